"""AdaptiveBatchTuner and train_with_tuning: the fastest micro-batch that fits, the effective batch kept exact.

The Hugging Face loop cannot change the dataloader's batch size mid-run, and changing gradient accumulation alone
skews epoch geometry, the LR horizon and GRPO's sampler. What works is **checkpoint → resume with a new split**
(same effective batch and, for GRPO, the same generation batch). :func:`train_with_tuning` owns that loop:

1. *Pre-flight probe* (optional): a few real optimizer steps per exact split at the worst-case length (GRPO:
   completions forced to ``max_completion_length``; otherwise the longest examples), largest micro-batch first,
   at learning rate 0 with weights, RNG and callbacks restored afterwards; it picks the split with the shortest
   median step time minus generation (``rank_by="non_generation"``, the default: the generation batch is the same
   for every split, and HF ``generate`` is launch-bound and jitters by tens of percent, so whole step times rank by
   noise) or the shortest whole step time (``"step"``), among those whose peak memory stays under the watchdog's
   budget.
2. *At run time:* on the watchdog's request for a smaller micro-batch, or a recognised out-of-memory error, it
   saves a checkpoint (or falls back to the last one if the error struck inside ``optimizer.step``), switches to the
   next smaller exact split and resumes in the same process. Under several ranks every micro-batch finishes on
   every rank before gradients are exchanged and the ranks agree on OOMs first, so an OOM anywhere in one rank's
   step (generation, forward, backward) re-sizes every rank together (see :func:`_guard_steps`).

The split and every decision are kept in ``<output_dir>/tuner_split.json`` (and the checkpoint's callback state),
so a resumed run starts at the tuned split; without ``train_with_tuning`` a re-size request saves, stops cleanly
and prints the split and the command to resume with.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from .base import PerfCallback
from .batching import Split, exact_splits, next_smaller
from .device import (GB, DeviceLayer, average_across_ranks, device_of, gather_floats, is_main_process,
                     is_oom_error, rng_state, set_rng_state, world_size)
from .stats import check_flag, check_number, median
from .watchdog import SIGNAL_SMALLER_BATCH, MemoryWatchdog

logger = logging.getLogger("hf_perf_callbacks")

SPLIT_FILE = "tuner_split.json"


class ResizeNeeded(RuntimeError):
    """Raised inside the training step on every rank when any rank ran out of memory in that micro-batch."""


def current_split(args) -> Split:
    spg = getattr(args, "steps_per_generation", None)
    return Split(args.per_device_train_batch_size, args.gradient_accumulation_steps, spg)


def apply_split(trainer, split: Split) -> None:
    """Set a split on a trainer's args in place (GRPO reads these live; the dataloader is rebuilt by train())."""
    args = trainer.args
    args.per_device_train_batch_size = split.micro_batch
    args.gradient_accumulation_steps = split.grad_accum
    if split.steps_per_generation is not None:
        args.steps_per_generation = split.steps_per_generation
        args.generation_batch_size = split.micro_batch * world_size() * split.steps_per_generation
    trainer._train_batch_size = args.train_batch_size


def saved_split(output_dir: str) -> dict | None:
    """The split recorded by a tuner that re-sized an earlier run in ``output_dir`` (None when there is none)."""
    path = os.path.join(output_dir, SPLIT_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["split"]
    except (OSError, ValueError, KeyError) as error:
        logger.warning("[tuner] ignoring unreadable %s: %s", path, error)
        return None


class AdaptiveBatchTuner(PerfCallback):
    """Keeps the fastest exact micro-batch / accumulation split that fits (see the module docstring).

    Args:
        probe: run the pre-flight probe in :func:`train_with_tuning` (a fresh run only).
        probe_steps: measured optimizer steps per candidate (one extra warm-up step runs first).
        max_micro_batch: largest micro-batch the probe tries (None: up to the whole effective batch per rank).
        probe_patience: stop probing smaller splits once this many in a row were slower than the best.
        rank_by: ``"non_generation"`` (step time minus generation time) or ``"step"`` (whole step time).

    Logged keys:

    =========================  =======  ==================================================
    key                        unit     meaning
    =========================  =======  ==================================================
    ``tuner/micro_batch``      samples  per-device micro-batch now
    ``tuner/grad_accum``       steps    gradient accumulation now
    ``tuner/effective_batch``  samples  micro-batch × accumulation × world (constant)
    ``tuner/resizes``          count    re-sizes so far
    =========================  =======  ==================================================
    """

    source = "tuner"

    def __init__(self, probe: bool = True, probe_steps: int = 2, max_micro_batch: int | None = None,
                 probe_patience: int = 1, rank_by: str = "non_generation"):
        check_flag("probe", probe)
        if rank_by not in ("step", "non_generation"):
            raise ValueError(f"rank_by={rank_by!r} is not allowed: expected 'step' or 'non_generation'")
        check_number("probe_steps", probe_steps, low=1, integer=True)
        check_number("max_micro_batch", max_micro_batch, low=1, integer=True, allow_none=True)
        check_number("probe_patience", probe_patience, low=1, integer=True)
        super().__init__(probe=probe, probe_steps=probe_steps, max_micro_batch=max_micro_batch,
                         probe_patience=probe_patience, rank_by=rank_by)
        self.decisions: list[dict] = []
        self.split: Split | None = None
        self.pending: dict | None = None
        self.managed = False
        self.in_optimizer_step = False

    # ------------------------------------------------------------ geometry
    def candidates(self, args) -> list[Split]:
        world = world_size()
        split = current_split(args)
        effective = split.micro_batch * split.grad_accum * world
        if hasattr(args, "num_generations"):
            return exact_splits(effective, world, split.micro_batch * world * split.steps_per_generation,
                                args.num_generations)
        return exact_splits(effective, world)

    # ------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        self._args = args
        self.split = current_split(args)
        self.world = world_size()
        self.bus.subscribe(SIGNAL_SMALLER_BATCH, self._on_smaller_batch)
        self.pending = None
        self.in_optimizer_step = False
        for decision in self.decisions:          # the probe ran before any trainer event: log it now, once
            if decision["kind"] == "probe" and not decision.get("logged"):
                decision["logged"] = True
                self.bus.event(self.source, "decision", f"probe: {_fmt(decision['old'])} → {_fmt(decision['new'])} "
                               f"({decision['reason']})", step=0, old_split=decision["old"],
                               new_split=decision["new"])

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.in_optimizer_step = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.in_optimizer_step = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.decisions and "recovery_sec" not in self.decisions[-1] and "resized_at" in self.decisions[-1]:
            self.decisions[-1]["recovery_sec"] = time.time() - self.decisions[-1]["resized_at"]
        s = current_split(args)                          # the split this step ran with (a decision applies later)
        fields = {"tuner/micro_batch": s.micro_batch, "tuner/grad_accum": s.grad_accum,
                  "tuner/effective_batch": s.micro_batch * s.grad_accum * self.world,
                  "tuner/resizes": sum(d["kind"] != "probe" for d in self.decisions)}
        self.bus.record_step(state.global_step, fields)
        self.bus.publish(fields)

    def _on_smaller_batch(self, reason: str, step: int, control=None, **_) -> bool:
        """The watchdog asks for a smaller micro-batch: plan it, checkpoint now and stop this train() call."""
        if self.pending is not None or control is None:
            return self.pending is not None
        try:
            new = next_smaller(self.split, self.candidates(self._args))
        except ValueError:
            return False                                 # nothing smaller: the watchdog stops instead
        self.pending = self._decide("watchdog", reason, self.split, new, step)
        control.should_save = True
        control.should_training_stop = True
        return True

    def on_init_end(self, args, state, control, **kwargs):
        self._args = args

    def on_train_end(self, args, state, control, **kwargs):
        summary = {"type": "summary", "source": self.source, "split": self.split.as_dict(),
                   "decisions": self.decisions}
        self.bus.write(summary)
        if self.decisions and state.is_world_process_zero:
            print(self.format_summary())
        if self.pending and not self.managed and state.is_world_process_zero:
            new = Split(**self.pending["new"])
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            print(f"AdaptiveBatchTuner: memory asked for a smaller micro-batch at step {state.global_step}. "
                  f"A checkpoint is saved to {checkpoint}. Resume with the exact split "
                  f"{', '.join(f'{k}={v}' for k, v in new.as_dict().items())} (effective batch unchanged):\n"
                  f"  trainer.args.per_device_train_batch_size = {new.micro_batch}; "
                  f"trainer.args.gradient_accumulation_steps = {new.grad_accum}; "
                  f"trainer.train(resume_from_checkpoint='{checkpoint}')\n"
                  f"or use hf_perf_callbacks.train_with_tuning(trainer), which does this by itself; the recipe "
                  f"launcher picks the split up from {os.path.join(args.output_dir, SPLIT_FILE)}.")

    # ------------------------------------------------------------ decisions
    def _decide(self, kind: str, reason: str, old: Split, new: Split, step: int) -> dict:
        decision = {"kind": kind, "step": step, "reason": reason, "old": asdict(old), "new": asdict(new),
                    "time": time.time()}
        self.decisions.append(decision)
        self.split = new
        self._persist()
        if self.bus is not None:
            self.bus.event(self.source, "decision", f"{kind}: {old} → {new} at step {step} ({reason})", step=step,
                           old_split=asdict(old), new_split=asdict(new))
        return decision

    def _persist(self) -> None:
        """Write the split and decisions (atomically; a failure is a warning, never an error on one rank only)."""
        args = getattr(self, "_args", None)
        if args is None or not is_main_process():
            return
        path = os.path.join(args.output_dir, SPLIT_FILE)
        try:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"split": self.split.as_dict(), "decisions": self.decisions}, f, indent=1,
                          default=str)
            os.replace(path + ".tmp", path)
        except OSError as error:
            logger.warning("[tuner] could not write %s: %s", path, error)

    def export(self) -> dict:
        return {"decisions": self.decisions}

    def load(self, saved: dict) -> None:
        if not self.decisions:          # a new process; in-process resumes keep their own (newer) history
            self.decisions = list(saved.get("decisions", []))

    def format_summary(self) -> str:
        lines = ["== AdaptiveBatchTuner summary ==", f"split: {self.split}"]
        for d in self.decisions:
            extra = f", recovered in {d['recovery_sec']:.2f} s" if "recovery_sec" in d else ""
            lines.append(f"step {d['step']}: {d['kind']} {_fmt(d['old'])} → {_fmt(d['new'])} ({d['reason']}{extra})")
        return "\n".join(lines)


# ---------------------------------------------------------------- the loop
def train_with_tuning(trainer, resume_from_checkpoint: str | bool | None = None, probe: bool | None = None,
                      max_resizes: int = 8):
    """``trainer.train()`` that probes for the fastest fitting split and survives re-sizes and OOM.

    Returns the last ``TrainOutput``. Raises the original error when it is not an out-of-memory error, or when no
    smaller exact split is left.
    """
    check_number("max_resizes", max_resizes, low=0, integer=True)
    if probe not in (None, True, False):
        raise ValueError(f"probe={probe!r} is not allowed: expected True, False or None (the tuner's setting)")
    tuner = _find(trainer, AdaptiveBatchTuner)
    if tuner is None:
        tuner = AdaptiveBatchTuner()
        trainer.add_callback(tuner)
    tuner.managed = True
    tuner._args = trainer.args
    output_dir = trainer.args.output_dir
    if resume_from_checkpoint is True or resume_from_checkpoint == "last":
        resume_from_checkpoint = get_last_checkpoint(output_dir)
    saved = saved_split(output_dir) if resume_from_checkpoint else None
    started = time.time()
    restore = _guard_steps(trainer)
    try:
        if saved:
            apply_split(trainer, Split(saved["per_device_train_batch_size"], saved["gradient_accumulation_steps"],
                                       saved.get("steps_per_generation")))
        elif (tuner.config["probe"] if probe is None else probe) and not resume_from_checkpoint:
            _probe(trainer, tuner)
        for _ in range(max_resizes + 1):
            try:
                output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            except Exception as error:  # noqa: BLE001 - only OOMs are handled, the rest is re-raised
                if not _recoverable(error):
                    raise
                tuner = _find(trainer, AdaptiveBatchTuner) or tuner
                resume_from_checkpoint = _recover_from_oom(trainer, tuner, error, started)
                continue
            # a resumed run with restore_callback_states_from_checkpoint holds a new tuner instance
            tuner = _find(trainer, AdaptiveBatchTuner) or tuner
            tuner.managed = True
            if tuner.pending is None:
                return output
            tuner.pending["resized_at"] = time.time()
            resume_from_checkpoint = os.path.join(output_dir, f"checkpoint-{trainer.state.global_step}")
            _prepare_resume(trainer, tuner.split)
        raise RuntimeError(f"train_with_tuning gave up after {max_resizes} re-sizes")
    finally:
        restore()


def _recoverable(error: BaseException) -> bool:
    """An out-of-memory error a new split can recover from: on one process any, under several ranks only one that
    every rank agreed on (:class:`ResizeNeeded`). An OOM outside the guarded training step (wrapping the model in
    DDP, ``optimizer.step``, evaluation, saving) left the other ranks inside some collective; re-sizing would pair
    mismatched collectives and hang until the NCCL timeout, so it is raised as it is and the launcher ends the
    run at once."""
    if isinstance(error, ResizeNeeded):
        return True
    if not is_oom_error(error):
        return False
    if world_size() > 1:
        logger.error("[tuner] out of memory outside the training step on this rank: under several ranks only an OOM "
                     "inside the step can be recovered together (the others are in a collective now). Free memory "
                     "or start with a smaller per_device_train_batch_size.")
        return False
    return True


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
    DeviceLayer(device_of(trainer.model)).empty_cache()              # room to save the checkpoint
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
            trainer._save_checkpoint(trainer.model, trial=None)
    decision = tuner._decide("oom", reason, old, new, step)
    decision["resized_at"] = time.time()
    decision["checkpoint"] = checkpoint
    _prepare_resume(trainer, new)
    logger.warning("[tuner] %s at step %d: resuming from %s with split %s", reason, step, checkpoint or "the start",
                   new)
    return checkpoint


def _checkpoint_of_this_run(output_dir: str, started: float, step: int) -> str | None:
    """The newest checkpoint written since ``started`` at a step ≤ ``step`` (never a stale one of an earlier run)."""
    checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is None or os.path.getmtime(checkpoint) < started:
        return None
    return checkpoint if int(checkpoint.rsplit("-", 1)[-1]) <= step else None


def _prepare_resume(trainer, split: Split) -> None:
    """Apply the split to a trainer whose last train() ended (see :func:`_reset_after_run`)."""
    apply_split(trainer, split)
    _reset_after_run(trainer, DeviceLayer(device_of(trainer.model)))


def _guard_steps(trainer):
    """Under several ranks, let every micro-batch finish on every rank before any gradient all-reduce, then agree
    on out-of-memory errors (see :class:`_OOMAgreement`): a rank that ran out of memory anywhere in its training
    step (GRPO's generation, the forward, the backward) raises ``ResizeNeeded`` on all ranks together instead of
    leaving the others waiting in a collective. The micro-batch that would have synchronized in its backward runs
    under ``no_sync`` and its gradients are averaged explicitly (one flattened all-reduce, its buffer allocated
    before the agreement) once all ranks have arrived. Any other error in one rank's step makes the other ranks
    raise :class:`PeerFailed` instead of waiting for the launcher's timeout. One process needs no guard: the error
    leaves ``train()``. Returns a function that removes the guard."""
    if world_size() == 1:
        return lambda: None
    original = trainer.training_step
    agreement = _OOMAgreement(device_of(trainer.model))
    agreement.install()

    def training_step(model, inputs, num_items_in_batch=None):
        syncing = trainer.accelerator.sync_gradients and hasattr(model, "no_sync")
        oom = failed = None
        # DDP broadcasts buffers at the start of each forward: a collective the other ranks must be told about
        # (under torch.compile accelerate wraps the DDP module in an OptimizedModule)
        ddp = getattr(model, "_orig_mod", model)
        hook = ddp.register_forward_pre_hook(agreement.check) if isinstance(ddp, DistributedDataParallel) else None
        with model.no_sync() if syncing else contextlib.nullcontext():
            agreement.begin()
            try:
                loss = original(model, inputs, num_items_in_batch)
                grads = _trainable_gradients(trainer.model) if syncing else []
                flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
            except Exception as error:  # noqa: BLE001
                if agreement.broken:         # it struck inside a collective: the ranks can no longer pair up
                    raise
                if isinstance(error, ResizeNeeded) or is_oom_error(error):
                    oom = error.with_traceback(None)    # let the step's tensors go before the exchange allocates
                else:
                    failed = error
            finally:
                agreement.inside = False
                if hook is not None:
                    hook.remove()
        any_oom, any_failed = agreement.settle(oom is not None, failed is not None)
        if failed is not None:
            raise failed
        if any_failed:
            raise PeerFailed("another rank failed inside its training step (its own traceback says why)")
        if any_oom:
            raise ResizeNeeded(f"out of memory on a rank: {oom or 'another rank'}") from oom
        if flat is not None:
            average_across_ranks(grads, flat)
        return loss

    trainer.training_step = training_step

    def restore():
        agreement.remove()
        if trainer.__dict__.get("training_step") is training_step:
            del trainer.training_step

    return restore


class PeerFailed(RuntimeError):
    """Raised on the other ranks when one rank's training step failed with an error other than out-of-memory."""


class _OOMAgreement:
    """Tells every rank about an out-of-memory error (or another failure) on any rank inside one training step,
    without deadlock.

    A training step holds collectives of its own (TRL gathers the rewards after generation and metrics after the
    loss forward; DDP broadcasts buffers in its forward). A rank that ran out of memory leaves its step and waits in
    :meth:`settle`; the others learn of it at their next collective of the step, before which :meth:`check` runs
    one small exchange (it pairs with the waiting rank's), leave the step too, and every rank raises together.
    Automatic micro-batching in MosaicML Composer agrees the same way. Collectives are seen through the
    ``torch.distributed`` functions on the default group (what accelerate and TRL call), wrapped while the guard is
    installed; without an OOM the cost is one exchange per collective of the step and one at its end. Not seen:
    collectives on sub-groups (TRL's vLLM colocate mode with tensor parallelism) and ones that torch issues
    internally; an error raised *inside* a collective marks the agreement broken and is raised as it is."""

    COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
                   "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
                   "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list")

    def __init__(self, device):
        self.device = device
        self.inside = False        # within a guarded training step
        self.exchanging = False    # our own exchange is running (its all_gather passes through unchecked)
        self.broken = False        # an error escaped a collective of this step
        self.originals: dict = {}

    def install(self) -> None:
        for name in self.COLLECTIVES:
            original = getattr(torch.distributed, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)

            @functools.wraps(original)
            def checked(*args, _original=original, _signature=signature, **kwargs):
                if not self.inside or self.exchanging:
                    return _original(*args, **kwargs)
                group = _signature.bind_partial(*args, **kwargs).arguments.get("group")
                if group is None or group is torch.distributed.GroupMember.WORLD:
                    self.check()
                try:
                    return _original(*args, **kwargs)
                except BaseException:
                    self.broken = True
                    raise

            self.originals[name] = original
            setattr(torch.distributed, name, checked)

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(torch.distributed, name, original)
        self.originals.clear()

    def begin(self) -> None:
        self.inside, self.broken = True, False

    def exchange(self, oom: bool, finished: bool, failed: bool = False) -> tuple[bool, bool, bool]:
        """(some rank ran out of memory, every rank has left its step, some rank failed otherwise)."""
        self.exchanging = True
        try:
            rows = gather_floats([float(oom), float(finished), float(failed)], self.device)
        finally:
            self.exchanging = False
        return max(r[0] for r in rows) > 0, min(r[1] for r in rows) > 0, max(r[2] for r in rows) > 0

    def check(self, *_) -> None:
        """Before a collective of the step: leave the step if another rank ran out of memory or failed."""
        if self.inside and not self.exchanging:
            oom, _, failed = self.exchange(False, False)
            if failed:
                raise PeerFailed("another rank failed inside its training step (its own traceback says why)")
            if oom:
                raise ResizeNeeded("out of memory on another rank")

    def settle(self, oom: bool, failed: bool) -> tuple[bool, bool]:
        """After the step: exchange until every rank has left its step; (any rank ran out of memory, any failed)."""
        while True:
            any_oom, all_finished, any_failed = self.exchange(oom, True, failed)
            if all_finished:
                return any_oom, any_failed


def _trainable_gradients(model) -> list[torch.Tensor]:
    """Every trainable parameter's gradient (zeros where a parameter got none), for averaging like DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


# ---------------------------------------------------------------- the probe
class _ProbeTimer(TrainerCallback):
    """Times optimizer steps (minus generation) and tracks peak memory during a probe run."""

    def __init__(self, device: DeviceLayer):
        self.device = device
        self.steps: list[tuple[float, float]] = []   # (step seconds, generation seconds)
        self.peak = 0.0
        self.generation = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.start, self.generation = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.steps.append((time.perf_counter() - self.start, self.generation))
        self.peak = max(self.peak, float(self.device.memory().used))


def _probe(trainer, tuner: AdaptiveBatchTuner) -> Split:
    args = trainer.args
    device = DeviceLayer(device_of(trainer.model))
    watchdog = _find(trainer, MemoryWatchdog) or MemoryWatchdog()
    budget = min(r[0] for r in gather_floats([watchdog.budget_bytes(device)], device.device))   # the tightest rank
    limit = tuner.config["max_micro_batch"]
    candidates = [s for s in tuner.candidates(args) if limit is None or s.micro_batch <= limit]
    original = current_split(args)
    saved = _snapshot(trainer, tuner.config["probe_steps"])
    trials: list[dict] = []
    best: dict | None = None
    slower = 0
    key = "step_time" if tuner.config["rank_by"] == "step" else "split_time"
    started = time.perf_counter()
    try:
        for split in candidates:
            trial = _probe_one(trainer, split, device, tuner.config["probe_steps"])
            trial["fits"] = trial.get("error") is None and trial["peak"] <= budget
            trials.append(trial)
            if not trial["fits"]:
                continue
            if best is None or trial[key] < best[key]:
                best, slower = trial, 0
            elif trial[key] > 1.05 * best[key]:
                slower += 1
                if slower >= tuner.config["probe_patience"]:
                    break
    finally:
        _restore(trainer, saved)
    chosen = Split(**best["split"]) if best else original
    seconds = time.perf_counter() - started
    apply_split(trainer, chosen)
    tuner.split = chosen
    why = (f"fastest split under the {budget / GB:.2f} GB budget: {seconds:.1f} s probing "
           + "; ".join(_fmt_trial(t) for t in trials)) if best else "no candidate fitted: keeping the configured split"
    tuner.decisions.append({"kind": "probe", "step": 0, "reason": why, "old": asdict(original),
                            "new": asdict(chosen), "trials": trials, "probe_sec": seconds})
    tuner._persist()
    if is_main_process():
        print(f"AdaptiveBatchTuner probe: {original} → {chosen} ({why})")
    return chosen


def _probe_one(trainer, split: Split, device: DeviceLayer, steps: int) -> dict:
    apply_split(trainer, split)
    trainer.args.max_steps = steps + 1
    timer = _ProbeTimer(device)
    trainer.callback_handler.callbacks = [cb for cb in trainer.callback_handler.callbacks
                                          if type(cb).__name__ == "DefaultFlowCallback"] + [timer]
    model = trainer.model
    original_generate = model.__dict__.get("generate")
    generate = model.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            timer.generation += time.perf_counter() - start

    model.generate = timed_generate
    device.reset_peak()
    trial = {"split": asdict(split)}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001
        if not _recoverable(error):
            raise
        trial["error"] = f"out of memory: {str(error).splitlines()[0][:120]}"
    finally:
        if original_generate is None:
            model.__dict__.pop("generate", None)
        else:
            model.generate = original_generate
        _reset_after_run(trainer, device)
    measured = timer.steps[1:] or timer.steps
    failed = "error" in trial or not measured
    split_time = median([s - g for s, g in measured]) if not failed else 0.0
    step_time = median([s for s, _ in measured]) if not failed else 0.0
    # every rank must judge the trial alike: the slowest rank's times, the highest peak, any rank's failure
    rows = gather_floats([split_time, step_time, timer.peak, float(failed)], device.device)
    if max(r[3] for r in rows) > 0:
        trial.setdefault("error", "out of memory on another rank")
    else:
        trial["split_time"], trial["step_time"] = max(r[0] for r in rows), max(r[1] for r in rows)
    trial["peak"] = max(r[2] for r in rows)
    return trial


def _snapshot(trainer, probe_steps: int) -> dict:
    args = trainer.args
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "max_steps", "learning_rate", "output_dir", "save_strategy", "logging_strategy",
            "report_to", "eval_strategy")
    saved = {"args": {k: getattr(args, k) for k in keys if hasattr(args, k)},
             "callbacks": list(trainer.callback_handler.callbacks),
             "dataset": trainer.train_dataset,
             "params": {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()
                        if p.requires_grad},
             "rng": rng_state(),
             "generation_config": getattr(trainer, "generation_config", None)}
    probe_dir = tempfile.mkdtemp(prefix="hf_perf_probe_")
    saved["probe_dir"] = probe_dir
    args.output_dir, args.learning_rate = probe_dir, 0.0
    for key, value in (("save_strategy", "no"), ("logging_strategy", "no"), ("eval_strategy", "no")):
        if hasattr(args, key):
            setattr(args, key, value)
    args.report_to = []
    if saved["generation_config"] is not None:          # GRPO: generate the longest completions
        config = saved["generation_config"]
        saved["min_new_tokens"] = config.min_new_tokens
        config.min_new_tokens = getattr(args, "max_completion_length", None)
    split = current_split(args)
    if hasattr(args, "num_generations"):              # prompts for every probe step of the largest candidate
        needed = split.micro_batch * world_size() * split.steps_per_generation // args.num_generations
    else:
        needed = split.micro_batch * split.grad_accum * world_size()
    trainer.train_dataset = _longest(trainer.train_dataset, needed * (probe_steps + 1))
    return saved


def _restore(trainer, saved: dict) -> None:
    args = trainer.args
    for key, value in saved["args"].items():
        setattr(args, key, value)
    trainer.callback_handler.callbacks = saved["callbacks"]
    trainer.train_dataset = saved["dataset"]
    if saved["generation_config"] is not None:
        saved["generation_config"].min_new_tokens = saved["min_new_tokens"]
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name in saved["params"]:
                param.copy_(saved["params"][name])
    set_rng_state(saved["rng"])
    trainer.state = type(trainer.state)()
    shutil.rmtree(saved["probe_dir"], ignore_errors=True)
    _reset_after_run(trainer, DeviceLayer(device_of(trainer.model)))


def _reset_after_run(trainer, device: DeviceLayer) -> None:
    """Forget the optimizer, scheduler and wrapper of the last train() (a resume restores them from the checkpoint),
    its gradients and GRPO's generation buffer and metric accumulators; give cached memory back."""
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.model_wrapped = trainer.model
    trainer.model.zero_grad(set_to_none=True)
    for name, value in (("_step", 0), ("_buffered_inputs", None)):
        if hasattr(trainer, name):
            setattr(trainer, name, value)
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict):
        for per_mode in metrics.values():
            per_mode.clear()
    device.empty_cache()


def _longest(dataset, count: int):
    """The ``count`` longest examples (worst-case memory), when lengths can be read; else the dataset itself."""
    try:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError):
        return dataset
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:max(1, count)]
    if hasattr(dataset, "select"):
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)


def _length(example) -> int:
    if "input_ids" in example:
        return len(example["input_ids"])
    prompt = example["prompt"]
    return len(prompt) if isinstance(prompt, str) else sum(len(m.get("content", "")) for m in prompt)


# ---------------------------------------------------------------- helpers
def _find(trainer, cls):
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)), None)


def _fmt(d: dict) -> str:
    return str(Split(d["micro_batch"], d["grad_accum"], d.get("steps_per_generation")))


def _fmt_trial(t: dict) -> str:
    split = _fmt(t["split"])
    if t.get("error"):
        return f"{split}: {t['error']}"
    return (f"{split}: {t['step_time']:.3f} s/step ({t['split_time']:.3f} s w/o generation), peak "
            f"{t['peak'] / GB:.2f} GB"
            + ("" if t["fits"] else " (over budget)"))
