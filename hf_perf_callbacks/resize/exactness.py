"""Exactness at the moment of change: whether a new split trains the rows of the step it starts with as the old split
would, shown on those rows, before that step trains.

A change of split (a re-size after an out-of-memory error, the watchdog's, a tuning trial, the memory check's, a
launcher's restart) is checked once, at the first optimizer step the new split runs, at that step's ``global_step`` and
model state, on the micro-batches the training loop fetched for it — nothing else is read: no dataset row, no collator
call, no stream row the run does not train. :func:`check` computes the step's accumulated gradients, through the
trainer's own ``training_step`` (so the run's collator, loss, NEFTune's noise hook, mixed precision and any auxiliary
loss are all in play), two ways, and compares their :mod:`~hf_perf_callbacks.core.sketch` es:

==========  ========================================================================================================
compared    when
==========  ========================================================================================================
``old``     the old split's own micro-batches of these rows (the fetch the old split made for this step: the step an
            out-of-memory error left, or the step after a switch was asked for) against the new split's, on the
            fewest rows both group whole (the ``lcm`` of their micro-batches, the window with the least padding)
            where both fetched the rows in one order, else the whole step; GRPO: the step's buffered completions
            (the rows it trains after generation) grouped both ways
``finer``   where the old split cannot run (it ran out of memory on these rows, or never fetched them: the memory
            check's move before the first step, a launcher's restart): one micro-batch of the new split against the
            same rows cut finer, at a size the device holds (the gradient of the step's rows cut one way and
            another)
==========  ========================================================================================================

The second way's gradient is computed again only when the two differ past the compute dtype's rounding (the noise
of the same grouping run twice, its rows in reverse order where the step draws no random numbers). The verdict is
``exact``, ``inexact`` (the parameter that differs, by how much) or ``unmeasured`` (why no comparison could be
made: every one ran out of memory, a single-row micro-batch with no old fetch to compare with, a sharded gradient,
images in GRPO's batch) — an unmeasured split is never used unless the run accepts it explicitly
(``AdaptiveBatchTuner(accept_unmeasured=True)``).

**Several ranks.** Every rank runs the same passes on its own rows through the model without its DDP wrapper (no
collective inside a pass but the step guard's own exchanges), over the whole step (a split deals a step's rows to the
ranks in another order), and the ranks' sketches are summed (a sketch is linear in the gradient): one verdict on every
rank. FSDP2's passes run through the sharded model, each parameter's reduced gradient gathered for its sketch;
DeepSpeed keeps its part of the reduced gradient inside its engine: its changes are unmeasured.

**No trace.** What the check changes is taken before the first pass and put back after the last (:class:`_Saved`, TRL's
metrics and GRPO's micro-batch counter by ``adapter.metrics_kept`` and ``adapter.inputs_as_given``; docs/exactness.md
lists it); the meter and the tests' sample recorder skip the passes
(:meth:`~hf_perf_callbacks.common.bus.RunBus.own_work`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core.batching import Split
from ..core.rowstream import row_digests
from ..core.sketch import Difference, Sketch, compare, rtol_for, sketch
from ..core.splitfile import ExactnessCheck
from ..platform import adapter
from ..platform.device import GB, DeviceLayer, RngState, gather_floats, is_oom_error, rng_state, set_rng_state
from .agreement import ResizeNeeded
from .release import free_memory

if TYPE_CHECKING:
    from transformers import Trainer


@dataclass
class Fetched:
    """Rows grouped as ``split`` groups them, as micro-batches, and the step's label count (``num_items_in_batch``):
    one optimizer step as the run holds it (the training loop's fetch; GRPO: the buffered completions the step
    trains), or the rows of a pass of the check (``split``'s args set for it: micro-batch, accumulation, GRPO's steps
    per generation)."""

    split: Split
    batches: list[Any]
    num_items: Any = None


class _OutOfMemory(Exception):
    """A pass ran out of memory on some rank (every rank raises it after the pass); ``candidate``: the new split's
    own pass."""

    def __init__(self, message: str, candidate: bool = False) -> None:
        super().__init__(message)
        self.candidate = candidate


def check(trainer: Trainer, kind: str, step: int, old: Split, new: Split, ours: Fetched, theirs: Fetched | None,
          *, grpo: bool = False, world: int = 1, unmeasurable: str | None = None) -> ExactnessCheck:
    """The check of the change ``old`` → ``new`` (``kind``) at optimizer step ``step`` (see the module docstring):
    ``ours`` is what the new split holds for the step, ``theirs`` what the old one fetched for it (None: it never
    did); ``unmeasurable``: why no check can run here (FSDP, DeepSpeed). The trainer, model and RNG are left as they
    were."""
    result = ExactnessCheck(step=step, kind=kind, old=old, new=new, verdict="unmeasured")
    started = time.perf_counter()
    if unmeasurable is not None:
        result.why = unmeasurable
        return result
    model = cast(torch.nn.Module, trainer.model)    # not its DDP wrapper: no collective inside a pass
    device = DeviceLayer()
    saved = _Saved(trainer, model)
    try:
        with adapter.metrics_kept(trainer), adapter.inputs_as_given(trainer, grpo):
            _decide(trainer, model, ours, theirs, grpo, world, saved.rng, result)
    except adapter.CannotReplay as cannot:
        result.why = f"the step's rows cannot be regrouped: {cannot}"
    finally:
        saved.restore()
    peak = device.memory().peak if device.type in ("cuda", "xpu") else None
    device.reset_peak()                    # the step's own peak, as the watchdog reads it, leaves the check out
    result.peak_gb = peak / GB if peak else None
    result.cost_sec = time.perf_counter() - started
    return result


def _decide(trainer: Trainer, model: torch.nn.Module, ours: Fetched, theirs: Fetched | None, grpo: bool,
            world: int, rng: RngState, result: ExactnessCheck) -> None:
    """The comparisons in turn until one runs (``result`` filled); the new split's own micro-batches running out of
    memory ends the check (it does not fit: ``fits`` False). Where no comparison could run, the new split's
    micro-batches are run alone, to tell a split that does not fit from one that fits unmeasured."""
    tried: list[str] = []
    candidate: Fetched | None = None
    try:
        for against, reference, candidate in comparisons(result.old, result.new, ours, theirs, grpo, world):
            try:
                _compare(trainer, model, reference, candidate, rng, world, result)
            except _OutOfMemory as error:
                if error.candidate:
                    raise
                free_memory(trainer, lambda key, message: None)
                tried.append(f"{against}: {error}")
                continue
            result.against = against
            return
        result.why = (f"every comparison ran out of memory ({'; '.join(tried)})" if tried else
                      _why_none(result.old, result.new, ours, theirs, grpo))
        alone = candidate or (Fetched(result.new, ours.batches, ours.num_items) if ours.batches and not grpo else None)
        if alone is not None:
            _pass(trainer, model, alone, rng, world, candidate=True)
            result.passes += 1
    except _OutOfMemory as error:               # the new split's own micro-batches: it does not fit
        free_memory(trainer, lambda key, message: None)
        result.fits, result.why = False, f"{result.new} ran out of memory on these rows ({error})"


def _why_none(old: Split, new: Split, ours: Fetched, theirs: Fetched | None, grpo: bool) -> str:
    if new.micro_batch == 1 and theirs is None and not grpo:
        return (f"the old split {old} did not fetch this step's rows and the new one holds one row a micro-batch: "
                f"no finer cut to compare with")
    return "the step's micro-batches cannot be cut into rows (a packed, padding-free batch) to compare"


# ------------------------------------------------------------ the comparisons
def comparisons(old: Split, new: Split, ours: Fetched, theirs: Fetched | None, grpo: bool,
                world: int) -> Iterator[tuple[str, Fetched, Fetched]]:
    """``(against, reference, candidate)`` in the order tried: the old split's grouping of the rows, then a finer cut
    of the new split's (see the module docstring)."""
    if grpo:
        rows = adapter.resplit_generation(ours.batches, 1)[0]       # the step's completions, one micro-batch
        window = math.lcm(old.micro_batch, new.micro_batch)
        part = _rows(rows, 0, window)
        yield "old", Fetched(old, _cut(part, old.micro_batch), None), Fetched(new, _cut(part, new.micro_batch), None)
    elif theirs is not None and theirs.batches and theirs.split != new:
        window = math.lcm(theirs.split.micro_batch, new.micro_batch)
        pair = _aligned(theirs, ours, window) if world == 1 else (theirs.batches, ours.batches)
        yield "old", Fetched(theirs.split, pair[0], theirs.num_items), Fetched(new, pair[1], ours.num_items)
    finer = _finer(new)
    if finer is None:
        return
    if grpo:
        part = _rows(rows, 0, new.micro_batch)
        yield "finer", Fetched(finer, _cut(part, finer.micro_batch), None), Fetched(new, [part], None)
        return
    batch = min(ours.batches, key=_size) if world == 1 else ours.batches[0]     # the least padded
    if _row_count(batch) != new.micro_batch:
        return                                  # a packed batch (or the epoch's short last one): no finer cut
    yield ("finer", Fetched(finer, _cut(batch, finer.micro_batch), ours.num_items),
           Fetched(new, [batch], ours.num_items))


def _finer(split: Split) -> Split | None:
    """The split of the same step with micro-batches a prime factor smaller (None: one row a micro-batch)."""
    m = split.micro_batch
    if m == 1:
        return None
    factor = next(p for p in range(2, m + 1) if m % p == 0)
    d = m // factor
    spg = split.steps_per_generation * factor if split.steps_per_generation is not None else None
    return Split(d, split.grad_accum * factor, spg)


def _aligned(theirs: Fetched, ours: Fetched, window: int) -> tuple[list[Any], list[Any]]:
    """The old and new split's micro-batches of the window of ``window`` rows with the least padding, when both
    fetched the step's rows in one order; else every micro-batch of the step (the same rows, as a multiset)."""
    old_m, new_m = theirs.split.micro_batch, ours.split.micro_batch
    old_rows = [d for b in theirs.batches for d in row_digests(b)]
    if old_rows != [d for b in ours.batches for d in row_digests(b)] or len(old_rows) % window:
        return theirs.batches, ours.batches
    per_old, per_new = window // old_m, window // new_m
    windows = len(old_rows) // window
    if any(_row_count(b) != old_m for b in theirs.batches) or any(_row_count(b) != new_m for b in ours.batches):
        return theirs.batches, ours.batches
    k = min(range(windows), key=lambda i: sum(_size(b) for b in theirs.batches[i * per_old:(i + 1) * per_old]))
    return theirs.batches[k * per_old:(k + 1) * per_old], ours.batches[k * per_new:(k + 1) * per_new]


def _size(batch: Any) -> int:
    """A micro-batch's padded size: the elements of its tensors."""
    values = batch.values() if isinstance(batch, Mapping) else [batch]
    return sum(v.numel() for v in values if isinstance(v, torch.Tensor))


def _row_count(batch: Any) -> int:
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim:
            return int(ids.shape[0])
        sizes = [len(v) for v in batch.values() if isinstance(v, (list, torch.Tensor)) and
                 (not isinstance(v, torch.Tensor) or v.ndim)]
        return max(sizes) if sizes else 0
    return 0


def _rows(batch: Any, start: int = 0, stop: int | None = None, reverse: bool = False) -> Any:
    """Rows ``start:stop`` of a micro-batch, in reverse order with ``reverse`` (its tensors and lists of one entry per
    row; anything else as it is)."""
    count = _row_count(batch)

    def part(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == count:
            return value[start:stop].flip(0) if reverse else value[start:stop]
        if isinstance(value, list) and len(value) == count:
            return value[start:stop][::-1] if reverse else value[start:stop]
        return value

    return {k: part(v) for k, v in batch.items()} if isinstance(batch, Mapping) else batch


def _cut(batch: Any, size: int) -> list[Any]:
    count = _row_count(batch)
    return [_rows(batch, i, i + size) for i in range(0, count, size)]


# ------------------------------------------------------------ the passes
def _compare(trainer: Trainer, model: torch.nn.Module, reference: Fetched, candidate: Fetched, rng: RngState,
             world: int, result: ExactnessCheck) -> None:
    """Fill ``result`` from the comparison of ``candidate`` with ``reference`` (the repeat of the reference only when
    they differ past rounding). :class:`_OutOfMemory` when a pass ran out of memory on any rank."""
    weight = next((p.dtype for p in model.parameters() if p.requires_grad), None)
    rtol = rtol_for(_compute_dtype(trainer, weight), weight)
    first = _pass(trainer, model, reference, rng, world)
    other = _pass(trainer, model, candidate, rng, world, candidate=True)
    passes, difference = 2, compare(first, first, other, rtol)
    if not difference.same:
        repeat = _pass(trainer, model, reference, rng, world, reverse=not first.drew_rng)
        passes, difference = 3, compare(first, repeat, other, rtol)
    result.passes += passes
    result.rows = sum(_row_count(b) for b in reference.batches)
    result.drew_rng = first.drew_rng or other.drew_rng
    result.sketch_bytes = other.nbytes * passes
    result.verdict = "exact" if difference.same else "inexact"
    result.why = "" if difference.same else _why(difference, first.drew_rng)


def _why(difference: Difference, drew_rng: bool) -> str:
    what = (f"{difference.where} differs by {difference.relative:.1e} of its size (rounding and noise allow "
            f"{difference.tolerance:.1e})")
    if drew_rng:
        return f"{what}; the step draws random numbers (dropout, embedding noise such as NEFTune) per micro-batch"
    return f"{what}; the loss depends on how the rows are grouped into micro-batches"


def _pass(trainer: Trainer, model: torch.nn.Module, cut: Fetched, rng: RngState, world: int,
          reverse: bool = False, candidate: bool = False) -> Sketch:
    """The gradients of ``cut``'s micro-batches, accumulated as ``cut.split``'s step accumulates them, through the
    trainer's own ``training_step``, from the RNG ``rng``; sketched (summed over the ranks), then dropped."""
    split = cut.split
    _set_split(trainer, split)
    set_rng_state(rng)
    batches = ([_rows(b, reverse=True) if _row_count(b) > 1 else b for b in reversed(cut.batches)] if reverse
               else cut.batches)           # reversed: the micro-batches and their rows, the same sums in another order
    loss, failed = _accumulate(trainer, model, batches, cut.num_items)
    drew = not _same_rng(rng, rng_state())
    if world > 1 and max(r[0] for r in gather_floats([float(failed is not None)])) > 0:
        failed = failed or MemoryError("out of memory on another rank")
    if failed is not None:
        model.zero_grad(set_to_none=True)
        raise _OutOfMemory(f"{split}: {str(failed).splitlines()[0][:80] if str(failed) else type(failed).__name__}",
                           candidate)
    mine = sketch(((n, p.grad) for n, p in model.named_parameters() if p.requires_grad), loss, drew)
    model.zero_grad(set_to_none=True)
    return _summed(mine) if world > 1 else mine


def _set_split(trainer: Trainer, split: Split) -> None:
    """``split`` in the trainer's args and its accumulation count, as the loop sets them for a step of it."""
    args = trainer.args
    args.per_device_train_batch_size, args.gradient_accumulation_steps = split.micro_batch, split.grad_accum
    if split.steps_per_generation is not None:
        args.steps_per_generation = split.steps_per_generation     # type: ignore[attr-defined]  # GRPO's config
    trainer.current_gradient_accumulation_steps = split.grad_accum     # the whole step's, as the loop sets it


def _accumulate(trainer: Trainer, model: torch.nn.Module, batches: list[Any],
                num_items: Any) -> tuple[float, BaseException | None]:
    """The micro-batches through ``training_step``: (their summed loss, the out-of-memory error that stopped them)."""
    loss = 0.0
    try:
        for inputs in batches:
            loss += float(trainer.training_step(model, inputs, num_items))
    except (torch.OutOfMemoryError, ResizeNeeded, RuntimeError, MemoryError) as error:
        if not (isinstance(error, ResizeNeeded) or is_oom_error(error)):
            raise
        return loss, error.with_traceback(None)
    return loss, None


def _summed(mine: Sketch) -> Sketch:
    """Every rank's sketch summed (the sketch of the summed gradients: a sketch is linear)."""
    flat = [*mine.projections.reshape(-1).tolist(), mine.loss, float(mine.drew_rng)]
    rows = gather_floats(flat)
    total = torch.tensor(rows, dtype=torch.float64).sum(dim=0)
    n = mine.projections.numel()
    return Sketch(mine.names, total[:n].view_as(mine.projections), float(total[n]), bool(total[n + 1] > 0))


def _same_rng(a: RngState, b: RngState) -> bool:
    """Whether torch's CPU and CUDA generators are where they were (Python's and NumPy's are not compared:
    transformers' own bookkeeping may draw from them)."""
    if not torch.equal(a[2], b[2]):
        return False
    if a[3] is None or b[3] is None:
        return a[3] is b[3]
    return all(torch.equal(x, y) for x, y in zip(a[3], b[3]))


def _compute_dtype(trainer: Trainer, weight: torch.dtype | None) -> torch.dtype:
    """The dtype the step's matrix products run in: the mixed precision's when set, else the trainable weights'
    (``weight``)."""
    args = trainer.args
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return weight if weight is not None else torch.float32


class _Saved:
    """What the check changes, put back by :meth:`restore`: the split in args (GRPO: its steps per generation), the
    trainer's accumulation count, the model's gradients, buffers and training mode, the RNG."""

    def __init__(self, trainer: Trainer, model: torch.nn.Module) -> None:
        self.trainer, self.model = trainer, model
        args = trainer.args
        self.split = (args.per_device_train_batch_size, args.gradient_accumulation_steps,
                      getattr(args, "steps_per_generation", None))
        self.accumulation = getattr(trainer, "current_gradient_accumulation_steps", None)
        self.grads = {n: p.grad for n, p in model.named_parameters()}
        self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.training = model.training
        model.zero_grad(set_to_none=True)
        self.rng = rng_state()

    def restore(self) -> None:
        args, model = self.trainer.args, self.model
        args.per_device_train_batch_size, args.gradient_accumulation_steps, spg = self.split
        if spg is not None:
            args.steps_per_generation = spg             # type: ignore[attr-defined]  # GRPO's config
        if self.accumulation is not None:
            self.trainer.current_gradient_accumulation_steps = self.accumulation
        for name, param in model.named_parameters():
            param.grad = self.grads.get(name)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                kept = self.buffers.get(name)
                if kept is not None and kept.shape == buffer.shape:
                    buffer.copy_(kept)
        model.train(self.training)
        set_rng_state(self.rng)
