"""The analysis' rules: each a pure function of :class:`~..model.Measurements` returning a
:class:`~..model.Finding`, a :class:`~..model.Note` or None; :data:`RULES` lists them in ranking order and
:func:`check` runs them. The rule table (README "The analysis") is :func:`rule_table`.
"""
from __future__ import annotations

from collections.abc import Callable

from ..model import CARDS, Finding, Measurements, Note
from .grpo import (
    rule_completion_budget,
    rule_generation_bound,
    rule_no_learning,
    rule_reward,
    rule_rollout_wait,
    rule_weight_sync,
)
from .machine import rule_compile, rule_contention, rule_oversubscription
from .memory import rule_memory_pressure
from .phases import rule_callbacks, rule_recompute, rule_saving
from .run import (
    rule_evaluation,
    rule_evidence,
    rule_log_fields,
    rule_scope,
    rule_tuner_hint,
    rule_tuning_cost,
    rule_warmup,
    scope_of,
    within_recipe,
)
from .step import rule_duplicate_forward, rule_input_bound, rule_padding_waste, rule_small_micro_batch

#: The one place to add a rule: each takes Measurements and returns a Finding, a Note or None.
RULES: list[Callable[[Measurements], Finding | Note | None]] = [
    rule_no_learning, rule_memory_pressure, rule_oversubscription, rule_contention, rule_compile, rule_evaluation,
    rule_saving, rule_callbacks, rule_input_bound, rule_recompute, rule_reward, rule_duplicate_forward,
    rule_padding_waste, rule_generation_bound, rule_weight_sync, rule_rollout_wait, rule_tuning_cost,
    rule_small_micro_batch, rule_tuner_hint, rule_completion_budget, rule_warmup, rule_evidence, rule_log_fields,
    rule_scope,
]
_ORDER = {rule.__name__.removeprefix("rule_"): i for i, rule in enumerate(RULES)}


def _rank(f: Finding) -> tuple[int, bool, float, int]:
    """Priority, then the seconds at stake (:attr:`~..model.Finding.stake_sec`, the largest first; a finding
    without a time figure after those with one), then the order of RULES: a total order, so one run's findings
    always rank the same."""
    return (f.priority, f.stake_sec is None, -round(f.stake_sec or 0.0, 1), _ORDER.get(f.rule, len(_ORDER)))


def check(m: Measurements) -> tuple[list[Finding], list[Note]]:
    """Every rule's result: the findings, each with what it was measured on (:func:`~.run.scope_of`) and its share
    of the run, ranked (:func:`_rank`); a finding whose setting would undo a memory choice of the recipe a stand-in
    run stood in for becomes a note (:func:`~.run.within_recipe`); and the notes (checked and fine, or not
    judged)."""
    scope, wall = scope_of(m), m.wall_sec or 0.0
    results = [r for r in (rule(m) for rule in RULES) if r is not None]
    results = [within_recipe(r, scope) if isinstance(r, Finding) else r for r in results]
    findings = sorted((r for r in results if isinstance(r, Finding)), key=_rank)
    for f in findings:
        f.scope = scope
        f.share = f.stake_sec / wall if f.stake_sec is not None and wall > 0 else None
    return findings, [r for r in results if isinstance(r, Note)]


def rule_table() -> str:
    """The README's rule table (section "The analysis"), one row per rule in the order of :data:`RULES`, from the
    cards the rules carry (:func:`~..model.card`): ``python -m hf_perf_callbacks.report.rules`` prints it."""
    rows = ["| rule | finding (setting) | gain printed | note instead |", "|---|---|---|---|"]
    for rule in RULES:
        name = rule.__name__.removeprefix("rule_")
        c = CARDS[name]
        rows.append(" ".join(f"| {cell}" if cell else "|" for cell in (f"`{name}`", c.finding, c.gain, c.note))
                    + " |")
    return "\n".join(rows)


__all__ = ["check", "rule_table", "RULES"]
