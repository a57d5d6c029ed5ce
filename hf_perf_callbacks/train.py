"""Recipe launcher: GRPO + LoRA with the project's callbacks, configured by one YAML file.

```bash
accelerate launch --config_file "$(hf-perf recipes path accelerate/mps)" -m hf_perf_callbacks.train \\
    --config mac-16gb-qwen1.5b [--key value ...]
python -m hf_perf_callbacks.train --config mac-16gb-qwen1.5b      # one process
hf-perf train --config mac-16gb-qwen1.5b                          # same
hf-perf train --config my.yaml                                    # a recipe file (a path that exists wins)
```

``--config`` takes a packaged recipe's name (:mod:`hf_perf_callbacks.recipes`) or a YAML file. Keys are fields of
``RecipeArguments`` (below), TRL's ``GRPOConfig`` and ``ModelConfig`` (TRL's ``TrlParser`` over the three);
command-line flags override the YAML. Unknown keys, values of the wrong type, impossible batch geometry and
precision the device lacks fail before the model loads, with the fix in the message; so do a model that cannot be
loaded and a trainer that refuses its arguments, before training starts: one line, exit 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import json
import logging
import math
import os
import sys
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import keys, recipes
from .batching import Split
from .splitfile import split_for_run

logger = logging.getLogger("hf_perf_callbacks.train")   # also when run as __main__

DEFAULT_CALLBACKS = ("ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner")
WORDLE_REWARDS = tuple(f"hf_perf_callbacks.tasks.wordle.{name}" for name in (
    "format_reward", "valid_word_reward", "letters_reward", "consistency_reward", "solved_reward"))  # REWARD_FUNCS
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key, its value and what to change."""


@dataclass
class RecipeArguments:
    """The launcher's own recipe keys (the rest are ``GRPOConfig`` and ``ModelConfig`` fields)."""

    callbacks: list[str] = field(default_factory=lambda: list(DEFAULT_CALLBACKS), metadata={
        "help": "callback class names from hf_perf_callbacks (or dotted paths of TrainerCallback classes); "
                "'none' for no callbacks; default: all four"})
    callback_kwargs: dict | str | None = field(default=None, metadata={
        "help": "keyword arguments per callback class name, e.g. {MemoryWatchdog: {limit_gb: 12}} (JSON on the "
                "command line)"})
    reward_funcs: list[str] = field(default_factory=lambda: list(WORDLE_REWARDS), metadata={
        "help": f"TRL reward names ({', '.join(TRL_REWARDS)}) or dotted paths pkg.module.func; "
                "default: the bundled Wordle rewards"})
    dataset: str = field(default="wordle", metadata={
        "help": "'wordle' (bundled, offline), a local .json/.jsonl/.csv/.parquet file, or a hub dataset name; "
                "needs a 'prompt' column"})
    dataset_split: str = field(default="train", metadata={"help": "split to train on (Wordle: train or eval)"})
    dataset_size: int = field(default=512, metadata={"help": "number of Wordle prompts"})
    eval_dataset_size: int = field(default=0, metadata={
        "help": "evaluation prompts (0 = none): Wordle's eval split, else rows held out of the training split"})
    tune: bool = field(default=True, metadata={
        "help": "let AdaptiveBatchTuner try other exact splits on the run's own steps when the rest of the run can "
                "pay the switches back (false: keep the recipe's split)"})
    report: bool = field(default=True, metadata={"help": "print the perf report and write its plots at the end"})


# ---------------------------------------------------------------- parsing and validation
#: a quick trial of any recipe: two optimizer steps (too few for the tuner to try another split: it costs nothing),
#: completions cut at 32 tokens, its own output_dir
QUICK_TRIAL = "--max_steps 2 --max_completion_length 32 --output_dir runs/trial"


def make_parser():
    """``TrlParser`` over ``(RecipeArguments, GRPOConfig, ModelConfig)``; a value argparse cannot convert raises
    :class:`RecipeError` (one line) instead of printing the whole usage and exiting."""
    from trl import GRPOConfig, ModelConfig, TrlParser

    class RecipeParser(TrlParser):
        def error(self, message):
            raise RecipeError(message)

    # transformers types dataclass_types with DataClassType, a NewType of Any that no real dataclass matches
    return RecipeParser((RecipeArguments, GRPOConfig, ModelConfig),  # type: ignore[arg-type]
                        prog="python -m hf_perf_callbacks.train")


def launcher_help() -> str:
    """The launcher's own keys (``RecipeArguments``) with their defaults, and the quick-trial flags."""
    import textwrap

    lines = ["the launcher's own keys (besides every GRPOConfig and ModelConfig field):"]
    for f in dataclasses.fields(RecipeArguments):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        flags = f"--{f.name}" + (f" / --no_{f.name}" if default is True else "")
        shown = f" (default {default!r})" if len(repr(default)) < 60 else ""
        lines.append(f"  {flags}{shown}")
        lines += textwrap.wrap(f.metadata["help"], 110, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines += ["", f"a quick trial of any recipe: hf-perf train --config NAME {QUICK_TRIAL}",
              "`python -m hf_perf_callbacks.train --help` lists every key (over a thousand lines)."]
    return "\n".join(lines)


def field_names() -> list[str]:
    """Every valid recipe key: the fields of the three dataclasses."""
    from trl import GRPOConfig, ModelConfig

    return sorted({f.name for cls in (RecipeArguments, GRPOConfig, ModelConfig) for f in dataclasses.fields(cls)})


def _did_you_mean(name: str, names: list[str], prefix: str = "") -> str:
    """The closest name (difflib); one sharing the first word wins (lora_rank → lora_r, not local_rank)."""
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    same_family = [c for c in close if c.split("_")[0] == name.split("_")[0]]
    best = (same_family or close)[:1]
    return f" (did you mean '{prefix}{best[0]}'?)" if best else ""


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` path (also ``--config=PATH``) and the remaining arguments."""
    rest, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise RecipeError("--config needs a packaged recipe's name (hf-perf recipes lists them) or a "
                                  "recipe YAML file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def read_recipe(path: str) -> dict:
    """The recipe YAML as a dict (``env`` included)."""
    import yaml

    if not os.path.isfile(path):
        raise RecipeError(f"--config {path!r}: no such file")
    with open(path) as handle:
        try:
            config = yaml.safe_load(handle) or {}
        except yaml.YAMLError as error:
            raise RecipeError(f"--config {path!r} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise RecipeError(f"--config {path!r}: expected a YAML mapping of key: value, got {type(config).__name__}")
    return config


#: ``trl grpo``'s script keys that the launcher spells differently
TRL_RENAMED = {"dataset_name": "dataset", "dataset_train_split": "dataset_split"}
#: ``trl``'s training commands (``trl grpo ...``): the launcher is ``trl grpo`` with the callbacks, without the word
TRL_COMMANDS = ("grpo", "sft", "dpo", "kto", "rloo", "reward")


def trl_script_keys() -> set[str]:
    """The keys ``trl grpo``'s own script takes besides ``GRPOConfig`` and ``ModelConfig`` (its
    ``GRPOScriptArguments`` and dataset mixture) that are not recipe keys here: ``dataset_name``,
    ``reward_model_name_or_path``, ..."""
    try:
        from trl.scripts.grpo import GRPOScriptArguments
        from trl.scripts.utils import DatasetMixtureConfig

        names = {f.name for cls in (GRPOScriptArguments, DatasetMixtureConfig) for f in dataclasses.fields(cls)}
    except (ImportError, TypeError):                    # a TRL without its scripts: the keys of TRL 1.0-1.16
        names = {*TRL_RENAMED, "dataset_config", "dataset_test_split", "dataset_streaming", "datasets",
                 "reward_model_name_or_path", "ignore_bias_buffers"}
    return names - set(field_names())


def check_trl_command(args: list[str]) -> None:
    """``trl grpo``'s command shape brought to the launcher (its command word, its ``--accelerate_config``): one line
    with the launcher's form of it."""
    word = args[0] if args and not args[0].startswith("-") else None
    if word in TRL_COMMANDS:
        instead = ("drop the word: hf-perf train --config R.yaml [--key value ...] is `trl grpo --config R.yaml` with "
                   "the callbacks" if word == "grpo" else
                   f"hf-perf train trains GRPO only; for `trl {word}` pass callbacks=default_callbacks() to the "
                   f"trainer in your own script")
        raise RecipeError(f"{word!r} is a `trl` command word, not a launcher argument: {instead}")
    if any(a == "--accelerate_config" or a.startswith("--accelerate_config=") for a in args):
        raise RecipeError("--accelerate_config is `trl`'s launch flag: launch with accelerate itself, accelerate "
                          "launch --config_file C.yaml -m hf_perf_callbacks.train --config R.yaml (packaged configs: "
                          "hf-perf recipes path accelerate/NAME)")


def check_trl_keys(config: Mapping, args: list[str], path: str | None = None) -> None:
    """``trl grpo``'s script keys in the recipe or on the command line: one line saying which to rename and which to
    remove; the rest of a ``trl grpo`` YAML runs as is (TRL's CLI has no way to attach callbacks, so the launcher is
    the route)."""
    trl_keys = trl_script_keys()
    in_config = [k for k in config if k in trl_keys]
    flags = [a.split("=", 1)[0][2:] for a in args if a.startswith("--") and a.split("=", 1)[0][2:] in trl_keys]
    if not in_config and not flags:
        return
    found = list(dict.fromkeys(in_config + flags))
    where = " and ".join(filter(None, [f"in {path}" if in_config else "", "on the command line" if flags else ""]))
    renamed = [f"{k} → {TRL_RENAMED[k]}" for k in found if k in TRL_RENAMED]
    dropped = [k for k in found if k not in TRL_RENAMED]
    changes = "; ".join(filter(None, [("rename " + ", ".join(renamed)) if renamed else "",
                                      (f"remove {', '.join(dropped)} (no counterpart here)") if dropped else ""]))
    rest = f"the rest of {path} runs as is: hf-perf train --config {path}" if in_config else "the rest runs as is"
    raise RecipeError(f"`trl grpo` script key{'s' if len(found) > 1 else ''} {', '.join(found)} {where}: {changes}; "
                      f"{rest} (`trl grpo` itself cannot attach callbacks)")


def check_keys(parser, config: Mapping, args: list[str], source: str = "recipe") -> None:
    """Fail on unknown YAML keys and command-line flags, naming each with its closest valid key."""
    names = field_names()
    dests = {action.dest for action in parser._actions}
    flags = {flag for action in parser._actions for flag in action.option_strings}
    problems = []
    for key in config:
        if key != "env" and key not in dests:
            problems.append(f"unknown recipe key {key!r} in {source}{_did_you_mean(str(key), names)}")
    for arg in args:
        if arg.startswith("--") and len(arg) > 2 and not arg[2].isdigit():
            flag = arg.split("=", 1)[0]
            if flag not in flags:
                problems.append(f"unknown command-line flag {flag!r}{_did_you_mean(flag[2:], names, '--')}")
    if problems:
        raise RecipeError("; ".join(problems) + ". Valid keys are the fields of RecipeArguments, GRPOConfig and "
                          "ModelConfig (python -m hf_perf_callbacks.train --help lists them).")


def _expected(hint) -> tuple:
    """``(test, words)`` for a field's annotation: a test of a YAML value and what it expects, in words. A type not
    known here (``ParallelismConfig``) passes: the library checks it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_expected(arg) for arg in args]
        words = [w for _, w in parts]
        return (lambda v: any(test(v) for test, _ in parts)), ", ".join(words[:-1]) + f" or {words[-1]}"
    if origin is typing.Literal:
        return (lambda v: v in args), "one of " + ", ".join(map(repr, args))
    if origin is list or hint is list:
        item, words = _expected(args[0]) if args else ((lambda v: True), "anything")
        plural = {"a string": "strings", "an integer": "integers", "a number": "numbers"}.get(words, words)
        return (lambda v: isinstance(v, list) and all(map(item, v))), f"a list of {plural}"
    if origin is dict or hint is dict:
        return (lambda v: isinstance(v, dict)), "a mapping"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        return (lambda v: isinstance(v, hint) or v in values), "one of " + ", ".join(map(str, values))
    scalars = {type(None): (lambda v: v is None, "null"), bool: (lambda v: isinstance(v, bool), "true or false"),
               int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
               float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
               str: (lambda v: isinstance(v, str), "a string")}
    return scalars.get(hint, ((lambda v: True), getattr(hint, "__name__", str(hint))))


def check_values(config: Mapping, source: str = "recipe") -> None:
    """Fail on YAML values of the wrong type (``callbacks: 5``, ``max_steps: 2.5``, ``output_dir: [a]``), each
    named with the type its field declares. Strings are left to argparse, which converts them as it converts flags."""
    from trl import GRPOConfig, ModelConfig

    hints = {}
    for cls in (ModelConfig, GRPOConfig, RecipeArguments):
        hints.update(typing.get_type_hints(cls))
    expected = {key: _expected(hints[key]) for key, value in config.items()
                if key != "env" and key in hints and not isinstance(value, str)}
    problems = [f"{key}={config[key]!r} is not allowed: expected {words}"
                for key, (test, words) in expected.items() if not test(config[key])]
    if problems:
        raise RecipeError(f"{source}: " + "; ".join(problems))


def raw_values(parser, config: Mapping, args: list[str]) -> dict:
    """Merged values (YAML under command line) before any dataclass validation runs."""
    parser.set_defaults_with_config(**{k: v for k, v in config.items() if k != "env"})
    namespace, _ = parser.parse_known_args(args)
    return vars(namespace)


def world_size_from_env() -> int:
    """Processes of this launch (``WORLD_SIZE`` from accelerate launch / torchrun; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def detect_device(use_cpu: bool = False) -> tuple[str, bool, str]:
    """``(kind, bf16_supported, description)`` of the device the trainer will use."""
    from .device import DeviceLayer

    if use_cpu:
        return "cpu", True, "the CPU (use_cpu: true)"
    device = DeviceLayer()
    if device.type in ("cuda", "xpu"):
        return device.type, device.bf16_supported(), f"{'CUDA GPU' if device.type == 'cuda' else 'Intel XPU'} " \
                                                     f"{device.name}"
    if device.type == "mps":
        new_enough = device.bf16_supported()
        return "mps", new_enough, "Apple MPS" + ("" if new_enough else " on macOS older than 14")
    return "cpu", False, "a machine without a GPU (use_cpu is false)"


def _as_dict(value, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise RecipeError(f"{name}={value!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise RecipeError(f"{name}={value!r} is not allowed: expected a mapping")
    return value


def _bf16_fix(kind: str) -> str:
    return {"mps": "set bf16: false and dtype: float16 or float32 (bf16 on MPS needs macOS 14)",
            "cuda": "set bf16: false, fp16: true and dtype: float16 (bf16 needs an Ampere or newer GPU)",
            "xpu": "set bf16: false and dtype: float16 or float32",
            }.get(kind, "set use_cpu: true to train on the CPU, or bf16: false and dtype: float32")


def check_batch_geometry(values: Mapping, world_size: int = 1) -> int:
    """GRPO's batch rule, checked with a clear fix before ``GRPOConfig`` runs its own; returns the generation batch.

    ``generation_batch_size = per_device_train_batch_size × world × steps_per_generation`` (which defaults to
    ``gradient_accumulation_steps``) must be a multiple of ``num_generations``, and ``num_generations ≥ 2``.
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
    if gbs is not None:
        if gbs % per_step:
            raise RecipeError(f"generation_batch_size={gbs} is not allowed: it must be a multiple of "
                              f"per_device_train_batch_size ({micro}) × world size ({world_size}) = {per_step}")
        formula = f"generation_batch_size = {gbs}"
    else:
        steps = spg if spg is not None else accum
        gbs = per_step * steps                           # micro × world × steps (Split.generation_batch)
        what = "steps_per_generation" if spg is not None else "gradient_accumulation_steps"
        formula = (f"generation_batch_size = per_device_train_batch_size ({micro}) × world size ({world_size}) × "
                   f"{what} ({steps}) = {gbs}")
    if gbs % ngen:
        step = ngen // math.gcd(per_step, ngen)
        fixed = ((gbs // per_step) // step + 1) * step
        raise RecipeError(f"{formula}, which is not a multiple of num_generations ({ngen}): every prompt needs all "
                          f"its {ngen} completions in one generation batch. Set gradient_accumulation_steps (or "
                          f"steps_per_generation) to a multiple of {step}, e.g. {fixed}, or num_generations to a "
                          f"divisor of {gbs} that is >= 2")
    return gbs


def check_recipe(values: Mapping, *, device: str, bf16_supported: bool, device_name: str | None = None,
                 world_size: int = 1, accelerate_mixed_precision: str | None = None) -> None:
    """Reject impossible combinations with what to change: GRPO batch rule, bf16 on a device without it,
    ``device_map: auto`` on MPS. ``values`` are the merged recipe values (see :func:`raw_values`)."""
    device_name = device_name or device
    gbs = check_batch_geometry(values, world_size)
    length = values.get("max_completion_length")
    if length is not None and (not isinstance(length, int) or length < 1):
        raise RecipeError(f"max_completion_length={length!r} is not allowed: expected an integer >= 1")

    if values.get("eval_dataset_size", 0) and values.get("eval_strategy", "no") != "no":
        ngen = values.get("num_generations_eval") or values["num_generations"]
        eval_batch = values["per_device_eval_batch_size"] * world_size
        if eval_batch % ngen:
            raise RecipeError(f"per_device_eval_batch_size ({values['per_device_eval_batch_size']}) × world size "
                              f"({world_size}) = {eval_batch} is not a multiple of num_generations"
                              f"{'_eval' if values.get('num_generations_eval') else ''} ({ngen}): set "
                              f"per_device_eval_batch_size to a multiple of {ngen // math.gcd(world_size, ngen)}")

    if values.get("dataset", "wordle") == "wordle":
        prompts = gbs // values["num_generations"]
        if values.get("dataset_size", prompts) < prompts:
            raise RecipeError(f"dataset_size={values['dataset_size']} is too small: one generation batch takes "
                              f"{prompts} prompts ({gbs} completions / num_generations {values['num_generations']})")

    if not bf16_supported and not values.get("use_cpu"):
        where = (f"but {device_name} has no bf16" if device != "cpu" else
                 "on a machine without a GPU, and use_cpu is not set (a recipe for a GPU or a Mac?)")
        bf16 = values.get("bf16")
        wants_amp = (not values.get("fp16")) if bf16 is None else bf16
        if wants_amp or values.get("bf16_full_eval"):
            how = "bf16: true" if bf16 else "bf16 unset (TRL then turns bf16 on)"
            raise RecipeError(f"bf16 mixed precision is requested ({how}) {where}: {_bf16_fix(device)}")
        if str(values.get("dtype")) == "bfloat16":
            raise RecipeError(f"dtype: bfloat16 loads the weights in bf16 {where}: {_bf16_fix(device)}")
        if accelerate_mixed_precision == "bf16":
            raise RecipeError(f"the accelerate config sets mixed_precision: bf16 {where}: launch with "
                              f"--mixed_precision no")

    if device == "mps" and not values.get("use_cpu"):
        init_kwargs = _as_dict(values.get("model_init_kwargs"), "model_init_kwargs")
        if init_kwargs.get("device_map") == "auto":
            raise RecipeError("model_init_kwargs sets device_map: auto, which segfaults on MPS during training "
                              "(TRL #7220): remove device_map; the trainer moves the model to MPS itself")


def _resuming(resume) -> bool:
    """Whether ``--resume_from_checkpoint`` asks for a resume (a path or ``last``; not unset, false or none)."""
    return bool(resume) and str(resume).lower() not in ("false", "none")


def split_to_resume(values: Mapping, world_size: int = 1) -> dict | None:
    """The split a batch tuner recorded in ``output_dir`` when this launch resumes that run, else None.

    The tuner re-sizes the split of a run that ran out of memory or found a faster one and writes it to
    ``output_dir``; a resume continues with it. It is applied only when ``resume_from_checkpoint`` is given and the
    recorded split is exact for the recipe (the one rule of :func:`~hf_perf_callbacks.resize.splitfile.split_for_run`,
    which ``train_with_tuning`` applies too): a fresh run, or a recipe whose batch was changed since, starts from the
    recipe's own split.
    ``values`` are the merged recipe values (see :func:`raw_values`).
    """
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


def config_with_split(args, split: Mapping):
    """A copy of the parsed ``GRPOConfig`` (before any trainer exists) with a recorded split, keeping GRPO's
    generation batch: a split with ``steps_per_generation`` sets it and clears ``generation_batch_size`` (GRPOConfig
    accepts only one of the two); one without keeps the current ``generation_batch_size``. (``tuner.apply_split`` sets
    a split on a live trainer, in place.)"""
    changes = {"per_device_train_batch_size": split["per_device_train_batch_size"],
               "gradient_accumulation_steps": split["gradient_accumulation_steps"]}
    if split.get("steps_per_generation"):
        changes.update(steps_per_generation=split["steps_per_generation"], generation_batch_size=None)
    else:
        changes.update(generation_batch_size=args.generation_batch_size, steps_per_generation=None)
    return dataclasses.replace(args, **changes)


def resolve_checkpoint(resume: str | None, output_dir: str) -> str | None:
    """``--resume_from_checkpoint PATH`` or ``last`` (the newest *complete* ``checkpoint-N`` in ``output_dir``;
    newer incomplete ones are moved aside, see :mod:`hf_perf_callbacks.resize.checkpoints`)."""
    if resume is None or not _resuming(resume):
        return None
    if resume == "last":
        from .resize.checkpoints import newest_complete

        last = newest_complete(output_dir)
        if last is None:
            raise RecipeError(f"resume_from_checkpoint=last: no complete checkpoint-N folder in output_dir "
                              f"{output_dir!r}; drop the flag to start fresh or pass a checkpoint path")
        return last
    if not os.path.isdir(resume):
        raise RecipeError(f"resume_from_checkpoint={resume!r}: no such directory (pass a checkpoint-N folder or "
                          f"'last')")
    return resume


def parse_recipe(argv: list[str]):
    """Validate and parse ``argv`` into ``(RecipeArguments, GRPOConfig, ModelConfig)``; a :class:`RecipeError`
    comes before anything heavy (distributed init, model, data) happens."""
    config_path, rest = _split_config(argv)
    check_trl_command(rest)
    config_path = recipes.resolve(config_path) if config_path else None
    config = read_recipe(config_path) if config_path else {}
    parser = make_parser()
    check_trl_keys(config, rest, config_path)
    check_keys(parser, config, rest, source=config_path or "recipe")
    check_values(config, source=config_path or "recipe")
    values = raw_values(parser, config, rest)
    split = split_to_resume(values, world_size_from_env())
    if split:
        values.update(split)
        if split.get("steps_per_generation"):
            values["generation_batch_size"] = None
    kind, bf16_ok, name = detect_device(bool(values.get("use_cpu")))
    check_recipe(values, device=kind, bf16_supported=bf16_ok, device_name=name, world_size=world_size_from_env(),
                 accelerate_mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION"))
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" and values.get("bf16") is False:
        logger.warning("the accelerate config sets mixed_precision: bf16, which overrides bf16: false in the recipe "
                       "(training then runs under bf16 autocast); launch with --mixed_precision no, or "
                       "hf-perf recipes path accelerate/mps, to keep the recipe's precision")

    args = ["--config", config_path, *rest] if config_path else rest
    recipe, training_args, model_args = make_parser().parse_args_and_config(args)
    if split:
        logger.info("applying the split recorded by the batch tuner in %s: %s", training_args.output_dir, split)
        training_args = config_with_split(training_args, split)
    recipe.callbacks = [name for name in ([recipe.callbacks] if isinstance(recipe.callbacks, str)
                                          else recipe.callbacks) if name.lower() != "none"]
    recipe.reward_funcs = [recipe.reward_funcs] if isinstance(recipe.reward_funcs, str) else recipe.reward_funcs
    recipe.callback_kwargs = _as_dict(recipe.callback_kwargs, "callback_kwargs")
    training_args.resume_from_checkpoint = resolve_checkpoint(training_args.resume_from_checkpoint,
                                                              training_args.output_dir)
    return recipe, training_args, model_args


# ---------------------------------------------------------------- building blocks
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
    if name not in DEFAULT_CALLBACKS:
        raise RecipeError(f"unknown callback {name!r}{_did_you_mean(name, list(DEFAULT_CALLBACKS))}: allowed are "
                          f"{', '.join(DEFAULT_CALLBACKS)} or a dotted path pkg.module.Class")
    return getattr(hf_perf_callbacks, name)


def build_callbacks(names: list[str], kwargs: Mapping) -> list:
    """Instantiate the named callbacks with their ``callback_kwargs`` (keyed by class name or dotted path)."""
    if len(set(names)) != len(names):
        raise RecipeError(f"callbacks={names!r} names a callback twice: two instances of one class overwrite each "
                          f"other's saved state")
    for key in kwargs:
        short = key.rsplit(".", 1)[-1]
        if short not in DEFAULT_CALLBACKS and key not in names and short not in (n.rsplit(".", 1)[-1] for n in names):
            raise RecipeError(f"callback_kwargs names unknown callback {key!r}"
                              f"{_did_you_mean(short, list(DEFAULT_CALLBACKS))}")
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
            raise RecipeError(f"unknown reward function {name!r}{_did_you_mean(name, list(TRL_REWARDS))}: allowed are "
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
        from .tasks import wordle

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

    kwargs = _as_dict(training_args.model_init_kwargs, "model_init_kwargs")
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


# ---------------------------------------------------------------- the console
#: the callbacks' keys that the console's log line keeps: throughput, MFU, memory against the budget and the split
#: in effect (every key still reaches ``log_history``, the reporters and the perf log)
CONSOLE_KEYS = (keys.PERF_TOKENS_PER_SEC, keys.PERF_MFU, keys.MEM_DEVICE_USED_GB, keys.MEM_LIMIT_GB,
                keys.TUNER_MICRO_BATCH, keys.TUNER_GRAD_ACCUM)


def console_logs(logs: Mapping) -> dict:
    """A training log as the console shows it: the trainer's own values (what ``trl grpo`` prints) and the callbacks'
    headline keys (:data:`CONSOLE_KEYS`), not each of their few dozen keys."""
    return {key: value for key, value in logs.items()
            if key in CONSOLE_KEYS or not key.startswith(keys.CALLBACK_PREFIXES)}


def compact_console(trainer) -> None:
    """Print the trainer's log lines through :func:`console_logs`: transformers' ``ProgressCallback`` (or
    ``PrinterCallback`` under ``disable_tqdm``) is replaced by a subclass that prints the compact dict; what the
    reporters, ``log_history`` and the perf log receive is unchanged."""
    from transformers import PrinterCallback, ProgressCallback

    class CompactProgressCallback(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)

    class CompactPrinterCallback(PrinterCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)

    for plain, compact in ((ProgressCallback, CompactProgressCallback), (PrinterCallback, CompactPrinterCallback)):
        if any(type(callback) is plain for callback in trainer.callback_handler.callbacks):
            trainer.remove_callback(plain)
            trainer.add_callback(compact)


def _describe(recipe, args, model_args, callbacks) -> str:
    world, micro, accum = args.world_size, args.per_device_train_batch_size, args.gradient_accumulation_steps
    lora = f", LoRA r={model_args.lora_r}" if model_args.use_peft else ""
    names = ", ".join(type(cb).__name__ for cb in callbacks) or "none"
    return (f"recipe: {model_args.model_name_or_path} ({model_args.dtype}{lora}) on {args.device.type} × {world}; "
            f"micro-batch {micro} × accumulation {accum} × world {world} = {micro * accum * world} completions per "
            f"optimizer step; generation batch {args.generation_batch_size} = "
            f"{args.generation_batch_size // args.num_generations} prompts × {args.num_generations}; "
            f"max_completion_length {args.max_completion_length}; dataset {recipe.dataset}; callbacks {names}")


def _report(output_dir: str) -> None:
    """End-of-run report; a failure here is logged and does not fail the finished run."""
    try:
        from .report import report_command

        report_command(output_dir)
    except Exception:                                  # training and checkpoints are already saved
        logger.exception("the perf report failed; rerun it with `hf-perf report %s`", output_dir)


def _end(trainer) -> None:
    """Finish the trackers and destroy the process group (``Trainer.end``).

    Several processes meet at a barrier first and then sleep briefly without the GIL: gloo's process-group
    destructor joins its worker thread while holding the GIL, and deadlocks when that thread still has to release
    the last collective's tensors (pytorch/pytorch#56297, #75097; seen on 2-process CPU runs).
    """
    if trainer.args.world_size > 1:
        trainer.accelerator.wait_for_everyone()
        time.sleep(0.5)
    if hasattr(trainer, "end"):                        # transformers >= 5.18
        trainer.end()


# ---------------------------------------------------------------- entry point
def run(recipe: RecipeArguments, training_args, model_args) -> int:
    """Build the trainer from parsed arguments, train, save, report."""
    from trl import GRPOTrainer, get_peft_config

    callbacks = build_callbacks(recipe.callbacks, _as_dict(recipe.callback_kwargs, "callback_kwargs"))
    rewards = resolve_reward_funcs(recipe.reward_funcs, training_args.max_completion_length)
    tokenizer = build_tokenizer(model_args, training_args)
    train_data, eval_data = build_datasets(recipe, training_args.seed,
                                           conversational=getattr(tokenizer, "chat_template", None) is not None)
    model = build_model(model_args, training_args)
    if eval_data is not None and training_args.eval_strategy == "no":
        logger.warning("eval_dataset_size=%d but eval_strategy is 'no': set eval_strategy: steps to evaluate",
                       recipe.eval_dataset_size)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=train_data,
                              eval_dataset=eval_data, processing_class=tokenizer,
                              peft_config=get_peft_config(model_args) if model_args.use_peft else None,
                              callbacks=callbacks)
    except ValueError as error:                        # TRL's and transformers' checks of the arguments
        raise RecipeError(f"GRPOTrainer refused the recipe: {error}") from None
    compact_console(trainer)
    if trainer.is_world_process_zero():
        logger.info(_describe(recipe, training_args, model_args, callbacks))

    if callbacks:                                      # the report words its advice as this launcher's recipe keys
        from .bus import bus_for

        bus_for(trainer.callback_handler).mark_runs(launcher="hf-perf train")
    resume = training_args.resume_from_checkpoint
    if any(type(cb).__name__ == "AdaptiveBatchTuner" for cb in callbacks):
        from .resize import train_with_tuning

        train_with_tuning(trainer, resume_from_checkpoint=resume, tune=recipe.tune)
    else:
        trainer.train(resume_from_checkpoint=resume)

    if getattr(trainer, "is_fsdp_enabled", False):    # checkpoints stay sharded; the final model is one loadable file
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(training_args.output_dir)
    main_process = trainer.is_world_process_zero()
    if main_process:
        trainer.save_state()
    _end(trainer)
    if main_process and recipe.report:
        _report(training_args.output_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Launch a recipe: ``--config R.yaml [--key value ...]``; 0 on success, 2 on an invalid recipe."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_perf_callbacks").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        recipe, training_args, model_args = parse_recipe(argv)
    except ValueError as error:                        # RecipeError and the dataclasses' own checks
        print(f"hf_perf_callbacks.train: error: {error}", file=sys.stderr)
        return 2
    try:
        return run(recipe, training_args, model_args)
    except RecipeError as error:
        print(f"hf_perf_callbacks.train: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
