"""``hf-perf report OUTPUT_DIR``: the text summary of a training run's ``perf_log.jsonl`` (its plots:
:mod:`hf_perf_callbacks.report.plots`).

```python
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.report import summarize
print(summarize(read_run("outputs/my_run")))
```

The log may come from a killed run (truncated lines, no summaries): the headline figures are the meter's either way
(:func:`.figures.figures`, the numbers the plots and the written analysis use too), worded as the meter's console
summary words them (:mod:`hf_perf_callbacks.core.wording`). The command reads the log once and hands it to this module,
the plots and the written analysis (:mod:`.render`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .. import keys
from ..core.runlog import PERF_LOG, ActionDetails, DecisionDetails, EventLine, RunLog, number
from ..core.splitfile import read_split_file, trial_figures
from ..core.stats import ranges_text, step_ranges
from ..core.wording import (
    console_line,
    mfu_words,
    phase_line,
    provisional_line,
    split_label,
    steady_words,
    throughput_line,
    warmup_line,
    wrapped,
)
from ..keys import CONSOLE_WIDTH
from .figures import Figures, completion_stats, figures, run_events, trainer_logs

MAX_EVENTS = 40          # events listed in full; beyond that the first and last halves


def _fmt(value: object, spec: str, unit: str = "") -> str:
    v = number(value)
    return f"{format(v, spec)}{unit}" if v is not None else "n/a"


# ---------------------------------------------------------------- summary
def summarize(run: RunLog) -> str:
    """The printed text summary of a run."""
    f = figures(run)
    lines = [f"== hf-perf report: {run.output_dir} =="]
    lines += _run_lines(run, f) + _throughput_lines(run, f) + _memory_lines(f) + _event_lines(run)
    lines += _tuning_lines(run)
    completions = _completion_line(trainer_logs(run))
    if completions:
        lines.append(completions)
    return "\n".join(lines + _log_notes(run))


#: the summary's status line of a log without summary lines (its start), and its throughput line without the meter
UNFINISHED = "status: the run did not finish (no summary lines: killed, crashed or still running)"
NO_METER = "throughput: no ThroughputMeter data in the log"


def _run_lines(run: RunLog, f: Figures) -> list[str]:
    """The device, steps and tokens; whether the run finished; its training sessions."""
    device = f.device or "unknown device"
    if f.device_type and f.device_type not in device:
        device += f" ({f.device_type})"
    lines = [f"device: {device} × {f.world_size or '?'}   steps: {f.steps}   tokens: {_fmt(f.tokens, ',.0f')}"]
    if run.summaries:
        lines.append("status: finished")
    else:
        lines.append(f"{UNFINISHED}; the figures below are the meter's as of its last step line "
                     f"({len(run.unique_steps())} step line(s))")
    headers = [h for h in run.headers if "perf" in h.sources and not h.resize]   # a tuner's switch is no resume
    if len(headers) > 1:
        starts = [str(h.resumed_from_step) for h in headers[1:]]
        lines.append(f"resumed: {len(headers)} training sessions in this log; later sessions started from "
                     f"step {', '.join(starts)}")
    elif headers and headers[0].resumed_from_step > 0:
        lines.append(f"resumed: from step {headers[0].resumed_from_step}")
    return lines


def _throughput_lines(run: RunLog, f: Figures) -> list[str]:
    """The meter's figures: throughput, warmup, the steady steps, MFU, the phase split."""
    metered = (any("perf" in h.sources for h in run.headers) or "perf" in run.summaries
               or any(keys.PERF_TOKENS in s.values for s in run.unique_steps()))
    if not metered:
        return [NO_METER]
    provisional = f.steady_tokens_per_sec is None and f.provisional_tokens_per_sec is not None
    lines = [provisional_line(f.provisional_tokens_per_sec, f.provisional_step_sec, f.provisional_steps,
                              f.mean_tokens_per_sec) if provisional
             else throughput_line(f.steady_tokens_per_sec, f.steady_step_sec, f.mean_tokens_per_sec)]
    if f.warmup_done is not None:
        lines.append("warmup: " + warmup_line(f.warmup_done, f.warmup_steps, f.first_step_slowdown,
                                              f.warmup_overhead_sec, f.steps, f.contention_sec, f.call_first_step,
                                              f.warmup_in_band, f.warmup_tolerance))
    if f.steady_steps:                 # an earlier train() call's steady steps count while the latest warms up
        steady = steady_words(f.steady_steps, ranges_text(step_ranges(f.steady_steps)))
        if f.not_steady:
            single = len(f.not_steady) == 1 and f.not_steady[0][0] == f.not_steady[0][1]
            steady += f"; not in them: step{'' if single else 's'} {ranges_text(f.not_steady)}"
        lines.append(f"steady steps: {steady}")
    if f.mfu is not None:
        lines.append(wrapped(mfu_words(f.mfu, f.mfu_basis, provisional)))
    if f.phases:
        lines.append(phase_line(f.phases))
    return lines


def _memory_lines(f: Figures) -> list[str]:
    """The watchdog's high-water mark against its budget, its stop, the cache clearer's clears."""
    high, budget = f.high_water_gb, f.budget_gb
    if high is not None and budget:
        lines = [f"memory: high-water {high:.2f} GiB of a {budget:.2f} GiB budget ({high / budget:.0%})"]
    elif high is not None:
        lines = [f"memory: high-water {high:.2f} GiB (budget unknown)"]
    else:
        lines = ["memory: no MemoryWatchdog data in the log"]
    if f.stopped_at is not None:
        lines.append(f"stopped: the watchdog stopped training at step {f.stopped_at} (a checkpoint was saved)")
    if f.cache_clears is not None:
        lines.append(f"cache clears: {f.cache_clears:.0f}, freed {_fmt(f.cache_freed_gb, '.2f', ' GiB')}")
    return lines


def _event_line(e: EventLine) -> str:
    action, decision = ActionDetails.from_details(e.details).action, DecisionDetails.from_details(e.details)
    label = e.kind + (f" {action}" if action and action != e.kind else "")
    old, new = (split_label(decision.old_split), split_label(decision.new_split)) if decision else ("", "")
    extra = "" if decision is None else f" (kept {new})" if old == new else f" ({old} -> {new})"
    when = f"step {e.step}" if e.step is not None else "(no step)"
    return "  " + console_line(f"{when}: [{e.source}] {label}{extra}: {e.message}", CONSOLE_WIDTH - 2)   # all: the log


def _event_lines(run: RunLog) -> list[str]:
    """Every event, one line each (beyond :data:`MAX_EVENTS`, the first and last halves)."""
    events = run_events(run)
    if not events:
        return ["events: none (no warnings or actions)"]
    if len(events) <= MAX_EVENTS:
        return [f"events ({len(events)}):"] + [_event_line(e) for e in events]
    return ([f"events ({len(events)}):"] + [_event_line(e) for e in events[:MAX_EVENTS // 2]]
            + [f"  … {len(events) - MAX_EVENTS} more in {PERF_LOG}"]
            + [_event_line(e) for e in events[-MAX_EVENTS // 2:]])


def _log_notes(run: RunLog) -> list[str]:
    """What the reader skipped or left out of the log."""
    notes = []
    if run.skipped_lines:
        notes.append(f"note: skipped {run.skipped_lines} unreadable line(s) in {PERF_LOG}")
    if run.replaced_runs:
        notes.append(f"note: {PERF_LOG} also holds {run.replaced_runs} earlier run(s) started afresh in this "
                     "output_dir; only the latest is reported")
    return notes


def _tuning_lines(run: RunLog) -> list[str]:
    """The latest tuning decision's trials, worded once (:func:`~hf_perf_callbacks.core.splitfile.trial_figures`: the
    figures the plots, the analysis and the console print)."""
    record = read_split_file(run.output_dir, session=run.header().session) if run.output_dir else None
    decision = record.last("tune") if record is not None else None
    if decision is None:
        return []
    outcome = (f"kept {split_label(decision.new)}" if decision.new == decision.old
               else f"switched {split_label(decision.old)} → {split_label(decision.new)}")
    cost = f"; cost {decision.cost_sec:.1f} s" if decision.cost_sec is not None else ""
    saving = (f"; expected saving {decision.expected_gain_sec:.1f} s" if decision.expected_gain_sec is not None
              and decision.new != decision.old else "")
    lines = [f"tuning at step {decision.step}: {outcome}{cost}{saving}"]
    lines += [wrapped(f"  {t.words()}", indent="    ") for t in trial_figures(decision)]
    return lines


def _completion_line(history: Sequence[Mapping[str, Any]]) -> str | None:
    """GRPO completion lengths over the run's training logs (:func:`figures.trainer_logs`, the step lines' ``log/``
    values; :func:`figures.completion_stats`, the figures the analysis cites), when present."""
    c = completion_stats(history)
    if not c["logs"]:
        return None
    logs = c["logs"]
    return (f"completions ({logs} log{'' if logs == 1 else 's'}): mean length {_fmt(c['mean'], '.1f')}, "
            f"max {_fmt(c['max'], '.0f')}, "
            f"clipped {_fmt(c['clipped'], '.0%')} (mean over the run)")
