"""The run's rules: warmup, evaluation's share, the tuning's own cost, the tuner without train_with_tuning, what
the run is too short to judge, fields skipped.
"""
from __future__ import annotations

import math
from typing import Literal

from ...wording import warmup_case
from ..model import MIN_STEADY_STEPS, Facts, Finding, Measurements, Note, card
from ..words import FRESH_COSTS, finding, note
from .advice import _launcher, _split_name
from .basis import _too_short
from .machine import rule_contention, rule_oversubscription

WARMUP_SHARE = 0.1           # warmup overhead / run time at which a note says "compare steady figures only"
EVAL_SHARE = 0.1             # evaluation's share of the wall time worth a finding
EVAL_TARGET = 0.05           # the share the advised eval_steps brings it to
TUNING_COST_SHARE = 0.01     # a tuning that cost more than it saved, by this share of the training time: a finding

#: the warmup note's cases (its ``reason``): not finished yet; the first step among the steady steps; else the
#: warmup steps left out of the steady figures (``facts["case"]``: :func:`~hf_perf_callbacks.wording.warmup_case`)
WarmupReason = Literal["not_finished", "first_step_steady", "excluded"]


def _contention_names(m: Measurements) -> list[str]:
    """The findings of this report that name other processes (oversubscription, contention)."""
    return [name for name, rule in (("oversubscription", rule_oversubscription), ("contention", rule_contention))
            if isinstance(rule(m), Finding)]


@card(note="always a note, from the meter's figures (\"not finished after N steps\" while it is)")
def rule_warmup(m: Measurements) -> Note | None:
    slow, overhead, steady, n = m.first_step_slowdown, m.warmup_overhead_sec, m.steady_step_sec, m.warmup_steps
    names = _contention_names(m)
    contended = bool(names) or bool(m.contention)
    facts: Facts = {"steps": m.steps, "contention_findings": ", ".join(names),
                    "contention_sec": m.contention.lost_sec if m.contention else None}
    if m.warmup_done is False or (n is None and (slow is not None or overhead is not None)):
        return note("warmup", "not_finished", facts, subject=m.contention, judged=False)   # no steady figures yet
    if slow is None and overhead is None:
        return None
    first = m.first_steady
    facts.update(case=warmup_case(n, slow), warmup_steps=n, slowdown=slow, overhead_sec=overhead,
                 fresh_cost=FRESH_COSTS.get(m.device_type), latest_first_step=first.step if first else None,
                 levels=max(1, m.split_levels))
    reason: WarmupReason = "first_step_steady" if first and first.included else "excluded"
    if first and first.included:
        facts.update(first_step=first.step, first_sec=first.sec, steady_with=first.with_it,
                     steady_without=first.without_it)
    share = overhead / (m.steps * steady + overhead) if (overhead and steady and m.steps) else None
    if overhead and steady and share is not None and share >= WARMUP_SHARE and not contended:
        target = 0.05
        facts.update(share=share, steps_for_target=math.ceil(overhead * (1 - target) / (target * steady)),
                     target_share=target)
    return note("warmup", reason, facts, subject=m.contention)


@card(finding=f"evaluation ≥ {EVAL_SHARE:.0%} of the wall time, ≥ 2 evaluations (`perf/phase_sec/eval`, measured) → "
              f"`eval_strategy: steps`, `eval_steps` at which it takes ~{EVAL_TARGET:.0%}",
      gain="measured: the run's own evaluation seconds at the new interval")
def rule_evaluation(m: Measurements) -> Finding | None:
    """Evaluation's share of the wall time, measured on this run's own evaluations: ``eval_steps``."""
    e = m.evaluation
    if not e or e.share < EVAL_SHARE or e.evals < 2:
        return None
    per_eval, train_per_step = e.eval_sec / e.evals, e.train_sec / max(1, e.steps)
    every = e.every
    needed = per_eval * (1 - EVAL_TARGET) / (EVAL_TARGET * train_per_step) if train_per_step > 0 else every * 10
    new = max(every + 1, _nice_interval(needed))
    saved = e.eval_sec * (1 - every / new)
    gain = e.wall_sec / (e.wall_sec - saved)
    return finding("evaluation", "eval_share",
                   {"evals": e.evals, "every": every, "eval_sec": e.eval_sec, "wall_sec": e.wall_sec,
                    "share": e.share, "per_eval_sec": per_eval, "train_per_step_sec": train_per_step,
                    "saved_sec": saved, "new_every": new, "gain": gain,
                    "share_after": per_eval / new / (per_eval / new + train_per_step)},
                   {"eval_strategy": "steps", "eval_steps": new}, gain, "high", "measured", gain, lower_bound=True)


def _nice_interval(x: float) -> int:
    """The next 1, 2, 5 × 10^k at or above ``x``."""
    if x <= 1:
        return 1
    scale = 10 ** math.floor(math.log10(x))
    return int(next(k * scale for k in (1, 2, 5, 10) if k * scale >= x - 1e-9))


@card(finding=f"the tuner's measurement cost more than its expected saving, by ≥ {TUNING_COST_SHARE:.0%} of the "
              "training time → `tune=False` (recipe: `tune: false`) for runs this short",
      gain="measured: the cost less the saving, against the training time")
def rule_tuning_cost(m: Measurements) -> Finding | None:
    """The tuner's measurement cost more than it is expected to save: a finding with its cost."""
    d = m.tune
    if d is None or not d.cost_sec or not m.train_sec:
        return None
    saving = d.expected_gain_sec or 0.0
    lost = d.cost_sec - saving
    if lost <= TUNING_COST_SHARE * m.train_sec:
        return None
    gain = m.train_sec / (m.train_sec - lost) if m.train_sec > lost else None
    return finding("tuning_cost", "cost_over_saving",
                   {"cost_sec": d.cost_sec, "saving_sec": saving, "lost_sec": lost, "train_sec": m.train_sec,
                    "kept": _split_name(d.new), "step": d.step, "tuner_reason": d.code, "ended_by": d.ended_by,
                    "switched": d.new != d.old, "launcher": bool(_launcher(m)), "gain": gain},
                   {"tune": False} if _launcher(m) else {}, gain, "medium", "measured" if gain else "try", gain,
                   subject=d)


@card(note="not judged: the tuner attached to a plain `trainer.train()` (its event)")
def rule_tuner_hint(m: Measurements) -> Note | None:
    """The tuner attached to a plain ``trainer.train()``: it measured nothing, and said so (its event)."""
    if not m.tuner_hint or m.tune is not None:
        return None
    return note("tuner_hint", "needs_train_with_tuning", {"launcher": bool(_launcher(m))}, judged=False)


@card(note="not judged: too few steps")
def rule_evidence(m: Measurements) -> Note | None:
    """What this run is too short to judge, and how many steps would do."""
    why = _too_short(m)
    if why is None:
        return None
    facts: Facts = {"steps": m.steps, "warmup_done": m.warmup_done, "steady_steps": m.steady_steps,
                    "needed_steps": (m.warmup_steps or 0) + MIN_STEADY_STEPS if m.warmup_done else None,
                    "grpo": m.grpo}
    return note("evidence", "too_few_steps", facts, judged=False)


@card(note="not judged: fields of another type skipped")
def rule_log_fields(m: Measurements) -> Note | None:
    """Logged fields of another type than this version reads (a newer or older writer), skipped."""
    if not m.skipped:
        return None
    return note("log_fields", "skipped", {"skipped": len(m.skipped)}, subject=list(m.skipped), judged=False)
