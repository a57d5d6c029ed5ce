"""The one place that touches private or undocumented parts of transformers, TRL, accelerate and torch.

Everything else in the package uses documented API. Each internal below has a test in ``tests/test_adapter.py``
that names it and fails with a clear message when a library version renames it.

================================================  ==============================================================
internal                                          why there is no public route
================================================  ==============================================================
the ``CallbackHandler`` and the ``Trainer`` on    a callback passed through ``callbacks=[...]`` is never handed
the call stack (``sys._getframe``)                the trainer or its handler (only transformers' own JIT
                                                  checkpoint callback gets ``set_trainer``); the bus must run
                                                  before the reporters (the handler's list) and release the
                                                  output-dir lock when ``train()`` ends, by an error too; the
                                                  tuner reads the run's loss facts from the trainer
``ProgressCallback.training_bar``                 the tqdm bar has no API for a postfix from another callback
``Trainer._train_batch_size``                     ``train()`` builds its dataloader from this copy, not from
                                                  ``args``; a re-size must set both
``Trainer._save_checkpoint``                      the only way to write a complete resumable checkpoint
                                                  (weights, optimizer, scheduler, RNG, state) on demand; it reads
                                                  ``args.save_only_model`` (set aside for that call)
``TrainerState.stateful_callbacks`` as            it indexes ``stateful_callbacks[name]`` for every
``Trainer._save_checkpoint`` reads it             ``ExportableState`` callback; a state loaded from a checkpoint
                                                  written without one has no entry for it, so the next save of a
                                                  resume that attached it raises ``KeyError`` (transformers 5.24;
                                                  ``EarlyStoppingCallback`` too): the entries are added first
``trainer.training_step`` (instance attribute)    the step is the unit the cross-rank agreement guards; no hook
                                                  runs around a whole micro-batch
``Trainer._load_from_checkpoint`` (instance        transformers 5.24 loads a resumed checkpoint non-strictly and
attribute)                                        without its weight conversion: a mixture of experts' router and
                                                  experts stay at their initial values; the resume is completed
                                                  (:func:`restore_converted_weights`)
``trainer.evaluate`` (instance attribute)         an evaluation OOM must be retried with a smaller evaluation
                                                  batch inside ``train()``; no hook runs around an evaluation
``Trainer._loss_shifts_labels``                   whether the model's loss shifts its labels (a causal language
                                                  model): with left padding, the first token of a padded row is
                                                  then a target; transformers decides it from the loss mapping
``Trainer._get_grad_norm``,                       the step's gradient norm and learning rate are locals of the
``Trainer._get_learning_rate``,                   training loop, logged after ``on_step_end``: a step whose
``Trainer._maybe_log_save_evaluate``,             callback raised there never logs them; a recovery logs them
``Trainer._tr_loss``,                             through the trainer's own logging before it saves the step
``Trainer._globalstep_last_logged``
``Trainer.current_flos``, ``Trainer._tr_loss``,   what the training loop holds between optimizer steps and no
``Trainer._globalstep_last_logged``,              checkpoint keeps: a step left mid-way by an OOM has counted its
``Trainer._total_loss_scalar``, TRL               first micro-batches' tokens and FLOPs, and a resume starts the
``GRPOTrainer._step``, ``_buffered_inputs``,      loss window and GRPO's generation buffer afresh
``_metrics``                                      (:class:`LoopState` takes them back and carries them over);
                                                  the last ``train()``'s survive into the next: a resume starts
                                                  clean (:func:`forget_last_train`)
TRL ``_metrics``, ``_total_train_tokens``        the metrics TRL's ``compute_loss`` adds to on every call (SFT,
(SFT, DPO, GRPO)                                  DPO: the tokens trained so far): the exactness check's passes
                                                  are no training, and take back what they added
``JITCheckpointCallback.jit_manager``             its ``on_train_end`` restores the old SIGTERM handler and only
(``setup_signal_handler``)                        ``Trainer.__init__`` installs it: the next in-process
                                                  ``train()`` of a re-size would run without it
``model.generate`` (instance attribute)           no hook reports the start and end of a generation
TRL ``GRPOTrainer._generate``,                    TRL's generation entry points (instance attributes): no hook
``_calculate_rewards``, ``vllm_generation``'s     reports a rollout, a weight sync to vLLM or the reward
``sync_weights`` and ``generate``, its            functions; under vLLM ``model.generate`` is never called; the
``vllm_client.generate`` and ``llm.generate``     engine call itself (the server's HTTP request, the colocated
                                                  engine's ``generate``) is what a rollout's engine time is
TRL ``AsyncGRPOTrainer._sync_weight``,            async GRPO's weight transfer to the server, the training step's
``_rollout_dataset.wait_s``,                      wait for the rollout queue and the tokens it trained, as TRL
``_step_trained_tokens``, ``rollout_worker``'s    itself measures them for its own ``perf/*`` and ``batch/*``
``start``, ``StepIntervalCallback.fn``            logs, read at the step's end before TRL resets them; the
                                                  periodic sync is the bound method TRL's callback holds
``OptimizedModule._orig_mod`` (torch.compile)     the compiled wrapper hides the DDP module it compiles
``torch.distributed`` collectives, process-wide   TRL's reward and metric gathers run through accelerate into
                                                  these functions; no hook runs before a collective of the
                                                  default group (DDP comm hooks see only gradient buckets)
FSDP2's iteration state (torch < 2.13, where      an OOM that aborted FSDP2's forward or backward leaves
``FSDPModule.reset_iter_state`` does not exist)   parameters unsharded and per-iteration trackers set; torch
                                                  2.13 resets them publicly, older releases only by hand
``FullyShardedDataParallelPlugin`` as             accelerate wraps a model for FSDP2 in ``prepare`` only; a
``Accelerator.prepare`` reads it                  second ``train()`` in one process prepares the wrapped model
                                                  again and fails looking up its layer classes by name (FSDP2
                                                  renamed them ``FSDP<Layer>``) or checkpoints them twice
``Trainer._load_optimizer_and_scheduler``,         accelerate < 1.13 resumes an FSDP2 optimizer from a sharded
accelerate's ``_prepare_sd_options``              checkpoint without its state (momentum, Adam moments); the
                                                  state is loaded again as accelerate 1.13 loads it
the ``transformers.trainer_utils`` logger         a resume compares the arguments with the checkpoint's
(``compare_trainer_and_checkpoint_args``)         ``trainer_state.json`` and logs a changed batch size as a
                                                  mismatch; the package's own re-size changes it on purpose
                                                  (and says so in its own line): filtered during those resumes
``Trainer.get_batch_samples`` (instance            the micro-batches of an optimizer step are fetched there,
attribute)                                        before ``on_step_begin``; no hook sees them before the step
                                                  trains (the check of a change at the step it starts with, only
                                                  while a change is pending or just applied)
TRL ``GRPOTrainer._prepare_inputs`` (instance     GRPO's trained rows exist only once its ``_prepare_inputs``
attribute), ``_buffered_inputs``, ``_step``,      generated them, inside the step's first ``training_step``: the
``_current_train_step_time``                      check of a change reads the step's buffered completions there,
                                                  and its passes train them as they are handed over
the training loop's ``batch_samples`` local       an out-of-memory error leaves the loop with the failed step's
(``Trainer._run_epoch``, older:                   micro-batches fetched; the error's traceback is the only route
``_inner_training_loop``)                         to them (the reference of the re-size's row-stream check)
warnings during the package's own resumes         TRL's generation context and peft read transformers'
(:data:`SHOWN_BEFORE_A_RESIZE`)                   deprecated checkpointing methods at every generation;
                                                  Python shows a warning once per code location only until the
                                                  filters change, and transformers changes them at every
                                                  checkpoint save and load (``warnings.catch_warnings`` around
                                                  ``torch.save``/``torch.load``): each re-size showed it again
================================================  ==============================================================
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
from transformers.trainer_callback import CallbackHandler, ExportableState, ProgressCallback, TrainerCallback

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments


# ---------------------------------------------------------------- the callback handler
def calling_handler() -> CallbackHandler | None:
    """The ``CallbackHandler`` dispatching the current event (the ``self`` of a ``call_event`` frame), if any."""
    return _self_on_stack(CallbackHandler)


def calling_trainer() -> Trainer | None:
    """The ``transformers.Trainer`` whose method is running on the call stack (its ``__init__`` or ``train``), if
    any."""
    from transformers import Trainer

    return _self_on_stack(Trainer)


_T = TypeVar("_T")


def _self_on_stack(cls: type[_T]) -> _T | None:
    """The innermost ``self`` on the call stack that is a ``cls``, if any."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back
    return None


def all_callbacks(handler: CallbackHandler | None) -> list[Any]:     # TrainerCallbacks, read duck-typed by the bus
    """The handler's callbacks, all of them also while :func:`time_callbacks` dispatches an event to one at a time."""
    if handler is None:
        return []
    return list(handler.__dict__.get("_hf_perf_all_callbacks") or handler.callbacks)


def progress_bars(handler: CallbackHandler | None) -> list[Any]:   # tqdm bars (tqdm has no types)
    """The tqdm training bars of the handler's progress callbacks (empty outside training or without tqdm)."""
    return [callback.training_bar for callback in all_callbacks(handler)
            if isinstance(callback, ProgressCallback) and getattr(callback, "training_bar", None) is not None]


def console_printers(handler: CallbackHandler | None) -> list[TrainerCallback]:
    """The callbacks that print each training log on the console: transformers' ``ProgressCallback`` (tqdm),
    ``PrinterCallback`` (``disable_tqdm``) and ``NotebookProgressCallback`` (Jupyter), subclasses included."""
    return [cb for cb in all_callbacks(handler) if isinstance(cb, _printer_kinds())]


@functools.cache
def _printer_kinds() -> tuple[type[TrainerCallback], ...]:
    """The printers' classes, looked up once a process: without IPython, importing transformers' notebook module
    fails, and a failed import runs the module again at every attempt (milliseconds a training log)."""
    from transformers.trainer_callback import PrinterCallback

    kinds: tuple[type[TrainerCallback], ...] = (ProgressCallback, PrinterCallback)
    try:
        from transformers.utils.notebook import NotebookProgressCallback
        kinds += (NotebookProgressCallback,)
    except ImportError:                                 # no IPython: no notebook printer either
        pass
    return kinds


# ---------------------------------------------------------------- trainer state between train() calls
def set_train_batch_size(trainer: Trainer) -> None:
    """Make the next ``train()`` build its dataloader from ``args.per_device_train_batch_size``."""
    trainer._train_batch_size = trainer.args.train_batch_size


def train_batch_size(trainer: Trainer) -> int:
    """The per-device batch size the next ``train()`` builds its dataloader with."""
    return trainer._train_batch_size


def loss_shifts_labels(trainer: Trainer) -> bool:
    """Whether the trainer's model computes a causal language-model loss (labels shifted by one), as transformers
    decided it at the trainer's init."""
    return trainer._loss_shifts_labels


class StepLog:
    """What the training loop logs for an optimizer step after ``on_step_end`` (its gradient norm and learning rate,
    locals of the loop): recorded as the loop computes them, so that a step whose ``on_step_end`` raised can still
    log them (:meth:`log_missed`). ``undo`` removes the recording."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.grad_norm: tuple[int, torch.Tensor | float | None] | None = None   # (the step it belongs to, the value)
        self.learning_rate: tuple[int, float] | None = None
        self.undos = [replace_method(trainer, "_get_grad_norm", self._recording("grad_norm")),
                      replace_method(trainer, "_get_learning_rate", self._recording("learning_rate"))]

    def _recording(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def record(*args: Any, **kwargs: Any) -> Any:
                value = original(*args, **kwargs)
                setattr(self, name, (self.trainer.state.global_step + 1, value))   # before the step counts
                return value
            return record
        return make

    def undo(self) -> None:
        for undo in self.undos:
            undo()

    def log_missed(self) -> None:
        """Log the last optimizer step as the training loop would have, when it was due (``control.should_log``) and
        not logged (a callback raised in ``on_step_end``)."""
        trainer = self.trainer
        step, control = trainer.state.global_step, trainer.control
        if not control.should_log or step <= getattr(trainer, "_globalstep_last_logged", step):
            return
        grad_norm = self.grad_norm[1] if self.grad_norm and self.grad_norm[0] == step else None
        rate = self.learning_rate[1] if self.learning_rate and self.learning_rate[0] == step else None
        evaluate, save = control.should_evaluate, control.should_save
        control.should_evaluate = control.should_save = False
        try:
            trainer._maybe_log_save_evaluate(trainer._tr_loss, grad_norm, trainer.model_wrapped, None,
                                             trainer.state.epoch, None,
                                             None,    # type: ignore[arg-type]  # start_time: log() takes None
                                             learning_rate=rate)
        finally:
            control.should_evaluate, control.should_save = evaluate, save


def save_checkpoint(trainer: Trainer, rotate: bool = True, run_dir: str | None = None) -> None:
    """Write ``checkpoint-<global_step>`` now, as the Trainer does at a save step, and a complete one whenever there
    is training state (weights, optimizer, scheduler, scaler, RNG), also under ``save_only_model=True``, from which a
    resume would restart the schedule and the optimizer silently. ``rotate=False``: ``save_total_limit`` deletes no
    checkpoint for this save (one written only to switch splits must not push the user's out). ``run_dir``: written
    there instead of ``output_dir``, with no rotation and the best model's checkpoint left as it was, so that a
    ``checkpoint-<global_step>`` of the user's is never written over."""
    register_stateful_callbacks(trainer.state, trainer.callback_handler.callbacks + [trainer.control])
    args, state = trainer.args, trainer.state
    only_model, limit, output_dir, best = (args.save_only_model, args.save_total_limit, args.output_dir,
                                           state.best_model_checkpoint)
    args.save_only_model = only_model and trainer.optimizer is None
    if not rotate or run_dir is not None:
        args.save_total_limit = None            # transformers' rotation would count this save as one of the user's
    if run_dir is not None:
        args.output_dir = run_dir
    try:
        trainer._save_checkpoint(cast(torch.nn.Module, trainer.model), trial=None)   # None only before init
    finally:
        args.save_only_model, args.save_total_limit, args.output_dir = only_model, limit, output_dir
        if run_dir is not None:
            state.best_model_checkpoint = best


def register_stateful_callbacks(state: TrainerState, callbacks: Iterable[object]) -> None:
    """Give every ``ExportableState`` in ``callbacks`` that has none an entry in ``state.stateful_callbacks`` (its
    current ``state()``; a list for several instances of one class, as ``TrainerState`` builds it for a fresh run),
    so that ``Trainer._save_checkpoint`` finds one for each."""
    entries = getattr(state, "stateful_callbacks", None)
    if not isinstance(entries, dict):
        return
    missing: dict[str, list[dict[str, Any]]] = {}
    for callback in callbacks:
        name = type(callback).__name__
        if isinstance(callback, ExportableState) and name not in entries:
            missing.setdefault(name, []).append(callback.state())
    for name, states in missing.items():
        entries[name] = states[0] if len(states) == 1 else states


@contextlib.contextmanager
def metrics_kept(trainer: Trainer) -> Iterator[None]:
    """What TRL's ``compute_loss`` adds to on every call (``_metrics``, ``_total_train_tokens``) is put back when the
    block ends: calls that train nothing (the exactness check) leave the logged figures as they were."""
    metrics = getattr(trainer, "_metrics", None)
    kept = ({mode: {k: list(v) for k, v in values.items()} for mode, values in metrics.items()}
            if isinstance(metrics, dict) else None)
    tokens = getattr(trainer, "_total_train_tokens", None)
    try:
        yield
    finally:
        if kept is not None and isinstance(metrics, dict):
            for mode, values in kept.items():
                metrics[mode].clear()
                metrics[mode].update(values)
        if tokens is not None:
            trainer._total_train_tokens = tokens      # type: ignore[attr-defined]  # TRL's trainers only


def forget_last_train(trainer: Trainer) -> None:
    """Drop what the last ``train()`` left behind (its optimizer, scheduler and wrapper are restored from the
    checkpoint by a resume), the gradients, and TRL's generation buffer and metric accumulators."""
    trainer.optimizer, trainer.lr_scheduler = None, None
    model = cast(torch.nn.Module, trainer.model)             # None only before the trainer's init
    trainer.model_wrapped = model
    model.zero_grad(set_to_none=True)
    for name, value in (("_step", 0), ("_buffered_inputs", None)):
        if hasattr(trainer, name):
            setattr(trainer, name, value)
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict):
        for per_mode in metrics.values():
            per_mode.clear()


class CannotReplay(ValueError):
    """A resume would not train the buffered GRPO completions the step it resumes at replays (the reason)."""


#: keys of a GRPO batch whose rows are not one per completion (images): such a buffer is not re-split
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids", "pixel_attention_mask", "spatial_shapes",
              "image_sizes", "num_images")


@dataclasses.dataclass
class _Noted:
    """The training loop's state between two optimizer steps (after ``step``, before the next one)."""

    step: int
    tokens: int                       # state.num_input_tokens_seen
    flos: float                       # state.total_flos + trainer.current_flos
    loss: torch.Tensor                # the loss accumulated since the last log (a copy)
    last_logged: int                  # the step of the last training log
    micro_steps: int | None = None    # GRPO: micro-batches since its counter started (TRL's ``_step``)
    buffer: list[dict[str, Any]] | None = None    # GRPO: the buffered generation, one dict per micro-batch of it
    metrics: dict[str, list[Any]] | None = None   # GRPO: the metrics gathered since the last log (copies of the lists)


@dataclasses.dataclass
class _Carry:
    noted: _Noted
    micro_steps: int | None
    buffer: list[dict[str, Any]] | None


class LoopState:
    """What the training loop holds between optimizer steps and no checkpoint keeps whole (:class:`_Noted`).

    Noted at every step's begin (:meth:`note`) and at every save of transformers (:meth:`note_save`): a step left
    mid-way takes back what its first micro-batches counted (:meth:`rewind`), and a resume in this process goes on
    with the same logging windows and, in a step that replays buffered completions, the same completions re-split
    for the new micro-batch (:meth:`carry`, then :meth:`install` at the resumed ``train()``'s begin)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.noted: _Noted | None = None          # at the begin of the step after noted.step
        self.saved: _Noted | None = None          # at transformers' newest save
        self.pending: _Carry | None = None        # what the next train() takes over

    def _now(self) -> _Noted:
        trainer = self.trainer
        state = trainer.state
        metrics = getattr(trainer, "_metrics", None)
        train = metrics.get("train") if isinstance(metrics, dict) else None
        return _Noted(step=state.global_step, tokens=state.num_input_tokens_seen,
                      flos=state.total_flos + getattr(trainer, "current_flos", 0),
                      loss=trainer._tr_loss.detach().clone(), last_logged=trainer._globalstep_last_logged,
                      micro_steps=getattr(trainer, "_step", None) if hasattr(trainer, "_buffered_inputs") else None,
                      buffer=getattr(trainer, "_buffered_inputs", None),
                      metrics={k: list(v) for k, v in train.items()} if train is not None else None)

    def note(self) -> None:
        """An optimizer step begins: what the loop holds now is the state after the last completed step."""
        self.noted = self._now()

    def note_save(self) -> None:
        """transformers saved the step (after its log): a later resume from that checkpoint goes on from here."""
        self.saved = self._now()

    def at(self, step: int) -> _Noted | None:
        return next((noted for noted in (self.noted, self.saved) if noted is not None and noted.step == step), None)

    def rewind(self, step: int) -> None:
        """The run goes back to completed step ``step`` (its checkpoint is saved next): the tokens and FLOPs that a
        later step left mid-way counted are taken back, when the state of ``step`` was noted."""
        noted = self.at(step)
        if noted is None:
            return
        trainer = self.trainer
        trainer.state.num_input_tokens_seen = noted.tokens
        trainer.state.total_flos = noted.flos
        trainer.current_flos = 0

    def carry(self, step: int | None, old_micro_batch: int, old_grad_accum: int, new_micro_batch: int,
              new_steps_per_generation: int | None = None, generate_every: int | None = None) -> None:
        """The next ``train()`` resumes from ``checkpoint-<step>`` (None: from the start) at ``new_micro_batch``:
        prepare what it takes over. GRPO: ``generate_every`` (micro-batches between generations at the old split);
        a resume in a step that replays buffered completions keeps them, re-split for the new micro-batch.
        :class:`CannotReplay` when it would have to generate other completions instead."""
        self.pending = None
        if step is None:
            return
        noted = self.at(step)
        if noted is None:                  # a checkpoint of an older step: its logging window is not held
            if generate_every is not None and (step * old_grad_accum) % generate_every:
                raise CannotReplay(f"step {step + 1} replays completions generated before checkpoint-{step}, and "
                                   f"they are not held in this process")
            return
        micro, buffer = noted.micro_steps, None
        if micro is not None and generate_every is not None:
            rows = micro * old_micro_batch
            if rows % new_micro_batch:
                raise CannotReplay(f"{rows} completions trained since the counter started are not whole "
                                   f"micro-batches of {new_micro_batch}")
            if micro % generate_every:                  # the next step replays the buffered completions
                if noted.buffer is None:
                    raise CannotReplay(f"no buffered completions were held at step {step}")
                buffer = resplit_generation(noted.buffer, new_steps_per_generation or 1)
            micro = rows // new_micro_batch
        self.pending = _Carry(noted, micro, buffer)

    def keep(self, step: int) -> None:
        """A checkpoint of ``step`` was saved from the state noted for it: a later resume from it goes on from there."""
        if self.noted is not None and self.noted.step == step:
            self.saved = self.noted

    def install(self) -> None:
        """At the begin of the resumed ``train()`` (after transformers reset its logging state): the loss since the
        last log, that log's step and GRPO's buffer, counter and metrics are what they were at the step resumed
        from. ``train_loss`` of this call stays the mean loss of the steps it trains."""
        carry, self.pending = self.pending, None
        trainer = self.trainer
        if carry is None or carry.noted.step != trainer.state.global_step:
            return
        noted = carry.noted
        trainer._tr_loss = noted.loss.clone().to(trainer._tr_loss.device)
        trainer._globalstep_last_logged = noted.last_logged
        trainer._total_loss_scalar -= noted.loss.item()     # counted in this call's log, trained before it
        if carry.micro_steps is not None:
            trainer._step = carry.micro_steps             # type: ignore[attr-defined]  # TRL's GRPOTrainer
            trainer._buffered_inputs = carry.buffer       # type: ignore[attr-defined]
        metrics = getattr(trainer, "_metrics", None)
        if noted.metrics is not None and isinstance(metrics, dict) and "train" in metrics:
            metrics["train"].clear()
            metrics["train"].update({k: list(v) for k, v in noted.metrics.items()})


def resplit_generation(buffer: Iterable[dict[str, Any]], chunks: int) -> list[dict[str, Any]]:
    """GRPO's buffered generation (one dict per micro-batch, consecutive rows of the shuffled generation batch) as
    ``chunks`` micro-batches of the same rows in the same order. :class:`CannotReplay` for a batch with images
    (their rows are not one per completion) or rows that do not divide."""
    parts = list(buffer)
    if any(part.get(key) is not None for part in parts for key in IMAGE_KEYS):
        raise CannotReplay("the buffered completions hold images, whose rows cannot be re-split")
    merged: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [part[key] for part in parts]
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [v for value in values for v in value]
        else:                                                   # a scalar or None: the same in every part
            merged[key] = first
    rows = next((len(v) for v in merged.values() if isinstance(v, list) or (isinstance(v, torch.Tensor) and v.ndim)),
                0)
    if rows % chunks:
        raise CannotReplay(f"{rows} buffered completions do not divide into {chunks} micro-batches")
    size = rows // chunks

    def part(v: Any, i: int) -> Any:
        return v[i * size:(i + 1) * size] if isinstance(v, list) or (isinstance(v, torch.Tensor) and v.ndim) else v

    return [{k: part(v, i) for k, v in merged.items()} for i in range(chunks)]


def replace_method(trainer: object, name: str,
                   make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace ``trainer.<name>`` (``training_step``, or ``evaluate``, which ``train()`` calls at an evaluation
    step) by ``make(original)`` on this instance; returns the undo, which puts back what the instance held before
    (an earlier replacement stays when replacements are undone in reverse order)."""
    original = getattr(trainer, name)
    before = trainer.__dict__.get(name)
    replacement = make(original)
    setattr(trainer, name, replacement)

    def undo() -> None:
        if trainer.__dict__.get(name) is replacement:
            if before is None:
                delattr(trainer, name)
            else:
                setattr(trainer, name, before)

    return undo


#: what a :func:`watch_batch_samples` watcher returns to leave the fetched optimizer step untrained
SKIP_STEP = "skip"


def watch_batch_samples(trainer: Trainer,
                        fetched: Callable[[list[Any], int, Any], object]) -> Callable[[], None]:
    """Call ``fetched(batch_samples, num_batches, num_items_in_batch)`` with what ``trainer.get_batch_samples``
    fetched for each optimizer step (the micro-batches, how many were asked for, the step's label count), before the
    step trains; an exception of ``fetched`` goes through to the training loop. Several watchers share one wrapper
    and run in the order they came; one that returns :data:`SKIP_STEP` leaves the step untrained: the loop gets no
    micro-batch, so it trains none, sees ``control.should_training_stop`` and ends the epoch and the run there (its
    ``on_epoch_end``, the save the control asks for, ``on_train_end``), and the watchers after it are not called.
    Returns the undo."""
    watchers: list[Callable[[list[Any], int, Any], object]] | None = trainer.__dict__.get("_hf_perf_batch_watchers")
    if watchers is None:
        watchers = []

        def make(original: Callable[..., tuple[list[Any], Any]]) -> Callable[..., tuple[list[Any], Any]]:
            def get_batch_samples(epoch_iterator: Any, num_batches: int, *args: Any,
                                  **kwargs: Any) -> tuple[list[Any], Any]:
                batches, count = original(epoch_iterator, num_batches, *args, **kwargs)
                for watcher in list(watchers):
                    if watcher(batches, num_batches, count) == SKIP_STEP:
                        return [], count
                return batches, count
            return get_batch_samples

        unwrap = replace_method(trainer, "get_batch_samples", make)
        trainer.__dict__["_hf_perf_batch_watchers"] = watchers
        trainer.__dict__["_hf_perf_batch_unwrap"] = unwrap
    watchers.append(fetched)

    def undo() -> None:
        if fetched in watchers:
            watchers.remove(fetched)
        if not watchers and trainer.__dict__.get("_hf_perf_batch_watchers") is watchers:
            trainer.__dict__.pop("_hf_perf_batch_unwrap")()
            del trainer.__dict__["_hf_perf_batch_watchers"]

    return undo


def guard_saves(trainer: Trainer, failed: Callable[[str], None]) -> Callable[[], None]:
    """Call ``failed(path)`` with the ``checkpoint-<global_step>`` folder that ``Trainer._save_checkpoint`` was
    writing when it ends by an error (Ctrl-C and a SIGTERM handler that raises too), before the error goes on: a
    save cut short must not leave a folder that ``get_last_checkpoint`` picks. Returns the undo."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException:
                failed(f"{trainer.args.output_dir}/checkpoint-{trainer.state.global_step}")
                raise
        return _save_checkpoint

    return replace_method(trainer, "_save_checkpoint", make)


def watch_prepared_inputs(trainer: Trainer, prepared: Callable[[], None]) -> Callable[[], None]:
    """Call ``prepared()`` each time TRL's GRPO ``_prepare_inputs`` hands a training micro-batch out (after it
    generated the step's completions or took them from its buffer: :func:`grpo_step_batches` then holds the step's
    rows), before that micro-batch trains; an exception of ``prepared`` goes through. Returns the undo."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _prepare_inputs(batch: Any) -> Any:
            inputs = original(batch)
            if cast(torch.nn.Module, trainer.model).training:
                prepared()
            return inputs
        return _prepare_inputs

    return replace_method(trainer, "_prepare_inputs", make)


def grpo_step_batches(trainer: Trainer) -> list[dict[str, Any]] | None:
    """The buffered completions the GRPO optimizer step now training trains: its micro-batches, in order, from TRL's
    ``_buffered_inputs`` at its micro-batch counter ``_step`` (None: no buffer, not GRPO)."""
    buffer = getattr(trainer, "_buffered_inputs", None)
    step = getattr(trainer, "_step", None)
    if not buffer or step is None:
        return None
    spg = len(buffer)
    return [buffer[(step + i) % spg] for i in range(trainer.args.gradient_accumulation_steps)]


@contextlib.contextmanager
def inputs_as_given(trainer: Trainer, grpo: bool = True) -> Iterator[None]:
    """While active, GRPO's ``training_step`` trains the micro-batch it is handed as it is: TRL's ``_prepare_inputs``
    (which generates, or hands out its buffered completions) is bypassed, and TRL's micro-batch counter ``_step``
    and step timer ``_current_train_step_time`` are put back afterwards (the exactness check's passes train the
    step's buffered rows regrouped, and count as no micro-batch). Nothing changes when ``grpo`` is False."""
    if not grpo:
        yield
        return
    kept = {name: getattr(trainer, name) for name in ("_step", "_current_train_step_time") if hasattr(trainer, name)}
    undo = replace_method(trainer, "_prepare_inputs", lambda original: lambda inputs: inputs)
    try:
        yield
    finally:
        undo()
        for name, value in kept.items():
            setattr(trainer, name, value)


#: the trainer's methods whose time is a phase of the step (:func:`clock_trainer`): the fetch of a step's batches,
#: the log (its callbacks included: they are clocked on their own, see :func:`time_callbacks`), an evaluation and a
#: checkpoint save (the private ``_save_checkpoint``, which every save of a training run calls before ``on_save``)
TRAINER_PHASES = {"get_batch_samples": "data_wait", "log": "log", "evaluate": "eval", "_save_checkpoint": "save"}


def _bracketed(original: Callable[..., Any], label: str, enter: Callable[[str], None],
               leave: Callable[[str], None]) -> Callable[..., Any]:
    """``original`` with ``enter(label)`` before each call and ``leave(label)`` after it (an error goes through, after
    ``leave``)."""
    def bracketed(*args: Any, **kwargs: Any) -> Any:
        enter(label)
        try:
            return original(*args, **kwargs)
        finally:
            leave(label)
    return bracketed


def clock_trainer(trainer: Trainer, enter: Callable[[str], None], leave: Callable[[str], None]) -> Callable[[], None]:
    """Call ``enter(phase)`` and ``leave(phase)`` around each of ``trainer``'s methods of :data:`TRAINER_PHASES`
    (an error goes through, after ``leave``); returns the undo, which puts back whatever each method was before (a
    wrapper another callback installed meanwhile stays: it calls through this one)."""
    undos: list[Callable[[], None]] = []
    for name, phase in TRAINER_PHASES.items():
        if not callable(getattr(trainer, name, None)):
            continue

        def make(original: Callable[..., Any], phase: str = phase) -> Callable[..., Any]:
            return functools.wraps(original)(_bracketed(original, phase, enter, leave))

        undos.append(replace_method(trainer, name, make))

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()
    return undo_all


#: events :func:`time_callbacks` dispatches whole (not per callback): a callback may join or reorder the list then
WHOLE_EVENTS = ("on_init_end", "on_train_begin", "on_train_end")


def time_callbacks(handler: CallbackHandler, started: Callable[[TrainerCallback, str], None],
                   finished: Callable[[TrainerCallback, str], None]) -> Callable[[], None]:
    """Call ``started(callback, event)`` and ``finished(callback, event)`` around every callback's every event: the
    handler's ``call_event`` (transformers 5.23-5.24: a loop over ``handler.callbacks`` with the handler's model,
    optimizer… as keywords) runs once per callback with ``handler.callbacks`` holding that one callback, so the
    trainer's own keywords and its ``control`` chaining stay transformers'. A callback that changes the list during
    its event (the bus putting itself first) keeps its change. Returns the undo."""
    original: Callable[..., TrainerControl] = handler.call_event     # untyped in transformers

    def call_event(event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   **kwargs: Any) -> TrainerControl:
        callbacks = handler.callbacks
        if event in WHOLE_EVENTS:
            return original(event, args, state, control, **kwargs)
        outer = handler.__dict__.get("_hf_perf_all_callbacks")      # an event dispatched inside another's
        handler.__dict__["_hf_perf_all_callbacks"] = callbacks
        try:
            for callback in list(callbacks):
                alone = [callback]
                handler.callbacks = alone
                started(callback, event)
                try:
                    control = original(event, args, state, control, **kwargs)
                finally:
                    finished(callback, event)
                    if handler.callbacks is not alone:    # the callback replaced the list: its list, then the others
                        mine = list(handler.callbacks)
                        callbacks = mine + [c for c in callbacks
                                            if c is not callback and all(c is not m for m in mine)]
                    handler.callbacks = callbacks
                    handler.__dict__["_hf_perf_all_callbacks"] = callbacks
        finally:
            if outer is None:
                handler.__dict__.pop("_hf_perf_all_callbacks", None)
            else:
                handler.__dict__["_hf_perf_all_callbacks"] = outer
        return control

    handler.call_event = call_event      # type: ignore[method-assign]  # this instance's, undone below

    def undo() -> None:
        if handler.__dict__.get("call_event") is call_event:
            del handler.call_event
    return undo


#: the training loop's functions whose ``batch_samples`` local holds the step's micro-batches
TRAINING_LOOP_FRAMES = ("_run_epoch", "_inner_training_loop")


#: what the training loop calls after it counted a step (its batches are then the step that completed)
AFTER_THE_STEP = ("_maybe_log_save_evaluate", "on_step_end", "on_epoch_end")


def fetched_step(error: BaseException) -> tuple[list[Any], Any] | None:     # the user's batches
    """The micro-batches the training loop had fetched for the optimizer step that ``error`` left before that step
    counted, and the step's label count (``num_items_in_batch``), from the innermost training-loop frame of its
    traceback; None: the traceback holds none, or the error struck after the step counted (saving, evaluating, a
    callback's ``on_step_end``)."""
    found, tb = None, error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in TRAINING_LOOP_FRAMES:
            batches = frame.f_locals.get("batch_samples")
            child = tb.tb_next.tb_frame.f_code.co_name if tb.tb_next is not None else None
            found = ((batches, frame.f_locals.get("num_items_in_batch"))
                     if isinstance(batches, list) and child not in AFTER_THE_STEP else None)
        tb = tb.tb_next
    return found


def rearm_jit_checkpoint(trainer: Trainer) -> bool:
    """Install transformers' just-in-time checkpoint SIGTERM handler again when it is enabled but no longer
    installed (its ``on_train_end`` restored the previous one); True when it re-installed it."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for callback in trainer.callback_handler.callbacks:
        manager = getattr(callback, "jit_manager", None)
        handler = getattr(manager, "_sigterm_handler", None)
        if manager is not None and handler is not None and signal.getsignal(signal.SIGTERM) != handler:
            manager.setup_signal_handler()
            return True
    return False


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile`` wrapped (the module itself when not compiled)."""
    return cast(torch.nn.Module, getattr(module, "_orig_mod", module))


# ---------------------------------------------------------------- generate
class GenerateListener(Protocol):
    """What :func:`watch_generate` tells (``input_ids`` and ``output``: what ``generate`` was given and returned)."""

    def generate_started(self) -> None: ...

    def generate_finished(self, input_ids: Any, output: Any) -> None: ...


class EntryListener(Protocol):
    """What :func:`watch_generation_entry` tells (``result``: what the entry point returned, None on an error)."""

    def entry_started(self, kind: str) -> None: ...

    def entry_finished(self, kind: str, result: Any) -> None: ...


class GenerationListener(GenerateListener, EntryListener, Protocol):
    """A listener of both (:func:`watch_generation`)."""


class _Watch:
    """Wrappers around one object's entry points that tell every listener, shared by all of them (:func:`_join`) and
    taken off when the last one leaves; a wrapper another one was put over outlives the undo: it then only passes
    through."""

    def __init__(self, entry: str) -> None:
        self.entry = entry                  # the attribute whose wrapper tells that the watch is still in place
        self.listeners: list[Any] = []
        self.alive = True
        self.undos: list[Callable[[], None]] = []
        self.wrapper: object = None         # what the entry reads while the watch is in place

    def _telling(self, started: Callable[[Any], None],
                 finished: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]
                 ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A wrapper for :func:`replace_method` that calls ``started(listener)`` and ``finished(listener, args,
        kwargs, result)`` (result None on an error) for every listener around the call."""
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def told(*args: Any, **kwargs: Any) -> Any:
                listeners = list(self.listeners) if self.alive else []
                for listener in listeners:
                    started(listener)
                result = None
                try:
                    result = original(*args, **kwargs)
                    return result
                finally:
                    for listener in listeners:
                        finished(listener, args, kwargs, result)
            return told
        return make

    def undo(self) -> None:
        self.alive = False
        for each in reversed(self.undos):
            each()
        self.undos.clear()


#: the watch of each watched object (a model's ``generate``, a trainer's generation entry points)
_WATCHES: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()


def _join(owner: Any, build: Callable[[], _Watch], listener: object) -> Callable[[], None]:
    """``listener`` joins the watch of ``owner`` (``build()`` when it has none, or another wrapper was put over its
    own); returns the function that stops it."""
    watch = _WATCHES.get(owner)
    if watch is None or getattr(owner, watch.entry, None) is not watch.wrapper:
        watch = _WATCHES[owner] = build()
    watch.listeners.append(listener)

    def stop() -> None:
        if listener in watch.listeners:
            watch.listeners.remove(listener)
        if not watch.listeners and watch.alive:
            watch.undo()
            if _WATCHES.get(owner) is watch:
                del _WATCHES[owner]

    return stop


class _GenerateWatch(_Watch):
    """One wrapper around one model's ``generate`` that tells every listener when a generation starts and ends."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__("generate")
        self.undos.append(replace_method(model, "generate", self._telling(
            lambda listener: listener.generate_started(),
            lambda listener, args, kwargs, output: listener.generate_finished(
                kwargs.get("input_ids", args[0] if args else None), output))))
        self.wrapper = model.generate               # a compiled model's: on the module it wraps


def watch_generate(model: torch.nn.Module, listener: GenerateListener) -> Callable[[], None]:
    """Call ``listener.generate_started()`` and ``listener.generate_finished(input_ids, output)`` (output None on
    an error) around every ``model.generate``; returns the function that stops it. One wrapper per model, shared
    by all listeners; the model's own ``generate`` comes back when the last listener leaves."""
    return _join(model, lambda: _GenerateWatch(model), listener)


class GenerationClock:
    """Seconds spent generating since the last :meth:`reset`: a listener for :func:`watch_generation` (TRL's
    rollouts and weight syncs, ``model.generate`` nested in them counted once) or :func:`watch_generate` alone."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = 0.0
        self.started: float | None = None
        self.depth = 0                              # generation calls open now (nested ones time nothing more)

    def generate_started(self) -> None:
        if self.depth == 0:
            self.started = self.clock()
        self.depth += 1

    def generate_finished(self, input_ids: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.started is not None:
            self.seconds += self.clock() - self.started
            self.started = None

    def entry_started(self, kind: str) -> None:
        if kind in (ROLLOUT, SYNC):
            self.generate_started()

    def entry_finished(self, kind: str, result: Any) -> None:
        if kind in (ROLLOUT, SYNC):
            self.generate_finished(None, None)

    def reset(self) -> None:
        self.seconds = 0.0


# ---------------------------------------------------------------- TRL's generation entry
#: what :func:`watch_generation_entry` times, by the ``kind`` it tells its listener: the trainer's whole rollout
#: (``GRPOTrainer._generate``: every backend, a custom ``rollout_func`` and tool calls), a weight sync to vLLM
#: (``VLLMGeneration.sync_weights``; async GRPO: ``AsyncGRPOTrainer._sync_weight``), TRL's vLLM generation
#: (``VLLMGeneration.generate``: the gathers and broadcasts of server mode included), the engine call itself (server
#: mode: ``VLLMClient.generate``, the HTTP request the main process makes; colocate: ``LLM.generate``) and the reward
#: functions (``GRPOTrainer._calculate_rewards``)
ROLLOUT, SYNC, ENGINE, CALL, REWARD = "rollout", "sync", "engine", "call", "reward"
#: the backend of TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo`` in TRL 1.16): a rollout worker process
#: generates against a vLLM server while the trainer trains on what its queue holds
ASYNC_BACKEND = "vllm-async"


def is_async_grpo(trainer: object) -> bool:
    """Whether ``trainer`` is TRL's ``AsyncGRPOTrainer`` (or a subclass): it syncs weights itself (``_sync_weight``)
    and trains on a rollout queue (``rollout_queue``), with no ``_generate`` of its own."""
    return callable(getattr(trainer, "_sync_weight", None)) and hasattr(trainer, "rollout_queue")


def async_rollout_wait(trainer: object) -> float | None:
    """Async GRPO: the seconds the trainer waited for its rollout queue since TRL last logged them (TRL's
    ``perf/rollout_wait_s``, accumulated in ``_rollout_dataset.wait_s`` on the main process and reset by TRL's
    ``_log_step_metrics`` after the step's end); None where there is none (another rank, another trainer)."""
    wait = getattr(getattr(trainer, "_rollout_dataset", None), "wait_s", None)
    return float(wait) if isinstance(wait, (int, float)) else None


def async_trained_tokens(trainer: object) -> float | None:
    """Async GRPO: the tokens the step trained, over every rank (TRL's ``batch/trained_tokens_per_step``: completion
    tokens of the packed rows; prompts and packing padding excluded), until TRL resets them after the step's end."""
    tokens = getattr(trainer, "_step_trained_tokens", None)
    return float(tokens) if isinstance(tokens, (int, float)) else None


def generation_backend(trainer: Trainer | None) -> str | None:
    """How a TRL trainer generates: ``"vllm-server"``, ``"vllm-colocate"``, ``"transformers-paged"`` (TRL's
    continuous batching), ``"transformers"`` (``model.generate``) or :data:`ASYNC_BACKEND`; None for a trainer that
    does not generate."""
    if is_async_grpo(trainer):
        return ASYNC_BACKEND
    if not callable(getattr(trainer, "_generate", None)):
        return None
    if getattr(trainer, "use_vllm", False):
        return f"vllm-{getattr(trainer, 'vllm_mode', None) or 'server'}"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "transformers-paged"
    return "transformers"


def rollout_counts(kind: str, result: Any) -> tuple[int, int, int]:
    """(completions, completion tokens, longest completion) in what ``kind``'s call returned: ``_generate``'s tuple
    (``prompt_ids, completion_ids, tool_mask, ...``; with tools only the model's own tokens, ``tool_mask`` 1, count)
    or ``VLLMGeneration.generate``'s (``prompt_ids, completion_ids, logprobs, logprob_token_ids``); zeros for
    anything else."""
    if kind not in (ROLLOUT, ENGINE) or not isinstance(result, tuple) or len(result) < 2:
        return 0, 0, 0
    completions = result[1]
    mask = result[2] if kind == ROLLOUT and len(result) > 2 else None
    rows = mask if isinstance(mask, list) and mask else completions
    if not isinstance(rows, list):
        return 0, 0, 0
    lengths = [int(sum(row)) if rows is mask else len(row) for row in rows]
    return len(lengths), sum(lengths), max(lengths, default=0)


class _EntryWatch(_Watch):
    """One set of wrappers around one trainer's generation entry points that tells every listener."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__("_sync_weight" if is_async_grpo(trainer) else "_generate")
        own = getattr(trainer, self.entry)         # the bound method (async GRPO: the one TRL's callback holds)
        self.undos.append(replace_method(trainer, self.entry, self._timed(SYNC if self.entry == "_sync_weight"
                                                                           else ROLLOUT)))
        self.wrapper = getattr(trainer, self.entry)
        if self.entry == "_sync_weight":
            self._watch_async(trainer, own)
        if callable(getattr(trainer, "_calculate_rewards", None)):
            self.undos.append(replace_method(trainer, "_calculate_rewards", self._timed(REWARD)))
        engine = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
        if engine is not None:
            self.undos.append(replace_method(engine, "sync_weights", self._timed(SYNC)))
            self.undos.append(replace_method(engine, "generate", self._timed(ENGINE)))
            # the engine call itself: the main process's HTTP request (server), the colocated engine's generate
            for holder in (getattr(engine, "vllm_client", None), getattr(engine, "llm", None)):
                if callable(getattr(holder, "generate", None)):
                    self.undos.append(replace_method(holder, "generate", self._timed(CALL)))

    def _watch_async(self, trainer: Trainer, own: Callable[..., Any]) -> None:
        """Async GRPO: TRL's ``StepIntervalCallback`` holds the bound ``_sync_weight`` it was given (its ``fn``), so
        that one is timed too; the rollout worker's start (a spawned process, TRL's train-begin callback) is the
        trainer's share of the rollout side, timed as a rollout."""
        for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
            if getattr(callback, "fn", None) == own:
                before = callback.fn
                callback.fn = self._timed(SYNC)(before)
                self.undos.append(functools.partial(setattr, callback, "fn", before))
        worker = getattr(trainer, "rollout_worker", None)
        if callable(getattr(worker, "start", None)):
            self.undos.append(replace_method(worker, "start", self._timed(ROLLOUT)))

    def _timed(self, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._telling(lambda listener: listener.entry_started(kind),
                             lambda listener, args, kwargs, result: listener.entry_finished(kind, result))


def watch_generation_entry(trainer: Trainer | None, listener: EntryListener) -> Callable[[], None]:
    """Tell ``listener.entry_started(kind)`` and ``listener.entry_finished(kind, result)`` (result None on an error)
    around TRL's own generation entry points on this trainer instance (kinds: :data:`ROLLOUT`, :data:`SYNC`,
    :data:`ENGINE`, :data:`REWARD`), so that HF ``generate``, vLLM server and vLLM colocate are timed at the same
    place. One set of wrappers per trainer, shared by all listeners, taken off when the last one leaves; nothing is
    watched on a trainer without ``_generate`` (not a TRL generating trainer). Returns the function that stops it."""
    if trainer is None or generation_backend(trainer) is None:
        return lambda: None
    return _join(trainer, lambda: _EntryWatch(trainer), listener)


def watch_generation(model: torch.nn.Module, listener: GenerationListener) -> Callable[[], None]:
    """:func:`watch_generate` on ``model`` and :func:`watch_generation_entry` on the trainer whose ``train()`` runs
    on the call stack (if any), for one listener of both; returns the undo of both."""
    undos = [watch_generate(model, listener), watch_generation_entry(calling_trainer(), listener)]

    def undo() -> None:
        for each in undos:
            each()

    return undo


# ---------------------------------------------------------------- collectives
#: the ``torch.distributed`` collectives that :func:`intercept_collectives` sees
#: (``all_gather_single`` and ``reduce_scatter_single``: FSDP2's own in torch 2.13; ``all_gather_into_tensor`` and
#: ``reduce_scatter_tensor`` before)
COLLECTIVES = ("all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
               "all_gather_single", "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier",
               "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list")


def _wrap_collectives(make: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace every ``torch.distributed`` function of :data:`COLLECTIVES` by ``make(name, original)`` until the
    returned undo runs."""
    originals: dict[str, Callable[..., Any]] = {}
    for name in COLLECTIVES:
        original = getattr(torch.distributed, name, None)
        if original is not None:
            originals[name] = original
            setattr(torch.distributed, name, functools.wraps(original)(make(name, original)))

    def undo() -> None:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)
        originals.clear()

    return undo


def watch_collectives(started: Callable[[str], None], finished: Callable[[str], None]) -> Callable[[], None]:
    """Until the returned undo runs, call ``started(name)`` and ``finished(name)`` around every collective of
    :data:`COLLECTIVES` that goes through the ``torch.distributed`` module functions (``finished`` on an error too).
    Meant for a short span (one rollout): installed over whatever wraps them now and undone before it."""
    return _wrap_collectives(lambda name, original: _bracketed(original, name, started, finished))


def intercept_collectives(before: Callable[[], None], failed: Callable[[], None]) -> Callable[[], None]:
    """Until the returned undo runs, call ``before()`` ahead of every collective on the default group that goes
    through the ``torch.distributed`` module functions (``before`` may raise to skip it), and ``failed()`` when the
    collective itself raises."""
    def make(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if group is None or group is torch.distributed.GroupMember.WORLD:
                before()
            try:
                return original(*args, **kwargs)
            except BaseException:
                failed()
                raise
        return checked

    return _wrap_collectives(make)


# ---------------------------------------------------------------- FSDP2
def fsdp2_root(model: torch.nn.Module) -> Any:
    """The outermost module FSDP2's ``fully_shard`` wrapped in ``model`` (the root FSDP module), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:                     # a torch without distributed support
        return None
    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def reset_fsdp_iteration(model: torch.nn.Module) -> None:
    """After an exception aborted FSDP2's forward or backward: reshard every parameter group and clear the
    iteration's trackers on this rank, so that the next forward starts clean (no collective: every rank does it on
    its own). torch ≥ 2.13: the public ``FSDPModule.reset_iter_state``; older: the same steps on FSDP2's state.
    Nothing happens when ``model`` holds no FSDP2 module."""
    root = fsdp2_root(model)
    if root is None:
        return
    state = root._get_fsdp_state()                   # typed Any: FSDP2's state is not a public type
    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:
        reset()
    else:
        _reset_fsdp_state(state)
    for group in _fsdp_param_groups(state):     # gradients of the aborted backward not yet reduce-scattered: the
        for param in group.fsdp_params:         # next backward would add to them (reset_iter_state keeps them)
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None


def _fsdp_param_groups(root_state: Any) -> list[Any]:       # FSDP2's private state and groups: no public type
    """Every FSDP2 parameter group under a root state (torch 2.13: ``_fsdp_param_groups`` per state; earlier one
    ``_fsdp_param_group``)."""
    groups: list[Any] = []
    for each in root_state._state_ctx.all_states:
        found = getattr(each, "_fsdp_param_groups", None)
        if found is None:
            group = getattr(each, "_fsdp_param_group", None)
            found = [group] if group is not None else []
        groups.extend(found)
    return groups


def _reset_fsdp_state(state: Any) -> None:
    """``FSDPModule.reset_iter_state`` for a torch without it (before 2.13), on the root's state."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    comm = getattr(state, "_comm_ctx", None)
    if comm is not None:
        comm.all_gather_state = None
        for name in ("reduce_scatter_states", "post_forward_order"):
            getattr(comm, name, []).clear()
        if getattr(comm, "reduce_scatter_state", None) is not None:
            comm.reduce_scatter_state = None
    for each in state._state_ctx.all_states:
        getattr(each, "_modules_to_run_forward", set()).clear()
        each._training_state = TrainingState.IDLE
    for group in _fsdp_param_groups(state):
        group._all_gather_result = None
        for name in ("_post_reduce_event", "_all_reduce_state", "_partial_reduce_output",
                     "_reshard_after_forward_event"):
            if hasattr(group, name):
                setattr(group, name, None)
        group._training_state = TrainingState.IDLE
        group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


@contextlib.contextmanager
def fsdp2_prepared_again(trainer: Trainer) -> Iterator[None]:
    """Let ``train()`` prepare a model that FSDP2 already wrapped (an in-process resume): accelerate's
    ``prepare`` then takes the model as it is — ``fsdp2_prepare_model`` returns a wrapped model unchanged, but the
    layer-class lookup before it (``set_auto_wrap_policy``: FSDP2 renamed the classes ``FSDP<Layer>``) and
    FSDP's activation checkpointing (already applied) would run again — and only the new optimizer is prepared."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    if plugin is None or fsdp2_root(cast(torch.nn.Module, trainer.model)) is None:
        yield
        return
    checkpointing = plugin.activation_checkpointing
    plugin.activation_checkpointing = False
    plugin.set_auto_wrap_policy = lambda model: None       # instance attribute: shadows the method for this call
    try:
        yield
    finally:
        del plugin.set_auto_wrap_policy
        plugin.activation_checkpointing = checkpointing
#: accelerate before 1.13 loads an FSDP2 optimizer's sharded checkpoint into the ``state_dict()`` of the optimizer
#: ``train()`` has just made, which holds no state yet: a resume restored none (1.13 reads it first)
FSDP2_OPTIMIZER_RESUME_FIXED = (1, 13)


@contextlib.contextmanager
def fsdp2_optimizer_state_restored(trainer: Trainer) -> Iterator[None]:
    """Resumes under FSDP2 with a sharded state dict restore the optimizer's state also on accelerate < 1.13: after
    ``Trainer._load_optimizer_and_scheduler`` (its only route to accelerate's ``load_fsdp_optimizer``) the state is
    read again as accelerate 1.13 reads it (``get_optimizer_state_dict``, ``torch.distributed.checkpoint.load``,
    ``set_optimizer_state_dict``). Does nothing on accelerate ≥ 1.13, without FSDP2 or with a full state dict."""
    import accelerate

    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    version = tuple(int(part) for part in accelerate.__version__.split(".")[:2] if part.isdigit())
    if (plugin is None or getattr(plugin, "fsdp_version", 1) != 2 or version >= FSDP2_OPTIMIZER_RESUME_FIXED
            or "FULL" in str(plugin.state_dict_type)):
        yield
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def load(checkpoint: str | None) -> None:
            original(checkpoint)
            if checkpoint is not None:
                _load_fsdp2_optimizer(plugin, trainer, checkpoint)
        return load

    undo = replace_method(trainer, "_load_optimizer_and_scheduler", make)
    try:
        yield
    finally:
        undo()


def _load_fsdp2_optimizer(plugin: Any, trainer: Trainer, checkpoint: str) -> None:   # accelerate has no types
    import torch.distributed.checkpoint as dist_cp
    from accelerate.utils.constants import OPTIMIZER_NAME
    from accelerate.utils.fsdp_utils import _prepare_sd_options
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    folder = os.path.join(checkpoint, f"{OPTIMIZER_NAME}_0")
    if not os.path.isdir(folder):
        return
    options = _prepare_sd_options(plugin)
    model, optimizer = cast(torch.nn.Module, trainer.model), cast(torch.optim.Optimizer, trainer.optimizer)  # train()'s
    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    dist_cp.load(state, checkpoint_id=folder,                 # type: ignore[attr-defined, unused-ignore]
                 storage_reader=dist_cp.FileSystemReader(folder))   # type: ignore[attr-defined, unused-ignore]
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


# ---------------------------------------------------------------- the console during the package's own re-sizes
#: the logger of transformers' check of a resume's arguments against the checkpoint's ``trainer_state.json``
#: (``trainer_utils.compare_trainer_and_checkpoint_args``) and the start of its batch-size line
RESUME_CHECK_LOGGER = "transformers.trainer_utils"
BATCH_SIZE_LINE = "per_device_train_batch_size: "


class _ResizedBatchSize(logging.Filter):
    """Drops the batch-size line from transformers' resume check; the record goes on with any other mismatch."""

    def filter(self, record: logging.LogRecord) -> bool:
        lines = record.getMessage().split("\n")
        kept = [line for line in lines if not (line.strip().startswith(BATCH_SIZE_LINE)
                                                and "(from trainer_state.json)" in line)]
        if len(kept) == len(lines):
            return True
        if len(kept) <= 1:                             # the heading alone: nothing else differed
            return False
        record.msg, record.args = "\n".join(kept), ()
        return True


#: (message pattern, category) of the deprecations TRL and peft trigger at every generation (see the module
#: docstring): shown by the run's first generation, not again after each of the package's re-sizes
SHOWN_BEFORE_A_RESIZE = ((r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated", FutureWarning),)


@contextlib.contextmanager
def own_resume() -> Iterator[None]:
    """Around the package's own ``train()`` that resumes after a re-size: transformers' resume check does not report
    the per-device batch size as a mismatch, and the deprecations of :data:`SHOWN_BEFORE_A_RESIZE` are not shown
    again (see the module docstring). A user's own resume shows both; a user's own warning filters still come
    first."""
    target = logging.getLogger(RESUME_CHECK_LOGGER)
    quiet = _ResizedBatchSize()
    target.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            for pattern, category in SHOWN_BEFORE_A_RESIZE:
                warnings.filterwarnings("ignore", message=pattern, category=category, append=True)
            yield
    finally:
        target.removeFilter(quiet)


def restore_converted_weights(trainer: Trainer, warn: Callable[[str], object]) -> Callable[[], None]:
    """While active, a resume of ``trainer`` that restored fewer weights than its checkpoint saved is completed:
    transformers 5 saves converted weights (a mixture of experts' fused experts) under their legacy names
    (``block_sparse_moe.experts.N.w1``) and ``Trainer._load_from_checkpoint`` loads them non-strictly, without the
    conversion (docs/known-issues.md). The weights the checkpoint file does not name are then read through the model
    class's own ``from_pretrained`` (which converts); ``warn(message)`` says so once. Returns the undo."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _load_from_checkpoint(resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
            original(resume_from_checkpoint, model)
            target = model if model is not None else trainer.model
            missing = _unsaved_weights(target, resume_from_checkpoint)
            if missing and target is not None:
                _load_converted(target, resume_from_checkpoint, missing)
                warn(f"the checkpoint {os.path.basename(resume_from_checkpoint)} holds {len(missing)} weights under "
                     f"names transformers' resume does not convert (e.g. {sorted(missing)[0]}): loaded with the "
                     f"model's own conversion")
        return _load_from_checkpoint

    return replace_method(trainer, "_load_from_checkpoint", make)


def _unsaved_weights(model: torch.nn.Module | None, checkpoint: str) -> set[str]:
    """The model's weights that the checkpoint's safetensors file (or index) does not name, when it names others in
    their place (a plain model's whole save; None for an adapter, a sharded or a DeepSpeed checkpoint)."""
    if model is None or hasattr(model, "peft_config"):
        return set()
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            saved = set(json.load(f).get("weight_map", {}))
    elif os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            saved = set(f.keys())
    else:
        return set()
    have = set(model.state_dict())
    missing, unexpected = have - saved, saved - have
    tied = {name for name in missing if "lm_head" in name or "embed" in name}   # tied weights are saved once
    return (missing - tied) if unexpected else set()


def _load_converted(model: torch.nn.Module, checkpoint: str, names: set[str]) -> None:
    """Load ``names`` from ``checkpoint`` as the model class's ``from_pretrained`` reads them (converted)."""
    loaded = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)  # type: ignore[attr-defined]
    state = loaded.state_dict()
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if name in names and name in state:
                value.copy_(state[name].to(value.device))
    del loaded
