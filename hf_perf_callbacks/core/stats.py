"""Pure statistics used by the callbacks: no torch, no transformers, no clock.

Everything here takes numbers and returns numbers, so it is unit tested with exact values.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .validation import check_number


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    if not values:
        raise ValueError("median of an empty sequence")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through (xs, ys): returns (slope, intercept)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"linear_fit needs two equal-length sequences of at least 2 points, got {n} and {len(ys)}")
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return slope, mean_y - slope * mean_x


class WarmupDetector:
    """Online steady-state detection that tolerates step-time jitter.

    Once ``2 × window`` samples exist, the steady level ``M`` is the median of the last ``window`` samples and the
    noise ``σ`` the robust spread of their successive differences (1.4826 × MAD / √2: a trend does not count as
    noise, so a still-falling step time is not called stable). The stable band is ``M + max(tolerance × M, 3σ)``: on a
    quiet device the relative tolerance decides, on a jittery one (GRPO's launch-bound generation) the measured noise
    does. Warmup ends at the first sample from which every later sample lies inside the band, provided at least
    ``window`` samples confirm it and the last window does not drift (its fitted change stays inside the band).
    Without such a point, warmup is declared over at ``max_warmup``. The decision (:attr:`warmup_samples`) is made
    once and then fixed; what warmup cost is the timeline's to compute.
    """

    def __init__(self, window: int = 4, tolerance: float = 0.1, max_warmup: int = 50):
        self.window = check_number("warmup_window", window, low=2, integer=True)
        self.tolerance = check_number("warmup_tolerance", tolerance, low=0, high=1, low_open=True)
        self.max_warmup = check_number("max_warmup_steps", max_warmup, low=0, integer=True)
        self.samples: list[float] = []
        self.warmup_samples: int | None = None     # the samples before the first stable window, once decided

    @property
    def done(self) -> bool:
        return self.warmup_samples is not None

    def band(self) -> tuple[float, float]:
        """(steady level, upper edge of the stable band) from the latest ``window`` samples."""
        recent = self.samples[-self.window:]
        level = median(recent)
        diffs = [b - a for a, b in zip(recent, recent[1:])]
        center = median(diffs)
        noise = 1.4826 * median([abs(d - center) for d in diffs]) / math.sqrt(2)
        return level, level + max(self.tolerance * level, 3.0 * noise)

    def add(self, value: float) -> bool:
        """Feed one sample; returns True when this sample completed the detection."""
        if self.done:
            return False
        self.samples.append(value)
        n = len(self.samples)
        if n < 2 * self.window:
            return False
        level, edge = self.band()
        recent = self.samples[-self.window:]
        drift = abs(linear_fit(range(self.window), recent)[0]) * (self.window - 1)
        start = n
        while start > 0 and self.samples[start - 1] <= edge:
            start -= 1
        if level > 0 and drift <= edge - level and n - start >= self.window and start <= self.max_warmup:
            self.warmup_samples = start
        elif n - self.window >= self.max_warmup + self.window:
            self.warmup_samples = self.max_warmup
        return self.done


class WindowedRate:
    """A rate (amount / seconds) over the last ``window`` samples, counted in whole periods.

    GRPO adds its tokens only on steps that generate (every ``period`` optimizer steps), so a window that cut a
    period in half would spike; the rate uses the largest multiple of ``period`` samples available.
    """

    def __init__(self, window: int, period: int = 1):
        check_number("window_steps", window, low=1, integer=True)
        self.period = check_number("period", period, low=1, integer=True)
        self.size = math.ceil(window / period) * period
        self.items: deque[tuple[float, float]] = deque(maxlen=self.size)

    def add(self, amount: float, seconds: float) -> None:
        self.items.append((amount, seconds))

    def rate(self) -> float | None:
        usable = len(self.items) - len(self.items) % self.period
        if usable == 0:
            return None
        recent = list(self.items)[-usable:]
        seconds = sum(s for _, s in recent)
        return sum(a for a, _ in recent) / seconds if seconds > 0 else None

    def mean_seconds(self) -> float | None:
        return sum(s for _, s in self.items) / len(self.items) if self.items else None


def generation_period(steps_per_generation: int, num_iterations: int, grad_accum: int) -> int:
    """Optimizer steps after which GRPO's generate/replay pattern repeats (1 for plain trainers)."""
    every = steps_per_generation * num_iterations          # micro-batches between generations
    return math.lcm(every, grad_accum) // grad_accum


# ---------------------------------------------------------------- comparing two samples

def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of a non-empty sequence (linear interpolation between order statistics)."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    check_number("q", q, low=0, high=1)
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(math.floor(pos))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def iqr(values: Sequence[float]) -> tuple[float, float]:
    """(lower quartile, upper quartile)."""
    return quantile(values, 0.25), quantile(values, 0.75)


def _u_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """Pairs (x from a, y from b) with x < y, ties counted half."""
    return sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in a for y in b)


def mann_whitney_less(a: Sequence[float], b: Sequence[float]) -> float:
    """One-sided Mann-Whitney p-value for "values of ``a`` tend to be smaller than those of ``b``".

    Exact (a permutation over every split of the pooled values, ties included) when ``len(a) + len(b) <= 14``,
    otherwise the normal approximation with a continuity correction. Small samples cannot reach small p-values:
    2 against 2 gives at best 1/6, 3 against 3 1/20, 4 against 4 1/70.
    """
    if not a or not b:
        raise ValueError(f"mann_whitney_less needs two non-empty samples, got {len(a)} and {len(b)}")
    observed = _u_statistic(a, b)
    n, m = len(a), len(b)
    if n + m <= 14:
        from itertools import combinations

        pooled = list(a) + list(b)
        count = 0
        for chosen in combinations(range(n + m), n):
            picked = set(chosen)
            first = [pooled[i] for i in chosen]
            second = [pooled[i] for i in range(n + m) if i not in picked]
            count += _u_statistic(first, second) >= observed - 1e-12
        return count / math.comb(n + m, n)
    mean = n * m / 2
    sd = math.sqrt(n * m * (n + m + 1) / 12)
    z = (observed - mean - 0.5) / sd
    return 0.5 * math.erfc(z / math.sqrt(2))


# ---------------------------------------------------------------- uncertainty of a growth trend

#: one-sided 97.5% quantiles of Student's t by degrees of freedom (two-sided 95% intervals)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(df: int) -> float:
    """One-sided 97.5% quantile of Student's t with ``df`` degrees of freedom (table, the next smaller df listed)."""
    check_number("df", df, low=1, integer=True)
    return _T975[max(k for k in _T975 if k <= df)] if df <= 60 else 1.960


@dataclass
class WallForecast:
    """Steps until a growing series reaches a limit: a point estimate and a 95% range (see :func:`steps_to_limit`)."""

    steps: float               # headroom / least-squares slope
    low: float                 # fewer steps: growth at the upper end of its interval
    high: float | None         # more steps; None when growth may be zero within the interval (no upper bound)
    slope: float               # least-squares slope per step


def steps_to_limit(steps: Sequence[float], values: Sequence[float], limit: float) -> WallForecast | None:
    """Forecast when ``values`` (one per step) reach ``limit``; None when the fitted trend is not growing.

    The point estimate divides the headroom by the least-squares slope. The range treats the series as a random
    walk with drift (a leak adds a random amount each step): the per-step increments give the mean growth ``m`` and
    its spread ``s``; the mean growth over the next ``k`` steps lies, with 95% confidence, within
    ``m ± t975(n-1) · s · sqrt(1/n + 1/k)`` (estimation error of ``m`` plus the randomness of the ``k`` future
    increments), ``n`` increments, ``k`` the point estimate. The range is that headroom divided by the interval's
    ends, widened to whole steps (the wall is met at a whole step).
    """
    if len(values) < 3 or len(values) != len(steps):
        return None
    slope, _ = linear_fit(steps, values)
    headroom = limit - values[-1]
    if slope <= 0:
        return None
    point = max(0.0, headroom / slope)
    if headroom <= 0:
        return WallForecast(0.0, 0.0, 0.0, slope)
    increments = [(v1 - v0) / (s1 - s0) for (s0, v0), (s1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:]))
                  if s1 > s0]
    n = len(increments)
    mean = sum(increments) / n
    spread = math.sqrt(sum((x - mean) ** 2 for x in increments) / (n - 1)) if n > 1 else abs(mean)
    horizon = max(1.0, point)
    delta = t975(max(1, n - 1)) * spread * math.sqrt(1.0 / n + 1.0 / horizon)
    fast, slow = mean + delta, mean - delta
    low = math.floor(headroom / fast) if fast > 0 else 0.0
    high = math.ceil(headroom / slow) if slow > 0 else None
    low = min(low, math.floor(point))
    if high is not None:
        high = max(high, math.ceil(point))
    return WallForecast(point, float(low), None if high is None else float(high), slope)


# ---------------------------------------------------------------- warmup or contention

@dataclass
class SlowStart:
    """Why early steps were slower than the steady step (see :func:`classify_slow_steps`)."""

    labels: list[str]          # per step: "steady", "warmup" (more own work), "contention" (same work, more time)
    contention_sec: float      # wall time above the steady step with no extra own CPU time behind it


def classify_slow_steps(wall: Sequence[float], cpu: Sequence[float], steady_wall: float, steady_cpu: float,
                        tolerance: float = 0.1) -> SlowStart:
    """Tell warmup (the process did more work) from contention (the same work took longer) in slow steps.

    ``wall`` and ``cpu`` are per-step wall seconds and the process's CPU seconds (``time.process_time``, all
    threads), ``steady_wall`` and ``steady_cpu`` the steady step's. A step whose wall time is within ``tolerance`` of
    the steady wall time is steady. Of a slow step's excess wall time, the part its extra CPU time explains (converted
    to wall time at the steady CPU-per-wall rate) is warmup, the rest contention; the label is the larger part.
    Meaningful where the CPU time is the work (a CPU device): on a GPU the host's CPU time is launch and wait time,
    not the work.
    """
    if len(wall) != len(cpu) or not wall:
        raise ValueError(f"classify_slow_steps needs equal-length non-empty wall and cpu, got {len(wall)} and "
                         f"{len(cpu)}")
    check_number("tolerance", tolerance, low=0)
    wall_per_cpu = steady_wall / steady_cpu if steady_cpu > 0 else 0.0
    labels, contended = [], 0.0
    for w, c in zip(wall, cpu):
        excess = w - steady_wall
        if excess <= tolerance * steady_wall:
            labels.append("steady")
            continue
        extra_work = (c - steady_cpu) * wall_per_cpu if c > steady_cpu * (1 + tolerance) else 0.0
        part_warm = min(excess, extra_work)
        contended += excess - part_warm
        labels.append("warmup" if part_warm >= excess - part_warm else "contention")
    return SlowStart(labels, contended)


def step_ranges(steps: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive steps as (first, last) ranges: ``[1, 2, 3, 7]`` → ``[(1, 3), (7, 7)]``."""
    out: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if out and step == out[-1][1] + 1:
            out[-1] = (out[-1][0], step)
        else:
            out.append((step, step))
    return out


def ranges_text(ranges: list[tuple[int, int]]) -> str:
    """``[(1, 3), (7, 7)]`` → ``1–3, 7``."""
    return ", ".join(f"{a}–{b}" if b != a else str(a) for a, b in ranges)


__all__ = [
    "median", "quantile", "iqr", "linear_fit", "mann_whitney_less", "t975", "WarmupDetector",
    "WindowedRate", "generation_period", "WallForecast", "steps_to_limit", "SlowStart", "classify_slow_steps",
    "step_ranges", "ranges_text"
]
