"""train_with_tuning: ``trainer.train()`` that survives re-sizes and out-of-memory errors.

The Hugging Face loop cannot change the dataloader's batch size mid-run, and changing gradient accumulation alone
skews epoch geometry, the LR horizon and GRPO's sampler. What works is **checkpoint → resume with a new split**
(same effective batch and, for GRPO, the same generation batch). On the watchdog's request for a smaller
micro-batch, or a recognised out-of-memory error, the loop saves a checkpoint (or falls back to the last one if the
error struck inside ``optimizer.step``), switches to the next smaller exact split and resumes in the same process.
Under several ranks every micro-batch finishes on every rank before gradients are exchanged and the ranks agree on
OOMs first (:mod:`~hf_perf_callbacks.resize.agreement`), so an OOM anywhere in one rank's step re-sizes every rank
together.
"""
from __future__ import annotations

import logging
import os
import time

from transformers.trainer_utils import get_last_checkpoint

from .. import adapter
from ..batching import Split, next_smaller
from ..device import DeviceLayer, training_device
from ..validation import check_number
from . import sharding
from .agreement import guard_training_step, recoverable
from .callback import AdaptiveBatchTuner, apply_split, current_split, find_callback, saved_split
from .probe import run_probe

logger = logging.getLogger("hf_perf_callbacks")


def train_with_tuning(trainer, resume_from_checkpoint: str | bool | None = None, probe: bool | None = None,
                      max_resizes: int = 8):
    """``trainer.train()`` that probes for the fastest fitting split and survives re-sizes and OOM.

    Returns the last ``TrainOutput``. Raises the original error when it is not an out-of-memory error, or when no
    smaller exact split is left.
    """
    check_number("max_resizes", max_resizes, low=0, integer=True)
    if probe not in (None, True, False):
        raise ValueError(f"probe={probe!r} is not allowed: expected True, False or None (the tuner's setting)")
    tuner = find_callback(trainer, AdaptiveBatchTuner)
    if tuner is None:
        tuner = AdaptiveBatchTuner()
        trainer.add_callback(tuner)
    tuner.managed = True
    tuner.run_args = trainer.args
    output_dir = trainer.args.output_dir
    if resume_from_checkpoint is True or resume_from_checkpoint == "last":
        resume_from_checkpoint = get_last_checkpoint(output_dir)
    saved = saved_split(output_dir) if resume_from_checkpoint else None
    started = time.time()
    sharded = sharding.start(trainer, tuner)          # FSDP: no step guard, no probe; DeepSpeed: refused
    restore = guard_training_step(trainer) if sharded is None else (lambda: None)
    try:
        if saved:
            apply_split(trainer, Split(saved["per_device_train_batch_size"], saved["gradient_accumulation_steps"],
                                       saved.get("steps_per_generation")))
        elif (tuner.config["probe"] if probe is None else probe) and not resume_from_checkpoint and not sharded:
            run_probe(trainer, tuner)
        for _ in range(max_resizes + 1):
            try:
                output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            except Exception as error:  # noqa: BLE001 - only OOMs are handled, the rest is re-raised
                sharding.raise_oom(sharded, error)
                if not recoverable(error):
                    raise
                tuner = find_callback(trainer, AdaptiveBatchTuner) or tuner
                resume_from_checkpoint = _recover_from_oom(trainer, tuner, error, started)
                continue
            # a resumed run with restore_callback_states_from_checkpoint holds a new tuner instance
            tuner = find_callback(trainer, AdaptiveBatchTuner) or tuner
            tuner.managed = True
            if tuner.planned_resize is None:
                return output
            if sharded == "fsdp":                         # a wrapped model cannot be prepared again in this process
                logger.warning(sharding.relaunch_message(output_dir, trainer.state.global_step, tuner.split))
                return output
            tuner.planned_resize["resized_at"] = time.time()
            resume_from_checkpoint = os.path.join(output_dir, f"checkpoint-{trainer.state.global_step}")
            prepare_resume(trainer, tuner.split)
        raise RuntimeError(f"train_with_tuning gave up after {max_resizes} re-sizes")
    finally:
        restore()


def _recover_from_oom(trainer, tuner: AdaptiveBatchTuner, error: BaseException, started: float) -> str | None:
    reason = f"out of memory: {str(error).splitlines()[0][:160]}"
    old = tuner.split or current_split(trainer.args)
    try:
        new = next_smaller(old, tuner.candidates(trainer.args))
    except ValueError as none_left:
        raise none_left from error
    step = trainer.state.global_step
    inside_optimizer = tuner.in_optimizer_step
    trainer.model.zero_grad(set_to_none=True)
    DeviceLayer(training_device()).empty_cache()                    # room to save the checkpoint
    if inside_optimizer:                                            # weights may be half-updated: go back
        checkpoint = _checkpoint_of_this_run(trainer.args.output_dir, started, step)
        if checkpoint is None:
            raise RuntimeError("out of memory inside optimizer.step before this run saved any checkpoint: the "
                               "weights may be half-updated, so the run cannot continue safely. Restart it with a "
                               f"smaller split ({new}) or set save_steps.") from error
    elif step == 0:
        checkpoint = None                                           # nothing trained yet: start again
    else:                                                           # weights and optimizer are at step N: keep them
        checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
        if not os.path.isdir(checkpoint):
            adapter.save_checkpoint(trainer)
    decision = tuner.decide("oom", reason, old, new, step)
    decision["resized_at"] = time.time()
    decision["checkpoint"] = checkpoint
    prepare_resume(trainer, new)
    logger.warning("[tuner] %s at step %d: resuming from %s with split %s", reason, step, checkpoint or "the start",
                   new)
    return checkpoint


def _checkpoint_of_this_run(output_dir: str, started: float, step: int) -> str | None:
    """The newest checkpoint written since ``started`` at a step ≤ ``step`` (never a stale one of an earlier run)."""
    checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is None or os.path.getmtime(checkpoint) < started:
        return None
    return checkpoint if int(checkpoint.rsplit("-", 1)[-1]) <= step else None


def prepare_resume(trainer, split: Split) -> None:
    """Apply the split to a trainer whose last train() ended, forget that train()'s state, give cached memory back."""
    apply_split(trainer, split)
    adapter.forget_last_train(trainer)
    DeviceLayer(training_device()).empty_cache()
