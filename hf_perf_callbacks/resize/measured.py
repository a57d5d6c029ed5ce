"""Exactness measured on the run's own rows: a split is trusted because the run's rows show it trains what the
configured split trains, not because its settings are on a list.

At the first optimizer step of a run that :func:`~hf_perf_callbacks.train_with_tuning` drives (inside ``train()``,
with the model as the run prepared it: NEFTune's noise hook, the mixed precision, the user's collator and loss in
place), before that step trains, :func:`measure` takes one optimizer step's rows of the training set (``E`` rows:
the configured effective batch of one rank, of spread lengths, :func:`step_rows`), and with the RNG put back before
each pass, computes the accumulated gradients the trainer's own ``training_step`` gives them

* grouped as each split the run may use that the rules of :mod:`~hf_perf_callbacks.batching` allow, on the fewest
  of those rows that it and the configured split both group whole (the ``lcm`` of their micro-batches: for a
  smaller split, one configured micro-batch; a loss that depends on the grouping shows it there as on a whole
  step, and a pass costs a fraction of a step),
* grouped as the configured split, on the same rows (the reference, once per row count), and again only when a
  split differs past the compute dtype's rounding: the noise of the same grouping run twice, its rows in reverse
  order where the step draws no random numbers (the same micro-batches summed in another order: what rounding
  alone moves; it can only widen the tolerance, so an equal split never needs it),

and compares their :mod:`~hf_perf_callbacks.sketch` es (a few KB each): a split whose gradients or summed loss differ
past the noise and the compute dtype's rounding is not exact for this run, whatever its settings, and the run says
so once, with the parameter that differs and the cause where one is seen (the step drew random numbers). The rules
still explain, and still skip the splits they refuse (a check that is sure to fail). Nothing of the check stays:
gradients, RNG, the trainer's accumulation count, args and TRL's logged metrics are put back; what it found and
cost (seconds, passes, sketch bytes) is the split file's ``measured`` record
(:class:`~hf_perf_callbacks.splitfile.ExactnessCheck`).

Not measured (the rules decide; :meth:`TuningSession.measure_exactness
<hf_perf_callbacks.resize.session.TuningSession.measure_exactness>` says why in the record): several ranks (each
rank's gradient is one part of the exchange), GRPO (its rows are generated in the step), a run that cannot re-size
(``max_resizes=0`` without the tuning), a run the memory check moved before its first step, a training set with
fewer rows than one optimizer step.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import adapter
from ..batching import Split
from ..device import RngState, rng_state, set_rng_state
from ..sketch import Difference, Sketch, compare, rtol_for, sketch
from ..splitfile import ExactnessCheck

if TYPE_CHECKING:
    from transformers import Trainer

#: the trainer's data collator: rows of the user's dataset (any objects) to one micro-batch (whatever the model takes)
Collate = Callable[[list[Any]], Any]

#: rows of the training set looked at to pick an optimizer step's rows of mixed lengths (times the step's rows)
POOL = 8


def measure(trainer: Trainer, model: torch.nn.Module, configured: Split, splits: Sequence[Split],
            dataset: Any, collate: Collate, wall: Callable[[], float] = time.perf_counter) -> ExactnessCheck:
    """Measure ``splits`` against ``configured`` on one optimizer step's rows of ``dataset`` collated by
    ``collate`` (see the module docstring); the trainer, model and RNG are left as they were."""
    started = wall()
    wanted = [s for s in splits if s != configured]
    rows = step_rows(dataset, configured.micro_batch * configured.grad_accum)
    result = ExactnessCheck(exact=[configured], rows=len(rows))
    if not wanted:
        return result
    if len(rows) < configured.micro_batch * configured.grad_accum or len(rows) < 2:
        result.skipped = f"the training set has fewer rows ({len(rows)}) than one optimizer step"
        return result
    weight = next((p for p in model.parameters() if p.requires_grad), None)
    rtol = rtol_for(_compute_dtype(trainer, model), weight.dtype if weight is not None else None)
    saved = _Saved(trainer, model)
    try:
        with adapter.metrics_kept(trainer):           # TRL's logged figures count none of the check's passes
            result.passes = _measure_all(trainer, model, configured, wanted, rows, collate, saved.rng, rtol, result)
    finally:
        saved.restore()
    result.cost_sec = wall() - started
    return result


def _measure_all(trainer: Trainer, model: torch.nn.Module, configured: Split, wanted: list[Split], rows: list[Any],
                 collate: Collate, rng: RngState, rtol: float, result: ExactnessCheck) -> int:
    """The passes; fills ``result``; returns how many ran. Each split is compared on the fewest rows both it and the
    configured split group whole (``lcm`` of the micro-batches: one configured micro-batch for a smaller split),
    with the configured grouping of the same rows, computed once per row count; the repeat of that grouping runs
    only when a split differs past rounding (noise can only widen the tolerance, so an equal split never needs
    it)."""
    references: dict[int, list[Sketch]] = {}      # rows → [reference, its repeat once run]
    passes = 0
    for split in wanted:
        count = math.lcm(configured.micro_batch, split.micro_batch)
        part, ours = rows[:count], Split(configured.micro_batch, count // configured.micro_batch)
        if count not in references:
            references[count] = [_pass(trainer, model, ours, part, collate, rng)]
            passes += 1
        sketches = references[count]
        candidate = _pass(trainer, model, Split(split.micro_batch, count // split.micro_batch), part, collate, rng)
        passes += 1
        difference = compare(sketches[0], sketches[-1], candidate, rtol)
        if not difference.same and len(sketches) == 1:
            sketches.append(_pass(trainer, model, ours, _reordered(part, sketches[0].drew_rng), collate, rng))
            passes += 1
            difference = compare(sketches[0], sketches[1], candidate, rtol)
        result.drew_rng = result.drew_rng or sketches[0].drew_rng
        if difference.same:
            result.exact.append(split)
        else:
            result.inexact[split] = _why(difference, sketches[0].drew_rng)
        result.sketch_bytes = max(result.sketch_bytes, candidate.nbytes * (1 + sum(map(len, references.values()))))
    result.rows = max(references, default=0)
    return passes


def _reordered(rows: list[Any], drew_rng: bool) -> list[Any]:
    """The rows of the repeat: reversed (the same micro-batches, each reversed, in reverse order: the same sums in
    another order, so on a device whose kernels are deterministic the repeat shows the rounding a regrouping leaves,
    e.g. a gradient that is zero but for rounding, such as a key projection's bias); as they were when the step draws
    random numbers, which follow the order of the rows."""
    return rows if drew_rng else rows[::-1]


def _why(difference: Difference, drew_rng: bool) -> str:
    what = (f"{difference.where} differs by {difference.relative:.1e} of its size (rounding and noise allow "
            f"{difference.tolerance:.1e})")
    if drew_rng:
        return f"{what}; the step draws random numbers (dropout, embedding noise such as NEFTune) per micro-batch"
    return f"{what}; the loss depends on how the rows are grouped into micro-batches"


def step_rows(dataset: Any, count: int) -> list[Any]:      # the user's dataset and rows: any objects
    """``count`` rows of ``dataset`` for the check: from its first ``POOL × count`` rows, ``count`` of spread
    lengths, longest first, in bit-reversed order (every prefix the check uses spans the lengths, and consecutive
    micro-batches hold different numbers of tokens and pad differently); an iterable dataset's first ``count``
    rows."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return list(itertools.islice(iter(dataset), count))
    size = len(dataset)
    pool = [dataset[i] for i in range(min(size, POOL * count))]
    if len(pool) <= count:
        return pool
    lengths = [_length(row) for row in pool]
    order = sorted(range(len(pool)), key=lambda i: (lengths[i], i))
    picked = [order[round(k * (len(order) - 1) / (count - 1))] for k in range(count)] if count > 1 else order[:1]
    longest_first = picked[::-1]
    bits = max(count - 1, 1).bit_length()
    spread = sorted(range(count), key=lambda k: int(f"{k:0{bits}b}"[::-1], 2))
    return [pool[longest_first[k]] for k in spread]


def _length(row: object) -> int:
    if isinstance(row, dict):
        for key in ("input_ids", "prompt", "text"):
            value = row.get(key)
            if value is not None and hasattr(value, "__len__"):
                return len(value)
    return 0


def _pass(trainer: Trainer, model: torch.nn.Module, split: Split, rows: list[Any], collate: Collate,
          rng: RngState) -> Sketch:
    """One optimizer step's gradients of ``rows`` grouped as ``split``, through the trainer's own
    ``get_batch_samples`` (the step's label count) and ``training_step``, from the RNG ``rng``; sketched, then
    the gradients are dropped."""
    args = trainer.args
    args.per_device_train_batch_size, args.gradient_accumulation_steps = split.micro_batch, split.grad_accum
    micro = split.micro_batch
    batches = [collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    set_rng_state(rng)
    batch_samples, num_items = trainer.get_batch_samples(iter(batches), len(batches), args.device)
    trainer.current_gradient_accumulation_steps = len(batch_samples)
    drawn_from = rng_state()
    loss = 0.0
    for inputs in batch_samples:
        loss += float(trainer.training_step(model, inputs, num_items))
    drew = not _same_rng(drawn_from, rng_state())
    result = sketch(((n, p.grad) for n, p in model.named_parameters() if p.requires_grad), loss, drew)
    model.zero_grad(set_to_none=True)
    return result


def _same_rng(a: RngState, b: RngState) -> bool:
    """Whether torch's CPU and CUDA generators are where they were (Python's and NumPy's are not compared:
    transformers' own bookkeeping may draw from them)."""
    if not torch.equal(a[2], b[2]):
        return False
    if a[3] is None or b[3] is None:
        return a[3] is b[3]
    return all(torch.equal(x, y) for x, y in zip(a[3], b[3]))


def _compute_dtype(trainer: Trainer, model: torch.nn.Module) -> torch.dtype:
    """The dtype the step's matrix products run in: the mixed precision's when set, else the trainable weights'."""
    args = trainer.args
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    weight = next((p for p in model.parameters() if p.requires_grad), None)
    return weight.dtype if weight is not None else torch.float32


class _Saved:
    """What the check changes, put back by :meth:`restore`: the split in args, the trainer's accumulation count,
    the gradients the model holds, the RNG."""

    def __init__(self, trainer: Trainer, model: torch.nn.Module) -> None:
        self.trainer, self.model = trainer, model
        args = trainer.args
        self.split = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
        self.accumulation = getattr(trainer, "current_gradient_accumulation_steps", None)
        self.grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        self.rng = rng_state()

    def restore(self) -> None:
        args = self.trainer.args
        args.per_device_train_batch_size, args.gradient_accumulation_steps = self.split
        if self.accumulation is not None:
            self.trainer.current_gradient_accumulation_steps = self.accumulation
        for name, param in self.model.named_parameters():
            param.grad = self.grads.get(name)
        set_rng_state(self.rng)
