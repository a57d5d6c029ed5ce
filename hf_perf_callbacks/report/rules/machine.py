"""The CPU's rules: thread oversubscription over the whole run, and steps slowed by other processes.
"""
from __future__ import annotations

from ..figures import (
    SLOW_MIN_STEPS,
    SLOW_SHARE,
    STRETCH_RATIO,
    SlowStretch,
    ranges_text,
    step_ranges,
)
from ..model import CONTENTION_RATIO, CONTENTION_SHARE, MIN_MACHINE_STEPS, Finding, Machine, Measurements, Note, card
from .advice import _bullets, _launcher, _pct
from .basis import _too_short

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


def _oversubscription(m: Measurements) -> tuple[Machine, float, int] | None:
    """Whole-run thread oversubscription on a CPU (:func:`_machine`'s figures): over ≥ :data:`MIN_MACHINE_STEPS`
    steps, this process's threads plus the other processes' busy cores exceed the cores by :data:`OVERSUBSCRIBED`,
    at least :data:`THREADS_IDLE` of its threads were not running (CPU time / wall time below the thread count),
    and time was lost: similar work took ≥ :data:`STEP_SPREAD` times longer (wall or CPU seconds per token) on some
    steps than on others.
    With the thread count assumed (the run header does not record it), the CPU time per token must vary as much
    (threads spinning while a partner waits for a core), so that a run already at one thread is not advised one.
    Returns the machine's figures, the demand (threads + other busy cores) and the advised thread count (the cores
    the others leave free, at least 1); None when it is not below the run's."""
    c = m.machine
    if not c or c.steps < MIN_MACHINE_STEPS or not c.cores or not c.threads or c.threads < 2:
        return None
    demand, idle = c.threads + c.other, c.threads - c.busy
    spread, cpu_spread = c.spread or 0.0, c.cpu_spread or 0.0
    if not oversubscribed(c.threads, c.other, c.cores) or idle < THREADS_IDLE \
            or max(spread, cpu_spread) < STEP_SPREAD:
        return None
    if c.threads_from != "run header" and cpu_spread < STEP_SPREAD:
        return None
    advised = free_cores(c.cores, c.other)
    return (c, demand, advised) if advised < c.threads else None


def _threads_item(m: Measurements, n: int) -> str:
    if _launcher(m):
        return (f"`OMP_NUM_THREADS={n}` in the environment that starts the run: `OMP_NUM_THREADS={n} hf-perf train "
                f"--config …` (a recipe's `env:` is applied after torch has started its threads)")
    return (f"`OMP_NUM_THREADS={n}` in the environment that starts the run, or `torch.set_num_threads({n})` "
            f"before training")


@card(finding="CPU, the whole run: torch threads + other processes' busy cores above the cores, threads idle, "
              f"similar work ≥ {STEP_SPREAD:g}x apart → `OMP_NUM_THREADS` = the free cores (measured on the run's "
              "CPU time and load)",
      gain="measured: at least the run's mean over its fastest steps")
def rule_oversubscription(m: Measurements) -> Finding | None:
    found = _oversubscription(m)
    if not found:
        return None
    o, demand, a = found
    t = o.threads
    obs = (f"Over the whole run ({o.steps} steps) this process kept {o.busy:.2f} of its {t} threads running "
           f"(process CPU time / wall time) while other processes kept {o.other:.1f} of the {o.cores} cores "
           f"busy" + (f" (load {o.load:.1f} per core)" if o.load is not None else "")
           + f": {t} threads and {o.other:.1f} cores of other work asked for {demand:.1f} cores of "
           f"{o.cores}; steps of similar work took {o.spread:.1f}x apart in wall time per token and "
           f"{o.cpu_spread:.1f}x in CPU time per token.")
    assumed = [where for where in (o.cores_from, o.threads_from) if where != "run header"]
    if assumed:
        obs += " The run header does not record them: " + "; ".join(assumed) + "."
    root = (f"Thread oversubscription: torch splits each operation over {t} threads and waits at its end for all of "
            "them. While another process holds a core, one thread waits for it and its partner spins at the barrier, "
            "so CPU time rises with the wall time (why the slow-step check, which looks for slow steps with flat CPU "
            "time, cannot see it, and why it is not warmup: it recurs all run). With no more threads than free cores "
            "no thread waits for a core.")
    items = [_threads_item(m, a) + f" ({o.cores} cores − {o.other:.1f} busy with other work, at least 1)",
             "or stop or move the other processes using these cores (a second training, a test suite, a build)"]
    gain, formula = None, "not predicted: the run has no step without contention to compare with"
    if o.lower_bound:
        gain = o.lower_bound
        formula = (f"at least {gain:.2f}x: the run's mean wall seconds per token over its fastest steps' (10th "
                   f"percentile) — those steps were contended too, and fewer threads also stop the spinning")
    return Finding("oversubscription", "Thread oversubscription: more threads than free cores", obs, root,
                   _bullets(items), gain, formula, "medium" if o.threads_from == "run header" else "low", {},
                   "measured" if gain else "try", None, env={"OMP_NUM_THREADS": str(a)}, lower_bound=bool(gain),
                   reason="threads_over_free_cores",
                   facts={"steps": o.steps, "busy": o.busy, "threads": t, "threads_from": o.threads_from,
                          "other": o.other, "cores": o.cores, "cores_from": o.cores_from, "load": o.load,
                          "demand": demand, "advised_threads": a, "spread": o.spread, "cpu_spread": o.cpu_spread,
                          "launcher": _launcher(m)})


def _stretches_words(stretches: list[SlowStretch]) -> str:
    """``steps 60–179 at 43% of the 2×4 split's speed, wall/CPU 1.90 against 1.02 (136.2 s lost)``, each stretch
    with its own figures."""
    return "; ".join(f"steps {s.first}–{s.last} at {s.share:.0%} of the {s.split + ' ' if s.split else ''}split's "
                     f"speed" + (f", wall/CPU {s.wall_over_cpu:.2f} against {s.steady_wall_over_cpu:.2f}"
                                 if s.wall_over_cpu is not None and s.steady_wall_over_cpu is not None else "")
                     + f" ({s.lost_sec:.1f} s lost)" for s in stretches)


def _unexplained_words(stretches: list[SlowStretch]) -> str:
    why = ("the process's CPU time rose with the wall time (wall/CPU against the split's other steady steps), so "
           "other processes do not explain it" if any(s.wall_over_cpu is not None for s in stretches) else
           "no CPU time on this device tells other processes from the run's own work")
    return (f"{len(stretches)} stretch(es) of steady steps ran well below their split's speed ("
            f"{_stretches_words(stretches)}) and {why}; the log does not say what slowed them (longer sequences, "
            "the data, the machine's clock or memory)")


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
        text = ""
        if contended:
            text = (f"Other processes slowed {len(contended)} stretch(es) of steady steps ("
                    f"{_stretches_words(contended)}): {lost:.1f} s, {_pct(share)} of the run, below the "
                    f"{CONTENTION_SHARE:.0%} that makes a finding. ")
        if unexplained:
            text += _unexplained_words(unexplained) + "."
        stretches = contended + unexplained
        return Note("contention", "Slow stretches" + (", cause unexplained" if not contended else ""), text.strip(),
                    judged=False, steps=[(s.first, s.last) for s in stretches],
                    lost_sec=sum(s.lost_sec for s in stretches),
                    reason="contention_below_share" if contended else "unexplained_stretches",
                    facts={"contended_stretches": len(contended), "unexplained_stretches": len(unexplained),
                           "lost_sec": lost, "share": share})
    parts = []
    if c:
        parts.append(f"{c.steps} step(s) ({ranges_text(step_ranges(c.step_list))}) ran slower than the steady level "
                     f"while their process CPU time did not rise with them (wall/CPU {c.wall_over_cpu:.2f} against "
                     f"{c.steady_wall_over_cpu:.2f} when steady): {c.lost_sec:.1f} s"
                     + (", the meter's `early_contention_sec`" if c.source == "meter" else ""))
    if contended:
        parts.append(f"{len(contended)} stretch(es) of steady steps ran well below their split's speed with their "
                     f"CPU time flat ({_stretches_words(contended)})")
    obs = "; ".join(parts) + f": {lost:.1f} s ({_pct(share)} of the run) went to waiting for a CPU"
    if c and c.other_cores is not None:
        obs += f"; other processes kept up to {c.other_cores:.1f} CPU cores busy during those steps"
    obs += "."
    if unexplained:
        obs += " Besides, " + _unexplained_words(unexplained) + "."
    root = ("Other processes (or too many threads of this one) shared the CPU cores: the training process was "
            "runnable but not running. This is not warmup — warmup costs CPU time (allocation, compilation) and "
            "does not recur.")
    items = ["stop or move the other processes using these cores (a second training, a test suite, a build)",
             "or leave them the cores they need: `OMP_NUM_THREADS` / `torch.set_num_threads` at most the cores "
             "the other processes leave free (threads beyond them wait for each other)"]
    gain = 1.0 / (1.0 - share)
    formula = (f"the measured time lost: 1/(1 − {lost:.1f} s / {run_sec:.1f} s) = {gain:.2f}x (those steps at "
               f"the steady level)")
    return Finding("contention", "CPU contention: other processes slowed the run", obs, root, _bullets(items), gain,
                   formula, "medium", {}, "measured", gain, steps=steps, lost_sec=lost, reason="other_processes",
                   facts={"lost_sec": lost, "share": share, "run_sec": run_sec, "source": c.source if c else None,
                          "contended_steps": c.steps if c else 0, "wall_over_cpu": c.wall_over_cpu if c else None,
                          "steady_wall_over_cpu": c.steady_wall_over_cpu if c else None,
                          "other_cores": c.other_cores if c else None, "contended_stretches": len(contended),
                          "unexplained_stretches": len(unexplained)})
