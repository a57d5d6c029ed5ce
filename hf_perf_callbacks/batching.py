"""Pure split math: every (micro-batch, accumulation) pair that keeps the effective batch — and GRPO's generation
batch — exactly the same. No torch, no transformers.

``effective = micro_batch × grad_accum × world`` (:meth:`Split.effective_batch`) is what one optimizer step trains
on. GRPO also generates ``generation = micro_batch × world × steps_per_generation`` (:meth:`Split.generation_batch`)
completions at a time; that number (a multiple of ``num_generations``: whole prompt groups) must not change either,
so ``steps_per_generation`` moves with the micro-batch. Never the ×0.9 drift of ``auto_find_batch_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .validation import check_number


@dataclass(frozen=True)
class Split:
    micro_batch: int
    grad_accum: int
    steps_per_generation: int | None = None   # GRPO only

    def __str__(self) -> str:
        spg = f", steps_per_generation={self.steps_per_generation}" if self.steps_per_generation else ""
        return f"{self.micro_batch}×{self.grad_accum}{spg}"

    def effective_batch(self, world_size: int = 1) -> int:
        """Samples (GRPO: completions) one optimizer step trains on over all ranks: micro × accumulation × world."""
        return self.micro_batch * self.grad_accum * world_size

    def generation_batch(self, world_size: int = 1) -> int | None:
        """GRPO completions generated at a time over all ranks: micro × world × ``steps_per_generation`` (None
        without ``steps_per_generation``: a plain Trainer)."""
        if self.steps_per_generation is None:
            return None
        return self.micro_batch * world_size * self.steps_per_generation

    def as_args(self) -> dict[str, int]:
        """The split as the trainer arguments that set it."""
        return {"per_device_train_batch_size": self.micro_batch, "gradient_accumulation_steps": self.grad_accum,
                **({"steps_per_generation": self.steps_per_generation} if self.steps_per_generation else {})}


def exact_splits(effective_batch: int, world_size: int = 1, generation_batch: int | None = None,
                 num_generations: int | None = None) -> list[Split]:
    """All exact splits, largest micro-batch first.

    Args:
        effective_batch: samples (GRPO: completions) per optimizer step over all ranks.
        world_size: data-parallel ranks.
        generation_batch: GRPO ``generation_batch_size`` (global); None for a plain Trainer.
        num_generations: GRPO completions per prompt; ``generation_batch`` must hold whole groups.
    """
    check_number("effective_batch", effective_batch, low=1, integer=True)
    check_number("world_size", world_size, low=1, integer=True)
    if effective_batch % world_size:
        raise ValueError(f"effective_batch={effective_batch} is not allowed: it must be a multiple of "
                         f"world_size={world_size}")
    if generation_batch is not None:
        check_number("generation_batch", generation_batch, low=1, integer=True)
        num_generations = check_number("num_generations", num_generations, low=2, integer=True)   # not None
        if generation_batch % num_generations:
            raise ValueError(f"generation_batch={generation_batch} is not allowed: it must be a multiple of "
                             f"num_generations={num_generations} (whole prompt groups)")
    splits = []
    for micro in range(effective_batch // world_size, 0, -1):
        per_step = micro * world_size
        if effective_batch % per_step:
            continue
        if generation_batch is None:
            splits.append(Split(micro, effective_batch // per_step))
        elif generation_batch % per_step == 0:
            splits.append(Split(micro, effective_batch // per_step, generation_batch // per_step))
    return splits


def next_smaller(current: Split, candidates: list[Split]) -> Split:
    """The largest candidate with a smaller micro-batch; ValueError when there is none."""
    smaller = [s for s in candidates if s.micro_batch < current.micro_batch]
    if not smaller:
        raise ValueError(f"no exact split smaller than {current} exists (candidates: "
                         f"{', '.join(map(str, candidates))}): the run does not fit even at micro-batch "
                         f"{min(s.micro_batch for s in candidates)}. Lower memory another way: activation "
                         f"checkpointing, a shorter max_completion_length, a smaller model or LoRA rank.")
    return smaller[0]
