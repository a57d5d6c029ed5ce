"""How a finding earns its number: ``measured`` (the run measured the alternative), ``calibrated`` (a model checked by
``benchmarks/bench_advice.py`` on this device type), ``too few steps`` (the run is shorter than the evidence needs),
``try`` (no number).
"""
from __future__ import annotations

import math

from ..model import TOO_FEW_STEPS, Measurements
from ..words import too_short_words

#: How close each model came to the measured gain when ``benchmarks/bench_advice.py`` applied its advice
#: (``benchmarks/results/advice_*.json``): (rule, device type) → (checks, worst |predicted / measured − 1|). A rule
#: prints its number only on a device type listed here within 25%: a gain checked on a CPU (process CPU time) says
#: nothing about a GPU's wall time. ``input_bound`` is absent on CPUs: 1/(1 − wait) predicted 2.30x where two workers
#: measured 1.67x on a loaded 2-core CPU (the workers' own collation competed for the cores); on an H100 it predicted
#: 4.99x against 4.13x measured.
CALIBRATION: dict[tuple[str, str], tuple[int, float]] = {
    ("duplicate_forward", "cpu"): (1, 0.06), ("duplicate_forward", "cuda"): (1, 0.13),
    ("input_bound", "cuda"): (1, 0.21), ("padding_waste", "cpu"): (2, 0.13),
    # the phase rules' measured gains (floors), checked too: two runs at a time, one per core, cores swapped, 6 pairs
    # at a load of 2.6-4.2 on 2 cores: evaluation 2.95x printed / 3.46x applied (and 3.52x / 3.54x alone), callbacks
    # 3.01x / 3.52x, saving 1.75x / 2.20x, recompute 1.21x / 1.39x
    ("evaluation", "cpu"): (3, 0.18), ("callbacks", "cpu"): (1, 0.15), ("saving", "cpu"): (2, 0.21),
    ("recompute", "cpu"): (1, 0.13)}


def _calibrated(rule: str, m: Measurements, predicted: float, formula: str) -> tuple[float | None, str, str, str]:
    """(expected_gain, basis, confidence, formula) for a model prediction: printed only when CALIBRATION holds the
    rule's check against runs with the advice applied on this device type, and when the run has the steps to
    judge it (:func:`_too_short`)."""
    device_type = m.device_type
    runs, error = CALIBRATION.get((rule, device_type), (0, math.inf))
    if not runs or error > 0.25:
        checked = sorted(d for r, d in CALIBRATION if r == rule)
        where = (f"calibrated on {', '.join(checked)} only, not on {device_type}" if checked and not runs
                 else "not calibrated against runs with the advice applied")
        return None, "try", "low", f"not printed: this model ({formula}) is {where}"
    confidence = "high" if error <= 0.1 and runs >= 3 else "medium"
    return _judged(m, predicted, "calibrated", confidence,
                   f"{formula}; calibrated on {device_type}: on {runs} run(s) with the advice applied the measured "
                   f"gain was within {error:.0%} of this model's")


def _too_short(m: Measurements) -> str | None:
    """Why this run's timings cannot be judged (None: they can): the timing rules and every gain need warmup over
    and :data:`MIN_STEADY_STEPS` steps measured after it."""
    return too_short_words(m.warmup_done, m.steps, m.steady_steps)


def _judged(m: Measurements, gain: float | None, basis: str, confidence: str,
            formula: str) -> tuple[float | None, str, str, str]:
    """A gain as the run's evidence allows it: without warmup over and enough steady steps, "too few steps"."""
    why = _too_short(m)
    if why is None or gain is None:
        return gain, basis, confidence, formula
    return None, TOO_FEW_STEPS, "low", f"too few steps to judge the gain ({why}); the model: {formula}"
