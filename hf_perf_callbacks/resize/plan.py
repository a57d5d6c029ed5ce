"""The run's decisions as pure transitions: a :class:`SplitState` in, a :class:`Plan` out.

The record (:mod:`~hf_perf_callbacks.resize.record`) holds the split facts as one frozen :class:`SplitState`;
each event the run meets is a function of that state and the event's own facts, returning a :class:`Plan`: what to
do (re-size to a split from a checkpoint, switch, finish, refuse, give up with an error, end and save) and the state
once it is done. :mod:`~hf_perf_callbacks.resize.executor` carries a plan out (saves, memory, the resume message)
and commits its state. Nothing here touches a trainer, a file or a device: no torch, no transformers.

=====================  ============================================================================================
transition             the event, and what the plan says
=====================  ============================================================================================
:func:`on_oom`         an out-of-memory error at a step: the next smaller exact split from this step's checkpoint
                       (the newest this run wrote when it struck inside ``optimizer.step``; the start at step 0),
                       a trial's next split, or give up (no smaller split, none exact); the loop checks first
                       that a re-size is left
:func:`on_watchdog`    the watchdog asks for a smaller micro-batch: the next smaller exact split, or refuse (why)
:func:`on_switch`      a pending switch takes effect now: from which checkpoint, and whether it spends a re-size
:func:`on_stop`        a ``train()`` call returned: finish (a pending in-process switch a stop came before is
                       cancelled) or switch now
:func:`on_end`         the run ends with an error: whether the last completed step can be saved, and why not
:func:`on_restart`     an out-of-memory error the ranks could not agree on: the split a launcher's restart takes
=====================  ============================================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ..core.batching import Exactness, Split, next_smaller

#: where a re-size resumes from: this step's checkpoint kept as a save of the run (``save``), this step's
#: checkpoint written only for the switch (``switch``), the newest complete one this run wrote (``newest``), the
#: start of the run (``start``)
Source = Literal["save", "switch", "newest", "start"]
#: ``resize``: go on at ``new`` from ``source``; ``switch``: the pending switch now; ``finish``: the run is done;
#: ``refuse``: nothing changes (``warn`` says why, once); ``give_up``: the run ends with ``error``;
#: ``end``: the run ends, saving its last completed step unless ``why`` says why not; ``none``: nothing to do
Action = Literal["resize", "switch", "finish", "refuse", "give_up", "end", "none"]


class InexactResize(ValueError):
    """An out-of-memory error at ``step`` and split ``old`` where smaller splits of the batch exist but none keeps the
    run's loss exact under ``exactness`` (the run saves and ends with why, and what makes every split exact);
    ``anyway``: the next smaller split, for going on inexactly by hand. What the run saved is said once it is known
    (:meth:`ended`): :attr:`checkpoint`, the checkpoint to go on from (None: none, and :attr:`not_saved` says why)."""

    def __init__(self, step: int, old: Split, anyway: Split, exactness: Exactness):
        self.step, self.old, self.anyway, self.exactness = step, old, anyway, exactness
        self._open(f"out of memory at step {step} at split {old}, and no smaller split keeps this run exact: "
                   f"{exactness.reason}. {exactness.fix} The run ends here rather than going on inexactly. To go on "
                   f"anyway at {anyway} (not exactly the configured run), set per_device_train_batch_size="
                   f"{anyway.micro_batch} and gradient_accumulation_steps={anyway.grad_accum} and ")

    def _open(self, head: str) -> None:
        """``head``: the message up to how to go on; the ending is completed by :meth:`ended`."""
        self.head, self.not_saved = head, ""
        self.checkpoint: str | None = None
        ValueError.__init__(self, self.message())

    def ended(self, checkpoint: str | None, not_saved: str = "") -> None:
        """The run ended: ``checkpoint`` is the one to go on from (None: none; ``not_saved``: why the last completed
        step was not saved); the message says that and nothing else."""
        self.checkpoint, self.not_saved = checkpoint, not_saved
        self.args = (self.message(),)

    def message(self) -> str:
        if self.checkpoint is not None:
            return f"{self.head}resume with trainer.train(resume_from_checkpoint={self.checkpoint!r})."
        if self.not_saved:
            return f"{self.head}start again with trainer.train(): nothing was saved to go on from ({self.not_saved})."
        return f"{self.head}resume with trainer.train(resume_from_checkpoint=...) from the checkpoint the run saved."


class _OwnWords(InexactResize):
    """An :class:`InexactResize` that says its cause in its own words (``head``: the message up to how to go on),
    completed by :meth:`ended` as for any other."""

    def __init__(self, head: str):
        self._open(head)


class ReplayLost(_OwnWords):
    """A re-size in a GRPO step that replays completions generated at an earlier step, where the resume could not
    train those completions (the run saves and ends with why, and what to change)."""


class Refused(_OwnWords):
    """A change the run needed (after an out-of-memory error, the memory check's, a launcher's restart's) was refused
    at the step it starts with: the new split is not exact on that step's rows, or could not be checked (the run
    saves and ends with why, and what to change)."""


class RowsLost(_OwnWords):
    """The split that trained the run fetched other rows for the next step than the run would have trained: no
    split can go on exactly from this step (the run saves and ends with why)."""


@dataclass(frozen=True)
class SplitState:
    """What the run's decisions read: the configured split and the one in effect, a pending switch (and why), the
    re-sizes forced by memory still allowed (None: no limit), the last split that completed a step, whether the run
    gave up, whether switches take effect in this process, the splits exact for the run and every split of its batch
    (largest micro-batch first), the kind of the last decision recorded, and the baseline of a tuning under way."""

    configured: Split
    split: Split
    switch: Split | None = None
    switch_reason: str = ""
    resizes_left: int | None = None
    ran: Split | None = None
    gave_up: bool = False
    in_process: bool = False
    exactness: Exactness | None = None
    every: tuple[Split, ...] = ()
    last_decision: str | None = None
    baseline: Split | None = None

    @property
    def resume_split(self) -> Split:
        """The split a resume starts with: a pending switch, else the baseline of a tuning under way, else the split
        in effect; once the run gave up (no smaller split fitted), the last split that completed a step (else the
        configured one), never the one that just failed."""
        if self.gave_up:
            return self.ran or self.configured
        return self.switch or self.baseline or self.split

    @property
    def resizes_spent(self) -> bool:
        """No re-size forced by memory is left."""
        return self.resizes_left is not None and self.resizes_left <= 0

    def allowed(self) -> list[Split]:
        """The splits the run may use: every split of its batch that keeps its loss exact (and the one in effect)."""
        return [s for s in self.every if self.exactness is None or self.exactness.allows(s) or s == self.split]

    def spent(self) -> SplitState:
        """One re-size forced by memory fewer is left."""
        return replace(self, resizes_left=None if self.resizes_left is None else self.resizes_left - 1)


@dataclass(frozen=True)
class Plan:
    """What to do, and the state once it is done (see the module docstring for each field's use)."""

    action: Action
    state: SplitState
    new: Split | None = None
    source: Source | None = None
    trial: bool = False
    spend: bool = False
    stop_now: bool = False
    cancelled: Split | None = None
    error: ValueError | None = None
    warn: tuple[str, str] | None = None
    why: str = ""


def smaller(state: SplitState, step: int) -> Split:
    """The next smaller split than the one in effect exact for the run (after an out-of-memory error at ``step``);
    :class:`InexactResize` when smaller ones exist but none is exact under its loss, ValueError when there is none."""
    old = state.split
    try:
        return next_smaller(old, state.allowed())
    except ValueError:
        exactness = state.exactness
        below = [s for s in state.every if s.micro_batch < old.micro_batch]
        if not below or exactness is None or exactness.reason is None:
            raise
        raise InexactResize(step, old, below[0], exactness) from None


def on_oom(state: SplitState, step: int, in_optimizer_step: bool = False, trial: bool = False,
           trial_next: Split | None = None) -> Plan:
    """An out-of-memory error at ``step`` (``in_optimizer_step``: inside ``optimizer.step``, so the weights may be
    half-updated). A split under trial (``trial``) is left for ``trial_next`` (the tuning's next candidate or its
    baseline) and spends no re-size; any other goes to the next smaller exact split and spends one (the caller
    checked that one is left), unless none is smaller (a ValueError) or none smaller is exact
    (:class:`InexactResize`): give up with that ``error``."""
    if trial and trial_next is not None:
        new = trial_next
    else:
        try:
            new = smaller(state, step)
        except ValueError as none:
            return Plan("give_up", replace(state, gave_up=True), error=none)
    source: Source = ("newest" if in_optimizer_step else "start" if step == 0 else "switch" if trial else "save")
    after = replace(state, split=new, switch=None)
    return Plan("resize", after if trial else after.spent(), new=new, source=source, trial=trial, spend=not trial)


def on_watchdog(state: SplitState, step: int) -> Plan:
    """The watchdog asks for a smaller micro-batch at ``step``: the next smaller exact split, taking effect at the
    next step's begin in this process, or else by stopping this ``train()`` now (``stop_now``); refused (``warn``:
    why, once) when the re-sizes are spent or no smaller split is exact; nothing to do when a switch is pending."""
    if state.switch is not None:
        return Plan("none", state, new=state.switch)
    if state.resizes_spent:
        return Plan("refuse", state, warn=("max-resizes", "the watchdog asked for a smaller micro-batch, but the "
                                                          "run's max_resizes re-sizes are done"))
    try:
        new = next_smaller(state.split, state.allowed())
    except ValueError:
        reason = state.exactness.reason if state.exactness is not None else None
        warn = (("watchdog-inexact", f"the watchdog asked for a smaller micro-batch, but no smaller split keeps "
                                     f"this run exact ({reason})") if reason is not None else None)
        return Plan("refuse", state, warn=warn)
    reason = "the watchdog asked for a smaller micro-batch"
    return Plan("resize", replace(state, switch=new, switch_reason=reason, last_decision="watchdog"), new=new,
                stop_now=not state.in_process)


def on_switch(state: SplitState) -> Plan:
    """The pending switch takes effect now (``train()`` stopped at its step): a watchdog's re-size keeps its
    checkpoint as a save of the run and spends one re-size; the tuning's switch resumes from a checkpoint written
    only for it."""
    memory = state.last_decision == "watchdog"
    new = state.switch
    if new is None:
        return Plan("none", state)
    after = replace(state, split=new, switch=None)
    return Plan("switch", after.spent() if memory else after, new=new, source="save" if memory else "switch",
                spend=memory)


def on_stop(state: SplitState, switching: bool) -> Plan:
    """A ``train()`` call returned (``switching``: stopped by the pending switch): a pending in-process switch that
    a stop came before (the user's, early stopping, ``max_steps``) is cancelled, and the run finishes; else the
    pending switch takes effect now."""
    cancelled = None
    if not switching and state.switch is not None and state.in_process:
        cancelled, state = state.switch, replace(state, switch=None)
    if state.switch is None:
        return Plan("finish", state, cancelled=cancelled)
    return Plan("switch", state, new=state.switch)


def on_end(state: SplitState, step: int, world: int, agreed: bool, in_optimizer_step: bool = False,
           gave_up: bool = False) -> Plan:
    """The run ends at ``step`` with an error (``agreed``: every one of ``world`` ranks left the step together;
    ``gave_up``: no smaller split fits, or the re-sizes are spent): the last completed step is saved, unless
    ``why`` says why it cannot be. No switch is pending afterwards."""
    if world > 1 and not agreed:
        why = "other ranks may be inside a collective, so no rank can save now"
    elif in_optimizer_step:
        why = "it struck inside optimizer.step, so the weights may be half-updated"
    elif step == 0:
        why = "no optimizer step was completed"
    else:
        why = ""
    return Plan("end", replace(state, switch=None, gave_up=state.gave_up or gave_up), why=why)


def on_restart(state: SplitState) -> Plan:
    """An out-of-memory error the ranks could not agree on: the next smaller exact split for the launcher's restart
    (``new`` None: there is none); the process ends, so nothing runs here at it."""
    try:
        new = next_smaller(state.split, state.allowed())
    except ValueError:
        return Plan("give_up", state)
    return Plan("resize", replace(state, switch=new), new=new, source="newest")
