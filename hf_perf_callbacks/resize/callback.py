"""AdaptiveBatchTuner: the callback side of re-sizing. It measures the run's own steps for the tuning on them,
logs the split in effect, and answers the watchdog's request for a smaller micro-batch; it sees the run's
:class:`~hf_perf_callbacks.resize.executor.Executor` (found on the trainer's bus) through
:class:`~hf_perf_callbacks.resize.executor.TunerView`, which carries every change out. Without ``train_with_tuning``
a re-size request saves, stops cleanly and prints the split and the command to resume with.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .. import keys
from ..common.base import Clock, PerfCallback, arguments, hook
from ..core.memory import budget_bytes
from ..core.runlog import SPLIT_FILE, NoteDetails
from ..core.validation import check_flag, check_number
from ..core.wording import TUNER_NEEDS_TRAIN_WITH_TUNING
from ..platform import adapter
from ..platform.device import GB, DeviceLayer, gather_floats, set_rng_state, world_size
from .executor import Executor, TunerView
from .tuning import FIRST_SAMPLES, MIN_SAMPLES, SAMPLES

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

_Callback = TypeVar("_Callback", bound="TrainerCallback")

logger = logging.getLogger("hf_perf_callbacks")

__all__ = ["AdaptiveBatchTuner", "find_callback"]


class AdaptiveBatchTuner(PerfCallback):
    """Keeps the fastest exact micro-batch / accumulation split that fits (see :mod:`hf_perf_callbacks.resize`).

    Args:
        tune: in :func:`~hf_perf_callbacks.train_with_tuning`, measure other exact splits on the run's own training
            steps when the rest of the run can pay the switches back (:mod:`~hf_perf_callbacks.resize.tuning`).
        samples: measured steps per split and round (at least 3: fewer cannot separate two splits; 4 by default,
            the fewest at which one round can separate two splits at the per-round significance level).
        max_rounds: interleaved rounds per candidate before it is left as not separable from the noise.
        first_samples: measured steps of the configured split before the first candidate is tried (2 by default, at
            least 2, at most ``samples``): each may be a step at a slow split; a candidate far from it is decided on
            its first measured steps by the sequential test, one near it gets interleaved rounds.
        max_micro_batch: the largest micro-batch tried (None: up to the whole effective batch per rank).
        patience: smaller splits tried in a row without one being kept before the walk down stops.
        rank_by: ``"non_generation"`` (step time minus generation) or ``"step"`` (the whole step).
        must_pay: try a split only when the rest of the run can pay its switches back (False: every split).
        memory_check: one step at the worst-case length before training, to catch a split that cannot fit
            (None: on CUDA and MPS when memory is tight — the estimated worst-case peak reaches half the budget, or
            cannot be estimated; True: always; False: never).
        accept_unmeasured: use a split whose change could not be checked on the step it starts with (it ran out of
            memory at every size, or the gradient is sharded: FSDP, DeepSpeed), saying so once; False (the default)
            ends the run there, saved, instead (docs/exactness.md).
        clock: the clock seam (:class:`~hf_perf_callbacks.common.base.Clock`; tests plant one).

    Logged keys:

    =========================  =======  ==================================================
    key                        unit     meaning
    =========================  =======  ==================================================
    ``tuner/micro_batch``      samples  per-device micro-batch now
    ``tuner/grad_accum``       steps    gradient accumulation now
    ``tuner/effective_batch``  samples  micro-batch × accumulation × world (constant)
    ``tuner/resizes``          count    re-sizes forced by memory so far
    =========================  =======  ==================================================
    """

    source = "tuner"

    @arguments
    def __init__(self, tune: bool = True, samples: int = SAMPLES, max_rounds: int = 3,
                 max_micro_batch: int | None = None, patience: int = 1, rank_by: str = "non_generation",
                 must_pay: bool = True, memory_check: bool | None = None, clock: Clock | None = None,
                 first_samples: int = FIRST_SAMPLES, accept_unmeasured: bool = False):
        check_flag("tune", tune)
        check_number("samples", samples, low=MIN_SAMPLES, integer=True)
        check_number("max_rounds", max_rounds, low=1, integer=True)
        check_number("first_samples", first_samples, low=2, high=samples, integer=True)
        check_number("max_micro_batch", max_micro_batch, low=1, integer=True, allow_none=True)
        check_number("patience", patience, low=1, integer=True)
        if rank_by not in ("step", "non_generation"):
            raise ValueError(f"rank_by={rank_by!r} is not allowed: expected 'step' or 'non_generation'")
        check_flag("must_pay", must_pay)
        check_flag("memory_check", memory_check, allow_none=True)
        check_flag("accept_unmeasured", accept_unmeasured)
        super().__init__(clock)
        self.tune, self.samples, self.max_rounds, self.max_micro_batch = tune, samples, max_rounds, max_micro_batch
        self.patience, self.rank_by, self.must_pay, self.memory_check = patience, rank_by, must_pay, memory_check
        self.first_samples, self.accept_unmeasured = first_samples, accept_unmeasured
        self.executor: TunerView | None = None
        self.in_optimizer_step = False
        self.measuring = False
        self.generation = adapter.GenerationClock(self.clock.wall)
        self._stop_watching: Callable[[], None] | None = None
        self._started: float | None = None
        self._hinted = False
        self._resumed = False

    # ------------------------------------------------------------ events
    @hook
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, train_dataloader: DataLoader[Any] | None = None,
                       **kwargs: Any) -> None:
        self._resumed = state.global_step > 0            # the next epoch begin is a resume within an epoch
        if state.global_step > 0:
            advance_sampler(train_dataloader, int(state.epoch or 0))
        if getattr(args, "auto_find_batch_size", False):
            self.warn("auto_find_batch_size=True re-sizes by itself (restarting at step 0 with a drifting batch): the "
                      "tuner stays off. Turn auto_find_batch_size off to let the tuner keep the batch exact.")
            self.disabled = True
            return
        refusal = _cannot_cut(adapter.calling_trainer())
        if refusal:
            self.warn(refusal)
            self.disabled = True
            return
        executor = self.executor = Executor.for_tuner(args, state, self.bus, self.accept_unmeasured)
        if self.tune and not executor.managed and not self._hinted:   # said once: nothing will be tuned
            self._hinted = True                         # a note (INFO), not a warning: a meter-only user lost nothing
            self._bus.log.event(self.source, "note", TUNER_NEEDS_TRAIN_WITH_TUNING, step=state.global_step,
                            details=NoteDetails(needs="train_with_tuning"))
        self.world = world_size()
        self._bus.requests.on_smaller_batch_request(self._on_smaller_batch)
        self.in_optimizer_step = False
        self.measuring = executor.begin_train(args, state.global_step, state.max_steps)
        if self.measuring:
            self.device = DeviceLayer()
            self._stop_watching = adapter.watch_generation(model, self.generation) if model is not None else None

    @property
    def _executor(self) -> TunerView:
        """The run's executor, found at ``on_train_begin`` (the events after it may use it)."""
        if self.executor is None:
            raise RuntimeError("AdaptiveBatchTuner has no executor yet: it finds one at on_train_begin")
        return self.executor

    @hook
    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        resumed, self._resumed = self._resumed, False
        rng = self._executor.epoch_begins(state.global_step, float(state.epoch or 0), resumed)
        if rng is not None:
            set_rng_state(rng)                           # the epoch's iterator draws what it drew before the resume

    @hook
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._executor.step_begins(state.global_step)
        if self.measuring:
            self.device.synchronize()
            self._started = self.clock.wall()
            self.generation.reset()

    @hook
    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        self.in_optimizer_step = True

    @hook
    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
        self.in_optimizer_step = False

    @hook
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """transformers wrote checkpoint-N (on_save follows a whole _save_checkpoint): this run's, if complete."""
        self._executor.saved(state.global_step)

    @hook
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        split, resizes = self._executor.step_ends(step)
        fields = {keys.TUNER_MICRO_BATCH: split.micro_batch, keys.TUNER_GRAD_ACCUM: split.grad_accum,
                  keys.TUNER_EFFECTIVE_BATCH: split.effective_batch(self.world), keys.TUNER_RESIZES: resizes}
        self._bus.log.record_step(step, fields)
        self._bus.merger.publish(fields)
        if self.measuring and self._started is not None:
            self._measure(args, step, control, self._started)

    def _measure(self, args: TrainingArguments, step: int, control: TrainerControl, started: float) -> None:
        self.device.synchronize()
        whole = self.clock.wall() - started
        ranked = whole if self.rank_by == "step" else max(0.0, whole - self.generation.seconds)
        used, limit = self._memory(step)
        rows = gather_floats([ranked, whole, used, limit], self.device.device)     # every rank judges alike
        ranked, whole = max(r[0] for r in rows), max(r[1] for r in rows)
        fits = all(r[2] <= r[3] for r in rows)
        stop, self.measuring = self._executor.measured_step(step, ranked, whole, max(r[2] for r in rows) / GB, fits)
        if stop:
            self._bus.continuing = True                    # a switch by stopping this train() (not in process)
            control.should_training_stop = True
        if not self.measuring:                  # the tuning finished: no more clocks
            self.close()

    def _memory(self, step: int) -> tuple[float, float]:
        """(bytes used at ``step``, the budget): the watchdog's reading of this step when it is attached (it owns
        them), else the device's reading and the default budget."""
        reading = self._bus.memory
        if reading is not None and reading.step == step:
            return reading.used, reading.budget
        sample = self.device.memory()
        return float(sample.used), budget_bytes(self.device.type, sample.device_limit, sample.hard_limit,
                                                sample.system_total, reachable=sample.reachable)

    def _on_smaller_batch(self, reason: str, step: int, control: TrainerControl | None = None,
                          rows: list[Any] | None = None, **_: Any) -> bool:
        """The watchdog asks for a smaller micro-batch: plan it. In train_with_tuning (one process per model) the
        re-size takes effect at the next step's begin, unless something stops the run at this step first; otherwise
        checkpoint now and stop this train() call. ``rows``: the next step's micro-batches when the watchdog asks
        after they were fetched (the rows the re-sized run must train at that step)."""
        executor = self._executor
        plan = executor.on_watchdog(reason, step, rows, acting=control is not None)
        if plan.stop_now and control is not None:
            self._bus.continuing = executor.managed
            control.should_save = True
            control.should_training_stop = True
        return plan.new is not None and plan.action in ("resize", "none")

    @hook
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()
        end = self._executor.train_ends(state.global_step, self.measuring, self._bus.continuing)
        self._bus.log.write_summary(self.source, {"split": end.split.as_args(), "session": end.session,
                                              "decisions": end.decisions})
        if not state.is_world_process_zero or self._bus.continuing:
            return
        if end.summary is not None:
            self._bus.console.say(end.summary)
        if end.switch is not None:
            new = end.switch
            checkpoint = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
            print(f"AdaptiveBatchTuner: memory asked for a smaller micro-batch at step {state.global_step}. "
                  f"A checkpoint is saved to {checkpoint}. Resume with the exact split "
                  f"{', '.join(f'{k}={v}' for k, v in new.as_args().items())} (effective batch unchanged):\n"
                  f"  trainer.args.per_device_train_batch_size = {new.micro_batch}; "
                  f"trainer.args.gradient_accumulation_steps = {new.grad_accum}; "
                  f"trainer.train(resume_from_checkpoint='{checkpoint}')\n"
                  f"or hf_perf_callbacks.train_with_tuning(trainer, resume_from_checkpoint='{checkpoint}'), which "
                  f"applies it from {os.path.join(str(args.output_dir), SPLIT_FILE)}; the recipe launcher does too.")

    def close(self) -> None:
        if self._stop_watching is not None:
            self._stop_watching()
            self._stop_watching = None


def advance_sampler(dataloader: DataLoader[Any] | None, epochs: int) -> int:
    """A resume that starts in epoch ``epochs`` (> 0) draws the order of that epoch, not of the first. transformers
    reseeds its own samplers per epoch (``set_epoch``), but a sampler that shuffles with a generator of its own and
    has no ``set_epoch`` (TRL's ``RepeatSampler``, GRPO's) draws one permutation per epoch from it: a fresh
    dataloader's sampler is advanced by the epochs already trained (as transformers 4 fast-forwarded skipped epochs).
    Returns the permutations drawn."""
    if dataloader is None or epochs <= 0:
        return 0
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None),
                    getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)):
        if (sampler is not None and hasattr(sampler, "set_epoch") is False
                and isinstance(getattr(sampler, "generator", None), torch.Generator)
                and getattr(sampler, "shuffle", False)):
            for _ in range(epochs):
                next(iter(sampler), None)                 # one permutation per epoch
            return epochs
    return 0


def find_callback(trainer: Trainer, cls: type[_Callback]) -> _Callback | None:
    return next((cb for cb in adapter.all_callbacks(trainer.callback_handler) if isinstance(cb, cls)), None)


def _cannot_cut(trainer: object) -> str | None:
    """Why the tuner cannot cut this run's batches into another split, said at its start (None: it can)."""
    if adapter.is_async_grpo(trainer):
        return ("AsyncGRPOTrainer packs its rollout queue's samples into rows with its own batcher (token_budget or a "
                "fixed count): the split does not decide its micro-batches, so the tuner stays off; lower "
                "token_budget to use less memory (the watchdog still measures and stops)")
    return None
