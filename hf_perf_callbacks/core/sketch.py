"""Gradient sketches: whether two groupings of the same rows give the same accumulated gradients, in a few KB.

A sketch holds, for every trainable parameter, its gradient's projections on ``WIDTH`` seeded random vectors (the
gradient cut into blocks of ``BLOCK`` entries, each block projected on the same Gaussian block and weighted by a
seeded random sign, so no vector of the parameter's size is ever built), and the step's summed loss. Two sketches of
the same rows grouped two ways are equal up to rounding when the loss does not depend on the grouping; a loss that
does (a mean per micro-batch, noise drawn per micro-batch, a term added once per micro-batch) moves at least one
parameter's projections far past rounding. :func:`compare` judges a candidate against the reference, with the noise
of the reference run twice and the rounding of the compute dtype as the tolerance.

Pure torch: no trainer, no Hugging Face import. A sharded gradient (FSDP2's ``DTensor``) is gathered one parameter at
a time (``full_tensor``), so every rank sketches the whole gradient.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: projections per parameter
WIDTH = 4
#: entries projected at once (the random block: WIDTH × BLOCK float32, 1 MiB)
BLOCK = 65536
#: a sketch differing from the reference by more than this many times the reference's own noise is not the same
NOISE_FACTOR = 8.0
#: relative difference a regrouping's rounding can leave, by the dtype the step computes in
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
#: ... and by the dtype the gradients are kept in, where it is that low (weights trained in bf16 or fp16, no float32
#: master copy): each micro-batch's gradient is rounded to it before the sum, and each grouping's matrix shapes pick
#: other kernels whose roundings, kept in that dtype layer after layer, reach a deep layer's gradient (3.7e-2 seen
#: on a 24-layer bf16 model between 16×1 and 8×2 of equal-length rows, an exact grouping)
GRAD_RTOL = {torch.bfloat16: 1e-1, torch.float16: 5e-2}
#: a :class:`Difference`'s ``where`` when the summed loss, not a parameter's gradient, differs most
LOSS = "the loss"


@dataclass(frozen=True)
class Sketch:
    """One grouping's accumulated gradients, sketched: ``names`` of the trainable parameters, their projections
    (``projections``, shape ``(len(names), WIDTH)``, float64 on the CPU), the step's summed loss, and whether the
    step drew random numbers (``drew_rng``: dropout, embedding noise, any sampling inside the step)."""

    names: tuple[str, ...]
    projections: torch.Tensor
    loss: float
    drew_rng: bool = False

    @property
    def nbytes(self) -> int:
        return self.projections.numel() * self.projections.element_size()


@dataclass(frozen=True)
class Difference:
    """How a candidate's sketch differs from the reference: ``same`` when every parameter and the loss stay within
    tolerance; else the worst parameter (``where``), its relative difference and its tolerance."""

    same: bool
    where: str = ""
    relative: float = 0.0
    tolerance: float = 0.0


def sketch(named_grads: Iterable[tuple[str, torch.Tensor | None]], loss: float, drew_rng: bool = False,
           seed: int = 0) -> Sketch:
    """The sketch of the gradients ``named_grads`` (a missing gradient counts as zeros of no size)."""
    names: list[str] = []
    rows: list[torch.Tensor] = []
    random_block: dict[torch.device, torch.Tensor] = {}
    for index, (name, grad) in enumerate(named_grads):
        names.append(name)
        if grad is None:
            rows.append(torch.zeros(WIDTH, dtype=torch.float64))
            continue
        if hasattr(grad, "full_tensor"):     # FSDP2: a DTensor shard; every rank gathers it (same order everywhere)
            grad = grad.full_tensor()
        flat = grad.detach().reshape(-1).float()
        if grad.device not in random_block:
            generator = torch.Generator().manual_seed(seed)
            random_block[grad.device] = torch.randn(WIDTH, BLOCK, generator=generator).to(grad.device)
        block = random_block[grad.device]
        blocks = -(-flat.numel() // BLOCK)
        padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK - flat.numel())).view(blocks, BLOCK)
        signs = torch.randint(0, 2, (blocks,), generator=torch.Generator().manual_seed(seed * 1_000_003 + index))
        signs = (signs.to(torch.float32) * 2 - 1).to(grad.device)
        rows.append((signs @ (padded @ block.T)).double())
    by_device: dict[torch.device, list[int]] = {}       # one copy to the host per device, not one per parameter
    for index, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(index)
    host = [torch.zeros(0)] * len(rows)
    for indices in by_device.values():
        for index, row in zip(indices, torch.stack([rows[i] for i in indices]).cpu()):
            host[index] = row
    projections = torch.stack(host) if host else torch.zeros(0, WIDTH, dtype=torch.float64)
    return Sketch(tuple(names), projections, float(loss), drew_rng)


def compare(reference: Sketch, repeat: Sketch, candidate: Sketch, rtol: float) -> Difference:
    """Whether ``candidate`` (another grouping of the same rows) gives what ``reference`` gives: per parameter, the
    distance of the projections against the larger of ``NOISE_FACTOR`` × the reference's distance to ``repeat``
    (the same grouping run twice) and ``rtol`` × the reference's size (a parameter whose reference is near zero is
    held to ``rtol`` × the largest parameter's, so that a gradient appearing from nothing counts); the summed loss
    likewise."""
    if reference.names != candidate.names or reference.names != repeat.names:
        raise ValueError(f"the sketches cover different parameters ({len(reference.names)}, {len(repeat.names)} and "
                         f"{len(candidate.names)} names): sketch one model's gradients only")
    size = reference.projections.norm(dim=1)
    floor = float(size.max()) * 1e-3 if size.numel() else 0.0
    scale = size.clamp(min=floor if floor > 0 else 1e-30)
    noise = (repeat.projections - reference.projections).norm(dim=1)
    distance = (candidate.projections - reference.projections).norm(dim=1)
    tolerance = torch.maximum(NOISE_FACTOR * noise, rtol * scale)
    excess = distance / tolerance.clamp(min=1e-300)
    worst = int(excess.argmax()) if excess.numel() else -1
    loss_scale = max(abs(reference.loss), 1e-30)
    loss_tolerance = max(NOISE_FACTOR * abs(repeat.loss - reference.loss), rtol * loss_scale)
    loss_distance = abs(candidate.loss - reference.loss)
    if loss_distance > loss_tolerance and (worst < 0 or loss_distance / loss_tolerance > float(excess[worst])):
        return Difference(False, LOSS, loss_distance / loss_scale, loss_tolerance / loss_scale)
    if worst >= 0 and float(excess[worst]) > 1.0:
        return Difference(False, reference.names[worst], float(distance[worst] / scale[worst]),
                          float(tolerance[worst] / scale[worst]))
    return Difference(True)


def rtol_for(dtype: torch.dtype, grad_dtype: torch.dtype | None = None) -> float:
    """The rounding a regrouping may leave when the step computes in ``dtype`` (float32's for an unknown one) and
    keeps the gradients in ``grad_dtype``."""
    return max(RTOL.get(dtype, RTOL[torch.float32]), GRAD_RTOL.get(grad_dtype, 0.0) if grad_dtype else 0.0)
