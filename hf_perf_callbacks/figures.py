"""The headline figures of a parsed run log, shared by ``hf-perf report``'s summary and the written analysis (so both
print the same numbers): from the summaries when the run finished, else computed from the step lines the way the
meter and the watchdog compute them. Pure: no torch, no transformers.
"""
from __future__ import annotations

import json
import os

from . import runlog as keys
from .runlog import SPLIT_FILE, RunHeader, RunLog, StepLine, number
from .stats import median, quantile
from .runlog import PHASES


def last_value(steps: list[StepLine], key: str) -> float | None:
    """The latest finite value of ``key`` in the step lines."""
    for s in reversed(steps):
        v = s.number(key)
        if v is not None:
            return v
    return None


def train_seconds(step: StepLine) -> float | None:
    """A step line's training time as the meter counts it: its wall time minus evaluation and saving."""
    wall = number(step.get(keys.PERF_STEP_WALL_SEC, step.get(keys.PERF_STEP_TIME)))
    if wall is None:
        return None
    return wall - sum(step.number(keys.PERF_PHASE_SEC[p]) or 0.0 for p in ("eval", "save"))


def warmup_end_step(steps: list[StepLine], headers: list[RunHeader]) -> int | None:
    """The first steady step: the warmup is decided a few steps late (it needs confirming steps), so the step
    where ``perf/warmup_done`` turns 1 is not it; the segment start plus ``perf/warmup_steps`` is."""
    for s in steps:
        warmup = s.number(keys.PERF_WARMUP_STEPS)
        if s.number(keys.PERF_WARMUP_DONE) == 1 and warmup is not None:
            starts = [h.resumed_from_step for h in headers if h.resumed_from_step < s.step]
            return int(max(starts, default=0) + warmup + 1)
    return None


def figures(run: RunLog) -> dict:
    """The headline numbers: from the summaries when the run finished, else computed from the step lines."""
    steps = run.unique_steps()
    perf, mem, cache = run.summary("perf"), run.summary("mem"), run.summary("cache")
    header, mem_header = run.header("perf"), run.header("mem")

    tokens = sum(s.number(keys.PERF_TOKENS) or 0.0 for s in steps)
    train = sum(train_seconds(s) or 0.0 for s in steps)
    steady_lines = [s for s in steps if s.number(keys.PERF_STEADY) == 1]
    steady = steady_lines or steps
    mfus = [v for v in (s.number(keys.PERF_MFU) for s in steady) if v is not None]
    steady_secs = [v for v in map(train_seconds, steady_lines) if v is not None]
    phase_sums = {p: sum(s.number(keys.PERF_PHASE_SEC[p]) or 0.0 for s in steps) for p in PHASES}
    phase_total = sum(phase_sums.values())
    used = [v for s in steps for v in (s.number(keys.MEM_PEAK_GB), s.number(keys.MEM_DEVICE_USED_GB))
            if v is not None]
    cache_events = [e for e in run.events if e.source == "cache"]

    def pick(summary: dict, key: str, fallback):
        value = summary.get(key)
        return value if value is not None else fallback

    warmup_done = pick(perf, "warmup_done", last_value(steps, keys.PERF_WARMUP_DONE))
    budget = mem_header.budget_gb if mem_header.budget_gb is not None else last_value(steps, keys.MEM_LIMIT_GB)
    return {
        "device": pick(perf, "device", header.device),
        "device_type": header.device_type,
        "world_size": pick(perf, "world_size", header.world_size),
        "steps": pick(perf, "steps", steps[-1].step if steps else 0),
        "tokens": pick(perf, "tokens", tokens or None),
        "warmup_done": bool(warmup_done) if warmup_done is not None else None,
        "warmup_steps": pick(perf, "warmup_steps", last_value(steps, keys.PERF_WARMUP_STEPS)),
        "warmup_end_step": warmup_end_step(steps, run.headers),
        "warmup_overhead_sec": pick(perf, "warmup_overhead_sec", last_value(steps, keys.PERF_WARMUP_OVERHEAD_SEC)),
        "first_step_slowdown": pick(perf, "first_step_slowdown", last_value(steps, keys.PERF_FIRST_STEP_SLOWDOWN)),
        "steady_tokens_per_sec": pick(perf, "steady_tokens_per_sec",
                                      last_value(steps, keys.PERF_STEADY_TOKENS_PER_SEC)),
        "steady_step_sec": pick(perf, "steady_step_sec", median(steady_secs) if steady_secs else None),
        "mean_tokens_per_sec": pick(perf, "mean_tokens_per_sec", tokens / train if tokens and train else None),
        "mfu": pick(perf, "mfu", median(mfus) if mfus else None),
        "phases": perf.get("phases") or ({p: v / phase_total for p, v in phase_sums.items()} if phase_total else {}),
        "high_water_gb": pick(mem, "high_water_gb", max(used) if used else None),
        "budget_gb": pick(mem, "budget_gb", budget),
        "stopped_at": pick(mem, "stopped_at", next((e.step for e in run.events
                                                    if e.source == "mem" and e.kind == "stop"), None)),
        "cache_clears": pick(cache, "clears", last_value(steps, keys.CACHE_CLEARS) or len(cache_events) or None),
        "cache_freed_gb": pick(cache, "freed_gb",                 # cache/freed_gb is per logging window
                               sum(number(e.details.get("freed_gb")) or 0.0 for e in cache_events)),
    }


def completion_stats(history: list[dict]) -> dict:
    """GRPO completion lengths over the run's logs (``log_history``): mean of the logged mean lengths, the longest
    completion, the 90th percentile of the per-log longest, the mean clipped ratio and the number of logs. The report's
    summary line and the analysis both cite these (one clipped share in one report)."""
    def values(key):
        return [float(h[key]) for h in history if number(h.get(key)) is not None and not isinstance(h[key], bool)]

    means, maxes, clipped = (values(k) for k in ("completions/mean_length", "completions/max_length",
                                                  "completions/clipped_ratio"))
    return {"mean": sum(means) / len(means) if means else None, "max": max(maxes, default=None),
            "p90": quantile(maxes, 0.9) if maxes else None,
            "clipped": sum(clipped) / len(clipped) if clipped else None, "logs": len(means)}


def warmup_words(steps, slowdown, overhead=None) -> str:
    """What the warmup figures say, without contradicting themselves: ``steps`` of warmup (0: none beyond the first
    step), the first step's ``slowdown`` against the steady step (below 1: later steps slowed, not warmup) and the
    ``overhead`` seconds above steady time. Used by the report's summary and the analysis' warmup note."""
    n, slow, over = number(steps), number(slowdown), number(overhead)
    parts = []
    if n:
        parts.append(f"warmup took {n:.0f} step{'s' if n != 1 else ''}")
        if slow is not None and slow >= 1.05:
            parts.append(f"the first step took {slow:.1f}x the steady step")
        if over:
            parts.append(f"{over:.1f} s above steady time")
    elif slow is not None and slow >= 1.05:
        parts.append(f"only the first step was slow ({slow:.1f}x the steady step); no warmup beyond it")
    else:
        parts.append("no warmup: the first step ran at the steady speed")
    if slow is not None and slow < 0.95:
        parts.append(f"the first step was faster than the steady level ({slow:.2f}x): later steps slowed down — "
                     f"longer sequences or other processes, not warmup")
    return "; ".join(parts)


def split_text(split) -> str:
    """``4×2`` for a tuner split written as a dict (micro_batch, grad_accum); anything else as it is."""
    if isinstance(split, dict) and "micro_batch" in split:
        return f"{split['micro_batch']}×{split.get('grad_accum', '?')}"
    return "?" if split is None else str(split)


def last_probe(output_dir: str) -> dict | None:
    """The tuner's latest probe decision (old and new split, the measured trials) from ``tuner_split.json``; None
    when no probe ran or the file is absent or unreadable."""
    try:
        with open(os.path.join(output_dir, SPLIT_FILE), encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return None
    decisions = saved.get("decisions") if isinstance(saved, dict) else None
    probes = [d for d in decisions or [] if isinstance(d, dict) and d.get("kind") == "probe"]
    return probes[-1] if probes else None
