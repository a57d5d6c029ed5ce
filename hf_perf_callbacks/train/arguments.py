"""The recipe's keys and values: the launcher's own arguments (:class:`RecipeArguments`), TRL's parser over them,
``GRPOConfig`` and ``ModelConfig``, and the checks of the YAML and the flags as written (unknown keys with the closest
valid one, ``trl grpo``'s script keys and command shape, values of the wrong type) before any value is used.

The checks run on :func:`early_classes` (stand-ins read from TRL's and transformers' sources, nothing heavy imported);
:func:`recipe_classes` are the real ones, which parse the checked recipe.
Standard library at import; TRL's parser (``trl.scripts``, no torch) and PyYAML when a function runs."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import logging
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from .. import CALLBACKS
from ..core.validation import did_you_mean
from ..tasks.wordle import REWARD_FUNCS
from . import schema

if TYPE_CHECKING:
    from trl import TrlParser

WORDLE_REWARDS = tuple(f"{f.__module__}.{f.__name__}" for f in REWARD_FUNCS)
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


logger = logging.getLogger(__name__)


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key, its value and what to change."""


@dataclass
class RecipeArguments:
    """The launcher's own recipe keys (the rest are ``GRPOConfig`` and ``ModelConfig`` fields)."""

    callbacks: list[str] = field(default_factory=lambda: list(CALLBACKS), metadata={
        "help": "callback class names from hf_perf_callbacks (or dotted paths of TrainerCallback classes); "
                "'none' for no callbacks; default: all four"})
    callback_kwargs: dict[str, typing.Any] | str | None = field(default=None, metadata={
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


def recipe_classes() -> tuple[type, ...]:
    """``(RecipeArguments, GRPOConfig, ModelConfig)``: the real classes (importing them imports torch and
    transformers)."""
    from trl import GRPOConfig, ModelConfig

    return RecipeArguments, GRPOConfig, ModelConfig


@functools.lru_cache(maxsize=1)
def early_classes() -> tuple[type, ...]:
    """``(RecipeArguments, GRPOConfig, ModelConfig)`` with stand-ins of the two TRL classes read from the installed
    sources (:func:`~hf_perf_callbacks.train.schema.stand_in`: their fields, types, defaults and metadata, nothing
    imported); the real classes where those sources cannot be read."""
    try:
        return (RecipeArguments, *(schema.stand_in("trl", name) for name in ("GRPOConfig", "ModelConfig")))
    except schema.SourceUnreadable as error:
        logger.debug("reading the recipe's fields from TRL's sources failed (%s): importing TRL", error)
        return recipe_classes()


def make_parser(classes: tuple[type, ...] | None = None) -> TrlParser:
    """``TrlParser`` over ``classes`` (default :func:`early_classes`); a value argparse cannot convert raises
    :class:`RecipeError` (one line) instead of printing the whole usage and exiting."""
    from trl import TrlParser

    class RecipeParser(TrlParser):
        def error(self, message: str) -> NoReturn:
            raise RecipeError(message)

    # transformers types dataclass_types with DataClassType, a NewType of Any that no real dataclass matches
    return RecipeParser(classes or early_classes(),  # type: ignore[arg-type]
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


def field_names(classes: tuple[type, ...] | None = None) -> list[str]:
    """Every valid recipe key: the fields of the three dataclasses (default :func:`early_classes`)."""
    return sorted({f.name for cls in classes or early_classes() for f in dataclasses.fields(cls)})


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` path (also ``--config=PATH``) and the remaining arguments."""
    rest, path, args = [], None, iter(argv)
    for arg in args:
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise RecipeError("--config needs a packaged recipe's name (hf-perf recipes lists them) or a "
                                  "recipe YAML file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def read_recipe(path: str) -> dict[str, Any]:          # the YAML's values: any
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
    try:                                                # read from TRL's sources: nothing imported
        names = {f.name for module, name in (("trl.scripts.grpo", "GRPOScriptArguments"),
                                             ("trl.scripts.utils", "DatasetMixtureConfig"))
                 for f in schema.class_fields(module, name)}
    except schema.SourceUnreadable:                     # a TRL without its scripts: the keys of TRL 1.0-1.16
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


def check_trl_keys(config: Mapping[str, Any], args: list[str], path: str | None = None) -> None:
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


def check_keys(parser: TrlParser, config: Mapping[str, Any], args: list[str], source: str = "recipe") -> None:
    """Fail on unknown YAML keys and command-line flags, naming each with its closest valid key."""
    names = field_names(tuple(parser.dataclass_types))
    dests = {action.dest for action in parser._actions}
    flags = {flag for action in parser._actions for flag in action.option_strings}
    problems = []
    for key in config:
        if key != "env" and key not in dests:
            problems.append(f"unknown recipe key {key!r} in {source}{did_you_mean(str(key), names)}")
    for arg in args:
        if arg.startswith("--") and len(arg) > 2 and not arg[2].isdigit():
            flag = arg.split("=", 1)[0]
            if flag not in flags:
                problems.append(f"unknown command-line flag {flag!r}{did_you_mean(flag[2:], names, '--')}")
    if problems:
        raise RecipeError("; ".join(problems) + ". Valid keys are the fields of RecipeArguments, GRPOConfig and "
                          "ModelConfig (python -m hf_perf_callbacks.train --help lists them).")


def expected_type(hint: Any) -> tuple[Callable[[Any], bool], str]:    # any annotation: a class, a Union, a Literal...
    """``(test, words)`` for a field's annotation: a test of a YAML value and what it expects, in words. A type not
    known here (``ParallelismConfig``) passes: the library checks it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    words: list[str] | str                              # a union's, or a list item's
    if origin in (typing.Union, types.UnionType):
        parts = [expected_type(arg) for arg in args]
        words = [w for _, w in parts]
        return (lambda v: any(test(v) for test, _ in parts)), ", ".join(words[:-1]) + f" or {words[-1]}"
    if origin is typing.Literal:
        return (lambda v: v in args), "one of " + ", ".join(map(repr, args))
    if origin is list or hint is list:
        item, words = expected_type(args[0]) if args else ((lambda v: True), "anything")
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


def check_values(config: Mapping[str, Any], source: str, parser: TrlParser) -> None:
    """Fail on YAML values of the wrong type (``callbacks: 5``, ``max_steps: 2.5``, ``max_steps: abc``,
    ``output_dir: [a]``), each named with the file, the key and the type its field declares. A string is converted
    as argparse converts a flag's value (``parser``'s own conversion)."""
    hints: dict[str, Any] = {}
    for cls in reversed(list(parser.dataclass_types)):
        hints.update(typing.get_type_hints(cls))
    actions: dict[str, argparse.Action] = {}
    for each in parser._actions:                        # --tune, not its --no_tune
        if each.option_strings:
            actions.setdefault(each.dest, each)
    problems = []
    for key, value in config.items():
        if key == "env" or key not in hints:
            continue
        test, words = expected_type(hints[key])
        action = actions.get(key)
        if isinstance(value, str) and action is not None and action.choices is not None:
            words = "one of " + ", ".join(map(str, action.choices))       # the flag's choices: what argparse takes
        if isinstance(value, str) and not _converts(action, value) or not isinstance(value, str) and not test(value):
            problems.append(f"{key}={value!r} is not allowed: expected {words}")
    if problems:
        raise RecipeError(f"{source}: " + "; ".join(problems))


def _converts(action: argparse.Action | None, value: str) -> bool:
    """Whether argparse takes ``value`` for ``action``'s flag: its conversion (``int``, ``float``, a bool) and its
    choices (a ``Literal`` or an ``Enum`` field)."""
    if action is None:
        return True
    try:
        converted = action.type(value) if callable(action.type) else value
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return action.choices is None or converted in action.choices


def raw_values(parser: TrlParser, config: Mapping[str, Any], args: list[str]) -> dict[str, Any]:
    """Merged values (YAML under command line) before any dataclass validation runs."""
    parser.set_defaults_with_config(**{k: v for k, v in config.items() if k != "env"})
    namespace, _ = parser.parse_known_args(args)
    return vars(namespace)


def as_dict(value: object, name: str) -> dict[str, Any]:
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
