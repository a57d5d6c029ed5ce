"""Pure memory policy: the budget and how it follows what the device can give, levels with hysteresis, the growth
trend, leak detection, the action ladder, and the cache-clear schedule with back-off. No torch, no transformers:
numbers in, decisions out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from .stats import WallForecast, linear_fit, median, steps_to_limit
from .validation import check_number

OK, WARN, CRITICAL = 0, 1, 2
LEVEL_NAMES = {OK: "ok", WARN: "warn", CRITICAL: "critical"}
#: the ladder's actions (logged as an event's ``action``; the bus's signals have their own names in ``bus.py``)
CLEAR, SMALLER_BATCH, STOP = "clear_cache", "smaller_batch", "stop"
GIB, MIB = 2**30, 2**20


#: the watchdog's default share of what the run can reach used as the budget
BUDGET_FRACTION = 0.85
#: the memory policy's defaults (:class:`MemoryPolicy`'s and the MemoryWatchdog's arguments of the same names): the
#: share of the budget at which the level becomes warn, the steps at a segment's start without actions, the steps
#: in the growth fit, and how many steps away the wall makes the watchdog warn and act, and stop
WARN_FRACTION = 0.9
GRACE_STEPS = 2
TREND_WINDOW = 8
WARN_WITHIN_STEPS = 20.0
STOP_WITHIN_STEPS = 3.0
#: the budget moves only when what the run can reach moved by more than this share of the budget
WALL_BAND = 0.05
#: a rising wall moves the budget to the median of this many latest candidates
WALL_WINDOW = 3
#: memory outside the run's reach is named as a cause of the wall when it is at least this share of the device
OUTSIDE_MATERIAL = 0.10
#: steps of growth on every step (3 increments) after which a smaller micro-batch is no longer asked for
STEADY_GROWTH_SAMPLES = 4


def gib(value: float) -> str:
    """Bytes in GiB words (``"16.10 GiB"``)."""
    return f"{value / GIB:.2f} GiB"


def mib(value: float) -> str:
    """Bytes in MiB words (``"512 MiB"``)."""
    return f"{value / MIB:.0f} MiB" if abs(value) >= 10 * MIB else f"{value / MIB:.1f} MiB"


def budget_bytes(device_type: str, device_limit: float | None, hard_limit: float | None, system_total: float | None,
                 limit_gb: float | None = None, budget_fraction: float = BUDGET_FRACTION,
                 reachable: float | None = None) -> float:
    """The memory budget in bytes: ``limit_gb`` when given, else ``budget_fraction`` × the smallest real limit —
    device memory and the MPS watermark hard limit, on unified memory (``mps``, ``cpu``) the physical RAM, and what
    the run can reach now (``reachable``: what it holds plus what the device can still give, see
    :attr:`~hf_perf_callbacks.platform.device.MemorySample.reachable`), so other processes and memory outside PyTorch's
    allocator count against it."""
    if limit_gb:
        return limit_gb * GIB
    limits = [device_limit, hard_limit] + ([system_total] if device_type in ("mps", "cpu") else [])
    known = [x for x in limits if x]
    if not known:
        raise ValueError(f"no memory limit known for device type {device_type!r}: pass limit_gb")
    static = budget_fraction * min(known)
    if reachable is None:
        return static
    return max(1.0, min(static, budget_fraction * reachable))


@dataclass
class MovingWall:
    """The budget as what the device can give moves (another process grows or shrinks, a pool is allocated).

    :meth:`update` takes each step's candidate budget. Asymmetric, safety first: a candidate below the band of
    :data:`WALL_BAND` × the budget lowers the budget at once (another process that took the card's memory between two
    steps is met by the very next step: waiting for a median means running into it); a higher one moves the budget
    only to the median of the last :data:`WALL_WINDOW` candidates, when that leaves the band (a wall that rises is
    believed once it holds: one reading up moves nothing); a drift within the band does not flap. The first candidate
    is the budget.
    """

    value: float | None = None
    candidates: deque[float] = field(default_factory=lambda: deque(maxlen=WALL_WINDOW))

    def update(self, candidate: float) -> float | None:
        """Account one candidate budget; returns the budget before when it moved, else None."""
        check_number("candidate budget", candidate, low=0, low_open=True)
        self.candidates.append(candidate)
        if self.value is None:
            self.value = candidate
            return None
        if candidate < (1 - WALL_BAND) * self.value:           # a lower wall: believed at once
            before, self.value = self.value, candidate
            return before
        if len(self.candidates) < WALL_WINDOW:
            return None
        level = median(self.candidates)
        if level <= (1 + WALL_BAND) * self.value:             # a higher one only once it holds
            return None
        before, self.value = self.value, level
        return before


@dataclass(frozen=True)
class Futile:
    """Why a smaller micro-batch cannot relieve memory pressure, as data: ``leak`` (memory grows by ``rate`` bytes on
    every step) or ``no_relief`` (micro-batch ``before_micro`` → ``micro_batch`` took memory from ``before`` to
    ``now`` bytes; at micro-batch 1 it would be ``at_one``, against the ``warn`` level). Words:
    :meth:`MemoryPolicy.shrink_futile`."""

    code: Literal["leak", "no_relief"]
    rate: float = 0.0
    before_micro: int = 0
    micro_batch: int = 0
    before: float = 0.0
    now: float = 0.0
    at_one: float = 0.0
    warn: float = 0.0


@dataclass(frozen=True)
class Cause:
    """A cause of memory pressure the watchdog knows, as data: ``outside`` (``bytes`` of the device's ``total`` held
    outside this run's reach; ``unified`` memory; ``holders``: who, in words, when the device can say) or ``leak``
    (``bytes`` a step). Its words: :func:`cause_words`."""

    code: Literal["outside", "leak"]
    bytes: float
    total: float | None = None
    unified: bool = False
    holders: str | None = None


def cause_words(cause: Cause) -> str:
    """A cause in words: the one place they are written."""
    if cause.code == "leak":
        return f"a leak of {mib(cause.bytes)} a step (memory grew on every step)"
    if cause.holders:
        return cause.holders
    if cause.unified:
        return f"other processes and the system hold {cause.bytes / GIB:.1f} GiB of this machine's " \
               f"{(cause.total or 0.0) / GIB:.1f} GiB"
    return f"another process (or memory outside PyTorch's allocator) holds {cause.bytes / GIB:.1f} GiB of this card"


@dataclass(frozen=True)
class WallFacts:
    """What sets the memory wall now and what presses on it, in bytes, for messages: the watchdog publishes it on
    the bus every step (``RunBus.memory_facts``), so that a stop or a re-size that gives up can name the causes."""

    budget: float
    total: float | None = None          # the card's memory (CUDA/XPU), the machine's RAM (MPS, CPU)
    outside: float | None = None        # of ``total``: held outside this run's reach (see MemorySample.outside)
    unified: bool = False               # unified memory (MPS, CPU): ``outside`` is other processes and the system
    holders: str | None = None          # who holds ``outside``, in words, when the device can say (NVML)
    leak_per_step: float | None = None  # growth on every step of the trend window: a leak (bytes a step)

    def outside_cause(self) -> Cause | None:
        """The memory held outside this run's reach as a :class:`Cause`; None when unknown or not material (below
        :data:`OUTSIDE_MATERIAL` of the device)."""
        if self.outside is None or not self.total or self.outside < OUTSIDE_MATERIAL * self.total:
            return None
        return Cause("outside", self.outside, self.total, self.unified, self.holders)

    def outside_words(self) -> str | None:
        """:meth:`outside_cause` in words (None: unknown or not material)."""
        cause = self.outside_cause()
        return cause_words(cause) if cause is not None else None

    def cause_list(self) -> list[Cause]:
        """The causes of memory pressure the watchdog knows, as data (empty when it knows none)."""
        found = []
        outside = self.outside_cause()
        if outside is not None:
            found.append(outside)
        if self.leak_per_step is not None and self.leak_per_step > 0:
            found.append(Cause("leak", self.leak_per_step))
        return found

    def sentence(self) -> str:
        """The causes in words, as one clause (``""`` when none is known)."""
        return "; ".join(cause_words(c) for c in self.cause_list())


def holders_words(holders: list[tuple[int, str, int]], own_pid: int, reserved: float) -> str | None:
    """Who holds a card's memory, in words, from NVML's process list ((pid, name, bytes), this process included)
    and this process's allocator-reserved bytes: the other processes by size, and what this process holds outside
    PyTorch's caching allocator. None when the list says nothing useful."""
    others = sorted(((b, pid, name) for pid, name, b in holders if pid != own_pid), reverse=True)
    own = sum(b for pid, _, b in holders if pid == own_pid)
    parts = []
    if others:
        listed = ", ".join(f"pid {pid} {name}: {b / GIB:.1f} GiB" for b, pid, name in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        subject = "another process holds" if len(others) == 1 else f"{len(others)} other processes hold"
        parts.append(f"{subject} {sum(b for b, _, _ in others) / GIB:.1f} GiB of this card ({listed}{more})")
    outside_allocator = own - reserved
    if own and outside_allocator > GIB:                # more than a CUDA context's few hundred MiB
        parts.append(f"this process holds {outside_allocator / GIB:.1f} GiB outside PyTorch's caching allocator "
                     f"(the CUDA context, NCCL buffers, a pool such as vLLM's)")
    return "; ".join(parts) or None


@dataclass
class Observation:
    """One step's memory reading (bytes) and OS pressure signals."""

    step: int
    used: float                          # what counts against the budget (see MemoryWatchdog)
    micro_batch: int | None = None       # the per-device micro-batch the step ran at
    os_level: int | None = None          # macOS: 1 normal, 2 warn, 4 critical
    swapouts: int | None = None          # macOS: pages swapped out since the previous sample
    alloc_retries: int | None = None     # CUDA: allocator retries since the previous sample


@dataclass
class MemoryPolicy:
    """Levels, trend and the action ladder for one rank.

    Levels: **critical** when ``used ≥ budget``, macOS reports critical pressure, or swap-outs grew on two
    consecutive steps; **warn** when ``used ≥ warn_fraction × budget``, macOS reports warn pressure, swap-outs grew
    once, or the CUDA allocator had to retry. A level falls only once ``used`` is ``hysteresis × budget`` below its
    threshold and the OS signals are quiet. No action is taken in the first ``grace_steps`` steps of a segment
    (first-step allocator spikes).

    The ladder, one rung at a time per episode (an episode starts when the level leaves ok or the wall comes
    within ``warn_within_steps``): clear caches → ask for a smaller micro-batch (when someone can provide one, and
    only where that helps: at the warn level or above — a wall that is near only because memory grows is not
    relieved by it — and not when :meth:`shrink_futile` says why not) → save and stop (at critical, or when the wall
    is ``stop_within_steps`` away with nothing else left).

    The budget may move between steps (:meth:`set_budget`: what the device can give changed); levels and the
    forecast always use the current one. A leak is remembered for the run (``leak_rate``) across the segments that
    in-process re-sizes start, and so is the last smaller micro-batch asked for (``shrink``: its micro-batch and the
    memory used before).
    """

    budget: float
    warn_fraction: float = WARN_FRACTION
    hysteresis: float = 0.05
    grace_steps: int = GRACE_STEPS
    trend_window: int = TREND_WINDOW
    warn_within_steps: float = WARN_WITHIN_STEPS
    stop_within_steps: float = STOP_WITHIN_STEPS
    leak_min_growth: float = MIB
    level: int = OK
    history: deque[tuple[int, float]] = field(default_factory=deque)   # (step, used bytes) of this segment
    growth: deque[float] = field(default_factory=deque)   # step-to-step growth within segments, after their grace
    last_used: float | None = None       # the latest reading, across segments
    switch_rise: float = 0.0             # the largest rise a segment's first reading brought over the one before
    swap_streak: int = 0
    segment_steps: int = 0
    episode: list[str] = field(default_factory=list)
    leak_reported: bool = False
    leak_rate: float | None = None       # bytes a step while a leak is known in this run
    micro_batch: int | None = None       # the micro-batch of the latest observation
    shrink: tuple[int, float] | None = None   # (micro-batch, memory used) when a smaller one was last asked for
    completions: WallForecast | None = None   # GRPO: the wall as the completions' growth brings it (CompletionTrend)
    completions_explain: bool = False    # GRPO: the peaks follow the completions' lengths (CompletionTrend.explains)

    def __post_init__(self) -> None:
        check_number("budget", self.budget, low=0, low_open=True)
        check_number("warn_fraction", self.warn_fraction, low=0, high=1, low_open=True)
        check_number("hysteresis", self.hysteresis, low=0, high=0.5)
        check_number("grace_steps", self.grace_steps, low=0, integer=True)
        check_number("trend_window", self.trend_window, low=3, integer=True)
        check_number("warn_within_steps", self.warn_within_steps, low=0)
        check_number("stop_within_steps", self.stop_within_steps, low=0, high=self.warn_within_steps)
        self.history = deque(maxlen=self.trend_window)
        self.growth = deque(maxlen=self.trend_window - 1)

    def set_budget(self, budget: float) -> None:
        """The budget from now on (the wall moved); levels and the forecast use it from the next observation."""
        self.budget = check_number("budget", budget, low=0, low_open=True)

    def follow_completions(self, forecast: WallForecast | None, explain: bool) -> None:
        """GRPO: the wall as the completions' growth brings it, and whether their lengths explain the peaks (then
        the growth is no leak)."""
        self.completions, self.completions_explain = forecast, explain
        if explain:
            self.leak_rate = None

    def start_segment(self) -> None:
        self.segment_steps = 0
        self.history.clear()
        self.swap_streak = 0
        self.episode = []

    # ------------------------------------------------------------ observing
    def observe(self, obs: Observation, replace_last: bool = False) -> int:
        """Account a reading (``replace_last``: a re-sample after an action in the same step); returns the level.

        A re-sample sets the level alone: the trend keeps the step's own reading, since a cleared cache fills again in
        the next step (a post-clear reading beside un-cleared ones would read as a sawtooth of false growth)."""
        if not (replace_last and self.history):
            self.segment_steps += 1
            self.swap_streak = self.swap_streak + 1 if (obs.swapouts or 0) > 0 else 0
            if self.history and self.segment_steps > self.grace_steps:     # growth from the grace on
                self.growth.append(obs.used - self.history[-1][1])
            if not self.history and self.last_used is not None:     # a segment's first reading
                self.switch_rise = max(self.switch_rise, obs.used - self.last_used - max(self.leak_rate or 0.0, 0.0))
            self.last_used = obs.used
            self.history.append((obs.step, obs.used))
            if obs.micro_batch is not None:
                self.micro_batch = obs.micro_batch
            if self.leaking:
                self.leak_rate = sum(self.growth) / len(self.growth)
            elif self.segment_steps > self.grace_steps and len(self.history) == self.trend_window:
                slope = self.slope
                if slope is not None and slope <= self.leak_min_growth:     # a whole window without growth
                    self.leak_rate = None
        self.level = self._level(obs)
        if self.level == OK and not self._wall_near(self.warn_within_steps):
            self.episode = []
        return self.level

    def _level(self, obs: Observation) -> int:
        margin = self.hysteresis * self.budget if self.level else 0.0
        critical = (obs.used >= self.budget - (margin if self.level == CRITICAL else 0.0) or obs.os_level == 4
                    or self.swap_streak >= 2)
        if critical:
            return CRITICAL
        warn = (obs.used >= self.warn_fraction * self.budget - margin or obs.os_level == 2 or self.swap_streak == 1
                or (obs.alloc_retries or 0) > 0)
        return WARN if warn else OK

    @property
    def slope(self) -> float | None:
        """Memory growth in bytes per step over the trend window (None until it is full enough)."""
        if len(self.history) < 3:
            return None
        steps, used = zip(*self.history)
        return linear_fit(steps, used)[0]

    @property
    def steps_to_wall(self) -> float | None:
        """The point estimate of :meth:`forecast`: steps until ``used`` reaches the budget (None where it is None)."""
        forecast = self.forecast()
        return forecast.steps if forecast is not None else None

    def forecast(self) -> WallForecast | None:
        """Steps to the budget with a 95% range (:func:`~hf_perf_callbacks.core.stats.steps_to_limit`); None when the
        trend is not growing or fewer than 3 samples. While a leak is known (``leak_rate``, kept across segments),
        the wall is never forecast farther than the leak brings it from the latest reading, less the largest rise a
        switch brought in this run: a switch starts a new segment, not a new leak."""
        segment = steps_to_limit([s for s, _ in self.history], [u for _, u in self.history], self.budget)
        if self.completions is not None and (segment is None or self.completions.steps < segment.steps):
            segment = self.completions                     # the completions' growth brings the wall sooner
        if self.leak_rate is None or self.leak_rate <= 0 or not self.history:
            return segment
        # the next switch may bring the largest rise one brought before (a larger split's level)
        steps = max(self.budget - self.history[-1][1] - self.switch_rise, 0.0) / self.leak_rate
        if segment is not None and segment.steps <= steps:
            return segment
        return WallForecast(steps=steps, low=steps, high=steps, slope=self.leak_rate)

    def _wall_near(self, within: float) -> bool:
        stw = self.steps_to_wall
        return stw is not None and stw <= within

    @property
    def leaking(self) -> bool:
        """Growth no split explains: over the last ``trend_window - 1`` step-to-step changes within segments (a
        switch or re-size starts a segment; the changes into its first ``grace_steps`` steps are left out, and so
        is the change across it), memory never fell by more than ``leak_min_growth``, grew by more than that on at
        least every other step (one of the last two among them), and by more than that a step on average: a leak
        on every step, on every other step, or across the splits of a tuning in turn. Growth that longer GRPO
        completions explain (``completions_explain``) is not a leak."""
        changes = list(self.growth)
        if len(changes) < self.trend_window - 1 or self.completions_explain:
            return False
        grew = sum(1 for c in changes if c > self.leak_min_growth)
        return (min(changes) > -self.leak_min_growth and 2 * grew >= len(changes) - 1
                and max(changes[-2:]) > self.leak_min_growth                 # still growing
                and sum(changes) > self.leak_min_growth * len(changes))

    @property
    def steady_growth(self) -> bool:
        """Memory grew by more than ``leak_min_growth`` on every step of the segment's last
        :data:`STEADY_GROWTH_SAMPLES` samples at least (all of the trend window's): what a leak looks like before the
        window is full."""
        used = [u for _, u in self.history]
        return len(used) >= min(STEADY_GROWTH_SAMPLES, self.trend_window) and all(
            b - a > self.leak_min_growth for a, b in zip(used, used[1:]))

    def shrink_futile(self) -> str | None:
        """Why a smaller micro-batch cannot relieve the pressure, in words (:meth:`futile`; the one place they are
        written), or None when it may."""
        f = self.futile()
        if f is None:
            return None
        if f.code == "leak":
            return f"memory grows by {mib(f.rate)} on every step, and a smaller micro-batch does not stop a leak"
        return (f"micro-batch {f.before_micro} → {f.micro_batch} took memory from {gib(f.before)} to {gib(f.now)}: "
                f"even at micro-batch 1 it would be about {gib(f.at_one)} against the warn level of {gib(f.warn)}")

    def futile(self) -> Futile | None:
        """Why a smaller micro-batch cannot relieve the pressure, as data, or None when it may.

        Never for memory that grows on every step (a leak, known or as it looks before the trend window is full):
        a smaller micro-batch does not stop it. After an earlier request of this run took effect, from what it did:
        memory ≈ fixed + micro-batch × per sample, fitted to the two micro-batches; futile when even micro-batch 1
        would stay at the warn level or above (or the smaller micro-batch did not lower memory at all). Memory that
        rose after it says something else changed too (the rows grew): not futile, the next smaller one is the test."""
        if not self.completions_explain and (self.leak_rate is not None or self.steady_growth):
            rate = self.leak_rate if self.leak_rate is not None else self.slope
            return Futile("leak", rate=rate or 0.0)
        if (self.shrink is None or self.micro_batch is None or not self.history
                or self.segment_steps <= self.grace_steps):
            return None
        before_micro, before = self.shrink
        if self.micro_batch >= before_micro:
            return None                                   # the smaller micro-batch has not taken effect
        now = median([u for _, u in self.history])
        if now > before:        # memory rose: more than the micro-batch changed (longer rows); a smaller one may help
            return None
        per_sample = (before - now) / (before_micro - self.micro_batch)
        at_one = now - per_sample * (self.micro_batch - 1)
        if per_sample > 0 and at_one < self.warn_fraction * self.budget:
            return None
        return Futile("no_relief", before_micro=before_micro, micro_batch=self.micro_batch, before=before, now=now,
                      at_one=max(at_one, 0.0), warn=self.warn_fraction * self.budget)

    # ------------------------------------------------------------ deciding
    def next_action(self, can_shrink: bool) -> str | None:
        """The next rung of the ladder for this step, or None (in a segment's grace steps too, unless a leak is
        known: a switch starts a new segment, not a new leak). Call :meth:`taken` after acting."""
        if self.segment_steps <= self.grace_steps and self.leak_rate is None:
            return None
        urgent = self.level == CRITICAL or self._wall_near(self.stop_within_steps)
        pressing = urgent or self.level == WARN or self._wall_near(self.warn_within_steps)
        if not pressing:
            return None
        if CLEAR not in self.episode:
            return CLEAR
        longer = self.completions is not None and self.completions.steps <= self.warn_within_steps
        if (can_shrink and SMALLER_BATCH not in self.episode and (self.level >= WARN or longer or urgent)
                and self.shrink_futile() is None):     # over the warn level, longer completions or the wall forecast
            return SMALLER_BATCH                       # within stop_within_steps: what a smaller one relieves
        if urgent and STOP not in self.episode:
            return STOP
        return None

    def taken(self, action: str) -> None:
        self.episode.append(action)
        if action == SMALLER_BATCH and self.micro_batch is not None and self.history:
            self.shrink = (self.micro_batch, median([u for _, u in self.history]))

    def reason(self) -> str:
        """Why the watchdog acts now, in words: the level, the memory used of the budget, the wall's forecast (only
        from a slope) and the steps macOS has been swapping."""
        stw, slope = self.steps_to_wall, self.slope
        used = self.history[-1][1] if self.history else 0.0
        text = f"{LEVEL_NAMES[self.level]}: {gib(used)} used of a {gib(self.budget)} budget"
        if stw is not None and slope is not None:
            text += f", wall in {stw:.1f} steps at +{mib(slope)}/step"
        if self.swap_streak:
            text += f", macOS swapping for {self.swap_streak} step(s)"
        return text


@dataclass
class CompletionTrend:
    """GRPO: a step's peak grows with its longest completions. From the last :data:`TREND_WINDOW` (step, longest
    completion, peak) points: the peak as a line in the completion length (least squares), the completion length at
    which a step stops fitting a budget, and, where the completions grow, in how many steps they reach it."""

    points: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=TREND_WINDOW))

    def add(self, step: int, length: float, peak: float) -> None:
        self.points.append((step, float(length), float(peak)))

    def line(self) -> tuple[float, float] | None:
        """(peak at length 0, bytes per completion token); None before 3 points, when the lengths hardly differ
        (less than a tenth of the longest) or the peak does not grow with them."""
        if len(self.points) < 3:
            return None
        lengths, peaks = [p[1] for p in self.points], [p[2] for p in self.points]
        if max(lengths) - min(lengths) < 0.1 * max(lengths):
            return None
        slope, intercept = linear_fit(lengths, peaks)
        return (intercept, slope) if slope > 0 else None

    def explains(self) -> bool:
        """Whether the completions' lengths explain the peaks: the line fits them with R² ≥ 0.9."""
        line = self.line()
        if line is None:
            return False
        peaks = [p[2] for p in self.points]
        mean = sum(peaks) / len(peaks)
        total = sum((y - mean) ** 2 for y in peaks)
        residual = sum((p[2] - line[0] - line[1] * p[1]) ** 2 for p in self.points)
        return total > 0 and residual <= 0.1 * total

    def wall_length(self, budget: float) -> float | None:
        """The completion length at which a step's peak reaches ``budget`` (None: unknown)."""
        line = self.line()
        return (budget - line[0]) / line[1] if line is not None else None

    def forecast(self, budget: float, limit: float, step: int | None = None) -> WallForecast | None:
        """Steps after ``step`` (default: the latest point's) until the completions reach :meth:`wall_length` at
        their trend; None when a step of ``limit``-token completions (``max_completion_length``) fits, the length is
        unknown, or the completions are not growing."""
        wall, line = self.wall_length(budget), self.line()
        if wall is None or line is None or wall >= limit:
            return None
        per_step = linear_fit([p[0] for p in self.points], [p[1] for p in self.points])[0]
        if per_step <= 0:
            return None
        latest_step, latest = self.points[-1][0], self.points[-1][1]
        steps = max(0.0, (wall - latest) / per_step - ((step if step is not None else latest_step) - latest_step))
        return WallForecast(steps=steps, low=steps, high=steps, slope=line[1] * per_step)


@dataclass
class ClearSchedule:
    """When clearing the allocator cache pays: periodic with back-off, plus on demand.

    After each automatic clear the interval doubles (up to ``max_interval``) when it freed less than ``min_freed``
    bytes, and halves (down to ``min_interval``) when it freed at least four times that.
    """

    interval: int = 50
    min_interval: int = 10
    max_interval: int = 400
    min_freed: float = 0.1 * GIB
    last_clear_step: int = 0

    def __post_init__(self) -> None:
        check_number("min_interval", self.min_interval, low=1, integer=True)
        check_number("max_interval", self.max_interval, low=self.min_interval, integer=True)
        check_number("interval_steps", self.interval, low=self.min_interval, high=self.max_interval, integer=True)
        check_number("min_freed (bytes)", self.min_freed, low=0)

    def due(self, step: int) -> bool:
        return step - self.last_clear_step >= self.interval

    def gap_ok(self, step: int) -> bool:
        """At least ``min_interval`` steps since the last clear (for bloat-triggered clears)."""
        return step - self.last_clear_step >= self.min_interval

    def cleared(self, step: int, freed: float, automatic: bool = True) -> None:
        self.last_clear_step = step
        if not automatic:
            return
        if freed < self.min_freed:
            self.interval = min(self.max_interval, self.interval * 2)
        elif freed >= 4 * self.min_freed:
            self.interval = max(self.min_interval, self.interval // 2)
