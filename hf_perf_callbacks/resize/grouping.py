"""The facts that decide whether a run's loss depends on how its examples are grouped into micro-batches, read once
at the start of a run from the trainer (:func:`read_grouping`); the rule that judges them is pure
(:func:`hf_perf_callbacks.core.batching.exact_under`), and :meth:`Executor.judge_grouping
<hf_perf_callbacks.resize.executor.Executor.judge_grouping>` applies it to every candidate split once: the
tuning, the memory check, the re-size on an out-of-memory error and the watchdog's re-size use only the splits it
keeps, and the run says once why the others are left out and which setting makes every split exact.

=============================  ====================================================================================
fact                           read from
=============================  ====================================================================================
the trainer whose loss runs    the library class (transformers ``Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer``,
                               ``GRPOTrainer``, …) whose ``compute_loss`` the trainer's class inherits
a loss override                a ``compute_loss`` defined outside transformers and TRL, or a ``compute_loss_func``
                               (Trainer, SFTTrainer), whose code never reads ``num_items_in_batch``
the loss counts the step's     ``Trainer.model_accepts_loss_kwargs`` (or a ``compute_loss_func``) and a loss that
label tokens                   takes ``num_items_in_batch`` (the model's ``loss_function``, a ``forward`` naming it,
                               label smoothing, ``compute_loss_func``)
loss types                     ``args.loss_type`` (DPO: a list; GRPO: one), ``top_entropy_quantile``,
                               ``entropy_coef``/``use_adaptive_entropy`` (GRPO)
left padding                   the training collator's ``tokenizer.padding_side`` and whether the model's loss shifts
                               its labels (:func:`hf_perf_callbacks.platform.adapter.loss_shifts_labels`)
dropout, batch normalisation   the model's modules in training: a dropout with ``p > 0``, an attention dropout > 0,
                               a ``BatchNorm`` layer
examples per epoch             ``len(train_dataset)`` (None for an iterable dataset)
the rest                       ``dataloader_drop_last``, ``average_tokens_across_devices``, the world size and the
                               planned optimizer steps
=============================  ====================================================================================
"""
from __future__ import annotations

import dis
import inspect
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core.batching import Grouping
from ..platform import adapter

if TYPE_CHECKING:
    from transformers import Trainer

#: dropout layers (the lazy and feature variants subclass these)
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
#: normalisations over the micro-batch (the lazy variants subclass these)
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
#: the packages whose trainers' losses the rule knows (a class defined in any other is the user's)
LIBRARIES = ("transformers", "trl")


def read_grouping(trainer: Trainer, planned_steps: int | None, world: int) -> Grouping:
    """The run's :class:`~hf_perf_callbacks.core.batching.Grouping` (see the module docstring)."""
    args = trainer.args
    model = cast(torch.nn.Module, trainer.model)            # None only before the trainer's init
    owner, override = loss_owner(type(trainer))
    compute_loss_func = loss_func(trainer) if owner in ("Trainer", "SFTTrainer") else None
    if override is None and compute_loss_func is not None and not reads(compute_loss_func, "num_items_in_batch"):
        override = f"compute_loss_func ({getattr(compute_loss_func, '__name__', type(compute_loss_func).__name__)})"
    loss_type = getattr(args, "loss_type", None) if owner in ("DPOTrainer", "GRPOTrainer") else None
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type or ())
    return Grouping(trainer=owner, loss_override=override, counts_items=counts_items(trainer),
                    loss_types=types, top_entropy_quantile=float(getattr(args, "top_entropy_quantile", 1.0)),
                    entropy_coef=float(getattr(args, "entropy_coef", 0.0) or 0.0),
                    adaptive_entropy=bool(getattr(args, "use_adaptive_entropy", False)),
                    left_padding=pads_left(trainer), dropout=has_dropout(model),
                    batch_norm=any(isinstance(m, BATCH_NORMS) for m in model.modules()),
                    rows=examples(trainer.train_dataset), drop_last=bool(args.dataloader_drop_last),
                    planned_steps=planned_steps, world=world,
                    tokens_across_devices=bool(getattr(args, "average_tokens_across_devices", True)))


def loss_owner(cls: type) -> tuple[str, str | None]:
    """(the library trainer whose loss the class computes, a user override of ``compute_loss`` that never reads
    ``num_items_in_batch`` or None). An override that reads it (passes it on) counts as the library's loss."""
    override = None
    for klass in cls.__mro__:
        if "compute_loss" not in vars(klass):
            continue
        if klass.__module__.split(".")[0] in LIBRARIES:
            return klass.__name__, override
        if override is None and not reads(vars(klass)["compute_loss"], "num_items_in_batch"):
            override = f"{klass.__name__}.compute_loss"
    return cls.__name__, override


def reads(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function``'s code reads the argument ``name`` (or passes its ``**kwargs`` on, which may hold it);
    False when it has no Python code to read."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    code = getattr(function, "__code__", None)
    if code is None and callable(function):              # a callable object: its __call__
        code = getattr(getattr(type(function).__call__, "__func__", type(function).__call__), "__code__", None)
    if code is None:
        return False
    names = {name}
    if code.co_flags & inspect.CO_VARKEYWORDS:           # **kwargs: passing them on passes num_items_in_batch on
        names.add(code.co_varnames[code.co_argcount + code.co_kwonlyargcount
                                   + bool(code.co_flags & inspect.CO_VARARGS)])
    return _loads(code, names)


def _loads(code: CodeType, names: set[str]) -> bool:
    for instruction in dis.get_instructions(code):
        value = instruction.argval
        if instruction.opname.startswith("LOAD") and (value in names if isinstance(value, str)
                                                      else isinstance(value, tuple) and bool(names & set(value))):
            return True
        if instruction.opname == "LOAD_CONST" and inspect.iscode(value) and _loads(value, names):
            return True                                  # a nested function or comprehension reads it
    return False


def loss_func(trainer: Trainer) -> Callable[..., Any] | None:
    """The trainer's ``compute_loss_func`` when it is one (TRL 1.0's GRPOTrainer sets the string ``"non-None"``
    there to keep transformers from dividing its loss by the accumulation; its own loss never calls it)."""
    func = getattr(trainer, "compute_loss_func", None)
    return func if callable(func) else None


def counts_items(trainer: Trainer) -> bool:
    """Whether the Trainer's loss is summed over the optimizer step's label tokens and divided by their count:
    transformers passes ``num_items_in_batch`` (the model accepts loss keyword arguments, or a
    ``compute_loss_func`` is set) to a loss that takes it."""
    if loss_func(trainer) is not None:
        return True                                     # read or not: judged as a loss override
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return False
    if getattr(trainer, "label_smoother", None) is not None:
        return True                                     # transformers' label smoother divides by it
    model: Any = trainer.model                  # the model, or a peft wrapper with get_base_model()
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = adapter.unwrap_compiled(inner)
    try:
        loss_function: Any = inner.loss_function     # a PreTrainedModel's (typed Tensor | Module by torch's getattr)
    except (AttributeError, ValueError, KeyError):
        loss_function = None
    if loss_function is not None:
        return "num_items_in_batch" in inspect.signature(loss_function).parameters
    return "num_items_in_batch" in inspect.signature(inner.forward).parameters


def pads_left(trainer: Trainer) -> bool:
    """The training collator pads left and the model's loss shifts its labels (a causal language model)."""
    tokenizer = getattr(trainer.data_collator, "tokenizer", None)
    return getattr(tokenizer, "padding_side", None) == "left" and adapter.loss_shifts_labels(trainer)


def has_dropout(model: torch.nn.Module) -> bool:
    """A dropout with ``p > 0`` (a LoRA dropout too), or an attention dropout > 0 (an attention module's
    ``attention_dropout`` or float ``dropout``)."""
    for module in model.modules():
        if isinstance(module, DROPOUTS) and module.p > 0:
            return True
        for name in ("attention_dropout", "dropout"):
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def examples(dataset: Any) -> int | None:          # the user's dataset: any object, sized or not
    """Examples per epoch: ``len(dataset)``, None for an iterable dataset (or none)."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None
