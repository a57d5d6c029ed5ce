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

* a resume uses only a checkpoint this run wrote completely (:mod:`~hf_perf_callbacks.resize.checkpoints`);
* a split read from disk is applied only when exact for the run (:mod:`~hf_perf_callbacks.resize.splitfile`);
* every path that ends the run early saves the last completed optimizer step first when it can, and says how to
  resume;
* an OOM in evaluation never changes the training split: the evaluation batch is halved, or the evaluation skipped;
* a fault in the probe or in the recovery's own housekeeping is one warning, never the end of training;
* transformers' just-in-time SIGTERM checkpoint stays armed across in-process re-sizes; ``auto_find_batch_size``
  is refused.
"""
from __future__ import annotations

import logging
import os
import time

from .. import adapter
from ..batching import Split, next_smaller
from ..device import DeviceLayer, is_main_process, is_oom_error, training_device, world_size
from ..validation import check_number
from . import sharding
from .agreement import ResizeNeeded, guard_training_step, recoverable
from .callback import AdaptiveBatchTuner, apply_split, current_split, find_callback, hand_over
from .checkpoints import checkpoint_dir, is_complete, move_aside, newest_complete, newest_written, step_of
from .probe import run_probe
from .splitfile import SPLIT_FILE, read_record, run_geometry, split_for_run

logger = logging.getLogger("hf_perf_callbacks")


def train_with_tuning(trainer, resume_from_checkpoint: str | bool | None = None, probe: bool | None = None,
                      max_resizes: int = 8):
    """``trainer.train()`` that probes for the fastest fitting split and survives re-sizes and OOM.

    Args:
        resume_from_checkpoint: a ``checkpoint-N`` folder, ``True`` or ``"last"`` (the newest *complete* one in
            ``output_dir``), or None.
        probe: run the pre-flight probe (None: the tuner's ``probe`` setting; never on a resume).
        max_resizes: re-sizes allowed; 0 re-raises the first out-of-memory error as it is, with no side effects.

    Returns the last ``TrainOutput``. Raises the original error when it is not an out-of-memory error, or when no
    smaller exact split is left, after saving the last completed optimizer step when it can.
    """
    check_number("max_resizes", max_resizes, low=0, integer=True)
    if probe not in (None, True, False):
        raise ValueError(f"probe={probe!r} is not allowed: expected True, False or None (the tuner's setting)")
    if getattr(trainer.args, "auto_find_batch_size", False):
        raise ValueError("train_with_tuning: auto_find_batch_size=True is not allowed with the AdaptiveBatchTuner: "
                         "transformers would catch the out-of-memory error first and restart at step 0 with a "
                         "smaller, inexact batch. Set auto_find_batch_size=False; the tuner keeps the effective "
                         "batch exact.")
    tuner = find_callback(trainer, AdaptiveBatchTuner)
    if tuner is None:
        tuner = AdaptiveBatchTuner()
        trainer.add_callback(tuner)
    tuner.managed = True
    tuner.run_args = trainer.args
    hand_over(trainer.args, tuner)
    output_dir = trainer.args.output_dir
    resume_from_checkpoint = _checked_resume(resume_from_checkpoint, output_dir)
    split = None
    if resume_from_checkpoint:
        split = split_for_run(output_dir, **run_geometry(trainer.args, world_size()))
        record = read_record(output_dir) if split is not None else None
        if record:                                  # the split file's history reaches past the checkpoint's
            tuner.adopt(record.get("decisions"), record.get("session"), [])
            tuner.split = split
        step = step_of(resume_from_checkpoint)
        parent = os.path.dirname(os.path.normpath(resume_from_checkpoint))
        if step is not None and os.path.realpath(parent) == os.path.realpath(output_dir):
            tuner.record_written(output_dir, step)  # the base of this run: a valid fallback for a later OOM
    sharded = sharding.start(trainer, tuner)          # FSDP: no step guard, no probe; DeepSpeed: refused
    restore = guard_training_step(trainer) if sharded is None else (lambda: None)
    undo_evaluate = adapter.replace_method(trainer, "evaluate",
                                           lambda original: _evaluate_within_memory(trainer, original))
    resizes = 0
    try:
        if split is not None:
            apply_split(trainer, split)
        elif (tuner.probe if probe is None else probe) and not resume_from_checkpoint and not sharded:
            _probe_or_warn(trainer, tuner)
        while True:
            adapter.rearm_jit_checkpoint(trainer)
            try:
                output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - OOMs re-size, the rest is re-raised
                sharding.raise_oom(sharded, error)  # FSDP: the other ranks wait in FSDP's collectives
                tuner = _live(trainer, tuner)
                if max_resizes == 0 or not isinstance(error, Exception) or not recoverable(error):
                    if max_resizes > 0:
                        _save_before_raising(trainer, tuner, error)
                    raise
                if resizes >= max_resizes:
                    _save_before_raising(trainer, tuner, error)
                    raise RuntimeError(f"train_with_tuning gave up after {max_resizes} re-sizes") from error
                try:
                    resume_from_checkpoint = _recover_from_oom(trainer, tuner, error)
                except ValueError as none_left:          # no smaller exact split
                    _save_before_raising(trainer, tuner, error)
                    raise none_left from error
                resizes += 1
                continue
            tuner = _live(trainer, tuner)
            if tuner.planned_resize is None:
                return output
            if sharded == "fsdp":                         # a wrapped model cannot be prepared again in this process
                logger.warning(sharding.relaunch_message(output_dir, trainer.state.global_step, tuner.split))
                return output
            if resizes >= max_resizes:
                logger.warning("[tuner] the watchdog asked for a smaller micro-batch but max_resizes=%d re-sizes "
                               "are done: stopping at step %d (checkpoint saved)", max_resizes,
                               trainer.state.global_step)
                return output
            tuner.planned_resize["resized_at"] = time.time()
            resume_from_checkpoint = _save_verified(trainer, tuner, trainer.state.global_step)
            prepare_resume(trainer, tuner.split, tuner)
            resizes += 1
    finally:
        undo_evaluate()
        restore()


def _live(trainer, tuner: AdaptiveBatchTuner) -> AdaptiveBatchTuner:
    """The tuner in the trainer's list now (a resume with restore_callback_states_from_checkpoint rebuilt it)."""
    live = find_callback(trainer, AdaptiveBatchTuner) or tuner
    if live is not tuner:
        live.adopt(tuner.decisions, tuner.session, tuner.written)
        hand_over(trainer.args, live)
    live.managed = True
    return live


def _checked_resume(resume, output_dir: str) -> str | None:
    """The checkpoint to resume from: complete, or a clear error; ``True``/``"last"`` finds the newest complete one."""
    if resume is None or resume is False:
        return None
    if resume is True or resume == "last":
        found = newest_complete(output_dir)
        if found is None:
            logger.warning("[tuner] resume_from_checkpoint=%r: no complete checkpoint-N in %s; starting from the "
                           "beginning", resume, output_dir)
            return None
        resume = found
    if not isinstance(resume, str):
        raise ValueError(f"train_with_tuning: resume_from_checkpoint={resume!r} is not allowed: expected a "
                         f"checkpoint-N folder, True, 'last' or None")
    step = step_of(resume)
    if not is_complete(resume, step):
        raise ValueError(f"train_with_tuning: resume_from_checkpoint={resume!r} is not a complete checkpoint (no "
                         f"valid trainer_state.json for step {step}, a weights file missing, or transformers' "
                         f"in-progress marker left): pass an earlier checkpoint-N, or 'last' for the newest "
                         f"complete one")
    return resume


def _probe_or_warn(trainer, tuner: AdaptiveBatchTuner) -> None:
    """The probe; a failure of its own (a memory reading, an exchange) is one warning and the configured split."""
    configured = current_split(trainer.args)
    try:
        run_probe(trainer, tuner)
    except Exception as error:  # noqa: BLE001 - the probe is an optimisation, never a reason to stop
        apply_split(trainer, configured)
        tuner.split = configured
        tuner.warn_once("probe", f"the probe failed ({type(error).__name__}: {error}); training goes on at the "
                                 f"configured split {configured} without it")


def _free_memory(trainer, tuner: AdaptiveBatchTuner | None) -> None:
    """Drop the gradients and give the device's cached memory back (after an OOM, before a save or a resume). A
    failing cache clear is one warning (the tuner's, once; the logger's without a tuner), never the end of the
    run."""
    trainer.model.zero_grad(set_to_none=True)
    try:
        DeviceLayer(training_device()).empty_cache()
    except Exception as error:  # noqa: BLE001 - housekeeping: going on without it
        message = (f"emptying the device cache failed during recovery ({type(error).__name__}: {error}); going on "
                   f"without it")
        if tuner is not None:
            tuner.warn_once("emptying the device cache", message)
        else:
            logger.warning("[tuner] %s", message)


def _recover_from_oom(trainer, tuner: AdaptiveBatchTuner, error: BaseException) -> str | None:
    """Plan the next smaller split and the checkpoint to resume from (ValueError when no smaller split is left)."""
    reason = f"out of memory: {str(error).splitlines()[0][:160]}"
    old = tuner.split or current_split(trainer.args)
    new = next_smaller(old, tuner.candidates(trainer.args))
    step = trainer.state.global_step
    output_dir = trainer.args.output_dir
    _free_memory(trainer, tuner)
    if tuner.in_optimizer_step:                                     # weights may be half-updated: go back
        checkpoint = newest_written(output_dir, tuner.written, step)
        if checkpoint is None:
            raise RuntimeError("out of memory inside optimizer.step before this run saved any complete checkpoint: "
                               "the weights may be half-updated, so the run cannot continue safely. Restart it "
                               f"with a smaller split ({new}) or set save_steps.") from error
    elif step == 0:
        checkpoint = None                                           # nothing trained yet: start again
    else:                                                           # weights and optimizer are at step N: keep them
        try:
            checkpoint = _save_verified(trainer, tuner, step)
        except Exception as save_error:  # noqa: BLE001 - fall back to the newest complete one of this run
            checkpoint = newest_written(output_dir, tuner.written, step)
            if checkpoint is None:
                raise RuntimeError(f"out of memory at step {step}, and saving checkpoint-{step} failed too "
                                   f"({type(save_error).__name__}: {save_error}); this run has no complete "
                                   f"checkpoint to resume from") from error
            tuner.warn_once("fallback", f"saving checkpoint-{step} failed ({save_error}): resuming from "
                                        f"{checkpoint}; steps after it are trained again")
    decision = tuner.decide("oom", reason, old, new, step)
    decision["resized_at"] = time.time()
    decision["checkpoint"] = checkpoint
    prepare_resume(trainer, new, tuner)
    logger.warning("[tuner] %s at step %d: resuming from %s with split %s", reason, step, checkpoint or "the start",
                   new)
    return checkpoint


def _save_verified(trainer, tuner: AdaptiveBatchTuner, step: int) -> str:
    """``checkpoint-<step>`` written by this run and verified complete. A folder of that name that this run did not
    write (an earlier run's, or a partial one) is moved aside first; a save that fails or comes out incomplete is
    moved aside too, and the error raised."""
    output_dir = trainer.args.output_dir
    path = checkpoint_dir(output_dir, step)
    main = is_main_process()             # under several ranks only the main process checks and moves folders
    if step in tuner.written and (not main or is_complete(path, step)):
        return path
    if main and os.path.exists(path):
        why = "stale" if is_complete(path, step) else "partial"
        moved = move_aside(path, why)
        if moved is None:
            raise RuntimeError(f"{path} is in the way (not written by this run) and could not be moved aside")
        logger.warning("[tuner] %s was not written by this run (%s): moved aside to %s", path,
                       "an earlier run's" if why == "stale" else "incomplete", moved)
    try:
        adapter.save_checkpoint(trainer)
    except BaseException:
        if main and os.path.exists(path):
            move_aside(path, "partial")
        raise
    if not tuner.record_written(output_dir, step):
        moved = move_aside(path, "partial")
        raise RuntimeError(f"checkpoint-{step} came out incomplete (moved aside to {moved})")
    return path


def _save_before_raising(trainer, tuner: AdaptiveBatchTuner, error: BaseException) -> None:
    """The run is about to end with ``error``: save its last completed optimizer step when it can, and say how to
    resume (as a log line and a note on the error)."""
    output_dir = trainer.args.output_dir
    step = trainer.state.global_step
    checkpoint, why = None, ""
    if world_size() > 1 and not isinstance(error, ResizeNeeded):
        why = "other ranks may be inside a collective, so no rank can save now"
    elif tuner.in_optimizer_step:
        why = "it struck inside optimizer.step, so the weights may be half-updated"
    elif step == 0:
        why = "no optimizer step was completed"
    else:
        try:
            _free_memory(trainer, tuner)
            checkpoint = _save_verified(trainer, tuner, step)
        except Exception as save_error:  # noqa: BLE001
            why = f"saving failed: {type(save_error).__name__}: {save_error}"
    if checkpoint is None:
        checkpoint = newest_written(output_dir, tuner.written, step) or newest_complete(output_dir)
        saved = (f"checkpoint-{step} was not saved ({why}); the newest complete checkpoint is "
                 f"{checkpoint or 'none'}")
    else:
        saved = f"saved {checkpoint} (the last completed optimizer step, {step})"
    resume = (f"resume with train_with_tuning(trainer, resume_from_checkpoint={checkpoint!r}) (the split in "
              f"{os.path.join(output_dir, SPLIT_FILE)} is applied when it fits)" if checkpoint
              else "the run must start again")
    message = f"training ended at step {step} by {type(error).__name__}: {str(error)[:160]}; {saved}; {resume}"
    logger.error("[tuner] %s", message)
    if hasattr(error, "add_note"):
        error.add_note(message)


def _evaluate_within_memory(trainer, original):
    """``trainer.evaluate`` that never turns an evaluation OOM into a training re-size: the evaluation batch is
    halved and the evaluation retried; at batch 1 it is skipped with one warning (empty metrics). When the run
    needs the metric (``metric_for_best_model``, a plateau scheduler), a RuntimeError ends the run instead (saved
    first by the loop).
    Under several ranks an OOM in evaluation is raised as it is (the other ranks are inside a collective)."""

    def evaluate(*args, **kwargs):
        targs = trainer.args
        while True:
            try:
                return original(*args, **kwargs)
            except Exception as error:  # noqa: BLE001
                if world_size() > 1 or not is_oom_error(error):
                    raise
                tuner = find_callback(trainer, AdaptiveBatchTuner)
                warn = tuner.warn_once if tuner is not None else (lambda key, message: logger.warning(message))
                error = error.with_traceback(None)
                _free_memory(trainer, tuner)
                batch = targs.per_device_eval_batch_size
                smaller = _smaller_eval_batch(targs, batch)
                if smaller is not None:
                    targs.per_device_eval_batch_size = smaller
                    warn(f"eval-{smaller}", f"evaluation ran out of memory at per_device_eval_batch_size={batch}: "
                                            f"retrying with {smaller}; the training split is unchanged")
                    continue
                scheduler = str(getattr(targs, "lr_scheduler_type", ""))
                if getattr(targs, "metric_for_best_model", None) or "plateau" in scheduler or "greedy" in scheduler:
                    raise RuntimeError(f"evaluation does not fit even at per_device_eval_batch_size={batch} and "
                                       f"the run needs its metric (metric_for_best_model="
                                       f"{targs.metric_for_best_model!r}, lr_scheduler_type={scheduler}): lower the "
                                       f"evaluation's memory (shorter eval sequences, eval_accumulation_steps)"
                                       ) from error
                warn("eval-skip", f"evaluation ran out of memory even at per_device_eval_batch_size={batch}: "
                                  f"evaluations are skipped for this run; training goes on at its split")
                return {}

    return evaluate


def _smaller_eval_batch(args, batch: int) -> int | None:
    """Half the evaluation batch (GRPO: still whole groups of ``num_generations_eval`` completions), or None."""
    if hasattr(args, "num_generations"):
        group = getattr(args, "num_generations_eval", None) or args.num_generations
        for smaller in range(batch // 2, 0, -1):
            if (smaller * world_size()) % group == 0:
                return smaller
        return None
    return batch // 2 if batch > 1 else None


def prepare_resume(trainer, split: Split, tuner: AdaptiveBatchTuner) -> None:
    """Apply the split to a trainer whose last train() ended, forget that train()'s state, free its memory."""
    apply_split(trainer, split)
    adapter.forget_last_train(trainer)
    _free_memory(trainer, tuner)
