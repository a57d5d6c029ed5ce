"""The PNG plots of ``hf-perf report``: ``throughput.png``, ``memory.png``, ``phases.png`` and ``tuner.png``.

```python
from hf_perf_callbacks.runlog import read_run
from hf_perf_callbacks.plots import write_plots
write_plots(read_run("outputs/my_run"))      # outputs/my_run/plots/{throughput,memory,phases,tuner}.png
```

Each plot reads the headline figures (:func:`hf_perf_callbacks.figures.figures`, the numbers the summary and the
analysis print), the step lines and the tuner's record (:func:`hf_perf_callbacks.splitfile.read_split_file`), and is
drawn to be read at a glance at the size a README shows it (800×450 pixels): one throughput line on the steady
figure's basis with the warmup and the steps slowed by other processes marked, memory on a scale of its own data (GiB)
with the budget as a line only when it is near, phases in words, the tuner's trials and costs. A ``plot_*`` function
draws on a matplotlib figure and returns None, or why it has nothing to draw. Needs matplotlib (the ``plots`` extra).
"""
from __future__ import annotations

import logging
import math
import os

from . import runlog as keys
from .figures import figures, last_value, run_events, train_seconds
from .runlog import PHASES, ReportError, RunLog, StepLine, number
from .splitfile import Decision, SplitFile, read_split_file
from .stats import iqr
from .wording import PHASE_WORDS, split_label, warmup_words

logger = logging.getLogger("hf_perf_callbacks")

PHASE_COLORS = {"data_wait": "tab:red", "generation": "tab:orange", "compute": "tab:blue", "eval": "tab:green",
                "save": "tab:purple"}
SIZE = (8, 4.5)                 # inches at DPI: 800×450 pixels, the width a README shows
DPI = 100
NEAR_BUDGET = 1.5               # the budget is drawn as a line when it is at most this × the highest value shown
MIN_SPAN = 0.1                  # memory's y-axis spans at least this share of its highest value
PLOTS = ("throughput", "memory", "phases", "tuner")


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
    for name in PLOTS:
        fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
        missing = DRAW[name](fig, data)
        if missing:
            notes.append(f"{name}.png skipped: {missing}")
            continue
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths, notes


class PlotData:
    """What the plots read, read once: the run, its step lines, its headline figures and its tuner record."""

    def __init__(self, run: RunLog, steps: list[StepLine], f: dict, split_file: SplitFile | None):
        self.run, self.steps, self.f, self.split_file = run, steps, f, split_file

    @classmethod
    def of(cls, run: RunLog) -> PlotData:
        split_file = read_split_file(run.output_dir, session=run.header().session) if run.output_dir else None
        return cls(run, run.unique_steps(), figures(run), split_file)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for s in self.steps:
            v = s.number(key)
            if v is not None:
                xs.append(s.step)
                ys.append(v)
        return xs, ys

    def tune_decisions(self) -> list[Decision]:
        return [d for d in (self.split_file.decisions if self.split_file else []) if d.kind == "tune"]


# ---------------------------------------------------------------- shared helpers
def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")


def _legend_below(fig, ax, ncol: int = 3) -> None:
    """The legend under the plot, off the data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(ncol, len(handles)), fontsize=8,
                   frameon=False)


def _title(ax, title: str, *notes: str | None) -> None:
    """The title, and under it the plot's notes in smaller grey type (off the data)."""
    ax.set_title(title, fontsize=10, pad=14 if any(notes) else 6)
    words = " · ".join(n for n in notes if n)
    if words:
        ax.annotate(words, xy=(0.5, 1.0), xycoords="axes fraction", xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, color="dimgrey")


def _note(ax, text: str, color: str = "dimgrey") -> None:
    """A line of text in the top left corner of the plot."""
    ax.text(0.01, 0.98, text, transform=ax.transAxes, fontsize=9, color=color, va="top", ha="left",
            bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})


# ---------------------------------------------------------------- throughput
def step_rates(steps: list[StepLine], period: int = 1) -> tuple[list[int], list[float]]:
    """The run's throughput per step, on the steady figure's basis: tokens per second of training time (the meter's
    ``perf/train_sec``), per step or per generation cycle of ``period`` steps (GRPO counts a cycle's tokens at its
    generation step), at the cycle's last step."""
    xs, ys = [], []
    period = max(1, int(period or 1))
    rows = []                                    # (step, tokens, training seconds) of the steps that have both
    for s in steps:
        tokens, train = s.number(keys.PERF_TOKENS), train_seconds(s)
        if tokens is not None and train:
            rows.append((s.step, tokens, train))
    for i in range(0, len(rows) - period + 1, period):
        block = rows[i:i + period]
        seconds = sum(train for _, _, train in block)
        if seconds > 0:
            xs.append(block[-1][0])
            ys.append(sum(tokens for _, tokens, _ in block) / seconds)
    return xs, ys


def plot_throughput(fig, data: PlotData) -> str | None:
    f, steps = data.f, data.steps
    period = int(number(data.run.header("perf").period) or 1)
    xs, ys = step_rates(steps, period)
    if not xs:
        return "no perf/tokens with a training time in the step lines"
    ax = fig.add_subplot()
    what = "step" if period == 1 else f"generation cycle of {period} steps"
    ax.plot(xs, ys, marker="o" if len(xs) <= 60 else None, ms=4, lw=1.5, color="tab:blue",
            label=f"throughput per {what} (tokens / training s)")
    first = f["warmup_end_step"]
    if f["warmup_done"] and first is not None and first > xs[0]:
        ax.axvspan(xs[0] - 0.5, first - 0.5, color="grey", alpha=0.15, lw=0,
                   label=f"warmup ({f['warmup_steps']:.0f} steps; steady from step {first})")
    elif f["warmup_done"] is False:
        _note(ax, f"warmup not finished after {f['steps']} steps: no steady figure yet", color="tab:red")
    steady = number(f["steady_tokens_per_sec"])
    if steady is not None:
        on = [x for x in xs if x in set(f["steady_steps"])] or xs
        ax.hlines(steady, on[0] - 0.5, on[-1] + 0.5, colors="tab:green", linestyles="--", lw=2,
                  label=f"steady throughput {steady:,.0f} tokens/s (its tokens / its training time)")
    contended = [(x, y) for x, y in zip(xs, ys) if any(x - period < s <= x for s in f["contention_steps"])]
    if contended:
        ax.scatter(*zip(*contended), s=90, facecolors="none", edgecolors="tab:red", lw=1.8, zorder=3,
                   label=f"slowed by other processes ({number(f['contention_sec']) or 0:.1f} s lost)")
    _mark_restarts(ax, data)
    _title(ax, "Training throughput (tokens per second of training time; evaluation and saving excluded)",
           warmup_words(f["warmup_steps"], f["first_step_slowdown"], f["warmup_overhead_sec"])
           if f["warmup_done"] else None)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(0, max(ys + [steady or 0.0]) * 1.12)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.grid(alpha=0.3)
    _integer_steps(ax)
    _legend_below(fig, ax, ncol=2)
    return None


def _mark_restarts(ax, data: PlotData) -> None:
    """A dotted line where a ``train()`` call resumed the run (a re-size or a resume): its warmup starts anew."""
    starts = sorted({h.resumed_from_step for h in data.run.headers if h.resumed_from_step > 0})
    for i, step in enumerate(starts):
        ax.axvline(step + 0.5, color="dimgrey", ls=":", lw=1.2,
                   label="resumed (a new train() call: warmup starts anew)" if i == 0 else None)


# ---------------------------------------------------------------- memory
def plot_memory(fig, data: PlotData) -> str | None:
    xs, ys = data.series(keys.MEM_DEVICE_USED_GB)
    if not xs:
        return "no mem/device_used_gb in the step lines"
    ax = fig.add_subplot()
    cpu = data.f.get("device_type") == "cpu"
    ax.plot(xs, ys, lw=1.8, marker="o" if len(xs) <= 60 else None, ms=3, color="tab:blue",
            label="process memory (RSS)" if cpu else "device memory used")
    px, py = data.series(keys.MEM_PEAK_GB)
    if px:
        ax.plot(px, py, lw=1.2, ls=(0, (4, 2)), color="black", label="high-water mark (peak so far)")
    shown = ys + py
    low, high = min(shown), max(shown)
    span = max(high - low, MIN_SPAN * high, 0.01)        # a flat curve stays flat: no zoom into noise
    budget = number(data.f["budget_gb"])
    lx, ly = data.series(keys.MEM_LIMIT_GB)
    lowest = min(ly) if ly else budget                   # the budget is per step: it follows what the run can reach
    moved = bool(ly) and max(ly) > 1.01 * min(ly)
    near = lowest is not None and lowest <= high * NEAR_BUDGET
    if near and budget is not None and lowest is not None:
        if lx:
            label = (f"budget per step ({min(ly):.2f}–{max(ly):.2f} GiB: what the run could reach moved)" if moved
                     else f"budget ({budget:.2f} GiB)")
            ax.plot(lx, ly, lw=1.5, color="tab:red", drawstyle="steps-post", label=label)
            high = max(high, min(max(ly), high * NEAR_BUDGET))
        else:
            ax.axhline(budget, lw=1.5, color="tab:red", label=f"budget ({budget:.2f} GiB)")
            high = max(high, budget)
    used = dict(zip(xs, ys))
    for level, color, name in ((1, "orange", "pressure: warn"), (2, "red", "pressure: critical")):
        pts = [(s.step, used[s.step]) for s in data.steps if s.number(keys.MEM_PRESSURE) == level and s.step in used]
        if pts:
            ax.scatter(*zip(*pts), color=color, s=30, zorder=3, label=name)
    acts = [(e, e.step) for e in run_events(data.run)
            if e.source == "mem" and e.kind in ("action", "stop", "wall") and e.step is not None
            and not (e.kind == "wall" and not e.message.startswith("the memory wall moved"))]
    for i, (e, step) in enumerate(acts):
        color = "red" if e.kind == "stop" else "tab:brown" if e.kind == "wall" else "purple"
        words = "wall moved" if e.kind == "wall" else str(e.details.get("action") or e.kind).replace("_", " ")
        _marker(ax, step, words, color, 0.97 - 0.07 * (i % 4))
    _mark_resizes(ax, data.split_file.decisions if data.split_file else [], top=0.83)
    ax.set_ylim(max(0.0, low - 0.15 * span), high + 0.3 * span)
    notes = []
    growth = last_value(data.steps, keys.MEM_GROWTH_MB_PER_STEP)
    if growth is not None:
        notes.append(f"growth {growth:+.2g} MiB/step (the watchdog's trend fit)")
    if budget is not None and not near:
        notes.append(f"budget {budget:.2f} GiB (off the scale: {budget / high:.0f}x the highest value)")
    walls = sum(1 for e, _ in acts if e.kind == "wall")
    if walls:
        notes.append(f"the wall moved {walls} time(s): memory outside the run changed (see the events)")
    _title(ax, "Process memory (RSS)" if cpu else "Device memory", *notes)
    ax.set_ylabel("memory (GiB)")
    ax.grid(alpha=0.3)
    _integer_steps(ax)
    _legend_below(fig, ax)
    return None


# ---------------------------------------------------------------- phases
def plot_phases(fig, data: PlotData) -> str | None:
    steps, f = data.steps, data.f
    rows = [s for s in steps if any(keys.PERF_PHASE_SEC[p] in s.values for p in PHASES)]
    ax = fig.add_subplot()
    if rows:
        size = max(1, math.ceil(len(rows) / 150))       # long runs: mean per bin of steps
        bins = [rows[i:i + size] for i in range(0, len(rows), size)]
        xs = [sum(s.step for s in b) / len(b) for b in bins]
        bottom = [0.0] * len(bins)
        for p in PHASES:
            vals = [sum(s.number(keys.PERF_PHASE_SEC[p]) or 0.0 for s in b) / len(b) for b in bins]
            if not any(vals):
                continue
            ax.bar(xs, vals, bottom=bottom, width=0.8 * size, color=PHASE_COLORS[p],
                   label=PHASE_WORDS[p] + _share_words((f["phases"] or {}).get(p)))
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, d in enumerate(data.tune_decisions()):
            measured = sorted({step for t in d.trials for step in t.steps})
            if measured:
                ax.axvspan(measured[0] - 0.5, measured[-1] + 0.5, color="grey", alpha=0.15, lw=0, zorder=0,
                           label="steps the tuner measured splits on" if i == 0 else None)
        ax.set_ylim(0, max(bottom) * 1.05 or 1)
        title = ("Time per step by phase, share of the run's time in the legend"
                 + (f" (mean of {size} steps per bar)" if size > 1 else ""))
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
        _integer_steps(ax)
    elif f["phases"]:
        left = 0.0
        for p, v in f["phases"].items():
            v = number(v) or 0.0
            if v <= 0:
                continue
            ax.barh([0], [v * 100], left=left, color=PHASE_COLORS.get(p), label=PHASE_WORDS.get(p, p) + _share_words(v))
            left += v * 100
        ax.set_yticks([])
        ax.set_xlim(0, 100)
        title = "Share of the run's time by phase (run summary)"
        ax.set_xlabel("share of wall time (%)")
    else:
        return "no perf/phase_sec/* in the step lines and no phase split in the summary"
    _title(ax, title, _tuning_cost(data))
    _legend_below(fig, ax, ncol=3)
    return None


def _share_words(share) -> str:
    v = number(share)
    if v is None:
        return ""
    return " (<1%)" if 0 < v < 0.005 else f" ({v:.0%})"


def _tuning_cost(data: PlotData) -> str | None:
    """The tuner's own cost (its decisions' ``cost_sec``) against the run's training time, in words."""
    costs = [d.cost_sec for d in (data.split_file.decisions if data.split_file else []) if d.cost_sec]
    if not costs:
        return None
    total = sum(costs)
    train = sum(train_seconds(s) or 0.0 for s in data.steps)
    share = f" ({total / train:.0%} of {train:.0f} s of training)" if train > 0 else ""
    gains = [d.expected_gain_sec for d in data.tune_decisions() if d.expected_gain_sec is not None]
    gain = f"; expected saving {sum(gains):.1f} s" if gains else ""
    return f"the tuner's own cost: {total:.1f} s{share}{gain}"


# ---------------------------------------------------------------- tuner
def plot_tuner(fig, data: PlotData) -> str | None:
    mx, my = data.series(keys.TUNER_MICRO_BATCH)
    gx, gy = data.series(keys.TUNER_GRAD_ACCUM)
    splits = {x: f"{m:.0f}×{a:.0f}" for x, m, a in zip(mx, my, [dict(zip(gx, gy)).get(x) for x in mx])
              if a is not None}
    decisions = data.split_file.decisions if data.split_file else []
    tuned = [d for d in decisions if d.kind == "tune" and d.trials]
    if not (splits or decisions):
        return "no tuner/* keys in the step lines and no tuner_split.json (no tuner attached)"
    if tuned:
        trials_ax, split_ax = fig.subplots(1, 2, width_ratios=[1.1, 1]) if splits else (fig.add_subplot(), None)
        _draw_trials(trials_ax, tuned[-1])
    else:
        split_ax = fig.add_subplot()
    if split_ax is not None and splits:
        _draw_splits(split_ax, splits, decisions)
    elif split_ax is not None:
        split_ax.set_axis_off()
    return None


def _trial_time(trial) -> tuple[float | None, tuple[float, float] | None]:
    return (trial.median, iqr(trial.samples) if len(trial.samples) >= 2 else None)


def _draw_trials(ax, decision: Decision) -> None:
    """One tuning decision's trials: each split's median measured time with its quartiles; the split kept green."""
    names = [split_label(t.split) for t in decision.trials]
    chosen = split_label(decision.new)
    heights, lows, highs, colors = [], [], [], []
    for t in decision.trials:
        median, quartiles = _trial_time(t)
        heights.append(median or 0.0)
        lows.append(median - quartiles[0] if quartiles and median is not None else 0.0)
        highs.append(quartiles[1] - median if quartiles and median is not None else 0.0)
        ok = t.fits and not t.error and median is not None
        colors.append("tab:green" if split_label(t.split) == chosen and ok else "tab:blue" if ok else "tab:red")
    ax.bar(range(len(names)), heights, color=colors, yerr=[lows, highs], capsize=3, ecolor="dimgrey")
    before = split_label(decision.old)
    ax.set_xticks(range(len(names)), [n + ("\n(before)" if n == before else "\n(chosen)" if n == chosen else "")
                                      for n in names])
    top = max([h + e for h, e in zip(heights, highs)] + [1e-9])
    for i, t in enumerate(decision.trials):
        median = t.median
        if not t.fits or t.error or median is None:
            ax.annotate("out of memory" if t.error or not t.fits else "not measured", (i, 0), ha="center",
                        va="bottom", fontsize=8, color="tab:red", rotation=90, xytext=(0, 3),
                        textcoords="offset points")
        else:
            words = f"{median:.3g} s"
            if t.gain is not None and split_label(t.split) != before:
                words += f"\n{-t.gain:+.0%}"
            ax.annotate(words, (i, median + highs[i]), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                        textcoords="offset points")
    ax.set_ylim(0, top * 1.3)
    kept = "kept" if decision.new == decision.old else "chose"
    title = f"Tuning at step {decision.step}: {kept} {chosen} (green)"
    ax.set_xlabel("split (micro-batch × gradient accumulation)", fontsize=9)
    ax.set_ylabel("measured s per optimizer step (median)")
    ax.grid(alpha=0.3, axis="y")
    cost = f"cost {decision.cost_sec:.1f} s" if decision.cost_sec is not None else None
    gain = (f"expected saving {decision.expected_gain_sec:.1f} s" if decision.expected_gain_sec is not None
            else None)
    _title(ax, title, cost, gain)


def _draw_splits(ax, splits: dict[int, str], decisions: list[Decision]) -> None:
    """The split each step ran with, on a categorical axis of split labels (largest micro-batch on top); the
    decisions that changed it marked with their kind."""
    def micro(label: str) -> int:
        return int(label.split("×")[0])

    levels = sorted(set(splits.values()), key=micro)
    xs = sorted(splits)
    ax.plot(xs, [levels.index(splits[x]) for x in xs], drawstyle="steps-mid", lw=2, color="tab:blue",
            marker="o" if len(xs) <= 60 else None, ms=3)
    ax.set_yticks(range(len(levels)), levels)
    ax.set_ylim(-0.5, len(levels) - 0.5 + 0.4)
    _mark_resizes(ax, decisions)
    _title(ax, "Split per step (micro-batch × accumulation)",
           f"the split stayed {levels[0]}: no re-size" if len(levels) == 1 else None)
    ax.set_ylabel("split")
    ax.grid(alpha=0.3)
    _integer_steps(ax)


DECISION_WORDS = {"tune": "tuned", "memory_check": "memory check", "oom": "out of memory", "watchdog": "watchdog"}


def _mark_resizes(ax, decisions: list[Decision], top: float = 0.97) -> None:
    """A dotted line after each decision that changed the split, labelled with its kind and the change (a decision
    that kept the split changes nothing on a per-step plot: no marker)."""
    for i, d in enumerate(d for d in decisions if d.new != d.old):
        words = f"{DECISION_WORDS.get(d.kind, d.kind)}: {split_label(d.old)} → {split_label(d.new)}"
        _marker(ax, d.step + 0.5, words, "tab:red" if d.kind in ("oom", "watchdog") else "grey", top - 0.08 * (i % 4))


def _marker(ax, x: float, words: str, color: str, height: float) -> None:
    """A dotted vertical line at ``x`` with ``words`` beside it, on the side with room."""
    ax.axvline(x, color=color, ls=":", lw=1.2)
    left, right = ax.get_xlim()
    late = x > (left + right) / 2
    ax.annotate(words, xy=(x, height), xycoords=("data", "axes fraction"), xytext=(-3 if late else 3, 0),
                textcoords="offset points", fontsize=8, color=color if color != "grey" else "dimgrey", va="top",
                ha="right" if late else "left")


DRAW = {"throughput": plot_throughput, "memory": plot_memory, "phases": plot_phases, "tuner": plot_tuner}
