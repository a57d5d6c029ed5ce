"""The analysis' English, in one place: one renderer per reason code (:data:`~.model.REASONS`) that writes a
finding's or a note's texts from its ``facts`` (and its ``setting``). A rule computes data only (the case it found,
the figures, the setting) and builds its result with :func:`finding` or :func:`note`; each sentence here is chosen
from that data, never appended to another rule's words, so two sentences of one result cannot contradict each other.

Rule modules whose words are rendered here: :data:`RENDERED_MODULES` (the others still write theirs inline).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .model import Fact, Facts, Finding, Note, Reason, Setting
from .rules.advice import FLOOR, _bullets, _gb, _pct


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


FindingRenderer = Callable[[Facts, Setting, Any], FindingWords]
NoteRenderer = Callable[[Facts, Any], NoteWords]
#: reason code → the renderer of a finding of that case / of a note of that case
FINDING_WORDS: dict[str, FindingRenderer] = {}
NOTE_WORDS: dict[str, NoteRenderer] = {}
#: the rule modules (under ``report/rules``) whose every result is worded here
RENDERED_MODULES: tuple[str, ...] = ("phases",)


def _finding_words(*reasons: Reason) -> Callable[[FindingRenderer], FindingRenderer]:
    def register(render: FindingRenderer) -> FindingRenderer:
        for reason in reasons:
            FINDING_WORDS[reason] = render
        return render
    return register


def _note_words(*reasons: Reason) -> Callable[[NoteRenderer], NoteRenderer]:
    def register(render: NoteRenderer) -> NoteRenderer:
        for reason in reasons:
            NOTE_WORDS[reason] = render
        return render
    return register


def finding(rule: str, reason: Reason, facts: Facts, setting: Setting, expected_gain: float | None,
            confidence: str, basis: str, predicted_gain: float | None, *, subject: Any = None,
            **more: Any) -> Finding:
    """A finding of ``rule`` in case ``reason``, its texts rendered from ``facts`` and ``setting`` (``subject``: a
    structured figure a renderer reads beside the facts, e.g. the tuner's decision; ``more``: Finding's other
    fields)."""
    w = FINDING_WORDS[reason](facts, setting, subject)
    return Finding(rule, w.title, w.observation, w.root_cause, w.recommendation, expected_gain, w.formula,
                   confidence, setting, basis, predicted_gain, reason=reason, facts=facts, **more)


def note(rule: str, reason: Reason, facts: Facts, *, subject: Any = None, **more: Any) -> Note:
    """A note of ``rule`` in case ``reason``, its title and text rendered from ``facts`` (``more``: Note's other
    fields: ``judged``, ``steps``, ``lost_sec``)."""
    w = NOTE_WORDS[reason](facts, subject)
    return Note(rule, w.title, w.text, reason=reason, facts=facts, **more)


def _num(facts: Facts, key: str) -> float:
    value: Fact = facts[key]
    assert isinstance(value, (int, float)), (key, value)
    return float(value)


def _int(facts: Facts, key: str) -> int:
    value: Fact = facts[key]
    assert isinstance(value, int), (key, value)
    return value


def _str(facts: Facts, key: str) -> str:
    return str(facts[key])


def _steps_word(n: int) -> str:
    return "step" if n == 1 else "steps"


# ---- phases: saving, callbacks, recompute ----------------------------------------------------------------------

@_finding_words("save_share")
def _save_share(f: Facts, setting: Setting, _: Any) -> FindingWords:
    n, every, new = _int(f, "saves"), _int(f, "every"), _int(f, "new_every")
    save, wall, saved, gain = _num(f, "save_sec"), _num(f, "wall_sec"), _num(f, "saved_sec"), _num(f, "gain")
    obs = (f"{n} checkpoint saves (every {every} {_steps_word(every)}) took {save:.1f} s of the run's "
           f"{wall:.1f} s wall time ({_pct(save / wall)}), {_num(f, 'per_save_sec'):.3g} s each, against "
           f"{_num(f, 'other_per_step_sec'):.3g} s of everything else per step.")
    root = ("Each save writes the model, and unless `save_only_model` is set the optimizer and scheduler state too, "
            "to disk while training waits; saving every few steps spends more time writing checkpoints than "
            "training.")
    items = [f"`save_steps: {new}` (now every {every}): saving then takes about {_pct(_num(f, 'share_after'))} of "
             "the wall time"]
    if not f["save_only_model"]:
        items.append("`save_only_model: true` writes the weights alone (no optimizer state: smaller and faster, but "
                     "a resume from it restarts the optimizer)")
    if not f["save_total_limit"]:
        items.append("`save_total_limit: 2` bounds the disk the checkpoints take (not their time)")
    items.append("with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`; this "
                 "transformers version has no asynchronous checkpoint save")
    formula = (f"measured: this run's {n} saves took {save:.1f} s; every {new} steps instead of {every} saves "
               f"{saved:.1f} s of {wall:.1f} s: {wall:.1f} / ({wall:.1f} − {saved:.1f}) = {gain:.2f}x (each save "
               f"costing what this run's did)")
    return FindingWords("Checkpoint saving takes a large share of the wall time", obs, root, _bullets(items),
                        formula + FLOOR)


def _callbacks_observation(f: Facts) -> str:
    """What the callbacks and the logging took, with the costliest classes (facts ``callback:<class>`` and
    ``callback:<class>:<event>``, in the order of their seconds)."""
    user, log, wall = _num(f, "user_sec"), _num(f, "log_sec"), _num(f, "wall_sec")
    classes = [k.split(":", 1)[1] for k in f if k.startswith("callback:") and k.count(":") == 1]
    named = "; ".join(
        f"`{name}` {_num(f, 'callback:' + name):.1f} s ("
        + ", ".join(f"{k.rsplit(':', 1)[1]} {_num(f, k):.1f} s" for k in f
                    if k.startswith(f"callback:{name}:") and k.count(":") == 2)
        + ")" for name in classes[:4])
    return (f"Callbacks of this run other than the package's took {user:.1f} s and the trainer's logging {log:.1f} s "
            f"of the {wall:.1f} s wall time ({_pct((user + log) / wall)})" + (f": {named}" if named else "") + ".")


@_finding_words("logging_share")
def _logging_share(f: Facts, setting: Setting, _: Any) -> FindingWords:
    logs, every, new = _int(f, "logs"), _int(f, "every"), _int(f, "new_every")
    on_log, wall, saved, gain = _num(f, "on_log_sec"), _num(f, "wall_sec"), _num(f, "saved_sec"), _num(f, "gain")
    root = (f"The work runs at every training log: {logs} logs (every {every} {_steps_word(every)}) cost "
            f"{_num(f, 'per_log_sec'):.3g} s each in `on_log` and the trainer's log, against "
            f"{_num(f, 'other_per_step_sec'):.3g} s of everything else per step; the time between steps was not "
            "waiting for data.")
    items = [f"`logging_steps: {new}` (now {every}): the log-driven work then takes about "
             f"{_pct(_num(f, 'share_after'))} of the wall time",
             "or make the costly callback's `on_log` cheaper (a `model.generate` or an evaluation inside it runs "
             "at every log)"]
    formula = (f"measured: this run's {logs} logs cost {on_log:.1f} s; every {new} steps instead of {every} "
               f"saves {saved:.1f} s of {wall:.1f} s: {wall:.1f} / ({wall:.1f} − {saved:.1f}) = {gain:.2f}x")
    return FindingWords("Logging and callbacks take a large share of the wall time", _callbacks_observation(f), root,
                        _bullets(items), formula + FLOOR)


@_finding_words("one_callback")
def _one_callback(f: Facts, setting: Setting, _: Any) -> FindingWords:
    name, event, sec, wall = _str(f, "callback"), _str(f, "event"), _num(f, "callback_sec"), _num(f, "wall_sec")
    root = (f"`{name}` spends {sec:.1f} s in its callbacks, most in `{event}`: work the trainer waits for at every "
            "such event; the time between steps was not waiting for data.")
    items = [f"make `{name}.{event}` cheaper, or let it act every N steps (`if state.global_step % N == 0`)",
             "or remove the callback from `callbacks`"]
    formula = (f"not predicted: how often the callback must run is the user's choice; all of its {sec:.1f} s of "
               f"{wall:.1f} s would be {wall / max(1e-9, wall - sec):.2f}x")
    return FindingWords(f"Callback {name} takes a large share of the wall time", _callbacks_observation(f), root,
                        _bullets(items), formula)


@_finding_words("memory_to_spare")
def _memory_to_spare(f: Facts, setting: Setting, _: Any) -> FindingWords:
    recompute, wall, gain = _num(f, "recompute_sec"), _num(f, "wall_sec"), _num(f, "gain")
    budget, after, extra = _num(f, "budget_gb"), _num(f, "after_gb"), _num(f, "extra_bytes")
    obs = (f"Gradient checkpointing re-ran the checkpointed layers' forwards for {recompute:.1f} s of the "
           f"{wall:.1f} s wall time ({_pct(recompute / wall)}); memory peaked at {_num(f, 'high_water_gb'):.2f} of "
           f"{budget:.2f} GiB.")
    root = ("Activation checkpointing trades compute for memory: the backward runs each layer's forward again. "
            "TRL's `SFTConfig` and `GRPOConfig` turn it on by default (`gradient_checkpointing: true`), whether "
            f"or not the memory is short; here keeping the activations takes about {_gb(extra)} more "
            f"(micro-batch {_int(f, 'micro_batch')} × {_int(f, 'seq_len')} tokens), {after:.2f} GiB of the "
            f"{budget:.2f} GiB budget.")
    rec = ("`activation_checkpointing: false` (TRL: `gradient_checkpointing: false`); keep the `MemoryWatchdog` "
           "attached: it stops or re-sizes the run before the wall")
    formula = (f"measured: this run's recompute took {recompute:.1f} s of {wall:.1f} s: {wall:.1f} / "
               f"({wall:.1f} − {recompute:.1f}) = {gain:.2f}x")
    return FindingWords("Gradient checkpointing recomputes with memory to spare", obs, root, rec, formula + FLOOR)


@_note_words("would_not_fit")
def _would_not_fit(f: Facts, _: Any) -> NoteWords:
    recompute, wall = _num(f, "recompute_sec"), _num(f, "wall_sec")
    return NoteWords("Gradient checkpointing kept: the activations would not fit",
                     f"Recompute took {recompute:.1f} s ({_pct(recompute / wall)} of the wall time), but keeping the "
                     f"activations would take about {_gb(_num(f, 'extra_bytes'))} more: {_num(f, 'after_gb'):.2f} of "
                     f"the {_num(f, 'budget_gb'):.2f} GiB budget, above the watchdog's margin.")
