"""TuningSession: the one owner of a tuning run's facts.

============================  ================================================================================
fact                          owner and readers
============================  ================================================================================
the split in effect           :attr:`TuningSession.split`; set only by :meth:`~TuningSession.apply`, which writes
                              it to the trainer's ``args`` and the dataloader's batch size together (the only
                              writer of both); the tuner logs ``tuner/*`` from it
the split a resume starts     :attr:`~TuningSession.resume_split`: a pending switch, else the tuning baseline,
with                          else the split in effect; after giving up, the last split that completed a step
every decision                :attr:`~TuningSession.decisions` (typed :class:`~hf_perf_callbacks.splitfile.Decision`)
the checkpoints this run      :attr:`~TuningSession.checkpoints` (:class:`~.checkpoints.RunCheckpoints`), each
wrote                         with the fingerprint of its files: a recovery resumes only from one whose fingerprint
                              still matches and that holds the training state (:meth:`~TuningSession.resumable`)
the RNG a checkpoint holds    :attr:`~TuningSession.next_rng`, noted by the tuner where transformers restores it
                              (:meth:`~TuningSession.note_rng`), written by :meth:`~TuningSession.save_checkpoint`
the session id                :attr:`~TuningSession.id`: the run in the perf log (the bus's session) and the split
                              file; kept across in-process re-sizes and resumes of the same run
the splits the run may use    :attr:`~TuningSession.exactness`, judged once at the start by the settings list
                              (:meth:`~TuningSession.judge_grouping`), then narrowed to the splits the run's own
                              rows showed exact at its first step (:meth:`~TuningSession.measure_exactness`,
                              :attr:`~TuningSession.measured`); :meth:`~TuningSession.candidates` is every
                              reader's list (the tuning, the memory check, the OOM and watchdog re-sizes)
what the training loop holds  :attr:`~TuningSession.loop_state` (:class:`~hf_perf_callbacks.adapter.LoopState`),
between steps                 noted by the tuner at each step's begin and save, rewound before a recovery's save
                              (:meth:`~TuningSession.rewind_loop`), carried into the resume
                              (:meth:`~TuningSession.carry_loop`)
``tuner_split.json``          written by :meth:`~TuningSession.persist` only (main process, atomically)
============================  ================================================================================

Only this module assigns the session's fields: the tuner and :func:`~hf_perf_callbacks.train_with_tuning` ask it
through its methods (the tuner: :meth:`~TuningSession.follow_args`, :meth:`~TuningSession.switch_taken`,
:meth:`~TuningSession.step_completed`, :meth:`~TuningSession.request_switch`, :meth:`~TuningSession.loop_step_begins`,
:meth:`~TuningSession.loop_saved`, :meth:`~TuningSession.loop_resumed`; the loop: :meth:`~TuningSession.drive`,
:meth:`~TuningSession.resume_from`, :meth:`~TuningSession.start_tuning`, :meth:`~TuningSession.switch_now`,
:meth:`~TuningSession.recover_from_oom`, :meth:`~TuningSession.record_for_restart`, :meth:`~TuningSession.end_run`,
:meth:`~TuningSession.close`), and it saves the checkpoints a re-size resumes from itself.

:func:`~hf_perf_callbacks.train_with_tuning` creates one session per call (a resume adopts the recorded one when it
is this run's) and hands it to the trainer's bus; the :class:`~hf_perf_callbacks.AdaptiveBatchTuner` — also an
instance transformers rebuilt from a checkpoint — finds it there. Without ``train_with_tuning`` the tuner opens one
itself. No process-global registry, no reconciliation: every reader asks the session.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING

from .. import adapter
from ..batching import Exactness, Split, exact_splits, exact_under, is_grpo, next_smaller
from ..bus import EVENT_WIDTH, console_line
from ..device import (
    DeviceLayer,
    error_line,
    gather_floats,
    is_main_process,
    main_process_value,
    rng_state,
    set_rng_state,
    training_device,
    world_size,
)
from ..keys import SPLIT_FILE
from ..splitfile import (
    Decision,
    ExactnessCheck,
    Restriction,
    SplitFile,
    WrittenCheckpoint,
    read_split_file,
    recorded_split,
    run_geometry,
)
from ..stats import generation_period
from .agreement import ResizeNeeded
from .checkpoints import (
    RunCheckpoints,
    add_training_state,
    checkpoint_dir,
    fingerprint,
    is_complete,
    move_aside,
    newest_complete,
    step_of,
    switch_dir,
)
from .oomsite import UnfixableOOM
from .rowcheck import RowCheck, RowsDiffer
from .sharding import deepspeed_split, release_engine, restart_message
from .tuning import OnRunTuning

if TYPE_CHECKING:
    from ..bus import RunBus

logger = logging.getLogger("hf_perf_callbacks")


def current_split(args) -> Split:
    """The split a trainer's args hold (GRPO: with its ``steps_per_generation``)."""
    spg = getattr(args, "steps_per_generation", None) if is_grpo(args) else None
    return Split(args.per_device_train_batch_size, args.gradient_accumulation_steps, spg)


def candidates(args, world: int) -> list[Split]:
    """Every split that keeps the run's effective batch (GRPO: and generation batch), largest micro-batch first;
    which of them keep its loss exact is :meth:`TuningSession.candidates`."""
    split = current_split(args)
    if is_grpo(args):
        return exact_splits(split.effective_batch(world), world, split.generation_batch(world), args.num_generations)
    return exact_splits(split.effective_batch(world), world)


class SwitchSplit(BaseException):
    """Raised at the begin of the optimizer step after the one where a switch was requested, before that step
    trains: :func:`~hf_perf_callbacks.train_with_tuning` catches it and resumes at the new split. A stop set by
    anything else at the requested step (a callback's ``should_training_stop``, early stopping, ``max_steps``) ends
    ``train()`` before that begin, so the user's stop wins. A ``BaseException``: the package's fault isolation and
    the user's ``except Exception`` let it through."""


class InexactResize(ValueError):
    """An out-of-memory error at ``step`` and split ``old`` where smaller splits of the batch exist but none keeps the
    run's loss exact under ``exactness`` (the run saves and ends with why, and what makes every split exact);
    ``anyway``: the next smaller split, for going on inexactly by hand. What the run saved is said once it is known
    (:meth:`ended`): :attr:`checkpoint`, the checkpoint to go on from (None: none, and :attr:`not_saved` says why)."""

    def __init__(self, step: int, old: Split, anyway: Split, exactness: Exactness):
        self.step, self.old, self.anyway, self.exactness = step, old, anyway, exactness
        self.checkpoint: str | None = None
        self.not_saved = ""
        super().__init__(self.message())

    def ended(self, checkpoint: str | None, not_saved: str = "") -> None:
        """The run ended: ``checkpoint`` is the one to go on from (None: none; ``not_saved``: why the last completed
        step was not saved); the message says that and nothing else."""
        self.checkpoint, self.not_saved = checkpoint, not_saved
        self.args = (self.message(),)

    def opening(self) -> str:
        """The message up to how to go on."""
        anyway, exactness = self.anyway, self.exactness
        return (f"out of memory at step {self.step} at split {self.old}, and no smaller split keeps this run exact: "
                f"{exactness.reason}. {exactness.fix} The run ends here rather than going on inexactly. To go on "
                f"anyway at {anyway} (not exactly the configured run), set per_device_train_batch_size="
                f"{anyway.micro_batch} and gradient_accumulation_steps={anyway.grad_accum} and ")

    def message(self) -> str:
        head = self.opening()
        if self.checkpoint is not None:
            return f"{head}resume with trainer.train(resume_from_checkpoint={self.checkpoint!r})."
        if self.not_saved:
            return f"{head}start again with trainer.train(): nothing was saved to go on from ({self.not_saved})."
        return f"{head}resume with trainer.train(resume_from_checkpoint=...) from the checkpoint the run saved."


class _OwnWords(InexactResize):
    """An :class:`InexactResize` that says its cause in its own words (``head``: the message up to how to go on),
    completed by :meth:`ended` as for any other."""

    def __init__(self, head: str):    # the message is its own; the ending is shared
        self.head = head
        self.checkpoint = None
        self.not_saved = ""
        ValueError.__init__(self, self.message())

    def opening(self) -> str:
        return self.head


class ReplayLost(_OwnWords):
    """A re-size in a GRPO step that replays completions generated at an earlier step, where the resume could not
    train those completions (the run saves and ends with why, and what to change)."""


class RowsLost(_OwnWords):
    """The split that trained the run fetched other rows for the next step than the run would have trained: no
    split can go on exactly from this step (the run saves and ends with why)."""


class TuningSession:
    """See the module docstring."""

    def __init__(self, args, bus: RunBus | None = None, session_id: str | None = None, managed: bool = False):
        self.id = session_id or uuid.uuid4().hex[:12]
        self.args = args                        # the trainer's args (the split is written there by apply)
        self.output_dir = args.output_dir
        self.bus = bus                          # the trainer's RunBus: decisions reach the perf log through it
        self.world = world_size()
        self.configured = current_split(args)
        self.split = self.configured
        self.switch: Split | None = None        # the split the next train() call runs with (a pending re-size)
        self.switch_reason = ""
        self.switch_requested_at: float | None = None
        self.decisions: list[Decision] = []
        self.checkpoints = RunCheckpoints(self.output_dir)    # the checkpoints this run wrote
        self.ended: str | None = None
        self.managed = managed                  # train_with_tuning drives the run (acts on switches)
        self.tuning: OnRunTuning | None = None  # the tuning on the run's own steps
        self.warned: set[str] = set()
        self.next_rng: tuple[int, tuple] | None = None   # (step, the RNG the step after it starts from)
        self.ran: Split | None = None           # the split of the last completed optimizer step
        self.gave_up = False                    # no smaller split fitted, or max_resizes were spent
        self.exactness: Exactness | None = None  # the splits exact under the run's loss (judge_grouping)
        self.measured: ExactnessCheck | None = None  # the check on the run's own rows (measure_exactness)
        self.in_process = False                 # switches take effect by SwitchSplit (train_with_tuning, unsharded)
        self.switch_decision: Decision | None = None   # the decision of the pending switch (dropped if cancelled)
        self.resizes_left: int | None = None    # re-sizes forced by memory still allowed (train_with_tuning)
        self.step_log: adapter.StepLog | None = None   # the training loop's step log (train_with_tuning)
        self.loop_state: adapter.LoopState | None = None   # the loop's counters, windows, GRPO buffer (ditto)
        self.rows: RowCheck | None = None       # the row-stream check of in-process switches (check_rows)
        self.recorded: Split | None = None      # the split the run's record asks a resume for (resume_from)
        self.epoch_rng: tuple[int, tuple] | None = None  # (epoch, the RNG its data iterator was made with)
        if bus is not None:
            bus.attach_tuning(self)
            bus.pin_session(self.id)

    # ------------------------------------------------------------ the run train_with_tuning drives
    def drive(self, in_process: bool, max_resizes: int, step_log: adapter.StepLog | None = None,
              loop_state: adapter.LoopState | None = None) -> None:
        """:func:`~hf_perf_callbacks.train_with_tuning` drives the run: a switch takes effect in this process at the
        next step's begin (``in_process``; else by stopping ``train()``), ``max_resizes`` re-sizes forced by memory
        are allowed, ``step_log`` is the training loop's step log, ``loop_state`` what the loop holds between
        steps (its counters, logging windows and GRPO's buffered generation), carried into a resume in process."""
        self.in_process, self.resizes_left, self.step_log = in_process, max_resizes, step_log
        self.loop_state = loop_state

    # ------------------------------------------------------------ what the training loop holds between steps
    def loop_step_begins(self) -> None:
        """An optimizer step begins: the loop's state after the last completed step is noted."""
        if self.loop_state is not None:
            self.loop_state.note()

    def loop_saved(self) -> None:
        """transformers saved the step: the loop's state at that checkpoint is noted."""
        if self.loop_state is not None:
            self.loop_state.note_save()

    def loop_resumed(self) -> bool:
        """A ``train()`` of this process resumed: it goes on with the loop's state carried from the checkpoint's
        step (the loss since the last log, GRPO's buffered completions). True when something was carried."""
        return self.loop_state.install() if self.loop_state is not None else False

    def carry_loop(self, trainer, checkpoint: str | None, new: Split) -> None:
        """The next ``train()`` resumes from ``checkpoint`` at ``new``: what the loop held at that step is prepared
        for it (GRPO: the buffered completions re-split for ``new``). :class:`adapter.CannotReplay` when a GRPO
        step that replays buffered completions could not replay them."""
        if self.loop_state is None:
            return
        old, args = self.split, trainer.args
        every = (old.steps_per_generation * getattr(args, "num_iterations", 1)
                 if old.steps_per_generation is not None else None)
        self.loop_state.carry(step_of(checkpoint) if checkpoint else None, old.micro_batch, old.grad_accum,
                              new.micro_batch, new.steps_per_generation, every)

    def replay_lost(self, trainer, step: int, new: Split, why: adapter.CannotReplay) -> ReplayLost:
        """The refusal of a re-size at ``step`` to ``new`` whose resume could not replay GRPO's buffered
        completions, with why and what to change."""
        args = trainer.args
        return ReplayLost(
            f"a re-size at step {step + 1} from {self.split} to {new}: that step trains completions generated at an "
            f"earlier step (num_iterations={getattr(args, 'num_iterations', 1)}, steps_per_generation="
            f"{args.steps_per_generation}, gradient_accumulation_steps={args.gradient_accumulation_steps}), and "
            f"{why}; a resume would train other completions. The run ends here rather than going on inexactly. "
            f"Every optimizer step generates its own completions with num_iterations=1 and steps_per_generation "
            f"dividing gradient_accumulation_steps; to go on anyway at {new}, set per_device_train_batch_size="
            f"{new.micro_batch}, gradient_accumulation_steps={new.grad_accum} and steps_per_generation="
            f"{new.steps_per_generation} and ")

    def resume_from(self, trainer, checkpoint: str) -> None:
        """A resume from ``checkpoint``: the run's record goes on when it is this run's, the split recorded for the
        run is applied when it is exact for it, and a checkpoint of this ``output_dir`` is a valid fallback for a
        later out-of-memory error (the base of this run)."""
        found = main_process_value(lambda: read_split_file(self.output_dir))   # one reading for every rank: the
        record = recorded_session(found, checkpoint)                           # main process rewrites the file
        if record is not None:                       # this run's record: its history goes on
            self.adopt(record)
        self.recorded = recorded_split(found, self.output_dir, **run_geometry(trainer.args, self.world))
        step = step_of(checkpoint)
        parent = os.path.dirname(os.path.normpath(checkpoint))
        if step is not None and os.path.realpath(parent) == os.path.realpath(self.output_dir):
            self.record_written(step)

    def apply_recorded(self, trainer) -> Split | None:
        """After :meth:`judge_grouping`: the split the run's record asks a resume for (:meth:`resume_from`; or one
        the recipe launcher set from it) is kept only when the run's exactness allows it; otherwise that is said
        once and the run trains at its configured split. Returns the split applied (None: none changed)."""
        recorded, self.recorded = self.recorded, None
        wanted = recorded or self.split
        if self.exactness is not None and not self.exactness.allows(wanted) and wanted != self.configured:
            self.warn_once("recorded-inexact", f"the split recorded in {os.path.join(self.output_dir, SPLIT_FILE)} "
                                               f"({wanted}) is not exact for this run ({self.exactness.reason}): "
                                               f"training at the configured split {self.configured}")
            wanted = self.configured
        if wanted == self.split:
            return None
        self.apply(trainer, wanted)
        return wanted

    def check_rows(self, trainer) -> None:
        """The row-stream check of this run's in-process switches (:mod:`~hf_perf_callbacks.resize.rowcheck`)."""
        self.rows = RowCheck(trainer, self.configured, current_split)

    def hold_rows(self, batches: list | None, step: int) -> None:
        """``batches``: what the split in effect fetched for ``step``, which an error left before it trained (the
        reference of the re-size that follows)."""
        if self.rows is not None:
            self.rows.hold(batches, step, self.split)

    def refuse_rows(self, trainer, differ: RowsDiffer) -> str | None:
        """The split in effect fetched other rows for a step than the unfaulted run trains (``differ``, found before
        the step trained): the split is not exact for this run (said once, never used again) and the run goes back
        — a split under trial to the tuning's next candidate or its baseline, any other to the split that fetched
        the unfaulted rows — from a checkpoint of the last completed step; returns it (None: the start).
        :class:`InexactResize` when the split that fetched the unfaulted rows is the one that differs (a resume at
        this step trains other rows at any split)."""
        step, bad, why = trainer.state.global_step, differ.split, str(differ)
        if self.rows is not None:
            self.rows.refuse(bad, why)
        kept = self.exactness.splits if self.exactness is not None else tuple(candidates(self.args, self.world))
        reason = why if self.exactness is None or self.exactness.reason is None else f"{self.exactness.reason}; {why}"
        fix = (self.exactness.fix if self.exactness is not None and self.exactness.fix
               else f"The configured split {self.configured} keeps every step's rows.")
        self.exactness = Exactness(tuple(s for s in kept if s != bad), reason, fix)
        self.warn_once(f"rows-{bad}", f"{why}: {bad} is not exact for this run and is not used again", step=step)
        self.free_memory(trainer)
        wrote = not self.is_ours(step)
        checkpoint = self.save_checkpoint(trainer, step, switch=True) if step > 0 else None
        if self.in_trial and self.tuning is not None:
            new = self.tuning.failed(bad, "trains other rows", step)
            if self.tuning.done is not None:
                self.record_tuning(step)
        elif differ.expected is not None and differ.expected != bad:
            new = differ.expected
        else:
            raise RowsLost(f"{why}, and it is the split that trained the run: resuming at step {step} trains other "
                           f"rows than the run would have at any split. The run ends here rather than going on "
                           f"inexactly; ")
        if checkpoint is not None:
            self.switched_at(step, wrote)
        self.request_switch(new, why)
        self.resume_with_switch(trainer)
        if is_main_process():
            logger.warning("[tuner] step %d: %s → %s (the rows differ): resuming from %s in this process", step, bad,
                           new, os.path.basename(checkpoint) if checkpoint else "the start")
        return checkpoint

    def close(self, trainer) -> None:
        """The driven run's ``train()`` calls are over: the step log undone, a tuning still running ended and
        recorded, the trainer left at the split in effect (:meth:`settle`)."""
        if self.rows is not None:
            self.rows.close()
        if self.tuning is not None and self.tuning.done is None:
            self.end_tuning(trainer.state.global_step, "the run ended before the tuning did")
        self.settle(trainer)
        if self.step_log is not None:
            self.step_log.undo()

    def start_tuning(self, planned: int | None, state_bytes: float, max_micro_batch: int | None = None,
                     **settings) -> None:
        """The tuning on the run's own steps starts (the tuner measures for it): the split in effect against every
        other split the run may use up to ``max_micro_batch``, over ``planned`` optimizer steps, GRPO's trials whole
        generation cycles; ``state_bytes``: what a switch's checkpoint writes and reads; ``settings``: the rest of
        :class:`~hf_perf_callbacks.resize.tuning.OnRunTuning`'s (``samples``, ``max_rounds``, ...)."""
        args = self.args
        others = [s for s in self.candidates(args)
                  if s != self.split and (max_micro_batch is None or s.micro_batch <= max_micro_batch)]
        period = (generation_period(args.steps_per_generation, getattr(args, "num_iterations", 1),
                                    args.gradient_accumulation_steps) if is_grpo(args) else 1)
        self.tuning = OnRunTuning(self.split, others, planned, period=period, state_bytes=state_bytes, **settings)

    def spend_resize(self) -> None:
        """A re-size forced by memory took place: one fewer is left."""
        if self.resizes_left is not None:
            self.resizes_left -= 1

    @property
    def resizes_spent(self) -> bool:
        """No re-size forced by memory is left (``max_resizes`` of :func:`~hf_perf_callbacks.train_with_tuning`)."""
        return self.resizes_left is not None and self.resizes_left <= 0

    def end(self, message: str) -> None:
        """The run ends early with ``message`` (why, what was saved, how to resume): no switch is pending, and the
        split file says so."""
        self.switch = None
        self.ended = message
        self.persist()

    # ------------------------------------------------------------ what the tuner reports of each step
    def follow_args(self, args) -> None:
        """Args changed by hand between ``train()`` calls rule: their split is the split in effect."""
        split = current_split(args)
        if split != self.split:
            self.split = split

    def switch_taken(self) -> float | None:
        """The switch requested last took effect: seconds since it was requested (None: none was), said once."""
        requested, self.switch_requested_at = self.switch_requested_at, None
        return None if requested is None else max(0.0, time.time() - requested)

    def step_completed(self, step: int) -> Split:
        """Optimizer step ``step`` completed at the split in effect, which is returned: it is the last split that
        completed a step, and a re-size forced by memory before it has its recovery time (from its decision to this
        step)."""
        last = self.decisions[-1] if self.decisions else None
        if (last is not None and last.kind in ("oom", "watchdog") and last.recovery_sec is None and step > last.step
                and last.time is not None):                     # a split file's decision may not hold its time
            last.recovery_sec = time.time() - last.time
            self.persist()
        self.ran = self.split
        return self.split

    # ------------------------------------------------------------ the split
    @property
    def resume_split(self) -> Split:
        """The split a resume starts with: a pending switch, else the tuning baseline, else the split in effect;
        once the tuner gave up (no smaller split fitted), the last split that completed a step (else the configured
        one), never the one that just failed."""
        if self.gave_up:
            return self.ran or self.configured
        if self.switch is not None:
            return self.switch
        if self.tuning is not None and self.tuning.done is None:
            return self.tuning.baseline
        return self.split

    def apply(self, trainer, split: Split) -> None:
        """Make ``split`` the split in effect: the trainer's args and the batch size its next ``train()`` builds
        its dataloader with (GRPO: the generation batch kept through ``steps_per_generation``)."""
        args = trainer.args
        args.per_device_train_batch_size = split.micro_batch
        args.gradient_accumulation_steps = split.grad_accum
        if split.steps_per_generation is not None:
            args.steps_per_generation = split.steps_per_generation
            args.generation_batch_size = split.generation_batch(self.world)
        adapter.set_train_batch_size(trainer)
        deepspeed_split(trainer)                # DeepSpeed: the config the next engine is built from
        self.split = split
        self.persist()

    def settle(self, trainer) -> None:
        """Leave the trainer at the split in effect, whatever ended the call (args, dataloader batch size and the
        logged ``tuner/*`` keys agree). A run that ended on a split the tuning tried and left (it ended mid-trial)
        is left at the split the tuning decided, so that ``args``, the split file and the decision say one split."""
        target = self.split
        last = self.decisions[-1] if self.decisions else None
        if self.switch is None and last is not None and last.kind == "tune" and last.new != target:
            target = last.new
        if current_split(trainer.args) != target or adapter.train_batch_size(trainer) != target.micro_batch:
            self.apply(trainer, target)

    def request_switch(self, split: Split, reason: str, decision: Decision | None = None) -> None:
        """The next ``train()`` call runs with ``split`` (the running one stops at this step boundary);
        ``decision``: the one that asked for it, dropped if the switch never takes effect (:meth:`cancel_switch`)."""
        self.switch, self.switch_reason, self.switch_requested_at = split, reason, time.time()
        self.switch_decision = decision
        if self.rows is not None:
            self.rows.arm()                     # the old split's next fetch: the rows the unfaulted run trains
        self.persist()

    def cancel_switch(self) -> Split | None:
        """A stop came first (the user's, early stopping, the run's end): the pending switch never takes effect, and
        the decision that asked for it is dropped. Returns the cancelled split."""
        split, self.switch = self.switch, None
        if self.switch_decision is not None and self.switch_decision in self.decisions:
            self.decisions.remove(self.switch_decision)
        self.switch_decision = None
        self.persist()
        return split

    # ------------------------------------------------------------ the splits exact under the run's loss
    def judge_grouping(self, trainer, planned_steps: int | None) -> Exactness:
        """Read the facts of the run's loss once and keep the splits exact under it (said once, with why and what
        makes every split exact, on the console, in the perf log and in the split file). Facts that cannot be read
        leave the configured split alone."""
        from .grouping import read_grouping

        every = candidates(trainer.args, self.world)
        try:
            self.exactness = exact_under(read_grouping(trainer, planned_steps, self.world), self.configured, every)
        except Exception as error:  # noqa: BLE001 - unknown facts: only the configured split is known to be exact
            self.exactness = Exactness((self.configured,), f"the run's loss could not be read "
                                                           f"({type(error).__name__}: {error})",
                                       "Nothing to change: this is a fault of the package.")
        if self.exactness.reason is not None:
            if self.managed:
                self.warn_once("grouping", self.exactness.message(every))
            elif "grouping" not in self.warned:        # a plain train() tunes nothing: a note (INFO), said once
                self.warned.add("grouping")
                self.note(self.exactness.message(every))
            self.persist()
        if self.measured is not None:                 # a resume: what the run's rows showed holds
            self._leave_out(self.measured)
        return self.exactness

    def measure_exactness(self, trainer, model, dataloader, wall) -> ExactnessCheck | None:
        """At the run's first optimizer step (train_with_tuning drives it): check every split the rules allow on
        the run's own rows (:mod:`~hf_perf_callbacks.resize.measured`) and keep only those shown exact; once per
        run (a resume keeps the recorded result). A fault of the check is one warning and the rules' splits."""
        from .measured import measure

        if self.measured is not None or not self.managed or self.exactness is None:
            return self.measured
        larger = self.tuning.larger if self.tuning is not None else []     # only the tuning tries larger splits
        others = [s for s in self.exactness.splits if s.micro_batch < self.configured.micro_batch or s in larger]
        skipped = ("no re-size can happen (max_resizes=0, no tuning)" if self.resizes_left == 0 and larger == [] else
                   "the run has several ranks" if self.world > 1 else
                   "GRPO's rows are generated inside the step" if is_grpo(self.args) else
                   f"the memory check moved the run to {self.split} before its first step"
                   if self.split != self.configured else None)
        if skipped is not None or not others:       # nothing changes: the split file is written when it is
            self.measured = ExactnessCheck(exact=list(self.exactness.splits), skipped=skipped)
            return self.measured
        if self.bus is not None:
            self.bus.own_passes = True               # the meter counts none of the check's forwards
        try:
            check = measure(trainer, model, self.configured, others, dataloader.dataset, dataloader.collate_fn, wall)
        except Exception as error:  # noqa: BLE001 - the check is evidence, never a reason to stop training
            self.free_memory(trainer)
            why = f"the check failed ({type(error).__name__}: {error_line(error)})"
            self.measured = ExactnessCheck(exact=list(self.exactness.splits), skipped=why)
            self.warn_once("measured", f"exactness not measured ({why[:90]}): the rules decide")
            self.persist()
            return self.measured
        finally:
            if self.bus is not None:
                self.bus.own_passes = False
        self.measured = check
        shown = ", ".join(map(str, check.exact))
        cost = f"{check.cost_sec:.1f} s, {check.passes} passes"
        self._leave_out(check)
        if check.inexact:
            first = next(iter(check.inexact))
            self.warn_once("measured", f"measured on {check.rows} rows: {first} not exact, so the re-size and the "
                                       f"tuning keep to {shown} ({cost}; why in {SPLIT_FILE})")
        else:
            self.note(f"measured on {check.rows} rows: {shown} exact ({cost})")
        self.persist()
        return check

    def _leave_out(self, check: ExactnessCheck) -> None:
        """Keep only the splits the check showed exact (a split it had no need to measure is not trusted either;
        the rules' reason and fix, and the check's)."""
        exactness = self.exactness
        if exactness is None or check.skipped is not None:
            return
        kept = tuple(s for s in exactness.splits if s in check.exact or s == self.configured)
        reason = "; ".join(r for r in (exactness.reason, check.reason()) if r) or None
        fix = exactness.fix or ("A loss that sums over the step's rows and divides by num_items_in_batch, with no "
                                "term or noise drawn per micro-batch, lets every split be used." if reason else None)
        self.exactness = Exactness(kept, reason, fix)
        if self.tuning is not None:
            self.tuning.leave_out(set(check.inexact))

    def candidates(self, args) -> list[Split]:
        """The splits the run may use: every split of its batch that keeps its loss exact (all of them before
        :meth:`judge_grouping` ran)."""
        every = candidates(args, self.world)
        return [s for s in every if self.exactness is None or self.exactness.allows(s) or s == self.split]

    def smaller_split(self, step: int, old: Split) -> Split:
        """The next smaller split than ``old`` exact for the run (after an out-of-memory error at ``step``);
        :class:`InexactResize` when smaller ones exist but none is exact under its loss, ValueError when there is
        none at all."""
        allowed = self.candidates(self.args)
        try:
            return next_smaller(old, allowed)
        except ValueError:
            exactness = self.exactness
            smaller = [s for s in candidates(self.args, self.world) if s.micro_batch < old.micro_batch]
            if not smaller or exactness is None or exactness.reason is None:
                raise
            raise InexactResize(step, old, smaller[0], exactness) from None

    def smaller_for_restart(self) -> Split | None:
        """The split a launcher's restart resumes with after an out-of-memory error the ranks could not agree on: the
        next smaller one exact for the run (:meth:`candidates`), None when there is none."""
        try:
            return next_smaller(self.split, self.candidates(self.args))
        except ValueError:
            return None

    def restriction(self) -> Restriction | None:
        exactness = self.exactness
        if exactness is None or exactness.reason is None:
            return None
        return Restriction(list(exactness.splits), exactness.reason, exactness.fix or "")

    def take_switch(self, trainer) -> Split | None:
        """Apply the pending switch (None when there is none)."""
        split, self.switch = self.switch, None
        if split is not None:
            self.apply(trainer, split)
        return split

    def decide(self, kind: str, reason: str, new: Split, step: int, old: Split | None = None, **details) -> Decision:
        """Record a decision (it takes effect through :meth:`request_switch` or :meth:`apply`) and log it as an
        event of the perf log."""
        return self._record(Decision(kind=kind, step=step, reason=reason, old=old or self.split, new=new,
                                     time=time.time(), **details))

    def _record(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        self.persist()
        if self.bus is not None:
            self.bus.event("tuner", "decision", decision.headline(), step=decision.step,
                           details=decision.event_details())
        return decision

    def end_tuning(self, step: int, reason: str) -> None:
        """Stop the tuning on the run's steps now (memory ended it) at its baseline, and record it."""
        if self.tuning is not None and self.tuning.done is None:
            self.tuning.end(reason)
            self.record_tuning(step)

    def record_tuning(self, step: int) -> Decision | None:
        """Record the finished tuning as its one ``tune`` decision (:meth:`OnRunTuning.decision
        <hf_perf_callbacks.resize.tuning.OnRunTuning.decision>`)."""
        decision = self.tuning.decision(step, time.time()) if self.tuning is not None else None
        return self._record(decision) if decision is not None else None

    @property
    def in_trial(self) -> bool:
        """The split in effect is one the tuning is trying (not its baseline)."""
        tuning = self.tuning
        return tuning is not None and tuning.done is None and self.split != tuning.baseline

    @property
    def resizes(self) -> int:
        """Re-sizes forced by memory (out-of-memory errors and the watchdog's requests; not the tuning's trials that
        ran out of memory)."""
        return sum(d.kind in ("oom", "watchdog") and not d.trial for d in self.decisions)

    # ------------------------------------------------------------ the RNG a checkpoint holds
    def note_rng(self, step: int, epoch_start: bool = False, epoch: int | None = None) -> None:
        """Remember the RNG that the optimizer step after ``step`` starts from: what a checkpoint of ``step`` must
        hold for a resume to draw what the run drew. transformers restores a checkpoint's RNG where the next step's
        batches are fetched (mid-epoch) or before the epoch's data iterator is made (at an epoch's start), so it is
        taken at that point: at the begin of the epoch (``epoch_start``) or of the step, before a GRPO step's
        generation draws from it. The step's end is too early (an evaluation at that step may draw), and the moment
        of an out-of-memory error too late (the failing step drew already)."""
        if epoch_start or self.next_rng is None or self.next_rng[0] != step:
            self.next_rng = (step, rng_state())
        if epoch_start and epoch is not None:
            self.epoch_rng = (epoch, self.next_rng[1])

    def epoch_start_rng(self, epoch: int) -> tuple | None:
        """The RNG that epoch ``epoch``'s data iterator was made with in this process (None: not seen): a resume
        within that epoch makes its iterator with it again, so that a sampler drawing its order from the global RNG
        (the length-grouped one) draws that epoch's order."""
        return self.epoch_rng[1] if self.epoch_rng is not None and self.epoch_rng[0] == epoch else None

    def rng_after(self, step: int) -> tuple | None:
        """The RNG to save in ``checkpoint-<step>`` (None: the step after it has not begun; the current one is
        right)."""
        return self.next_rng[1] if self.next_rng is not None and self.next_rng[0] == step else None

    # ------------------------------------------------------------ checkpoints
    def record_written(self, step: int, whole: bool = False) -> bool:
        """Record ``checkpoint-<step>`` as this run's when it is complete (:meth:`RunCheckpoints.record
        <hf_perf_callbacks.resize.checkpoints.RunCheckpoints.record>`); ``whole``: the session saved it itself, with
        the whole training state. True when recorded (and the split file says so)."""
        if not self.checkpoints.record(step, whole):
            return False
        self.persist()
        return True

    @property
    def written(self) -> list[WrittenCheckpoint]:
        """The checkpoints this run wrote, each with the fingerprint of its files."""
        return self.checkpoints.written

    def location(self, step: int) -> str:
        return self.checkpoints.location(step)

    def hide(self, step: int) -> str:
        return self.checkpoints.hide(step)

    def is_ours(self, step: int) -> bool:
        return self.checkpoints.is_ours(step)

    def newest_ours(self, at_most: int) -> str | None:
        return self.checkpoints.newest_ours(at_most, self.args.save_only_model)

    def resumable(self, step: int) -> bool:
        return self.checkpoints.resumable(step, self.args.save_only_model)

    def switched_at(self, step: int, wrote: bool) -> None:
        """A switch resumed from ``checkpoint-<step>`` (``wrote``: written for the switch): older switch checkpoints
        are removed."""
        if self.checkpoints.switched_at(step, wrote):
            self.persist()

    def drop_switch_checkpoints(self, keep: int | None = None) -> None:
        """Remove the checkpoints written only for switches, but the one of step ``keep``."""
        if self.checkpoints.drop_switch(keep):
            self.persist()

    # ------------------------------------------------------------ saving, resuming and ending in this process
    def free_memory(self, trainer) -> None:
        """Drop the gradients and give the device's cached memory back (after an OOM, before a save or a resume; FSDP2:
        its iteration state reset on this rank first, the gathered parameters freed). A failing cache clear is one
        warning, never the end of the run."""
        adapter.reset_fsdp_iteration(trainer.model)
        trainer.model.zero_grad(set_to_none=True)
        try:
            DeviceLayer(training_device()).empty_cache()
        except Exception as error:  # noqa: BLE001 - housekeeping: going on without it
            self.warn_once("emptying the device cache", f"emptying the device cache failed during recovery "
                                                        f"({type(error).__name__}: {error}); going on without it")

    def save_checkpoint(self, trainer, step: int, switch: bool = False) -> str:
        """``checkpoint-<step>`` written by this run, verified complete and holding the whole training state (weights,
        optimizer, scheduler and the RNG the next step starts from, whatever ``save_only_model`` says), with the
        training log and the perf line of step ``step`` written first. A folder of that name that this run did not write
        (an earlier run's, or a partial one) is moved aside first; a save that fails or comes out incomplete is moved
        aside too, and the error raised. ``switch``: written only to switch splits, so it is saved without
        ``save_total_limit``'s rotation and moved out of the ``checkpoint-*`` names (the path returned is where it is).
        One this run wrote with the weights alone (``save_only_model``: the user's) is never written over nor moved:
        the whole save is written in ``tuner_switch/`` beside it; a switch resumes from there, a recovery or the run's
        end moves in the files the user's lacks (optimizer, scheduler, RNG) once the whole save is complete
        (:func:`~.checkpoints.add_training_state`)."""
        output_dir = trainer.args.output_dir
        path = checkpoint_dir(output_dir, step)
        main = is_main_process()             # under several ranks only the main process checks and moves folders
        ours = self.is_ours(step)
        there = self.location(step) if ours and self.resumable(step) else None    # saved already, whole
        next_rng = self.rng_after(step)                             # the RNG the next step starts from
        step_log = self.step_log                                    # a callback raised before the step's log
        if self.bus is not None:                                    # the checkpoint's steps all have their line
            self.bus.complete_step(trainer.args, trainer.state, step_log.log_missed if step_log else None)
        elif step_log is not None:
            step_log.log_missed()
        if there is not None:
            return there
        beside = ours                        # the user's checkpoint-<step>, weights alone: written beside, not over
        target = switch_dir(output_dir, step) if beside else path
        if main and beside and os.path.exists(target):
            move_aside(target, "stale")      # the package's own folder: a leftover, not this run's
        if main and not ours and os.path.exists(path):
            why = "stale" if is_complete(path, step) else "partial"
            moved = move_aside(path, why)
            if moved is None:
                raise RuntimeError(f"{path} is in the way (not written by this run) and could not be moved aside")
            logger.warning("[tuner] %s was not written by this run (%s): moved aside to %s", path,
                           "an earlier run's or another process's" if why == "stale" else "incomplete", moved)
        current = rng_state()
        try:
            set_rng_state(next_rng or current)
            adapter.save_checkpoint(trainer, rotate=not switch, run_dir=os.path.dirname(target) if beside else None)
        except BaseException:
            if main and os.path.exists(target):
                move_aside(target, "partial")
            raise
        finally:
            set_rng_state(current)
        if beside:
            return self._whole_beside(step, target, path, switch)
        if not self.record_written(step, whole=True):
            moved = move_aside(path, "partial")
            raise RuntimeError(f"checkpoint-{step} came out incomplete (moved aside to {moved})")
        if self.loop_state is not None:
            self.loop_state.keep(step)
        if switch:
            try:
                return self.hide(step)
            except OSError as error:          # it stays where it is: rotation may count it, training goes on
                self.warn_once("hide-switch", f"could not move the switch checkpoint-{step} out of the "
                                              f"checkpoint names ({error})")
        return path

    def _whole_beside(self, step: int, staged: str, path: str, switch: bool) -> str:
        """The whole save of ``step`` written in ``staged`` beside the user's ``path`` (:meth:`save_checkpoint`): a
        switch's stays there; a recovery's or the run's end's training state joins the user's weights in ``path``."""
        main = is_main_process()
        if switch:
            if not self.checkpoints.record_copy(step):
                moved = move_aside(staged, "partial") if main else None
                raise RuntimeError(f"{staged} came out incomplete (moved aside to {moved})")
            return staged
        every_rank_here()                    # every rank's files are in the staged folder
        try:
            if main:
                if not is_complete(staged, step):
                    moved = move_aside(staged, "partial")
                    raise RuntimeError(f"{staged} came out incomplete (moved aside to {moved})")
                add_training_state(staged, path)
        finally:
            every_rank_here()                # no rank resumes before the files are in place
        if not self.record_written(step, whole=True):
            raise RuntimeError(f"checkpoint-{step} is not complete after its training state was added")
        return path

    def end_run(self, trainer, error: BaseException, in_optimizer_step: bool = False, agreed: bool | None = None,
                gave_up: bool = False) -> None:
        """The run is about to end with ``error``: save its last completed optimizer step when it can, and say how to
        resume (as a log line and a note on the error). ``agreed``: every rank left the step together (default: the
        error is the agreement's). ``gave_up``: no smaller split fits, or the re-sizes are spent. The split file
        records why the run ended (``ended``) and the split to resume with (:attr:`resume_split`: after giving up,
        the last split that completed a step)."""
        self.gave_up = self.gave_up or gave_up
        output_dir = trainer.args.output_dir
        step = trainer.state.global_step
        checkpoint, why = None, ""
        agreed = isinstance(error, ResizeNeeded) if agreed is None else agreed
        if world_size() > 1 and not agreed:
            why = "other ranks may be inside a collective, so no rank can save now"
        elif in_optimizer_step:
            why = "it struck inside optimizer.step, so the weights may be half-updated"
        elif step == 0:
            why = "no optimizer step was completed"
        else:
            try:
                self.free_memory(trainer)
                self.rewind_loop(step)
                checkpoint = self.save_checkpoint(trainer, step)
            except (Exception, KeyboardInterrupt) as save_error:  # noqa: BLE001 - a second Ctrl-C too: say what is left
                why = f"saving failed: {type(save_error).__name__}: {error_line(save_error)[:160]}"
        if checkpoint is None:
            checkpoint = self.newest_ours(step) or newest_complete(output_dir)
            saved = (f"checkpoint-{step} was not saved ({why}); the newest complete checkpoint is "
                     f"{checkpoint or 'none'}")
        else:
            saved = f"saved {checkpoint} (the last completed optimizer step, {step})"
        if isinstance(error, InexactResize):                 # its own words say the same: what is there to go on from
            error.ended(checkpoint, "" if checkpoint else why)
        resume = (f"resume with train_with_tuning(trainer, resume_from_checkpoint={checkpoint!r}) (the split in "
                  f"{os.path.join(output_dir, SPLIT_FILE)} is applied when it fits)" if checkpoint
                  else "the run must start again")
        what = (str(error) if isinstance(error, (UnfixableOOM, InexactResize))     # its cause and its fix
                else error_line(error)[:160])
        message = f"training ended at step {step} by {type(error).__name__}: {what}; {saved}; {resume}"
        self.end(message)
        logger.error("[tuner] %s", message)
        if hasattr(error, "add_note"):
            error.add_note(message)

    def rewind_loop(self, step: int) -> None:
        """The run goes back to completed step ``step``: the tokens and FLOPs counted by a step left mid-way are
        taken back (the checkpoint of ``step`` and every later log count what an unfaulted run counts)."""
        if self.loop_state is not None:
            self.loop_state.rewind(step)

    def resume_with_switch(self, trainer) -> None:
        """Apply the pending switch to a trainer whose last train() ended, forget that train()'s state, free its
        memory."""
        self.take_switch(trainer)
        adapter.forget_last_train(trainer)
        release_engine(trainer)                 # DeepSpeed: the next train() builds an engine for the new split
        self.free_memory(trainer)
        if self.rows is not None:
            self.rows.switched()                # the new split's first fetch is checked before it trains

    def switch_now(self, trainer) -> str:
        """The pending switch, in this process: the step's checkpoint (a watchdog's re-size keeps it as a save of the
        run, and spends one of ``max_resizes``), the switch applied; returns the checkpoint to resume from."""
        step = trainer.state.global_step
        memory = self.decisions[-1].kind == "watchdog" if self.decisions else False
        wrote = not self.is_ours(step)
        checkpoint = self.save_checkpoint(trainer, step, switch=not memory)
        new = self.switch
        if new is not None:
            try:
                self.carry_loop(trainer, checkpoint, new)
            except adapter.CannotReplay as cannot:       # ended here, saved: no switch to a run that differs
                lost = self.replay_lost(trainer, step, new, cannot)
                self.cancel_switch()
                self.end_run(trainer, lost, gave_up=True)
                raise lost from None
        if not memory:
            self.switched_at(step, wrote)
        if is_main_process():                    # a memory switch's decision said why already (printed once)
            why = "" if memory else f" ({self.switch_reason.removeprefix(f'back to {self.switch}: ')})"
            logger.warning("%s", console_line(f"[tuner] step {step}: {self.split} → {self.switch}: resuming from "
                                              f"{os.path.basename(checkpoint)} in this process{why}", EVENT_WIDTH))
        self.resume_with_switch(trainer)
        if memory:
            self.spend_resize()
        return checkpoint

    def recover_from_oom(self, trainer, error: BaseException, in_optimizer_step: bool = False,
                         trial: bool = False) -> str | None:
        """An out-of-memory error at the trainer's step (``in_optimizer_step``: it struck inside
        ``optimizer.step``): the next split planned and applied, recorded as an ``oom`` decision; returns the
        checkpoint to resume from (None: the start). ValueError when no smaller split is left, :class:`InexactResize`
        when the smaller ones are not exact for this run. A split under trial that ran out of memory (``trial``) is
        left: the run goes on at the next candidate or the tuning baseline, the decision marked ``trial`` (no re-size:
        it spends none of ``max_resizes``, nor counts in ``tuner/resizes``)."""
        reason = f"out of memory: {error_line(error)[:160]}"
        old, tuning = self.split, self.tuning
        step = trainer.state.global_step
        if trial and tuning is not None:
            new = tuning.failed(old, "out of memory", step)         # the next candidate, or back to the baseline
            if tuning.done is not None:
                self.record_tuning(step)
        else:
            new = self.smaller_split(step, old)
            if tuning is not None and tuning.done is None:
                self.end_tuning(step, "out of memory ended the tuning")
        self.free_memory(trainer)
        self.rewind_loop(step)
        if in_optimizer_step:                                       # weights may be half-updated: go back
            checkpoint = self.newest_ours(step)
            if checkpoint is None:
                raise RuntimeError("out of memory inside optimizer.step before this run saved any complete "
                                   "checkpoint: the weights may be half-updated, so the run cannot continue safely. "
                                   f"Restart it with a smaller split ({new}) or set save_steps.") from error
        elif step == 0:
            checkpoint = None                                           # nothing trained yet: start again
        else:                                                           # weights and optimizer are at step N: keep them
            wrote = not self.is_ours(step)
            try:
                checkpoint = self.save_checkpoint(trainer, step, switch=trial)
                if trial:
                    self.switched_at(step, wrote)
            except Exception as save_error:  # noqa: BLE001 - fall back to the newest complete one of this run
                checkpoint = self.newest_ours(step)
                if checkpoint is None:
                    raise RuntimeError(f"out of memory at step {step}, and saving checkpoint-{step} failed too "
                                       f"({type(save_error).__name__}: {save_error}); this run has no complete "
                                       f"checkpoint to resume from") from error
                self.warn_once("fallback", f"saving checkpoint-{step} failed ({save_error}): resuming from "
                                           f"{checkpoint}; steps after it are trained again")
        try:
            self.carry_loop(trainer, checkpoint, new)
        except adapter.CannotReplay as why:
            raise self.replay_lost(trainer, step, new, why) from None
        self.decide("oom", reason, new, step, old=old, checkpoint=checkpoint, trial=trial)
        self.request_switch(new, reason)
        self.resume_with_switch(trainer)
        logger.warning("[tuner] step %d: resuming from %s with split %s (the decision above says why)", step,
                       os.path.basename(checkpoint) if checkpoint else "the start", new)
        return checkpoint

    def record_for_restart(self, step: int, error: BaseException, kind: str | None = "fsdp") -> None:
        """An out-of-memory error at ``step`` under FSDP (or DeepSpeed: ``kind``) that the ranks could not agree on:
        record the next smaller exact split for the launcher's restart (the main process writes it) and say what
        happens; the caller re-raises."""
        checkpoint = self.newest_ours(step)
        new = self.smaller_for_restart()
        if new is not None:
            reason = f"out of memory, not agreed inside the step: {error_line(error)[:160]}"
            self.decide("oom", reason, new, step, checkpoint=checkpoint)
            self.request_switch(new, reason)
        logger.error(restart_message(error, step, new, checkpoint, self.exactness, kind))

    # ------------------------------------------------------------ the file
    def record(self) -> SplitFile:
        return SplitFile(session=self.id, world_size=self.world, configured=self.configured,
                         split=self.resume_split, written=list(self.written), decisions=list(self.decisions),
                         ended=self.ended, restricted=self.restriction(), measured=self.measured)

    def persist(self) -> None:
        """Write ``tuner_split.json`` (main process only; a failure is one warning, the facts stay in memory)."""
        if not is_main_process():
            return
        try:
            self.record().write(self.output_dir)
        except OSError as error:
            self.warn_once("persist", f"could not write the split file in {self.output_dir}: {error} (the split "
                                      f"and decisions are kept in memory)")

    def adopt(self, record: SplitFile) -> None:
        """Continue the recorded run (a resume in a new process): its id, decisions and written checkpoints."""
        self.id, self.decisions = record.session, list(record.decisions)
        self.checkpoints.written = list(record.written)
        self.configured = record.configured
        self.measured = record.measured
        if self.bus is not None:
            self.bus.pin_session(self.id)

    def note(self, message: str, step: int | None = None) -> None:
        """An informational event of the run (console and perf log; the logger alone without a bus)."""
        if self.bus is not None:
            self.bus.event("tuner", "note", message, step=step)
        else:
            logger.info("[tuner] %s", message)

    def warn_once(self, key: str, message: str, step: int | None = None) -> bool:
        """``message`` as a warning (console and perf log; the logger alone without a bus), once per ``key`` for
        this session; True when it was logged now."""
        if key in self.warned:
            return False
        self.warned.add(key)
        if self.bus is not None:
            self.bus.event("tuner", "warning", message, step=step)
        else:
            logger.warning("[tuner] %s", message)
        return True


def every_rank_here() -> None:
    """Under several ranks, wait until every rank is here (every rank calls it at the same point)."""
    if world_size() > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def recorded_session(record: SplitFile | None, checkpoint: str | None) -> SplitFile | None:
    """The split file's ``record`` when it belongs to the run being resumed from ``checkpoint``: the checkpoint is
    one the record lists as written, with the same fingerprint (another run's record, or one whose checkpoint was
    rewritten since, is not adopted)."""
    if checkpoint is None:
        return record
    step = step_of(checkpoint)
    entry = record.checkpoint(step) if record is not None and step is not None else None
    adopted = (entry is not None and is_complete(checkpoint, step)
               and (not is_main_process() or fingerprint(checkpoint) == entry.fingerprint))
    if world_size() > 1:            # on every rank or on none (the main process checks the fingerprint): one split
        adopted = min(r[0] for r in gather_floats([float(adopted)])) > 0
    return record if adopted else None
