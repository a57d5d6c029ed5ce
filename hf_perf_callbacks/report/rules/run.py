"""The run's rules: warmup, evaluation's share, the tuning's own cost, the tuner without train_with_tuning, what
the run is too short to judge, fields skipped.
"""
from __future__ import annotations

import math
from typing import Literal

from ...splitfile import trial_figures
from ...wording import TUNER_NEEDS_TRAIN_WITH_TUNING, warmup_case, warmup_words
from ..figures import (
    ranges_text,
    step_ranges,
)
from ..model import CONTENTION_SHARE, MIN_MACHINE_STEPS, MIN_STEADY_STEPS, Facts, Finding, Measurements, Note, card
from .advice import FLOOR, _bullets, _launcher, _pct, _sentence, _split_name
from .basis import _too_short
from .machine import rule_contention, rule_oversubscription

WARMUP_SHARE = 0.1           # warmup overhead / run time at which a note says "compare steady figures only"
EVAL_SHARE = 0.1             # evaluation's share of the wall time worth a finding
EVAL_TARGET = 0.05           # the share the advised eval_steps brings it to
TUNING_COST_SHARE = 0.01     # a tuning that cost more than it saved, by this share of the training time: a finding

#: the warmup note's cases (its ``reason``): not finished yet; the first step among the steady steps; else the
#: warmup steps left out of the steady figures (``facts["case"]``: :func:`~hf_perf_callbacks.wording.warmup_case`)
WarmupReason = Literal["not_finished", "first_step_steady", "excluded"]
#: the one-time costs of a fresh process the warmup note names beside the optimizer state and the allocator
FRESH_COSTS = {"mps": "Metal shader compilation", "cuda": "CUDA context and kernel selection",
               "xpu": "kernel compilation"}


def _contention_names(m: Measurements) -> list[str]:
    """The findings of this report that name other processes (oversubscription, contention)."""
    return [name for name, rule in (("oversubscription", rule_oversubscription), ("contention", rule_contention))
            if isinstance(rule(m), Finding)]


def _contention_words(m: Measurements) -> str:
    """What the report says about other processes beside warmup: the finding that names them (only one the report
    has), else the meter's measured seconds when there are any, else nothing."""
    names = _contention_names(m)
    if names:
        return (f" Other processes slowed this run too (the {' and the '.join(names)} finding"
                f"{'s' if len(names) > 1 else ''} above): that time is contention, not warmup, and it recurs.")
    c = m.contention
    if c:
        return (f" Other processes slowed {c.steps} step(s) ({ranges_text(step_ranges(c.step_list))}) by "
                f"{c.lost_sec:.1f} s, {_pct(c.lost_share)} of the run: contention, not warmup (below the "
                f"{CONTENTION_SHARE:.0%} that makes a finding).")
    return ""


@card(note="always a note, from the meter's figures (\"not finished after N steps\" while it is)")
def rule_warmup(m: Measurements) -> Note | None:
    slow, overhead, steady, n = m.first_step_slowdown, m.warmup_overhead_sec, m.steady_step_sec, m.warmup_steps
    other = _contention_words(m)
    contended = bool(other)
    facts: Facts = {"steps": m.steps, "contention_findings": ", ".join(_contention_names(m)),
                    "contention_sec": m.contention.lost_sec if m.contention else None}
    if m.warmup_done is False:
        return Note("warmup", "Warmup not finished",
                    f"Warmup was not finished after {m.steps} step{'' if m.steps == 1 else 's'}: the meter has not "
                    f"seen its steps settle at one level, so the run has no steady figures yet (run longer)."
                    + other, judged=False, reason="not_finished", facts=facts)
    if slow is None and overhead is None:
        return None
    first = m.first_steady
    parts = [warmup_words(n, slow, overhead, first.step if first else None, levels=max(1, m.split_levels))]
    fresh = ("One-time costs of a fresh process (optimizer state, allocator growth"
             + (f", {FRESH_COSTS[m.device_type]}" if m.device_type in FRESH_COSTS else "") + ") do not recur")
    facts.update(case=warmup_case(n, slow), warmup_steps=n, slowdown=slow, overhead_sec=overhead,
                 fresh_cost=FRESH_COSTS.get(m.device_type))
    reason: WarmupReason = "first_step_steady" if first and first.included else "excluded"
    if first and first.included:
        facts.update(first_step=first.step, first_sec=first.sec, steady_with=first.with_it,
                     steady_without=first.without_it)
    if first and first.included:
        text = _sentence(parts) + (
            f" Step {first.step} counts among the steady steps (the meter found no warmup beyond it), so its "
            f"{first.sec:.3g} s are in the steady figures: steady step {first.with_it:.3g} s, "
            f"{first.without_it:.3g} s without it.")
    else:
        text = _sentence(parts) + " " + fresh + "; the steady figures exclude the warmup steps."
    text += other
    share = overhead / (m.steps * steady + overhead) if (overhead and steady and m.steps) else None
    if overhead and steady and share is not None and share >= WARMUP_SHARE and not contended:
        target = 0.05
        steps_needed = math.ceil(overhead * (1 - target) / (target * steady))
        text += (f" In this short run warmup is {_pct(share)} of the time: compare steady figures only, or run "
                 f"≥ {steps_needed} steps for warmup below 5%.")
        facts.update(share=share, steps_for_target=steps_needed, target_share=target)
    return Note("warmup", "Warmup", text, reason=reason, facts=facts)


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
    obs = (f"{e.evals} evaluations (every {every} step{'s' if every != 1 else ''}) took {e.eval_sec:.1f} s of "
           f"the run's {e.wall_sec:.1f} s wall time ({_pct(e.share)}), {per_eval:.3g} s each, against "
           f"{train_per_step:.3g} s of training per step. The steady figures (s/step, tokens/s) leave evaluation "
           f"out: the run's wall time does not.")
    root = ("Each evaluation runs the whole `eval_dataset` through the model; evaluating every few steps spends more "
            "time judging the model than training it.")
    items = [f"`eval_strategy: steps` with `eval_steps: {new}` (now every {every}): evaluation then takes about "
             f"{_pct(per_eval / new / (per_eval / new + train_per_step))} of the wall time",
             "with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`",
             "or evaluate a smaller set (`eval_dataset.select(range(n))`) or with a larger "
             "`per_device_eval_batch_size`"]
    formula = (f"measured: this run's {e.evals} evaluations took {e.eval_sec:.1f} s; every {new} steps instead "
               f"of {every} saves {saved:.1f} s of {e.wall_sec:.1f} s: {e.wall_sec:.1f} / "
               f"({e.wall_sec:.1f} − {saved:.1f}) = {gain:.2f}x (each evaluation costing what this run's did)")
    return Finding("evaluation", "Evaluation takes a large share of the wall time", obs, root, _bullets(items), gain,
                   formula + FLOOR, "high", {"eval_strategy": "steps", "eval_steps": new}, "measured", gain,
                   lower_bound=True, reason="eval_share",
                   facts={"evals": e.evals, "every": every, "eval_sec": e.eval_sec, "wall_sec": e.wall_sec,
                          "share": e.share, "per_eval_sec": per_eval, "train_per_step_sec": train_per_step,
                          "saved_sec": saved})


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
    trials = "; ".join(t.words() for t in trial_figures(d))
    obs = (f"The tuner's measurement of splits on this run's own steps cost {d.cost_sec:.1f} s "
           f"({_pct(d.cost_sec / m.train_sec)} of the {m.train_sec:.1f} s of training) and is expected to save "
           f"{saving:.1f} s over the rest of the run "
           f"({'kept ' + _split_name(d.new) if d.new == d.old else 'switched to ' + _split_name(d.new)} at step "
           f"{d.step}): {trials}.")
    root = ("A trial costs its switches (a checkpoint, the end of a train() call and the start of the next), the "
            "warm-up steps after each and any slower steps of the candidate; it pays only when the split it keeps "
            "saves more over the steps left. In a short or noisy run the candidate cannot be told apart from the "
            "noise in the steps there are" + (f" (the tuner's reason: {d.reason})" if d.reason else "") + ".")
    how = ("`tune: false` in the recipe (`--tune false`)" if _launcher(m) else
           "`train_with_tuning(trainer, tune=False)` (or `AdaptiveBatchTuner(tune=False)`)")
    items = [f"{how} for runs this short; the split it measured: {_split_name(d.new)}",
             "or let the run be long enough to pay a trial back: the tuner weighs each round against the steps left"]
    gain = m.train_sec / (m.train_sec - lost) if m.train_sec > lost else None
    formula = (f"measured: the tuning's own cost {d.cost_sec:.1f} s less its expected saving {saving:.1f} s, "
               f"against {m.train_sec:.1f} s of training: {m.train_sec:.1f} / ({m.train_sec:.1f} − {lost:.1f})"
               + (f" = {gain:.2f}x" if gain else ""))
    return Finding("tuning_cost", "The batch tuning cost more than it saved", obs, root, _bullets(items), gain,
                   formula, "medium", {"tune": False} if _launcher(m) else {}, "measured" if gain else "try", gain,
                   reason="cost_over_saving",
                   facts={"cost_sec": d.cost_sec, "saving_sec": saving, "lost_sec": lost, "train_sec": m.train_sec,
                          "kept": _split_name(d.new), "step": d.step, "tuner_reason": d.code,
                          "ended_by": d.ended_by})


@card(note="not judged: the tuner attached to a plain `trainer.train()` (its event)")
def rule_tuner_hint(m: Measurements) -> Note | None:
    """The tuner attached to a plain ``trainer.train()``: it measured nothing, and said so (its event)."""
    if not m.tuner_hint or m.tune is not None:
        return None
    return Note("tuner_hint", "Batch split not measured: the tuner needs train_with_tuning",
                _sentence([TUNER_NEEDS_TRAIN_WITH_TUNING]) + (" Use `hf-perf train`'s recipe key `tune`."
                                                              if _launcher(m) else ""), judged=False,
                reason="needs_train_with_tuning")


@card(note="not judged: too few steps")
def rule_evidence(m: Measurements) -> Note | None:
    """What this run is too short to judge, and how many steps would do."""
    why = _too_short(m)
    if why is None:
        return None
    more = (f"run ≥ {(m.warmup_steps or 0) + MIN_STEADY_STEPS} steps" if m.warmup_done else
            f"run more steps: warmup ends once the step times settle at one level, and {MIN_STEADY_STEPS} steps after "
            f"it are needed")
    timed = "data wait, " + ("generation share, " if m.grpo else "") + "micro-batch, slow early steps"
    counted = "forwards per micro-batch, padding, " + ("rewards, completion lengths, " if m.grpo else "") + "memory"
    facts: Facts = {"steps": m.steps, "warmup_done": m.warmup_done, "steady_steps": m.steady_steps,
                    "needed_steps": (m.warmup_steps or 0) + MIN_STEADY_STEPS if m.warmup_done else None,
                    "timed": timed, "counted": counted}
    return Note("evidence", f"Too few steps to judge ({why})",
                f"Too few steps to judge the timings: {why}. Not judged: {timed}; no gain is estimated. Judged "
                f"anyway (counts, not timings): {counted}; thread oversubscription from {MIN_MACHINE_STEPS} steps "
                f"on. To judge the rest, {more}.", judged=False, reason="too_few_steps", facts=facts)


@card(note="not judged: fields of another type skipped")
def rule_log_fields(m: Measurements) -> Note | None:
    """Logged fields of another type than this version reads (a newer or older writer), skipped."""
    if not m.skipped:
        return None
    return Note("log_fields", "Fields skipped", "Skipped (another writer's format): " + "; ".join(m.skipped) + ".",
                judged=False, reason="skipped", facts={"skipped": len(m.skipped)})
