"""The executor: the trainer side of re-sizing. It owns the trainer, the checkpoints this run wrote, the training
loop's state between steps and the check of every change, and carries each change out in one protocol:

1. **snapshot** — the record's split facts (:meth:`SplitRecord.snapshot <.record.SplitRecord.snapshot>`);
2. **plan** — a pure transition of :mod:`~hf_perf_callbacks.resize.plan` (an out-of-memory error, the watchdog's
   request, a tuning switch, a stop, the end);
3. **stage** — the checkpoint the new split resumes from (verified complete, the whole training state, the RNG the
   next step starts from), the loop's state carried over, the new split applied to ``args`` and the dataloader;
4. **check** — at the optimizer step the new split starts with, before it trains: its rows against the old split's
   fetch (:mod:`~hf_perf_callbacks.resize.watch`), then its gradients on those rows
   (:mod:`~hf_perf_callbacks.resize.exactness`; not for a return to the split that trained the run);
5. **commit once** — the plan's state, its decision and the check, written to ``tuner_split.json`` by the record
   (:meth:`SplitRecord.commit <.record.SplitRecord.commit>`); or, refused, back to the split that trains those rows
   from the same checkpoint (the tuning's trial, the watchdog's request), or the run ends there saved whole
   (an out-of-memory error, the memory check, a launcher's restart: :class:`~.plan.InexactResize`).

The loop of :func:`~hf_perf_callbacks.train_with_tuning` calls :meth:`Executor.take_run`, :meth:`~Executor.prepare`,
:meth:`~Executor.after_train`, :meth:`~Executor.recover`, :meth:`~Executor.refused` and :meth:`~Executor.close`; the
:class:`~hf_perf_callbacks.AdaptiveBatchTuner` sees :class:`TunerView`, one method per event it reports. One executor
per ``train_with_tuning`` call, found by the tuner on the trainer's bus (without ``train_with_tuning`` the tuner opens
one itself: it saves and stops on the watchdog's request, and prints the split to resume with).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch

from ..common.console import EVENT_WIDTH, console_line
from ..common.outputdir import step_of
from ..core.batching import Exactness, Split, candidates, current_split, exact_under, is_grpo
from ..core.splitfile import Decision, ExactnessCheck, SplitFile, read_split_file, recorded_split, run_geometry
from ..core.stats import generation_period
from ..core.wording import wrapped
from ..keys import SPLIT_FILE
from ..platform import adapter
from ..platform.device import (
    error_line,
    gather_floats,
    is_main_process,
    main_process_value,
    rank,
    rng_state,
    world_size,
)
from . import exactness, grouping, sharding
from . import plan as plans
from .agreement import ResizeNeeded, StepGuard, guard_training_step, recoverable
from .checkpoints import RunCheckpoints, fingerprint, is_complete, newest_complete, resume_point
from .oomsite import UnfixableOOM, unfixable_cause
from .plan import InexactResize, Plan, Refused, ReplayLost, RowsLost, SplitState
from .record import Change, SplitRecord, clear_rank_files, merged, rank_files
from .release import free_memory
from .tuning import OnRunTuning, Switch
from .watch import ChangeRefused, ChangeWatch

if TYPE_CHECKING:
    from transformers import Trainer, TrainerState, TrainingArguments
    from trl import GRPOConfig

    from ..common.bus import RunBus
    from ..core.memory import WallFacts
    from ..platform.device import RngState

__all__ = ["Executor", "SwitchSplit", "RUN_END", "TunerView", "TunerEnd", "InexactResize", "ReplayLost", "RowsLost",
           "format_summary"]

logger = logging.getLogger("hf_perf_callbacks")


class SwitchSplit(BaseException):
    """Raised at the begin of the optimizer step after the one where a switch was requested, before that step
    trains: :func:`~hf_perf_callbacks.train_with_tuning` catches it and resumes at the new split. A stop set by
    anything else at the requested step (a callback's ``should_training_stop``, early stopping, ``max_steps``) ends
    ``train()`` before that begin, so the user's stop wins. A ``BaseException``: the package's fault isolation and
    the user's ``except Exception`` let it through."""


#: the changes whose refusal ends the run (the old split cannot go on: it ran out of memory, or never ran)
FORCED = ("oom", "memory_check", "restart")


@dataclass
class Staged:
    """A change applied and not yet checked: ``kind`` (:data:`~hf_perf_callbacks.core.splitfile.CHANGES`, or ``back``: a
    return to the split that trained the run), ``old`` → ``new``, the step it starts with (0: the first step of the
    next ``train()``, a resume's), the plan's state and decision to commit once checked, and the checkpoint it
    resumed from."""

    kind: str
    old: Split
    new: Split
    step: int
    state: SplitState
    decision: Decision | None = None
    checkpoint: str | None = None

    @property
    def checked(self) -> bool:
        """Whether its gradients are checked: any change but a return to the split that trained the run."""
        return self.kind != "back"


class Executor:
    """See the module docstring. ``managed``: :func:`~hf_perf_callbacks.train_with_tuning` drives the run;
    ``accept_unmeasured``: a change that could not be checked is used anyway (said once)."""

    def __init__(self, args: TrainingArguments, bus: RunBus | None = None, managed: bool = False,
                 accept_unmeasured: bool = False) -> None:
        self.args = args
        self.output_dir = str(args.output_dir)       # set by TrainingArguments (None only before its init)
        self.bus, self.managed, self.accept_unmeasured = bus, managed, accept_unmeasured
        self.world = world_size()
        # the split in effect, every split of the run's batch (its size never changes), the run kind
        configured, self.every, self.grpo = current_split(args), candidates(args, self.world), is_grpo(args)
        self.record = SplitRecord.start(self.output_dir, configured, self.world, is_main_process(), rank())
        self.checkpoints = RunCheckpoints(self.output_dir)
        self.trainer: Trainer | None = None
        self.tuning: OnRunTuning | None = None
        self.step_log: adapter.StepLog | None = None
        self.loop: adapter.LoopState | None = None
        self.watch: ChangeWatch | None = None
        self.staged: Staged | None = None           # a change applied, checked at the step it starts with
        self.pending: Decision | None = None        # the decision of a requested switch, committed once checked
        self.requested_at: float | None = None
        self.next_rng: tuple[int, RngState] | None = None   # (step, the RNG the step after it starts from)
        self.epoch_rng: tuple[int, RngState] | None = None  # (epoch, the RNG its data iterator was made with)
        self.sharded: str | None = None             # FSDP, DeepSpeed (take_run)
        self.unmeasured: set[Split] = set()         # refused unmeasured: the watchdog does not ask for them again
        self.max_resizes = 0                        # re-sizes forced by memory allowed (take_run)
        self.recorded: Split | None = None          # the split a resume's record asks for (resume_from)
        self.recorded_checked = False               # ... and whether its change was checked on the run's rows
        self._undo_grpo: Callable[[], None] | None = None
        self._open, self._dirty = 0, False
        if bus is not None:
            bus.tuning = self
            bus.log.pin_session(self.record.id)

    @property
    def state(self) -> SplitState:
        return self.record.state

    @property
    def split(self) -> Split:
        """The split the trainer trains at now."""
        return current_split(self.args)

    @property
    def resizes(self) -> int:
        """Re-sizes forced by memory (not the tuning's trials that ran out of memory)."""
        return sum(d.kind in ("oom", "watchdog") and not d.trial for d in self.record.decisions)

    # ------------------------------------------------------------ commits
    @contextlib.contextmanager
    def event(self) -> Iterator[None]:
        """One event of the run (nested ones are part of it): the record is written once, at its end."""
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0 and self._dirty:
                self._dirty = False
                self._write(Change())

    def commit(self, **change: Any) -> None:
        """Commit a change to the record (written at the end of the event under way; now, when none is)."""
        if self._open:
            self.record.commit(Change(**change), self.checkpoints.written, write=False)
            self._dirty = True
        else:
            self._write(Change(**change))

    def _write(self, change: Change) -> None:
        try:
            self.record.commit(change, self.checkpoints.written)
        except OSError as error:
            self.warn_once("persist", f"could not write the split file in {self.output_dir}: {error} (the split "
                                      f"and decisions are kept in memory)")

    def snapshot(self) -> SplitState:
        state = self.record.snapshot(self.every)
        return replace(state, split=self.split,
                       last_decision=self.pending.kind if self.pending is not None else state.last_decision)

    def note(self, message: str, step: int | None = None, kind: Literal["note", "warning"] = "note") -> None:
        """An event of the run: a note, or a ``warning`` (console and perf log; the logger alone without a bus)."""
        if self.bus is not None:
            self.bus.log.event("tuner", kind, message, step=step)
        else:
            logger.log(logging.WARNING if kind == "warning" else logging.INFO, "[tuner] %s", message)

    def warn_once(self, key: str, message: str, step: int | None = None) -> bool:
        """``message`` as a warning (console and perf log), once per ``key`` for this run; True when said now."""
        if not self.record.first_time(key):
            return False
        self.note(message, step, kind="warning")
        return True

    def decide(self, kind: str, reason: str, new: Split, step: int, old: Split | None = None,
               **details: Any) -> Decision:
        return Decision(kind=kind, step=step, reason=reason, old=old or self.split, new=new, time=time.time(),
                        **details)

    def decided(self, decision: Decision) -> None:
        """Commit ``decision`` and log it as an event of the perf log."""
        self.commit(decision=decision)
        if self.bus is not None:
            self.bus.log.event("tuner", "decision", decision.headline(), step=decision.step,
                               details=decision.event_details())

    # ------------------------------------------------------------ the run train_with_tuning drives
    def take_run(self, trainer: Trainer, resume: str | bool | None,
                 max_resizes: int) -> tuple[str | None, str | None, StepGuard | None]:
        """The executor takes the run: a resume from ``resume`` (a checkpoint, ``True``/``"last"``, or None; after a
        launcher's restart the newest this job wrote) continues the run's record. Returns the checkpoint to resume
        from, the trainer's sharding (FSDP, DeepSpeed: no tuning) and the step guard."""
        checkpoint = resume_point(resume, self.output_dir, restarts=sharding.restarted_by_launcher())
        self.trainer, self.max_resizes = trainer, max_resizes
        if self.world > 1:          # one run, one id on every rank: the restart merges a rank's record by it
            self.record.id = main_process_value(lambda: self.record.id)
            if self.bus is not None:
                self.bus.log.pin_session(self.record.id)
        sharded, guarded = sharding.start(trainer, self.warn_once)
        self.sharded = sharded
        self.record.commit(Change(state=replace(self.state, in_process=sharded is None, resizes_left=max_resizes)),
                           self.checkpoints.written, write=False)      # nothing the file holds: not written
        self.step_log, self.loop = adapter.StepLog(trainer), adapter.LoopState(trainer)
        if checkpoint:
            self.resume_from(trainer, checkpoint)
        if not guarded:
            return checkpoint, sharded, None
        return checkpoint, sharded, guard_training_step(trainer, sharding.STABLE_STEPS if sharded else None,
                                                        notify=self.note)

    def prepare(self, trainer: Trainer, check_memory: Callable[[], None] | None,
                tuning: dict[str, Any] | None) -> None:
        """Before the run's first ``train()``: the splits exact under the run's loss, a resume's recorded split,
        the change watch, the memory check (``check_memory``) and the tuning on the run's steps (``tuning``)."""
        with self.event():
            self.judge_grouping(trainer)
            self.watch = ChangeWatch(trainer, self.state.configured, current_split, rows=not self.grpo,
                                     sized=grouping.examples(trainer.train_dataset) is not None)
            self.apply_recorded(trainer)
            if check_memory is not None:
                check_memory()
            if tuning is not None and not any(d.kind == "tune" for d in self.record.decisions):
                self.start_tuning(**tuning)

    def close(self, trainer: Trainer) -> None:
        """The driven run's ``train()`` calls are over: a tuning still running ended and recorded, the trainer left
        at the split the run trained, the hooks undone, the trainer's bus free for a later plain ``train()``."""
        with self.event():
            if self.watch is not None:
                self.watch.close()
            self._stop_grpo_watch()
            self.end_tuning(trainer.state.global_step, "the run ended before the tuning did")
            self.settle(trainer)
        if self.step_log is not None:
            self.step_log.undo()
        if self.bus is not None and self.bus.tuning is self:
            self.bus.tuning = None

    def resume_from(self, trainer: Trainer, checkpoint: str) -> None:
        """A resume from ``checkpoint``: the run's record goes on when it is this run's (merged with what other ranks
        recorded for a launcher's restart), the recorded split is applied when exact, and a checkpoint of this
        ``output_dir`` is a valid fallback for a later out-of-memory error."""
        found = main_process_value(lambda: merged(read_split_file(self.output_dir), rank_files(self.output_dir)))
        record = recorded_session(found, checkpoint)
        if record is not None:
            self.record.adopt(record)
            self.checkpoints.written = list(record.written)
            if self.bus is not None:
                self.bus.log.pin_session(self.record.id)
            if is_main_process():
                clear_rank_files(self.output_dir)
        self.recorded = recorded_split(found, self.output_dir, **run_geometry(trainer.args, self.world))
        self.recorded_checked = record is not None and _checked(record, self.recorded)
        step = step_of(checkpoint)
        parent = os.path.dirname(os.path.normpath(checkpoint))
        if step is not None and os.path.realpath(parent) == os.path.realpath(self.output_dir):
            self.record_written(step)

    def apply_recorded(self, trainer: Trainer) -> None:
        """The split the run's record asks a resume for, kept only when the run's rules allow it (said once
        otherwise); one that was never checked on this run's rows is checked at the first step
        (``restart``: a launcher's restart resumes with the split another rank chose)."""
        recorded, self.recorded = self.recorded, None
        if recorded is None or recorded == self.split:
            return
        configured, exactness = self.state.configured, self.state.exactness
        if exactness is not None and not exactness.allows(recorded) and recorded != configured:
            self.warn_once("recorded-inexact", f"the split recorded in {os.path.join(self.output_dir, SPLIT_FILE)} "
                                               f"({recorded}) is not exact for this run ({exactness.reason}): "
                                               f"training at the configured split {configured}")
            self.apply(trainer, configured)
            return
        old = self.split
        self.apply(trainer, recorded)
        if self.recorded_checked or recorded == configured:
            self.commit(state=replace(self.state, split=recorded, switch=None))
        else:
            self.stage(Staged("restart", old, recorded, 0, replace(self.state, split=recorded, switch=None)))

    # ------------------------------------------------------------ the splits the run may use
    def judge_grouping(self, trainer: Trainer) -> Exactness:
        """Read the facts of the run's loss and keep the splits the settings list does not refuse (said once, with
        why and what makes every split exact). The list explains causes and skips checks sure to fail; every change
        it lets through is still checked on the step it starts with."""
        every = self.every
        configured = self.state.configured
        planned = trainer.state.max_steps if trainer.state.max_steps > 0 else trainer.args.max_steps
        try:
            facts = grouping.read_grouping(trainer, planned if planned and planned > 0 else None, self.world)
            exactness = exact_under(facts, configured, every)
        except Exception as error:  # noqa: BLE001 - unknown facts: only the configured split is known to be exact
            exactness = Exactness((configured,), f"the run's loss could not be read ({type(error).__name__}: "
                                                 f"{error})", "Nothing to change: this is a fault of the package.")
        exactness = _narrowed(exactness, self.state.exactness)   # a resume: what the run's rows showed stays
        self.commit(state=replace(self.state, exactness=exactness))
        if exactness.reason is not None:
            if self.managed:
                self.warn_once("grouping", exactness.message(every))
            elif self.record.first_time("grouping"):        # a plain train() tunes nothing: a note, said once
                self.note(exactness.message(every))
        return exactness

    def leave_out(self, bad: Split, why: str, step: int) -> None:
        """``bad`` was refused at ``step`` (``why``): it is not used again in this run (said once)."""
        if self.watch is not None:
            self.watch.refuse(bad, why)
        exactness = self.state.exactness
        kept = exactness.splits if exactness is not None else tuple(self.every)
        reason = why if exactness is None or exactness.reason is None else f"{exactness.reason}; {why}"
        fix = (exactness.fix if exactness is not None and exactness.fix else
               "A loss that sums over the step's rows and divides by num_items_in_batch, with no term or noise drawn "
               "per micro-batch, lets every split be used.")
        self.commit(state=replace(self.state, exactness=Exactness(tuple(s for s in kept if s != bad), reason, fix)))
        if self.tuning is not None:
            self.tuning.leave_out({bad})
        self.warn_once(f"refused-{bad}", f"{why}: {bad} is not used again in this run", step=step)

    # ------------------------------------------------------------ the split
    def apply(self, trainer: Trainer, split: Split) -> None:
        """Make ``split`` the split the trainer trains at: ``args`` and the batch size its next ``train()`` builds its
        dataloader with (GRPO: the generation batch kept through ``steps_per_generation``), DeepSpeed's config."""
        args = trainer.args
        args.per_device_train_batch_size, args.gradient_accumulation_steps = split.micro_batch, split.grad_accum
        if split.steps_per_generation is not None:
            grpo = cast("GRPOConfig", args)     # a split with steps_per_generation is GRPO's
            grpo.steps_per_generation = split.steps_per_generation
            grpo.generation_batch_size = split.generation_batch(self.world)
        adapter.set_train_batch_size(trainer)
        sharding.deepspeed_split(trainer)

    def settle(self, trainer: Trainer) -> None:
        """Leave the trainer at the split the record holds (a change applied and never checked is undone; a run
        that ended mid-trial at the split the tuning decided), so that ``args``, the split file and the decision say
        one split."""
        target = self.state.split
        last = self.record.decisions[-1] if self.record.decisions else None
        if self.state.switch is None and last is not None and last.kind == "tune" and last.new != target:
            target = last.new
            self.commit(state=replace(self.state, split=target))
        if self.split != target or adapter.train_batch_size(trainer) != target.micro_batch:
            self.apply(trainer, target)

    def request_switch(self, split: Split, reason: str, decision: Decision | None = None) -> None:
        """The next step begins at ``split`` (this ``train()`` stops at the step boundary); ``decision``: the one
        that asked for it, committed once the change is checked (dropped if it never takes effect)."""
        self.commit(state=replace(self.state, switch=split, switch_reason=reason))
        self.requested_at, self.pending = time.time(), decision
        if self.watch is not None:
            self.watch.arm()                     # the old split's next fetch: the rows the unfaulted run trains

    def cancel_switch(self) -> None:
        """A stop came first (the user's, early stopping, the run's end): the pending switch never takes effect."""
        self.commit(state=replace(self.state, switch=None))
        self.pending = None

    def stage(self, staged: Staged) -> None:
        """``staged.new`` is applied; its first step is checked before it trains (:meth:`step_begins`)."""
        self.staged = staged
        if self.watch is not None:
            self.watch.expect()
        if staged.checked and self.grpo and self.trainer is not None and self._undo_grpo is None:
            self._undo_grpo = adapter.watch_prepared_inputs(self.trainer, self._grpo_prepared)

    def _stop_grpo_watch(self) -> None:
        if self._undo_grpo is not None:
            self._undo_grpo()
            self._undo_grpo = None

    # ------------------------------------------------------------ the check of a staged change
    def step_begins_check(self, step: int) -> None:
        """At the begin of optimizer step ``step + 1``: a staged change's rows are in; its gradients are checked now
        (GRPO: once its completions are, in the step's first micro-batch)."""
        staged = self.staged
        if staged is not None and staged.step == 0:     # staged before train() knew its first step (a resume)
            staged.step = step + 1
        if staged is None or staged.step != step + 1 or self.watch is None:
            return
        theirs, ours = self.watch.taken()
        if not staged.checked:
            self._confirmed(staged, None)
        elif not self.grpo:                       # ours None: the step fetched nothing the watch saw
            self._check(staged, theirs, ours or exactness.Fetched(staged.new, [], None))

    def _grpo_prepared(self) -> None:
        """GRPO's first micro-batch of the staged change's step was handed out: its buffered completions are the
        step's rows."""
        trainer, staged = self.trainer, self.staged
        self._stop_grpo_watch()
        if trainer is None or staged is None or staged.step not in (0, trainer.state.global_step + 1):
            return
        staged.step = trainer.state.global_step + 1
        batches = adapter.grpo_step_batches(trainer)
        self._check(staged, None, exactness.Fetched(staged.new, batches or [], None))

    def _check(self, staged: Staged, theirs: exactness.Fetched | None, ours: exactness.Fetched) -> None:
        trainer = cast("Trainer", self.trainer)
        kind = sharding.sharding(trainer)
        unmeasurable = ("under DeepSpeed each rank keeps only its part of the reduced gradient inside the engine, so "
                        "no micro-batch's gradient can be compared" if kind == "deepspeed" else
                        None if ours.batches else "the step fetched no rows to compare")
        with self.bus.own_work() if self.bus is not None else contextlib.nullcontext():
            check = exactness.check(trainer, staged.kind, staged.step, staged.old, staged.new, ours, theirs,
                                    grpo=self.grpo, world=self.world, unmeasurable=unmeasurable)
        if check.exact or (check.verdict == "unmeasured" and check.fits and self.accept_unmeasured):
            if not check.exact:
                self.warn_once(f"unmeasured-{staged.new}", f"step {staged.step}: {staged.new} used unchecked "
                                                           f"(accept_unmeasured=True): {check.why}", step=staged.step)
            self._padding(check, theirs, ours)
            self._confirmed(staged, check)
            return
        raise ChangeRefused(staged.step, staged.new, f"{check.verdict}: {check.why}", staged.old, check, ours)

    def _confirmed(self, staged: Staged, check: ExactnessCheck | None) -> None:
        """The staged change passed its check (or needs none): its state, decision and check, committed once."""
        self.staged = None
        if self.watch is not None:
            self.watch.theirs = None                    # the reference of this change, used
        with self.event():
            state = replace(self.state, split=staged.new, switch=None, resizes_left=staged.state.resizes_left,
                            gave_up=staged.state.gave_up)
            self.commit(state=state, check=check)
            decision = staged.decision
            if decision is not None:                    # its one line says the check passed and what it cost
                if check is not None and check.passes:
                    decision.reason = f"{decision.reason}; checked exact on the step's rows in {check.cost_sec:.2f} s"
                self.decided(decision)
        if decision is None and check is not None and check.passes:
            self.note(f"step {staged.step}: {check.words()}", step=staged.step)

    def _padding(self, check: ExactnessCheck, theirs: exactness.Fetched | None, ours: exactness.Fetched) -> None:
        """transformers' ``total_flos`` (and ``num_input_tokens_seen`` when it counts padding) count each
        micro-batch's padded tokens: from this step on they count the new split's padding. The difference at this
        step (every rank's rows) goes into the check, and one note says it."""
        if theirs is None:
            return
        delta = float(_padded_tokens(ours.batches) - _padded_tokens(theirs.batches))
        check.padded_delta = int(sum(r[0] for r in gather_floats([delta])) if self.world > 1 else delta)
        if check.padded_delta == 0:
            return
        counts = getattr(self.args, "include_num_input_tokens_seen", False) in (True, "all")
        which = "num_input_tokens_seen and total_flos count" if counts else "total_flos counts"
        self.note(f"{which} {check.new}'s padding from step {check.step}, not {check.old}'s "
                  f"({check.padded_delta:+d} tokens at this step)", step=check.step)

    # ------------------------------------------------------------ the loop's events
    def after_train(self, switching: bool, in_optimizer_step: bool) -> tuple[bool, str | None]:
        """A ``train()`` call returned (``switching``: stopped by the pending switch): (True, None) when the run is
        done (a pending switch a stop came before is cancelled), else (False, the checkpoint the switch resumes
        from)."""
        trainer = cast("Trainer", self.trainer)
        plan = plans.on_stop(self.snapshot(), switching)
        with self.event():
            if plan.cancelled is not None:
                self.cancel_switch()
            if plan.action == "finish":
                if self.checkpoints.drop_switch():
                    self.commit()
                return True, None
        try:
            return False, self.switch_now(trainer)
        except BaseException as error:               # Ctrl-C, SIGTERM or a failure while the switch saved
            self.end_run(trainer, error, in_optimizer_step, agreed=False)
            raise

    def switch_now(self, trainer: Trainer) -> str:
        """The pending switch, in this process: the step's checkpoint (a watchdog's re-size keeps it as a save of the
        run and spends one of ``max_resizes``), the switch staged; returns the checkpoint to resume from."""
        plan = plans.on_switch(self.snapshot())
        step, old, new = trainer.state.global_step, self.split, plan.new
        assert new is not None, "a pending switch names its split"
        with self.event():
            wrote = not self.checkpoints.is_ours(step)
            checkpoint = self.save_checkpoint(trainer, step, switch=plan.source == "switch")
            try:
                self.carry_loop(trainer, checkpoint, new)
            except adapter.CannotReplay as cannot:        # ended here, saved: no switch to a run that differs
                lost = self.replay_lost(trainer, step, new, cannot)
                self.cancel_switch()
                self.end_run(trainer, lost, gave_up=True)
                raise lost from None
            if not plan.spend:
                self._switched_at(step, wrote)
            why = "" if plan.spend else f" ({self.state.switch_reason.removeprefix(f'back to {new}: ')})"
            _say(f"[tuner] step {step}: {old} → {new}: resuming from {os.path.basename(checkpoint)} in this "
                 f"process{why}")
            decision, self.pending = self.pending, None
            kind = "watchdog" if plan.spend else "tune" if self._in_tuning(new) else "back"
            self.resume_with(trainer, Staged(kind, old, new, step + 1, plan.state, decision, checkpoint))
        return checkpoint

    def recover(self, error: BaseException, in_optimizer_step: bool, memory: WallFacts | None) -> str | None:
        r"""What ``train()`` raised: an out-of-memory error a smaller split fixes re-sizes (returns the checkpoint to
        resume from, None: the start); anything else saves when it can and is raised (the bare ``raise``\ s
        re-raise ``error`` as it was: this runs inside its ``except``)."""
        trainer = cast("Trainer", self.trainer)
        if self.max_resizes > 0 and sharding.unagreed_oom(self.sharded, error):    # the others wait in a collective
            self.record_for_restart(trainer.state.global_step, error, self.sharded)
            raise
        if not isinstance(error, Exception) or not recoverable(error):
            if self.max_resizes > 0:
                self.end_run(trainer, error, in_optimizer_step)
            raise
        if self.max_resizes == 0 and not self._in_tuning(self.split):
            raise
        agreed = isinstance(error, ResizeNeeded)
        if self.watch is not None and (self.world == 1 or agreed):     # several ranks: every one of them is here
            fetched = adapter.fetched_step(error)
            self.watch.hold(fetched[0] if fetched else None, trainer.state.global_step + 1, self.split,
                            fetched[1] if fetched else None)
        return self._resize(trainer, error, in_optimizer_step, agreed, memory)

    def _resize(self, trainer: Trainer, error: BaseException, in_optimizer_step: bool, agreed: bool,
                memory: WallFacts | None) -> str | None:
        """An out-of-memory error a smaller micro-batch may fix (the step's, or the new split's in its check):
        re-size, or end saved with why."""
        trial = self._in_tuning(self.split)
        cause = unfixable_cause(error, trainer, error.site if isinstance(error, ResizeNeeded) else None, memory)
        if cause is not None:                    # no micro-batch fixes it: no re-size
            unfixable = UnfixableOOM(cause)
            self.end_run(trainer, unfixable, in_optimizer_step, agreed=agreed)
            raise unfixable from error
        if not trial and self.state.resizes_spent:
            self.end_run(trainer, error, in_optimizer_step, gave_up=True)
            raise RuntimeError(f"train_with_tuning gave up after {self.max_resizes} re-sizes"
                               f"{memory_causes(memory)}") from error
        try:
            return self.recover_from_oom(trainer, error, in_optimizer_step, trial)
        except InexactResize as inexact:         # smaller splits exist, none exact for this run
            self.end_run(trainer, inexact, in_optimizer_step, agreed=agreed, gave_up=True)
            raise inexact from error
        except ValueError as none_left:          # no smaller exact split
            self.end_run(trainer, error, in_optimizer_step, gave_up=True)
            raise ValueError(f"{none_left}{memory_causes(memory)}") from error
        except (KeyboardInterrupt, SystemExit) as stopped:      # Ctrl-C or SIGTERM while the re-size saved: a stop
            self.end_run(trainer, stopped, in_optimizer_step, agreed=agreed)
            raise

    def recover_from_oom(self, trainer: Trainer, error: BaseException, in_optimizer_step: bool = False,
                         trial: bool = False) -> str | None:
        """An out-of-memory error in optimizer step ``global_step + 1``: the next split planned
        (:func:`~hf_perf_callbacks.resize.plan.on_oom`) and staged, its ``oom`` decision committed once it is
        checked; returns the checkpoint to resume from (None: the start). ValueError when no smaller split is left,
        :class:`InexactResize` when the smaller ones are refused by the run's rules. A split under trial that ran out
        of memory is left: the run goes on at the next candidate or the baseline, the decision marked ``trial``."""
        reason = f"out of memory: {error_line(error)[:70]}"
        old, tuning, step = self.state.split, self.tuning, trainer.state.global_step
        with self.event():
            trial_next = None
            if trial and tuning is not None:
                trial_next = tuning.failed(self.split, "out of memory", step)
                self.record_tuning(step)
            plan = plans.on_oom(self.snapshot(), step + 1, in_optimizer_step, trial=trial and tuning is not None,
                                trial_next=trial_next)
            if plan.error is not None:
                raise plan.error
            new = plan.new
            assert new is not None, "a re-size plan names its split"
            if not plan.trial:
                self.end_tuning(step, "out of memory ended the tuning")
            free_memory(trainer, self.warn_once)
            if self.loop is not None:
                self.loop.rewind(step)
            checkpoint = self._resume_point(trainer, plan, step, new, error)
            try:
                self.carry_loop(trainer, checkpoint, new)
            except adapter.CannotReplay as why:
                raise self.replay_lost(trainer, step, new, why) from None
            if plan.trial:                  # a trial split that did not fit: a fact of the tuning, recorded now
                self.decided(self.decide("oom", reason, new, step + 1, old=self.split, checkpoint=checkpoint,
                                         trial=True))
                kind, decision = ("tune" if self._in_tuning(new) else "back"), None
            else:                           # the re-size: recorded once its first step is checked
                kind, decision = "oom", self.decide("oom", reason, new, step + 1, old=old, checkpoint=checkpoint)
            self.resume_with(trainer, Staged(kind, old, new, step + 1, plan.state, decision, checkpoint))
        return checkpoint

    def _in_tuning(self, split: Split) -> bool:
        """Whether ``split`` is one the tuning tries (not its baseline)."""
        tuning = self.tuning
        return tuning is not None and tuning.done is None and split != tuning.baseline

    def _resume_point(self, trainer: Trainer, plan: Plan, step: int, new: Split,
                      error: BaseException) -> str | None:
        """The checkpoint an out-of-memory re-size resumes from, as ``plan.source`` says: the newest this run wrote
        (the weights may be half-updated), the start, or this step's, saved now (the newest of this run when saving
        fails)."""
        save_only_model = bool(trainer.args.save_only_model)
        if plan.source == "newest":
            checkpoint = self.checkpoints.newest_ours(step, save_only_model)
            if checkpoint is None:
                raise RuntimeError("out of memory inside optimizer.step before this run saved any complete "
                                   "checkpoint: the weights may be half-updated, so the run cannot continue safely. "
                                   f"Restart it with a smaller split ({new}) or set save_steps.") from error
            return checkpoint
        if plan.source == "start":
            return None
        wrote = not self.checkpoints.is_ours(step)
        try:
            checkpoint = self.save_checkpoint(trainer, step, switch=plan.source == "switch")
            if plan.source == "switch":
                self._switched_at(step, wrote)
            return checkpoint
        except Exception as save_error:  # noqa: BLE001 - fall back to the newest complete one of this run
            fallback = self.checkpoints.newest_ours(step, save_only_model)
            if fallback is None:
                raise RuntimeError(f"out of memory in step {step + 1}, and saving checkpoint-{step} failed too "
                                   f"({type(save_error).__name__}: {save_error}); this run has no complete "
                                   f"checkpoint to resume from") from error
            self.warn_once("fallback", f"saving checkpoint-{step} failed ({save_error}): resuming from {fallback}; "
                                       f"steps after it are trained again")
            return fallback

    def refused(self, refusal: ChangeRefused) -> str | None:
        """A change was refused at the step it starts with (its rows or gradients differ, or could not be checked):
        back to the split that trains those rows from the same checkpoint — the tuning's next candidate or its
        baseline, the split before the watchdog's request — or, where that split cannot go on (it ran out of memory,
        or never ran), the run ends there, saved, saying why (:class:`InexactResize`)."""
        trainer = cast("Trainer", self.trainer)
        staged, self.staged = self.staged, None
        self._stop_grpo_watch()
        step = trainer.state.global_step
        check = refusal.check
        if check is not None and not check.fits:        # the new split's own micro-batches ran out of memory
            if refusal.rows is not None and self.watch is not None and self.watch.theirs is None:
                self.watch.hold(refusal.rows.batches, step + 1, self.split, refusal.rows.num_items)
            self.commit(check=check)
            oom = torch.OutOfMemoryError(f"out of memory in the check of a change: {check.why}")
            return self._resize(trainer, oom, False, True, self.bus.memory_facts if self.bus is not None else None)
        try:
            with self.event():
                why = f"{refusal.split} refused at step {refusal.step} ({refusal.why})"
                if refusal.check is not None:
                    self.commit(check=refusal.check)
                if refusal.check is not None and refusal.check.verdict == "unmeasured":
                    self.unmeasured.add(refusal.split)         # not asked for again; a forced re-size checks anew
                    if self.tuning is not None:
                        self.tuning.leave_out({refusal.split})
                    self.warn_once(f"unmeasured-{refusal.split}", f"{why}: not tried again", step=step)
                else:
                    self.leave_out(refusal.split, why, step)
                return self._back(trainer, staged, refusal)
        except InexactResize as inexact:
            self.end_run(trainer, inexact, gave_up=True)
            raise inexact from None

    def _back(self, trainer: Trainer, staged: Staged | None, refusal: ChangeRefused) -> str | None:
        """Back from a refused change to the split that trains its step's rows, from the same checkpoint."""
        step, bad = trainer.state.global_step, refusal.split
        new = self._back_to(step, staged, refusal)
        free_memory(trainer, self.warn_once)
        checkpoint = staged.checkpoint if staged is not None else None
        if checkpoint is None and step > 0:
            wrote = not self.checkpoints.is_ours(step)
            checkpoint = self.save_checkpoint(trainer, step, switch=True)
            self._switched_at(step, wrote)
        self.carry_loop(trainer, checkpoint, new)
        self.pending = None
        self.commit(state=replace(self.state, switch=new, switch_reason=refusal.why))
        back = "back" if new == self.state.split or new == self.state.configured else "tune"
        self.resume_with(trainer, Staged(back, self.state.split, new, step + 1, replace(self.state, switch=None)))
        _say(f"[tuner] step {step + 1}: {bad} → {new} ({refusal.why[:70]}): resuming from "
             f"{os.path.basename(checkpoint) if checkpoint else 'the start'} in this process")
        return checkpoint

    def _back_to(self, step: int, staged: Staged | None, refusal: ChangeRefused) -> Split:
        """The split a refused change goes back to: the tuning's next candidate or its baseline (a trial), the split
        before it; :class:`InexactResize` where that cannot go on (the change was forced by memory)."""
        bad, tuning = refusal.split, self.tuning
        if tuning is not None and tuning.done is None and bad != tuning.baseline:
            new = tuning.failed(bad, "refused at its first step", step)
            self.record_tuning(step)
            return new
        forced = staged is not None and staged.kind in FORCED
        if forced or refusal.expected is None or refusal.expected == bad:
            raise self._inexact(step, staged, refusal)
        return refusal.expected

    def _inexact(self, step: int, staged: Staged | None, refusal: ChangeRefused) -> InexactResize:
        """Why the run ends: the change the run needed (``staged``) was refused and no split before it goes on."""
        if staged is None or refusal.check is None:
            return RowsLost(f"{refusal.why}, and no split trains the rows the run would have trained at step "
                            f"{refusal.step}. The run ends here rather than going on inexactly; ")
        check, new = refusal.check, staged.new
        why = {"oom": f"out of memory in step {refusal.step} at split {staged.old}",
               "memory_check": f"the memory check found {staged.old} does not fit",
               "restart": f"a launcher's restart resumed with {new}, recorded by the rank that ran out of "
                          f"memory"}[staged.kind]
        unchecked = ("" if check.verdict == "inexact" else
                     "; or, to go on at it with train_with_tuning, set AdaptiveBatchTuner(accept_unmeasured=True)")
        return Refused(f"{why}, and {new} is {check.verdict} on that step's rows: {check.why}. The run ends here "
                       f"rather than going on inexactly. To go on anyway at {new} (not exactly the configured run)"
                       f"{unchecked}, set per_device_train_batch_size={new.micro_batch} and "
                       f"gradient_accumulation_steps={new.grad_accum} and ")

    def record_for_restart(self, step: int, error: BaseException, kind: str | None = "fsdp") -> None:
        """An out-of-memory error in step ``step + 1`` under FSDP (or DeepSpeed) that the ranks could not agree on:
        this rank records the next smaller split for the launcher's restart (the main process in the split file, any
        other rank in its own, which the restart merges) and says what happens; the caller re-raises."""
        plan = plans.on_restart(self.snapshot())
        checkpoint = self.checkpoints.newest_ours(step, bool(self.args.save_only_model))
        if plan.new is not None:
            reason = f"out of memory, not agreed inside the step: {error_line(error)[:160]}"
            decision = self.decide("oom", reason, plan.new, step + 1, checkpoint=checkpoint)
            self._write(Change(state=replace(self.state, switch=plan.new, switch_reason=reason), decision=decision,
                               restart=True))
        _tell(error, sharding.restart_message(step + 1, plan.new, checkpoint, self.state.exactness, kind))

    def end_run(self, trainer: Trainer, error: BaseException, in_optimizer_step: bool = False,
                agreed: bool | None = None, gave_up: bool = False) -> None:
        """The run is about to end with ``error``: its last completed optimizer step saved when it can
        (:func:`~hf_perf_callbacks.resize.plan.on_end` says whether), and how to resume said once: by the error (a note
        on it, unless its own words say it) and in the split file's ``ended``. ``agreed``: every rank left the step
        together; ``gave_up``: no smaller split fits, or the re-sizes are spent."""
        output_dir, step = str(trainer.args.output_dir), trainer.state.global_step
        agreed = isinstance(error, ResizeNeeded) if agreed is None else agreed
        plan = plans.on_end(self.snapshot(), step, self.world, agreed, in_optimizer_step, gave_up)
        checkpoint, why = None, plan.why
        self.staged, self.pending = None, None
        with self.event():
            self.commit(state=replace(plan.state, split=self.state.split))
            if not why:
                try:
                    free_memory(trainer, self.warn_once)
                    if self.loop is not None:
                        self.loop.rewind(step)
                    checkpoint = self.save_checkpoint(trainer, step)
                except (Exception, KeyboardInterrupt) as save_error:  # noqa: BLE001 - a 2nd Ctrl-C too: say what is left
                    why = f"saving failed: {type(save_error).__name__}: {error_line(save_error)[:160]}"
            if checkpoint is None:
                checkpoint = (self.checkpoints.newest_ours(step, bool(trainer.args.save_only_model))
                              or newest_complete(output_dir))
                saved = (f"checkpoint-{step} was not saved ({why}); the newest complete checkpoint is "
                         f"{checkpoint or 'none'}")
            else:
                saved = f"saved {checkpoint} (the last completed optimizer step, {step})"
            resume = (f"resume with train_with_tuning(trainer, resume_from_checkpoint={checkpoint!r}) (the split in "
                      f"{os.path.join(output_dir, SPLIT_FILE)} is applied when it fits)" if checkpoint
                      else "the run must start again")
            if isinstance(error, InexactResize):     # its own words say what was saved and how to go on from there
                error.ended(checkpoint, "" if checkpoint else why)
            said = str(error) if isinstance(error, (UnfixableOOM, InexactResize)) else error_line(error)[:160]
            self.commit(state=replace(self.state, switch=None),
                        ended=f"training ended at step {step} by {type(error).__name__}: {said}; {saved}; {resume}")
        if not isinstance(error, InexactResize):
            _tell(error, f"{saved}; {resume}", checkpoint)       # what the error does not say
        setattr(error, RUN_END, checkpoint)         # where to go on from (None: nowhere), for the launcher

    def replay_lost(self, trainer: Trainer, step: int, new: Split, why: adapter.CannotReplay) -> ReplayLost:
        """The refusal of a re-size in step ``step + 1`` to ``new`` whose resume could not replay GRPO's buffered
        completions, with why and what to change."""
        args = trainer.args
        return ReplayLost(
            f"a re-size in step {step + 1} from {self.split} to {new}: that step trains completions generated at an "
            f"earlier step (num_iterations={getattr(args, 'num_iterations', 1)}, steps_per_generation="
            f"{getattr(args, 'steps_per_generation', None)}, gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}), and {why}; a resume would train other completions. The run ends "
            f"here rather than going on inexactly. Every optimizer step generates its own completions with "
            f"num_iterations=1 and steps_per_generation dividing gradient_accumulation_steps; to go on anyway at "
            f"{new}, set per_device_train_batch_size={new.micro_batch}, gradient_accumulation_steps="
            f"{new.grad_accum} and steps_per_generation={new.steps_per_generation} and ")

    # ------------------------------------------------------------ saving and resuming in this process
    def resume_with(self, trainer: Trainer, staged: Staged) -> None:
        """Apply the staged change to a trainer whose last ``train()`` ended, forget that ``train()``'s state, free
        its memory; its first step is checked."""
        self.apply(trainer, staged.new)
        adapter.forget_last_train(trainer)
        sharding.release_engine(trainer)        # DeepSpeed: the next train() builds an engine for the new split
        free_memory(trainer, self.warn_once)
        self.stage(staged)

    def save_checkpoint(self, trainer: Trainer, step: int, switch: bool = False) -> str:
        """:meth:`RunCheckpoints.save <.checkpoints.RunCheckpoints.save>` with the RNG the next step starts from,
        the training log and the perf line of step ``step`` written first."""
        if self.bus is not None:                                    # the checkpoint's steps all have their line
            self.bus.complete_step(trainer.args, trainer.state, self.step_log.log_missed if self.step_log else None)
        elif self.step_log is not None:
            self.step_log.log_missed()
        after = self.next_rng              # the RNG the step after ``step`` starts from (None: it has not begun)
        rng = after[1] if after is not None and after[0] == step else None
        path, wrote = self.checkpoints.save(trainer, step, switch, rng, self.warn_once)
        if wrote:
            self.commit()
        if wrote and self.loop is not None and path.endswith(f"checkpoint-{step}"):
            self.loop.keep(step)
        return path

    def record_written(self, step: int) -> None:
        """Record ``checkpoint-<step>`` as this run's when it is complete."""
        if self.checkpoints.record(step):
            self.commit()

    def _switched_at(self, step: int, wrote: bool) -> None:
        if self.checkpoints.switched_at(step, wrote):
            self.commit()

    def carry_loop(self, trainer: Trainer, checkpoint: str | None, new: Split) -> None:
        """The next ``train()`` resumes from ``checkpoint`` at ``new``: what the loop held at that step is prepared
        for it (GRPO: the buffered completions re-split). :class:`adapter.CannotReplay` when it cannot be."""
        if self.loop is None:
            return
        old, args = self.split, trainer.args
        every = (old.steps_per_generation * getattr(args, "num_iterations", 1)
                 if old.steps_per_generation is not None else None)
        self.loop.carry(step_of(checkpoint) if checkpoint else None, old.micro_batch, old.grad_accum,
                        new.micro_batch, new.steps_per_generation, every)

    # ------------------------------------------------------------ the tuning
    def start_tuning(self, planned: int | None, state_bytes: float, max_micro_batch: int | None = None,
                     **settings: Any) -> None:
        """The tuning on the run's own steps: the split in effect against every other split the run may use up to
        ``max_micro_batch``, over ``planned`` optimizer steps (GRPO: trials of whole generation cycles)."""
        args = self.args
        others = [s for s in self.snapshot().allowed() if s != self.split
                  and (max_micro_batch is None or s.micro_batch <= max_micro_batch)]
        period = (generation_period(cast(int, cast("GRPOConfig", args).steps_per_generation),
                                    getattr(args, "num_iterations", 1), args.gradient_accumulation_steps)
                  if self.grpo else 1)
        self.tuning = OnRunTuning(self.split, others, planned, period=period, state_bytes=state_bytes, **settings)
        self.commit(state=replace(self.state, baseline=self.split))

    def end_tuning(self, step: int, reason: str) -> None:
        """Stop the tuning now at its baseline, and record it."""
        if self.tuning is not None and self.tuning.done is None:
            self.tuning.end(reason)
            self.record_tuning(step)

    def record_tuning(self, step: int) -> None:
        """Record a finished tuning as its one ``tune`` decision, once (nothing while it runs, or once recorded)."""
        decision = self.tuning.decision(step, time.time()) if self.tuning is not None else None
        if decision is not None:
            self.decided(decision)
            self.commit(state=replace(self.state, baseline=None))

    # ------------------------------------------------------------ the RNG a checkpoint holds
    def note_rng(self, step: int, epoch_start: bool = False, epoch: int | None = None) -> None:
        """Remember the RNG that the optimizer step after ``step`` starts from: what a checkpoint of ``step`` must
        hold for a resume to draw what the run drew (taken where transformers restores it: at an epoch's begin, or
        at the step's begin, before a GRPO step's generation draws from it)."""
        if epoch_start or self.next_rng is None or self.next_rng[0] != step:
            self.next_rng = (step, rng_state())
        if epoch_start and epoch is not None:
            self.epoch_rng = (epoch, self.next_rng[1])

    # ------------------------------------------------------------ the tuner's events (TunerView)
    @classmethod
    def for_tuner(cls, args: TrainingArguments, state: TrainerState, bus: RunBus | None,
                  accept_unmeasured: bool = False) -> Executor:
        """The run's executor for the tuner at ``on_train_begin``: train_with_tuning's (on the bus), or one of the
        tuner's own (a resume continues the recorded run when it is this one)."""
        found = bus.tuning if bus is not None else None
        if isinstance(found, Executor) and found.output_dir == args.output_dir:
            return found
        executor = cls(args, bus=bus, accept_unmeasured=accept_unmeasured)
        executor.trainer = adapter.calling_trainer()
        if state.global_step > 0:
            record = read_split_file(str(args.output_dir), warn=False)
            if record is not None and record.checkpoint(state.global_step) is not None:
                executor.record.adopt(record)
                executor.checkpoints.written = list(record.written)
        if executor.trainer is not None:
            executor.judge_grouping(executor.trainer)
        return executor

    def begin_train(self, args: TrainingArguments, step: int, max_steps: int = 0) -> bool:
        """A ``train()`` call of ``max_steps`` optimizer steps begins at ``step``: args changed by hand between calls
        rule, a resume in process goes on with the loop's windows and buffer, and a tuning under way measures a new
        segment (over the steps transformers planned). True when the tuner measures this call's steps."""
        with self.event():
            if self.staged is None and self.split != self.state.split:              # changed by hand
                self.commit(state=replace(self.state, split=self.split))
            if step > 0 and self.loop is not None:
                self.loop.install()
            tuning = self.tuning
            if not (self.managed and tuning is not None and tuning.done is None):
                return False
            if tuning.planned is None and max_steps > 0:
                tuning.planned = max_steps
            requested, self.requested_at = self.requested_at, None
            tuning.segment_started(self.split, step,
                                   switch_sec=None if requested is None else max(0.0, time.time() - requested))
            self.record_tuning(step)
            return tuning.done is None

    def epoch_begins(self, step: int, epoch: float, resumed: bool) -> RngState | None:
        """An epoch's begin (``resumed``: the first of a resumed ``train()``, the epoch it resumes within): the RNG
        at an epoch's start is noted (an iterable dataset's epoch count is fractional: every begin but a resumed
        one starts an epoch); returns the RNG a resumed epoch's data iterator must draw from (None: the current
        one)."""
        if not self.managed:
            return None
        if not resumed:
            self.note_rng(step, epoch_start=True, epoch=int(epoch))
            return None
        return self.epoch_rng[1] if self.epoch_rng is not None and self.epoch_rng[0] == int(epoch) else None

    def step_begins(self, step: int) -> None:
        """Optimizer step ``step + 1`` begins: the RNG and the loop's state a checkpoint of ``step`` must hold are
        noted, a staged change's first step is checked, and a pending in-process switch raises
        :class:`SwitchSplit` before the step trains."""
        if self.managed:
            self.note_rng(step)
            if self.loop is not None:
                self.loop.note()
            self.step_begins_check(step)
        if self.state.switch is not None and self.state.in_process and self.staged is None:
            raise SwitchSplit(f"switch to {self.state.switch} before step {step + 1}")

    def saved(self, step: int) -> None:
        """transformers wrote ``checkpoint-<step>``: this run's, if complete."""
        self.record_written(step)
        if self.loop is not None:
            self.loop.note_save()

    def step_ends(self, step: int) -> tuple[Split, int]:
        """Optimizer step ``step`` completed at the split in effect, which is returned with the re-sizes so far; a
        re-size forced by memory before it gets its recovery time."""
        last = self.record.decisions[-1] if self.record.decisions else None
        with self.event():
            if (last is not None and last.kind in ("oom", "watchdog") and last.recovery_sec is None
                    and step >= last.step and last.time is not None):
                last.recovery_sec = time.time() - last.time
                self.commit()
            if self.state.ran != self.split:
                self.commit(state=replace(self.state, ran=self.split))
        return self.split, self.resizes

    def measured_step(self, step: int, ranked: float, whole: float, peak_gb: float,
                      fits: bool) -> tuple[bool, bool]:
        """The tuner measured step ``step`` for the tuning: a switch it asks for is requested. Returns ``(stop,
        measuring)``."""
        tuning = self.tuning
        assert tuning is not None, "measuring starts only with a tuning to measure for (begin_train)"
        stop = False
        with self.event():
            action = tuning.observe(step, ranked, whole, peak_gb=peak_gb, fits=fits)
            if isinstance(action, Switch):
                self.request_switch(action.split, action.why)
                stop = not self.state.in_process
            self.record_tuning(step)
        return stop, tuning.done is None

    def on_watchdog(self, reason: str, step: int, rows: list[Any] | None, acting: bool) -> Plan:
        """The watchdog asks for a smaller micro-batch at ``step`` (``acting``: the tuner can stop the run now;
        ``rows``: the next step's micro-batches, when fetched already): the plan of
        :func:`~hf_perf_callbacks.resize.plan.on_watchdog`, requested as the pending switch (its ``watchdog`` decision
        committed once the change is checked)."""
        if not acting and self.state.switch is None:
            return Plan("none", self.state)
        plan = plans.on_watchdog(self._asked_state(), step)
        if plan.action == "refuse" and plan.warn is not None:
            self.warn_once(*plan.warn, step=step)
        if plan.action != "resize" or plan.new is None:
            return plan
        with self.event():
            self.end_tuning(step, "memory pressure ended the tuning")
            decision = self.decide("watchdog", reason, plan.new, step)
            if self.managed:                           # committed once its first step is checked
                self.request_switch(plan.new, plan.state.switch_reason, decision)
            else:                                      # no check to wait for: the user resumes with it
                self.decided(decision)
                self.request_switch(plan.new, plan.state.switch_reason)
            if rows is not None and self.watch is not None:
                self.watch.hold(rows, step + 1, self.split)
        return plan

    def _asked_state(self) -> SplitState:
        """The state an asked-for change plans from: the splits refused unmeasured in this run left out (a forced
        re-size checks them anew)."""
        state = self.snapshot()
        exactness = state.exactness
        if not self.unmeasured or exactness is None:
            return state
        return replace(state, exactness=Exactness(tuple(s for s in exactness.splits if s not in self.unmeasured),
                                                  exactness.reason or "a smaller split could not be checked",
                                                  exactness.fix))

    def train_ends(self, step: int, measuring: bool, continuing: bool) -> TunerEnd:
        """A ``train()`` call ends at ``step`` (``continuing``: train_with_tuning resumes it in this process)."""
        if measuring and not continuing:
            self.end_tuning(step, "the run ended before the tuning did")
        decisions = self.record.decisions
        return TunerEnd(self.split, self.record.id, len(decisions), format_summary(self) if decisions else None,
                        None if self.managed else self.state.switch)


def _narrowed(rules: Exactness, recorded: Exactness | None) -> Exactness:
    """The rules' splits, less those a resumed run's record left out (its checks refused them), with both reasons."""
    if recorded is None or recorded.reason is None or recorded.reason == rules.reason:
        return rules
    kept = tuple(s for s in rules.splits if recorded.allows(s))
    return Exactness(kept, "; ".join(r for r in (rules.reason, recorded.reason) if r), rules.fix or recorded.fix)


def _padded_tokens(batches: list[Any]) -> int:
    """The tokens of micro-batches with their padding, as transformers' FLOP count reads them (``input_ids``)."""
    return sum(int(b["input_ids"].numel()) for b in batches if hasattr(b, "get") and hasattr(b.get("input_ids"),
                                                                                              "numel"))


#: the attribute the run's end sets on the error it ends with, and on its log record: the checkpoint to go on from
#: (None: none); the launcher words its own line from it (``train/interrupts.py``)
RUN_END = "hf_perf_resume_from"


def _tell(error: BaseException, text: str, checkpoint: str | None = None) -> None:
    """``text`` said once, by the error it is about: a note on it (its traceback shows it; raised, not also logged),
    wrapped at the console's width; logged with the error's name where Python has no notes (3.10), the record
    carrying :data:`RUN_END` (``checkpoint``)."""
    if hasattr(error, "add_note"):
        error.add_note(wrapped(f"[tuner] {text}"))
    else:
        logger.error("[tuner] %s: %s", type(error).__name__, text, extra={RUN_END: checkpoint})


def _say(text: str) -> None:
    if is_main_process():
        logger.warning("%s", console_line(text, EVENT_WIDTH))


def _checked(record: SplitFile, split: Split | None) -> bool:
    """Whether the record's last change to ``split`` was checked exact on the run's rows."""
    last = next((c for c in reversed(record.checks) if c.new == split), None)
    return split is None or split == record.configured or (last is not None and last.exact)


def memory_causes(facts: WallFacts | None) -> str:
    """What the watchdog knows presses on memory (another process, a leak), as a sentence to end a message with."""
    causes = facts.sentence() if facts is not None else ""
    return f" The memory wall, as the watchdog reads it: {causes}." if causes else ""


def recorded_session(record: SplitFile | None, checkpoint: str | None) -> SplitFile | None:
    """The split file's ``record`` when it belongs to the run being resumed from ``checkpoint``: the checkpoint is
    one the record lists as written, with the same fingerprint."""
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
    """What the tuner reports when a ``train()`` call ends: the split in effect, the run's id, the decisions so
    far, the end-of-run summary (None: no decision) and, without train_with_tuning, the split a pending re-size asks
    the user to resume with."""

    split: Split
    session: str
    decisions: int
    summary: str | None
    switch: Split | None


class TunerView(Protocol):
    """What :class:`~hf_perf_callbacks.resize.callback.AdaptiveBatchTuner` sees of the executor: one method per event
    it reports, and whether train_with_tuning drives the run."""

    managed: bool

    def begin_train(self, args: TrainingArguments, step: int, max_steps: int = 0) -> bool: ...

    def epoch_begins(self, step: int, epoch: float, resumed: bool) -> RngState | None: ...

    def step_begins(self, step: int) -> None: ...

    def saved(self, step: int) -> None: ...

    def step_ends(self, step: int) -> tuple[Split, int]: ...

    def measured_step(self, step: int, ranked: float, whole: float, peak_gb: float,
                      fits: bool) -> tuple[bool, bool]: ...

    def on_watchdog(self, reason: str, step: int, rows: list[Any] | None, acting: bool) -> Plan: ...

    def train_ends(self, step: int, measuring: bool, continuing: bool) -> TunerEnd: ...


def format_summary(executor: Executor) -> str:
    """The end-of-run summary: the split and when it was decided (each decision's own line was printed when it was
    made, once; its detail is in the perf log and the report)."""
    decisions = executor.record.decisions
    steps = ", ".join(str(d.step) for d in decisions)
    n = len(decisions)
    recovered = [d.recovery_sec for d in decisions if d.recovery_sec is not None]
    extra = f"; recovered in {sum(recovered):.2f} s in all" if recovered else ""
    return "\n".join(["== AdaptiveBatchTuner summary ==",
                      f"split: {executor.split} after {n} decision{'s' if n != 1 else ''} (step{'s' if n != 1 else ''} "
                      f"{steps}){extra}; each one is in perf_log.jsonl and the report"])
