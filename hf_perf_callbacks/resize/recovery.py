"""Recovery: carries out the session's plans (:mod:`~hf_perf_callbacks.resize.plan`) on the trainer.

The session decides (a pure transition of its :class:`~hf_perf_callbacks.resize.plan.SplitState` returns a
:class:`~hf_perf_callbacks.resize.plan.Plan`); this module acts: it frees the failed step's memory, saves the
checkpoint a re-size resumes from through the run's :class:`~hf_perf_callbacks.resize.checkpoints.RunCheckpoints`
(verified complete, the whole training state, the RNG the next step starts from), carries what the training loop
holds into the resume, applies the new split, writes the user's resume message when the run ends, and commits the
plan's state. Each entry point is one transition of the session: the split file is written once, at its end.

==============================  ===================================================================================
entry point                     the event (called by :func:`~hf_perf_callbacks.train_with_tuning`)
==============================  ===================================================================================
:func:`after_train`             a ``train()`` call returned: finish, or the pending switch now (:func:`switch_now`)
:func:`recover_or_raise`        ``train()`` raised: an out-of-memory error a smaller split fixes re-sizes
                                (:func:`recover_from_oom`); anything else saves when it can and is raised
:func:`back_from`               a step fetched other rows than the run trains: back to an exact split, or end
:func:`end_run`                 the run ends with an error: the last completed step saved when it can, the message
:func:`evaluate_within_memory`  ``trainer.evaluate`` that halves its batch on an out-of-memory error
==============================  ===================================================================================
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import adapter
from ..batching import Split, is_grpo
from ..bus import EVENT_WIDTH, console_line
from ..device import error_line, is_main_process, is_oom_error, rng_state, set_rng_state, world_size
from ..keys import SPLIT_FILE
from ..memory import WallFacts
from . import plan as plans
from . import sharding
from .agreement import ResizeNeeded, recoverable
from .checkpoints import (
    add_training_state,
    checkpoint_dir,
    is_complete,
    move_aside,
    newest_complete,
    step_of,
    switch_dir,
)
from .oomsite import UnfixableOOM, unfixable_cause
from .plan import InexactResize, ReplayLost, RowsLost
from .release import free_memory
from .rowcheck import RowsDiffer
from .session import TuningSession, every_rank_here

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger("hf_perf_callbacks")


# ------------------------------------------------------------ the loop's events
def after_train(trainer: Trainer, session: TuningSession, switching: bool,
                in_optimizer_step: bool) -> tuple[bool, str | None]:
    """A ``train()`` call returned (``switching``: stopped by the pending switch): (True, None) when the run is done
    (a pending switch a stop came before is cancelled, the switch checkpoints removed), else (False, the checkpoint
    the switch resumes from)."""
    plan = plans.on_stop(session.snapshot(), switching)
    with session.transition():
        if plan.cancelled is not None:
            session.cancel_switch()                   # a stop at the switch's step came first: it wins
        if plan.action == "finish":
            session.drop_switch_checkpoints()
            return True, None
    try:
        return False, switch_now(trainer, session)
    except BaseException as error:               # Ctrl-C, SIGTERM or a failure while the switch saved
        end_run(trainer, session, error, in_optimizer_step, agreed=False)
        raise


def recover_or_raise(trainer: Trainer, session: TuningSession, error: BaseException, in_optimizer_step: bool,
                     sharded: str | None, max_resizes: int, memory: WallFacts | None) -> str | None:
    r"""What ``train()`` raised: an out-of-memory error a smaller split fixes re-sizes (returns the checkpoint to
    resume from, None: the start); anything else saves when it can and is raised (the bare ``raise``\ s re-raise
    ``error`` as it was: this runs inside its ``except``). ``memory``: the watchdog's facts of the memory wall."""
    if max_resizes > 0 and sharding.unagreed_oom(sharded, error):    # the others wait in a collective
        record_for_restart(session, trainer.state.global_step, error, sharded)
        raise
    if not isinstance(error, Exception) or not recoverable(error):
        if max_resizes > 0:
            end_run(trainer, session, error, in_optimizer_step)
        raise
    trial = session.in_trial          # the tuning's own trial: never a re-size the user counts
    if max_resizes == 0 and not trial:
        raise
    agreed = isinstance(error, ResizeNeeded)
    cause = unfixable_cause(error, trainer, error.site if isinstance(error, ResizeNeeded) else None, memory)
    if cause is not None:                    # no micro-batch fixes it: no re-size
        unfixable = UnfixableOOM(cause)
        end_run(trainer, session, unfixable, in_optimizer_step, agreed=agreed)
        raise unfixable from error
    if not trial and session.state.resizes_spent:
        end_run(trainer, session, error, in_optimizer_step, gave_up=True)
        raise RuntimeError(f"train_with_tuning gave up after {max_resizes} re-sizes{memory_causes(memory)}") from error
    if world_size() == 1 or agreed:          # several ranks: every one of them is here
        session.hold_rows(adapter.fetched_batches(error), trainer.state.global_step + 1)   # the failed step's rows
    try:
        return recover_from_oom(trainer, session, error, in_optimizer_step, trial)
    except InexactResize as inexact:         # smaller splits exist, none exact for this run: every rank agreed on it
        end_run(trainer, session, inexact, in_optimizer_step, agreed=agreed, gave_up=True)
        raise inexact from error
    except ValueError as none_left:          # no smaller exact split
        end_run(trainer, session, error, in_optimizer_step, gave_up=True)
        raise ValueError(f"{none_left}{memory_causes(memory)}") from error
    except (KeyboardInterrupt, SystemExit) as stopped:      # Ctrl-C or SIGTERM while the re-size saved: a stop
        end_run(trainer, session, stopped, in_optimizer_step, agreed=agreed)
        raise


def back_from(trainer: Trainer, session: TuningSession, differ: RowsDiffer) -> str | None:
    """A step fetched other rows than the run trains there: the run goes back (the checkpoint to resume from), or,
    when no split continues it exactly, saves and ends saying why."""
    try:
        return refuse_rows(trainer, session, differ)
    except InexactResize as inexact:
        end_run(trainer, session, inexact, gave_up=True)
        raise inexact from None


def memory_causes(facts: WallFacts | None) -> str:
    """What the watchdog knows presses on memory (another process, a leak), as a sentence to end a message with."""
    causes = facts.sentence() if facts is not None else ""
    return f" The memory wall, as the watchdog reads it: {causes}." if causes else ""


# ------------------------------------------------------------ the plans carried out
def switch_now(trainer: Trainer, session: TuningSession) -> str:
    """The pending switch, in this process: the step's checkpoint (a watchdog's re-size keeps it as a save of the
    run, and spends one of ``max_resizes``), the switch applied; returns the checkpoint to resume from."""
    plan = plans.on_switch(session.snapshot())
    step = trainer.state.global_step
    with session.transition():
        wrote = not session.checkpoints.is_ours(step)
        checkpoint = save_checkpoint(trainer, session, step, switch=plan.source == "switch")
        new = plan.new
        if new is not None:
            try:
                carry_loop(trainer, session, checkpoint, new)
            except adapter.CannotReplay as cannot:       # ended here, saved: no switch to a run that differs
                lost = replay_lost(trainer, session, step, new, cannot)
                session.cancel_switch()
                end_run(trainer, session, lost, gave_up=True)
                raise lost from None
        if not plan.spend:
            session.switched_at(step, wrote)
        if is_main_process():                    # a memory switch's decision said why already (printed once)
            why = "" if plan.spend else f" ({session.state.switch_reason.removeprefix(f'back to {new}: ')})"
            logger.warning("%s", console_line(f"[tuner] step {step}: {session.split} → {new}: resuming from "
                                              f"{os.path.basename(checkpoint)} in this process{why}", EVENT_WIDTH))
        resume_with_switch(trainer, session)
        session.commit(plan)
    return checkpoint


def recover_from_oom(trainer: Trainer, session: TuningSession, error: BaseException, in_optimizer_step: bool = False,
                     trial: bool = False) -> str | None:
    """An out-of-memory error at the trainer's step (``in_optimizer_step``: it struck inside ``optimizer.step``):
    the next split planned (:func:`~hf_perf_callbacks.resize.plan.on_oom`) and applied, recorded as an ``oom``
    decision; returns the checkpoint to resume from (None: the start). ValueError when no smaller split is left,
    :class:`InexactResize` when the smaller ones are not exact for this run. A split under trial that ran out of
    memory (``trial``) is left: the run goes on at the next candidate or the tuning baseline, the decision marked
    ``trial`` (no re-size: it spends none of ``max_resizes``, nor counts in ``tuner/resizes``)."""
    reason = f"out of memory: {error_line(error)[:160]}"
    old, tuning = session.split, session.tuning
    step = trainer.state.global_step
    with session.transition():
        trial_next = None
        if trial and tuning is not None:
            trial_next = tuning.failed(old, "out of memory", step)       # the next candidate, or back to the baseline
            if tuning.done is not None:
                session.record_tuning(step)
        plan = plans.on_oom(session.snapshot(), step, in_optimizer_step, trial=trial and tuning is not None,
                            trial_next=trial_next)
        if plan.error is not None:                 # gave up: no smaller split, or none exact
            raise plan.error
        new = plan.new
        assert new is not None, "a re-size plan names its split"
        if not plan.trial and tuning is not None and tuning.done is None:
            session.end_tuning(step, "out of memory ended the tuning")
        free_memory(trainer, session.warn_once)
        rewind_loop(session, step)
        checkpoint = _resume_point(trainer, session, plan, step, new, error)
        try:
            carry_loop(trainer, session, checkpoint, new)
        except adapter.CannotReplay as why:
            raise replay_lost(trainer, session, step, new, why) from None
        session.decide("oom", reason, new, step, old=old, checkpoint=checkpoint, trial=plan.trial)
        session.request_switch(new, reason)
        resume_with_switch(trainer, session)
        session.commit(plan)
    logger.warning("[tuner] step %d: resuming from %s with split %s (the decision above says why)", step,
                   os.path.basename(checkpoint) if checkpoint else "the start", new)
    return checkpoint


def _resume_point(trainer: Trainer, session: TuningSession, plan: plans.Plan, step: int, new: Split,
                  error: BaseException) -> str | None:
    """The checkpoint an out-of-memory re-size resumes from, as ``plan.source`` says: the newest this run wrote
    (the weights may be half-updated), the start, or this step's, saved now (the newest of this run when saving
    fails)."""
    save_only_model = bool(trainer.args.save_only_model)
    if plan.source == "newest":                                 # weights may be half-updated: go back
        checkpoint = session.checkpoints.newest_ours(step, save_only_model)
        if checkpoint is None:
            raise RuntimeError("out of memory inside optimizer.step before this run saved any complete "
                               "checkpoint: the weights may be half-updated, so the run cannot continue safely. "
                               f"Restart it with a smaller split ({new}) or set save_steps.") from error
        return checkpoint
    if plan.source == "start":                                  # nothing trained yet: start again
        return None
    wrote = not session.checkpoints.is_ours(step)               # weights and optimizer are at step N: keep them
    try:
        checkpoint = save_checkpoint(trainer, session, step, switch=plan.source == "switch")
        if plan.source == "switch":
            session.switched_at(step, wrote)
        return checkpoint
    except Exception as save_error:  # noqa: BLE001 - fall back to the newest complete one of this run
        fallback = session.checkpoints.newest_ours(step, save_only_model)
        if fallback is None:
            raise RuntimeError(f"out of memory at step {step}, and saving checkpoint-{step} failed too "
                               f"({type(save_error).__name__}: {save_error}); this run has no complete "
                               f"checkpoint to resume from") from error
        session.warn_once("fallback", f"saving checkpoint-{step} failed ({save_error}): resuming from "
                                      f"{fallback}; steps after it are trained again")
        return fallback


def refuse_rows(trainer: Trainer, session: TuningSession, differ: RowsDiffer) -> str | None:
    """The split in effect fetched other rows for a step than the unfaulted run trains (``differ``, found before
    the step trained): the split is not exact for this run (said once, never used again) and the run goes back
    — a split under trial to the tuning's next candidate or its baseline, any other to the split that fetched
    the unfaulted rows — from a checkpoint of the last completed step; returns it (None: the start).
    :class:`InexactResize` when the split that fetched the unfaulted rows is the one that differs (a resume at
    this step trains other rows at any split)."""
    step, bad, why = trainer.state.global_step, differ.split, str(differ)
    with session.transition():
        session.leave_out(bad, why, step)
        free_memory(trainer, session.warn_once)
        wrote = not session.checkpoints.is_ours(step)
        checkpoint = save_checkpoint(trainer, session, step, switch=True) if step > 0 else None
        tuning = session.tuning
        if session.in_trial and tuning is not None:
            new = tuning.failed(bad, "trains other rows", step)
            if tuning.done is not None:
                session.record_tuning(step)
        elif differ.expected is not None and differ.expected != bad:
            new = differ.expected
        else:
            raise RowsLost(f"{why}, and it is the split that trained the run: resuming at step {step} trains other "
                           f"rows than the run would have at any split. The run ends here rather than going on "
                           f"inexactly; ")
        if checkpoint is not None:
            session.switched_at(step, wrote)
        session.request_switch(new, why)
        resume_with_switch(trainer, session)
    if is_main_process():
        logger.warning("[tuner] step %d: %s → %s (the rows differ): resuming from %s in this process", step, bad,
                       new, os.path.basename(checkpoint) if checkpoint else "the start")
    return checkpoint


def record_for_restart(session: TuningSession, step: int, error: BaseException, kind: str | None = "fsdp") -> None:
    """An out-of-memory error at ``step`` under FSDP (or DeepSpeed: ``kind``) that the ranks could not agree on:
    record the next smaller exact split for the launcher's restart (the main process writes it) and say what
    happens; the caller re-raises."""
    plan = plans.on_restart(session.snapshot())
    with session.transition():
        checkpoint = session.checkpoints.newest_ours(step, bool(session.args.save_only_model))
        if plan.new is not None:
            reason = f"out of memory, not agreed inside the step: {error_line(error)[:160]}"
            session.decide("oom", reason, plan.new, step, checkpoint=checkpoint)
            session.request_switch(plan.new, reason)
    logger.error(sharding.restart_message(error, step, plan.new, checkpoint, session.exactness, kind))


def end_run(trainer: Trainer, session: TuningSession, error: BaseException, in_optimizer_step: bool = False,
            agreed: bool | None = None, gave_up: bool = False) -> None:
    """The run is about to end with ``error``: save its last completed optimizer step when it can
    (:func:`~hf_perf_callbacks.resize.plan.on_end` says whether), and say how to resume (as a log line and a note on
    the error). ``agreed``: every rank left the step together (default: the error is the agreement's).
    ``gave_up``: no smaller split fits, or the re-sizes are spent. The split file records why the run ended
    (``ended``) and the split to resume with (the session's ``resume_split``: after giving up, the last split that
    completed a step)."""
    output_dir = str(trainer.args.output_dir)
    step = trainer.state.global_step
    agreed = isinstance(error, ResizeNeeded) if agreed is None else agreed
    plan = plans.on_end(session.snapshot(), step, world_size(), agreed, in_optimizer_step, gave_up)
    checkpoint, why = None, plan.why
    with session.transition():
        session.commit(plan)
        if not why:
            try:
                free_memory(trainer, session.warn_once)
                rewind_loop(session, step)
                checkpoint = save_checkpoint(trainer, session, step)
            except (Exception, KeyboardInterrupt) as save_error:  # noqa: BLE001 - a second Ctrl-C too: say what is left
                why = f"saving failed: {type(save_error).__name__}: {error_line(save_error)[:160]}"
        if checkpoint is None:
            checkpoint = (session.checkpoints.newest_ours(step, bool(trainer.args.save_only_model))
                          or newest_complete(output_dir))
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
        session.end(message)
    logger.error("[tuner] %s", message)
    if hasattr(error, "add_note"):
        error.add_note(message)


# ------------------------------------------------------------ saving and resuming in this process
def save_checkpoint(trainer: Trainer, session: TuningSession, step: int, switch: bool = False) -> str:
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
    output_dir = str(trainer.args.output_dir)
    checkpoints = session.checkpoints
    path = checkpoint_dir(output_dir, step)
    main = is_main_process()             # under several ranks only the main process checks and moves folders
    ours = checkpoints.is_ours(step)
    there = (checkpoints.location(step) if ours and checkpoints.resumable(step, bool(trainer.args.save_only_model))
             else None)                                         # saved already, whole
    next_rng = session.rng_after(step)                          # the RNG the next step starts from
    step_log = session.step_log                                 # a callback raised before the step's log
    if session.bus is not None:                                 # the checkpoint's steps all have their line
        session.bus.complete_step(trainer.args, trainer.state, step_log.log_missed if step_log else None)
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
        return _whole_beside(session, step, target, path, switch)
    if not session.record_written(step, whole=True):
        moved = move_aside(path, "partial")
        raise RuntimeError(f"checkpoint-{step} came out incomplete (moved aside to {moved})")
    if session.loop_state is not None:
        session.loop_state.keep(step)
    if switch:
        try:
            return checkpoints.hide(step)
        except OSError as error:          # it stays where it is: rotation may count it, training goes on
            session.warn_once("hide-switch", f"could not move the switch checkpoint-{step} out of the "
                                             f"checkpoint names ({error})")
    return path


def _whole_beside(session: TuningSession, step: int, staged: str, path: str, switch: bool) -> str:
    """The whole save of ``step`` written in ``staged`` beside the user's ``path`` (:func:`save_checkpoint`): a
    switch's stays there; a recovery's or the run's end's training state joins the user's weights in ``path``."""
    main = is_main_process()
    if switch:
        if not session.checkpoints.record_copy(step):
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
    if not session.record_written(step, whole=True):
        raise RuntimeError(f"checkpoint-{step} is not complete after its training state was added")
    return path


def rewind_loop(session: TuningSession, step: int) -> None:
    """The run goes back to completed step ``step``: the tokens and FLOPs counted by a step left mid-way are
    taken back (the checkpoint of ``step`` and every later log count what an unfaulted run counts)."""
    if session.loop_state is not None:
        session.loop_state.rewind(step)


def carry_loop(trainer: Trainer, session: TuningSession, checkpoint: str | None, new: Split) -> None:
    """The next ``train()`` resumes from ``checkpoint`` at ``new``: what the loop held at that step is prepared
    for it (GRPO: the buffered completions re-split for ``new``). :class:`adapter.CannotReplay` when a GRPO
    step that replays buffered completions could not replay them."""
    if session.loop_state is None:
        return
    old, args = session.split, trainer.args
    every = (old.steps_per_generation * getattr(args, "num_iterations", 1)
             if old.steps_per_generation is not None else None)
    session.loop_state.carry(step_of(checkpoint) if checkpoint else None, old.micro_batch, old.grad_accum,
                             new.micro_batch, new.steps_per_generation, every)


def replay_lost(trainer: Trainer, session: TuningSession, step: int, new: Split,
                why: adapter.CannotReplay) -> ReplayLost:
    """The refusal of a re-size at ``step`` to ``new`` whose resume could not replay GRPO's buffered
    completions, with why and what to change."""
    args = trainer.args
    return ReplayLost(
        f"a re-size at step {step + 1} from {session.split} to {new}: that step trains completions generated at an "
        f"earlier step (num_iterations={getattr(args, 'num_iterations', 1)}, steps_per_generation="
        f"{getattr(args, 'steps_per_generation', None)}, gradient_accumulation_steps="
        f"{args.gradient_accumulation_steps}), and {why}; a resume would train other completions. The run ends here "
        f"rather than going on inexactly. Every optimizer step generates its own completions with num_iterations=1 "
        f"and steps_per_generation dividing gradient_accumulation_steps; to go on anyway at {new}, set "
        f"per_device_train_batch_size={new.micro_batch}, gradient_accumulation_steps={new.grad_accum} and "
        f"steps_per_generation={new.steps_per_generation} and ")


def resume_with_switch(trainer: Trainer, session: TuningSession) -> None:
    """Apply the pending switch to a trainer whose last train() ended, forget that train()'s state, free its
    memory."""
    session.take_switch(trainer)
    adapter.forget_last_train(trainer)
    sharding.release_engine(trainer)        # DeepSpeed: the next train() builds an engine for the new split
    free_memory(trainer, session.warn_once)
    if session.rows is not None:
        session.rows.switched()             # the new split's first fetch is checked before it trains


# ------------------------------------------------------------ evaluation
def evaluate_within_memory(trainer: Trainer, original: Callable[..., dict[str, float]],
                           session: TuningSession) -> Callable[..., dict[str, float]]:
    """``trainer.evaluate`` that never turns an evaluation OOM into a training re-size: the evaluation batch is
    halved and the evaluation retried; at batch 1 it is skipped with one warning (empty metrics). When the run
    needs the metric (``metric_for_best_model``, a plateau scheduler), a RuntimeError ends the run instead (saved
    first by the loop).
    Under several ranks an OOM in evaluation is raised as it is (the other ranks are inside a collective)."""

    def evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
        targs = trainer.args
        while True:
            drawn = rng_state()          # a new evaluation dataloader iterator draws from the global RNG
            try:
                return original(*args, **kwargs)
            except Exception as error:
                if world_size() > 1 or not is_oom_error(error):
                    raise
                error = error.with_traceback(None)
                set_rng_state(drawn)     # the retry draws what the failed attempt drew: the run's stream goes on
                batch = targs.per_device_eval_batch_size
                smaller = _smaller_eval_batch(targs, batch)
                free_memory(trainer, session.warn_once)
                if smaller is not None:
                    targs.per_device_eval_batch_size = smaller
                    session.warn_once(f"eval-{smaller}", f"evaluation ran out of memory at "
                                      f"per_device_eval_batch_size={batch}: retrying with {smaller}; the training "
                                      f"split is unchanged")
                    continue
                scheduler = str(getattr(targs, "lr_scheduler_type", ""))
                if getattr(targs, "metric_for_best_model", None) or "plateau" in scheduler or "greedy" in scheduler:
                    raise RuntimeError(f"evaluation does not fit even at per_device_eval_batch_size={batch} and "
                                       f"the run needs its metric (metric_for_best_model="
                                       f"{targs.metric_for_best_model!r}, lr_scheduler_type={scheduler}): lower the "
                                       f"evaluation's memory (shorter eval sequences, eval_accumulation_steps)"
                                       ) from error
                session.warn_once("eval-skip", f"evaluation ran out of memory even at "
                                  f"per_device_eval_batch_size={batch}: evaluations are skipped for this run; "
                                  f"training goes on at its split")
                return {}

    return evaluate


def _smaller_eval_batch(args: Any, batch: int) -> int | None:
    """Half the evaluation batch (GRPO: still whole groups of ``num_generations_eval`` completions), or None."""
    if is_grpo(args):
        group = getattr(args, "num_generations_eval", None) or args.num_generations
        for smaller in range(batch // 2, 0, -1):
            if (smaller * world_size()) % group == 0:
                return smaller
        return None
    return int(batch // 2) if batch > 1 else None
