"""The PNG plots of ``hf-perf report``: ``throughput.png``, ``memory.png``, ``phases.png`` and ``tuner.png``.

```python
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.report.plots import write_plots
write_plots(read_run("outputs/my_run"))      # outputs/my_run/plots/{throughput,memory,phases,tuner}.png
```

Each plot reads the headline figures (:func:`hf_perf_callbacks.report.figures.figures`, the numbers the summary and the
analysis print), the step lines and the tuner's record (:func:`hf_perf_callbacks.core.splitfile.read_split_file`), and
is drawn to be read at a glance at the size a README shows it (800×450 pixels): one throughput line on the steady
figure's basis with the warmup and the steps slowed by other processes marked, a steady line per split at its own level,
the long slow stretches shaded (other processes, or unexplained), memory on a scale of its own data (GiB) with the
budget as a line only when it is near, phases in words, the tuner's trials and costs. The words written inside a plot
(restarts, wall moves, the split over each stretch) are placed by their boxes once the layout is settled, so that none
overlaps another (:func:`_place_labels`). A ``plot_*`` function draws on a matplotlib figure and returns None, or why it
has nothing to draw. Needs matplotlib (the ``plots`` extra).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import textwrap
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import keys
from ..core.runlog import PHASES, ActionDetails, ReportError, RunLog, number
from ..core.splitfile import Decision, SplitFile, read_split_file, trial_figures
from ..core.stats import ranges_text, step_ranges
from ..core.wording import PHASE_WORDS, split_label, steady_words, value_range, warmup_words
from ..keys import SPLIT_FILE
from .figures import (
    Figures,
    LogStep,
    SplitLevel,
    figures,
    finite,
    last_value,
    run_events,
    slow_stretches,
    split_column,
    split_levels,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

logger = logging.getLogger("hf_perf_callbacks")

PHASE_COLORS = {"data_wait": "tab:red", "generation": "tab:orange", "rollout_wait": "gold", "reward": "yellowgreen",
                "compute": "tab:blue", "eval": "tab:green", "save": "tab:purple", "log": "tab:brown",
                "own_callbacks": "tab:pink", "user_callbacks": "tab:olive",
                "recompute": "tab:cyan", "unexplained": "tab:gray"}
SIZE = (8, 4.5)                 # inches at DPI: 800×450 pixels, the width a README shows
DPI = 100
NEAR_BUDGET = 1.5               # the budget is drawn as a line when it is at most this × the highest value shown
MIN_SPAN = 0.1                  # memory's y-axis spans at least this share of its highest value


def write_plots(run: RunLog, out_dir: str | None = None) -> list[str]:
    """Write the PNG plots (default ``OUTPUT_DIR/plots/``); returns the paths written. Skipped plots are logged."""
    paths, notes = plot_all(run, out_dir)
    for note in notes:
        logger.info("report: %s", note)
    return paths


def plot_all(run: RunLog, out_dir: str | None) -> tuple[list[str], list[str]]:
    """Write every plot that has data: (paths written, notes on the plots skipped and why)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ReportError(f"plots need matplotlib ({error}): pip install 'hf-perf-callbacks[plots]', "
                          f"or pass --no-plots") from error
    out_dir = out_dir or os.path.join(run.output_dir, "plots")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise ReportError(f"cannot create the plot directory {out_dir!r}: {error}") from error
    data = PlotData.of(run)
    paths, notes = [], []
    for name, draw in DRAW.items():
        fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
        missing = draw(fig, data)
        if missing:
            notes.append(f"{name}.png skipped: {missing}")
            continue
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths, notes


class PlotData:
    """What the plots read, read once: the run, its step lines, its headline figures, its tuner record and the split
    each step ran with (all in one pass over the step lines: the plots are linear in the run's steps)."""

    def __init__(self, run: RunLog, steps: Sequence[LogStep], f: Figures, split_file: SplitFile | None):
        self.run, self.steps, self.f, self.split_file = run, steps, f, split_file
        self.splits = {n: split for n, split in zip(run.step_numbers(), split_column(run)) if split is not None}

    @classmethod
    def of(cls, run: RunLog) -> PlotData:
        split_file = read_split_file(run.output_dir, session=run.header().session) if run.output_dir else None
        return cls(run, run.unique_steps(), figures(run), split_file)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the lines with a number under ``key`` (from the run's column of it)."""
        xs, ys = [], []
        for n, v in zip(self.run.step_numbers(), self.run.column(key)):
            if v == v:
                xs.append(n)
                ys.append(v)
        return xs, ys

    @property
    def decisions(self) -> list[Decision]:
        """The tuner record's decisions (none without a record)."""
        return self.split_file.decisions if self.split_file else []

    def tune_decisions(self) -> list[Decision]:
        return [d for d in self.decisions if d.kind == "tune"]

    def restarts(self) -> list[tuple[int, str, str]]:
        """Each ``train()`` call after the first, named: (the step it resumed after, words, colour) — the tuner's
        switch to another split (``tuner: 4×2 → 8×1``), a re-size with its decision (``out of memory: 4×2 → 2×4``),
        or a resume at the same split; and a decision that changed the split where no restart shows it."""
        decisions = {d.step: d for d in self.decisions if d.kind != "tune"}
        out = []
        for step in sorted({h.resumed_from_step for h in self.run.headers if h.resumed_from_step > 0}):
            before, after = self.splits.get(step), self.splits.get(step + 1)
            d = decisions.get(step)
            if d is not None and d.new != d.old:
                out.append(_decision_mark(d))
            elif before and after and before != after:
                out.append((step, f"tuner: {before} → {after}", "dimgrey"))
            else:
                out.append((step, "resumed", "dimgrey"))
        seen = {step for step, _, _ in out}
        shown = {words.split(": ", 1)[-1] for _, words, _ in out}              # "4×2 → 8×1"
        for d in self.decisions:                                             # a change the step lines do not show
            if d.new != d.old and d.step not in seen and f"{split_label(d.old)} → {split_label(d.new)}" not in shown:
                out.append(_decision_mark(d))
        return sorted(out)


def _decision_mark(d: Decision) -> tuple[int, str, str]:
    """A decision that changed the split, as a restart's (step, words, colour): ``out of memory: 4×2 → 2×4``."""
    words = f"{DECISION_WORDS.get(d.kind, d.kind)}: {split_label(d.old)} → {split_label(d.new)}"
    return d.step, words, "tab:red" if d.kind in ("oom", "watchdog") else "dimgrey"


# ---------------------------------------------------------------- shared helpers
def _integer_steps(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")


def _legend_below(fig: Figure, ax: Axes, ncol: int = 3) -> None:
    """The legend under the plot, off the data: as many columns as the labels' length lets fit the width."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        longest = max(len(label) for label in labels)
        fits = 1 if longest > 55 else 2 if longest > 34 else 3
        fig.legend(handles, labels, loc="outside lower center", ncol=max(1, min(ncol, fits, len(handles))),
                   fontsize=8, frameon=False)


def _title(ax: Axes, title: str, *notes: str | None) -> None:
    """The title, and under it the plot's notes in smaller grey type (off the data), wrapped to the axes' width."""
    words = " · ".join(n for n in notes if n)
    width = max(40, int(ax.get_position().width * 150))      # characters of 8-point type across the axes
    lines = textwrap.wrap(words, width) if words else []
    ax.set_title(title, fontsize=10, pad=4 + 10 * len(lines) if lines else 6)
    if lines:
        ax.annotate("\n".join(lines), xy=(0.5, 1.0), xycoords="axes fraction", xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8, color="dimgrey")


def _note(ax: Axes, text: str, color: str = "dimgrey") -> None:
    """A line of text in the top left corner of the plot."""
    ax.text(0.01, 0.98, text, transform=ax.transAxes, fontsize=9, color=color, va="top", ha="left",
            bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})


#: the phases plot's y axis
PHASES_AXIS = "seconds per step"

#: points drawn per line at most: a longer run is drawn per bin of steps (said on the plot), so that a plot takes the
#: same time to draw whatever the run's length
MAX_POINTS = 2000


def _thin(xs: list[int], ys: list[float],
          reduce: Callable[[list[float]], float] = max) -> tuple[list[int], list[float], int]:
    """At most :data:`MAX_POINTS` points: (each bin's last step, ``reduce`` of its values, steps per bin)."""
    size = max(1, math.ceil(len(xs) / MAX_POINTS))
    starts = range(0, len(xs), size)
    return [xs[min(i + size, len(xs)) - 1] for i in starts], [reduce(ys[i:i + size]) for i in starts], size


# ---------------------------------------------------------------- throughput
def _rates(run: RunLog, period: int) -> tuple[list[int], list[float]]:
    """The run's throughput on the steady figure's basis: tokens per second of training time (the meter's
    ``perf/train_sec``), per block of ``period`` steps (GRPO counts a cycle's tokens at its generation step), at the
    block's last step; from the run's columns (one pass per key over a long run)."""
    columns = zip(run.step_numbers(), run.column(keys.PERF_TOKENS), run.column(keys.PERF_TRAIN_SEC))
    rows = [(n, t, s) for n, t, s in columns if t == t and s == s and s]
    xs, ys = [], []
    for i in range(0, len(rows) - period + 1, period):
        block = rows[i:i + period]
        seconds = sum(s for _, _, s in block)
        if seconds > 0:
            xs.append(block[-1][0])
            ys.append(sum(t for _, t, _ in block) / seconds)
    return xs, ys


def plot_throughput(fig: Figure, data: PlotData) -> str | None:
    f, steps = data.f, data.steps
    period = int(number(data.run.header("perf").period) or 1)
    block = period * max(1, math.ceil(len(steps) / period / MAX_POINTS))     # a long run: per bin of steps
    xs, ys = _rates(data.run, block)
    if not xs:
        return "no perf/tokens with a training time in the step lines"
    ax = fig.add_subplot()
    what = ("step" if block == 1 else f"generation cycle of {period} steps" if block == period
            else f"bin of {block} steps")
    ax.plot(xs, ys, marker="o" if len(xs) <= 60 else None, ms=4, lw=1.5, color="tab:blue",
            label=f"throughput per {what} (its tokens / its training s)")
    steady_list = f.steady_steps
    if f.not_steady:                                    # the meter's own record: the steps it did not count
        for i, (a, b) in enumerate(f.not_steady):
            ax.axvspan(a - 0.5, b + 0.5, color="grey", alpha=0.15, lw=0,
                       label=(f"not in the steady figures: steps {ranges_text(f.not_steady)} (warmup; each "
                              f"train() call starts it anew)") if i == 0 else None)
    if f.warmup_done is False:
        _note(ax, f"warmup not finished after {f.steps} steps: no steady figure yet" if not steady_list else
              f"the latest train() call's warmup had not finished after step {f.steps}: the steady figure is "
              f"the earlier calls'", color="tab:red")
    steady = number(f.steady_tokens_per_sec)
    levels = split_levels(data.run)
    if len(levels) > 1:                                 # two splits, two levels: one line each, never one between
        _steady_levels(ax, levels)
        if steady is not None and steady_list:          # the summary's figure, named (a line would fall between)
            ax.plot([], [], color="none",
                    label=f"steady figure {steady:,.0f} tokens/s: Σ tokens / Σ training s of the {len(steady_list)} "
                          f"steady steps (all splits; each split's level drawn)")
    elif steady is not None and steady_list:
        ax.hlines(steady, steady_list[0] - 0.5, steady_list[-1] + 0.5, colors="tab:green", linestyles="--", lw=2,
                  label=f"steady figure {steady:,.0f} tokens/s: Σ tokens / Σ training s of the {len(steady_list)} "
                        f"steady steps (a slow step weighs by its time)")
    contention = set(f.contention_steps)
    contended = [(x, y) for x, y in zip(xs, ys) if any(s in contention for s in range(x - block + 1, x + 1))]
    if contended:
        ax.scatter([x for x, _ in contended], [y for _, y in contended],
                   s=90, facecolors="none", edgecolors="tab:red", lw=1.8, zorder=3,
                   label=f"slowed by other processes ({number(f.contention_sec) or 0:.1f} s lost)")
    _shade_stretches(ax, data)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    _mark_restarts(ax, data)
    notes = []
    if f.warmup_done:
        notes.append(warmup_words(f.warmup_steps, f.first_step_slowdown, f.warmup_overhead_sec,
                                  f.call_first_step, levels=max(1, len(levels)), in_band=f.warmup_in_band,
                                  tolerance=f.warmup_tolerance))
    if steady_list:
        notes.append(steady_words(steady_list, ranges_text(step_ranges(steady_list))))
    _title(ax, "Training throughput (tokens per second of training time; evaluation and saving excluded)", *notes)
    ax.set_ylabel("tokens / s of training time")
    ax.set_ylim(0, max(ys + [steady or 0.0] + [level.tokens_per_sec for level in levels]) * 1.12)
    ax.grid(alpha=0.3)
    _integer_steps(ax)
    _legend_below(fig, ax, ncol=1)
    _place_labels(fig)
    return None


LEVEL_COLORS = ("tab:green", "tab:purple", "tab:olive", "tab:cyan", "tab:brown")


def _steady_levels(ax: Axes, levels: Sequence[SplitLevel]) -> None:
    """One steady line per stretch of steps at one split, at its level (Σ tokens / Σ training s of its steady
    steps, :func:`~hf_perf_callbacks.report.figures.split_levels`), over its steady steps; one legend entry per
    split, in a colour of its own."""
    by_split: dict[str | None, list[SplitLevel]] = {}
    for level in levels:
        by_split.setdefault(level.split, []).append(level)
    for n, (split, mine) in enumerate(by_split.items()):
        rates = " / ".join(f"{level.tokens_per_sec:,.0f}" for level in mine)
        label = (f"steady at {split or 'one split'}: {rates} tokens/s (Σ tokens / Σ training s of its "
                 f"{sum(len(level.steady) for level in mine)} steady steps)")
        for i, level in enumerate(mine):
            ax.hlines(level.tokens_per_sec, level.steady[0] - 0.5, level.steady[-1] + 0.5,
                      colors=LEVEL_COLORS[n % len(LEVEL_COLORS)], linestyles="--", lw=2,
                      label=label if i == 0 else "")


STRETCH_COLORS = {"contention": "tab:red", "unexplained": "tab:orange"}


def _shade_stretches(ax: Axes, data: PlotData) -> None:
    """Shade the run's slow stretches (:func:`~hf_perf_callbacks.report.figures.slow_stretches`), one legend entry
    per cause with the steps and the seconds lost: other processes, or unexplained."""
    stretches = slow_stretches(data.run)
    for cause, color in STRETCH_COLORS.items():
        mine = [s for s in stretches if s.cause == cause]
        if not mine:
            continue
        ranges = ranges_text([(s.first, s.last) for s in mine[:4]]) + (", …" if len(mine) > 4 else "")
        speed = value_range([s.share for s in mine], ".0%")
        lost = sum(s.lost_sec for s in mine)
        if cause == "contention":
            why = (f"other processes (wall/CPU {value_range([s.wall_over_cpu or 0.0 for s in mine], '.1f')} "
                   f"against {value_range([s.steady_wall_over_cpu or 0.0 for s in mine], '.1f')})")
        else:
            why = ("cause unexplained (CPU time rose with it)" if any(s.wall_over_cpu is not None for s in mine)
                   else "cause unexplained")
        for i, s in enumerate(mine):
            ax.axvspan(s.first - 0.5, s.last + 0.5, color=color, alpha=0.12, lw=0, zorder=0,
                       label=(f"slow stretch{'es' if len(mine) > 1 else ''}, {why}: steps {ranges} at {speed} of "
                              f"the split's speed, {lost:.1f} s lost") if i == 0 else None)


def _mark_restarts(ax: Axes, data: PlotData) -> None:
    """A dotted line where a ``train()`` call resumed the run (the tuner's switch, a re-size, a resume: its warmup
    starts anew), named: few are named beside their line; more get the split in effect written over each stretch
    between them, and one legend entry."""
    restarts = data.restarts()
    if not restarts:
        return
    if len(restarts) <= 2:
        for step, words, color in restarts:
            _marker(ax, step + 0.5, words, color)
        return
    tuned = all(words.startswith("tuner") for _, words, _ in restarts)
    for i, (step, _, color) in enumerate(restarts):
        ax.axvline(step + 0.5, color=color, ls=":", lw=1.1,
                   label=(f"{len(restarts)} switches between splits by the tuner (a new train() call each; the split "
                          f"in effect written above each stretch)" if tuned else
                          f"{len(restarts)} restarts (a new train() call each: the tuner's switches, re-sizes, "
                          f"resumes; the split in effect written above each stretch)") if i == 0 else None)
    if len(restarts) > MAX_NAMED or not data.splits:
        return
    edges = [min(data.splits) - 0.5] + [step + 0.5 for step, _, _ in restarts] + [max(data.splits) + 0.5]
    for a, b in zip(edges, edges[1:]):
        inside = [data.splits[x] for x in data.splits if a < x < b]
        if inside:                  # placed with the others: stretches too narrow for their split merge into one
            _PENDING.setdefault(ax, []).append(_Label(a, inside[0], "dimgrey", "stretch", b))


MAX_NAMED = 8                   # restarts named one by one on a plot; beyond that, one legend entry


# ---------------------------------------------------------------- memory
def _memory_budget(ax: Axes, data: PlotData, high: float) -> tuple[bool, float]:
    """Draw the budget where it is near the curves (per step when the log has it): (drawn, the new top)."""
    budget = data.f.budget_gb
    lx, ly, _ = _thin(*data.series(keys.MEM_LIMIT_GB), reduce=min)   # a long run: each bin's lowest budget
    lowest = min(ly) if ly else budget                   # the budget is per step: it follows what the run can reach
    near = lowest is not None and lowest <= high * NEAR_BUDGET
    if not near or budget is None:
        return near, high
    if lx:
        moved = max(ly) > 1.01 * min(ly)
        label = (f"budget per step ({min(ly):.2f}–{max(ly):.2f} GiB: what the run could reach moved)" if moved
                 else f"budget ({budget:.2f} GiB)")
        ax.plot(lx, ly, lw=1.5, color="tab:red", drawstyle="steps-post", label=label)
        return near, max(high, min(max(ly), high * NEAR_BUDGET))
    ax.axhline(budget, lw=1.5, color="tab:red", label=f"budget ({budget:.2f} GiB)")
    return near, max(high, budget)


def _memory_marks(ax: Axes, data: PlotData, used: dict[int, float]) -> int:
    """Mark the pressure levels and the watchdog's actions and wall moves; returns how often the wall moved."""
    for level, color, name in ((1, "orange", "pressure: warn"), (2, "red", "pressure: critical")):
        pts = [(s.step, used[s.step]) for s in data.steps if s.number(keys.MEM_PRESSURE) == level and s.step in used]
        if pts:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], color=color, s=30, zorder=3, label=name)
    acts = [(e, e.step) for e in run_events(data.run)
            if e.source == "mem" and e.kind in ("action", "stop", "wall") and e.step is not None
            and not (e.kind == "wall" and not e.message.startswith("the memory wall moved"))]
    for e, step in acts:
        color = "red" if e.kind == "stop" else "tab:brown" if e.kind == "wall" else "purple"
        words = ("wall moved" if e.kind == "wall" else
                 str(ActionDetails.from_details(e.details).action or e.kind).replace("_", " "))
        _marker(ax, step, words, color)
    return sum(1 for e, _ in acts if e.kind == "wall")


def _memory_notes(data: PlotData, near: bool, high: float, walls: int) -> list[str]:
    notes = []
    growth = last_value(data.steps, keys.MEM_GROWTH_MB_PER_STEP)
    if growth is not None:
        notes.append(f"growth {growth:+.2g} MiB/step (the watchdog's trend fit)")
    budget = data.f.budget_gb
    if budget is not None and not near:
        notes.append(f"budget {budget:.2f} GiB (off the scale: {budget / high:.0f}x the highest value)")
    if walls:
        notes.append(f"the wall moved {walls} time(s): memory outside the run changed (see the events)")
    return notes


def plot_memory(fig: Figure, data: PlotData) -> str | None:
    all_x, all_y = data.series(keys.MEM_DEVICE_USED_GB)
    if not all_x:
        return "no mem/device_used_gb in the step lines"
    ax = fig.add_subplot()
    cpu = data.f.device_type == "cpu"
    xs, ys, binned = _thin(all_x, all_y)                # a long run: the largest value of each bin of steps
    ax.plot(xs, ys, lw=1.8, marker="o" if len(xs) <= 60 else None, ms=3, color="tab:blue",
            label=("process memory (RSS)" if cpu else "device memory used")
            + (f", the largest of each {binned} steps" if binned > 1 else ""))
    px, py, _ = _thin(*data.series(keys.MEM_PEAK_GB))
    if px:
        ax.plot(px, py, lw=1.2, ls=(0, (4, 2)), color="black", label="high-water mark (peak so far)")
    shown = ys + py
    low, high = min(shown), max(shown)
    span = max(high - low, MIN_SPAN * high, 0.01)        # a flat curve stays flat: no zoom into noise
    near, top = _memory_budget(ax, data, high)
    walls = _memory_marks(ax, data, dict(zip(all_x, all_y)))
    ax.set_ylim(max(0.0, low - 0.15 * span), top + 0.3 * span)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    _mark_restarts(ax, data)                 # a split change moves memory: the switch that explains a step in it
    _title(ax, "Process memory (RSS)" if cpu else "Device memory", *_memory_notes(data, near, top, walls))
    ax.set_ylabel("memory (GiB)")
    ax.grid(alpha=0.3)
    _integer_steps(ax)
    _legend_below(fig, ax)
    _place_labels(fig)
    return None


# ---------------------------------------------------------------- phases
def _phase_bars(ax: Axes, data: PlotData, columns: Sequence[Sequence[float]], rows: list[int]) -> str:
    """Seconds per step by phase, stacked (long runs: the mean per bin of steps); returns the title."""
    numbers = data.run.step_numbers()
    size = max(1, math.ceil(len(rows) / 150))
    bins = [rows[i:i + size] for i in range(0, len(rows), size)]
    xs = [sum(numbers[i] for i in b) / len(b) for b in bins]
    bottom = [0.0] * len(bins)
    for p, column in zip(PHASES, columns):
        vals = [sum(v for v in (column[i] for i in b) if v == v) / len(b) for b in bins]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottom, width=0.8 * size, color=PHASE_COLORS[p],
               label=PHASE_WORDS[p] + _share_words(data.f.phases.get(p)))
        bottom = [b + v for b, v in zip(bottom, vals)]
    measured = step_ranges(step for d in data.tune_decisions() for t in d.trials for step in t.steps)
    for i, (a, b) in enumerate(measured):
        ax.axvspan(a - 0.5, b + 0.5, color="grey", alpha=0.15, lw=0, zorder=0,
                   label=f"steps the tuner measured splits on ({ranges_text(measured)})" if i == 0 else None)
    ax.set_ylim(0, max(bottom) * 1.05 or 1)
    ax.set_ylabel(PHASES_AXIS)
    ax.grid(alpha=0.3, axis="y")
    _integer_steps(ax)
    return ("Time per step by phase, share of the run's time in the legend"
            + (f" (mean of {size} steps per bar)" if size > 1 else ""))


def _phase_shares(ax: Axes, phases: dict[str, float]) -> str:
    """The run summary's phase split as one bar of shares; returns the title."""
    left = 0.0
    for p, v in phases.items():
        if v <= 0:
            continue
        ax.barh([0], [v * 100], left=left, color=PHASE_COLORS.get(p), label=PHASE_WORDS.get(p, p) + _share_words(v))
        left += v * 100
    ax.set_yticks([])
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of wall time (%)")
    return "Share of the run's time by phase (run summary)"


def plot_phases(fig: Figure, data: PlotData) -> str | None:
    columns = [data.run.column(keys.PERF_PHASE_SEC[p]) for p in PHASES]     # the run's columns, one per phase
    rows = [i for i, seconds in enumerate(zip(*columns)) if any(v == v for v in seconds)]
    if not rows and not data.f.phases:
        return "no perf/phase_sec/* in the step lines and no phase split in the summary"
    ax = fig.add_subplot()
    title = _phase_bars(ax, data, columns, rows) if rows else _phase_shares(ax, data.f.phases)
    _title(ax, title, _tuning_cost(data))
    _legend_below(fig, ax, ncol=3)
    return None


def _share_words(share: object) -> str:
    v = number(share)
    if v is None:
        return ""
    return " (<1%)" if 0 < v < 0.005 else f" ({v:.0%})"


def _tuning_cost(data: PlotData) -> str | None:
    """The tuner's own cost (its decisions' ``cost_sec``) against the run's training time, in words."""
    costs = [d.cost_sec for d in data.decisions if d.cost_sec]
    if not costs:
        return None
    total = sum(costs)
    train = sum(finite(data.run.column(keys.PERF_TRAIN_SEC)))
    share = f" ({total / train:.0%} of {train:.0f} s of training)" if train > 0 else ""
    gains = [d.expected_gain_sec for d in data.tune_decisions() if d.expected_gain_sec is not None]
    gain = f"; expected saving {sum(gains):.1f} s" if gains else ""
    return f"the tuner's own cost: {total:.1f} s{share}{gain}"


# ---------------------------------------------------------------- tuner
def tuner_missing(data: PlotData) -> tuple[str, int] | None:
    """Why the tuner plot has nothing to draw, as data: ("record_missing", the tuner's decisions in the events: a
    tuner was attached, its record is what is missing) or ("no_tuner", 0); None when it has something."""
    if data.splits or data.decisions:
        return None
    logged = sum(1 for e in data.run.events if e.source == "tuner" and e.kind == "decision")
    return ("record_missing", logged) if logged else ("no_tuner", 0)


def plot_tuner(fig: Figure, data: PlotData) -> str | None:
    missing = tuner_missing(data)
    if missing is not None:
        code, logged = missing
        if code == "record_missing":
            return (f"no tuner/* keys in the step lines and no {SPLIT_FILE} of this run; the tuner's "
                    f"{logged} decision(s) are in the events")
        return f"no tuner/* keys in the step lines and no {SPLIT_FILE} (no tuner attached)"
    splits, tuned = data.splits, data.tune_decisions()
    latest = tuned[-1] if tuned else None
    drawn = latest is not None and any(t.status != "reference" and (t.measured or t.error)
                                       for t in trial_figures(latest))
    if drawn and splits:
        trials_ax, split_ax = fig.subplots(1, 2, width_ratios=[1.1, 1])
    elif drawn:
        trials_ax, split_ax = fig.add_subplot(), None
    else:
        trials_ax, split_ax = None, fig.add_subplot() if splits else None
    if trials_ax is not None and latest is not None:
        _draw_trials(trials_ax, latest)
    if split_ax is not None:
        _draw_splits(split_ax, splits, data)
        if latest is not None and not drawn:       # a tuning that measured no other split: said in a line of text
            _note(split_ax, _untried_words(latest))
    elif not drawn:
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, _untried_words(latest) if latest is not None else
                "no tuning decision and no tuner/* keys: nothing to draw", ha="center", va="center", wrap=True,
                fontsize=10)
    _place_labels(fig)
    return None


def _untried_words(decision: Decision) -> str:
    reason = decision.reason.removeprefix("kept the configured split: ")
    return (f"Tuning at step {decision.step}: kept {split_label(decision.new)}, no other split measured"
            + (f"\n({textwrap.fill(reason, 70)})" if reason else ""))


def _draw_trials(ax: Axes, decision: Decision) -> None:
    """One tuning decision's trials: each split's median with its quartiles, the split kept green, and beside each
    the comparison every reader prints (:func:`~hf_perf_callbacks.core.splitfile.trial_figures`)."""
    shown = trial_figures(decision)
    chosen, before = split_label(decision.new), split_label(decision.old)
    heights, lows, highs, colors = [], [], [], []
    for t in shown:
        median = t.median
        heights.append(median or 0.0)
        lows.append(median - t.quartiles[0] if t.quartiles and median is not None else 0.0)
        highs.append(t.quartiles[1] - median if t.quartiles and median is not None else 0.0)
        ok = t.status in ("reference", "measured") and median is not None
        colors.append("tab:green" if t.label == chosen and ok else "tab:blue" if ok else "tab:red")
    ax.bar(range(len(shown)), heights, color=colors, yerr=[lows, highs], capsize=3, ecolor="dimgrey")
    ax.set_xticks(range(len(shown)), [t.label + ("\n(before)" if t.label == before else "\n(chosen)"
                                                 if t.label == chosen else "") for t in shown])
    top = max([h + e for h, e in zip(heights, highs)] + [0.0])
    for i, t in enumerate(shown):
        if t.median is None:
            ax.annotate(t.error or "not measured", (i, 0), ha="center", va="bottom", fontsize=8, color="tab:red",
                        rotation=90, xytext=(0, 3), textcoords="offset points")
            continue
        words = f"{t.median:.3g} s, {len(t.samples)} step{'s' if len(t.samples) != 1 else ''}"
        compared = t.comparison()
        if compared:
            words += "\n" + compared.replace(" than ", "\nthan ")
        ax.annotate(words, (i, t.median + highs[i]), ha="center", va="bottom", fontsize=7, xytext=(0, 3),
                    textcoords="offset points")
    ax.set_ylim(0, (top or 1.0) * 1.45)
    kept = "kept" if decision.new == decision.old else "chose"
    ax.set_xlabel("split (micro-batch × gradient accumulation)", fontsize=9)
    ax.set_ylabel(f"median {shown[0].unit}" if shown else "median s per optimizer step", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    cost = f"cost {decision.cost_sec:.1f} s" if decision.cost_sec is not None else None
    gain = (f"expected saving {decision.expected_gain_sec:.1f} s" if decision.expected_gain_sec is not None
            else None)
    _title(ax, f"Tuning at step {decision.step}: {kept} {chosen} (green)", cost, gain)


def _draw_splits(ax: Axes, splits: dict[int, str], data: PlotData) -> None:
    """The split each step ran with, on a categorical axis of split labels (largest micro-batch on top); the
    restarts that changed it named (the tuner's trials, re-sizes)."""
    levels = sorted(set(splits.values()), key=lambda label: int(label.split("×")[0]))
    index = {label: i for i, label in enumerate(levels)}
    every = sorted(splits)
    xs = every if len(every) <= 60 else [x for i, x in enumerate(every)      # a long run: where it changes
                                         if i in (0, len(every) - 1) or splits[x] != splits[every[i - 1]]
                                         or splits[x] != splits[every[i + 1]]]
    ax.plot(xs, [index[splits[x]] for x in xs], drawstyle="steps-mid", lw=2, color="tab:blue",
            marker="o" if len(xs) <= 60 else None, ms=3)
    ax.set_yticks(range(len(levels)), levels)
    ax.set_ylim(-0.5, len(levels) - 0.5 + 0.6)
    ax.set_xlim(min(every) - 0.7, max(every) + 0.7)
    changed = [r for r in data.restarts() if "→" in r[1]]
    for step, words, color in changed:       # the y-axis names the splits: words only for a few
        if len(changed) <= 2:
            _marker(ax, step + 0.5, words, color)
        else:
            ax.axvline(step + 0.5, color=color, ls=":", lw=1.1)
    tuner_switches = sum(words.startswith("tuner") for _, words, _ in changed)
    _title(ax, "Split per step (micro-batch × accumulation)",
           f"the split stayed {levels[0]}: no re-size" if len(levels) == 1 else
           f"{len(changed)} switches (dotted), {tuner_switches} of them the tuner's" if len(changed) > 2 else None)
    ax.set_ylabel("split")
    ax.grid(alpha=0.3)
    _integer_steps(ax)


DECISION_WORDS = {"tune": "tuned", "memory_check": "memory check", "oom": "out of memory", "watchdog": "watchdog"}


def _marker(ax: Axes, x: float, words: str, color: str) -> None:
    """A dotted vertical line at ``x`` with ``words`` beside it (placed by :func:`_place_labels`: on the side with
    room, in the first row where it overlaps no other text)."""
    ax.axvline(x, color=color, ls=":", lw=1.2)
    _PENDING.setdefault(ax, []).append(_Label(x, words, color if color != "grey" else "dimgrey", "beside"))


# ---------------------------------------------------------------- labels in the plot, placed by their boxes
LABEL_ROWS = 4                  # rows of labels under an axes' top edge; a label finding no room in them is left out
LABEL_GAP = 3.0                 # pixels between two labels, and between a label and its line


@dataclass
class _Label:
    """Words to write inside an axes at step ``x``: beside a marker line ("beside"), or centred over the stretch
    of steps ``x``–``end`` ("stretch": the split in effect between two restarts)."""

    x: float
    words: str
    color: str
    kind: str
    end: float = 0.0


#: the labels waiting to be placed on each axes
_PENDING: weakref.WeakKeyDictionary[Axes, list[_Label]] = weakref.WeakKeyDictionary()


def _place_labels(fig: Figure) -> None:
    """Place every axes' pending labels once the figure's layout is settled (its constrained layout drawn without
    rendering; the labels stay out of it, so the layout they were placed in is the one saved): markers first, then
    the split stretches (consecutive stretches too narrow for their split merged into one label, ``4×2 → 8×1 → 2×4
    (steps 1–9)``). Each takes the first of :data:`LABEL_ROWS` rows under the top edge, on either side of its line,
    where its box overlaps no other text of the axes (a note, a placed label) and stays inside the axes; a label
    with no room is left out, and how many were is said in a last label when it fits."""
    todo = [(ax, labels) for ax in fig.axes if (labels := _PENDING.pop(ax, None))]
    if not todo:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    renderer: RendererBase = canvas.get_renderer()  # type: ignore[no-untyped-call]
    for ax, labels in todo:
        frame = ax.get_window_extent(renderer)
        taken = [_box(t, renderer) for t in ax.texts]
        markers = _merge_markers(ax, sorted((lab for lab in labels if lab.kind == "beside"), key=lambda lab: lab.x),
                                 renderer)
        stretches = _merge_stretches(ax, sorted((lab for lab in labels if lab.kind == "stretch"),
                                                key=lambda lab: lab.x), renderer)
        left_out = sum(not _put(ax, lab, frame, taken, renderer) for lab in markers + stretches)
        if left_out:
            _put(ax, _Label(frame.x1, f"{left_out} label(s) left out: too close together", "dimgrey", "corner"),
                 frame, taken, renderer)


def _box(text: Text, renderer: RendererBase) -> Bbox:
    """A text's box on the canvas, its background box included."""
    patch = text.get_bbox_patch()
    return patch.get_window_extent(renderer) if patch is not None else text.get_window_extent(renderer)


def _text(ax: Axes, words: str, color: str) -> Text:
    text = ax.text(0, 0, words, transform=ax.transAxes, fontsize=8, color=color, ha="left", va="top")
    text.set_in_layout(False)
    return text


def _width(ax: Axes, words: str, renderer: RendererBase) -> float:
    text = _text(ax, words, "black")
    width = text.get_window_extent(renderer).width
    text.remove()
    return float(width)


def _pixels(ax: Axes, x: float) -> float:
    return float(ax.transData.transform((x, 0))[0])


def _merge_markers(ax: Axes, markers: list[_Label], renderer: RendererBase) -> list[_Label]:
    """Markers of the same words closer together than their label is wide as one label: ``wall moved ×3 (steps
    4–5, 11)``."""
    groups: list[list[_Label]] = []
    for lab in markers:
        last = groups[-1][-1] if groups else None
        if last is not None and (last.words, last.color) == (lab.words, lab.color) \
                and _pixels(ax, lab.x) - _pixels(ax, last.x) < _width(ax, lab.words, renderer) + 2 * LABEL_GAP:
            groups[-1].append(lab)
        else:
            groups.append([lab])
    return [g[0] if len(g) == 1 else
            _Label(g[0].x, f"{g[0].words} ×{len(g)} (steps {ranges_text(step_ranges(int(lab.x) for lab in g))})",
                   g[0].color, "beside")
            for g in groups]


def _merge_stretches(ax: Axes, stretches: list[_Label], renderer: RendererBase) -> list[_Label]:
    """Consecutive stretches too narrow for their split's label as one label over them all."""
    out: list[_Label] = []
    for fits, grouped in itertools.groupby(stretches, key=lambda lab: _width(ax, lab.words, renderer) + 2 * LABEL_GAP
                                           <= abs(_pixels(ax, lab.end) - _pixels(ax, lab.x))):
        group = list(grouped)
        if fits or len(group) == 1:
            out += group
        else:
            first, last = math.ceil(group[0].x), math.floor(group[-1].end)
            out.append(_Label(group[0].x, " → ".join(lab.words for lab in group) + f" (steps {first}–{last})",
                              "dimgrey", "stretch", group[-1].end))
    return out


def _put(ax: Axes, lab: _Label, frame: Bbox, taken: list[Bbox], renderer: RendererBase) -> bool:
    """Write ``lab`` in the first free row (see :func:`_place_labels`); False where it finds none (removed)."""
    from matplotlib.transforms import Bbox

    text = _text(ax, lab.words, lab.color)
    box = text.get_window_extent(renderer)
    width, height = box.width, box.height
    at = _pixels(ax, lab.x)
    if lab.kind == "stretch":
        centre = (at + _pixels(ax, lab.end)) / 2
        lefts = [centre - width / 2]
    elif lab.kind == "corner":
        lefts = [frame.x1 - LABEL_GAP - width]
    else:
        right, left = at + LABEL_GAP, at - LABEL_GAP - width
        lefts = [left, right] if at > (frame.x0 + frame.x1) / 2 else [right, left]
    low, high = frame.x0 + LABEL_GAP, frame.x1 - LABEL_GAP - width
    if high < low:
        text.remove()
        return False
    for row in range(LABEL_ROWS):
        top = frame.y1 - LABEL_GAP - row * (height + LABEL_GAP)
        for left in lefts:
            left = min(max(left, low), high)
            spot = Bbox.from_bounds(left, top - height, width, height)
            grown = spot.expanded(1.0, 1.0).padded(LABEL_GAP / 2)
            if spot.y0 >= frame.y0 and not any(grown.overlaps(t) for t in taken):
                text.set_position(tuple(ax.transAxes.inverted().transform((left, top))))
                taken.append(text.get_window_extent(renderer))
                return True
    text.remove()
    return False


#: the plots, in the order they are written: name → the function that draws it
DRAW = {"throughput": plot_throughput, "memory": plot_memory, "phases": plot_phases, "tuner": plot_tuner}


__all__ = ["write_plots", "plot_all", "PlotData", "plot_throughput", "plot_memory", "plot_phases", "plot_tuner"]
