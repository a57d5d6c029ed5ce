"""Building the trainer's parts from a parsed recipe: the callbacks, the reward functions, the datasets, the
tokenizer and the model; a part that cannot be built raises :class:`~hf_perf_callbacks.train.arguments.RecipeError`
(one line) before training starts."""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

from .. import CALLBACKS
from .arguments import (
    FILE_FORMATS,
    TRL_REWARDS,
    RecipeArguments,
    RecipeError,
    as_dict,
    did_you_mean,
)


def _import_object(path: str, what: str):
    module_name, _, attr = path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RecipeError(f"{what} {path!r}: cannot import module {module_name!r} ({error})") from None
    if not hasattr(module, attr):
        raise RecipeError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _callback_class(name: str):
    import hf_perf_callbacks

    if "." in name:
        return _import_object(name, "callback")
    if name not in CALLBACKS:
        raise RecipeError(f"unknown callback {name!r}{did_you_mean(name, list(CALLBACKS))}: allowed are "
                          f"{', '.join(CALLBACKS)} or a dotted path pkg.module.Class")
    return getattr(hf_perf_callbacks, name)


def build_callbacks(names: list[str], kwargs: Mapping) -> list:
    """Instantiate the named callbacks with their ``callback_kwargs`` (keyed by class name or dotted path)."""
    if len(set(names)) != len(names):
        raise RecipeError(f"callbacks={names!r} names a callback twice: two instances of one class overwrite each "
                          f"other's saved state")
    for key in kwargs:
        short = key.rsplit(".", 1)[-1]
        if short not in CALLBACKS and key not in names and short not in (n.rsplit(".", 1)[-1] for n in names):
            raise RecipeError(f"callback_kwargs names unknown callback {key!r}"
                              f"{did_you_mean(short, list(CALLBACKS))}")
    callbacks = []
    for name in names:
        cls = _callback_class(name)
        options = kwargs.get(name, kwargs.get(name.rsplit(".", 1)[-1], {})) or {}
        if not isinstance(options, Mapping):
            raise RecipeError(f"callback_kwargs[{name!r}]={options!r} is not allowed: expected a mapping")
        try:
            callbacks.append(cls(**options))
        except (TypeError, ValueError) as error:         # the package's callbacks name the class and the key
            raise RecipeError(f"callback_kwargs[{name!r}]: {error}") from None
    return callbacks


def resolve_reward_funcs(names: list[str], max_completion_length: int) -> list:
    """TRL's reward registry names or dotted paths, as functions."""
    if not names:
        raise RecipeError("reward_funcs is empty: GRPO needs at least one reward function")
    funcs = []
    for name in names:
        if name in TRL_REWARDS:
            from trl import rewards

            func = getattr(rewards, name)
            if name == "get_soft_overlong_punishment":     # punish the last quarter of the recipe's length budget
                func = func(max_completion_len=max_completion_length,
                            soft_punish_cache=max(1, max_completion_length // 4))
        elif "." in name:
            func = _import_object(name, "reward function")
        else:
            raise RecipeError(f"unknown reward function {name!r}{did_you_mean(name, list(TRL_REWARDS))}: allowed are "
                              f"{', '.join(TRL_REWARDS)} or a dotted path pkg.module.func")
        if not callable(func):
            raise RecipeError(f"reward function {name!r} is not callable")
        funcs.append(func)
    return funcs


def build_datasets(recipe: RecipeArguments, seed: int, conversational: bool):
    """(train, eval or None) for ``recipe.dataset``."""
    if recipe.eval_dataset_size < 0 or recipe.dataset_size < 1:
        raise RecipeError(f"dataset_size={recipe.dataset_size} / eval_dataset_size={recipe.eval_dataset_size}: "
                          f"expected dataset_size >= 1 and eval_dataset_size >= 0")
    if recipe.dataset == "wordle":
        from ..tasks import wordle

        train = wordle.make_dataset(recipe.dataset_size, seed=seed, split=recipe.dataset_split,
                                    conversational=conversational)
        evaluation = (wordle.make_dataset(recipe.eval_dataset_size, seed=seed, split="eval",
                                          conversational=conversational) if recipe.eval_dataset_size else None)
        return train, evaluation

    from datasets import load_dataset

    suffix = os.path.splitext(recipe.dataset)[1].lower()
    if suffix in FILE_FORMATS:
        if not os.path.isfile(recipe.dataset):
            raise RecipeError(f"dataset={recipe.dataset!r}: no such file")
        data = load_dataset(FILE_FORMATS[suffix], data_files=recipe.dataset, split="train")
    else:
        data = load_dataset(recipe.dataset, split=recipe.dataset_split)
    if "prompt" not in data.column_names:
        raise RecipeError(f"dataset={recipe.dataset!r} has no 'prompt' column (GRPO needs one); its columns are "
                          f"{data.column_names}")
    if not recipe.eval_dataset_size:
        return data, None
    parts = data.train_test_split(test_size=recipe.eval_dataset_size, seed=seed)
    return parts["train"], parts["test"]


def _torch_dtype(dtype):
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise RecipeError(f"dtype={dtype!r} is not allowed: expected auto, bfloat16, float16 or float32")
    return getattr(torch, dtype)


def trust_remote_code(model_args, training_args) -> bool:
    """The recipe's ``trust_remote_code``: a field of ``GRPOConfig`` in newer TRL (1.8), of ``ModelConfig`` in
    older (1.0)."""
    source = training_args if hasattr(training_args, "trust_remote_code") else model_args
    return bool(getattr(source, "trust_remote_code", False))


#: the packaged model's folder, for a machine that cannot download one
PACKAGED_MODEL = ('--model_name_or_path "$(python -c \'from hf_perf_callbacks.real_model import smollm2_path; '
                  'print(smollm2_path())\')"')


def _offline() -> bool:
    """Whether the hub is switched off for this process (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    flags = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(flag.upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def model_load_error(name: str, error: Exception) -> str:
    """The one line for a ``model_name_or_path`` that does not load, worded for what was given: a folder that is
    not there, a hub id on a machine that cannot download it (offline mode, or no network), or another failure."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    looks_like_path = os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
    if not os.path.isdir(name) and looks_like_path:
        return f"model_name_or_path={name!r} cannot be loaded (no such folder): name a local model folder or a hub " \
               f"model id"
    if not os.path.isdir(name) and (_offline() or "couldn't connect" in first.lower()):
        why = ("HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached from this machine")
        return (f"model_name_or_path={name!r} cannot be loaded ({why}, and it is not in the local Hugging Face "
                f"cache): on a machine with internet, `hf download {name} --local-dir DIR`, copy DIR here and name "
                f"it; or train the packaged SmolLM2-135M-Instruct: {PACKAGED_MODEL}")
    return f"model_name_or_path={name!r} cannot be loaded ({first}): name a local model folder or a hub model id"


def build_tokenizer(model_args, training_args):
    """The model's tokenizer: left padding (as TRL loads it), pad token falls back to eos."""
    from transformers import AutoTokenizer

    if not model_args.model_name_or_path:
        raise RecipeError("model_name_or_path is not set: name a hub model or a local directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                                  trust_remote_code=trust_remote_code(model_args, training_args),
                                                  padding_side="left", truncation_side="left")
    except OSError as error:                           # no such folder, no such hub model, offline without a copy
        raise RecipeError(model_load_error(model_args.model_name_or_path, error)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(model_args, training_args):
    """``AutoModelForCausalLM.from_pretrained`` with the recipe's dtype and ``model_init_kwargs``; no
    ``device_map`` on MPS (the trainer moves the model)."""
    from transformers import AutoModelForCausalLM
    from trl import get_quantization_config

    kwargs = as_dict(training_args.model_init_kwargs, "model_init_kwargs")
    kwargs.setdefault("revision", model_args.model_revision)
    kwargs.setdefault("trust_remote_code", trust_remote_code(model_args, training_args))
    if model_args.attn_implementation:
        kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    kwargs["dtype"] = _torch_dtype(kwargs.get("dtype", model_args.dtype))
    quantization = get_quantization_config(model_args)       # load_in_4bit / load_in_8bit, as in TRL's script
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if training_args.device.type == "mps":
        kwargs.pop("device_map", None)                 # device_map on MPS segfaults in training (TRL #7220)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
    training_args.model_init_kwargs = None             # used here; GRPOTrainer would warn about them
    return model
