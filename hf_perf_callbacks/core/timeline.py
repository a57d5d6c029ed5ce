"""Pure accounting of optimizer-step boundaries: step times, phases, tokens, warmup and steady throughput.

The caller feeds timestamps (seconds, any monotonic clock) at the trainer's events; nothing here reads a clock,
so every number is exact under test. Each optimizer step's record covers the wall time since the previous step
ended, split into phases:

==================  ======================================================================================
phase               time
==================  ======================================================================================
``data_wait``       inside the trainer's fetch of the step's batches (``get_batch_samples``: the whole
                    accumulation window, fetched before ``on_step_begin``), clocked
``generation``      GRPO rollouts: inside TRL's ``_generate`` (HF ``generate``, vLLM server or colocate, weight
                    syncs to vLLM included; async GRPO: its weight transfers), else inside ``model.generate``;
                    clocked (a region) or, from a caller without clocks, carved out of ``compute``
``rollout_wait``    GRPO: a rank waiting for rollouts made elsewhere: in a collective of the rollout for another
                    rank's weight sync or generation; async GRPO: the step's wait for the rollout queue (TRL's own
                    figure, moved out of ``data_wait`` with :meth:`StepTimeline.reassign`)
``reward``          GRPO: inside TRL's reward functions (``_calculate_rewards``), out of the step's compute
``compute``         the rest of the step, from ``on_step_begin`` to ``on_step_end``: forward, backward,
                    optimizer (and the meter's one synchronize)
``recompute``       forwards the gradient checkpointing runs again during the backward (CPU: each part of a
                    checkpointed layer run again, timed as its first forward in the micro-batch was;
                    elsewhere left in ``compute``)
``eval``            inside the trainer's ``evaluate`` (its callbacks and its log excepted)
``save``            inside the trainer's checkpoint save (its callbacks excepted)
``log``             inside the trainer's ``log`` and the events of transformers', TRL's and the reporters' own
                    callbacks (progress bar, flow, TensorBoard…)
``own_callbacks``   the events of this package's callbacks (memory sampling, cache clears, the meter)
``user_callbacks``  the events of every other callback (the user's)
``unexplained``     time outside a step that no clock above measured (never given to a phase)
==================  ======================================================================================

The clocks are regions (:meth:`StepTimeline.enter`, :meth:`StepTimeline.leave`) counted exclusively: a region's
time excludes the regions opened inside it (a callback's ``on_log`` inside ``log`` is the callback's, a log inside
``evaluate`` is ``log``). Every figure of a step covers one interval, from the previous step's end to this step's end,
so the time after a step (its log, evaluation, save, the callbacks' ``on_step_end``) is on the next step's line and
the time after the last step is the run's *tail* (:meth:`StepTimeline.tail`, the meter's summary). The phases sum to
the wall time. A caller without clocks (``mark``, ``step_begin``'s ``overhead``) gets the older split: ``mark``
books the time since the last event as eval or save.

Training time of a step excludes eval and save. Warmup is detected on cycles of ``period`` steps (GRPO generates every
``period`` optimizer steps; 1 otherwise), on the **work** of a cycle: its wall time (``work="wall"``), or on a CPU
device the process's CPU time (``work="cpu"``, :func:`time.process_time`, all threads): there the CPU time is the work,
and a step that took longer with the same CPU time was slowed by other processes, not by warmup. CPU mode reports wall
figures all the same; of the early cycles' excess wall time, the part no extra CPU time explains is contention
(:meth:`StepTimeline._early_split`). The CPU time counts the process's child processes too (the caller adds them), so a
compile in the first steps is warmup, not contention. On a GPU the host's CPU time is launch and wait time, not the
work, so the detector stays on wall time there. Each
``train()`` call (a resume included) starts a new segment with its own warmup; steady totals, the warmup overhead and
the contention accumulate over segments (a fresh run starts a new timeline).

The figures, one definition each (all in training time, eval and save excluded):

=========================  ===============================================================================
figure                     definition
=========================  ===============================================================================
steady steps               the steps of the cycles from the warmup decision's first steady cycle on
                           (:attr:`StepTimeline.first_steady_step`); the cycles before it are warmup
steady tokens/s            Σ tokens / Σ training seconds over the steady steps
steady step time           Σ training seconds / number of steady steps (so steady tokens/s × steady step
                           time = the mean tokens of a steady step)
first-step slowdown        the first cycle's training seconds / (steady step time × ``period``)
warmup overhead            Σ over the warmup cycles of every segment of their training seconds above the
                           steady step time × ``period`` (positive parts), the cycles holding a contention step
                           left out: recomputable from the perf log's step lines and summary
early contention           CPU mode: the excess wall time of the cycles up to the decision that no extra CPU
                           time explains (other processes); :attr:`StepTimeline.contention_steps` are the steps
                           of the cycles where it is the larger part
=========================  ===============================================================================
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import keys
from ..keys import CLOCKED_PHASES
from .runlog import PHASES
from .stats import SlowStart, WarmupDetector, WindowedRate, classify_slow_steps, median
from .validation import check_number


@dataclass
class StepRecord:
    """One optimizer step (seconds unless named otherwise)."""

    step: int
    wall: float          # since the previous step ended, everything included
    train: float         # wall minus eval and save: what throughput is measured against
    data_wait: float
    generation: float
    compute: float
    eval: float
    save: float
    tokens: float = 0.0
    rollout_wait: float = 0.0
    reward: float = 0.0
    steady: bool = False
    cpu: float | None = None   # process CPU seconds since the previous step ended (all threads), when measured
    log: float = 0.0
    own_callbacks: float = 0.0
    user_callbacks: float = 0.0
    recompute: float = 0.0
    unexplained: float = 0.0

    @property
    def train_cpu(self) -> float | None:
        """CPU seconds of the training part (the step's CPU time × its training share of the wall time)."""
        if self.cpu is None:
            return None
        return self.cpu * (self.train / self.wall) if self.wall > 0 else 0.0


class StepTimeline:
    """Step accounting for a :class:`~hf_perf_callbacks.ThroughputMeter` (no clock, no torch)."""

    def __init__(self, window_steps: int = 10, warmup_window: int = 4, warmup_tolerance: float = 0.1,
                 max_warmup_steps: int = 50):
        self.window_steps = check_number("window_steps", window_steps, low=1, integer=True)
        self.warmup_window = check_number("warmup_window", warmup_window, low=2, integer=True)
        self.warmup_tolerance = check_number("warmup_tolerance", warmup_tolerance, low=0, high=1, low_open=True)
        self.max_warmup_steps = check_number("max_warmup_steps", max_warmup_steps, low=0, integer=True)
        # cumulative over segments (exported for resume)
        self.steady_tokens = 0.0
        self.steady_seconds = 0.0
        #: (steps, training seconds, training CPU seconds or None) of every segment's warmup cycles
        self.warmup_cycles: list[tuple[list[int], float, float | None]] = []
        self.steady_cpu_seconds = 0.0   # Σ training CPU seconds of the steady steps that have a CPU reading ...
        self.steady_cpu_steps = 0       # ... and how many they are
        self.total_tokens = 0.0
        self.total_train_seconds = 0.0
        self.phase_totals = dict.fromkeys(PHASES, 0.0)
        self.past_contention = 0.0      # early contention of earlier segments (see early_contention)
        self.past_contention_steps: list[int] = []
        self.steady_steps = 0
        self.steps = 0
        self.segments = 0
        self.start_segment(0.0)
        self.segments = 0

    # ------------------------------------------------------------ segments
    def start_segment(self, t: float, period: int = 1, cpu: float | None = None, work: str = "wall") -> None:
        """A ``train()`` begins (fresh or resumed) at time ``t`` (``cpu``: the process CPU clock then; ``work``:
        what warmup is detected on, ``"wall"`` or ``"cpu"``)."""
        self.period = check_number("period", period, low=1, integer=True)
        if work not in ("wall", "cpu"):
            raise ValueError(f"work={work!r} is not allowed: expected 'wall' or 'cpu'")
        if hasattr(self, "segment_cycles"):
            self.past_contention += self._segment_contention()
            self.past_contention_steps += self._segment_contention_steps()
        self.work = work if cpu is not None else "wall"
        self.prev_cpu = cpu
        # (wall, CPU, steps) of this segment's cycles (CPU mode)
        self.segment_cycles: list[tuple[float, float, tuple[int, ...]]] = []
        self.first_cycle_seconds: float | None = None   # training seconds of this segment's first cycle
        self.first_steady_step: int | None = None       # this segment's first steady step, once decided
        self.decided_at: int | None = None   # cycles seen when warmup was decided on CPU time (else None)
        self._split: tuple[int, SlowStart] | None = None   # the early split, keyed by len(segment_cycles)
        self.segments += 1
        self.segment_warmup = len(self.warmup_cycles)   # where this segment's warmup cycles begin
        self.detector = WarmupDetector(max(2, -(-self.warmup_window // period)), self.warmup_tolerance,
                                       -(-self.max_warmup_steps // period))
        self.rate = WindowedRate(self.window_steps, period)
        self.train_rate = WindowedRate(self.window_steps, period)   # tokens per second outside generation
        self.cpu_rate = WindowedRate(self.window_steps, period)     # tokens per training CPU second (CPU mode)
        self.last_mark = self.prev_end = t
        self.regions: list[str] = []          # clocked regions open now, innermost last
        self.step_begin_at: float | None = None
        self.step_phases = dict.fromkeys(PHASES, 0.0)        # seconds per phase of the step in progress
        self.unclocked_generation = 0.0       # add_generation's seconds of the step: carved out of compute
        self.cycle: list[StepRecord] = []
        self.unsettled: list[list[StepRecord]] = []   # cycles seen before warmup was decided
        self.window_phases = dict.fromkeys(PHASES, 0.0)

    @property
    def warmup_done(self) -> bool:
        return self.detector.done

    @property
    def warmup_steps(self) -> int | None:
        warmup = self.detector.warmup_samples
        return warmup * self.period if warmup is not None else None

    @property
    def first_step_slowdown(self) -> float | None:
        """This segment's first cycle's training seconds / (steady step time × period): wall time in CPU mode too."""
        steady = self.steady_step_seconds
        if not self.detector.done or steady is None or self.first_cycle_seconds is None:
            return None
        return self.first_cycle_seconds / (steady * self.period) if steady > 0 else float("nan")

    @property
    def steady_step_seconds(self) -> float | None:
        """Mean training seconds of the steady steps, all segments (see the module docstring)."""
        return self.steady_seconds / self.steady_steps if self.steady_steps else None

    # ------------------------------------------------------------ events
    def _charge(self, t: float, phase: str | None = None) -> None:
        """The time since the last event goes to ``phase`` when given, else to the innermost open region, else to
        ``compute`` inside a step and ``unexplained`` outside one."""
        if phase is None:
            phase = self.regions[-1] if self.regions else "compute" if self.step_begin_at is not None else "unexplained"
        self.step_phases[phase] += max(0.0, t - self.last_mark)
        self.last_mark = max(self.last_mark, t)

    def enter(self, phase: str, t: float) -> None:
        """A clocked region of ``phase`` (:data:`~hf_perf_callbacks.keys.CLOCKED_PHASES`) begins at ``t``."""
        if phase not in CLOCKED_PHASES:
            raise ValueError(f"phase={phase!r} is not allowed: expected one of {', '.join(CLOCKED_PHASES)}")
        self._charge(t)
        self.regions.append(phase)

    def leave(self, phase: str, t: float) -> None:
        """The innermost open region of ``phase`` ends at ``t`` (one never entered is ignored)."""
        self._charge(t)
        for i in range(len(self.regions) - 1, -1, -1):
            if self.regions[i] == phase:
                del self.regions[i]
                break

    def step_begin(self, t: float, overhead: float = 0.0) -> None:
        """A step begins at ``t``; ``overhead`` seconds of the unclocked time since the last event were the
        package's callbacks' work (a caller without callback clocks), not unexplained."""
        self._charge(t)
        self.reassign(overhead, "unexplained", "own_callbacks")
        self.step_begin_at = t

    def mark(self, phase: str, t: float) -> None:
        """Eval or save ended at ``t``, unclocked: the time since the last event was that phase."""
        if phase not in ("eval", "save"):
            raise ValueError(f"phase={phase!r} is not allowed: expected 'eval' or 'save'")
        self._charge(t, phase)

    def add_generation(self, seconds: float) -> None:
        """``seconds`` of the step's compute were generation, unclocked (a caller without regions)."""
        if self.step_begin_at is not None:   # generation during eval belongs to eval
            self.unclocked_generation += seconds

    def reassign(self, seconds: float, source: str, target: str) -> float:
        """Move up to ``seconds`` of the interval in progress from phase ``source`` to ``target`` (what a clock of
        the library measured inside another one's region: async GRPO's queue wait inside the batch fetch); returns
        the seconds moved."""
        moved = min(max(0.0, seconds), self.step_phases[source])
        self.step_phases[source] -= moved
        self.step_phases[target] += moved
        return moved

    def add_inside(self, phase: str, seconds: float) -> None:
        """``seconds`` of the step's compute were ``reward`` (GRPO's reward functions) or ``recompute`` (forwards run
        again by gradient checkpointing)."""
        if self.step_begin_at is not None:
            self.step_phases[phase] += seconds

    def _take_phases(self, t: float) -> tuple[float, dict[str, float]]:
        """(wall, phases) of the interval from the previous step's end to ``t``; the next interval starts at ``t``
        (open regions go on in it)."""
        self._charge(t)
        wall = max(0.0, t - self.prev_end)
        p = self.step_phases
        generation = min(self.unclocked_generation, p["compute"])     # generate ran inside the step's compute time
        p["compute"] -= generation
        p["generation"] += generation
        self.unclocked_generation = 0.0
        for inside in ("reward", "recompute"):             # so did the rewards and the recompute
            p[inside] = min(p[inside], p["compute"])
            p["compute"] -= p[inside]
        self.step_phases = dict.fromkeys(PHASES, 0.0)
        self.last_mark = self.prev_end = t
        return wall, p

    def measure(self, step: int, t: float, cpu: float | None = None) -> StepRecord:
        """The step ended at ``t`` (``cpu``: the process CPU clock then): its local durations (tokens come with
        :meth:`commit`)."""
        wall, p = self._take_phases(t)
        phases: dict[str, Any] = p                       # each phase is a field of the record
        record = StepRecord(step, wall, wall - p["eval"] - p["save"], **phases)
        if cpu is not None and self.prev_cpu is not None:
            record.cpu = max(0.0, cpu - self.prev_cpu)
        self.prev_cpu = cpu
        self.step_begin_at = None
        return record

    def tail(self, t: float) -> tuple[float, dict[str, float]]:
        """The run's time after its last step up to ``t`` (the last log, evaluation and save): (wall, phases), added
        to the run's phase totals; no step."""
        wall, p = self._take_phases(t)
        self.step_begin_at = None
        for phase, seconds in p.items():
            self.phase_totals[phase] += seconds
        return wall, p

    def commit(self, record: StepRecord, tokens: float, train_seconds: float | None = None) -> StepRecord:
        """Account a measured step with its (global) tokens; ``train_seconds`` overrides the local figure
        (ranks agree on the slowest rank's time)."""
        record.tokens = tokens
        if train_seconds is not None:
            record.train = train_seconds
        self.steps += 1
        self.total_tokens += tokens
        self.total_train_seconds += record.train
        for phase in PHASES:
            seconds = getattr(record, phase)
            self.phase_totals[phase] += seconds
            self.window_phases[phase] += seconds
        self.rate.add(tokens, record.train)
        self.train_rate.add(tokens, max(0.0, record.train - record.generation - record.rollout_wait))
        if record.train_cpu is not None:
            self.cpu_rate.add(tokens, record.train_cpu)
        self.cycle.append(record)
        if len(self.cycle) == self.period:
            self._close_cycle(self.cycle)
            self.cycle = []
        return record

    def _close_cycle(self, cycle: list[StepRecord]) -> None:
        steps, seconds, train_cpu = _totals(cycle)
        cpu_mode = self.work == "cpu" and train_cpu is not None
        if not cpu_mode and self.work == "cpu" and not self.detector.done:
            self.work = "wall"                       # a step without a CPU reading: wall time from here on
        sample = train_cpu if cpu_mode and train_cpu is not None else seconds
        if self.first_cycle_seconds is None:
            self.first_cycle_seconds = seconds
        if cpu_mode and len(self.segment_cycles) < 1000:
            self.segment_cycles.append((seconds, sample, tuple(steps)))
        if self.detector.done:
            self._steady(cycle)
            return
        self.unsettled.append(cycle)
        self.detector.add(sample)
        warmup = self.detector.warmup_samples
        if warmup is not None:                       # this cycle completed the warmup detection
            if cpu_mode:
                self.decided_at = len(self.segment_cycles)
            self.warmup_cycles += [_totals(c) for c in self.unsettled[:warmup]]
            settled = self.unsettled[warmup:]
            self.first_steady_step = settled[0][0].step
            for steady in settled:
                self._steady(steady)
            self.unsettled = []

    def _early_split(self) -> SlowStart:
        """CPU mode: the cycles up to the warmup decision classified once against the steady wall and CPU levels,
        the medians from the decision's window on (later cycles included: the window alone may still hold a
        contended cycle): of each slow cycle's excess wall time, the part no extra CPU time explains is contention;
        recomputed only when a cycle was added."""
        if self._split is None or self._split[0] != len(self.segment_cycles):
            assert self.decided_at is not None, "called only once warmup was decided on CPU time"
            walls, cpus, _ = zip(*self.segment_cycles)
            start = max(0, self.decided_at - self.detector.window)
            levels = (median(walls[start:]), median(cpus[start:]), self.warmup_tolerance)
            self._split = (len(self.segment_cycles),
                           classify_slow_steps(walls[:self.decided_at], cpus[:self.decided_at], *levels))
        return self._split[1]

    def _segment_contention(self) -> float:
        """This segment's early contention in wall seconds (CPU mode, once warmup is decided; else 0)."""
        return self._early_split().contention_sec if self.decided_at is not None else 0.0

    def _segment_contention_steps(self) -> list[int]:
        """This segment's steps in the cycles :meth:`_early_split` labels contention (CPU mode)."""
        if self.decided_at is None:
            return []
        labels = self._early_split().labels
        return [step for (_, _, steps), label in zip(self.segment_cycles, labels) if label == "contention"
                for step in steps]

    @property
    def contention_steps(self) -> list[int]:
        """CPU mode: the steps of the slow early cycles labelled contention (other processes), all segments."""
        return self.past_contention_steps + self._segment_contention_steps()

    @property
    def warmup_overhead(self) -> float:
        """Training seconds of the warmup cycles (all segments) above the steady step time s × their steps: a
        cycle's excess in full on wall time; in CPU mode (the cycle and the steady steps have CPU readings) the part
        of it that its CPU seconds above the steady steps' mean c explain, at s / c wall seconds per CPU second (the
        rest is contention). Recomputable from the perf log's step lines (``perf/train_sec``, ``perf/cpu_sec`` ×
        train / wall, ``perf/first_steady_step``); 0 before any warmup was decided."""
        steady = self.steady_step_seconds
        if steady is None:
            return 0.0
        cpu = self.steady_cpu_seconds / self.steady_cpu_steps if self.steady_cpu_steps else None
        total = 0.0
        for steps, seconds, train_cpu in self.warmup_cycles:
            excess = max(0.0, seconds - steady * len(steps))
            if train_cpu is not None and cpu:
                excess = min(excess, max(0.0, train_cpu - cpu * len(steps)) * steady / cpu)
            total += excess
        return total

    @property
    def warmup_in_band(self) -> bool | None:
        """This segment's warmup cycles each within ``warmup_tolerance`` of the steady step time (× their steps): a
        speed that settled, not a warmup; None before warmup was decided or without warmup cycles."""
        steady, cycles = self.steady_step_seconds, self.warmup_cycles[self.segment_warmup:]
        if steady is None or not self.detector.done or not cycles:
            return None
        return all(seconds <= (1 + self.warmup_tolerance) * steady * len(steps) for steps, seconds, _ in cycles)

    @property
    def early_contention(self) -> float:
        """CPU mode: wall seconds of slow early cycles whose CPU time was flat (other processes), all segments."""
        return self.past_contention + self._segment_contention()

    def _steady(self, cycle: list[StepRecord]) -> None:
        for r in cycle:
            r.steady = True
            self.steady_steps += 1
            self.steady_tokens += r.tokens
            self.steady_seconds += r.train
            if r.train_cpu is not None:
                self.steady_cpu_seconds += r.train_cpu
                self.steady_cpu_steps += 1

    # ------------------------------------------------------------ readings
    @property
    def tokens_per_sec(self) -> float | None:
        """Windowed rate over the last ``window_steps`` (whole periods)."""
        return self.rate.rate()

    @property
    def steady_tokens_per_sec(self) -> float | None:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else None

    @property
    def steady_tokens_per_cpu_sec(self) -> float | None:
        """Σ tokens / Σ training CPU seconds over the steady steps, when every one of them has a CPU reading."""
        whole = self.steady_cpu_steps == self.steady_steps and self.steady_cpu_seconds > 0
        return self.steady_tokens / self.steady_cpu_seconds if whole else None

    def provisional(self) -> tuple[float, float, int, int, float | None] | None:
        """While warmup is not decided (a short run): (tokens/s, seconds per step, first step, last step, tokens per
        training CPU second or None) over this segment's steps so far, its first step left out when there are others
        (the slowest, as a rule); None once warmup is decided or before any step. A figure of too few steps to call
        steady: marked provisional."""
        if self.detector.done:
            return None
        records = [r for cycle in self.unsettled for r in cycle] + list(self.cycle)
        if len(records) > 1:
            records = records[1:]
        _, seconds, cpu = _totals(records)
        if not records or seconds <= 0:
            return None
        tokens = sum(r.tokens for r in records)
        return tokens / seconds, seconds / len(records), records[0].step, records[-1].step, \
            tokens / cpu if cpu else None

    def rate_metrics(self, world: int = 1) -> dict[str, float]:
        """The step's rate figures as the perf log names them (those known so far): tokens/s over the window (whole
        run and per device), the steady rate and step time, and once warmup is over its length and cost."""
        rate, steady = self.tokens_per_sec, self.steady_tokens_per_sec
        m: dict[str, float | None] = {
            keys.PERF_WARMUP_DONE: int(self.warmup_done), keys.PERF_STEP_TIME: self.rate.mean_seconds(),
            keys.PERF_TOKENS_PER_SEC: rate, keys.PERF_TOKENS_PER_SEC_PER_DEVICE: None if rate is None else rate / world,
            keys.PERF_STEADY_TOKENS_PER_SEC: steady,
            keys.PERF_STEADY_STEP_TIME: None if steady is None else self.steady_step_seconds}
        if self.warmup_done:
            m.update({keys.PERF_WARMUP_STEPS: self.warmup_steps, keys.PERF_WARMUP_OVERHEAD_SEC: self.warmup_overhead,
                      keys.PERF_FIRST_STEP_SLOWDOWN: self.first_step_slowdown})
        return {k: v for k, v in m.items() if v is not None}

    def take_window_phases(self) -> dict[str, float]:
        """Phase fractions since the last call (one logging interval)."""
        parts, self.window_phases = self.window_phases, dict.fromkeys(PHASES, 0.0)
        return _shares(parts)

    def phase_fractions(self) -> dict[str, float]:
        """Phase fractions over the whole run."""
        return _shares(self.phase_totals)

    # ------------------------------------------------------------ resume
    def export(self) -> dict[str, Any]:
        """The counters a resume restores (JSON-serialisable: saved in the checkpoint's trainer state)."""
        return {**{k: getattr(self, k) for k in _TOTALS}, "warmup_cycles": [list(c) for c in self.warmup_cycles],
                "early_contention": self.early_contention, "contention_steps": self.contention_steps,
                "phase_totals": dict(self.phase_totals)}

    def load(self, saved: Mapping[str, Any]) -> None:
        for key in _TOTALS:
            if key in saved:
                setattr(self, key, saved[key])
        self.warmup_cycles = [(list(steps), float(seconds), cpu)
                              for steps, seconds, cpu in saved.get("warmup_cycles", [])]
        self.past_contention = saved.get("early_contention", 0.0)
        self.past_contention_steps = list(saved.get("contention_steps", []))
        self.phase_totals.update(saved.get("phase_totals", {}))


#: the cumulative counters a resume restores
_TOTALS = ("steady_tokens", "steady_seconds", "steady_steps", "total_tokens", "total_train_seconds", "steps",
           "segments", "steady_cpu_seconds", "steady_cpu_steps")


def _totals(records: list[StepRecord]) -> tuple[list[int], float, float | None]:
    """Steps' totals as :attr:`StepTimeline.warmup_cycles` keeps a warmup cycle's: their steps, training seconds and
    training CPU seconds (None when one of them has no CPU reading)."""
    cpus = [r.train_cpu for r in records]
    return [r.step for r in records], sum(r.train for r in records), \
        sum(c for c in cpus if c is not None) if all(c is not None for c in cpus) else None


def _shares(parts: dict[str, float]) -> dict[str, float]:
    total = sum(parts.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in parts.items()}
