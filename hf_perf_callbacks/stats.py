"""Pure statistics used by the callbacks: no torch, no transformers, no clock.

Everything here takes numbers and returns numbers, so it is unit tested with exact values.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
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


@dataclass
class WarmupResult:
    """Where warmup ended and what it cost, in units of the samples fed to the detector."""

    warmup_samples: int        # samples before the first stable window
    steady_reference: float    # median of the first stable window
    overhead: float            # sum over warmup samples of (sample - steady_reference), positive parts only
    first_slowdown: float      # first sample / steady_reference
    capped: bool               # True when no stable window was found before the cap


class WarmupDetector:
    """Online steady-state detection that tolerates step-time jitter.

    Once ``2 × window`` samples exist, the steady level ``M`` is the median of the last ``window`` samples and the
    noise ``σ`` the robust spread of their successive differences (1.4826 × MAD / √2: a trend does not count as
    noise, so a still-falling step time is not called stable). The stable band is ``M + max(tolerance × M, 3σ)``: on a quiet
    device the relative tolerance decides, on a jittery one (GRPO's launch-bound generation) the measured noise does.
    Warmup ends at the first sample from which every later sample lies inside the band, provided at least
    ``window`` samples confirm it and the last window does not drift (its fitted change stays inside the band). Without such a point, warmup is declared over at ``max_warmup`` (``capped``).
    The decision is made once and then fixed.
    """

    def __init__(self, window: int = 4, tolerance: float = 0.1, max_warmup: int = 50):
        self.window = check_number("warmup_window", window, low=2, integer=True)
        self.tolerance = check_number("warmup_tolerance", tolerance, low=0, high=1, low_open=True)
        self.max_warmup = check_number("max_warmup_steps", max_warmup, low=0, integer=True)
        self.samples: list[float] = []
        self.result: WarmupResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

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
            self.result = self._result(start, level, capped=False)
        elif n - self.window >= self.max_warmup + self.window:
            self.result = self._result(self.max_warmup, level, capped=True)
        return self.done

    def _result(self, warmup: int, ref: float, capped: bool) -> WarmupResult:
        overhead = sum(max(0.0, v - ref) for v in self.samples[:warmup])
        first = self.samples[0] / ref if ref > 0 else float("nan")
        return WarmupResult(warmup, ref, overhead, first, capped)


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

    def clear(self) -> None:
        self.items.clear()

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
