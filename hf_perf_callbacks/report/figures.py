"""The headline figures of a parsed run log, computed once for ``hf-perf report``'s summary, its plots and the
written analysis (``perf_report.md``), so that all of them print the same numbers as the meter's console summary and
its TensorBoard/W&B values. Pure: no torch, no transformers.

**The meter's figures, as it measured them.** The ThroughputMeter keeps running figures and writes them on every step
line as they stand after that step, and in its summary as they stand at the end; :func:`figures` takes the summary,
else (a killed run) the latest step line: the same numbers either way. Their definitions (training time = a
step's wall time without evaluation and saving, the meter's ``perf/train_sec``; all segments of a resumed run counted):

========================  ==================================================================================
figure                    definition
========================  ==================================================================================
``steady_steps``          the steps the meter counts as steady: those logged with ``perf/steady`` 1, and those
                          from a step line's ``perf/first_steady_step`` up to that line (warmup is decided a
                          few steps after it ended: the lines from the decision on name where it ended)
``steady_tokens_per_sec`` Σ tokens / Σ training seconds over the steady steps
``steady_step_sec``       Σ training seconds / number of steady steps: steady tokens/s × steady step time = the
                          mean tokens of a steady step
``warmup_done``           the latest ``train()`` call's warmup has been decided (False: not finished, the
                          warmup figures are None, and every reader says "not finished", never "no warmup")
``warmup_steps``          steps before the first steady step of the latest ``train()`` call
``warmup_end_step``       that first steady step
``call_first_step``       the latest ``train()`` call's first step (warmup and the first-step slowdown are that
                          call's: each ``train()`` call — a resume, a re-size, the tuner's switch — starts over)
``first_step_slowdown``   the first step's (GRPO: generation cycle's) training time / the steady step time, of the
                          latest ``train()`` call (its first step: ``call_first_step``)
``warmup_in_band``        every warmup cycle of the latest ``train()`` call took at most (1 + the meter's
                          ``warmup_tolerance``) × the steady step time × its steps: the speed settled, no warmup
                          cost (None: not decided, or no warmup steps)
``not_steady``            the steps outside the steady figures, as (first, last) ranges: warmup, and the steps of
                          earlier ``train()`` calls too short to decide it
``warmup_overhead_sec``   training seconds of the warmup cycles above the steady step time × their steps (CPU
                          device: the part their CPU seconds above the steady steps' mean explain), the meter's
                          :attr:`~hf_perf_callbacks.core.timeline.StepTimeline.warmup_overhead` (0 until decided)
``contention_sec``        CPU device: wall seconds of slow early steps whose CPU time stayed flat (other
                          processes), the meter's ``early_contention_sec``; ``contention_steps`` lists them (from
                          the summary; a killed run has the seconds only)
``mean_tokens_per_sec``   Σ tokens / Σ training seconds over all steps
========================  ==================================================================================

**Levels and slow stretches** (:func:`split_levels`, :func:`slow_stretches`: the throughput plot and the contention
rule read the same ones). A split's level is Σ tokens / Σ training seconds over the steady steps of one stretch of
consecutive steps at that split (``tuner/micro_batch`` × ``tuner/grad_accum``), drawn where it has at least
:data:`MIN_LEVEL_STEPS` steady steps: a tuned run with two splits has two levels, not one line between them. A slow
stretch is at least :data:`SLOW_MIN_STEPS` consecutive steady steps each below :data:`SLOW_SHARE` (70%) of its
split's median per-step rate (GRPO: per generation cycle; the median, so that a long stretch does not pull its own
reference down); its seconds lost are its training seconds minus those its tokens take at that median; its cause is
"contention" where its wall/CPU ratio stands :data:`STRETCH_RATIO` above the split's steps at speed, else
"unexplained" (its CPU time rose with it: not other processes).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import keys
from ..core.runlog import (
    PHASES,
    ActionDetails,
    CacheClear,
    EventKind,
    EventLine,
    LogRow,
    ReadStep,
    RunLog,
    StepLine,
    number,
    strict_number,
)
from ..core.stats import median, quantile, step_ranges

#: a step line as written (:class:`~hf_perf_callbacks.core.runlog.StepLine`) or as read back (``ReadStep``)
LogStep = StepLine | ReadStep
T = TypeVar("T")


def _cached(run: RunLog, name: str, compute: Callable[[RunLog], T]) -> T:
    """``compute(run)``, computed once per parsed run (kept in ``run.cache`` under ``name``)."""
    if name not in run.cache:
        run.cache[name] = compute(run)
    value: T = run.cache[name]
    return value


def last_value(steps: Sequence[LogStep], key: str) -> float | None:
    """The latest finite value of ``key`` in the step lines."""
    for s in reversed(steps):
        v = s.number(key)
        if v is not None:
            return v
    return None


def finite(values: Iterable[float]) -> list[float]:
    """The values that are numbers (a column's NaN left out)."""
    return [v for v in values if v == v]


def steady_steps(steps: Sequence[LogStep]) -> list[int]:
    """The steps the meter counts as steady (see the module docstring), in order: one pass over the lines."""
    upto: dict[int, int] = {}                       # first steady step → the latest line naming it
    for s in steps:
        first = s.number(keys.PERF_FIRST_STEADY_STEP)
        if first is not None and s.step >= first:
            upto[int(first)] = max(upto.get(int(first), s.step), s.step)
    spans: list[list[int]] = []                     # the ranges, merged where they touch
    for first, last in sorted(upto.items()):
        if spans and first <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    starts = [a for a, _ in spans]
    out = []
    for s in steps:
        at = bisect.bisect_right(starts, s.step) - 1
        if s.number(keys.PERF_STEADY) == 1 or (at >= 0 and s.step <= spans[at][1]):
            out.append(s.step)
    return out


def call_first_step(run: RunLog) -> int:
    """The latest ``train()`` call's first step — a fresh start, a resume or a re-size: the run headers the meter
    described (its segments: warmup is detected anew in each)."""
    steps = run.unique_steps()
    last = steps[-1].step if steps else 0
    starts = sorted({h.resumed_from_step for h in run.headers if "perf" in h.sources} or {0})
    return max([starts[0]] + [start for start in starts if start < last]) + 1


def trainer_logs(run_log: RunLog) -> list[LogRow]:
    """The trainer's own training logs: the step lines' ``log/<key>`` values, one mapping per logging step (keys
    without the prefix, plus ``step``). The one source of every count of logs the report prints (the summary's
    completion line, the analysis)."""
    prefix = keys.TRAINER_LOG
    return _cached(run_log, "trainer_logs",
                   lambda run: [LogRow(s, prefix) for s in run.unique_steps() if s.has_prefix(prefix)])


def run_events(run: RunLog) -> list[EventLine]:
    """Logged events plus watchdog summary actions missing from them (their event line was lost), by step."""
    events = list(run.events)
    seen = {(e.step, ActionDetails.from_details(e.details).action) for e in events if e.source == "mem"}
    for a in run.summary("mem").get("actions") or []:
        if isinstance(a, dict) and (a.get("step"), a.get("action")) not in seen:
            kind: EventKind = "stop" if a.get("action") == "stop" else "action"
            step = number(a.get("step"))
            events.append(EventLine("mem", kind, str(a.get("message", "")), int(step) if step is not None else None,
                                    details={k: v for k, v in a.items() if k not in ("step", "message")}))
    return sorted(events, key=lambda e: e.step if e.step is not None else -1)


@dataclass(frozen=True)
class Figures:
    """The headline figures of a run (see the module docstring), typed once here: every reader (the summary, the
    plots, the analysis) reads these attributes. None: not measured (or of another type in the log)."""

    steps: int
    call_first_step: int
    not_steady: list[tuple[int, int]]
    steady_steps: list[int]
    contention_steps: list[int]
    phases: dict[str, float]                 # fractions of the run's wall time, by phase
    device: str | None = None
    device_type: str | None = None
    world_size: int | None = None
    tokens: float | None = None
    warmup_done: bool | None = None
    warmup_steps: int | None = None
    warmup_end_step: int | None = None
    warmup_overhead_sec: float | None = None
    first_step_slowdown: float | None = None
    warmup_in_band: bool | None = None
    warmup_tolerance: float | None = None
    mfu_basis: str | None = None
    steady_tokens_per_sec: float | None = None
    steady_step_sec: float | None = None
    contention_sec: float | None = None
    mean_tokens_per_sec: float | None = None
    mfu: float | None = None
    high_water_gb: float | None = None
    budget_gb: float | None = None
    stopped_at: int | None = None
    cache_clears: int | None = None
    cache_freed_gb: float | None = None
    # a run too short for steady figures: the meter's provisional rate of the steps it had (first and last step)
    provisional_tokens_per_sec: float | None = None
    provisional_step_sec: float | None = None
    provisional_steps: list[int] | None = None


def figures(run: RunLog) -> Figures:
    """The headline numbers (see the module docstring): from the summaries when the run finished, else from the
    step lines. Computed once per parsed run (the summary, the plots and the analysis share them)."""
    return _cached(run, "figures", _figures)


def _int(value: object) -> int | None:
    v = number(value)
    return int(v) if v is not None else None


def _pick(summary: Mapping[str, Any], key: str, fallback: object) -> float | None:
    """A summary's number, else ``fallback``'s."""
    value = number(summary.get(key))
    return value if value is not None else number(fallback)


def _meter(perf: Mapping[str, Any], latest: Mapping[str, Any], summary_key: str, step_key: str) -> float | None:
    """The meter's figure: its summary's, else the latest step line's (a killed run)."""
    return number(perf.get(summary_key)) if perf else number(latest.get(step_key))


def _steady(run: RunLog) -> list[int]:
    return _cached(run, "steady_steps", lambda run: steady_steps(run.unique_steps()))


def _steady_values(run: RunLog, key: str) -> Iterator[float]:
    """The finite numbers under ``key`` on the steady lines — the steps the meter's final warmup decision counts
    steady (:func:`steady_steps`), not the lines' ``perf/steady`` flag written before it — (every line when none is
    steady), one at a time."""
    steady_set, numbers = set(_steady(run)), run.step_numbers()
    steady_at = [i for i, n in enumerate(numbers) if n in steady_set] or list(range(len(numbers)))
    column = run.column(key)
    return (v for v in (column[i] for i in steady_at) if v == v)


def _values(rows: Sequence[Any], key: str) -> list[float]:
    """The finite numbers under ``key`` in step lines or log dicts (other types skipped)."""
    return [v for v in (strict_number(r.get(key)) for r in rows) if v is not None]


def _median(values: list[float]) -> float | None:
    return median(values) if values else None


def _phases(run: RunLog, perf: Mapping[str, Any]) -> dict[str, float]:
    logged = perf.get("phases")
    if isinstance(logged, dict) and logged:
        return {str(k): float(v) for k, v in logged.items() if number(v) is not None}
    sums = {p: sum(finite(run.column(keys.PERF_PHASE_SEC[p]))) for p in PHASES}
    total = sum(sums.values())
    return {p: v / total for p, v in sums.items()} if total else {}


def _warmup(perf: Mapping[str, Any], latest: Mapping[str, Any]) -> dict[str, Any]:
    """The latest ``train()`` call's warmup figures (None while it is not decided)."""
    done = _meter(perf, latest, "warmup_done", keys.PERF_WARMUP_DONE)
    warmup_done = bool(done) if done is not None else None
    overhead = _meter(perf, latest, "warmup_overhead_sec", keys.PERF_WARMUP_OVERHEAD_SEC)  # 0 until decided
    first = _int(perf.get("first_steady_step") if perf else latest.get(keys.PERF_FIRST_STEADY_STEP))
    return {"warmup_done": warmup_done,
            "warmup_steps": _int(_meter(perf, latest, "warmup_steps", keys.PERF_WARMUP_STEPS)) if warmup_done
            else None,
            "warmup_end_step": first if warmup_done else None,
            "warmup_overhead_sec": overhead if overhead is not None or warmup_done is not False else 0.0,
            "first_step_slowdown": _meter(perf, latest, "first_step_slowdown", keys.PERF_FIRST_STEP_SLOWDOWN)
            if warmup_done else None}


def _memory_and_cache(run: RunLog) -> dict[str, Any]:
    """The watchdog's and the cache clearer's figures: their summaries', else the step lines' and events'."""
    steps, mem, cache = run.unique_steps(), run.summary("mem"), run.summary("cache")
    mem_header = run.header("mem")
    used = finite(run.column(keys.MEM_PEAK_GB)) + finite(run.column(keys.MEM_DEVICE_USED_GB))
    budget = mem_header.budget_gb if mem_header.budget_gb is not None else last_value(steps, keys.MEM_LIMIT_GB)
    stop = next((e.step for e in run.events if e.source == "mem" and e.kind == "stop"), None)
    cache_events = [e for e in run.events if e.source == "cache"]
    clears = last_value(steps, keys.CACHE_CLEARS) or len(cache_events) or None
    freed = sum(CacheClear.from_details(e.details).freed_gb or 0.0 for e in cache_events)   # per window
    return {"high_water_gb": _pick(mem, "high_water_gb", max(used) if used else None),
            "budget_gb": _pick(mem, "budget_gb", budget), "stopped_at": _int(_pick(mem, "stopped_at", stop)),
            "cache_clears": _int(_pick(cache, "clears", clears)), "cache_freed_gb": _pick(cache, "freed_gb", freed)}


def _figures(run: RunLog) -> Figures:
    steps = run.unique_steps()
    perf, header = run.summary("perf"), run.header("perf")
    last = next((s for s in reversed(steps) if keys.PERF_WARMUP_DONE in s.values), None)
    latest = last.values if last is not None else {}
    numbers = run.step_numbers()
    tokens = sum(finite(run.column(keys.PERF_TOKENS)))
    train = sum(finite(run.column(keys.PERF_TRAIN_SEC)))
    steady = _steady(run)
    steady_set = set(steady)
    step_sec = _meter(perf, latest, "steady_step_sec", keys.PERF_STEADY_STEP_TIME)
    first = call_first_step(run)
    device = perf.get("device") or header.device
    warmup = _warmup(perf, latest)
    return Figures(
        steps=_int(_pick(perf, "steps", steps[-1].step if steps else 0)) or 0,
        call_first_step=first,
        not_steady=step_ranges(n for n in numbers if n not in steady_set) if steady_set else [],
        steady_steps=steady,
        contention_steps=[int(v) for v in perf.get("contention_steps") or [] if number(v) is not None],
        phases=_phases(run, perf),
        device=str(device) if device else None, device_type=header.device_type,
        world_size=_int(_pick(perf, "world_size", header.world_size)),
        tokens=_pick(perf, "tokens", tokens or None),
        **warmup,
        warmup_in_band=_in_band(run, first, warmup["warmup_end_step"], step_sec, header.warmup_tolerance),
        warmup_tolerance=header.warmup_tolerance, mfu_basis=header.mfu_basis,
        steady_tokens_per_sec=_meter(perf, latest, "steady_tokens_per_sec", keys.PERF_STEADY_TOKENS_PER_SEC),
        steady_step_sec=step_sec,
        contention_sec=_meter(perf, latest, "early_contention_sec", keys.PERF_EARLY_CONTENTION_SEC),
        mean_tokens_per_sec=_pick(perf, "mean_tokens_per_sec", tokens / train if tokens and train else None),
        mfu=_pick(perf, "mfu", _median(list(_steady_values(run, keys.PERF_MFU)))),
        **_memory_and_cache(run),
        **_provisional(perf),
    )


def _in_band(run: RunLog, first: int, end: int | None, steady: float | None, tolerance: float | None) -> bool | None:
    """The ``warmup_in_band`` figure (see the module docstring) from the step lines: the latest call's warmup steps,
    ``first`` up to the first steady step ``end``, in cycles of the header's ``period``."""
    if end is None or steady is None or tolerance is None or end <= first:
        return None
    period = max(1, int(number(run.header("perf").period) or 1))
    train = dict(zip(run.step_numbers(), run.column(keys.PERF_TRAIN_SEC)))
    cycles = [range(a, min(a + period, end)) for a in range(first, end, period)]
    return all(sum(train.get(n, 0.0) for n in c) <= (1 + tolerance) * steady * len(c) for c in cycles)


def _provisional(perf: Mapping[str, Any]) -> dict[str, Any]:
    """The meter's provisional rate of a run too short for steady figures (its summary's ``provisional``)."""
    if not perf.get("provisional"):
        return {}
    steps = perf.get("provisional_steps")
    return {"provisional_tokens_per_sec": number(perf.get("provisional_tokens_per_sec")),
            "provisional_step_sec": number(perf.get("provisional_step_sec")),
            "provisional_steps": [int(v) for v in steps] if isinstance(steps, list) and len(steps) == 2
            and all(number(v) is not None for v in steps) else None}


#: the levels of a run and its slow stretches (:func:`split_levels`, :func:`slow_stretches`): a split's stretch of
#: steps needs this many steady steps for a level of its own (drawn, and judged for slow stretches)
MIN_LEVEL_STEPS = 3
SLOW_SHARE = 0.7          # a steady step (GRPO: cycle) below this share of its split's median rate is slow ...
SLOW_MIN_STEPS = 5        # ... and this many consecutive slow steady steps (at least) are a slow stretch
STRETCH_RATIO = 0.2       # a stretch's wall/CPU above its split's other steady steps' by this share: contention


@dataclass(frozen=True)
class SplitLevel:
    """A split's level (see the module docstring; a run whose lines name no split is one stretch): its first and
    last step, its steady steps, the level drawn and the median rate a slow stretch is judged against."""

    split: str | None            # "4×2"; None: the step lines name no split
    first: int
    last: int
    steady: list[int]
    tokens_per_sec: float
    median_tokens_per_sec: float


@dataclass(frozen=True)
class SlowStretch:
    """A slow stretch (see the module docstring), the steps the meter already counted as early contention left out;
    its ``cause`` is "unexplained" also where no CPU time is the work (a GPU)."""

    first: int
    last: int
    split: str | None
    share: float                 # the stretch's rate / the split's median rate
    seconds: float               # training seconds of the stretch
    lost_sec: float
    cause: str                   # "contention" | "unexplained"
    wall_over_cpu: float | None = None
    steady_wall_over_cpu: float | None = None


def split_column(run: RunLog) -> list[str | None]:
    """The split of each line of ``run.unique_steps()`` ("4×2"; None where the line names none)."""
    return [f"{micro:.0f}×{accum:.0f}" if micro == micro and accum == accum else None
            for micro, accum in zip(run.column(keys.TUNER_MICRO_BATCH), run.column(keys.TUNER_GRAD_ACCUM))]


def _segments(run: RunLog) -> list[tuple[str | None, list[int]]]:
    """Consecutive lines with the same split: (split, their indices)."""
    out: list[tuple[str | None, list[int]]] = []
    for i, split in enumerate(split_column(run)):
        if out and out[-1][0] == split:
            out[-1][1].append(i)
        else:
            out.append((split, [i]))
    return out


def _units(rows: list[int], period: int) -> list[list[int]]:
    """Rows in blocks of ``period`` (GRPO counts a cycle's tokens at its generation step: a rate needs whole
    cycles), consecutive rows only; a trailing part block is left out."""
    out: list[list[int]] = []
    block: list[int] = []
    for i in rows:
        if block and i != block[-1] + 1:
            block = []
        block.append(i)
        if len(block) == period:
            out.append(block)
            block = []
    return out


def split_levels(run: RunLog) -> list[SplitLevel]:
    """The steady level of each stretch of steps run at one split (see :class:`SplitLevel`), those with at least
    :data:`MIN_LEVEL_STEPS` steady steps, in step order. Computed once per parsed run."""
    return _cached(run, "split_levels", lambda run: [level for level, _ in _levels(run)])


def _levels(run: RunLog) -> list[tuple[SplitLevel, list[list[int]]]]:
    """Each :class:`SplitLevel` with its steady rows in units (steps; GRPO: cycles)."""
    numbers, tokens = run.step_numbers(), run.column(keys.PERF_TOKENS)
    train = run.column(keys.PERF_TRAIN_SEC)
    steady = set(_steady(run))
    period = max(1, int(number(run.header("perf").period) or 1))
    out = []
    for split, rows in _segments(run):
        rows = [i for i in rows if numbers[i] in steady and tokens[i] == tokens[i] and train[i] == train[i]]
        units = [u for u in _units(rows, period) if sum(train[i] for i in u) > 0]
        if len(rows) < MIN_LEVEL_STEPS or not units:
            continue
        seconds = sum(train[i] for u in units for i in u)
        rates = [sum(tokens[i] for i in u) / sum(train[i] for i in u) for u in units]
        out.append((SplitLevel(split, numbers[rows[0]], numbers[rows[-1]], [numbers[i] for u in units for i in u],
                               sum(tokens[i] for u in units for i in u) / seconds, median(rates)), units))
    return out


def slow_stretches(run: RunLog) -> list[SlowStretch]:
    """The run's slow stretches (see :class:`SlowStretch`), in step order: the same for the throughput plot and the
    analysis' contention rule. Computed once per parsed run."""
    return _cached(run, "slow_stretches", _stretches)


def _stretches(run: RunLog) -> list[SlowStretch]:
    numbers, tokens = run.step_numbers(), run.column(keys.PERF_TOKENS)
    train = run.column(keys.PERF_TRAIN_SEC)
    booked = {int(v) for v in run.summary("perf").get("contention_steps") or [] if number(v) is not None}
    ratios = _wall_over_cpu(run)
    out = []
    for level, units in _levels(run):
        slow: list[list[int]] = []          # runs of consecutive slow units
        for u in units:
            rate = sum(tokens[i] for i in u) / sum(train[i] for i in u)
            if rate < SLOW_SHARE * level.median_tokens_per_sec and not booked.intersection(numbers[i] for i in u):
                if slow and numbers[slow[-1][-1]] + 1 == numbers[u[0]]:
                    slow[-1].extend(u)
                else:
                    slow.append(list(u))
        below = {i for rows in slow for i in rows}
        rest = [r for u in units for i in u if i not in below and (r := ratios[i]) is not None]
        steady_ratio = median(rest) if rest else None           # the split's steady steps at its speed
        for rows in slow:
            if len(rows) < SLOW_MIN_STEPS:
                continue
            seconds = sum(train[i] for i in rows)
            at_level = sum(tokens[i] for i in rows) / level.median_tokens_per_sec
            mine = [r for i in rows if (r := ratios[i]) is not None]
            stretch_ratio = median(mine) if mine else None
            contended = (stretch_ratio is not None and steady_ratio is not None
                         and stretch_ratio >= steady_ratio * (1 + STRETCH_RATIO))
            out.append(SlowStretch(numbers[rows[0]], numbers[rows[-1]], level.split,
                                   at_level / seconds if seconds > 0 else 0.0, seconds, max(0.0, seconds - at_level),
                                   "contention" if contended else "unexplained", stretch_ratio, steady_ratio))
    return out


def timed_rows(run: RunLog) -> tuple[list[int], list[float], list[float]]:
    """The lines with both a wall and a CPU time and no checkpoint save (a save's disk time is wall time without
    CPU time, not other processes): (their indices, wall seconds, CPU seconds)."""
    col = run.column
    wall_col, cpu_col, save_col = col(keys.PERF_STEP_WALL_SEC), col(keys.PERF_CPU_SEC), col(keys.PERF_PHASE_SEC["save"])
    rows, walls, cpus = [], [], []
    for i, (w, c, saved) in enumerate(zip(wall_col, cpu_col, save_col)):
        if w == w and c == c and w > 0 and c > 0 and not saved > 0:
            rows.append(i)
            walls.append(w)
            cpus.append(c)
    return rows, walls, cpus


def _wall_over_cpu(run: RunLog) -> list[float | None]:
    """Each line's wall seconds / process CPU seconds (:func:`timed_rows`) on a CPU device; None elsewhere."""
    out: list[float | None] = [None] * len(run.step_numbers())
    if run.header("perf").device_type == "cpu":
        for i, w, c in zip(*timed_rows(run)):
            out[i] = w / c
    return out


def completion_stats(history: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """GRPO completion lengths over the run's training logs (:func:`trainer_logs`): mean of the logged mean lengths,
    the longest completion, the 90th percentile of the per-log longest, the mean clipped ratio and the number of logs.
    The report's summary line and the analysis both cite these (one clipped share in one report)."""
    means, maxes, clipped = (_values(history, k) for k in ("completions/mean_length", "completions/max_length",
                                                            "completions/clipped_ratio"))
    ended = [v for v in _values(history, "completions/mean_terminated_length")   # TRL: the finished completions'
             if v > 0]
    return {"mean": sum(means) / len(means) if means else None, "max": max(maxes, default=None),
            "terminated_mean": sum(ended) / len(ended) if ended else None,
            "p90": quantile(maxes, 0.9) if maxes else None,
            "clipped": sum(clipped) / len(clipped) if clipped else None, "logs": len(means)}


__all__ = [
    "Figures", "figures", "SplitLevel", "SlowStretch", "split_column", "split_levels", "slow_stretches",
    "completion_stats", "steady_steps", "timed_rows", "call_first_step", "trainer_logs",
    "run_events", "last_value", "finite"
]
