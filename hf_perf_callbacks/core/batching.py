"""Pure split math: every (micro-batch, accumulation) pair that keeps the effective batch — and GRPO's generation
batch — exactly the same. No torch, no transformers.

``effective = micro_batch × grad_accum × world`` (:meth:`Split.effective_batch`) is what one optimizer step trains
on. GRPO also generates ``generation = micro_batch × world × steps_per_generation`` (:meth:`Split.generation_batch`)
completions at a time; that number (a multiple of ``num_generations``: whole prompt groups) must not change either,
so ``steps_per_generation`` moves with the micro-batch. Never the ×0.9 drift of ``auto_find_batch_size``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .validation import check_number


def is_grpo(args: object) -> bool:
    """Whether ``args`` are a GRPO run's (TRL's ``GRPOConfig`` and its kin, ``RLOOConfig``: they carry
    ``num_generations``, the completions per prompt, and ``steps_per_generation``, the optimizer steps one generation
    batch feeds): the one place the package decides the run kind. A config with ``num_generations`` alone (TRL's
    experimental ``GOLDConfig``, an SFT run that samples) is not: nothing of GRPO's step accounting applies to it."""
    return hasattr(args, "num_generations") and hasattr(args, "steps_per_generation")


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

    @staticmethod
    def generation_steps(generation_batch: int, micro_batch: int, world_size: int = 1) -> int | None:
        """The ``steps_per_generation`` at which ``micro_batch`` over ``world_size`` ranks generates
        ``generation_batch`` completions at a time (the inverse of :meth:`generation_batch`); None when none does."""
        per_step = micro_batch * world_size
        return generation_batch // per_step if generation_batch % per_step == 0 else None

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
        elif (spg := Split.generation_steps(generation_batch, micro, world_size)) is not None:
            splits.append(Split(micro, effective_batch // per_step, spg))
    return splits


def current_split(args: Any) -> Split:
    """The split a trainer's args hold (GRPO: with its ``steps_per_generation``)."""
    spg = getattr(args, "steps_per_generation", None) if is_grpo(args) else None
    return Split(args.per_device_train_batch_size, args.gradient_accumulation_steps, spg)


def candidates(args: Any, world: int) -> list[Split]:
    """Every split that keeps the run's effective batch (GRPO: and generation batch), largest micro-batch first."""
    split = current_split(args)          # a generation batch (GRPO's steps_per_generation) only for a GRPO run
    return exact_splits(split.effective_batch(world), world, split.generation_batch(world),
                        args.num_generations if is_grpo(args) else None)


def next_smaller(current: Split, candidates: list[Split]) -> Split:
    """The largest candidate with a smaller micro-batch; ValueError when there is none."""
    smaller = [s for s in candidates if s.micro_batch < current.micro_batch]
    if not smaller:
        raise ValueError(f"no exact split smaller than {current} exists (candidates: "
                         f"{', '.join(map(str, candidates))}): the run does not fit even at micro-batch "
                         f"{min(s.micro_batch for s in candidates)}. Lower memory another way: activation "
                         f"checkpointing, a shorter max_completion_length, a smaller model or LoRA rank.")
    return smaller[0]


# ---------------------------------------------------------------- which splits keep the run's loss
#: the trainers whose loss the rule below knows (any other computes a loss whose grouping it cannot tell)
KNOWN_TRAINERS = ("Trainer", "SFTTrainer", "DPOTrainer", "GRPOTrainer")
#: GRPO loss types that weigh every completion of an optimizer step alike whatever the split: a mean per sequence
#: averaged over full micro-batches (``grpo``, ``sapo``, ``luspo``), or a sum over a normaliser fixed by the
#: generation batch (``dr_grpo``: completions × ``max_completion_length``; ``dapo``, ``cispo``, ``vespo``: the
#: generation batch's tokens). ``bnpo`` divides by each micro-batch's tokens.
GRPO_EXACT_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")
#: DPO loss types that are a mean over each micro-batch's pairs of a per-pair term (exact when every micro-batch of
#: an optimizer step holds as many pairs under both splits); ``sft`` is a mean over each micro-batch's tokens,
#: ``aot``/``aot_unpaired`` sort the log-ratios within a micro-batch, ``bco_pair`` updates a running mean per
#: micro-batch
DPO_ROW_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "sppo_hard", "apo_zero", "apo_down",
                  "discopop", "sigmoid_norm")


@dataclass(frozen=True)
class Grouping:
    """What decides whether a run's loss depends on how its examples are grouped into micro-batches: facts read once
    at the run's start (:func:`hf_perf_callbacks.resize.grouping.read_grouping`), judged by :func:`exact_under`.

    ``trainer`` is the class whose loss the run computes (a subclass counts as the library class it derives from);
    ``loss_override`` names a ``compute_loss`` override or ``compute_loss_func`` that never reads
    ``num_items_in_batch``; ``counts_items`` says the Trainer's (SFT's) loss is summed over the optimizer step's
    label tokens and divided by their count (``num_items_in_batch`` reaches a loss that takes it); ``rows`` is the
    number of examples per epoch (None: unknown, an iterable dataset); ``planned_steps`` the optimizer steps the run
    trains (None: unknown)."""

    trainer: str = "Trainer"
    loss_override: str | None = None
    counts_items: bool = True
    loss_types: tuple[str, ...] = ()
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    adaptive_entropy: bool = False
    left_padding: bool = False
    dropout: bool = False
    batch_norm: bool = False
    rows: int | None = None
    drop_last: bool = False
    planned_steps: int | None = None
    world: int = 1
    tokens_across_devices: bool = True


@dataclass(frozen=True)
class Exactness:
    """The splits that train exactly what the configured split trains (``splits``, the configured one included),
    and, when others are left out, why (``reason``) and the setting that makes every split exact (``fix``)."""

    splits: tuple[Split, ...]
    reason: str | None = None
    fix: str | None = None

    def allows(self, split: Split) -> bool:
        return split in self.splits

    def message(self, candidates: list[Split]) -> str:
        """What is said once at the start (console, perf log, split file) when splits are left out."""
        left = [s for s in candidates if s not in self.splits]
        only = ", ".join(map(str, self.splits))
        return (f"the re-size and the tuning use only {only} for this run: {self.reason}, so "
                f"{', '.join(map(str, left))} would train something other than the configured split. {self.fix}")


def exact_under(grouping: Grouping, configured: Split, candidates: list[Split]) -> Exactness:
    """The candidates that keep the run's loss exactly as at the ``configured`` split (every candidate already
    keeps the effective batch, and GRPO's generation batch; see :func:`exact_splits`), under ``grouping``.

    A loss computed per micro-batch (a mean over its tokens, a quantile, a sort, batch statistics, left-padded
    targets, dropout masks) is exact at the configured split only. A mean over each micro-batch's examples is exact
    where every micro-batch of every optimizer step holds as many examples under both splits. The examples an epoch
    trains must be the same (``dataloader_drop_last``; under several ranks accelerate completes a last incomplete
    micro-batch with repeated examples). GRPO's dataloader draws whole generation batches, the same for every split.
    """
    whole = _per_micro_batch(grouping)
    if whole:
        return Exactness((configured,), "; ".join(why for why, _ in whole), " ".join(fix for _, fix in whole))
    if grouping.trainer == "GRPOTrainer":
        return Exactness(tuple(candidates))
    rows_exact, why, fix = _rows_rule(grouping, configured)
    kept = tuple(s for s in candidates if s == configured or rows_exact(s))
    if len(kept) == len(candidates):
        return Exactness(kept)
    return Exactness(kept, why, fix)


def _per_micro_batch(g: Grouping) -> list[tuple[str, str]]:
    """(why, fix) of every setting under which the loss depends on each micro-batch's own content."""
    found: list[tuple[str, str]] = []
    if g.trainer not in KNOWN_TRAINERS:
        found.append((f"{g.trainer} computes its own loss, whose weighting across micro-batches is not known here",
                      "Train with Trainer, SFTTrainer, DPOTrainer or GRPOTrainer to let every split be used."))
    if g.loss_override is not None:
        found.append((f"{g.loss_override} never reads num_items_in_batch, so its loss is not known to be normalised "
                      f"over the whole optimizer step",
                      "Pass num_items_in_batch on (super().compute_loss(model, inputs, return_outputs, "
                      "num_items_in_batch=num_items_in_batch)) or divide the summed loss by it to let every split be "
                      "used."))
    if g.trainer in ("Trainer", "SFTTrainer") and not g.counts_items:
        found.append(("the model's loss is a mean over each micro-batch (it does not take num_items_in_batch), so a "
                      "split weighs examples and tokens differently",
                      "A model whose loss takes num_items_in_batch (transformers' causal and masked language-model "
                      "losses), or a compute_loss_func that divides the summed loss by it, lets every split be "
                      "used."))
    if g.left_padding:
        found.append(("the training collator pads left: transformers counts the label tokens per padded "
                      "micro-batch, and the first token of a row shorter than its micro-batch's longest becomes a "
                      "target predicted from padding",
                      "Pad right for training (tokenizer.padding_side = 'right') to make every split exact."))
    if g.dropout:
        found.append(("dropout draws its masks per micro-batch, so another split draws other masks",
                      "Train without dropout (dropout probabilities 0, lora_dropout=0.0) to make every split exact."))
    if g.batch_norm:
        found.append(("batch normalisation takes its statistics over each micro-batch",
                      "A model without BatchNorm layers makes every split exact."))
    found += _grpo_per_micro_batch(g) if g.trainer == "GRPOTrainer" else []
    found += _dpo_per_micro_batch(g) if g.trainer == "DPOTrainer" else []
    if g.world > 1 and g.trainer in ("Trainer", "SFTTrainer") and not g.tokens_across_devices:
        found.append(("average_tokens_across_devices=False divides each rank's loss by that rank's own tokens, "
                      "which depend on how the examples are split into micro-batches",
                      "average_tokens_across_devices=True makes every split exact."))
    return found


def _grpo_per_micro_batch(g: Grouping) -> list[tuple[str, str]]:
    """GRPO's settings under which its loss depends on each micro-batch's own content."""
    found: list[tuple[str, str]] = []
    odd = [t for t in g.loss_types if t not in GRPO_EXACT_LOSSES]
    if odd:
        found.append((f"GRPOTrainer's loss_type={odd[0]!r} divides by each micro-batch's own tokens"
                      if odd[0] == "bnpo" else f"GRPOTrainer's loss_type={odd[0]!r} is not known here",
                      "loss_type='dapo', 'dr_grpo' or 'grpo' makes every split exact."))
    if g.top_entropy_quantile < 1.0:
        found.append((f"top_entropy_quantile={g.top_entropy_quantile} takes its quantile over each "
                      f"micro-batch's tokens", "top_entropy_quantile=1.0 makes every split exact."))
    if g.entropy_coef != 0.0 or g.adaptive_entropy:
        found.append((f"the entropy bonus (entropy_coef={g.entropy_coef}"
                      f"{', adaptive' if g.adaptive_entropy else ''}) is a mean over each micro-batch's "
                      f"tokens", "entropy_coef=0.0 (and use_adaptive_entropy=False) makes every split exact."))
    return found


def _dpo_per_micro_batch(g: Grouping) -> list[tuple[str, str]]:
    """DPO's loss types that depend on each micro-batch's own content."""
    found: list[tuple[str, str]] = []
    odd = [t for t in g.loss_types if t not in DPO_ROW_LOSSES]
    if odd:
        what = {"sft": "is a mean over each micro-batch's chosen tokens",
                "aot": "sorts the log-ratios within each micro-batch",
                "aot_unpaired": "sorts the log-ratios within each micro-batch",
                "bco_pair": "updates its running mean of rewards once per micro-batch"}.get(odd[0],
                                                                                        "is not known here")
        found.append((f"DPOTrainer's loss_type {odd[0]!r} {what}",
                      f"A loss_type without {odd[0]!r} makes every split exact."))
    return found


def _rows_rule(g: Grouping, configured: Split) -> tuple[Callable[[Split], bool], str | None, str | None]:
    """Which splits train the same examples per epoch, with micro-batches as full as the configured split's where
    the loss is a mean over each micro-batch (DPO) or accelerate completes the last one (several ranks)."""
    mean_rows = g.trainer == "DPOTrainer"
    effective = configured.effective_batch(g.world)
    if not (g.drop_last or mean_rows or g.world > 1):
        return (lambda split: True), None, None
    what = ("dataloader_drop_last=True" if g.drop_last else
            "DPOTrainer's mean over each micro-batch" if mean_rows else f"training on {g.world} ranks")
    if g.rows is None:
        return ((lambda split: False),
                f"{what} makes the examples of an epoch's last micro-batch matter, and the number of examples per "
                f"epoch is unknown (an iterable dataset)",
                "A dataset with a length whose size is a multiple of the effective batch lets every split be used.")
    rows = g.rows

    def kept(split: Split) -> int:                   # examples one epoch trains
        micro = split.micro_batch * g.world
        return rows - rows % micro if g.drop_last else rows

    def full(split: Split) -> bool:                  # every micro-batch of the epoch holds micro-batch examples
        return kept(split) % (split.micro_batch * g.world) == 0

    def exact(split: Split) -> bool:
        if g.planned_steps is not None and g.planned_steps * effective <= min(kept(split), kept(configured)):
            return True                              # the run ends before the first epoch's last step
        if kept(split) != kept(configured):
            return False
        if (mean_rows or g.world > 1) and not (full(split) and full(configured)):
            return False
        return True

    if g.drop_last:
        why = (f"dataloader_drop_last=True drops the last incomplete micro-batch of each epoch "
               f"({rows % (configured.micro_batch * g.world)} of {rows} examples at micro-batch "
               f"{configured.micro_batch}), so another micro-batch trains other examples")
    elif mean_rows:
        why = (f"DPOTrainer's loss is a mean over each micro-batch, and an epoch's {rows} pairs leave a last "
               f"micro-batch of {rows % (configured.micro_batch * g.world)} at micro-batch {configured.micro_batch}: "
               f"another split weighs those pairs differently")
    else:
        why = (f"on {g.world} ranks accelerate completes an epoch's last incomplete micro-batch ({rows} examples) "
               f"with repeated examples, which depend on the micro-batch")
    fix = (f"Examples per epoch a multiple of the effective batch ({effective}) make every split exact."
           if not g.drop_last else f"dataloader_drop_last=False, or examples per epoch a multiple of the effective "
                                   f"batch ({effective}), makes every split exact.")
    return exact, why, fix
