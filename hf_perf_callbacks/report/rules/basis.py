"""How a finding earns its number: ``measured`` (the run measured the alternative), ``calibrated`` (a model checked by
``benchmarks/bench_advice.py`` on this device type), ``too few steps`` (the run is shorter than the evidence needs),
``try`` (no number).
"""
from __future__ import annotations

from ..facts import Calibration, Evidence
from ..model import MIN_STEADY_STEPS, TOO_FEW_STEPS, Measurements

#: How close each model came to the measured gain when ``benchmarks/bench_advice.py`` applied its advice
#: (``benchmarks/results/advice_*.json``): (rule, device type) → (checks, worst |predicted / measured − 1|). A rule
#: prints its number only on a device type listed here within 25%: a gain checked on a CPU (process CPU time) says
#: nothing about a GPU's wall time. ``input_bound`` is absent on CPUs: 1/(1 − wait) predicted 2.30x where two workers
#: measured 1.67x on a loaded 2-core CPU (the workers' own collation competed for the cores); on an H100 it predicted
#: 4.99x against 4.13x measured.
CALIBRATION: dict[tuple[str, str], tuple[int, float]] = {
    ("duplicate_forward", "cpu"): (1, 0.06), ("duplicate_forward", "cuda"): (1, 0.13),
    ("input_bound", "cuda"): (1, 0.21), ("padding_waste", "cpu"): (2, 0.13),
    # the phase rules' measured gains (floors), checked too: two runs at a time, one per core, cores swapped, 4 pairs
    # at a load of 5.7-8.2 on 2 cores, the intervals' last events counted: evaluation 2.90x printed / 3.43x applied
    # (3.52x / 3.54x alone; 4.93x / 6.00x with a slow compute_metrics), callbacks 2.87x / 3.11x, saving 1.63x / 1.64x
    # (1.17x / 1.15x beside a costly callback); recompute 1.21x / 1.39x (6 pairs at 2.6-2.9)
    ("evaluation", "cpu"): (3, 0.18), ("callbacks", "cpu"): (1, 0.08), ("saving", "cpu"): (2, 0.03),
    ("recompute", "cpu"): (1, 0.13)}


def _calibrated(rule: str, m: Measurements, predicted: float) -> tuple[float | None, str, str, Calibration]:
    """(expected_gain, basis, confidence, how far it is checked) for a model prediction: printed only when
    CALIBRATION holds the rule's check against runs with the advice applied on this device type (within 25%), and
    when the run has the steps to judge it (:func:`_too_short`)."""
    runs, error = CALIBRATION.get((rule, m.device_type), (0, 1.0))
    checked = Calibration(m.device_type, runs, error, tuple(sorted(d for r, d in CALIBRATION if r == rule)))
    if not runs or error > 0.25:
        return None, "try", "low", checked
    short = _too_short(m)
    if short is not None:
        return None, TOO_FEW_STEPS, "low", Calibration(m.device_type, runs, error, checked.elsewhere, short)
    return predicted, "calibrated", "high" if error <= 0.1 and runs >= 3 else "medium", checked


def _too_short(m: Measurements) -> Evidence | None:
    """The run's evidence where its timings cannot be judged (None: they can): the timing rules and every gain need
    warmup over and :data:`MIN_STEADY_STEPS` steps measured after it."""
    if m.warmup_done and m.steady_steps >= MIN_STEADY_STEPS:
        return None
    return Evidence(m.warmup_done, m.steps, m.steady_steps,
                    (m.warmup_steps or 0) + MIN_STEADY_STEPS if m.warmup_done else None, m.grpo)
