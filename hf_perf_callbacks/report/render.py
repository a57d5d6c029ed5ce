"""The analysis written out: ``perf_report.md`` (:func:`render_markdown`, :func:`write_analysis`) and the console's
top findings (:func:`console_summary`).
"""
from __future__ import annotations

import json
import os

from .. import keys
from ..core.runlog import RunLog, read_run
from ..core.wording import MFU_BASIS_SHORT, wrapped
from .facts import NothingFound
from .model import TOO_FEW_STEPS, ZERO, Finding, Measurements, Note, Scope
from .reading import measurements
from .rules import check
from .rules.basis import _too_short
from .words import _pct, _yaml, nothing_found_words, scope_words, stake_words, stand_in_words

REPORT_FILE = "perf_report.md"


def _facts_line(m: Measurements) -> str:
    parts = [f"{m.device_type} × {m.world_size}", "GRPO" if m.grpo else "Trainer", f"{m.steps} steps"]
    if m.launcher:
        parts.insert(0, f"`{m.launcher}`")
    if m.micro_batch and m.grad_accum:
        parts.append(f"micro-batch {m.micro_batch} × accumulation {m.grad_accum}")
    if m.warmup_done is False:
        parts.append("warmup not finished (no steady figures)")
    if m.steady_tokens_per_sec:
        parts.append(f"steady {m.steady_tokens_per_sec:,.0f} tok/s")
    if m.steady_step_sec:
        parts.append(f"{m.steady_step_sec:.3g} s/step of training (evaluation and saving excluded)")
    e = m.evaluation
    if e and e.share >= 0.01 and m.steps:
        parts.append(f"{e.wall_sec / m.steps:.3g} s/step of wall time with evaluation")
    if m.mfu is not None:
        basis = MFU_BASIS_SHORT.get(m.mfu_basis or "")
        parts.append(f"MFU {_pct(m.mfu)}" + (f" {basis}" if basis else ""))
    split = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}" for k, v in
                      sorted(m.phases.items(), key=lambda kv: -kv[1]) if v >= 0.005)
    if split:
        parts.append(f"time: {split}")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        parts.append(f"memory {m.mem_high_water_gb:.2f}/{m.mem_budget_gb:.2f} GiB")
    return " · ".join(parts)


def gain_text(f: Finding) -> str:
    """``1.21x (calibrated, medium confidence)``, ``≥ 1.70x (measured, …)``, ``too few steps to judge the gain``
    or ``try (no predicted gain)``."""
    if f.expected_gain is None:
        if f.basis == TOO_FEW_STEPS:
            return "too few steps to judge the gain"
        return "try (no predicted gain)" if f.priority else "fix first"
    return f"{'≥ ' if f.lower_bound else ''}{f.expected_gain:.2f}x ({f.basis}, {f.confidence} confidence)"


def nothing_found_facts(m: Measurements, notes: list[Note]) -> NothingFound:
    """What the "no finding" paragraph says, as data (its words: :func:`~.words.nothing_found_words`)."""
    r = m.rewards
    return NothingFound(data_wait=bool(not _too_short(m) and m.phases), memory=m.mem_high_water_gb is not None,
                        rewards=None if not m.grpo else "none" if r is None else
                        "varied" if (r.std_max or 0.0) > ZERO else "flat",
                        timings_unjudged=any(not n.judged and n.rule == "evidence" for n in notes),
                        metric=next((k for k in (keys.PERF_STEADY_TOKENS_PER_SEC, keys.PERF_TOKENS_PER_SEC)
                                     if k in m.logged), None))


def _stand_in(notes: list[Note] | None) -> Scope | None:
    """The stand-in note's facts, when the run stood in for its recipe's target."""
    return next((n.facts for n in notes or [] if n.reason == "stand_in" and isinstance(n.facts, Scope)), None)


def render_markdown(findings: list[Finding], m: Measurements, notes: list[Note] | None = None) -> str:
    """The content of ``perf_report.md``: the findings, what the run was too short to judge, and what was checked
    and is fine."""
    notes = notes or []
    lines = ["# Performance report", "", f"**Run:** {_facts_line(m)}", ""]
    stand_in = _stand_in(notes)
    if stand_in is not None:
        lines += [f"> **Stand-in run.** {stand_in_words(stand_in)}", ""]
    if not findings:
        lines += ["## No bottleneck found", "", nothing_found_words(nothing_found_facts(m, notes)), ""]
    for i, f in enumerate(findings, 1):
        stake = stake_words(f)
        scope = scope_words(f.scope) if f.scope else "measured on this run"
        lines += [f"## {i}. {f.title} — {gain_text(f)}", "",
                  f"_{scope[0].upper()}{scope[1:]}" + (f"; {stake}" if stake else "") + "._", "",
                  "### Observation", "", f.observation, "",
                  "### Root cause", "", f.root_cause, "",
                  "### Recommendation", "", f.recommendation, ""]
        if f.setting:
            lines += ["### Setting", "", "```yaml"]
            lines += [f"{k}: {json.dumps(v)}" for k, v in f.setting.items()]
            lines += ["```", ""]
        if f.env:
            lines += ["### Environment", "", "```bash"] + [f"{k}={v}" for k, v in f.env.items()] + ["```", ""]
        lines += ["### Expected gain", "",
                  (f"**{'≥ ' if f.lower_bound else ''}{f.expected_gain:.2f}x** — " if f.expected_gain is not None
                   else "**too few steps** — " if f.basis == TOO_FEW_STEPS else "**try** — ") + f.gain_formula,
                  "", "### Confidence", "", f.confidence, ""]
    for heading, judged in (("Not judged", False), ("Checked and fine", True)):
        items = [f"- **{n.title}.** {n.text}" for n in notes if n.judged == judged]
        if items:
            lines += [f"## {heading}", ""] + items + [""]
    return "\n".join(lines)


def write_analysis(run: RunLog | str) -> tuple[str, list[Finding], list[Note]]:
    """Analyse a parsed run (or the run directory) and write ``<output_dir>/perf_report.md``; returns (path,
    findings, notes)."""
    run = read_run(run) if isinstance(run, (str, os.PathLike)) else run
    m = measurements(run)
    findings, notes = check(m)
    path = os.path.join(run.output_dir, REPORT_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_markdown(findings, m, notes))
    return path, findings, notes


def console_summary(findings: list[Finding], top: int = 3, notes: list[Note] | None = None) -> str:
    """The top findings, a few lines each, what the run was too short to judge, and the titles of what was checked
    and is fine; a line wider than ``CONSOLE_WIDTH`` goes on over indented lines (nothing is cut)."""
    lines = ["== Performance analysis =="]
    stand_in = _stand_in(notes)
    if stand_in is not None:
        lines.append(wrapped(f"stand-in run: {stand_in_words(stand_in)}"))
    if not findings:
        lines.append("no bottleneck found")
    for i, f in enumerate(findings[:top], 1):
        actions = [line.removeprefix("- ") for line in f.recommendation.splitlines() if line.strip()]
        first = (_yaml(f.setting) if f.setting else
                 ", ".join(f"`{k}={v}` (environment)" for k, v in f.env.items()) if f.env else
                 actions[0].split(" (")[0] if actions else "-")
        more = f" (+{len(actions) - 1} more)" if len(actions) > 1 else ""
        share = f" · {_pct(f.share)} of the run" if f.share is not None else ""
        lines += [wrapped(f"{i}. {f.title} — {gain_text(f)}{share}", indent="   "),
                  wrapped(f"   seen: {f.observation}", indent=" " * 9),
                  wrapped(f"   do:   {first}{more}", indent=" " * 9)]
    if len(findings) > top:
        lines.append(f"... {len(findings) - top} more in {REPORT_FILE}")
    for heading, judged, sep in (("not judged", False, "; "), ("checked and fine", True, ", ")):
        titles = [n.title.lower() for n in notes or [] if n.judged == judged]
        if titles:
            lines.append(wrapped(f"{heading}: " + sep.join(titles)))
    return "\n".join(lines)
