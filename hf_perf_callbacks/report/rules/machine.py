"""The CPU's rules: thread oversubscription over the whole run, and steps slowed by other processes.
"""
from __future__ import annotations

from ...core.stats import step_ranges
from ..facts import OtherProcesses, Oversubscription, Recompiles, SlowStretches
from ..figures import (
    SLOW_MIN_STEPS,
    SLOW_SHARE,
    STRETCH_RATIO,
)
from ..model import (
    CONTENTION_RATIO,
    CONTENTION_SHARE,
    MIN_MACHINE_STEPS,
    RECOMPILE_SLOWDOWN,
    Finding,
    Measurements,
    Note,
    card,
)
from ..words import finding, note
from .advice import _saved
from .basis import _too_short

COMPILE_SHARE = 0.05         # recompiles after warmup worth a finding: this share of the wall time
OVERSUBSCRIBED = 0.5         # threads + other processes' busy cores above the cores by this much: oversubscribed
THREADS_IDLE = 0.5           # threads of this process not running (threads − CPU time / wall) worth a finding
STEP_SPREAD = 1.5            # similar work whose wall (or CPU) seconds per token differ this much between steps


def oversubscribed(threads: float, other: float, cores: float) -> bool:
    """Torch's threads plus the other processes' busy cores exceed the cores by :data:`OVERSUBSCRIBED` (the demand
    half of :func:`rule_oversubscription`; ``hf-perf demo`` applies it before its run)."""
    return threads + other >= cores + OVERSUBSCRIBED


def free_cores(cores: float, other: float) -> int:
    """The thread count :func:`rule_oversubscription` advises: the cores the other processes leave free, at least 1."""
    return max(1, int(cores - other + 0.25))


@card(finding="CPU, the whole run: torch threads + other processes' busy cores above the cores, threads idle, "
              f"similar work ≥ {STEP_SPREAD:g}x apart → `OMP_NUM_THREADS` = the free cores (measured on the run's "
              "CPU time and load)",
      gain="measured: at least the run's mean over its fastest steps")
def rule_oversubscription(m: Measurements) -> Finding | None:
    """Whole-run thread oversubscription on a CPU (:func:`_machine`'s figures): over ≥ :data:`MIN_MACHINE_STEPS`
    steps, this process's threads plus the other processes' busy cores exceed the cores by :data:`OVERSUBSCRIBED`,
    at least :data:`THREADS_IDLE` of its threads were not running (CPU time / wall time below the thread count),
    and time was lost: similar work took ≥ :data:`STEP_SPREAD` times longer (wall or CPU seconds per token) on some
    steps than on others.
    With the thread count assumed (the run header does not record it), the CPU time per token must vary as much
    (threads spinning while a partner waits for a core), so that a run already at one thread is not advised one.
    The advice: as many threads as the cores the others leave free, at least 1; none when that is not below the
    run's."""
    o = m.machine
    if not o or o.steps < MIN_MACHINE_STEPS or not o.cores or not o.threads or o.threads < 2:
        return None
    spread, cpu_spread = o.spread or 0.0, o.cpu_spread or 0.0
    if not oversubscribed(o.threads, o.other, o.cores) or o.threads - o.busy < THREADS_IDLE \
            or max(spread, cpu_spread) < STEP_SPREAD:
        return None
    if o.threads_from != "run header" and cpu_spread < STEP_SPREAD:
        return None
    a = free_cores(o.cores, o.other)
    if a >= o.threads:
        return None
    return finding("oversubscription", "threads_over_free_cores",
                   Oversubscription(o, o.threads + o.other, a, bool(m.launcher)),
                   {}, o.lower_bound or None, "medium" if o.threads_from == "run header" else "low",
                   "measured" if o.lower_bound else "try", None, env={"OMP_NUM_THREADS": str(a)},
                   lower_bound=bool(o.lower_bound), stake_sec=_saved(m, o.lower_bound))


@card(finding="steps slower while their process CPU time stayed flat, each step's own wall/CPU ratio ≥ "
              f"{1 + CONTENTION_RATIO:g}× the steady steps' (the steps named); a slow stretch (≥ {SLOW_MIN_STEPS} "
              f"consecutive steady steps below {SLOW_SHARE:.0%} of their split's median speed) whose wall/CPU stands "
              f"{STRETCH_RATIO:.0%} above its split's → other processes, `OMP_NUM_THREADS`",
      gain="measured: the time lost",
      note="a slow stretch whose CPU time rose with it: unexplained, not blamed on other processes (nor on warmup)")
def rule_contention(m: Measurements) -> Finding | Note | None:
    if _too_short(m):
        return None
    c = m.contention
    # a stretch among the steps the step lines already found contended is counted there (a log without the meter's
    # own figure): its seconds once
    counted = set(c.step_list) if c and c.source != "meter" else set()
    contended = [s for s in m.slow_stretches if s.cause == "contention"
                 and not counted.intersection(range(s.first, s.last + 1))]
    unexplained = [s for s in m.slow_stretches if s.cause == "unexplained"]
    run_sec = c.run_sec if c else (m.wall_sec or 0.0)
    lost = (c.lost_sec if c else 0.0) + sum(s.lost_sec for s in contended)
    share = lost / run_sec if run_sec > 0 else 0.0
    steps = (step_ranges(c.step_list) if c else []) + [(s.first, s.last) for s in contended]
    if share < CONTENTION_SHARE or not (c or contended):
        if not m.slow_stretches:
            return None
        stretches = contended + unexplained
        return note("contention", "contention_below_share" if contended else "unexplained_stretches",
                    SlowStretches(tuple(contended), tuple(unexplained), lost, share), judged=False,
                    steps=[(s.first, s.last) for s in stretches], lost_sec=sum(s.lost_sec for s in stretches))
    gain = 1.0 / (1.0 - share)
    return finding("contention", "other_processes",
                   OtherProcesses(c, tuple(contended), tuple(unexplained), lost, share, run_sec, gain),
                   {}, gain, "medium", "measured", gain, steps=steps, lost_sec=lost, stake_sec=lost)


@card(finding=f"`torch_compile`: steady steps ≥ {1 + RECOMPILE_SLOWDOWN:g}× the steady step time with the CPU time "
              f"(child processes included: inductor's workers) rising with them, ≥ {COMPILE_SHARE:.0%} of the wall "
              "time → recompiles: fewer shapes (`pad_to_multiple_of`, `dataloader_drop_last`), `TORCH_LOGS` to name "
              "the guard",
      gain="no: the run measures its recompiles, not a run without them",
      note="recompiles below that share; the first compile is the warmup note's")
def rule_compile(m: Measurements) -> Finding | Note | None:
    """Recompiles after warmup: a compile called what it is, not contention and not warmup."""
    if not m.recompiles:
        return None
    lost = sum(r.excess_sec for r in m.recompiles)
    wall = float(m.wall_sec or 0.0)
    share = lost / wall if wall > 0 else 0.0
    steps = step_ranges(r.step for r in m.recompiles)
    facts = Recompiles(tuple(m.recompiles), lost, share)
    if share < COMPILE_SHARE:
        return note("compile", "recompiles_small", facts, steps=steps, lost_sec=lost)
    return finding("compile", "recompiles", facts, {}, None, "medium", "try", None, steps=steps, lost_sec=lost,
                   stake_sec=lost)
