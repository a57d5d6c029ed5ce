"""Cross-rank agreement on out-of-memory errors inside one training step, without deadlock.

A training step holds collectives of its own (TRL gathers the rewards after generation and the metrics after the
loss forward; DDP broadcasts buffers in its forward). A rank that ran out of memory leaves its step and waits in
:meth:`OOMAgreement.settle`; the others learn of it at their next collective of the step, before which
:meth:`OOMAgreement.check` runs one small exchange (it pairs with the waiting rank's), leave the step too, and every
rank raises :class:`ResizeNeeded` together. Automatic micro-batching in MosaicML Composer agrees the same way.

Collectives are seen through the ``torch.distributed`` functions on the default group (what accelerate, TRL and FSDP2
call; see :func:`~hf_perf_callbacks.platform.adapter.intercept_collectives`) and through a forward pre-hook on the DDP
module; without an OOM the cost is one exchange per collective of the step and one at its end. Under FSDP2 that is one
exchange before every all-gather and reduce-scatter, so the :class:`StepGuard` comes off once the split has been stable
for a few steps and is put back after each change (as MosaicML Composer does with its FSDP hooks). Not seen: collectives
on sub-groups (TRL's vLLM colocate mode with tensor parallelism, a 2-D device mesh) and ones that torch issues
internally; an error raised *inside* a collective marks the agreement broken and is raised as it is.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from ..platform import adapter
from ..platform.device import error_line, gather_floats, is_oom_error, training_device, world_size
from .oomsite import MICRO_BATCH, oom_site

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger("hf_perf_callbacks")


class ResizeNeeded(RuntimeError):
    """Raised inside the training step on every rank when any rank ran out of memory in that micro-batch; ``site``
    is where it struck (:mod:`~hf_perf_callbacks.resize.oomsite`; the same on every rank)."""

    def __init__(self, message: str, site: int = MICRO_BATCH) -> None:
        super().__init__(message)
        self.site = site


class PeerFailed(RuntimeError):
    """Raised on the other ranks when one rank's training step failed with an error other than out-of-memory."""


class OOMAgreement:
    """The flag exchange of one process (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inside = False        # within a guarded training step
        self.exchanging = False    # our own exchange is running (its all_gather passes through unchecked)
        self.broken = False        # an error escaped a collective of this step

    def exchange(self, oom: int | None, finished: bool, failed: bool = False) -> tuple[int | None, bool, bool]:
        """(the site of some rank's out-of-memory error, None when none ran out; every rank has left its step; some
        rank failed otherwise). A site no micro-batch fixes outranks the micro-batch's."""
        self.exchanging = True
        try:
            rows = gather_floats([-1.0 if oom is None else float(oom), float(finished), float(failed)], self.device)
        finally:
            self.exchanging = False
        site = int(max(r[0] for r in rows))
        return (None if site < 0 else site), min(r[1] for r in rows) > 0, max(r[2] for r in rows) > 0

    def check(self, *_args: object) -> None:
        """Before a collective of the step: leave the step if another rank ran out of memory or failed."""
        if self.inside and not self.exchanging:
            site, _, failed = self.exchange(None, False)
            if failed:
                raise PeerFailed("another rank failed inside its training step (its own traceback says why)")
            if site is not None:
                raise ResizeNeeded("out of memory on another rank", site)

    def collective_failed(self) -> None:
        if self.inside and not self.exchanging:
            self.broken = True

    def settle(self, oom: int | None, failed: bool) -> tuple[int | None, bool]:
        """After the step: exchange until every rank has left its step; (the site of any rank's out-of-memory error
        or None, any rank failed)."""
        while True:
            site, all_finished, any_failed = self.exchange(oom, True, failed)
            if all_finished:
                return site, any_failed


class StepGuard:
    """The cross-rank agreement installed on a trainer (see :func:`guard_training_step`): armed, every micro-batch's
    errors are agreed on before any rank's next collective; disarmed, the step runs as it is. ``stable_steps``
    (FSDP): it disarms itself once that many optimizer steps ran without a change since it was armed — every
    collective of FSDP then runs without an exchange before it — and :meth:`arm` puts it back (after a re-size or
    a switch); None keeps it armed (DDP, whose gradient averaging it takes over)."""

    def __init__(self, trainer: Trainer, stable_steps: int | None = None,
                 notify: Callable[[str, int], None] | None = None) -> None:
        self.trainer = trainer
        self.stable_steps = stable_steps
        self.notify = notify                       # (message, step): the guard coming off, for the perf log
        self.agreement = OOMAgreement(training_device())
        self._stop_intercepting: Callable[[], None] | None = None
        self.armed_since: int | None = None       # the first optimizer step the armed guard saw
        self._undo_step = adapter.replace_method(trainer, "training_step", self._make)
        self.arm()

    @property
    def armed(self) -> bool:
        return self._stop_intercepting is not None

    def arm(self) -> None:
        if not self.armed:
            self._stop_intercepting = adapter.intercept_collectives(self.agreement.check,
                                                                    self.agreement.collective_failed)
        self.armed_since = None

    def disarm(self) -> None:
        if self._stop_intercepting is not None:
            self._stop_intercepting()
            self._stop_intercepting = None

    def remove(self) -> None:
        self.disarm()
        self._undo_step()

    def _stable(self) -> bool:
        """Whether the split has run ``stable_steps`` optimizer steps since the guard was armed (decided at a step's
        first micro-batch from the global step, so every rank decides alike, outside any collective)."""
        step = self.trainer.state.global_step
        if self.armed_since is None:
            self.armed_since = step
        return self.stable_steps is not None and step - self.armed_since >= self.stable_steps

    def _make(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def training_step(model: torch.nn.Module, inputs: dict[str, Any], *args: Any,
                          **kwargs: Any) -> torch.Tensor:         # inputs: the user's micro-batch
            if self.armed and self._stable():
                self._come_off()
            if not self.armed:
                return original(model, inputs, *args, **kwargs)
            return self._agreed_step(original, model, inputs, *args, **kwargs)

        return training_step

    def _come_off(self) -> None:
        """The split ran ``stable_steps`` steps: the guard comes off (said once, at its step)."""
        self.disarm()
        if self.notify is not None:
            self.notify(f"the cross-rank step guard is off after {self.stable_steps} stable steps (its exchange "
                        f"before every collective costs a host round trip); it comes back after a re-size",
                        self.trainer.state.global_step)

    def _agreed_step(self, original: Callable[..., torch.Tensor], model: torch.nn.Module, inputs: dict[str, Any],
                     *args: Any, **kwargs: Any) -> torch.Tensor:
        """One micro-batch's training step under the agreement: what failed on any rank is raised on every rank."""
        trainer, agreement = self.trainer, self.agreement
        syncing = trainer.accelerator.sync_gradients and hasattr(model, "no_sync")
        oom = failed = buffers = site = None
        grads: list[torch.Tensor] = []
        # DDP broadcasts buffers at the start of each forward: a collective the other ranks must be told about
        ddp = adapter.unwrap_compiled(model)
        hook = ddp.register_forward_pre_hook(agreement.check) if isinstance(ddp, DistributedDataParallel) else None
        with model.no_sync() if syncing else contextlib.nullcontext():  # type: ignore[operator]  # DDP's (hasattr)
            agreement.inside, agreement.broken = True, False
            try:
                loss = original(model, inputs, *args, **kwargs)
                grads = _trainable_gradients(cast(torch.nn.Module, trainer.model)) if syncing else []
                buffers = average_buffers(grads) if grads else None    # allocated before the agreement
            except Exception as error:
                if agreement.broken:         # it struck inside a collective: the ranks can no longer pair up
                    raise
                if isinstance(error, ResizeNeeded) or is_oom_error(error):
                    site = error.site if isinstance(error, ResizeNeeded) else oom_site(error, trainer)
                    oom = error.with_traceback(None)    # let the step's tensors go before the exchange allocates
                else:
                    failed = error
            finally:
                agreement.inside = False
                if hook is not None:
                    hook.remove()
        self._raise_what_failed(site, failed, oom)
        if buffers is not None:
            average_across_ranks(grads, buffers)
        return loss

    def _raise_what_failed(self, site: int | None, failed: Exception | None, oom: BaseException | None) -> None:
        """Every rank learns what failed on any rank: its own error, :class:`PeerFailed` for another's, or
        :class:`ResizeNeeded` for an out-of-memory error anywhere."""
        any_site, any_failed = self.agreement.settle(site, failed is not None)
        if failed is not None:
            raise failed
        if any_failed:
            raise PeerFailed("another rank failed inside its training step (its own traceback says why)")
        if any_site is not None:
            where = error_line(oom) if oom is not None else "another rank"
            raise ResizeNeeded(f"out of memory on a rank: {where}", any_site) from oom


def guard_training_step(trainer: Trainer, stable_steps: int | None = None,
                        notify: Callable[[str, int], None] | None = None) -> StepGuard | None:
    """Under several ranks, the :class:`StepGuard` on ``trainer`` (see the module docstring): an out-of-memory error
    anywhere in one rank's step raises :class:`ResizeNeeded` on every rank together, any other error
    :class:`PeerFailed` on the others; under DDP the micro-batch that would synchronize runs under ``no_sync`` and its
    gradients are averaged by :func:`average_across_ranks` once every rank arrived. One process needs no guard: None."""
    if world_size() == 1:
        return None
    return StepGuard(trainer, stable_steps, notify)


def _trainable_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every trainable parameter's gradient (zeros where a parameter got none), for averaging like DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]        # type: ignore[misc]  # none is None now


#: the most a gradient average stages at once (DDP's default bucket): never a second copy of all the gradients
AVERAGE_BUCKET_BYTES = 25 * 1024**2


def average_buffers(tensors: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Staging buffers for :func:`average_across_ranks`, one per dtype of the tensors smaller than
    ``AVERAGE_BUCKET_BYTES``, each at most that size: made beforehand by a caller that must not allocate later."""
    small: dict[torch.dtype, tuple[int, torch.device]] = {}
    for t in tensors:
        if t.numel() * t.element_size() < AVERAGE_BUCKET_BYTES:
            n, _ = small.get(t.dtype, (0, t.device))
            small[t.dtype] = (n + t.numel(), t.device)
    return {dtype: torch.empty(min(n, AVERAGE_BUCKET_BYTES // torch.empty(0, dtype=dtype).element_size()),
                               dtype=dtype, device=device) for dtype, (n, device) in small.items()}


def average_across_ranks(tensors: list[torch.Tensor], buffers: dict[torch.dtype, torch.Tensor]) -> None:
    """Replace each tensor by its mean over the ranks: a tensor of ``AVERAGE_BUCKET_BYTES`` or more in its own
    all-reduce, in place; smaller ones packed through ``buffers`` (:func:`average_buffers`), one all-reduce per full
    buffer. Memory beyond the tensors: the buffers only."""
    world = world_size()
    packed: dict[torch.dtype, list[torch.Tensor]] = {dtype: [] for dtype in buffers}
    used = dict.fromkeys(buffers, 0)

    def flush(dtype: torch.dtype) -> None:
        view = buffers[dtype][:used[dtype]]
        offset = 0
        for t in packed[dtype]:
            view[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        torch.distributed.all_reduce(view)
        view /= world
        offset = 0
        for t in packed[dtype]:
            t.copy_(view[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        packed[dtype], used[dtype] = [], 0

    for t in tensors:
        buffer = buffers.get(t.dtype)
        if buffer is None or t.numel() > buffer.numel():                   # a bucket or more: on its own
            own = t if t.is_contiguous() else t.contiguous()
            torch.distributed.all_reduce(own)
            own /= world
            if own is not t:
                t.copy_(own)
            continue
        if used[t.dtype] + t.numel() > buffer.numel():
            flush(t.dtype)
        packed[t.dtype].append(t)
        used[t.dtype] += t.numel()
    for dtype in buffers:
        if packed[dtype]:
            flush(dtype)


def recoverable(error: BaseException) -> bool:
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
        logger.error("[tuner] out of memory outside the training step: several ranks recover only an OOM inside it; "
                     "lower per_device_train_batch_size")
        return False
    return True
