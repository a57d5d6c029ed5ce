"""The analysis' English, in one place: one renderer per reason code (:data:`~.model.Reason`) that writes a
finding's or a note's texts from its facts — the frozen dataclass of its case (:mod:`.facts`) — and its setting. A
rule computes data only (the case it found, the figures, the setting) and builds its result with :func:`finding` or
:func:`note`; each sentence here is chosen from that data, never appended to another rule's words, so two sentences
of one result cannot contradict each other. A renderer reads its case's figures as attributes (strict mypy checks
each one; ``tests/test_words.py`` checks them against the dataclass too), and :func:`finding` refuses facts of
another case's class.

Every module under ``report/rules`` that defines a rule is worded here (checked by ``tests/test_words.py``).
"""
from __future__ import annotations

import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.dataloader import dataloader_changes
from ..core.runlog import GB
from ..core.splitfile import trial_figures
from ..core.stats import ranges_text, step_ranges
from ..core.wording import TUNER_NEEDS_TRAIN_WITH_TUNING, split_label, warmup_words
from . import facts as fx
from .figures import SlowStretch
from .model import (
    CONTENTION_SHARE,
    MIN_FIXED_LENGTH_STEPS,
    MIN_MACHINE_STEPS,
    MIN_STEADY_STEPS,
    Facts,
    Finding,
    Note,
    Reason,
    Scope,
    Setting,
)

#: what a phase's measured gain leaves out: checked with the advice applied (benchmarks/results/advice_phases_cpu.json),
#: the steps around a save, a log or an evaluation ran faster without it (caches), so the gains measured came out
#: 13-26% above these figures; printed as floors ("≥")
FLOOR = ("; a floor: only the phase's own seconds are counted, not what it costs the steps around it (caches "
         "evicted)")


def model_label(name: str | None) -> str:
    """A model's name as the report writes it: a hub id as it is, a local folder by its last part."""
    if not name:
        return "the model"
    return name.rstrip("/").rsplit("/", 1)[-1] if name.startswith(("/", ".", "~")) else name


def _params(n: int | None) -> str:
    if not n:
        return ""
    return f" ({n / 1e9:.2f}B parameters)" if n >= 1e9 else f" ({n / 1e6:.0f}M parameters)" if n >= 1e6 else \
        f" ({n:,} parameters)"


def scope_words(scope: Scope) -> str:
    """What a finding was measured on: the model that ran, the device, the lengths; a stand-in's target named."""
    model = (model_label(scope.model) + _params(scope.params) if scope.model else
             f"a model of {_params(scope.params).strip(' ()')}" if scope.params else "")
    parts = [p for p in (model, scope.device_type) if p]
    if scope.max_completion_length:
        parts.append(f"completions ≤ {scope.max_completion_length} tokens")
    if scope.seq_len:
        parts.append(f"training sequences ≤ {scope.seq_len} tokens")
    text = "measured on " + ", ".join(parts)
    if scope.stand_in and scope.target:
        text += (f" — a stand-in for recipe `{scope.target.recipe}`'s target ({', '.join(scope.stand_in)} differ): "
                 "its figures are this run's")
    return text


def stake_words(f: Finding) -> str:
    """The share of the run a finding is about: what it saves (a gain measured or calibrated), else what its cause
    took (the most the change can save); empty without a time figure."""
    if f.stake_sec is None or f.share is None:
        return ""
    if f.expected_gain is not None:
        return f"saves {'≥ ' if f.lower_bound else ''}{f.stake_sec:.1f} s, {_pct(f.share)} of the run"
    return f"{_pct(f.share)} of the run at stake ({f.stake_sec:.1f} s: its cause's time, the most it can save)"


def _bullets(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _sentence(parts: list[str]) -> str:
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


def _yaml(setting: Setting) -> str:
    return ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in setting.items())


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _gb(nbytes: float) -> str:
    gb = nbytes / GB
    return f"{gb:.2f} GiB" if gb >= 0.1 else f"{nbytes / 1024**2:.0f} MB"


def _steps_word(n: int) -> str:
    return "step" if n == 1 else "steps"


@dataclass(frozen=True)
class FindingWords:
    """A finding's texts: its title, observation, root cause, recommendation and gain formula."""

    title: str
    observation: str
    root_cause: str
    recommendation: str
    formula: str


@dataclass(frozen=True)
class NoteWords:
    """A note's texts: its title and text."""

    title: str
    text: str


F = TypeVar("F", bound=Facts)
#: reason code → the renderer of a finding of that case / of a note of that case, with the facts class it reads
FINDING_WORDS: dict[str, tuple[Callable[[Any, Setting], FindingWords], type]] = {}
NOTE_WORDS: dict[str, tuple[Callable[[Any], NoteWords], type]] = {}


def facts_class(render: Callable[..., object]) -> type:
    """The facts class a renderer reads: the annotation of its first parameter."""
    hints = typing.get_type_hints(render)
    cls: type = hints[next(iter(hints))]
    return cls


def _finding_words(*reasons: Reason) -> Callable[[Callable[[F, Setting], FindingWords]],
                                                  Callable[[F, Setting], FindingWords]]:
    def register(render: Callable[[F, Setting], FindingWords]) -> Callable[[F, Setting], FindingWords]:
        FINDING_WORDS.update(dict.fromkeys(reasons, (render, facts_class(render))))
        return render
    return register


def _note_words(*reasons: Reason) -> Callable[[Callable[[F], NoteWords]], Callable[[F], NoteWords]]:
    def register(render: Callable[[F], NoteWords]) -> Callable[[F], NoteWords]:
        NOTE_WORDS.update(dict.fromkeys(reasons, (render, facts_class(render))))
        return render
    return register


def _renderer(table: dict[str, tuple[Any, type]], reason: Reason, facts: Facts) -> Any:
    render, cls = table[reason]
    if not isinstance(facts, cls):
        raise TypeError(f"facts of reason {reason!r} are a {type(facts).__name__}: expected a {cls.__name__}")
    return render


def finding(rule: str, reason: Reason, facts: Facts, setting: Setting, expected_gain: float | None,
            confidence: str, basis: str, predicted_gain: float | None, **more: Any) -> Finding:
    """A finding of ``rule`` in case ``reason``, its texts rendered from ``facts`` and ``setting`` (``more``:
    Finding's other fields)."""
    w: FindingWords = _renderer(FINDING_WORDS, reason, facts)(facts, setting)
    return Finding(rule, w.title, w.observation, w.root_cause, w.recommendation, expected_gain, w.formula,
                   confidence, setting, basis, predicted_gain, reason=reason, facts=facts, **more)


def note(rule: str, reason: Reason, facts: Facts, **more: Any) -> Note:
    """A note of ``rule`` in case ``reason``, its title and text rendered from ``facts`` (``more``: Note's other
    fields: ``judged``, ``steps``, ``lost_sec``)."""
    w: NoteWords = _renderer(NOTE_WORDS, reason, facts)(facts)
    return Note(rule, w.title, w.text, reason=reason, facts=facts, **more)


# ---- parts several renderers share -----------------------------------------------------------------------------

def too_short_words(e: fx.Evidence) -> str:
    """Why a run's timings cannot be judged: warmup not decided or not over, or fewer than
    :data:`~.model.MIN_STEADY_STEPS` steps after it."""
    if e.warmup_done is None:
        return "the log holds no warmup decision (no ThroughputMeter step lines)"
    if not e.warmup_done:
        return f"warmup was not finished after {e.steps} step{'' if e.steps == 1 else 's'}"
    return f"only {e.steady_steps} step(s) ran after warmup ({MIN_STEADY_STEPS} needed)"


def calibration_words(c: fx.Calibration, model: str) -> str:
    """A model's gain formula (``model``, written with the run's figures) with how far it is checked on this device
    type, or why the gain is not printed."""
    if not c.runs or c.error > 0.25:
        where = (f"calibrated on {', '.join(c.elsewhere)} only, not on {c.device_type}" if c.elsewhere and not c.runs
                 else "not calibrated against runs with the advice applied")
        return f"not printed: this model ({model}) is {where}"
    text = (f"{model}; calibrated on {c.device_type}: on {c.runs} run(s) with the advice applied the measured gain was "
            f"within {c.error:.0%} of this model's")
    if c.too_short:
        return f"too few steps to judge the gain ({too_short_words(c.too_short)}); the model: {text}"
    return text


def hit_words(h: fx.MemoryHit) -> str:
    """``micro-batch 8 ran out of memory at step 12 (its reason)``: a micro-batch that hit the memory limit."""
    what = {"oom": "ran out of memory", "watchdog": "neared the memory budget (the watchdog asked for less)",
            "memory_check": "did not fit at the longest length"}.get(h.kind)
    if what:
        return f"micro-batch {h.micro_batch} {what} at step {h.step}" + (f" ({h.reason})" if h.reason else "")
    if h.kind == "trial":
        return f"the tuner's trial of {h.split} " + ("ran out of memory" if h.error else "went over the memory budget")
    return f"the memory watchdog's {h.kind} at step {h.step} at micro-batch {h.micro_batch}"


def sized_words(r: fx.RaisedLimit) -> str:
    """How a raised ``max_completion_length`` was sized: from the lengths that ended, or a guess."""
    if r.guessed:
        return (f"no completion ended before the limit, so no length beyond {r.limit} was observed: {r.new} (TRL's "
                f"default {r.unseen_default}, within 2 to 16 times the limit) is a guess; the next report sizes it "
                "from the lengths that end")
    return (f"the {_pct(r.ended)} of completions that ended averaged {r.terminated_mean:.1f} tokens; at that spread "
            f"{r.ends_by:.0%} end by ≈ {r.need:.0f} tokens (next power of two {r.new})")


#: what a completion target rests on, by its ``basis`` (:class:`~.facts.CompletionTarget`: "p90" or "max")
TARGET_BASIS = {"p90": "p90 of the per-log longest completion", "max": "longest completion"}


def freed_words(x: fx.MemoryFreed) -> str:
    """The memory a completion cap frees, written out with its formulas."""
    text = (f"KV cache = {x.kv_formula} × ({x.old} − {x.new}) tokens × {x.sequences} sequences = "
            f"{_gb(x.kv_bytes)}")
    if x.train_bytes is not None:
        text += (f"; training activations and logits = ({x.train_formula}) × {x.old - x.new} tokens × "
                 f"{x.micro_batch} micro-batch = {_gb(x.train_bytes)}")
    return text


# ---- phases: saving, callbacks, recompute ----------------------------------------------------------------------

#: why an interval's events are more than its multiples: the event transformers 5 adds to a run (by the kind)
_AT_END = {"save": "its last save at the end of training", "eval": "its last evaluation at the end of training",
           "log": "the log of the run's metrics after training"}


def _events_after(i: fx.Interval, kind: str) -> str:
    """``8 times in this run's 40 steps (with its last save at the end of training)``: how often the event runs at
    the new interval over this run, and the run's own event beyond the multiples."""
    extra = kind == "log" or i.steps % i.new_every != 0
    times = "once" if i.events_after == 1 else f"{i.events_after} times"
    return f"{times} in this run's {i.steps} steps" + (f" (with {_AT_END[kind]})" if extra else "")


def _interval_item(i: fx.Interval, setting: str, work: str, kind: str) -> str:
    """The bullet that spaces out saves, logs or evaluations: ``setting`` (at ``new_every``), the interval now, how
    often it then runs, and the share of the wall time ``work`` then takes."""
    return (f"{setting} (now every {i.every}): {_events_after(i, kind)}; {work} then takes about "
            f"{_pct(i.share_after)} of the wall time")


def _interval_formula(i: fx.Interval, wall: float, done: str, sec: float, each: str, kind: str) -> str:
    """The measured gain of doing it every ``new_every`` steps instead of ``every``: ``done`` took ``sec`` seconds,
    each one (``each``) costing what this run's did; the runs at the new interval counted as transformers runs
    them."""
    return (f"measured: this run's {done} took {sec:.1f} s; every {i.new_every} steps instead of {i.every}, "
            f"{_events_after(i, kind)}, saves {i.saved_sec:.1f} s of {wall:.1f} s: {wall:.1f} / ({wall:.1f} − "
            f"{i.saved_sec:.1f}) = {i.gain:.2f}x (each {each} costing what this run's did)")


@_finding_words("save_share")
def _save_share(f: fx.SaveShare, setting: Setting) -> FindingWords:
    n, every, save, wall = f.saves, f.interval.every, f.save_sec, f.wall_sec
    obs = (f"{n} checkpoint saves (every {every} {_steps_word(every)}) took {save:.1f} s of the run's "
           f"{wall:.1f} s wall time ({_pct(save / wall)}), {save / n:.3g} s each, against "
           f"{f.interval.other_per_step_sec:.3g} s of everything else per step.")
    root = ("Each save writes the model, and unless `save_only_model` is set the optimizer and scheduler state too, "
            "to disk while training waits; saving every few steps spends more time writing checkpoints than "
            "training.")
    items = [_interval_item(f.interval, f"`save_steps: {f.interval.new_every}`", "saving", "save")]
    if not f.save_only_model:
        items.append("`save_only_model: true` writes the weights alone (no optimizer state: smaller and faster, but "
                     "a resume from it restarts the optimizer)")
    if not f.save_total_limit:
        items.append("`save_total_limit: 2` bounds the disk the checkpoints take (not their time)")
    items.append("with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`; this "
                 "transformers version has no asynchronous checkpoint save")
    return FindingWords("Checkpoint saving takes a large share of the wall time", obs, root, _bullets(items),
                        _interval_formula(f.interval, wall, f"{n} saves", save, "save", "save") + FLOOR)


def _callbacks_observation(t: fx.CallbackTimes) -> str:
    """What the callbacks and the logging took, with the costliest classes and their events."""
    named = "; ".join(f"`{name}` {sec:.1f} s (" + ", ".join(f"{e} {s:.1f} s" for e, s in events) + ")"
                      for name, sec, events in t.classes[:4])
    return (f"Callbacks of this run other than the package's took {t.user_sec:.1f} s and the trainer's logging "
            f"{t.log_sec:.1f} s of the {t.wall_sec:.1f} s wall time ({_pct((t.user_sec + t.log_sec) / t.wall_sec)})"
            + (f": {named}" if named else "") + ".")


@_finding_words("logging_share")
def _logging_share(f: fx.LoggingShare, setting: Setting) -> FindingWords:
    i = f.interval
    root = (f"The work runs at every training log: {f.logs} logs (every {i.every} {_steps_word(i.every)}) and the log "
            f"after training cost {f.on_log_sec / (f.logs + 1):.3g} s each in `on_log` and the trainer's log, against "
            f"{i.other_per_step_sec:.3g} s of everything else per step; the time between steps was not waiting for "
            "data.")
    items = [_interval_item(i, f"`logging_steps: {i.new_every}`", "the log-driven work", "log"),
             "or make the costly callback's `on_log` cheaper (a `model.generate` or an evaluation inside it runs "
             "at every log)"]
    formula = _interval_formula(i, f.callbacks.wall_sec, f"{f.logs} training logs and the log after training",
                                f.on_log_sec, "log", "log")
    return FindingWords("Logging and callbacks take a large share of the wall time",
                        _callbacks_observation(f.callbacks), root, _bullets(items), formula + FLOOR)


@_finding_words("one_callback")
def _one_callback(f: fx.OneCallback, setting: Setting) -> FindingWords:
    name, event, sec, wall = f.callback, f.event, f.callback_sec, f.callbacks.wall_sec
    root = (f"`{name}` spends {sec:.1f} s in its callbacks, most in `{event}`: work the trainer waits for at every "
            "such event; the time between steps was not waiting for data.")
    items = [f"make `{name}.{event}` cheaper, or let it act every N steps (`if state.global_step % N == 0`)",
             "or remove the callback from `callbacks`"]
    formula = (f"not predicted: how often the callback must run is the user's choice; all of its {sec:.1f} s of "
               f"{wall:.1f} s would be {wall / max(1e-9, wall - sec):.2f}x")
    return FindingWords(f"Callback {name} takes a large share of the wall time", _callbacks_observation(f.callbacks),
                        root, _bullets(items), formula)


@_finding_words("memory_to_spare")
def _memory_to_spare(f: fx.Recompute, setting: Setting) -> FindingWords:
    recompute, wall, gain = f.recompute_sec, f.wall_sec, f.gain or 0.0
    obs = (f"Gradient checkpointing re-ran the checkpointed layers' forwards for {recompute:.1f} s of the "
           f"{wall:.1f} s wall time ({_pct(recompute / wall)}); memory peaked at {f.high_water_gb:.2f} of "
           f"{f.budget_gb:.2f} GiB.")
    root = ("Activation checkpointing trades compute for memory: the backward runs each layer's forward again. "
            "TRL's `SFTConfig` and `GRPOConfig` turn it on by default (`gradient_checkpointing: true`), whether "
            f"or not the memory is short; here keeping the activations takes about {_gb(f.extra_bytes)} more "
            f"(micro-batch {f.micro_batch} × {f.seq_len} tokens), {f.after_gb:.2f} GiB of the "
            f"{f.budget_gb:.2f} GiB budget.")
    rec = ("`activation_checkpointing: false` (TRL: `gradient_checkpointing: false`); keep the `MemoryWatchdog` "
           "attached: it stops or re-sizes the run before the wall")
    formula = (f"measured: this run's recompute took {recompute:.1f} s of {wall:.1f} s: {wall:.1f} / "
               f"({wall:.1f} − {recompute:.1f}) = {gain:.2f}x")
    return FindingWords("Gradient checkpointing recomputes with memory to spare", obs, root, rec, formula + FLOOR)


@_note_words("would_not_fit")
def _would_not_fit(f: fx.Recompute) -> NoteWords:
    return NoteWords("Gradient checkpointing kept: the activations would not fit",
                     f"Recompute took {f.recompute_sec:.1f} s ({_pct(f.recompute_sec / f.wall_sec)} of the wall time), "
                     f"but keeping the activations would take about {_gb(f.extra_bytes)} more: {f.after_gb:.2f} of "
                     f"the {f.budget_gb:.2f} GiB budget, above the watchdog's margin.")


# ---- run: warmup, evaluation, the tuning's cost, the tuner's hint, evidence, fields skipped, scope --------------

#: the one-time costs of a fresh process the warmup note names beside the optimizer state and the allocator
FRESH_COSTS = {"mps": "Metal shader compilation", "cuda": "CUDA context and kernel selection",
               "xpu": "kernel compilation"}
#: the child processes' CPU seconds outside the steady steps from which the warmup note names them
CHILD_CPU_SEC = 0.5


def _contention_words(f: fx.Warmup) -> str:
    """What the warmup note says about other processes: the findings that name them, else the meter's measured
    seconds when there are any, else nothing."""
    names, c = f.contention_findings, f.contention
    if names:
        return (f" Other processes slowed this run too (the {' and the '.join(names)} finding"
                f"{'s' if len(names) > 1 else ''} above): that time is contention, not warmup, and it recurs.")
    if c:
        return (f" Other processes slowed {c.steps} step(s) ({ranges_text(step_ranges(c.step_list))}) by "
                f"{c.lost_sec:.1f} s, {_pct(c.lost_share)} of the run: contention, not warmup (below the "
                f"{CONTENTION_SHARE:.0%} that makes a finding).")
    return ""


@_note_words("not_finished")
def _warmup_not_finished(f: fx.Warmup) -> NoteWords:
    return NoteWords("Warmup not finished",
                     f"Warmup was not finished after {f.steps} step{'' if f.steps == 1 else 's'}: the meter has not "
                     "seen its steps settle at one level, so the run has no steady figures yet (run longer)."
                     + _contention_words(f))


def _compile_and_children(f: fx.Warmup) -> tuple[str, str]:
    """The first steps' compile (the trainer's ``torch_compile``) among a fresh process's one-time costs, and else
    the child processes' CPU time outside the steady steps (from :data:`CHILD_CPU_SEC`: DataLoader workers starting):
    the run's own work, not contention."""
    child = f.child_cpu_sec
    children = f"child processes used {child:.1f} s of CPU" if child is not None and child >= CHILD_CPU_SEC else ""
    if f.compile:
        return (" and torch.compile's first compile of the model (`torch_compile: true`"
                + (f"; {children}: inductor's compile workers, counted in the process's CPU time" if children else "")
                + ")"), ""
    if not children:
        return "", ""
    return "", (f" Outside the steady steps {children} (DataLoader workers starting, compile workers), counted in the "
                "process's CPU time: their work is the run's, not other processes'.")


@_note_words("first_step_steady", "excluded")
def _warmup(f: fx.Warmup) -> NoteWords:
    text = _sentence([warmup_words(f.warmup_steps, f.slowdown, f.overhead_sec, f.latest_first_step,
                                   levels=f.levels, in_band=f.in_band, tolerance=f.tolerance)])
    if f.first:
        text += (f" Step {f.first.step} counts among the steady steps (the meter found no warmup beyond "
                 f"it), so its {f.first.sec:.3g} s are in the steady figures: steady step "
                 f"{f.first.with_it:.3g} s, {f.first.without_it:.3g} s without it.")
    else:
        fresh, (compiled, children) = FRESH_COSTS.get(f.device_type), _compile_and_children(f)
        text += (" One-time costs of a fresh process (optimizer state, allocator growth"
                 + (f", {fresh}" if fresh else "") + ")" + compiled
                 + " do not recur; the steady figures exclude the warmup steps." + children)
    text += _contention_words(f)
    if f.share is not None and f.steps_for_target is not None:
        text += (f" In this short run warmup is {_pct(f.share)} of the time: compare steady figures only, "
                 f"or run ≥ {f.steps_for_target} steps for warmup below {f.target_share:.0%}.")
    return NoteWords("Warmup", text)


#: compute_metrics' share of the evaluation seconds from which the evaluation finding names it
METRICS_SHARE = 0.25


def _metrics_items(f: fx.EvalShare) -> list[str]:
    """What the trainer's ``compute_metrics`` took of the evaluation, and the logits every evaluation batch keeps
    for it (``compute_metrics`` set, neither ``prediction_loss_only`` nor ``preprocess_logits_for_metrics``)."""
    items = []
    metrics, eval_sec = f.metrics_sec, f.evaluation.eval_sec
    if metrics is not None and metrics >= METRICS_SHARE * eval_sec:
        items.append(f"`compute_metrics` took {metrics:.1f} s of the {eval_sec:.1f} s of evaluation "
                     f"({_pct(metrics / eval_sec)}): make it cheaper (vectorised, only the metrics you track), or "
                     "`batch_eval_metrics: true` (it then gets one batch at a time, `compute_result` on the last)")
    if f.compute_metrics and not f.loss_only and not f.preprocess_logits:
        items.append("every evaluation batch's logits (vocabulary × tokens numbers) are gathered and kept for "
                     "`compute_metrics`: pass `preprocess_logits_for_metrics=lambda logits, labels: "
                     "logits.argmax(-1)` to the Trainer (only the predicted ids are kept), or `prediction_loss_only: "
                     "true` where the loss is all the metrics need")
    return items


@_finding_words("eval_share")
def _eval_share(f: fx.EvalShare, setting: Setting) -> FindingWords:
    e, i = f.evaluation, f.interval
    obs = (f"{e.evals} evaluations (every {e.every} {_steps_word(e.every)}) took {e.eval_sec:.1f} s of the run's "
           f"{e.wall_sec:.1f} s wall time ({_pct(e.share)}), {e.eval_sec / e.evals:.3g} s each, against "
           f"{i.other_per_step_sec:.3g} s of training per step. The steady figures (s/step, tokens/s) leave "
           "evaluation out: the run's wall time does not.")
    root = ("Each evaluation runs the whole `eval_dataset` through the model; evaluating every few steps spends more "
            "time judging the model than training it.")
    items = [_interval_item(i, f"`eval_strategy: steps` with `eval_steps: {i.new_every}`", "evaluation", "eval"),
             *_metrics_items(f),
             "with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`",
             "or evaluate a smaller set (`eval_dataset.select(range(n))`) or with a larger "
             "`per_device_eval_batch_size`"]
    return FindingWords("Evaluation takes a large share of the wall time", obs, root, _bullets(items),
                        _interval_formula(i, e.wall_sec, f"{e.evals} evaluations", e.eval_sec, "evaluation", "eval")
                        + FLOOR)


@_finding_words("cost_over_saving")
def _cost_over_saving(f: fx.TuningCost, setting: Setting) -> FindingWords:
    d, cost, saving, train, lost = f.decision, f.cost_sec, f.saving_sec, f.train_sec, f.lost_sec
    kept, switched = split_label(d.new), d.new != d.old
    trials = "; ".join(t.words() for t in trial_figures(d))
    outcome = (f"is expected to save {saving:.1f} s over the rest of the run (switched to {kept} at step {d.step})"
               if switched else f"saves nothing: it kept the configured split {kept} at step {d.step}")
    obs = (f"The tuner's measurement of splits on this run's own steps cost {cost:.1f} s ({_pct(cost / train)} of "
           f"the {train:.1f} s of training) and {outcome}: {trials}.")
    root = ("A trial costs its switches (a checkpoint, the end of a train() call and the start of the next), the "
            "warm-up steps after each and any slower steps of the candidate; it pays only when the split it keeps "
            "saves more over the steps left. In a short or noisy run the candidate cannot be told apart from the "
            "noise in the steps there are" + (f" (the tuner's reason: {d.reason})" if d.reason else "") + ".")
    how = ("`tune: false` in the recipe (`--tune false`)" if f.launcher else
           "`train_with_tuning(trainer, tune=False)` (or `AdaptiveBatchTuner(tune=False)`)")
    items = [f"{how} for runs this short; the split it measured: {kept}",
             "or let the run be long enough to pay a trial back: the tuner weighs each round against the steps left"]
    formula = (f"measured: the tuning's own cost {cost:.1f} s"
               + (f" less its expected saving {saving:.1f} s" if switched else " (no saving: the split was kept)")
               + f", against {train:.1f} s of training: {train:.1f} / ({train:.1f} − {lost:.1f})"
               + (f" = {f.gain:.2f}x" if f.gain else ""))
    return FindingWords("The batch tuning cost more than it saved", obs, root, _bullets(items), formula)


@_note_words("needs_train_with_tuning")
def _needs_train_with_tuning(f: fx.TunerHint) -> NoteWords:
    return NoteWords("Batch split not measured: the tuner needs train_with_tuning",
                     _sentence([TUNER_NEEDS_TRAIN_WITH_TUNING])
                     + (" Use `hf-perf train`'s recipe key `tune`." if f.launcher else ""))


@_note_words("too_few_steps")
def _too_few_steps(e: fx.Evidence) -> NoteWords:
    why = too_short_words(e)
    more = (f"run ≥ {e.needed_steps} steps" if e.warmup_done else
            f"run more steps: warmup ends once the step times settle at one level, and {MIN_STEADY_STEPS} steps after "
            f"it are needed")
    timed = "data wait, " + ("generation share, " if e.grpo else "") + "micro-batch, slow early steps"
    counted = "forwards per micro-batch, padding, " + ("rewards, completion lengths, " if e.grpo else "") + "memory"
    return NoteWords(f"Too few steps to judge ({why})",
                     f"Too few steps to judge the timings: {why}. Not judged: {timed}; no gain is estimated. Judged "
                     f"anyway (counts, not timings): {counted}; thread oversubscription from {MIN_MACHINE_STEPS} "
                     f"steps on. To judge the rest, {more}.")


@_note_words("skipped")
def _skipped(f: fx.Skipped) -> NoteWords:
    return NoteWords("Fields skipped", "Skipped (another writer's format): " + "; ".join(f.skipped) + ".")


def stand_in_words(f: Scope) -> str:
    """The report's first words on a run that stood in for its recipe's target."""
    t = f.target
    assert t is not None, "a stand-in for a recipe's target"
    target = (f"{t.model or 'its model'} on {t.machine or 'its machine'}" + (f" ({t.device_type})" if t.device_type
                                                                             else "")
              + (f", completions ≤ {t.max_completion_length} tokens" if t.max_completion_length else ""))
    ran = (f"{model_label(f.model)} on {f.device_type}"
           + (f", completions ≤ {f.max_completion_length} tokens" if f.max_completion_length else ""))
    return (f"This run stood in for recipe `{t.recipe}`'s target ({target}): it trained {ran}. Its "
            "figures, memory estimates included, are this run's, not the target's, and no setting below undoes a "
            "memory choice of the recipe.")


@_note_words("stand_in")
def _stand_in(f: Scope) -> NoteWords:
    return NoteWords(f"A stand-in for the recipe's target ({', '.join(f.stand_in)} differ)", stand_in_words(f))


@_note_words("kept_for_recipe")
def _kept_for_recipe(f: fx.KeptForRecipe) -> NoteWords:
    t = f.target
    advised = ", ".join(f"{k}: {json.dumps(v)}" for k, _, v in f.undone)
    recipe = ", ".join(f"{k}: {json.dumps(v)}" for k, v, _ in f.undone)
    return NoteWords(f"Not advised for recipe {t.recipe}: {f.finding.lower()}",
                     f"This stand-in run ({model_label(f.model)} on {f.device_type}) would advise `{advised}`, but "
                     f"the recipe sets `{recipe}` for the memory of {t.model or 'its model'} on "
                     f"{t.machine or 'its machine'}: what a stand-in measures about memory says nothing about the "
                     "target's. Measure it on the recipe's own model and machine.")


# ---- machine: thread oversubscription, contention, recompiles --------------------------------------------------

@_finding_words("threads_over_free_cores")
def _threads_over_free_cores(f: fx.Oversubscription, setting: Setting) -> FindingWords:
    o, a = f.machine, f.advised_threads
    t, cores, other = o.threads or 0, o.cores or 0, o.other
    obs = (f"Over the whole run ({o.steps} steps) this process kept {o.busy:.2f} of its {t} threads "
           f"running (process CPU time / wall time) while other processes kept {other:.1f} of the {cores} cores "
           f"busy" + (f" (load {o.load:.1f} per core)" if o.load is not None else "")
           + f": {t} threads and {other:.1f} cores of other work asked for {f.demand:.1f} cores of "
           f"{cores}; steps of similar work took {o.spread or 0:.1f}x apart in wall time per token and "
           f"{o.cpu_spread or 0:.1f}x in CPU time per token.")
    assumed = [where for where in (o.cores_from, o.threads_from) if where != "run header"]
    if assumed:
        obs += " The run header does not record them: " + "; ".join(assumed) + "."
    root = (f"Thread oversubscription: torch splits each operation over {t} threads and waits at its end for all of "
            "them. While another process holds a core, one thread waits for it and its partner spins at the barrier, "
            "so CPU time rises with the wall time (why the slow-step check, which looks for slow steps with flat CPU "
            "time, cannot see it, and why it is not warmup: it recurs all run). With no more threads than free cores "
            "no thread waits for a core.")
    how = (f"`OMP_NUM_THREADS={a}` in the environment that starts the run: `OMP_NUM_THREADS={a} hf-perf train "
           f"--config …` (a recipe's `env:` is applied after torch has started its threads)" if f.launcher else
           f"`OMP_NUM_THREADS={a}` in the environment that starts the run, or `torch.set_num_threads({a})` before "
           "training")
    items = [how + f" ({cores} cores − {other:.1f} busy with other work, at least 1)",
             "or stop or move the other processes using these cores (a second training, a test suite, a build)"]
    formula = "not predicted: the run has no step without contention to compare with"
    if o.lower_bound:
        formula = (f"at least {o.lower_bound:.2f}x: the run's mean wall seconds per token over its fastest "
                   f"steps' (10th percentile) — those steps were contended too, and fewer threads also stop the "
                   f"spinning")
    return FindingWords("Thread oversubscription: more threads than free cores", obs, root, _bullets(items), formula)


def _recompile_text(f: fx.Recompiles) -> str:
    n, one = len(f.recompiles), len(f.recompiles) == 1
    steps = ranges_text(step_ranges(r.step for r in f.recompiles))
    return (f"{n} steady step{'' if one else 's'} (step{'' if one else 's'} {steps}) took "
            f"{f.lost_sec:.1f} s above the steady steps' median ({_pct(f.share)} of the run), "
            f"{'its' if one else 'their'} CPU time rising with {'it' if one else 'them'} (at least "
            f"{_pct(min(r.cpu_share for r in f.recompiles))} of the excess, child processes included): torch.compile "
            "compiled again")


@_finding_words("recompiles")
def _recompiles(f: fx.Recompiles, setting: Setting) -> FindingWords:
    root = ("A compiled graph is guarded by the shapes and values it was traced with: a batch of a new shape (a new "
            "padded length, the last partial batch) fails a guard, and dynamo traces and inductor compiles again "
            "while training waits. Its CPU time is the process's and its compile workers': not other processes.")
    items = ["fewer shapes: pad to a multiple (`pad_to_multiple_of: 64`, or the collator's) so lengths fall in a "
             "few buckets, and `dataloader_drop_last: true` so the last partial batch never runs",
             "`TORCH_LOGS=recompiles` names the guard that failed at each recompile; "
             "`torch._dynamo.config.recompile_limit` bounds how often one function compiles",
             "or `torch_compile: false` where the run is too short for compiled steps to pay their compiles back"]
    return FindingWords("Recompiles during training (torch.compile)", _sentence([_recompile_text(f)]), root,
                        _bullets(items), "not predicted: the run measures its recompiles, not a run without them")


@_note_words("recompiles_small")
def _recompiles_small(f: fx.Recompiles) -> NoteWords:
    return NoteWords("Recompiles (torch.compile)", _sentence([_recompile_text(f)])
                     + " Below the share that makes a finding; `TORCH_LOGS=recompiles` names the guard that failed.")


def _stretches_words(stretches: tuple[SlowStretch, ...]) -> str:
    """``steps 60–179 at 43% of the 2×4 split's speed, wall/CPU 1.90 against 1.02 (136.2 s lost)``, each stretch
    with its own figures."""
    return "; ".join(f"steps {s.first}–{s.last} at {s.share:.0%} of the {s.split + ' ' if s.split else ''}split's "
                     f"speed" + (f", wall/CPU {s.wall_over_cpu:.2f} against {s.steady_wall_over_cpu:.2f}"
                                 if s.wall_over_cpu is not None and s.steady_wall_over_cpu is not None else "")
                     + f" ({s.lost_sec:.1f} s lost)" for s in stretches)


def _unexplained_words(stretches: tuple[SlowStretch, ...]) -> str:
    why = ("the process's CPU time rose with the wall time (wall/CPU against the split's other steady steps), so "
           "other processes do not explain it" if any(s.wall_over_cpu is not None for s in stretches) else
           "no CPU time on this device tells other processes from the run's own work")
    return (f"{len(stretches)} stretch(es) of steady steps ran well below their split's speed ("
            f"{_stretches_words(stretches)}) and {why}; the log does not say what slowed them (longer sequences, "
            "the data, the machine's clock or memory)")


@_note_words("contention_below_share", "unexplained_stretches")
def _slow_stretches(f: fx.SlowStretches) -> NoteWords:
    text = ""
    if f.contended:
        text = (f"Other processes slowed {len(f.contended)} stretch(es) of steady steps ("
                f"{_stretches_words(f.contended)}): {f.lost_sec:.1f} s, {_pct(f.share)} of the run, "
                f"below the {CONTENTION_SHARE:.0%} that makes a finding. ")
    if f.unexplained:
        text += _unexplained_words(f.unexplained) + "."
    return NoteWords("Slow stretches" + (", cause unexplained" if not f.contended else ""), text.strip())


@_finding_words("other_processes")
def _other_processes(f: fx.OtherProcesses, setting: Setting) -> FindingWords:
    c = f.contention
    parts = [f"{c.steps} step(s) ({ranges_text(step_ranges(c.step_list))}) ran slower than the steady level "
             f"while their process CPU time did not rise with them (wall/CPU {c.wall_over_cpu:.2f} against "
             f"{c.steady_wall_over_cpu:.2f} when steady): {c.lost_sec:.1f} s"
             + (", the meter's `early_contention_sec`" if c.source == "meter" else "")] if c else []
    if f.contended:
        parts.append(f"{len(f.contended)} stretch(es) of steady steps ran well below their split's speed with their "
                     f"CPU time flat ({_stretches_words(f.contended)})")
    obs = "; ".join(parts) + f": {f.lost_sec:.1f} s ({_pct(f.share)} of the run) went to waiting for a CPU"
    if c and c.other_cores is not None:
        obs += f"; other processes kept up to {c.other_cores:.1f} CPU cores busy during those steps"
    obs += "."
    if f.unexplained:
        obs += " Besides, " + _unexplained_words(f.unexplained) + "."
    root = ("Other processes (or too many threads of this one) shared the CPU cores: the training process was "
            "runnable but not running. This is not warmup — warmup costs CPU time (allocation, compilation) and "
            "does not recur.")
    items = ["stop or move the other processes using these cores (a second training, a test suite, a build)",
             "or leave them the cores they need: `OMP_NUM_THREADS` / `torch.set_num_threads` at most the cores "
             "the other processes leave free (threads beyond them wait for each other)"]
    formula = (f"the measured time lost: 1/(1 − {f.lost_sec:.1f} s / {f.run_sec:.1f} s) = {f.gain:.2f}x (those "
               "steps at the steady level)")
    return FindingWords("CPU contention: other processes slowed the run", obs, root, _bullets(items), formula)


# ---- step: waiting for data, duplicate forwards, padding, the micro-batch --------------------------------------

def tuner_how(launcher: bool, tuner_attached: bool) -> str:
    """How a run gets the batch tuner to measure its splits, in the interface it was started with."""
    if launcher:
        return ("keep `AdaptiveBatchTuner` in the recipe's `callbacks` (the default) with `tune: true` (the "
                "default; `--tune false` turns it off)")
    if tuner_attached:
        return ("call `train_with_tuning(trainer)` instead of `trainer.train()`, with `AdaptiveBatchTuner(tune=True)` "
                "(the default): only then does the tuner measure the splits")
    return "attach `AdaptiveBatchTuner()` (`callbacks=default_callbacks()`) and call `train_with_tuning(trainer)`"


@_finding_words("no_workers", "workers_behind")
def _input_bound(f: fx.InputBound, setting: Setting) -> FindingWords:
    dl = f.dataloader
    settings = ", ".join(f"{k}={dl.get(k)}" for k in ("num_workers", "persistent_workers", "prefetch_factor",
                                                         "pin_memory") if k in dl)
    obs = f"The device waited for data {_pct(f.data_wait)} of the wall time (data-wait phase)" + \
          (f"; DataLoader: {settings}." if settings else ".")
    workers = dl.get("num_workers") or 0
    if workers == 0:
        root = ("Batches are loaded, tokenized and collated on the training process between steps "
                "(`dataloader_num_workers` 0), serially with compute, so the device idles while the CPU prepares "
                "the next batch.")
    else:
        root = f"{workers} DataLoader workers cannot keep up: preparing a batch takes longer than computing one."
    lines = [line for line, _ in dataloader_changes(f.device_type, dl)]
    model = f"workers hide the measured wait: 1/(1 − {f.data_wait:.2f}) = {f.predicted:.2f}x"
    return FindingWords("Input-bound: the device waits for data", obs, root, _bullets(lines),
                        calibration_words(f.calibration, model))


def _kept_words(f: fx.TunerMeasured) -> str:
    old, new = split_label(f.decision.old), split_label(f.decision.new)
    return f"kept the configured {old}" if old == new else f"switched from {old} to {new}"


@_note_words("tuner_measured_none")
def _tuner_measured_none(f: fx.TunerMeasured) -> NoteWords:
    d = f.decision
    figures_ = trial_figures(d)
    reason = f" (the tuner's reason: {d.reason})" if d.reason else ""
    tried = "; ".join(t.words() for t in figures_ if t.status != "reference")
    base = next((t for t in figures_ if t.status == "reference"), None)
    return NoteWords("Batch split not measured",
                     f"The tuner {_kept_words(f)} at step {d.step} without measuring another split{reason}"
                     + (f"; {base.words()}" if base is not None else "") + (f"; {tried}" if tried else "") + ".")


@_note_words("tuner_measured")
def _tuner_measured(f: fx.TunerMeasured) -> NoteWords:
    d = f.decision
    figures_ = trial_figures(d)
    reason = f" (the tuner's reason: {d.reason})" if d.reason else ""
    said = [f"measuring cost {d.cost_sec:.1f} s"] if d.cost_sec is not None else []
    if d.new == d.old:
        said.append("it kept the configured split, so the tuning saves nothing")
    elif d.expected_gain_sec is not None:
        said.append(f"expected saving {d.expected_gain_sec:.1f} s over the rest of the run")
    return NoteWords("Batch split chosen by measurement",
                     f"The tuner measured {f.measured} split(s) on this run's own training steps "
                     f"({'; '.join(t.words() for t in figures_)}) and {_kept_words(f)} at step {d.step}{reason}."
                     + (" " + _sentence(said) if said else "")
                     + (f" No larger micro-batch is advised: {hit_words(f.hit)}." if f.hit else ""))


@_note_words("memory_cap")
def _memory_cap_note(f: fx.MemoryCap) -> NoteWords:
    return NoteWords("Micro-batch kept small by memory",
                     f"Micro-batch {f.micro_batch} × accumulation {f.grad_accum}: no larger micro-batch is "
                     f"advised, because {hit_words(f.hit)}.")


@_finding_words("small_split")
def _small_split(f: fx.SmallSplit, setting: Setting) -> FindingWords:
    mb, ga, world = f.micro_batch, f.grad_accum, f.world_size
    effective = mb * ga * world
    obs = (f"Micro-batch {mb} × accumulation {ga}" + (f" × {world} devices" if world > 1 else "")
           + f" (effective batch {effective})" + (f"; MFU {_pct(f.mfu)}" if f.mfu is not None else "")
           + f"; compute {_pct(f.compute)} of the wall time"
           + (f"; {hit_words(f.hit)}, so nothing above micro-batch {f.hit.micro_batch - 1} is advised" if f.hit
              else "") + ".")
    if f.device_type == "cpu":
        root = ("Each micro-batch pays fixed costs (Python and autograd set-up, adapter dispatch, the optimizer's "
                f"accumulation) {ga} times per optimizer step; on a CPU the matmuls of a larger micro-batch run at "
                "about the same FLOP rate, so only those fixed costs can shrink — whether they matter is measured, "
                "not known in advance.")
    else:
        root = ("With 1–2 sequences per micro-batch the matmuls are too thin to fill the device: each micro-batch "
                f"pays its kernel launches and a forward/backward at low arithmetic intensity, {ga} times per "
                "optimizer step.")
    rec = (f"Try {_yaml(setting)} (effective batch {effective} unchanged"
           + (", the generation batch and GRPO's groups too" if f.grpo else "") + "), or measure instead of "
           f"guessing: {tuner_how(f.launcher, f.tuner_attached)}; the tuner times the exact splits "
           f"({', '.join(f.splits)}) on the run's own steps and keeps the fastest that fits memory.")
    formula = ("not predicted: a larger micro-batch helps only where per-micro-batch costs dominate (measured on GPUs, "
               "not on every CPU); the tuner measures it")
    return FindingWords("Small micro-batch", obs, root, rec, formula)


@_finding_words("grad_forwards")
def _grad_forwards(f: fx.DuplicateForward, setting: Setting) -> FindingWords:
    c, n = f.compute, f.forwards_per_microbatch
    obs = (f"{n:.2f} grad-enabled forward passes per micro-batch (expected 1); compute is {_pct(c)} of the wall "
           "time.")
    root = ("A custom `compute_loss` / `training_step` (or a metric or reward inside it) runs the model again with "
            "gradients on — e.g. recomputing the loss instead of taking it from the first forward's logits — so "
            "each micro-batch pays for the forward, and its graph and backward, more than once.")
    rec = ("Compute the loss from the first forward's outputs (`outputs = model(**inputs)`; "
           "`loss = loss_fn(outputs.logits, labels)`); run any extra pass (metrics, rewards) under "
           "`torch.no_grad()` or drop it. `perf/forwards_per_microbatch` should read 1.")
    model = (f"compute scales with forwards per micro-batch: 1/((1 − {c:.2f}) + {c:.2f}/{n:.2f}) = "
             f"{f.predicted:.2f}x")
    return FindingWords("Duplicate forward pass", obs, root, rec, calibration_words(f.calibration, model))


@_finding_words("fixed_length")
def _fixed_length(f: fx.FixedLength, setting: Setting) -> FindingWords:
    length, p, c = f.length, f.pad_fraction, f.compute
    obs = (f"Every step was padded to exactly {length} positions (`perf/seq_len` {length} on all {f.steps} steps) "
           f"while {_pct(p)} of the positions were padding: about {(1 - p) * length:.0f} real tokens per sequence.")
    root = (f"A fixed length: the collator (or the tokenizer's `padding='max_length'`) pads every batch to {length} "
            f"whatever the lengths of its sequences, so the device computes on the pad positions, and attention on "
            "them quadratically. Grouping by length cannot help: it sorts sequences into batches, and a fixed length "
            f"pads every batch to {length} all the same.")
    if f.trainer_kind == "sft":
        items = [f"let `SFTTrainer`'s own collator pad per batch: drop the fixed-length `data_collator` (and "
                 f"`padding='max_length'` in any tokenization of your own), keeping `max_length: {length}` to bound "
                 "the longest",
                 "`padding_free: true` (flash attention) or `packing: true`: no padding at all"]
    else:
        items = ["pad per batch, to the longest sequence of each batch: tokenize without `padding='max_length'` and "
                 "collate with `DataCollatorWithPadding(tokenizer)` (causal LM: `DataCollatorForLanguageModeling("
                 f"tokenizer, mlm=False)`) and no fixed `max_length` (keep `truncation=True, max_length={length}` to "
                 "bound the longest)",
                 "with TRL's `SFTTrainer`: its own collator pads per batch (pass no `data_collator`); `padding_free: "
                 "true` or `packing: true` removes the padding altogether"]
    items.append("then `train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before): "
                 "similar lengths in a batch pad less")
    formula = ("not predicted: per-batch padding keeps the padding up to each batch's longest sequence, which the "
               "log does not record, and a step's costs that do not shrink with its positions (the optimizer step, "
               "per-micro-batch work outside the model's matmuls) cannot be told from those that do in a log padded "
               f"to one length on every step; the pad positions are {_pct(p)} of the positions, compute "
               f"{_pct(c)} of the wall time")
    return FindingWords("Padding to a fixed length", obs, root, _bullets(items), formula)


def _padding_observation(f: fx.Padding) -> str:
    k = f.pad_to_multiple_of
    return f"{_pct(f.pad_fraction)} of the positions in training forwards are padding" + \
        (f" (padded length up to {f.seq_len} tokens)" if f.seq_len else "") + \
        (f"; `pad_to_multiple_of` {k}" if k > 1 else "") + "."


@_finding_words("pad_to_multiple")
def _pad_to_multiple(f: fx.Padding, setting: Setting) -> FindingWords:
    k = f.pad_to_multiple_of
    root = (f"`pad_to_multiple_of: {k}` rounds every padded "
            + ("prompt and every completion block" if f.grpo else "batch") + f" up to a multiple of {k}: "
            "on average (k − 1)/2 extra positions each. It bounds the number of distinct shapes, which only "
            "MPS needs (one Metal graph per shape); on this device it is pure extra compute.")
    rec = "`pad_to_multiple_of: null` (the default: pad to the longest sequence of each batch)"
    formula = "not predicted: compute share or sequence length not measured"
    if f.calibration and f.rounding_share is not None and f.predicted is not None:
        c, r = f.compute, f.rounding_share
        formula = calibration_words(f.calibration, (
            f"the rounding adds ≈ {f.pad_parts} × ({k} − 1)/2 of the mean {f.mean_length or 0:.0f} padded positions "
            f"= {_pct(r)}; compute on them saved: 1/((1 − {c:.2f}) + {c:.2f} × (1 − {r:.3f})) = {f.predicted:.2f}x"))
    return FindingWords("Padding from pad_to_multiple_of", _padding_observation(f), root, rec, formula)


@_note_words("grpo_inherent")
def _grpo_inherent(f: fx.Padding) -> NoteWords:
    return NoteWords("Padding", f"{_padding_observation(f)} GRPO pads each micro-batch's completions to its longest one"
                     + (" and left-pads its prompts to the longest prompt" if f.prompts_per_micro_batch > 1
                        else " (each micro-batch holds one prompt, so prompts add none)")
                     + ": unequal completion lengths are inherent in sampling and no setting removes that padding"
                     + ("; on MPS `pad_to_multiple_of` adds to it on purpose (fewer Metal graphs)"
                        if f.pad_to_multiple_of > 1 else "") + ".")


_GROUP = ("`train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before) puts "
          "similar lengths in a batch")
_PADDING_REST = ["with TRL SFT: `padding_free: true` or `packing: true`",
                 "split very long documents into `max_length` chunks"]


@_finding_words("one_length_unsure")
def _one_length_unsure(f: fx.Padding, setting: Setting) -> FindingWords:
    root = (f"Batches are padded to one length, {f.seq_len} positions, on the steps logged: a fixed length (a "
            f"collator's `max_length`, `padding='max_length'`) or each batch's longest sequence; too few steps "
            f"({MIN_FIXED_LENGTH_STEPS} needed) to tell which. The device computes on the pad positions, "
            f"attention quadratically.")
    items = ["if the collator pads to a fixed length, pad per batch instead (tokenize without "
             "`padding='max_length'`, collate with `DataCollatorWithPadding`): grouping cannot shorten a fixed "
             "length", _GROUP, *_PADDING_REST]
    return FindingWords("Padding waste", _padding_observation(f), root, _bullets(items),
                        "not predicted: which padding the collator does is not yet known from the log")


@_finding_words("per_batch")
def _per_batch(f: fx.Padding, setting: Setting) -> FindingWords:
    root = ("Batches are padded to the longest sequence of each batch (the padded length changed from step to step, "
            "so the padding is per batch): long and short sequences share batches, and the device computes on the "
            "pad positions, attention quadratically.")
    return FindingWords("Padding waste", _padding_observation(f), root, _bullets([_GROUP, *_PADDING_REST]),
                        "not predicted: how much padding grouping removes depends on the length distribution")


# ---- grpo: a run that cannot learn, generation, weight syncs, rewards, the completion budget --------------------

_BACKEND_WORDS = {"transformers": "HF generate", "transformers-paged": "HF continuous batching",
                  "vllm-server": "vLLM server", "vllm-colocate": "vLLM colocated", "vllm": "vLLM",
                  "vllm-async": "async GRPO's vLLM server"}
_CHECK_BY_HAND = ("check the reward functions on a few completions by hand: a reward that is constant by mistake (a "
                  "parsing error that always returns 0) looks exactly like this")


@_note_words("no_reward_data")
def _no_reward_data(f: fx.NoRewardData) -> NoteWords:
    return NoteWords("No reward data",
                     "No reward data in this run's logs (no `log/reward` in the step lines): whether the run can "
                     "learn was not checked.")


@_note_words("too_few_logs")
def _too_few_logs(f: fx.TooFewLogs) -> NoteWords:
    return NoteWords("Too few logs to judge the rewards",
                     f"Every completion of the {f.logs} log(s) scored {f.reward:.3g}: too few logs to "
                     f"judge whether the run can learn ({f.logs_needed} needed; `logging_steps` sets how often the "
                     "trainer logs).")


_NO_LEARNING_FORMULA = "no speed figure: until rewards differ within a group no step changes the weights"


@_finding_words("constant_reward")
def _constant_reward(f: fx.NoLearning, setting: Setting) -> FindingWords:
    funcs = ", ".join(f"`{name}` {value:.3g}" for name, value in f.reward_funcs)
    n = f.no_signal_run
    obs = (f"On all {f.logs} logs every completion got the same reward, {f.reward_min:.3g}: no prompt "
           f"group had any spread (`reward_std` 0)" + (f"; per reward function: {funcs}" if funcs else "")
           + (f"; the gradient norm was 0 on {n} consecutive logs" if n else "") + ".")
    root = ("GRPO learns from reward differences between the completions of one prompt (each advantage is a "
            "reward minus its group's mean). Every completion of this run scored the same, so every advantage, "
            "the loss and the gradient were 0: the weights never moved. More samples per prompt or a higher "
            "temperature cannot move a reward that no sample of the whole run has moved: the reward gives no "
            "partial credit the model's completions can reach, or the task is too hard for this model.")
    items = ["make the reward give partial credit a sampled completion can reach (the format, a correct part, "
             "closeness to the answer), so that completions of a group differ", _CHECK_BY_HAND,
             "or start where the model succeeds sometimes: an easier task or curriculum, or a model (or a short "
             "supervised warm-start) that solves some prompts"]
    if f.raised:
        items.append(f"then, if the answers need more room: `max_completion_length: {f.raised.new}` (now "
                     f"{f.raised.limit}; {_pct(f.clipped)} of completions were cut at the limit) — a longer limit "
                     "cannot make a reward that no completion moved vary by itself")
    return FindingWords("The run cannot learn: every completion got the same reward", obs, root, _bullets(items),
                        _NO_LEARNING_FORMULA)


@_finding_words("no_group_variance")
def _no_group_variance(f: fx.NoLearning, setting: Setting) -> FindingWords:
    obs = (f"On {f.no_signal_run} consecutive logs (of {f.logs}) every prompt group's completions got the same "
           f"reward (`frac_reward_zero_std` 1) and the gradient norm was 0"
           + (f"; the mean reward of those logs was {f.reward_mean:.3g}" if f.reward_mean is not None else "")
           + (f"; over all {f.logs} logs the mean reward ranged from {f.reward_min:.3g} to {f.reward_max:.3g}, so "
              "some prompts score and others do not" if f.reward_varied else "") + ".")
    root = ("GRPO's advantage is each completion's reward minus its group's mean: when all completions of a "
            "group score the same, every advantage is 0, so the loss and the gradient are 0 and the weights do "
            "not move.")
    items = ["reward shaping: give partial credit a sampled completion can reach (format, a correct part, "
             "closeness), so completions of a group differ"]
    if "num_generations" in setting:            # more samples per prompt: chosen where some prompts score
        text = (f"`num_generations: {setting['num_generations']}` (more samples per prompt: more chances that one "
                "scores differently from the others)")
        if "steps_per_generation" in setting:
            text += (f" with `steps_per_generation: {setting['steps_per_generation']}` (the generation batch must "
                     "hold whole groups)")
        items.append(text)
        if "temperature" in setting:
            items.append(f"`temperature: 1.0` (now {f.temperature or 0:g}): more varied samples within a group")
    items.append(_CHECK_BY_HAND)
    return FindingWords("The run cannot learn: no reward variance, zero gradients", obs, root, _bullets(items),
                        _NO_LEARNING_FORMULA)


def _doubled_generation(spg: int, gain: str, steps_per_rollout: float = 1.0) -> str:
    """The bullet that doubles ``steps_per_generation`` (now ``spg``): what it saves (``gain``), and its cost."""
    return (f"`steps_per_generation: {2 * spg}` (now {spg}): {gain}. The cost is on-policy-ness: the rollouts "
            f"then serve {2 * spg} micro-batches"
            + (f" ({steps_per_rollout:g} optimizer steps)" if steps_per_rollout > 1 else "")
            + ", so the updates after the first learn from completions sampled by older weights (off-policy); "
              "TRL then computes the sampling policy's log-probabilities (one more forward over the generation "
              "batch) and clips the importance ratio at `epsilon`")


@_finding_words("launch_bound", "generation_share")
def _generation_bound(f: fx.GenerationBound, setting: Setting) -> FindingWords:
    g, u, backend = f.generation, f.decode_bandwidth_util, f.backend
    obs = f"Generation (rollouts, {_BACKEND_WORDS.get(backend, backend)}) took {_pct(g)} of the run's wall time"
    if f.weight_sync_share:
        obs += f", weight syncs to vLLM {_pct(f.weight_sync_share)} of the wall time within it"
    if f.steady_step_sec:
        obs += f"; a steady step took {f.steady_step_sec:.2f} s"
    if f.rollout_tokens_per_sec:
        obs += f"; {f.rollout_tokens_per_sec:.0f} completion tokens/s"
    if u is not None:
        obs += f"; decode read the weights at {_pct(u)} of peak memory bandwidth"
        obs += " — launch-bound, not bandwidth-bound" if f.launch_bound else ""
    obs += "."
    if backend.startswith("vllm"):
        root = ("TRL generates synchronously: training waits while vLLM decodes the generation batch until its "
                "longest completion (and, after each optimizer step, while the new weights are sent to it). "
                "Generation does not depend on the training split, so it dominates a GRPO step.")
    else:
        root = ("HF `generate` decodes one token per step for the whole batch and runs every layer for each token; a "
                "batch decodes until its longest completion. Generation does not depend on the training split, so "
                "it dominates a GRPO step.")
    lines: list[str] = []
    if f.suggest_vllm:
        lines += ["`use_vllm: true` with `vllm_mode: colocate` (paged KV cache and CUDA graphs remove the per-token "
                  "launch overhead; `vllm_gpu_memory_utilization: 0.3` leaves room for training)",
                  "or, without vLLM, `cache_implementation: static` (fixed-shape KV cache, no re-allocation per "
                  "token)"]
    if backend == "vllm-server":
        lines.append("more GPUs for the vLLM server (`vllm serve ... --data-parallel-size N`): the generation batch "
                     "is spread over its engines")
    if f.optimizer_steps_per_rollout is not None and f.steps_per_generation:
        lines.append(_doubled_generation(f.steps_per_generation, "one generate call for twice the sequences, the "
                                         "same decode steps", f.optimizer_steps_per_rollout))
    if f.target is not None:
        lines.append(f"`max_completion_length: {f.target.new}` (the {TARGET_BASIS[f.target.basis]} is "
                     f"{f.target.tokens:.0f} tokens; decode steps = the longest completion of a batch)")
    if f.clipped_large:
        lines.append(f"do not shorten `max_completion_length`: {_pct(f.clipped)} of completions are already "
                     "cut at the limit")
    formula = (f"not predicted: the run does not measure generation at another batch or backend (generation free "
               f"would be the ceiling, 1/(1 − {g:.2f}) = {1 / (1 - g):.1f}x)")
    return FindingWords("Generation-bound GRPO step", obs, root, _bullets(lines), formula)


@_finding_words("sync_share")
def _sync_share(f: fx.WeightSync, setting: Setting) -> FindingWords:
    share, backend, gen = f.share, f.backend, f.generation
    obs = (f"Sending the weights to vLLM ({_BACKEND_WORDS.get(backend, backend)}) took {_pct(share)} of the wall "
           f"time: {f.syncs} syncs" + (f" of ≈ {f.sync_sec:.2f} s each" if f.sync_sec else "")
           + (f"; generation as a whole {_pct(gen)}" if gen else "") + ".")
    root = ("Before generating after an optimizer step, TRL sends every weight of the model to vLLM "
            "(`VLLMGeneration.sync_weights`; with LoRA the adapters are merged and the whole model is sent), and the "
            "trainer waits for it. Its cost grows with the model, not with the batch, so it weighs most where "
            "generation batches are small.")
    if backend == "vllm-async":
        root = ("AsyncGRPOTrainer pauses the server and sends it every weight after each `weight_sync_steps` optimizer "
                "steps (`_sync_weight`); the trainer waits for the transfer. Its cost grows with the model, not with "
                "the batch.")
    if f.sleep_mode:
        root += (" With `vllm_enable_sleep_mode` the engine drops its weights after every generate call (sleep "
                 "level 2), so a second call in one step (tool-call turns, evaluation) sends them again.")
    lines: list[str] = []
    if "steps_per_generation" in setting and f.steps_per_generation:
        lines.append(_doubled_generation(f.steps_per_generation, "one generation, and one sync, for twice the "
                                         "micro-batches"))
    if "weight_sync_steps" in setting:
        lines.append(f"`weight_sync_steps: {setting['weight_sync_steps']}` (now {f.weight_sync_steps}): "
                     "half the transfers; the cost is staleness: rollouts come from older weights (up to "
                     "`max_staleness` versions back)")
    if backend in ("vllm-server", "vllm-async"):
        lines.append("keep the server on GPUs of the training node (NVLink or PCIe, not across the network): the "
                     "weights travel over NCCL from the training process's first rank")
    formula = (f"not predicted: the run measures syncs at one setting (syncs free would be the ceiling, "
               f"1/(1 − {share:.2f}) = {1 / (1 - share):.2f}x)")
    return FindingWords("Weight syncs to vLLM take a large share of the step", obs, root, _bullets(lines), formula)


@_finding_words("waits_for_rollouts")
def _waits_for_rollouts(f: fx.RolloutWait, setting: Setting) -> FindingWords:
    share, staleness = f.share, f.staleness
    obs = (f"The trainer waited for rollouts {_pct(share)} of the wall time (TRL's `perf/rollout_wait_s`)"
           + (f"; the samples it trained were {staleness:.1f} policy versions old on average"
              if staleness is not None else "") + ".")
    root = ("AsyncGRPOTrainer trains on what its rollout queue holds; an empty queue stops the step until the "
            "rollout worker's requests to the vLLM server come back: generation is slower than training.")
    lines = ["more generation: more vLLM engines (`vllm serve ... --data-parallel-size N`) and more requests in "
             "flight (`max_inflight_tasks`)",
             "or a larger `max_staleness`: the worker may generate further ahead, and the trainer learns from "
             "older policies' samples (more off-policy)"]
    formula = (f"not predicted: the run does not measure another generation rate (no wait would be the ceiling, "
               f"1/(1 − {share:.2f}) = {1 / (1 - share):.2f}x)")
    return FindingWords("The async trainer waits for rollouts", obs, root, _bullets(lines), formula)


@_finding_words("reward_share")
def _reward_share(f: fx.RewardShare, setting: Setting) -> FindingWords:
    seconds, wall, calls, per = f.reward_sec, f.wall_sec, f.calls, f.completions_per_call
    funcs = ", ".join(f.funcs)
    obs = (f"The reward functions{f' ({funcs})' if funcs else ''} took {seconds:.1f} s of the run's {wall:.1f} s wall "
           f"time ({_pct(seconds / wall)}): {calls} call{'' if calls == 1 else 's'} of ≈ {seconds / calls:.3g} s "
           "each" + (f", each scoring ≈ {per:.0f} completions" if per is not None else "") + ".")
    root = ("TRL scores a generation batch between generating it and training on it (`_calculate_rewards`: each "
            "reward function once, with every completion of the batch), and training waits: a reward that calls a "
            "model, a server or a sandbox per completion, one after another, holds every step.")
    items = ["score the completions of a call together: the function gets all of them at once (`completions`, "
             "`completion_ids`), so one batched model call or request can replace one per completion",
             "`async def` for a reward that waits (an API, a judge, a sandbox): TRL runs its async reward functions "
             "concurrently on an event loop of their own"]
    if "steps_per_generation" in setting and f.steps_per_generation:
        items.insert(0, _doubled_generation(f.steps_per_generation, "half the reward calls, each scoring twice the "
                                            "completions — pays where a call has a cost of its own (a round trip, a "
                                            "model load)"))
    formula = (f"not predicted: the run does not tell a reward's cost per call from its cost per completion; all of "
               f"its {seconds:.1f} s of {wall:.1f} s would be {wall / max(1e-9, wall - seconds):.2f}x")
    return FindingWords("The reward functions take a large share of the wall time", obs, root, _bullets(items),
                        formula)


def _completion_observation(s: fx.CompletionLengths) -> str:
    stats = ", ".join(f"{name} {value:.0f}" for name, value in (
        ("mean", s.mean), ("p90 of per-log max", s.p90), ("max", s.max)) if value is not None)
    return (f"Completion lengths: {stats or 'n/a'} tokens against `max_completion_length` {s.limit}"
            + (f"; clipped ratio {_pct(s.clipped_ratio)} (mean over the run's logs)" if s.clipped_ratio is not None
               else "") + ".")


@_finding_words("cut_off")
def _cut_off(f: fx.CutOff, setting: Setting) -> FindingWords:
    clipped, limit, raised = f.clipped, f.seen.limit, f.raised.new
    root = (f"{_pct(clipped)} of completions reached `max_completion_length` {limit} before the model ended them. A "
            "cut completion is scored on an unfinished answer (a missing closing tag or final answer usually scores "
            "0) and, unless masked, trained on as if it were complete.")
    raise_it = (f"`max_completion_length: {raised}` (now {limit}; {sized_words(f.raised)}) if the answers need the "
                f"room: each step then decodes up to {raised / limit:.0f} times as many tokens (slower) and holds a "
                "longer KV cache")
    mask = ("`mask_truncated_completions: true`: cut completions are left out of the loss, so only finished answers "
            f"teach (with {_pct(clipped)} cut, few remain: raise the limit too)")
    items = [raise_it, mask] if f.headroom else [mask, raise_it]
    items.append("or reward finishing within the budget (TRL's `get_soft_overlong_punishment`), or ask for shorter "
                 "answers in the prompt")
    return FindingWords("Most completions are cut off at max_completion_length", _completion_observation(f.seen),
                        root, _bullets(items), "no speed figure: a quality finding (a higher limit makes steps "
                        "slower, not faster)")


@_note_words("no_runaways")
def _no_runaways(f: fx.Runaways) -> NoteWords:
    return NoteWords("max_completion_length far above what completions use",
                     f"{_completion_observation(f.seen)} No completion reached the limit, so time is unchanged by a "
                     f"cap; `max_completion_length: {f.target.new}` (next power of two ≥ {f.headroom_factor} × the "
                     f"{TARGET_BASIS[f.target.basis]}) would bound runaway rollouts"
                     + (f" and free ≈ {_gb(f.freed.total_bytes)} at the limit, if memory is ever short"
                        if f.freed else "") + ".")


@_finding_words("runaways")
def _runaways(f: fx.Runaways, setting: Setting) -> FindingWords:
    limit, basis, new, headroom = f.seen.limit, f.target.tokens, f.target.new, f.headroom_factor
    root = (f"The limit is {limit / basis:.1f}x what the task uses. A completion that never emits end-of-sequence "
            f"decodes to the limit, holds the whole generation batch for {limit} decode steps and pads every "
            f"training sequence of its batch to {limit} tokens.")
    rec = (f"`max_completion_length: {new}` (next power of two ≥ {headroom} × {basis:.0f} = "
           f"{headroom * basis:.0f}, the {TARGET_BASIS[f.target.basis]}).")
    if f.seen.max is not None and f.seen.max > new:
        rec += f" The longest observed completion ({f.seen.max:.0f}) would be cut."
    if f.freed:
        rec += f" At the limit this frees ≈ {_gb(f.freed.total_bytes)}: {freed_words(f.freed)}."
    formula = (f"not predicted: {_pct(f.clipped)} of completions reached the limit; how much decode time a "
               "cap saves depends on how often a batch holds one")
    return FindingWords("Runaway completions reach max_completion_length", _completion_observation(f.seen), root, rec,
                        formula)


# ---- memory: swapping, pressure, the wall close, driver memory far above live tensors ------------------------

def _remedy_words(r: fx.Remedy) -> str:
    if r.code == "leak_first":
        return ("fix the leak first: memory that grows on every step comes from tensors kept across steps (a loss "
                "appended without `.item()`, a growing cache); a smaller micro-batch does not stop it")
    if r.code == "free_outside":
        return ("free the memory held outside this run (another process on the device, a pool outside PyTorch's "
                "allocator), or give the run a device of its own"
                + ("; with vLLM colocated, a lower `vllm_gpu_memory_utilization`" if r.use_vllm else ""))
    if r.code == "checkpointing":
        text = "`activation_checkpointing: true` (`gradient_checkpointing` before transformers 5; ~20–30% more compute)"
        if r.saved_bytes:
            text += (f": activations per token {r.formula} → {r.formula_after}, × {r.tokens} "
                     f"frees ≈ {_gb(r.saved_bytes)}")
        return text
    if r.code == "smaller_split" and r.split:
        micro, accum, new_mb, new_ga = r.split
        text = (f"`per_device_train_batch_size: {new_mb}` with `gradient_accumulation_steps: {new_ga}` (effective "
                f"batch {micro} × {accum} = {new_mb} × {new_ga} = {micro * accum}, unchanged)")
        if r.saved_bytes:
            text += (f": frees ≈ {_gb(r.saved_bytes)} = ({r.formula}) × {r.seq_len} tokens × "
                     f"{micro - new_mb} fewer sequences")
        return text
    if r.code == "shorter_completions" and r.target:
        text = (f"`max_completion_length: {r.target.new}` (now {r.limit}; the "
                f"{TARGET_BASIS[r.target.basis]} is {r.target.tokens:.0f})")
        if r.saved_bytes and r.freed:
            text += f": frees ≈ {_gb(r.saved_bytes)} at the limit — {freed_words(r.freed)}"
        return text
    assert r.code == "shorter_completions_hint", r.code
    return ("a shorter `max_completion_length` if the task's answers are short (see `completions/max_length` in the "
            "logs)")


def _wall_words(f: fx.MemoryPressure) -> list[str]:
    """The budget, the wall's moves, a leak, the watchdog's actions and the tuner's OOMs, in words."""
    out = []
    low, high = f.budget_range_gb or (0.0, 0.0)
    if f.budget_range_gb and high > 1.01 * low:
        out.append(f"the budget followed what the run could reach, between {low:.2f} and {high:.2f} GiB")
    out += [f"at step {step} the wall {'moved' if moved else 'was set'}: {why}"
            for step, why, moved in f.wall_moves[:4] if why]
    if f.leak_mib_per_step:
        out.append(f"memory grew by {f.leak_mib_per_step:.0f} MiB on every step: a leak")
    if f.actions:
        acts = ", ".join(f"{action} at step {step}" for action, step in f.actions[:5])
        out.append(f"the watchdog acted {len(f.actions)} times ({acts})")
    out += [f"micro-batch {micro} ran out of memory at step {step} (the tuner went on at {split})"
            for micro, step, split in f.ooms]
    return out


def _memory_seen(f: fx.MemoryPressure) -> list[str]:
    """What the memory finding observed: swap, pressure, the high-water mark, the wall's distance, the allocator."""
    seen = []
    if f.swapping:
        seen.append(f"swap grew by {f.swap_growth_gb or 0.0:.2f} GiB" +
                    (f" with swap-outs on {f.swapout_steps} steps" if f.swapout_steps else ""))
    if f.max_pressure:
        level = f.max_pressure
        seen.append(f"memory pressure reached {('warn', 'critical')[min(level, 2) - 1]} (level {level})")
    if f.high_water_gb is not None and f.budget_gb:
        seen.append(f"high-water mark {f.high_water_gb:.2f} GiB of a {f.budget_gb:.2f} GiB budget "
                    f"({_pct(f.high_water_gb / f.budget_gb)})")
    if f.steps_to_wall is not None and f.wall_near:
        seen.append(f"the budget was {f.steps_to_wall:.0f} steps away at the current growth")
    if f.allocator_bloat and f.driver_gb is not None and f.allocated_gb is not None:
        seen.append(f"the allocator held {f.driver_gb:.2f} GiB while live tensors were {f.allocated_gb:.2f} GiB "
                    f"({f.driver_gb - f.allocated_gb:.2f} GiB cached)")
    return seen + _wall_words(f)


@_finding_words("swapping", "near_the_wall", "pressure")
def _memory_pressure(f: fx.MemoryPressure, setting: Setting) -> FindingWords:
    if f.device_type == "mps":
        root = ("Unified memory: Metal memory (weights, activations, the allocator's cache) competes with the OS and "
                "other apps; past the working set macOS compresses and then swaps pages to SSD, and every kernel "
                "that touches a swapped page waits for it.")
    elif f.device_type == "cuda":
        root = ("The GPU works close to its memory limit: the caching allocator retries, fragments and finally "
                "raises out-of-memory; a GPU does not swap, it stops.")
    else:
        root = "Training memory is close to physical RAM: the OS swaps and every step waits for page-ins."
    if f.swapping and f.grpo:
        root += (" In GRPO the peak is the training forward/backward over prompt + completion tokens (activations "
                 "and full-vocabulary logits) on top of the generation KV cache.")
    lines = [_remedy_words(r) for r in f.remedies]
    if f.allocator_advice == "mps_cache_clearer":
        lines.append(("add `MPSCacheClearer` to the recipe's `callbacks`" if f.launcher else
                      "attach `MPSCacheClearer()` (`callbacks=default_callbacks()` has it)")
                     + ": it clears the Metal cache when driver memory runs ahead of live tensors")
    elif f.allocator_advice == "expandable_segments":
        lines.append("`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the environment (less fragmentation of "
                     "the reserved memory)")
    if f.swapping:
        formula = ("not predicted: this run never ran without swapping, so its own step time without it is not "
                   "measured; swapping steps wait for the SSD and can be several times slower")
    else:
        formula = "no swapping observed: no speed-up; the gain is headroom (the GiB freed above) and no lost run"
    return FindingWords("Memory pressure" + (": the run is swapping" if f.swapping else ""),
                        _sentence(_memory_seen(f)), root, _bullets(lines), formula)


# ---- the report's "no finding" paragraph -----------------------------------------------------------------------

#: the "no finding" paragraph's words for the rewards (:attr:`~.facts.NothingFound.rewards`)
REWARD_WORDS = {"none": "no reward data in this run's logs", "varied": "the rewards varied within prompt groups",
                "flat": "the rewards never varied within a prompt group"}


def nothing_found_words(f: fx.NothingFound) -> str:
    """The "no finding" paragraph: only what this run's log shows, and a metric it holds."""
    checked = []
    if f.data_wait:
        checked.append("the device did not wait for data")
    if f.memory:
        checked.append("memory stayed within budget")
    if f.rewards:
        checked.append(REWARD_WORDS[f.rewards])
    text = "No rule found something to change" + (": " + ", ".join(checked) if checked else "") + "."
    if f.timings_unjudged:
        text += " The timings were too short to judge (see Not judged)."
    if f.metric:
        text += f" Track `{f.metric}` to compare future runs."
    return text
