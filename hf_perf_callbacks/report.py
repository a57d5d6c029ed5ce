"""``hf-perf report OUTPUT_DIR``: a text summary and PNG plots of a training run's ``perf_log.jsonl``.

```python
from hf_perf_callbacks.runlog import read_run
from hf_perf_callbacks.report import summarize, write_plots
run = read_run("outputs/my_run")
print(summarize(run))
write_plots(run)            # outputs/my_run/plots/{throughput,memory,phases,tuner}.png
```

The log may come from a killed run (truncated lines, no summaries): what can be computed from the step lines is.
The command (:func:`hf_perf_callbacks.cli.report_command`) reads the log once and hands it to this module and to
:mod:`hf_perf_callbacks.analysis`.
"""
from __future__ import annotations

import logging
import math
import os

from . import runlog as keys
from .figures import completion_stats, figures, last_probe, split_text, train_seconds, warmup_words
from .runlog import PERF_LOG, EventLine, ReportError, RunLog, StepLine, number
from .runlog import PHASES

logger = logging.getLogger("hf_perf_callbacks")

PHASE_COLORS = {"data_wait": "tab:red", "generation": "tab:orange", "compute": "tab:blue", "eval": "tab:green",
                "save": "tab:purple"}
MAX_EVENTS = 40          # events listed in full; beyond that the first and last halves
DPI = 100


def _series(steps: list[StepLine], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in steps:
        v = s.number(key)
        if v is not None:
            xs.append(s.step)
            ys.append(v)
    return xs, ys


def _events(run: RunLog) -> list[EventLine]:
    """Logged events plus watchdog summary actions missing from them (their event line was lost), by step."""
    events = list(run.events)
    seen = {(e.step, e.details.get("action")) for e in events if e.source == "mem"}
    for a in run.summary("mem").get("actions") or []:
        if isinstance(a, dict) and (a.get("step"), a.get("action")) not in seen:
            kind = "stop" if a.get("action") == "stop" else "action"
            step = number(a.get("step"))
            events.append(EventLine("mem", kind, str(a.get("message", "")), int(step) if step is not None else None,
                                    details={k: v for k, v in a.items() if k not in ("step", "message")}))
    return sorted(events, key=lambda e: e.step if e.step is not None else -1)


def _fmt(value, spec: str, unit: str = "") -> str:
    v = number(value)
    return f"{format(v, spec)}{unit}" if v is not None else "n/a"


# ---------------------------------------------------------------- summary
def summarize(run: RunLog) -> str:
    """The printed text summary of a run."""
    f = figures(run)
    steps = run.unique_steps()
    lines = [f"== hf-perf report: {run.output_dir} =="]
    device = f["device"] or "unknown device"
    if f["device_type"] and f["device_type"] not in str(device):
        device += f" ({f['device_type']})"
    lines.append(f"device: {device} × {f['world_size'] or '?'}   steps: {f['steps']}   "
                 f"tokens: {_fmt(f['tokens'], ',.0f')}")
    if run.summaries:
        lines.append("status: finished")
    else:
        lines.append(f"status: the run did not finish (no summary lines: killed, crashed or still running); "
                     f"figures below are computed from {len(steps)} step line(s)")
    headers = [h for h in run.headers if "perf" in h.sources]
    if len(headers) > 1:
        starts = [str(h.resumed_from_step) for h in headers[1:]]
        lines.append(f"resumed: {len(headers)} training sessions in this log; later sessions started from "
                     f"step {', '.join(starts)}")
    elif headers and headers[0].resumed_from_step > 0:
        lines.append(f"resumed: from step {headers[0].resumed_from_step}")

    if headers or "perf" in run.summaries or any(keys.PERF_TOKENS_PER_SEC in s.values for s in steps):
        lines.append(f"steady tokens/s: {_fmt(f['steady_tokens_per_sec'], ',.0f')}   "
                     f"(mean incl. warmup {_fmt(f['mean_tokens_per_sec'], ',.0f')})")
        if f["warmup_done"] is False:
            lines.append(f"warmup: not finished after {f['steps']} steps (no steady figures yet: run longer)")
        else:
            lines.append("warmup: " + warmup_words(f["warmup_steps"], f["first_step_slowdown"],
                                                  f["warmup_overhead_sec"]))
        if number(f["mfu"]) is not None:
            lines.append(f"MFU: {f['mfu']:.1%}")
        if f["phases"]:
            split = ", ".join(f"{k} {v:.1%}" for k, v in f["phases"].items() if number(v) is not None)
            lines.append(f"time split: {split}")
    else:
        lines.append("throughput: no ThroughputMeter data in the log")

    high, budget = number(f["high_water_gb"]), number(f["budget_gb"])
    if high is not None and budget:
        lines.append(f"memory: high-water {high:.2f} GB of a {budget:.2f} GB budget ({high / budget:.0%})")
    elif high is not None:
        lines.append(f"memory: high-water {high:.2f} GB (budget unknown)")
    else:
        lines.append("memory: no MemoryWatchdog data in the log")
    if f["stopped_at"] is not None:
        lines.append(f"stopped: the watchdog stopped training at step {f['stopped_at']} (a checkpoint was saved)")

    if f["cache_clears"] is not None:
        lines.append(f"cache clears: {f['cache_clears']:.0f}, freed {_fmt(f['cache_freed_gb'], '.2f', ' GB')}")

    events = _events(run)
    if events:
        lines.append(f"events ({len(events)}):")
        shown = events if len(events) <= MAX_EVENTS else events[:MAX_EVENTS // 2] + [None] + events[-MAX_EVENTS // 2:]
        for e in shown:
            if e is None:
                lines.append(f"  … {len(events) - MAX_EVENTS} more in {PERF_LOG}")
                continue
            action = e.details.get("action")
            label = e.kind + (f" {action}" if action and action != e.kind else "")
            extra = (f" ({split_text(e.details.get('old_split'))} -> {split_text(e.details['new_split'])})"
                     if "new_split" in e.details else "")
            step = e.step if e.step is not None else "?"
            lines.append(f"  step {step}: [{e.source}] {label}{extra}: {e.message}")
    else:
        lines.append("events: none (no warnings or actions)")

    completions = _completion_line(run.log_history)
    if completions:
        lines.append(completions)
    if run.skipped_lines:
        lines.append(f"note: skipped {run.skipped_lines} unreadable line(s) in {PERF_LOG}")
    if run.replaced_runs:
        lines.append(f"note: {PERF_LOG} also holds {run.replaced_runs} earlier run(s) started afresh in this "
                     "output_dir; only the latest is reported")
    return "\n".join(lines)


def _completion_line(history: list[dict]) -> str | None:
    """GRPO completion lengths from ``trainer_state.json`` over the whole run (:func:`figures.completion_stats`, the
    figures the analysis cites), when present."""
    c = completion_stats(history)
    if not c["logs"]:
        return None
    return (f"completions ({c['logs']} logs): mean length {_fmt(c['mean'], '.1f')}, max {_fmt(c['max'], '.0f')}, "
            f"clipped {_fmt(c['clipped'], '.0%')} (mean over the run)")


# ---------------------------------------------------------------- plots
def write_plots(run: RunLog, out_dir: str | None = None) -> list[str]:
    """Write the PNG plots (default ``OUTPUT_DIR/plots/``); returns the paths written. Skipped plots are logged."""
    paths, notes = _plot_all(run, out_dir)
    for note in notes:
        logger.info("report: %s", note)
    return paths


def _plot_all(run: RunLog, out_dir: str | None) -> tuple[list[str], list[str]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ReportError(f"plots need matplotlib ({error}): pip install 'hf-perf-callbacks[plots]', "
                          f"or pass plots=False") from error
    out_dir = out_dir or os.path.join(run.output_dir, "plots")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise ReportError(f"cannot create the plot directory {out_dir!r}: {error}") from error
    steps = run.unique_steps()
    f = figures(run)
    paths, notes = [], []
    for name, draw in (("throughput", _plot_throughput), ("memory", _plot_memory), ("phases", _plot_phases),
                       ("tuner", _plot_tuner)):
        fig = Figure(figsize=(8, 4.5), dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        missing = draw(ax, run, steps, f)
        if missing:
            notes.append(f"{name}.png skipped: {missing}")
            continue
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths, notes


def step_rates(steps: list[StepLine], period: int = 1) -> tuple[list[int], list[float]]:
    """Tokens per second of training time (eval and save excluded: the steady figure's basis) per step, or per
    generation cycle of ``period`` steps (GRPO counts a cycle's tokens at its generation step), at the cycle's last
    step."""
    xs, ys = [], []
    period = max(1, int(period or 1))
    rows = [s for s in steps if s.number(keys.PERF_TOKENS) is not None and train_seconds(s)]
    for i in range(0, len(rows) - period + 1, period):
        block = rows[i:i + period]
        seconds = sum(train_seconds(s) for s in block)
        if seconds > 0:
            xs.append(block[-1].step)
            ys.append(sum(s.number(keys.PERF_TOKENS) for s in block) / seconds)
    return xs, ys


def _plot_throughput(ax, run, steps, f) -> str | None:
    period = int(number(run.header("perf").period) or 1)
    px, py = step_rates(steps, period)
    xs, ys = _series(steps, keys.PERF_TOKENS_PER_SEC)
    if not (xs or px):
        return "no perf/tokens_per_sec or perf/tokens in the step lines"
    if px:
        what = "step" if period == 1 else f"generation cycle ({period} steps)"
        ax.plot(px, py, marker="o" if len(px) <= 60 else None, ms=3, lw=1.2, color="tab:blue",
                label=f"tokens/s per {what} (training time)")
    if xs:
        ax.plot(xs, ys, lw=1, ls="--", color="tab:purple", alpha=0.8,
                label="windowed tokens/s (perf/tokens_per_sec: recent steps, wall time incl. eval/save)")
    rx, ry = _series(steps, keys.PERF_ROLLOUT_TOKENS_PER_SEC)
    if rx:
        ax.plot(rx, ry, lw=1, color="tab:orange", alpha=0.7,
                label="generated tokens / generation time (not decode speed)")
    steady = number(f["steady_tokens_per_sec"])
    if steady is not None:
        ax.axhline(steady, color="tab:green", ls="--", lw=1.5, label=f"steady {steady:,.0f} tokens/s")
    end = f["warmup_end_step"]
    if end is not None:
        ax.axvline(end - 0.5, color="grey", ls=":", lw=1.5, label=f"warmup end (first steady step {end})")
        n = number(f["warmup_steps"])
        text = f"warmup: {n:.0f} steps" if n is not None else "warmup end"
        ax.annotate(text, xy=(end - 0.5, 0.04), xycoords=("data", "axes fraction"), xytext=(4, 0),
                    textcoords="offset points", fontsize=9, color="dimgrey")
    _finish(ax, "Training throughput", "tokens / s", "lower right")
    return None


def _finish(ax, title: str, ylabel: str, legend: str) -> None:
    """Title, axis labels, a zero baseline, a light grid and the legend of a per-step plot."""
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc=legend, fontsize=8)


def _plot_memory(ax, run, steps, f) -> str | None:
    xs, ys = _series(steps, keys.MEM_DEVICE_USED_GB)
    if not xs:
        return "no mem/device_used_gb in the step lines"
    cpu = f.get("device_type") == "cpu"
    ax.plot(xs, ys, lw=1.5, color="tab:blue", label="process RSS" if cpu else "device memory used")
    px, py = _series(steps, keys.MEM_PEAK_GB)
    if px:
        ax.plot(px, py, lw=1, ls="--", color="tab:cyan", label="peak")
    lx, ly = _series(steps, keys.MEM_LIMIT_GB)
    if lx:
        ax.plot(lx, ly, lw=1.5, color="black", drawstyle="steps-post", label="budget")
    elif number(f["budget_gb"]) is not None:
        ax.axhline(f["budget_gb"], lw=1.5, color="black", label="budget")
    used = dict(zip(xs, ys))
    for level, color, name in ((1, "orange", "pressure: warn"), (2, "red", "pressure: critical")):
        pts = [(s.step, used[s.step]) for s in steps if s.number(keys.MEM_PRESSURE) == level and s.step in used]
        if pts:
            ax.scatter(*zip(*pts), color=color, s=28, zorder=3, label=name)
    acts = [e for e in _events(run) if e.source == "mem" and e.kind in ("action", "stop") and e.step is not None]
    for i, e in enumerate(acts):
        color = "red" if e.kind == "stop" else "purple"
        ax.axvline(e.step, color=color, ls=":", lw=1.2)
        ax.annotate(str(e.details.get("action") or e.kind), xy=(e.step, 0.97 - 0.07 * (i % 4)),
                    xycoords=("data", "axes fraction"), xytext=(3, 0), textcoords="offset points",
                    fontsize=8, color=color, va="top")
    _finish(ax, "Process memory (RSS) vs budget" if cpu else "Device memory vs budget", "memory (GB)",
            "center right")
    return None


def _plot_phases(ax, run, steps, f) -> str | None:
    rows = [s for s in steps if any(keys.PERF_PHASE_SEC[p] in s.values for p in PHASES)]
    if rows:
        size = max(1, math.ceil(len(rows) / 150))       # long runs: mean per bin of steps
        bins = [rows[i:i + size] for i in range(0, len(rows), size)]
        xs = [sum(s.step for s in b) / len(b) for b in bins]
        bottom = [0.0] * len(bins)
        for p in PHASES:
            vals = [sum(s.number(keys.PERF_PHASE_SEC[p]) or 0.0 for s in b) / len(b) for b in bins]
            if not any(vals):
                continue
            ax.bar(xs, vals, bottom=bottom, width=0.8 * size, color=PHASE_COLORS[p], label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylim(0, max(bottom) * 1.25 or 1)           # room for the legend above the bars
        ax.set_title("Time per step by phase" + (f" (mean of {size} steps per bar)" if size > 1 else ""))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("seconds")
    elif f["phases"]:
        left = 0.0
        for p, v in f["phases"].items():
            v = number(v) or 0.0
            if v <= 0:
                continue
            ax.barh([0], [v * 100], left=left, color=PHASE_COLORS.get(p), label=f"{p} {v:.0%}")
            left += v * 100
        ax.set_yticks([])
        ax.set_xlim(0, 100)
        ax.set_title("Share of training time by phase (run summary)")
        ax.set_xlabel("share of training time (%)")
    else:
        return "no perf/phase_sec/* in the step lines and no phase split in the summary"
    ax.grid(alpha=0.3, axis="y" if rows else "x")
    ax.legend(loc="upper center", fontsize=8, ncol=len(PHASES))
    return None


def probe_trials(output_dir: str) -> list[dict]:
    """The tuner's probe trials from ``tuner_split.json``: ``{"split": "8×1", "seconds": s | None, "fits": bool,
    "chosen": bool, "error": str | None}`` per measured split (empty when no probe ran)."""
    probe = last_probe(output_dir)
    if probe is None:
        return []
    chosen = split_text(probe.get("new"))
    out = []
    for t in probe.get("trials") or []:
        if not isinstance(t, dict):
            continue
        split = split_text(t.get("split"))
        out.append({"split": split, "seconds": number(t.get("split_time")) if not t.get("error") else None,
                    "fits": bool(t.get("fits")), "chosen": split == chosen, "error": t.get("error")})
    return out


def _plot_tuner(ax, run, steps, f) -> str | None:
    mx, my = _series(steps, keys.TUNER_MICRO_BATCH)
    gx, gy = _series(steps, keys.TUNER_GRAD_ACCUM)
    trials = probe_trials(run.output_dir) if run.output_dir else []
    if not (mx or gx or trials):
        return "no tuner/* keys in the step lines (no tuner attached)"
    if trials:
        inset = ax.inset_axes([0.55, 0.35, 0.42, 0.45])
        names = [t["split"] for t in trials]
        secs = [t["seconds"] or 0.0 for t in trials]
        colors = ["tab:green" if t["chosen"] else "tab:grey" if t["fits"] else "tab:red" for t in trials]
        inset.bar(range(len(trials)), secs, color=colors)
        inset.set_xticks(range(len(trials)), names, fontsize=7)
        inset.tick_params(axis="y", labelsize=7)
        for i, t in enumerate(trials):
            if t["seconds"] is None:
                inset.annotate("OOM" if t["error"] else "n/a", (i, 0), ha="center", va="bottom", fontsize=7,
                               color="tab:red")
        inset.set_title("probe: s per step outside generation (green: chosen, red: over budget)", fontsize=7)
    if mx:
        ax.plot(mx, my, drawstyle="steps-post", lw=1.8, color="tab:blue", label="micro-batch (per device)")
    if gx:
        ax.plot(gx, gy, drawstyle="steps-post", lw=1.8, ls="--", color="tab:orange", label="gradient accumulation")
    decisions = [e for e in _events(run) if (e.source == "tuner" or e.kind == "decision") and e.step is not None]
    for i, e in enumerate(decisions):
        ax.axvline(e.step, color="grey", ls=":", lw=1.2, label="tuner decision" if i == 0 else None)
        new = e.details.get("new_split")
        label = (f"{split_text(e.details.get('old_split'))} → {split_text(new)}" if new is not None
                 else str(e.details.get("action") or e.kind))
        ax.annotate(label, xy=(e.step, 0.97 - 0.07 * (i % 4)), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", fontsize=8, color="dimgrey", va="top")
    _finish(ax, "Batch tuner: micro-batch × gradient accumulation", "size (samples / micro-batches)", "lower right")
    return None


def print_report(run: RunLog, plots: bool = True) -> None:
    """Print the summary of a parsed run and write its plots (listing them); raises :class:`ReportError`."""
    print(summarize(run))
    if plots:
        paths, notes = _plot_all(run, None)
        print("plots:")
        for path in paths:
            print(f"  {path}")
        for note in notes:
            print(f"  ({note})")
