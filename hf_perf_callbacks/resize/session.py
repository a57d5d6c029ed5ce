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
the checkpoints this run      :attr:`~TuningSession.written`, each with the fingerprint of its files: a recovery
wrote                         resumes only from one whose fingerprint still matches and that holds the training
                              state (:meth:`~TuningSession.resumable`)
the RNG a checkpoint holds    :attr:`~TuningSession.next_rng`, noted by the tuner where transformers restores it
                              (:meth:`~TuningSession.note_rng`), written by the loop's saves
the session id                :attr:`~TuningSession.id`: the run in the perf log (the bus's session) and the split
                              file; kept across in-process re-sizes and resumes of the same run
the splits the run may use    :attr:`~TuningSession.exactness`, judged once at the start
                              (:meth:`~TuningSession.judge_grouping`); :meth:`~TuningSession.candidates` is every
                              reader's list (the tuning, the memory check, the OOM and watchdog re-sizes)
``tuner_split.json``          written by :meth:`~TuningSession.persist` only (main process, atomically)
============================  ================================================================================

:func:`~hf_perf_callbacks.train_with_tuning` creates one session per call (a resume adopts the recorded one when it
is this run's) and hands it to the trainer's bus; the :class:`~hf_perf_callbacks.AdaptiveBatchTuner` — also an
instance transformers rebuilt from a checkpoint — finds it there. Without ``train_with_tuning`` the tuner opens one
itself. No process-global registry, no reconciliation: every reader asks the session.
"""
from __future__ import annotations

import logging
import shutil
import time
import uuid
from typing import TYPE_CHECKING

from .. import adapter
from ..batching import Exactness, Split, exact_splits, exact_under
from ..device import is_main_process, rng_state, world_size
from ..splitfile import Decision, Restriction, SplitFile, WrittenCheckpoint, read_split_file
from .checkpoints import checkpoint_dir, fingerprint, has_training_state, hide, is_complete, switch_dir

if TYPE_CHECKING:
    from ..bus import RunBus
    from .tuning import OnRunTuning

logger = logging.getLogger("hf_perf_callbacks")


def current_split(args) -> Split:
    """The split a trainer's args hold (GRPO: with its ``steps_per_generation``)."""
    spg = getattr(args, "steps_per_generation", None) if hasattr(args, "num_generations") else None
    return Split(args.per_device_train_batch_size, args.gradient_accumulation_steps, spg)


def candidates(args, world: int) -> list[Split]:
    """Every split that keeps the run's effective batch (GRPO: and generation batch), largest micro-batch first;
    which of them keep its loss exact is :meth:`TuningSession.candidates`."""
    split = current_split(args)
    if hasattr(args, "num_generations"):
        return exact_splits(split.effective_batch(world), world, split.generation_batch(world), args.num_generations)
    return exact_splits(split.effective_batch(world), world)


class SwitchSplit(BaseException):
    """Raised at the begin of the optimizer step after the one where a switch was requested, before that step
    trains: :func:`~hf_perf_callbacks.train_with_tuning` catches it and resumes at the new split. A stop set by
    anything else at the requested step (a callback's ``should_training_stop``, early stopping, ``max_steps``) ends
    ``train()`` before that begin, so the user's stop wins. A ``BaseException``: the package's fault isolation and
    the user's ``except Exception`` let it through."""


class TuningSession:
    """See the module docstring."""

    def __init__(self, args, bus: RunBus | None = None, session_id: str | None = None):
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
        self.written: list[WrittenCheckpoint] = []
        self.saved_complete: set[int] = set()   # steps of the checkpoints the session saved itself (complete)
        self.ended: str | None = None
        self.managed = False                    # train_with_tuning drives the run (acts on switches)
        self.tuning: OnRunTuning | None = None  # the tuning on the run's own steps
        self.warned: set[str] = set()
        self.next_rng: tuple[int, tuple] | None = None   # (step, the RNG the step after it starts from)
        self.ran: Split | None = None           # the split of the last completed optimizer step
        self.gave_up = False                    # no smaller split fitted, or max_resizes were spent
        self.switch_steps: list[int] = []       # checkpoints written only to switch splits (removed when superseded)
        self.hidden: dict[int, str] = {}        # step → where a switch checkpoint was moved (out of checkpoint-*)
        self.exactness: Exactness | None = None  # the splits exact under the run's loss (judge_grouping)
        self.in_process = False                 # switches take effect by SwitchSplit (train_with_tuning, unsharded)
        self.switch_decision: Decision | None = None   # the decision of the pending switch (dropped if cancelled)
        self.resizes_left: int | None = None    # re-sizes forced by memory still allowed (train_with_tuning)
        self.step_log: adapter.StepLog | None = None   # the training loop's step log (train_with_tuning)
        if bus is not None:
            bus.tuning = self
            bus.pin_session(self.id)

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
            self.warn_once("grouping", self.exactness.message(every))
            self.persist()
        return self.exactness

    def candidates(self, args) -> list[Split]:
        """The splits the run may use: every split of its batch that keeps its loss exact (all of them before
        :meth:`judge_grouping` ran)."""
        every = candidates(args, self.world)
        return [s for s in every if self.exactness is None or self.exactness.allows(s) or s == self.split]

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
        decision = Decision(kind=kind, step=step, reason=reason, old=old or self.split, new=new, time=time.time(),
                            **details)
        self.decisions.append(decision)
        self.persist()
        if self.bus is not None:
            self.bus.event("tuner", "decision", decision.headline(), step=step, old_split=decision.old.as_args(),
                           new_split=decision.new.as_args(), cost_sec=decision.cost_sec,
                           expected_gain_sec=decision.expected_gain_sec)
        return decision

    def end_tuning(self, step: int, reason: str) -> None:
        """Stop the tuning on the run's steps now (memory ended it) at its baseline, and record it."""
        from .tuning import Finished

        if self.tuning is not None and self.tuning.done is None:
            self.tuning.done = Finished(self.tuning.baseline, reason)
            self.record_tuning(step)

    def record_tuning(self, step: int) -> Decision | None:
        """Record the finished tuning as one ``tune`` decision: every split measured, its cost and expected gain."""
        tuning = self.tuning
        if tuning is None or tuning.done is None or tuning.recorded:
            return None
        tuning.recorded = True
        return self.decide("tune", tuning.done.reason, tuning.done.split, step, old=tuning.start,
                           trials=tuning.trial_list(), cost_sec=tuning.cost,
                           expected_gain_sec=tuning.expected_gain_sec(step), planned_steps=tuning.planned,
                           rule=tuning.rule())

    @property
    def resizes(self) -> int:
        """Re-sizes forced by memory (out-of-memory errors and the watchdog's requests; not the tuning's trials that
        ran out of memory)."""
        return sum(d.kind in ("oom", "watchdog") and not d.trial for d in self.decisions)

    # ------------------------------------------------------------ the RNG a checkpoint holds
    def note_rng(self, step: int, epoch_start: bool = False) -> None:
        """Remember the RNG that the optimizer step after ``step`` starts from: what a checkpoint of ``step`` must
        hold for a resume to draw what the run drew. transformers restores a checkpoint's RNG where the next step's
        batches are fetched (mid-epoch) or before the epoch's data iterator is made (at an epoch's start), so it is
        taken at that point: at the begin of the epoch (``epoch_start``) or of the step, before a GRPO step's
        generation draws from it. The step's end is too early (an evaluation at that step may draw), and the moment
        of an out-of-memory error too late (the failing step drew already)."""
        if epoch_start or self.next_rng is None or self.next_rng[0] != step:
            self.next_rng = (step, rng_state())

    def rng_after(self, step: int) -> tuple | None:
        """The RNG to save in ``checkpoint-<step>`` (None: the step after it has not begun; the current one is
        right)."""
        return self.next_rng[1] if self.next_rng is not None and self.next_rng[0] == step else None

    # ------------------------------------------------------------ checkpoints
    def record_written(self, step: int) -> bool:
        """Record ``checkpoint-<step>`` as this run's, with its fingerprint, when it is complete (checked by the
        main process, which writes it; the other ranks take its word). True when recorded."""
        path = checkpoint_dir(self.output_dir, step)
        if is_main_process():
            if not is_complete(path, step):
                return False
            mark = fingerprint(path)
        else:
            mark = "written by the main process"
        self.written = [w for w in self.written if w.step != step] + [WrittenCheckpoint(step, mark)]
        self.hidden.pop(step, None)             # written again where transformers writes it
        self.persist()
        return True

    def location(self, step: int) -> str:
        """Where this run's checkpoint of ``step`` is: ``checkpoint-<step>``, or ``tuner_switch/checkpoint-<step>``
        for a switch checkpoint moved out of the rotation's way."""
        return self.hidden.get(step) or checkpoint_dir(self.output_dir, step)

    def hide(self, step: int) -> str:
        """Move the switch checkpoint of ``step`` out of the names transformers' rotation counts (main process; the
        other ranks take the same path)."""
        path = hide(self.output_dir, step) if is_main_process() else switch_dir(self.output_dir, step)
        self.hidden[step] = path
        return path

    def is_ours(self, step: int) -> bool:
        """Whether ``checkpoint-<step>`` is one this run wrote and its files are still the ones it wrote."""
        entry = next((w for w in self.written if w.step == step), None)
        if entry is None:
            return False
        if not is_main_process():
            return True
        path = self.location(step)
        return is_complete(path, step) and fingerprint(path) == entry.fingerprint

    def newest_ours(self, at_most: int) -> str | None:
        """The newest checkpoint this run wrote at a step ≤ ``at_most`` that is still there, unchanged, and holds the
        training state (rotation by ``save_total_limit`` may have removed older ones; another process may have
        replaced one; ``save_only_model`` leaves the weights alone)."""
        for entry in sorted(self.written, key=lambda w: -w.step):
            if entry.step <= at_most and self.is_ours(entry.step) and self.resumable(entry.step):
                return self.location(entry.step)
        return None

    def resumable(self, step: int) -> bool:
        """Whether ``checkpoint-<step>`` holds the optimizer and scheduler state: one the session saved (always
        complete), else as its files say (the main process, which wrote them; the other ranks, which cannot see
        them, go by ``save_only_model``, so that every rank decides alike)."""
        if step in self.saved_complete:
            return True
        if not is_main_process():
            return not self.args.save_only_model
        return has_training_state(self.location(step))

    def switched_at(self, step: int, wrote: bool) -> None:
        """A switch resumed from ``checkpoint-<step>`` (``wrote``: written for the switch, not by a save the run
        makes anyway). The newest such checkpoint stays as the run's fallback; older ones are removed."""
        keep = step if wrote or step in self.switch_steps else None
        self.drop_switch_checkpoints(keep)
        if keep is not None:
            self.switch_steps = [keep]

    def drop_switch_checkpoints(self, keep: int | None = None) -> None:
        """Remove the checkpoints written only for switches (main process; the run's own saves stay), but the one of
        step ``keep``."""
        steps = [s for s in self.switch_steps if s != keep]
        self.switch_steps = [s for s in self.switch_steps if s == keep]
        if not steps:
            return
        if is_main_process():
            for step in steps:
                shutil.rmtree(self.location(step), ignore_errors=True)
        for step in steps:
            self.hidden.pop(step, None)
        self.written = [w for w in self.written if w.step not in steps]
        self.persist()

    # ------------------------------------------------------------ the file
    def record(self) -> SplitFile:
        return SplitFile(session=self.id, world_size=self.world, configured=self.configured,
                         split=self.resume_split, written=list(self.written), decisions=list(self.decisions),
                         ended=self.ended, restricted=self.restriction())

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
        self.id, self.decisions, self.written = record.session, list(record.decisions), list(record.written)
        self.configured = record.configured
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


def recorded_session(output_dir: str, checkpoint: str | None) -> SplitFile | None:
    """The split file's record when it belongs to the run being resumed from ``checkpoint``: the checkpoint is one
    the record lists as written, with the same fingerprint (another run's record, or one whose checkpoint was
    rewritten since, is not adopted)."""
    record = read_split_file(output_dir)
    if record is None or checkpoint is None:
        return record if checkpoint is None else None
    from .checkpoints import step_of

    step = step_of(checkpoint)
    entry = record.checkpoint(step) if step is not None else None
    if entry is None or not is_complete(checkpoint, step):
        return None
    if is_main_process() and fingerprint(checkpoint) != entry.fingerprint:
        return None
    return record
