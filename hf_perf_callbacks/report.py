"""``hf-perf report OUTPUT_DIR``: a text summary and PNG plots of a training run's ``perf_log.jsonl``.

```python
from hf_perf_callbacks.report import load_run, summarize, write_plots
run = load_run("outputs/my_run")
print(summarize(run))
write_plots(run)            # outputs/my_run/plots/{throughput,memory,phases,tuner}.png
```

The log may come from a killed run (truncated lines, no summaries): what can be computed from the step lines is.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

from .reporting import PERF_LOG
from .stats import median
from .timeline import PHASES

logger = logging.getLogger("hf_perf_callbacks")

TRAINER_STATE = "trainer_state.json"
TUNER_SPLIT = "tuner_split.json"
PHASE_COLORS = {"data_wait": "tab:red", "generation": "tab:orange", "compute": "tab:blue", "eval": "tab:green",
                "save": "tab:purple"}
MAX_EVENTS = 40          # events listed in full; beyond that the first and last halves
DPI = 100

HOW_TO = ("perf_log.jsonl is written into the trainer's output_dir during trainer.train() when the callbacks are "
          "attached: `from hf_perf_callbacks import default_callbacks; trainer = Trainer(..., "
          "callbacks=default_callbacks())`. `hf-perf demo --output_dir DIR` makes a sample run.")


class ReportError(ValueError):
    """The run directory cannot be reported on (missing, or without a readable perf log)."""


@dataclass
class RunLog:
    """Everything parsed from a run directory.

    ``summaries`` holds the last summary per source written after the last run header, so a resumed session
    that was killed does not show the previous session's stale summary. A fresh run written into a reused
    ``output_dir`` (a run header of a new session, starting at step 0) replaces what the log held before it;
    ``replaced_runs`` counts how many earlier runs were dropped that way.
    """
    output_dir: str
    runs: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    summaries: dict[str, dict] = field(default_factory=dict)
    log_history: list[dict] = field(default_factory=list)
    skipped_lines: int = 0
    replaced_runs: int = 0


# ---------------------------------------------------------------- loading
def load_run(output_dir: str) -> RunLog:
    """Parse ``OUTPUT_DIR/perf_log.jsonl`` (and ``trainer_state.json`` when present); garbled lines are counted."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        raise ReportError(f"{output_dir!r} is not a directory: expected a training run's output_dir holding "
                          f"{PERF_LOG}. {HOW_TO}")
    path = os.path.join(output_dir, PERF_LOG)
    if not os.path.isfile(path):
        raise ReportError(f"no {PERF_LOG} in {output_dir!r}: the run was trained without the hf_perf_callbacks "
                          f"callbacks, or this is not its output_dir. {HOW_TO}")
    run = RunLog(output_dir=output_dir)
    summaries: dict[str, dict] = {}
    session = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    run.skipped_lines += 1
                    continue
                kind = entry.get("type") if isinstance(entry, dict) else None
                if kind == "run":
                    if entry.get("session", session) != session:
                        if not _num(entry.get("resumed_from_step")) and (run.steps or run.events):
                            run.replaced_runs += 1          # a fresh run in a reused output_dir: start over
                            run.runs, run.steps, run.events = [], [], []
                        session = entry.get("session")
                    run.runs.append(entry)
                    summaries = {}
                elif kind == "step" and _num(entry.get("step")) is not None:
                    run.steps.append(entry)
                elif kind == "event":
                    run.events.append(entry)
                elif kind == "summary":
                    summaries[str(entry.get("source"))] = entry
                else:
                    run.skipped_lines += 1
    except OSError as error:
        raise ReportError(f"cannot read {path}: {error}") from error
    run.summaries = summaries
    if not (run.runs or run.steps or run.events or run.summaries):
        what = f"only {run.skipped_lines} unreadable line(s)" if run.skipped_lines else "nothing"
        raise ReportError(f"{path} holds {what}: the run stopped before its first step was logged, or the log was "
                          f"written by something else. {HOW_TO}")
    run.log_history = _load_log_history(os.path.join(output_dir, TRAINER_STATE))
    return run


def _load_log_history(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            history = json.load(f).get("log_history", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []


# ---------------------------------------------------------------- helpers
def _num(value) -> float | None:
    """``value`` as a finite float, else None (bools count as 0/1)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def unique_steps(run: RunLog) -> list[dict]:
    """Step lines ordered by step, one per step (a step re-run after a resume keeps its latest line)."""
    by_step = {}
    for s in run.steps:
        by_step[int(s["step"])] = s
    return [by_step[k] for k in sorted(by_step)]


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in steps:
        v = _num(s.get(key))
        if v is not None:
            xs.append(int(s["step"]))
            ys.append(v)
    return xs, ys


def _last(steps: list[dict], key: str) -> float | None:
    for s in reversed(steps):
        v = _num(s.get(key))
        if v is not None:
            return v
    return None


def _train_sec(step: dict) -> float | None:
    """A step line's training time as the meter counts it: its wall time minus evaluation and saving."""
    wall = _num(step.get("perf/step_wall_sec", step.get("perf/step_time")))
    if wall is None:
        return None
    return wall - sum(_num(step.get(f"perf/phase_sec/{p}")) or 0.0 for p in ("eval", "save"))


def _perf_headers(run: RunLog) -> list[dict]:
    return [r for r in run.runs if r.get("source") == "perf"]


def _split_text(split) -> str:
    """``4×2`` for a tuner split written as a dict (micro_batch, grad_accum); anything else as it is."""
    if isinstance(split, dict) and "micro_batch" in split:
        return f"{split['micro_batch']}×{split.get('grad_accum', '?')}"
    return "?" if split is None else str(split)


def _warmup_end_step(steps: list[dict], runs: list[dict]) -> int | None:
    """The first steady step: the warmup is decided a few steps late (it needs confirming steps), so the step
    where ``perf/warmup_done`` turns 1 is not it; the segment start plus ``perf/warmup_steps`` is."""
    for s in steps:
        if _num(s.get("perf/warmup_done")) == 1 and _num(s.get("perf/warmup_steps")) is not None:
            starts = [_num(r.get("resumed_from_step")) or 0 for r in runs if r.get("source") == "perf"
                      and (_num(r.get("resumed_from_step")) or 0) < s["step"]]
            return int(max(starts, default=0) + s["perf/warmup_steps"] + 1)
    return None


def figures(run: RunLog) -> dict:
    """The headline numbers: from the summaries when the run finished, else computed from the step lines."""
    steps = unique_steps(run)
    perf = run.summaries.get("perf", {})
    mem = run.summaries.get("mem", {})
    cache = run.summaries.get("cache", {})
    header = (_perf_headers(run) or [{}])[-1]
    mem_header = ([r for r in run.runs if r.get("source") == "mem"] or [{}])[-1]

    tokens = sum(_num(s.get("perf/tokens")) or 0.0 for s in steps)
    train = sum(_train_sec(s) or 0.0 for s in steps)
    steady_lines = [s for s in steps if _num(s.get("perf/steady")) == 1]
    steady = steady_lines or steps
    mfus = [v for v in (_num(s.get("perf/mfu")) for s in steady) if v is not None]
    steady_secs = [v for v in map(_train_sec, steady_lines) if v is not None]
    phase_sums = {p: sum(_num(s.get(f"perf/phase_sec/{p}")) or 0.0 for s in steps) for p in PHASES}
    phase_total = sum(phase_sums.values())
    used = [v for s in steps for v in (_num(s.get("mem/peak_gb")), _num(s.get("mem/device_used_gb"))) if v is not None]
    cache_events = [e for e in run.events if e.get("source") == "cache"]

    def pick(summary: dict, key: str, fallback):
        value = summary.get(key)
        return value if value is not None else fallback

    warmup_done = pick(perf, "warmup_done", _last(steps, "perf/warmup_done"))
    return {
        "device": pick(perf, "device", header.get("device")),
        "device_type": header.get("device_type"),
        "world_size": pick(perf, "world_size", header.get("world_size")),
        "steps": pick(perf, "steps", int(steps[-1]["step"]) if steps else 0),
        "tokens": pick(perf, "tokens", tokens or None),
        "warmup_done": bool(warmup_done) if warmup_done is not None else None,
        "warmup_steps": pick(perf, "warmup_steps", _last(steps, "perf/warmup_steps")),
        "warmup_end_step": _warmup_end_step(steps, run.runs),
        "warmup_overhead_sec": pick(perf, "warmup_overhead_sec", _last(steps, "perf/warmup_overhead_sec")),
        "first_step_slowdown": pick(perf, "first_step_slowdown", _last(steps, "perf/first_step_slowdown")),
        "steady_tokens_per_sec": pick(perf, "steady_tokens_per_sec", _last(steps, "perf/steady_tokens_per_sec")),
        "steady_step_sec": pick(perf, "steady_step_sec", median(steady_secs) if steady_secs else None),
        "mean_tokens_per_sec": pick(perf, "mean_tokens_per_sec", tokens / train if tokens and train else None),
        "mfu": pick(perf, "mfu", median(mfus) if mfus else None),
        "phases": perf.get("phases") or ({p: v / phase_total for p, v in phase_sums.items()} if phase_total else {}),
        "high_water_gb": pick(mem, "high_water_gb", max(used) if used else None),
        "budget_gb": pick(mem, "budget_gb", mem_header.get("budget_gb", _last(steps, "mem/limit_gb"))),
        "stopped_at": pick(mem, "stopped_at", next((e.get("step") for e in run.events
                                                    if e.get("source") == "mem" and e.get("kind") == "stop"), None)),
        "cache_clears": pick(cache, "clears", _last(steps, "cache/clears") or len(cache_events) or None),
        "cache_freed_gb": pick(cache, "freed_gb",                 # cache/freed_gb is per logging window
                               sum(_num(e.get("freed_gb")) or 0.0 for e in cache_events)),
    }


def _events(run: RunLog) -> list[dict]:
    """Logged events plus watchdog summary actions missing from them (their event line was lost), by step."""
    events = list(run.events)
    seen = {(e.get("step"), e.get("action")) for e in events if e.get("source") == "mem"}
    for a in run.summaries.get("mem", {}).get("actions") or []:
        if isinstance(a, dict) and (a.get("step"), a.get("action")) not in seen:
            kind = "stop" if a.get("action") == "stop" else "action"
            events.append({"source": "mem", "kind": kind, **a})
    return sorted(events, key=lambda e: _num(e.get("step")) if _num(e.get("step")) is not None else -1)


def _fmt(value, spec: str, unit: str = "") -> str:
    v = _num(value)
    return f"{format(v, spec)}{unit}" if v is not None else "n/a"


# ---------------------------------------------------------------- summary
def summarize(run: RunLog) -> str:
    """The printed text summary of a run."""
    f = figures(run)
    steps = unique_steps(run)
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
    headers = _perf_headers(run)
    if len(headers) > 1:
        starts = [str(h.get("resumed_from_step", "?")) for h in headers[1:]]
        lines.append(f"resumed: {len(headers)} training sessions in this log; later sessions started from "
                     f"step {', '.join(starts)}")
    elif headers and (_num(headers[0].get("resumed_from_step")) or 0) > 0:
        lines.append(f"resumed: from step {headers[0]['resumed_from_step']}")

    if headers or "perf" in run.summaries or any("perf/tokens_per_sec" in s for s in steps):
        lines.append(f"steady tokens/s: {_fmt(f['steady_tokens_per_sec'], ',.0f')}   "
                     f"(mean incl. warmup {_fmt(f['mean_tokens_per_sec'], ',.0f')})")
        if f["warmup_done"] is False:
            lines.append(f"warmup: not finished after {f['steps']} steps (no steady figures yet: run longer)")
        else:
            parts = [f"{_fmt(f['warmup_steps'], '.0f')} steps"]
            if _num(f["warmup_overhead_sec"]) is not None:
                parts.append(f"overhead {f['warmup_overhead_sec']:.2f} s")
            if _num(f["first_step_slowdown"]) is not None:
                parts.append(f"first step {f['first_step_slowdown']:.2f}x the steady step")
            lines.append("warmup: " + "   ".join(parts))
        if _num(f["mfu"]) is not None:
            lines.append(f"MFU: {f['mfu']:.1%}")
        if f["phases"]:
            split = ", ".join(f"{k} {v:.1%}" for k, v in f["phases"].items() if _num(v) is not None)
            lines.append(f"time split: {split}")
    else:
        lines.append("throughput: no ThroughputMeter data in the log")

    high, budget = _num(f["high_water_gb"]), _num(f["budget_gb"])
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
            kind, action = e.get("kind", "?"), e.get("action")
            label = kind + (f" {action}" if action and action != kind else "")
            extra = (f" ({_split_text(e.get('old_split'))} -> {_split_text(e['new_split'])})" if "new_split" in e
                     else "")
            lines.append(f"  step {e.get('step', '?')}: [{e.get('source', '?')}] {label}{extra}: "
                         f"{e.get('message', '')}")
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


def completion_stats(history: list[dict]) -> dict:
    """GRPO completion lengths over the run's logs (``trainer_state.json``): mean of the logged mean lengths, the
    longest completion, the 90th percentile of the per-log longest, the mean clipped ratio and the number of logs.
    The summary line and the analysis both use these (one figure for "clipped" in one report)."""
    def values(key):
        return [float(h[key]) for h in history if _num(h.get(key)) is not None and not isinstance(h[key], bool)]

    means, maxes, clipped = (values(k) for k in ("completions/mean_length", "completions/max_length",
                                                  "completions/clipped_ratio"))
    p90 = None
    if maxes:
        s, pos = sorted(maxes), 0.9 * (len(maxes) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        p90 = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return {"mean": sum(means) / len(means) if means else None, "max": max(maxes, default=None), "p90": p90,
            "clipped": sum(clipped) / len(clipped) if clipped else None, "logs": len(means)}


def _completion_line(history: list[dict]) -> str | None:
    """GRPO completion lengths from ``trainer_state.json`` over the whole run, when present."""
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
    steps = unique_steps(run)
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


def step_rates(steps: list[dict], period: int = 1) -> tuple[list[int], list[float]]:
    """Tokens per second of training time (eval and save excluded: the steady figure's basis) per step, or per
    generation cycle of ``period`` steps (GRPO counts a cycle's tokens at its generation step), at the cycle's last
    step."""
    xs, ys = [], []
    period = max(1, int(period or 1))
    rows = [s for s in steps if _num(s.get("perf/tokens")) is not None and _train_sec(s)]
    for i in range(0, len(rows) - period + 1, period):
        block = rows[i:i + period]
        seconds = sum(_train_sec(s) for s in block)
        if seconds > 0:
            xs.append(int(block[-1]["step"]))
            ys.append(sum(_num(s.get("perf/tokens")) for s in block) / seconds)
    return xs, ys


def _plot_throughput(ax, run, steps, f) -> str | None:
    header = (_perf_headers(run) or [{}])[-1]
    period = int(_num(header.get("period")) or 1)
    px, py = step_rates(steps, period)
    xs, ys = _series(steps, "perf/tokens_per_sec")
    if not (xs or px):
        return "no perf/tokens_per_sec or perf/tokens in the step lines"
    if px:
        what = "step" if period == 1 else f"generation cycle ({period} steps)"
        ax.plot(px, py, marker="o" if len(px) <= 60 else None, ms=3, lw=1.2, color="tab:blue",
                label=f"tokens/s per {what} (training time)")
    if xs:
        ax.plot(xs, ys, lw=1, ls="--", color="tab:purple", alpha=0.8,
                label="windowed tokens/s (perf/tokens_per_sec: recent steps, wall time incl. eval/save)")
    rx, ry = _series(steps, "perf/rollout_tokens_per_sec")
    if rx:
        ax.plot(rx, ry, lw=1, color="tab:orange", alpha=0.7,
                label="generated tokens / generation time (not decode speed)")
    steady = _num(f["steady_tokens_per_sec"])
    if steady is not None:
        ax.axhline(steady, color="tab:green", ls="--", lw=1.5, label=f"steady {steady:,.0f} tokens/s")
    end = f["warmup_end_step"]
    if end is not None:
        ax.axvline(end - 0.5, color="grey", ls=":", lw=1.5, label=f"warmup end (first steady step {end})")
        n = _num(f["warmup_steps"])
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
    xs, ys = _series(steps, "mem/device_used_gb")
    if not xs:
        return "no mem/device_used_gb in the step lines"
    cpu = f.get("device_type") == "cpu"
    ax.plot(xs, ys, lw=1.5, color="tab:blue", label="process RSS" if cpu else "device memory used")
    px, py = _series(steps, "mem/peak_gb")
    if px:
        ax.plot(px, py, lw=1, ls="--", color="tab:cyan", label="peak")
    lx, ly = _series(steps, "mem/limit_gb")
    if lx:
        ax.plot(lx, ly, lw=1.5, color="black", drawstyle="steps-post", label="budget")
    elif _num(f["budget_gb"]) is not None:
        ax.axhline(f["budget_gb"], lw=1.5, color="black", label="budget")
    used = dict(zip(xs, ys))
    for level, color, name in ((1, "orange", "pressure: warn"), (2, "red", "pressure: critical")):
        pts = [(int(s["step"]), used[int(s["step"])]) for s in steps
               if _num(s.get("mem/pressure")) == level and int(s["step"]) in used]
        if pts:
            ax.scatter(*zip(*pts), color=color, s=28, zorder=3, label=name)
    acts = [e for e in _events(run) if e.get("source") == "mem" and e.get("kind") in ("action", "stop")
            and _num(e.get("step")) is not None]
    for i, e in enumerate(acts):
        color = "red" if e.get("kind") == "stop" else "purple"
        ax.axvline(e["step"], color=color, ls=":", lw=1.2)
        ax.annotate(str(e.get("action") or e.get("kind")), xy=(e["step"], 0.97 - 0.07 * (i % 4)),
                    xycoords=("data", "axes fraction"), xytext=(3, 0), textcoords="offset points",
                    fontsize=8, color=color, va="top")
    _finish(ax, "Process memory (RSS) vs budget" if cpu else "Device memory vs budget", "memory (GB)",
            "center right")
    return None


def _plot_phases(ax, run, steps, f) -> str | None:
    rows = [s for s in steps if any(f"perf/phase_sec/{p}" in s for p in PHASES)]
    if rows:
        size = max(1, math.ceil(len(rows) / 150))       # long runs: mean per bin of steps
        bins = [rows[i:i + size] for i in range(0, len(rows), size)]
        xs = [sum(int(s["step"]) for s in b) / len(b) for b in bins]
        bottom = [0.0] * len(bins)
        for p in PHASES:
            vals = [sum(_num(s.get(f"perf/phase_sec/{p}")) or 0.0 for s in b) / len(b) for b in bins]
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
            v = _num(v) or 0.0
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
    try:
        with open(os.path.join(output_dir, TUNER_SPLIT), encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return []
    probes = [d for d in (saved.get("decisions") or []) if isinstance(d, dict) and d.get("kind") == "probe"] \
        if isinstance(saved, dict) else []
    if not probes:
        return []
    chosen = _split_text(probes[-1].get("new"))
    out = []
    for t in probes[-1].get("trials") or []:
        if not isinstance(t, dict):
            continue
        split = _split_text(t.get("split"))
        out.append({"split": split, "seconds": _num(t.get("split_time")) if not t.get("error") else None,
                    "fits": bool(t.get("fits")), "chosen": split == chosen, "error": t.get("error")})
    return out


def _plot_tuner(ax, run, steps, f) -> str | None:
    mx, my = _series(steps, "tuner/micro_batch")
    gx, gy = _series(steps, "tuner/grad_accum")
    trials = probe_trials(run.output_dir)
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
    decisions = [e for e in _events(run) if (e.get("source") == "tuner" or e.get("kind") == "decision")
                 and _num(e.get("step")) is not None]
    for i, e in enumerate(decisions):
        ax.axvline(e["step"], color="grey", ls=":", lw=1.2, label="tuner decision" if i == 0 else None)
        label = (f"{_split_text(e.get('old_split'))} → {_split_text(e['new_split'])}" if e.get("new_split") is not None
                 else str(e.get("action") or e.get("kind")))
        ax.annotate(label, xy=(e["step"], 0.97 - 0.07 * (i % 4)), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", fontsize=8, color="dimgrey", va="top")
    _finish(ax, "Batch tuner: micro-batch × gradient accumulation", "size (samples / micro-batches)", "lower right")
    return None


# ---------------------------------------------------------------- entry point
def main(output_dir: str, plots: bool = True) -> int:
    """Print the summary of ``output_dir``, write its plots and ``perf_report.md`` (the analysis) and print the top
    findings; 0 on success, 2 (message on stderr) on a ReportError."""
    from .analysis import console_summary, write_analysis

    try:
        run = load_run(output_dir)
        print(summarize(run))
        if plots:
            paths, notes = _plot_all(run, None)
            print("plots:")
            for path in paths:
                print(f"  {path}")
            for note in notes:
                print(f"  ({note})")
    except ReportError as error:
        print(f"hf-perf report: {error}", file=sys.stderr)
        return 2
    try:
        path, findings, notes = write_analysis(output_dir)
    except Exception as error:  # noqa: BLE001 - the summary and plots above stand on their own
        print(f"hf-perf report: the analysis failed ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    print(console_summary(findings, notes=notes))
    print(f"analysis: {path}")
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_perf_callbacks.report", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    cli = parser.parse_args()
    sys.exit(main(cli.output_dir, plots=cli.plots))
