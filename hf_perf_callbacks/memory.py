"""Pure memory policy: budget levels with hysteresis, the growth trend, leak detection, the action ladder, and the
cache-clear schedule with back-off. No torch, no transformers: numbers in, decisions out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .stats import WallForecast, linear_fit, steps_to_limit
from .validation import check_number

OK, WARN, CRITICAL = 0, 1, 2
LEVEL_NAMES = {OK: "ok", WARN: "warn", CRITICAL: "critical"}
#: the ladder's actions (logged as an event's ``action``; the bus's signals have their own names in ``bus.py``)
CLEAR, SMALLER_BATCH, STOP = "clear_cache", "smaller_batch", "stop"


#: the watchdog's default share of the smallest real limit used as the budget
BUDGET_FRACTION = 0.85


def budget_bytes(device_type: str, device_limit: float | None, hard_limit: float | None, system_total: float | None,
                 limit_gb: float | None = None, budget_fraction: float = BUDGET_FRACTION) -> float:
    """The memory budget in bytes: ``limit_gb`` when given, else ``budget_fraction`` × the smallest real limit —
    device memory and the MPS watermark hard limit, and on unified memory (``mps``, ``cpu``) the physical RAM."""
    if limit_gb:
        return limit_gb * 2**30
    limits = [device_limit, hard_limit] + ([system_total] if device_type in ("mps", "cpu") else [])
    known = [x for x in limits if x]
    if not known:
        raise ValueError(f"no memory limit known for device type {device_type!r}: pass limit_gb")
    return budget_fraction * min(known)


@dataclass
class Observation:
    """One step's memory reading (bytes) and OS pressure signals."""

    step: int
    used: float                          # what counts against the budget (see MemoryWatchdog)
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
    within ``warn_within_steps``): clear caches → ask for a smaller micro-batch (when someone can provide one) →
    save and stop (at critical, or when the wall is ``stop_within_steps`` away with nothing else left).
    """

    budget: float
    warn_fraction: float = 0.9
    hysteresis: float = 0.05
    grace_steps: int = 2
    trend_window: int = 8
    warn_within_steps: float = 20
    stop_within_steps: float = 3
    leak_min_growth: float = 1024**2
    level: int = OK
    history: deque[tuple[int, float]] = field(default_factory=deque)   # (step, used bytes)
    swap_streak: int = 0
    segment_steps: int = 0
    episode: list[str] = field(default_factory=list)
    leak_reported: bool = False

    def __post_init__(self) -> None:
        check_number("budget", self.budget, low=0, low_open=True)
        check_number("warn_fraction", self.warn_fraction, low=0, high=1, low_open=True)
        check_number("hysteresis", self.hysteresis, low=0, high=0.5)
        check_number("grace_steps", self.grace_steps, low=0, integer=True)
        check_number("trend_window", self.trend_window, low=3, integer=True)
        check_number("warn_within_steps", self.warn_within_steps, low=0)
        check_number("stop_within_steps", self.stop_within_steps, low=0, high=self.warn_within_steps)
        self.history = deque(maxlen=self.trend_window)

    def start_segment(self) -> None:
        self.segment_steps = 0
        self.history.clear()
        self.swap_streak = 0
        self.episode = []

    # ------------------------------------------------------------ observing
    def observe(self, obs: Observation, replace_last: bool = False) -> int:
        """Account a reading (``replace_last``: a re-sample after an action in the same step); returns the level."""
        if replace_last and self.history:
            self.history.pop()
        else:
            self.segment_steps += 1
            self.swap_streak = self.swap_streak + 1 if (obs.swapouts or 0) > 0 else 0
        self.history.append((obs.step, obs.used))
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
        """Steps until ``used`` reaches the budget at the current slope: the point estimate of :meth:`forecast`
        (None when not growing or fewer than 3 samples)."""
        forecast = self.forecast()
        return forecast.steps if forecast is not None else None

    def forecast(self) -> WallForecast | None:
        """Steps to the budget with a 95% range (:func:`~hf_perf_callbacks.stats.steps_to_limit`); None when the
        trend is not growing or fewer than 3 samples."""
        return steps_to_limit([s for s, _ in self.history], [u for _, u in self.history], self.budget)

    def _wall_near(self, within: float) -> bool:
        stw = self.steps_to_wall
        return stw is not None and stw <= within

    @property
    def leaking(self) -> bool:
        """Memory grew by more than ``leak_min_growth`` on every step of a full trend window after grace."""
        if self.segment_steps <= self.grace_steps or len(self.history) < self.trend_window:
            return False
        used = [u for _, u in self.history]
        return all(b - a > self.leak_min_growth for a, b in zip(used, used[1:]))

    # ------------------------------------------------------------ deciding
    def next_action(self, can_shrink: bool) -> str | None:
        """The next rung of the ladder for this step, or None. Call :meth:`taken` after acting."""
        if self.segment_steps <= self.grace_steps:
            return None
        urgent = self.level == CRITICAL or self._wall_near(self.stop_within_steps)
        pressing = urgent or self.level == WARN or self._wall_near(self.warn_within_steps)
        if not pressing:
            return None
        if CLEAR not in self.episode:
            return CLEAR
        if can_shrink and SMALLER_BATCH not in self.episode:
            return SMALLER_BATCH
        if urgent and STOP not in self.episode:
            return STOP
        return None

    def taken(self, action: str) -> None:
        self.episode.append(action)

    def reason(self) -> str:
        stw, slope = self.steps_to_wall, self.slope
        used = self.history[-1][1] if self.history else 0.0
        text = f"{LEVEL_NAMES[self.level]}: {used / 1024**3:.2f} GB used of a {self.budget / 1024**3:.2f} GB budget"
        if stw is not None and slope is not None:         # a wall is forecast only from a slope
            text += f", wall in {stw:.1f} steps at +{slope / 1024**2:.1f} MB/step"
        if self.swap_streak:
            text += f", macOS swapping for {self.swap_streak} step(s)"
        return text


@dataclass
class ClearSchedule:
    """When clearing the allocator cache pays: periodic with back-off, plus on demand.

    After each automatic clear the interval doubles (up to ``max_interval``) when it freed less than ``min_freed``
    bytes, and halves (down to ``min_interval``) when it freed at least four times that.
    """

    interval: int = 50
    min_interval: int = 10
    max_interval: int = 400
    min_freed: float = 0.1 * 1024**3
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
