"""TuningSession: the one owner of a tuning run's facts.

============================  ================================================================================
fact                          owner and readers
============================  ================================================================================
the split facts               :attr:`TuningSession.state`, one frozen :class:`~.plan.SplitState` (the split in
                              effect, a pending switch, the re-sizes left, ...): the decisions are pure
                              transitions of it (:mod:`~hf_perf_callbacks.resize.plan`), whose plan
                              :mod:`~hf_perf_callbacks.resize.recovery` carries out and commits
                              (:meth:`~TuningSession.commit`)
the split in effect           :attr:`TuningSession.split`; set only by :meth:`~TuningSession.apply`, which writes
                              it to the trainer's ``args`` and the dataloader's batch size together (the only
                              writer of both); the tuner logs ``tuner/*`` from it
the split a resume starts     :attr:`~TuningSession.resume_split`: a pending switch, else the tuning baseline,
with                          else the split in effect; after giving up, the last split that completed a step
every decision                :attr:`~TuningSession.decisions` (typed :class:`~hf_perf_callbacks.splitfile.Decision`)
the checkpoints this run      :attr:`~TuningSession.checkpoints` (:class:`~.checkpoints.RunCheckpoints`), each
wrote                         with the fingerprint of its files: a recovery resumes only from one whose fingerprint
                              still matches and that holds the training state (``RunCheckpoints.resumable``)
the RNG a checkpoint holds    :attr:`~TuningSession.next_rng`, noted by the tuner where transformers restores it
                              (:meth:`~TuningSession.note_rng`), written by :func:`.recovery.save_checkpoint`
the session id                :attr:`~TuningSession.id`: the run in the perf log (the bus's session) and the split
                              file; kept across in-process re-sizes and resumes of the same run
the splits the run may use    :attr:`~TuningSession.exactness`, judged once at the start by the settings list
                              (:meth:`~TuningSession.judge_grouping`), then narrowed to the splits the run's own
                              rows showed exact at its first step (:meth:`~TuningSession.measure_exactness`,
                              :attr:`~TuningSession.measured`); :meth:`~TuningSession.candidates` is every
                              reader's list (the tuning, the memory check, the OOM and watchdog re-sizes)
what the training loop holds  :attr:`~TuningSession.loop_state` (:class:`~hf_perf_callbacks.adapter.LoopState`),
between steps                 noted by the tuner at each step's begin and save, rewound before a recovery's save
                              (:func:`.recovery.rewind_loop`), carried into the resume
                              (:func:`.recovery.carry_loop`)
``tuner_split.json``          written by :meth:`~TuningSession.persist` only (main process, atomically), once at the
                              end of each transition that changed the record (:meth:`~TuningSession.transition`)
============================  ================================================================================

Only this module (and :mod:`~hf_perf_callbacks.resize.recovery`, through the session's methods) changes the
session's facts. The tuner sees :class:`TunerView`, one method per event it reports (:meth:`~TuningSession.begin_train`,
:meth:`~TuningSession.epoch_begins`, :meth:`~TuningSession.step_begins`, :meth:`~TuningSession.saved`,
:meth:`~TuningSession.step_ends`, :meth:`~TuningSession.measured_step`, :meth:`~TuningSession.on_watchdog`,
:meth:`~TuningSession.train_ends`) and ``managed``; :func:`~hf_perf_callbacks.train_with_tuning` calls
:meth:`~TuningSession.take_run`, :meth:`~TuningSession.prepare` and :meth:`~TuningSession.close`, and hands every
recovery to :mod:`~hf_perf_callbacks.resize.recovery`, which saves the checkpoints a re-size resumes from.

:func:`~hf_perf_callbacks.train_with_tuning` creates one session per call (a resume adopts the recorded one when it
is this run's) and hands it to the trainer's bus; the :class:`~hf_perf_callbacks.AdaptiveBatchTuner` — also an
instance transformers rebuilt from a checkpoint — finds it there. Without ``train_with_tuning`` the tuner opens one
itself. No process-global registry, no reconciliation: every reader asks the session.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

from .. import adapter
from ..batching import Exactness, Split, exact_splits, exact_under, is_grpo
from ..device import (
    error_line,
    gather_floats,
    is_main_process,
    main_process_value,
    rng_state,
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
from . import plan as plans
from .agreement import StepGuard, guard_training_step
from .checkpoints import RunCheckpoints, fingerprint, is_complete, step_of
from .plan import InexactResize, Plan, ReplayLost, RowsLost, SplitState
from .release import free_memory
from .rowcheck import RowCheck
from .sharding import STABLE_STEPS, deepspeed_split
from .sharding import start as start_sharding
from .tuning import OnRunTuning, Switch

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerState, TrainingArguments
    from trl import GRPOConfig

    from ..bus import RunBus
    from ..device import RngState

__all__ = ["InexactResize", "ReplayLost", "RowsLost", "SwitchSplit", "TuningSession", "candidates", "current_split",
           "format_summary"]

logger = logging.getLogger("hf_perf_callbacks")


def current_split(args: object) -> Split:
    """The split a trainer's args hold (GRPO: with its ``steps_per_generation``)."""
    spg = getattr(args, "steps_per_generation", None) if is_grpo(args) else None
    targs = cast("TrainingArguments", args)     # any trainer's args (RowCheck reads any object's)
    return Split(targs.per_device_train_batch_size, targs.gradient_accumulation_steps, spg)


def candidates(args: TrainingArguments, world: int) -> list[Split]:
    """Every split that keeps the run's effective batch (GRPO: and generation batch), largest micro-batch first;
    which of them keep its loss exact is :meth:`TuningSession.candidates`."""
    split = current_split(args)
    if is_grpo(args):
        return exact_splits(split.effective_batch(world), world, split.generation_batch(world),
                            cast("GRPOConfig", args).num_generations)
    return exact_splits(split.effective_batch(world), world)


class SwitchSplit(BaseException):
    """Raised at the begin of the optimizer step after the one where a switch was requested, before that step
    trains: :func:`~hf_perf_callbacks.train_with_tuning` catches it and resumes at the new split. A stop set by
    anything else at the requested step (a callback's ``should_training_stop``, early stopping, ``max_steps``) ends
    ``train()`` before that begin, so the user's stop wins. A ``BaseException``: the package's fault isolation and
    the user's ``except Exception`` let it through."""


class TuningSession:
    """See the module docstring."""

    def __init__(self, args: TrainingArguments, bus: RunBus | None = None, session_id: str | None = None,
                 managed: bool = False):
        self.id = session_id or uuid.uuid4().hex[:12]
        self.args = args                        # the trainer's args (the split is written there by apply)
        self.output_dir = str(args.output_dir)    # set by TrainingArguments (None only before its init)
        self.bus = bus                          # the trainer's RunBus: decisions reach the perf log through it
        self.world = world_size()
        configured = current_split(args)
        self.state = SplitState(configured, configured)   # the split facts the decisions read (plan.SplitState)
        self.switch_requested_at: float | None = None
        self.decisions: list[Decision] = []
        self.checkpoints = RunCheckpoints(self.output_dir)    # the checkpoints this run wrote
        self.ended: str | None = None
        self.managed = managed                  # train_with_tuning drives the run (acts on switches)
        self.tuning: OnRunTuning | None = None  # the tuning on the run's own steps
        self.warned: set[str] = set()
        self.next_rng: tuple[int, RngState] | None = None   # (step, the RNG the step after it starts from)
        self.measured: ExactnessCheck | None = None  # the check on the run's own rows (measure_exactness)
        self.switch_decision: Decision | None = None   # the decision of the pending switch (dropped if cancelled)
        self.step_log: adapter.StepLog | None = None   # the training loop's step log (train_with_tuning)
        self.loop_state: adapter.LoopState | None = None   # the loop's counters, windows, GRPO buffer (ditto)
        self.rows: RowCheck | None = None       # the row-stream check of in-process switches (check_rows)
        self.recorded: Split | None = None      # the split the run's record asks a resume for (resume_from)
        self.epoch_rng: tuple[int, RngState] | None = None  # (epoch, the RNG its data iterator was made with)
        self._open = 0                          # transitions under way (nested calls are one)
        self._changed = False                   # the record changed in the transition under way
        if bus is not None:
            bus.attach_tuning(self)
            bus.pin_session(self.id)

    # ------------------------------------------------------------ the state (plan.SplitState) and its transitions
    @property
    def configured(self) -> Split:
        """The split the user configured."""
        return self.state.configured

    @property
    def split(self) -> Split:
        """The split in effect (set only by :meth:`apply`)."""
        return self.state.split

    @property
    def switch(self) -> Split | None:
        """The split the next train() call runs with (a pending re-size)."""
        return self.state.switch

    @property
    def resizes_left(self) -> int | None:
        """Re-sizes forced by memory still allowed (train_with_tuning; None: no limit)."""
        return self.state.resizes_left

    @property
    def ran(self) -> Split | None:
        """The split of the last completed optimizer step."""
        return self.state.ran

    @property
    def gave_up(self) -> bool:
        """No smaller split fitted, or max_resizes were spent."""
        return self.state.gave_up

    @property
    def in_process(self) -> bool:
        """Switches take effect by :class:`SwitchSplit` (train_with_tuning, unsharded)."""
        return self.state.in_process

    @property
    def exactness(self) -> Exactness | None:
        """The splits exact under the run's loss (:meth:`judge_grouping`)."""
        return self.state.exactness

    def snapshot(self) -> SplitState:
        """The state a transition of :mod:`~hf_perf_callbacks.resize.plan` reads: every split of the run's batch and
        the last decision's kind as they are now."""
        last = self.decisions[-1].kind if self.decisions else None
        return replace(self.state, every=tuple(candidates(self.args, self.world)), last_decision=last)

    def commit(self, plan: Plan) -> None:
        """The plan was carried out: its state is the session's (the split facts a plan decides)."""
        new = plan.state
        self._set(split=new.split, switch=new.switch, resizes_left=new.resizes_left, gave_up=new.gave_up)

    def _set(self, **fields: Any) -> None:
        self.state = replace(self.state, **fields)

    @contextlib.contextmanager
    def transition(self) -> Iterator[None]:
        """One transition of the session (nested ones are part of it): the split file is written once, at its end,
        when the record changed (also when it ends by an error)."""
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0 and self._changed:
                self._changed = False
                self.persist()

    def changed(self) -> None:
        """The record changed: written at the end of the transition under way (now, when none is)."""
        self._changed = True
        if self._open == 0:
            self._changed = False
            self.persist()

    # ------------------------------------------------------------ the run train_with_tuning drives
    def drive(self, in_process: bool, max_resizes: int, step_log: adapter.StepLog | None = None,
              loop_state: adapter.LoopState | None = None) -> None:
        """:func:`~hf_perf_callbacks.train_with_tuning` drives the run: a switch takes effect in this process at the
        next step's begin (``in_process``; else by stopping ``train()``), ``max_resizes`` re-sizes forced by memory
        are allowed, ``step_log`` is the training loop's step log, ``loop_state`` what the loop holds between
        steps (its counters, logging windows and GRPO's buffered generation), carried into a resume in process."""
        self._set(in_process=in_process, resizes_left=max_resizes)
        self.step_log, self.loop_state = step_log, loop_state

    def take_run(self, trainer: Trainer, checkpoint: str | None,
                 max_resizes: int) -> tuple[str | None, StepGuard | None]:
        """The session takes the run of :func:`~hf_perf_callbacks.train_with_tuning` (a resume from ``checkpoint``
        continues the run's record); returns the trainer's sharding (FSDP, DeepSpeed: no tuning) and the step
        guard (FSDP: off once stable; none where it cannot see the sharding's collectives: DeepSpeed)."""
        sharded, guarded = start_sharding(trainer, self)
        self.drive(in_process=sharded is None,        # a switch takes effect at the next step's begin
                   max_resizes=max_resizes, step_log=adapter.StepLog(trainer), loop_state=adapter.LoopState(trainer))
        if checkpoint:
            self.resume_from(trainer, checkpoint)
        if not guarded:
            return sharded, None
        return sharded, guard_training_step(trainer, STABLE_STEPS if sharded else None, notify=self.note)

    def prepare(self, trainer: Trainer, planned: Callable[[], int | None], check_memory: Callable[[], None] | None,
                tuning: dict[str, Any] | None) -> None:
        """Before the run's first ``train()``: the splits exact under the run's loss, a resume's recorded split when
        exact, the row check, the memory check (``check_memory``: a fresh unsharded start) and the tuning on the
        run's own steps (``tuning``: :meth:`start_tuning`'s settings; none when sharded, or when the run's record
        holds a tuning decision). ``planned``: the optimizer steps the run will take (read again after the memory
        check, which may change the split)."""
        self.judge_grouping(trainer, planned())
        self.apply_recorded(trainer)          # a resume's recorded split, when exact for this run
        self.check_rows(trainer)
        if check_memory is not None:
            check_memory()
        if tuning is not None and not any(d.kind == "tune" for d in self.decisions):
            self.start_tuning(planned(), **tuning)     # at the split the check left

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

    def resume_from(self, trainer: Trainer, checkpoint: str) -> None:
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

    def apply_recorded(self, trainer: Trainer) -> Split | None:
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

    def check_rows(self, trainer: Trainer) -> None:
        """The row-stream check of this run's in-process switches (:mod:`~hf_perf_callbacks.resize.rowcheck`)."""
        self.rows = RowCheck(trainer, self.configured, current_split)

    def hold_rows(self, batches: list[Any] | None, step: int) -> None:
        """``batches``: what the split in effect fetched for ``step``, which an error left before it trained (the
        reference of the re-size that follows)."""
        if self.rows is not None:
            self.rows.hold(batches, step, self.split)

    def close(self, trainer: Trainer) -> None:
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
                     **settings: Any) -> None:
        """The tuning on the run's own steps starts (the tuner measures for it): the split in effect against every
        other split the run may use up to ``max_micro_batch``, over ``planned`` optimizer steps, GRPO's trials whole
        generation cycles; ``state_bytes``: what a switch's checkpoint writes and reads; ``settings``: the rest of
        :class:`~hf_perf_callbacks.resize.tuning.OnRunTuning`'s (``samples``, ``max_rounds``, ...)."""
        args = self.args
        others = [s for s in self.candidates(args)
                  if s != self.split and (max_micro_batch is None or s.micro_batch <= max_micro_batch)]
        spg = cast(int, cast("GRPOConfig", args).steps_per_generation) if is_grpo(args) else 1
        period = (generation_period(spg, getattr(args, "num_iterations", 1), args.gradient_accumulation_steps)
                  if is_grpo(args) else 1)
        self.tuning = OnRunTuning(self.split, others, planned, period=period, state_bytes=state_bytes, **settings)

    def end(self, message: str) -> None:
        """The run ends early with ``message`` (why, what was saved, how to resume): no switch is pending, and the
        split file says so."""
        self._set(switch=None)
        self.ended = message
        self.changed()

    # ------------------------------------------------------------ what the tuner reports of each step
    def follow_args(self, args: TrainingArguments) -> None:
        """Args changed by hand between ``train()`` calls rule: their split is the split in effect."""
        split = current_split(args)
        if split != self.split:
            self._set(split=split)

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
            self.changed()
        self._set(ran=self.split)
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

    def apply(self, trainer: Trainer, split: Split) -> None:
        """Make ``split`` the split in effect: the trainer's args and the batch size its next ``train()`` builds
        its dataloader with (GRPO: the generation batch kept through ``steps_per_generation``)."""
        args = trainer.args
        args.per_device_train_batch_size = split.micro_batch
        args.gradient_accumulation_steps = split.grad_accum
        if split.steps_per_generation is not None:
            grpo = cast("GRPOConfig", args)     # a split with steps_per_generation is GRPO's
            grpo.steps_per_generation = split.steps_per_generation
            grpo.generation_batch_size = split.generation_batch(self.world)
        adapter.set_train_batch_size(trainer)
        deepspeed_split(trainer)                # DeepSpeed: the config the next engine is built from
        self._set(split=split)
        self.changed()

    def settle(self, trainer: Trainer) -> None:
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
        self._set(switch=split, switch_reason=reason)
        self.switch_requested_at, self.switch_decision = time.time(), decision
        if self.rows is not None:
            self.rows.arm()                     # the old split's next fetch: the rows the unfaulted run trains
        self.changed()

    def cancel_switch(self) -> Split | None:
        """A stop came first (the user's, early stopping, the run's end): the pending switch never takes effect, and
        the decision that asked for it is dropped. Returns the cancelled split."""
        split = self.switch
        self._set(switch=None)
        if self.switch_decision is not None and self.switch_decision in self.decisions:
            self.decisions.remove(self.switch_decision)
        self.switch_decision = None
        self.changed()
        return split

    # ------------------------------------------------------------ the splits exact under the run's loss
    def judge_grouping(self, trainer: Trainer, planned_steps: int | None) -> Exactness:
        """Read the facts of the run's loss once and keep the splits exact under it (said once, with why and what
        makes every split exact, on the console, in the perf log and in the split file). Facts that cannot be read
        leave the configured split alone."""
        from .grouping import read_grouping

        every = candidates(trainer.args, self.world)
        try:
            exactness = exact_under(read_grouping(trainer, planned_steps, self.world), self.configured, every)
        except Exception as error:  # noqa: BLE001 - unknown facts: only the configured split is known to be exact
            exactness = Exactness((self.configured,), f"the run's loss could not be read "
                                                      f"({type(error).__name__}: {error})",
                                  "Nothing to change: this is a fault of the package.")
        self._set(exactness=exactness)
        if exactness.reason is not None:
            if self.managed:
                self.warn_once("grouping", exactness.message(every))
            elif "grouping" not in self.warned:        # a plain train() tunes nothing: a note (INFO), said once
                self.warned.add("grouping")
                self.note(exactness.message(every))
            self.changed()
        if self.measured is not None:                 # a resume: what the run's rows showed holds
            self._leave_out(self.measured)
        return self.exactness or exactness

    def measure_exactness(self, trainer: Trainer, model: torch.nn.Module, dataloader: DataLoader[Any],
                          wall: Callable[[], float]) -> ExactnessCheck | None:
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
            free_memory(trainer, self.warn_once)
            why = f"the check failed ({type(error).__name__}: {error_line(error)})"
            self.measured = ExactnessCheck(exact=list(self.exactness.splits), skipped=why)
            self.warn_once("measured", f"exactness not measured ({why[:90]}): the rules decide")
            self.changed()
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
        self.changed()
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
        self._set(exactness=Exactness(kept, reason, fix))
        if self.tuning is not None:
            self.tuning.leave_out(set(check.inexact))

    def candidates(self, args: TrainingArguments) -> list[Split]:
        """The splits the run may use: every split of its batch that keeps its loss exact (all of them before
        :meth:`judge_grouping` ran; :meth:`~.plan.SplitState.allowed`)."""
        return replace(self.state, every=tuple(candidates(args, self.world))).allowed()

    def smaller_for_restart(self) -> Split | None:
        """The split a launcher's restart resumes with after an out-of-memory error the ranks could not agree on: the
        next smaller one exact for the run (:meth:`candidates`), None when there is none."""
        return plans.on_restart(self.snapshot()).new

    def restriction(self) -> Restriction | None:
        exactness = self.exactness
        if exactness is None or exactness.reason is None:
            return None
        return Restriction(list(exactness.splits), exactness.reason, exactness.fix or "")

    def take_switch(self, trainer: Trainer) -> Split | None:
        """Apply the pending switch (None when there is none)."""
        split = self.switch
        self._set(switch=None)
        if split is not None:
            self.apply(trainer, split)
        return split

    def decide(self, kind: str, reason: str, new: Split, step: int, old: Split | None = None,
               **details: Any) -> Decision:
        """Record a decision (it takes effect through :meth:`request_switch` or :meth:`apply`) and log it as an
        event of the perf log."""
        return self._record(Decision(kind=kind, step=step, reason=reason, old=old or self.split, new=new,
                                     time=time.time(), **details))

    def _record(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        self.changed()
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

    def epoch_start_rng(self, epoch: int) -> RngState | None:
        """The RNG that epoch ``epoch``'s data iterator was made with in this process (None: not seen): a resume
        within that epoch makes its iterator with it again, so that a sampler drawing its order from the global RNG
        (the length-grouped one) draws that epoch's order."""
        return self.epoch_rng[1] if self.epoch_rng is not None and self.epoch_rng[0] == epoch else None

    def rng_after(self, step: int) -> RngState | None:
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
        self.changed()
        return True

    @property
    def written(self) -> list[WrittenCheckpoint]:
        """The checkpoints this run wrote, each with the fingerprint of its files."""
        return self.checkpoints.written

    def switched_at(self, step: int, wrote: bool) -> None:
        """A switch resumed from ``checkpoint-<step>`` (``wrote``: written for the switch): older switch checkpoints
        are removed."""
        if self.checkpoints.switched_at(step, wrote):
            self.changed()

    def drop_switch_checkpoints(self, keep: int | None = None) -> None:
        """Remove the checkpoints written only for switches, but the one of step ``keep``."""
        if self.checkpoints.drop_switch(keep):
            self.changed()

    # ------------------------------------------------------------ the tuner's events (TunerView)
    @classmethod
    def for_tuner(cls, args: TrainingArguments, state: TrainerState, bus: RunBus | None) -> TuningSession:
        """The run's tuning session for the tuner at ``on_train_begin``: train_with_tuning's (on the bus), or one of
        the tuner's own."""
        found = bus.tuning if bus is not None else None
        if isinstance(found, TuningSession) and found.output_dir == args.output_dir:
            return found
        session = cls(args, bus=bus)
        if state.global_step > 0:                        # a resume: continue the recorded run when it is this one
            # each rank's own reading, no collective (a rank whose tuner a fault disabled skips this hook): the
            # main process may rewrite the file meanwhile, but a rewrite keeps the checkpoints of an adopted record
            record = read_split_file(str(args.output_dir), warn=False)
            if record is not None and record.checkpoint(state.global_step) is not None:
                session.adopt(record)
        trainer = adapter.calling_trainer()              # the splits a re-size asked for by the watchdog may use
        if trainer is not None:
            session.judge_grouping(trainer, state.max_steps if state.max_steps > 0 else None)
        return session

    def begin_train(self, args: TrainingArguments, step: int) -> bool:
        """A ``train()`` call begins at ``step``: args changed by hand between calls rule, a resume in process goes
        on with the loop's windows and buffer, and a tuning under way measures a new segment. True when the tuner
        measures this call's steps (a tuning is under way)."""
        with self.transition():
            self.follow_args(args)
            if step > 0:
                self.loop_resumed()
            tuning = self.tuning
            if not (self.managed and tuning is not None and tuning.done is None):
                return False
            tuning.segment_started(self.split, step, switch_sec=self.switch_taken())
            self._tuning_done(step)
            return tuning.done is None

    def epoch_begins(self, step: int, epoch: float, resumed: bool) -> RngState | None:
        """An epoch's begin (``resumed``: the first after a resume within it): the RNG at an epoch's start is noted;
        returns the RNG a resumed epoch's data iterator must draw from (None: the current one)."""
        if not self.managed:
            return None
        if epoch.is_integer():                           # an epoch's start, not a resume within it
            self.note_rng(step, epoch_start=True, epoch=int(epoch))
            return None
        return self.epoch_start_rng(int(epoch)) if resumed else None

    def step_begins(self, step: int, dataloader: DataLoader[Any] | None, wall: Callable[[], float]) -> None:
        """Optimizer step ``step + 1`` begins: the RNG and the loop's state a checkpoint of ``step`` must hold are
        noted, the first one checks the exact splits on the run's own rows, and a pending in-process switch raises
        :class:`SwitchSplit` before the step trains."""
        if self.managed:                                 # the RNG a checkpoint of the last step must hold
            self.note_rng(step)
            self.loop_step_begins()                      # and what the loop holds after that step
            if self.measured is None and dataloader is not None:
                trainer = adapter.calling_trainer()      # the splits to trust, shown on the run's own rows
                if trainer is not None:
                    with self.transition():
                        self.measure_exactness(trainer, trainer.model_wrapped, dataloader, wall)
        if self.switch is not None and self.in_process:
            raise SwitchSplit(f"switch to {self.switch} before step {step + 1}")

    def saved(self, step: int) -> None:
        """transformers wrote ``checkpoint-<step>`` (on_save follows a whole save): this run's, if complete."""
        self.record_written(step)
        self.loop_saved()

    def step_ends(self, step: int) -> tuple[Split, int]:
        """Optimizer step ``step`` completed: the split in effect and the re-sizes forced by memory so far."""
        return self.step_completed(step), self.resizes

    def measured_step(self, step: int, ranked: float, whole: float, peak_gb: float,
                      fits: bool) -> tuple[bool, bool]:
        """The tuner measured step ``step`` for the tuning (every rank's figures agreed): a switch the tuning asks
        for is requested. Returns ``(stop, measuring)``: the switch takes effect by stopping this ``train()`` (not in
        process); the tuning still measures the next steps (False once it finished: the rest of the run is not
        synchronized or timed for it)."""
        tuning = self.tuning
        assert tuning is not None, "measuring starts only with a tuning to measure for (begin_train)"
        stop = False
        with self.transition():
            action = tuning.observe(step, ranked, whole, peak_gb=peak_gb, fits=fits)
            if isinstance(action, Switch):
                self.request_switch(action.split, action.why)
                stop = not self.in_process              # takes effect at the next step's begin otherwise
            self._tuning_done(step)
        return stop, tuning.done is None

    def on_watchdog(self, reason: str, step: int, rows: list[Any] | None, acting: bool) -> Plan:
        """The watchdog asks for a smaller micro-batch at ``step`` (``acting``: the tuner can stop the run now;
        ``rows``: the next step's micro-batches, when fetched already): the plan of
        :func:`~hf_perf_callbacks.resize.plan.on_watchdog`, recorded as a ``watchdog`` decision and requested as
        the pending switch. Its ``new`` is the split asked for (None: refused); ``stop_now``: stop this ``train()``."""
        if not acting and self.switch is None:
            return Plan("none", self.state)
        plan = plans.on_watchdog(self.snapshot(), step)
        if plan.action == "refuse" and plan.warn is not None:
            self.warn_once(*plan.warn, step=step)
        if plan.action != "resize" or plan.new is None:
            return plan
        with self.transition():
            self.end_tuning(step, "memory pressure ended the tuning")
            decision = self.decide("watchdog", reason, plan.new, step)
            self.request_switch(plan.new, plan.state.switch_reason, decision)
            if rows is not None:
                self.hold_rows(rows, step + 1)
            self.commit(plan)
        return plan

    def train_ends(self, step: int, measuring: bool, continuing: bool) -> TunerEnd:
        """A ``train()`` call ends at ``step`` (``continuing``: train_with_tuning resumes it in this process): a
        tuning still measuring ends; returns what the tuner reports."""
        if measuring and not continuing:                 # the run ended before the tuning did
            self.end_tuning(step, "the run ended before the tuning did")
        return TunerEnd(self.split, self.id, len(self.decisions), format_summary(self) if self.decisions else None,
                        None if self.managed else self.switch)

    def _tuning_done(self, step: int) -> None:
        """Record the tuning once it finished (its decision event is its one console line; the evidence is in the
        perf log and the report)."""
        tuning = self.tuning
        if tuning is not None and tuning.done is not None and not tuning.recorded:
            self.record_tuning(step)

    def leave_out(self, bad: Split, why: str, step: int) -> None:
        """``bad`` fetched other rows for ``step`` than the unfaulted run trains (``why``): it is not exact for this
        run (said once) and never used again."""
        if self.rows is not None:
            self.rows.refuse(bad, why)
        exactness = self.exactness
        kept = exactness.splits if exactness is not None else tuple(candidates(self.args, self.world))
        reason = why if exactness is None or exactness.reason is None else f"{exactness.reason}; {why}"
        fix = (exactness.fix if exactness is not None and exactness.fix
               else f"The configured split {self.configured} keeps every step's rows.")
        self._set(exactness=Exactness(tuple(s for s in kept if s != bad), reason, fix))
        self.warn_once(f"rows-{bad}", f"{why}: {bad} is not exact for this run and is not used again", step=step)

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
        self._set(configured=record.configured)
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


@dataclass(frozen=True)
class TunerEnd:
    """What the tuner reports when a ``train()`` call ends: the split in effect, the session id, the decisions so
    far, the end-of-run summary (None: no decision) and, without train_with_tuning, the split a pending re-size
    asks the user to resume with."""

    split: Split
    session: str
    decisions: int
    summary: str | None
    switch: Split | None


class TunerView(Protocol):
    """What :class:`~hf_perf_callbacks.resize.callback.AdaptiveBatchTuner` sees of the session: one method per
    event it reports, and whether train_with_tuning drives the run."""

    managed: bool

    def begin_train(self, args: TrainingArguments, step: int) -> bool: ...

    def epoch_begins(self, step: int, epoch: float, resumed: bool) -> RngState | None: ...

    def step_begins(self, step: int, dataloader: DataLoader[Any] | None, wall: Callable[[], float]) -> None: ...

    def saved(self, step: int) -> None: ...

    def step_ends(self, step: int) -> tuple[Split, int]: ...

    def measured_step(self, step: int, ranked: float, whole: float, peak_gb: float,
                      fits: bool) -> tuple[bool, bool]: ...

    def on_watchdog(self, reason: str, step: int, rows: list[Any] | None, acting: bool) -> Plan: ...

    def train_ends(self, step: int, measuring: bool, continuing: bool) -> TunerEnd: ...


def format_summary(session: TuningSession) -> str:
    """The end-of-run summary: the split and when it was decided; each decision's own line was printed when it was
    made (once), and its detail is in the perf log and the report."""
    steps = ", ".join(str(d.step) for d in session.decisions)
    n = len(session.decisions)
    recovered = [d.recovery_sec for d in session.decisions if d.recovery_sec is not None]
    extra = f"; recovered in {sum(recovered):.2f} s in all" if recovered else ""
    return "\n".join(["== AdaptiveBatchTuner summary ==",
                      f"split: {session.split} after {n} decision{'s' if n != 1 else ''} (step{'s' if n != 1 else ''} "
                      f"{steps}){extra}; each one is in perf_log.jsonl and the report"])
