"""The run's rules: warmup, evaluation's share, the tuning's own cost, the tuner without train_with_tuning, what
the run is too short to judge, fields skipped.
"""
from __future__ import annotations

import math
from typing import Literal

from ..facts import EvalShare, Interval, KeptForRecipe, Skipped, TunerHint, TuningCost, Warmup
from ..model import Finding, Measurements, Note, Scope, card
from ..words import finding, note
from .basis import _too_short
from .machine import rule_contention, rule_oversubscription

WARMUP_SHARE = 0.1           # warmup overhead / run time at which a note says "compare steady figures only"
WARMUP_TARGET = 0.05         # ... and the share it names the run's length for
EVAL_SHARE = 0.1             # evaluation's share of the wall time worth a finding
EVAL_TARGET = 0.05           # the share the advised eval_steps brings it to
TUNING_COST_SHARE = 0.01     # a tuning that cost more than it saved, by this share of the training time: a finding

#: the warmup note's cases (its ``reason``): not finished yet; the first step among the steady steps; else the
#: warmup steps left out of the steady figures
WarmupReason = Literal["not_finished", "first_step_steady", "excluded"]


@card(note="always a note, from the meter's figures (\"not finished after N steps\" while it is)")
def rule_warmup(m: Measurements) -> Note | None:
    slow, overhead, steady, n = m.first_step_slowdown, m.warmup_overhead_sec, m.steady_step_sec, m.warmup_steps
    names = tuple(name for name, rule in (("oversubscription", rule_oversubscription), ("contention", rule_contention))
                  if isinstance(rule(m), Finding))             # this report's findings that name other processes
    if m.warmup_done is False or (n is None and (slow is not None or overhead is not None)):
        return note("warmup", "not_finished", Warmup(m.steps, names, m.contention), judged=False)   # no steady figures
    if slow is None and overhead is None:
        return None
    first = m.first_steady
    share = overhead / (m.steps * steady + overhead) if (overhead and steady and m.steps) else None
    short = bool(overhead and steady and share is not None and share >= WARMUP_SHARE and not (names or m.contention))
    facts = Warmup(m.steps, names, m.contention, warmup_steps=n,
                   slowdown=slow, overhead_sec=overhead, device_type=m.device_type,
                   latest_first_step=first.step if first else None, levels=max(1, m.split_levels),
                   in_band=m.warmup_in_band, tolerance=m.warmup_tolerance, compile=m.torch_compile,
                   child_cpu_sec=m.warmup_child_cpu_sec, first=first if first and first.included else None,
                   share=share if short else None, target_share=WARMUP_TARGET, steps_for_target=math.ceil(
                       (overhead or 0.0) * (1 - WARMUP_TARGET) / (WARMUP_TARGET * (steady or 1.0))) if short else None)
    reason: WarmupReason = "first_step_steady" if first and first.included else "excluded"
    return note("warmup", reason, facts)


def events(steps: int, every: int, at_end: bool = True, first: bool = False, final: bool = False) -> int:
    """How many times transformers 5 runs an event every ``every`` steps over a run of ``steps`` steps: at each
    multiple; once more at the end when the last step is not one (``at_end``: its last save and evaluation); once
    more at step 1 (``first``: ``logging_first_step``); and once after training (``final``: the log of the run's
    metrics, whatever the interval)."""
    every = max(1, every)
    return (steps // every + (at_end and steps % every != 0) + (first and every > 1 and steps >= 1)
            + bool(final))


@card(finding=f"evaluation ≥ {EVAL_SHARE:.0%} of the wall time, ≥ 2 evaluations (`perf/phase_sec/eval`, measured) → "
              f"`eval_strategy: steps`, `eval_steps` at which it takes ~{EVAL_TARGET:.0%}; what `compute_metrics` "
              "took of it, and the logits kept for it",
      gain="measured: the run's own evaluation seconds at the new interval, the last evaluation at the end counted")
def rule_evaluation(m: Measurements) -> Finding | None:
    """Evaluation's share of the wall time, measured on this run's own evaluations: ``eval_steps``; the part of it
    in the trainer's ``compute_metrics``, and whether every batch's logits are kept for it."""
    e = m.evaluation
    if not e or e.share < EVAL_SHARE or e.evals < 2:
        return None
    per_eval, train_per_step = e.eval_sec / e.evals, e.train_sec / max(1, e.steps)
    every = e.every
    new = _interval(per_eval, train_per_step, every, EVAL_TARGET)
    after = events(e.steps, new)
    saved = per_eval * max(0, e.evals - after)
    gain = e.wall_sec / (e.wall_sec - saved)
    settings = m.trainer_settings
    interval = Interval(every, new, train_per_step, e.steps, after, saved, gain,
                        per_eval * after / (per_eval * after + train_per_step * e.steps))
    return finding("evaluation", "eval_share",
                   EvalShare(e, interval, m.compute_metrics_sec, settings.get("compute_metrics") is True,
                             settings.get("preprocess_logits_for_metrics") is True,
                             settings.get("prediction_loss_only") is True),
                   {"eval_strategy": "steps", "eval_steps": new}, gain, "high", "measured", gain, lower_bound=True,
                   stake_sec=saved)


def _interval(per_event: float, other_per_step: float, every: int, target: float) -> int:
    """The next 1, 2, 5 × 10^k steps between events at which an event costing ``per_event`` seconds takes about
    ``target`` of the wall time beside ``other_per_step`` seconds a step (at least ``every`` + 1)."""
    needed = per_event * (1 - target) / (target * other_per_step) if other_per_step > 0 else every * 10
    if needed <= 1:
        return every + 1
    scale = 10 ** math.floor(math.log10(needed))
    return max(every + 1, int(next(k * scale for k in (1, 2, 5, 10) if k * scale >= needed - 1e-9)))


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
                   TuningCost(d, d.cost_sec, saving, lost, m.train_sec, bool(m.launcher), gain),
                   {"tune": False} if m.launcher else {}, gain, "medium", "measured" if gain else "try", gain,
                   stake_sec=lost)


@card(note="not judged: the tuner attached to a plain `trainer.train()` (its event)")
def rule_tuner_hint(m: Measurements) -> Note | None:
    """The tuner attached to a plain ``trainer.train()``: it measured nothing, and said so (its event)."""
    if not m.tuner_hint or m.tune is not None:
        return None
    return note("tuner_hint", "needs_train_with_tuning", TunerHint(bool(m.launcher)), judged=False)


@card(note="not judged: too few steps")
def rule_evidence(m: Measurements) -> Note | None:
    """What this run is too short to judge, and how many steps would do."""
    evidence = _too_short(m)
    return None if evidence is None else note("evidence", "too_few_steps", evidence, judged=False)


def scope_of(m: Measurements) -> Scope:
    """What the run's findings were measured on, and what differs from the recipe's target (a run of ``hf-perf
    train`` on another model or device, or with shorter completions, than its recipe was written for)."""
    t = m.target
    differs: list[str] = []
    if t is not None:
        if t.model and m.model_name and t.model != m.model_name:
            differs.append("model")
        if t.device_type and t.device_type != m.device_type:
            differs.append("device")
        if t.max_completion_length and m.max_completion_length and m.max_completion_length < t.max_completion_length:
            differs.append("completions")
    return Scope(m.model_name, m.model_params, m.device_type, m.max_completion_length, m.seq_len, t, tuple(differs))


#: the recipe keys whose values size memory, and the direction that costs more of it: a boolean the recipe turned on
#: (off costs memory), a number the recipe set (more costs memory)
MEMORY_DIRECTION = {"activation_checkpointing": "on", "gradient_checkpointing": "on", "use_peft": "on",
                    "per_device_train_batch_size": "up", "max_completion_length": "up", "num_generations": "up",
                    "vllm_gpu_memory_utilization": "up"}


def _undoes(key: str, value: object, recipe: object) -> bool:
    """``key: value`` costs more memory than the recipe's own ``recipe`` value (:data:`MEMORY_DIRECTION`)."""
    way = MEMORY_DIRECTION.get(key)
    if way == "on":
        return recipe is True and value is False
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, recipe))
    return way == "up" and numbers and float(value) > float(recipe)  # type: ignore[arg-type]


def within_recipe(f: Finding, scope: Scope) -> Finding | Note:
    """``f``, or — on a run that stood in for its recipe's target — a note in its place when its setting would undo
    a memory choice of the recipe (turn off what it turned on, raise what it set): what a stand-in measured about
    memory says nothing about the target's."""
    t = scope.target
    if t is None or not scope.stand_in:
        return f
    undone = tuple((k, t.memory[k], v) for k, v in f.setting.items() if k in t.memory and _undoes(k, v, t.memory[k]))
    if not undone:
        return f
    return note("scope", "kept_for_recipe", KeptForRecipe(f.title, f.rule, t, scope.model, scope.device_type, undone),
                judged=False)


@card(note="a run of `hf-perf train` on another model, device or shorter completions than its recipe's target: said "
           "at the top of the report; a setting that would undo a memory choice of the recipe (checkpointing off, a "
           "larger micro-batch, longer completions than the recipe's) is a note instead of a finding")
def rule_scope(m: Measurements) -> Note | None:
    """A stand-in run: what it ran instead of the recipe's target."""
    scope = scope_of(m)
    if not scope.stand_in:
        return None
    return note("scope", "stand_in", scope, judged=False)


@card(note="not judged: fields of another type skipped")
def rule_log_fields(m: Measurements) -> Note | None:
    """Logged fields of another type than this version reads (a newer or older writer), skipped."""
    if not m.skipped:
        return None
    return note("log_fields", "skipped", Skipped(tuple(m.skipped)), judged=False)
