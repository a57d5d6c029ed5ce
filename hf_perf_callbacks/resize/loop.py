"""train_with_tuning: ``trainer.train()`` that survives re-sizes and out-of-memory errors, and loses no step.

The Hugging Face loop cannot change the dataloader's batch size mid-run, and changing gradient accumulation alone
skews epoch geometry, the LR horizon and GRPO's sampler. What works is **checkpoint → resume with a new split**
(same effective batch and, for GRPO, the same generation batch), in the same process. Every change — the watchdog's
request for a smaller micro-batch, a recognised out-of-memory error, a tuning trial — is carried out by the
:class:`~hf_perf_callbacks.resize.executor.Executor`: planned, staged, **checked at the step it starts with, on that
step's rows, before it trains** (:mod:`~hf_perf_callbacks.resize.exactness`), and committed once; a change the check
refuses goes back to the split that trains those rows, or ends the run saved. Under several ranks every micro-batch
finishes on every rank before gradients are exchanged and the ranks agree on OOMs first
(:mod:`~hf_perf_callbacks.resize.agreement`), so an OOM anywhere in one rank's step re-sizes every rank together.

Guarantees (each with a fault-injection test in ``tests/test_faults.py`` or ``tests/test_exactness.py``; docs/tuning.md,
"What a re-size guarantees", words each one): no trace when nothing changes; a split is used only once the step it
starts with showed it trains what the old split would have (:mod:`~hf_perf_callbacks.resize.exactness`); a resume
only from a checkpoint this run wrote completely, holding the whole training state
(:mod:`~hf_perf_callbacks.resize.checkpoints`); the loop's own state goes on as unfaulted
(:class:`~hf_perf_callbacks.platform.adapter.LoopState`; else :class:`~.plan.ReplayLost`); an OOM no smaller
micro-batch fixes ends the run saved, named (:mod:`~hf_perf_callbacks.resize.oomsite`); every early end saves the last
completed step when it can and says how to resume; a user's weights-only checkpoint is never written over nor moved;
another stop at a switch's step wins (:class:`~hf_perf_callbacks.resize.executor.SwitchSplit`); the tuning's trials
never spend ``max_resizes`` nor push the user's checkpoints out of ``save_total_limit``; an OOM in evaluation never
changes the training split (:mod:`~hf_perf_callbacks.resize.evaluation`); a fault of the memory check or of the
recovery's housekeeping is one warning; transformers' SIGTERM checkpoint stays armed; ``auto_find_batch_size`` is
refused.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, cast

from ..common.bus import bus_for
from ..core.validation import check_flag, check_number, suggest_keywords
from ..platform import adapter
from ..platform.device import DeviceLayer, is_main_process, rng_state, set_rng_state, training_device
from . import memcheck
from .callback import AdaptiveBatchTuner, find_callback
from .evaluation import evaluate_within_memory
from .executor import Executor, SwitchSplit
from .watch import ChangeRefused

if TYPE_CHECKING:
    import torch
    from transformers import Trainer
    from transformers.trainer_utils import TrainOutput

    from ..common.bus import RunBus

logger = logging.getLogger("hf_perf_callbacks")


@suggest_keywords
def train_with_tuning(trainer: Trainer, resume_from_checkpoint: str | bool | None = None, tune: bool | None = None,
                      max_resizes: int = 8) -> TrainOutput:
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
    check_flag("tune", tune, allow_none=True)
    if getattr(trainer.args, "auto_find_batch_size", False):
        raise ValueError("train_with_tuning: auto_find_batch_size=True is not allowed with the AdaptiveBatchTuner: "
                         "transformers would catch the out-of-memory error first and restart at step 0 with a "
                         "smaller, inexact batch. Set auto_find_batch_size=False; the tuner keeps the effective "
                         "batch exact.")
    tuner = find_callback(trainer, AdaptiveBatchTuner)
    if tuner is None:
        tuner = AdaptiveBatchTuner()
        trainer.add_callback(tuner)
    output_dir = str(trainer.args.output_dir)
    bus = bus_for(trainer.callback_handler)
    bus.output_lock.watch_trainer(trainer)
    if is_main_process():
        bus.output_lock.hold(output_dir)                 # another process there: refused before anything is written
    try:
        return _train(trainer, tuner, bus, resume_from_checkpoint, tune, max_resizes)
    finally:
        bus.output_lock.unhold()


def _train(trainer: Trainer, tuner: AdaptiveBatchTuner, bus: RunBus, resume_from_checkpoint: str | bool | None,
           tune: bool | None, max_resizes: int) -> TrainOutput:
    executor = Executor(trainer.args, bus=bus, managed=True, accept_unmeasured=tuner.accept_unmeasured)
    resume_from_checkpoint, sharded, guard = executor.take_run(trainer, resume_from_checkpoint, max_resizes)
    eval_batch = trainer.args.per_device_eval_batch_size
    undo_evaluate = adapter.replace_method(
        trainer, "evaluate", lambda original: evaluate_within_memory(trainer, original, executor.warn_once,
                                                                      executor.grpo))
    undo_restore = adapter.restore_converted_weights(trainer, lambda message: executor.warn_once("converted",
                                                                                                  message))
    try:
        _before_training(trainer, executor, tuner, tune, resumed=bool(resume_from_checkpoint), sharded=sharded)
        start_rng = rng_state()              # every in-process resume starts from it, as a new process would
        resized = False                      # from the first re-size on, the resumes are the package's own
        while True:
            adapter.rearm_jit_checkpoint(trainer)
            if guard is not None:
                guard.arm()                          # after a start and every change (FSDP: off once stable)
            switching: bool | None = False       # None: train() failed, and its recovery gave the resume
            try:
                with adapter.fsdp2_prepared_again(trainer), adapter.fsdp2_optimizer_state_restored(trainer), (
                        adapter.own_resume() if resized else contextlib.nullcontext()):
                    output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            except SwitchSplit:                           # the step after a switch's step began: switch now
                switching = True
            except ChangeRefused as refusal:              # a change's first step differs from the run's: back
                resume_from_checkpoint = executor.refused(refusal)
                switching = None
            except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - OOMs re-size, recover raises the rest
                resume_from_checkpoint = executor.recover(error, tuner.in_optimizer_step, bus.memory_facts)
                switching = None
            if switching is not None:
                finished, resume_from_checkpoint = executor.after_train(switching, tuner.in_optimizer_step)
                if finished:
                    return output
            resized = True
            set_rng_state(start_rng)
    finally:
        undo_restore()
        undo_evaluate()
        trainer.args.per_device_eval_batch_size = eval_batch     # an evaluation OOM shrank it for this run only
        if guard is not None:
            guard.remove()
        executor.close(trainer)


def _before_training(trainer: Trainer, executor: Executor, tuner: AdaptiveBatchTuner, tune: bool | None,
                     resumed: bool, sharded: str | None) -> None:
    """The splits the run's rules allow, the memory check (a fresh unsharded start) and the tuning on the run's own
    steps (unless sharded, or the run's record holds a tuning decision)."""
    check = None
    if not resumed and not sharded and memcheck.wanted(tuner.memory_check, DeviceLayer(training_device()).type):
        def check() -> None:
            memcheck.check_or_warn(trainer, executor, clock=tuner.clock, force=tuner.memory_check is True)
    wants_tuning = tuner.tune if tune is None else tune
    model = cast("torch.nn.Module", trainer.model)          # None only before the trainer's init
    max_steps = trainer.args.max_steps
    settings = (dict(planned=max_steps if max_steps and max_steps > 0 else None,
                     state_bytes=_training_state_bytes(model), max_micro_batch=tuner.max_micro_batch,
                     samples=tuner.samples, max_rounds=tuner.max_rounds, patience=tuner.patience,
                     must_pay=tuner.must_pay, rank_by=tuner.rank_by, first_samples=tuner.first_samples)
                if wants_tuning and not sharded else None)
    executor.prepare(trainer, check, settings)


def _training_state_bytes(model: torch.nn.Module) -> float:
    """What a switch's checkpoint writes and reads: the saved weights (a PEFT model's adapter only, else every
    weight) and Adam's two moments of every trainable weight."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = trainable if hasattr(model, "peft_config") else sum(p.numel() * p.element_size()
                                                                  for p in model.parameters())
    return float(weights + 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad))
