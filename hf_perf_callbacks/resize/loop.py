"""train_with_tuning: ``trainer.train()`` that survives re-sizes and out-of-memory errors, and loses no step.

The Hugging Face loop cannot change the dataloader's batch size mid-run, and changing gradient accumulation alone
skews epoch geometry, the LR horizon and GRPO's sampler. What works is **checkpoint → resume with a new split**
(same effective batch and, for GRPO, the same generation batch). On the watchdog's request for a smaller
micro-batch, or a recognised out-of-memory error, the loop saves a checkpoint (or falls back to the last one this
run wrote if the error struck inside ``optimizer.step``), switches to the next smaller exact split and resumes in
the same process. Under several ranks every micro-batch finishes on every rank before gradients are exchanged and
the ranks agree on OOMs first (:mod:`~hf_perf_callbacks.resize.agreement`), so an OOM anywhere in one rank's step
re-sizes every rank together.

Guarantees (each has a fault-injection test in ``tests/test_faults.py``):

* a resume uses only a checkpoint this run wrote completely (:mod:`~hf_perf_callbacks.resize.checkpoints`); the
  loop's own saves hold the whole training state whatever ``save_only_model`` says, and the RNG the next step
  starts from (:meth:`~hf_perf_callbacks.resize.session.TuningSession.note_rng`), so a re-size trains what the run
  would have trained without it;
* what the training loop holds between steps goes on as unfaulted (:class:`~hf_perf_callbacks.adapter.LoopState`):
  the tokens and FLOPs of a step left mid-way are taken back, a resumed ``train()`` logs the loss window the
  unfaulted run logs, and a GRPO step that replays buffered completions replays the same ones, re-split for the new
  micro-batch (or the re-size is refused before it changes anything: :class:`~.session.ReplayLost`);
* an OOM no smaller micro-batch fixes (generation, a reward function: :mod:`~hf_perf_callbacks.resize.oomsite`) is
  not re-sized: the run saves and ends with its cause and fix;
* a split read from disk is applied only when exact for the run (:mod:`~hf_perf_callbacks.resize.splitfile`);
* every path that ends the run early saves the last completed optimizer step first when it can, and says how to
  resume — also Ctrl-C or SIGTERM while the loop writes its own checkpoint (a re-size's, a switch's), and an OOM no
  exact smaller split fixes that every rank agreed on (:class:`~hf_perf_callbacks.resize.session.InexactResize`);
* a user's own ``checkpoint-N`` saved with the weights alone is never written over nor moved by a switch's save;
* a re-size and the tuning use only splits under which the run's loss stays what it is at the configured split
  (:meth:`~hf_perf_callbacks.resize.session.TuningSession.judge_grouping`; said once at the start when some are left
  out); an OOM with no smaller such split saves and ends with why and what makes every split exact;
* a stop from anything but the tuner (a callback, early stopping, ``max_steps``) ends the run at its step, also at
  the step where the tuner asked for a switch: a switch takes effect only when the next step begins
  (:class:`~hf_perf_callbacks.resize.session.SwitchSplit`);
* the tuning's own trials never spend ``max_resizes``: a trial split that runs out of memory is left and the run goes
  on (also with ``max_resizes=0``); their checkpoints never push the user's out of ``save_total_limit``; a run that
  ends mid-trial leaves ``args``, the split file and the decision at the split the tuning kept;
* an OOM in evaluation never changes the training split: the evaluation batch is halved (the RNG put back before
  the retry, the batch size put back when the run ends), or the evaluation skipped;
* a step whose callback raised in ``on_step_end`` still gets its training log (loss, gradient norm, learning rate)
  before the checkpoint that ends the run is saved;
* a fault in the memory check or in the recovery's own housekeeping is one warning, never the end of training;
* transformers' just-in-time SIGTERM checkpoint stays armed across in-process re-sizes; ``auto_find_batch_size``
  is refused.
"""
from __future__ import annotations

import contextlib
import logging

from .. import adapter
from ..batching import is_grpo
from ..bus import bus_for
from ..device import (
    DeviceLayer,
    is_main_process,
    is_oom_error,
    rng_state,
    set_rng_state,
    training_device,
    world_size,
)
from ..validation import check_number, suggest_keywords
from . import memcheck, sharding
from .agreement import ResizeNeeded, StepGuard, guard_training_step, recoverable
from .callback import AdaptiveBatchTuner, find_callback
from .checkpoints import resume_point
from .oomsite import UnfixableOOM, unfixable_cause
from .rowcheck import RowsDiffer
from .session import InexactResize, SwitchSplit, TuningSession

logger = logging.getLogger("hf_perf_callbacks")


@suggest_keywords
def train_with_tuning(trainer, resume_from_checkpoint: str | bool | None = None, tune: bool | None = None,
                      max_resizes: int = 8):
    """``trainer.train()`` that keeps the fastest exact split that fits, measured on the run's own steps, and
    survives re-sizes and out-of-memory errors.

    Args:
        resume_from_checkpoint: a ``checkpoint-N`` folder, ``True`` or ``"last"`` (the newest *complete* one in
            ``output_dir``), or None.
        tune: measure other splits on the run's steps (None: the tuner's ``tune`` setting; a resume does not tune
            again when the run's record holds a tuning decision).
        max_resizes: re-sizes forced by memory allowed; 0 re-raises the first out-of-memory error as it is, with
            no side effects.

    Returns the last ``TrainOutput``. Raises the original error when it is not an out-of-memory error, or when no
    smaller exact split is left, after saving the last completed optimizer step when it can.
    """
    check_number("max_resizes", max_resizes, low=0, integer=True)
    if tune not in (None, True, False):
        raise ValueError(f"tune={tune!r} is not allowed: expected True, False or None (the tuner's setting)")
    if getattr(trainer.args, "auto_find_batch_size", False):
        raise ValueError("train_with_tuning: auto_find_batch_size=True is not allowed with the AdaptiveBatchTuner: "
                         "transformers would catch the out-of-memory error first and restart at step 0 with a "
                         "smaller, inexact batch. Set auto_find_batch_size=False; the tuner keeps the effective "
                         "batch exact.")
    tuner = find_callback(trainer, AdaptiveBatchTuner)
    if tuner is None:
        tuner = AdaptiveBatchTuner()
        trainer.add_callback(tuner)
    output_dir = trainer.args.output_dir
    bus = bus_for(trainer.callback_handler)
    bus.watch_trainer(trainer)
    if is_main_process():
        bus.hold(output_dir)                 # another process there: refused before anything is written
    try:
        return _train(trainer, tuner, bus, resume_from_checkpoint, tune, max_resizes)
    finally:
        bus.unhold()


def _train(trainer, tuner: AdaptiveBatchTuner, bus, resume_from_checkpoint, tune: bool | None, max_resizes: int):
    resume_from_checkpoint = resume_point(resume_from_checkpoint, trainer.args.output_dir,
                                          restarts=sharding.restarted_by_launcher())
    session = TuningSession(trainer.args, bus=bus, managed=True)
    sharded, guard = _start(trainer, session, resume_from_checkpoint, max_resizes)
    eval_batch = trainer.args.per_device_eval_batch_size
    undo_evaluate = adapter.replace_method(trainer, "evaluate",
                                           lambda original: _evaluate_within_memory(trainer, original, session))
    try:
        _before_training(trainer, session, tuner, tune, resumed=bool(resume_from_checkpoint), sharded=sharded)
        start_rng = rng_state()              # every in-process resume starts from it, as a new process would
        resized = False                      # from the first re-size on, the resumes are the package's own
        while True:
            adapter.rearm_jit_checkpoint(trainer)
            if guard is not None:
                guard.arm()                          # after a start and every change (FSDP: off once stable)
            switching = False
            try:
                with adapter.fsdp2_prepared_again(trainer), adapter.fsdp2_optimizer_state_restored(trainer), (
                        adapter.own_resume() if resized else contextlib.nullcontext()):
                    output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            except SwitchSplit:                           # the step after a switch's step began: switch now
                switching = True
            except RowsDiffer as differ:                  # a step fetched other rows than the run trains: back
                resume_from_checkpoint = _back_from(trainer, session, differ)
                resized = True
                set_rng_state(start_rng)
                continue
            except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - OOMs re-size, _recover_or_raise raises the rest
                resume_from_checkpoint = _recover_or_raise(trainer, session, tuner, error, sharded, max_resizes)
                resized = True
                set_rng_state(start_rng)
                continue
            if not switching and session.switch is not None and session.in_process:
                session.cancel_switch()                   # a stop at the switch's step came first: it wins
            if session.switch is None:
                session.drop_switch_checkpoints()
                return output
            try:
                resume_from_checkpoint = session.switch_now(trainer)
            except BaseException as error:               # Ctrl-C, SIGTERM or a failure while the switch saved
                session.end_run(trainer, error, tuner.in_optimizer_step, agreed=False)
                raise
            resized = True
            set_rng_state(start_rng)
    finally:
        undo_evaluate()
        trainer.args.per_device_eval_batch_size = eval_batch     # an evaluation OOM shrank it for this run only
        if guard is not None:
            guard.remove()
        session.close(trainer)


def _start(trainer, session: TuningSession, checkpoint: str | None,
           max_resizes: int) -> tuple[str | None, StepGuard | None]:
    """The session takes the run (a resume from ``checkpoint`` continues the run's record); returns the trainer's
    sharding (FSDP, DeepSpeed: no tuning) and the step guard (FSDP: off once stable; none where it cannot see the
    sharding's collectives: DeepSpeed)."""
    sharded, guarded = sharding.start(trainer, session)
    session.drive(in_process=sharded is None,        # a switch takes effect at the next step's begin
                  max_resizes=max_resizes, step_log=adapter.StepLog(trainer), loop_state=adapter.LoopState(trainer))
    if checkpoint:
        session.resume_from(trainer, checkpoint)
    if not guarded:
        return sharded, None
    return sharded, guard_training_step(trainer, sharding.STABLE_STEPS if sharded else None, notify=session.note)


def _before_training(trainer, session: TuningSession, tuner: AdaptiveBatchTuner, tune: bool | None, resumed: bool,
                     sharded: str | None) -> None:
    """The splits exact under the run's loss, the memory check (a fresh unsharded start) and the tuning on the
    run's own steps (unless sharded, or the run's record holds a tuning decision)."""
    session.judge_grouping(trainer, planned_steps(trainer))
    session.apply_recorded(trainer)          # a resume's recorded split, when exact for this run
    session.check_rows(trainer)
    if not resumed and not sharded:
        device = DeviceLayer(training_device())
        if memcheck.wanted(tuner.memory_check, device.type):
            _check_memory_or_warn(trainer, session, tuner)
    wants_tuning = tuner.tune if tune is None else tune
    if wants_tuning and not sharded and not any(d.kind == "tune" for d in session.decisions):
        planned, state_bytes = planned_steps(trainer), _training_state_bytes(trainer.model)
        session.start_tuning(planned, state_bytes, max_micro_batch=tuner.max_micro_batch,  # at the split the check left
                             samples=tuner.samples, max_rounds=tuner.max_rounds, patience=tuner.patience,
                             must_pay=tuner.must_pay, rank_by=tuner.rank_by, first_samples=tuner.first_samples)


def _recover_or_raise(trainer, session: TuningSession, tuner: AdaptiveBatchTuner, error: BaseException,
                      sharded: str | None, max_resizes: int) -> str | None:
    r"""What ``train()`` raised: an out-of-memory error a smaller split fixes re-sizes (returns the checkpoint to
    resume from, None: the start); anything else saves when it can and is raised (the bare ``raise``\ s re-raise
    ``error`` as it was, this runs inside its ``except``)."""
    if max_resizes > 0 and sharding.unagreed_oom(sharded, error):    # the others wait in a collective
        session.record_for_restart(trainer.state.global_step, error, sharded)
        raise
    if not isinstance(error, Exception) or not recoverable(error):
        if max_resizes > 0:
            session.end_run(trainer, error, tuner.in_optimizer_step)
        raise
    trial = session.in_trial          # the tuning's own trial: never a re-size the user counts
    if max_resizes == 0 and not trial:
        raise
    cause = unfixable_cause(error, trainer, error.site if isinstance(error, ResizeNeeded) else None,
                            _memory_facts(session))
    if cause is not None:                    # no micro-batch fixes it: no re-size
        unfixable = UnfixableOOM(cause)
        session.end_run(trainer, unfixable, tuner.in_optimizer_step, agreed=isinstance(error, ResizeNeeded))
        raise unfixable from error
    if not trial and session.resizes_spent:
        session.end_run(trainer, error, tuner.in_optimizer_step, gave_up=True)
        raise RuntimeError(f"train_with_tuning gave up after {max_resizes} re-sizes"
                           f"{_memory_causes(session)}") from error
    if world_size() == 1 or isinstance(error, ResizeNeeded):     # several ranks: every one of them is here
        session.hold_rows(adapter.fetched_batches(error), trainer.state.global_step + 1)   # the failed step's rows
    try:
        checkpoint = session.recover_from_oom(trainer, error, tuner.in_optimizer_step, trial)
    except InexactResize as inexact:         # smaller splits exist, none exact for this run: every rank agreed on it
        session.end_run(trainer, inexact, tuner.in_optimizer_step, agreed=isinstance(error, ResizeNeeded),
                        gave_up=True)
        raise inexact from error
    except ValueError as none_left:          # no smaller exact split
        session.end_run(trainer, error, tuner.in_optimizer_step, gave_up=True)
        raise ValueError(f"{none_left}{_memory_causes(session)}") from error
    except (KeyboardInterrupt, SystemExit) as stopped:      # Ctrl-C or SIGTERM while the re-size saved: a stop
        session.end_run(trainer, stopped, tuner.in_optimizer_step, agreed=isinstance(error, ResizeNeeded))
        raise
    if not trial:
        session.spend_resize()
    return checkpoint


def _back_from(trainer, session: TuningSession, differ: RowsDiffer) -> str | None:
    """A step fetched other rows than the run trains there: the run goes back (the checkpoint to resume from), or,
    when no split continues it exactly, saves and ends saying why."""
    try:
        return session.refuse_rows(trainer, differ)
    except InexactResize as inexact:
        session.end_run(trainer, inexact, gave_up=True)
        raise inexact from None


def _memory_facts(session: TuningSession):
    """The watchdog's facts of the memory wall (:class:`~hf_perf_callbacks.memory.WallFacts`), when it is attached."""
    return session.bus.memory_facts if session.bus is not None else None


def _memory_causes(session: TuningSession) -> str:
    """What the watchdog knows presses on memory (another process, a leak), as a sentence to end a message with."""
    facts = _memory_facts(session)
    causes = facts.sentence() if facts is not None else ""
    return f" The memory wall, as the watchdog reads it: {causes}." if causes else ""


def _training_state_bytes(model) -> float:
    """What a switch's checkpoint writes and reads: the saved weights (a PEFT model's adapter only, else every
    weight) and Adam's two moments of every trainable weight."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = trainable if hasattr(model, "peft_config") else sum(p.numel() * p.element_size()
                                                                  for p in model.parameters())
    return float(weights + 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad))


def planned_steps(trainer) -> int | None:
    """Optimizer steps the run will take: ``max_steps``, else epochs × steps per epoch (as the Trainer counts
    them); None when the dataloader has no length."""
    import math

    args = trainer.args
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    state = rng_state()                  # building the dataloader may draw from the RNG: put it back
    try:
        batches = len(trainer.get_train_dataloader())
    except (TypeError, ValueError, NotImplementedError):
        return None
    finally:
        set_rng_state(state)
    accum = args.gradient_accumulation_steps
    per_epoch = max(batches // accum + int(batches % accum > 0), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


def _check_memory_or_warn(trainer, session: TuningSession, tuner: AdaptiveBatchTuner) -> None:
    """The memory check; a failure of its own (a memory reading, an exchange) is one warning and the configured
    split."""
    configured = session.split
    try:
        memcheck.check_memory(trainer, session, session.candidates(trainer.args), clock=tuner.clock,
                              force=tuner.memory_check is True)
    except Exception as error:  # noqa: BLE001 - the check is a safety net, never a reason to stop
        session.apply(trainer, configured)
        session.warn_once("memory-check", f"the memory check failed ({type(error).__name__}: {error}); training "
                                          f"goes on at the configured split {configured} without it")


def _evaluate_within_memory(trainer, original, session: TuningSession):
    """``trainer.evaluate`` that never turns an evaluation OOM into a training re-size: the evaluation batch is
    halved and the evaluation retried; at batch 1 it is skipped with one warning (empty metrics). When the run
    needs the metric (``metric_for_best_model``, a plateau scheduler), a RuntimeError ends the run instead (saved
    first by the loop).
    Under several ranks an OOM in evaluation is raised as it is (the other ranks are inside a collective)."""

    def evaluate(*args, **kwargs):
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
                session.free_memory(trainer)
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


def _smaller_eval_batch(args, batch: int) -> int | None:
    """Half the evaluation batch (GRPO: still whole groups of ``num_generations_eval`` completions), or None."""
    if is_grpo(args):
        group = getattr(args, "num_generations_eval", None) or args.num_generations
        for smaller in range(batch // 2, 0, -1):
            if (smaller * world_size()) % group == 0:
                return smaller
        return None
    return batch // 2 if batch > 1 else None
