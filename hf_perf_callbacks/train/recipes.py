"""The recipes: one GRPO YAML per machine and the accelerate configs they are launched with (``accelerate/NAME.yaml``),
kept in the project's top-level ``recipes/`` folder (README.md there says which recipe fits which machine and why)
and shipped inside the wheel as ``hf_perf_callbacks/recipes/`` (pyproject.toml maps the folder). :data:`DIR` is the
installed copy when there is one, else the checkout's folder (an editable install, ``PYTHONPATH=<checkout>``).

| command | what |
|---|---|
| ``hf-perf recipes`` | list them: name, machine, model |
| ``hf-perf recipes copy NAME [DEST]`` | copy one out to edit (DEST: a file or a folder; default ``./NAME.yaml``) |
| ``hf-perf recipes path NAME`` | the packaged file's path, e.g. for ``accelerate launch --config_file`` |
| ``hf-perf train --config NAME`` | a packaged recipe by name (a file of that path, when it exists, wins) |

A recipe's first line is ``# MACHINE: what it trains.``; the listing shows MACHINE and the recipe's
``model_name_or_path``. Standard library, PyYAML and the package's wording only: the listing answers without torch.
"""
from __future__ import annotations

import os
import shutil

from ..core.wording import wrapped

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INSTALLED = os.path.join(_PACKAGE, "recipes")                     # inside an installed wheel
_CHECKOUT = os.path.join(os.path.dirname(_PACKAGE), "recipes")     # the source checkout's top-level folder
#: the folder holding the recipes (and ``accelerate/``); a checkout's stale ``hf_perf_callbacks/recipes/`` (left
#: ``__pycache__``) does not count: the installed copy carries README.md
DIR = _INSTALLED if os.path.isfile(os.path.join(_INSTALLED, "README.md")) else _CHECKOUT
ACCELERATE = "accelerate"          # the folder of the accelerate configs; their names are "accelerate/NAME"
SUFFIX = ".yaml"


class UnknownRecipe(ValueError):
    """A name that is neither a packaged recipe nor an accelerate config; the message lists the names."""


def _stems(folder: str) -> list[str]:
    return sorted(f.removesuffix(SUFFIX) for f in os.listdir(folder) if f.endswith(SUFFIX))


def recipe_names() -> list[str]:
    """The packaged training recipes (``hf-perf train --config NAME``)."""
    return _stems(DIR)


def accelerate_names() -> list[str]:
    """The packaged accelerate configs, as ``accelerate/NAME``."""
    return [f"{ACCELERATE}/{stem}" for stem in _stems(os.path.join(DIR, ACCELERATE))]


def path(name: str) -> str:
    """The file of a recipe or an accelerate config (``.yaml`` optional); :class:`UnknownRecipe` otherwise."""
    stem = name.removesuffix(SUFFIX)
    if stem not in recipe_names() + accelerate_names():
        raise UnknownRecipe(f"no packaged recipe or accelerate config named {name!r}: the recipes are "
                            f"{', '.join(recipe_names())}; the accelerate configs {', '.join(accelerate_names())} "
                            f"(`hf-perf recipes` lists them)")
    return os.path.join(DIR, *stem.split("/")) + SUFFIX


def resolve(config: str) -> str:
    """``--config`` of the launcher: an existing file as it is, else a packaged recipe's name; the path to read."""
    if os.path.isfile(config):
        return config
    if config.removesuffix(SUFFIX) in recipe_names():
        return path(config)
    stem = os.path.basename(config).removesuffix(SUFFIX)    # e.g. recipes/NAME.yaml, where a clone once kept them
    hint = f" (the packaged recipe of that name: --config {stem})" if stem in recipe_names() else ""
    raise UnknownRecipe(f"--config {config!r}: no such file, and no packaged recipe of that name{hint}; the packaged "
                        f"recipes are {', '.join(recipe_names())} (`hf-perf recipes` lists them)")


def machine(file: str) -> str:
    """The machine a recipe file's first line (``# MACHINE: what it trains.``) names; "" without that comment."""
    with open(file, encoding="utf-8") as handle:
        line = handle.readline().strip()
    return line.lstrip("#").strip().split(": ", 1)[0] if line.startswith("#") else ""


def _first_sentence(file: str) -> str:
    """The file's leading comment up to the end of its first sentence (over as many lines as it takes; a line that
    shows the launch command ends it)."""
    words: list[str] = []
    with open(file, encoding="utf-8") as handle:
        for line in handle:
            text = line.strip()
            if not text.startswith("#") or text.lstrip("#").strip().startswith("accelerate launch"):
                break
            words.append(text.lstrip("#").strip())
            if words[-1].endswith("."):
                break
    joined = " ".join(words)
    end = joined.find(". ")
    return joined[:end + 1] if end >= 0 else joined


def describe(name: str) -> dict[str, str]:
    """``{"name", "machine", "model"}`` of a packaged recipe: the machine from its first line, the model from
    ``model_name_or_path``."""
    import yaml

    file = path(name)
    with open(file, encoding="utf-8") as handle:
        config = yaml.safe_load(handle) or {}
    return {"name": name.removesuffix(SUFFIX), "machine": machine(file),
            "model": str(config.get("model_name_or_path", "?"))}


def listing() -> str:
    """What ``hf-perf recipes`` prints: one line per recipe (name, machine, model), then the accelerate configs."""
    rows = [describe(name) for name in recipe_names()]
    width = [max(len(r[key]) for r in rows) for key in ("name", "machine")]
    lines = ["recipes (hf-perf train --config NAME; hf-perf recipes copy NAME to edit one):"]
    lines += [f"  {r['name']:<{width[0]}}  {r['machine']:<{width[1]}}  {r['model']}" for r in rows]
    lines.append('accelerate configs (accelerate launch --config_file "$(hf-perf recipes path accelerate/NAME)" '
                 "-m hf_perf_callbacks.train --config RECIPE):")
    names = accelerate_names()
    column = max(len(n) for n in names)
    lines += [wrapped(f"  {n:<{column}}  {_first_sentence(path(n))}", indent=" " * (column + 4)) for n in names]
    return "\n".join(lines)


def copy(name: str, dest: str | None = None, force: bool = False) -> str:
    """Copy a packaged recipe or accelerate config to ``dest`` (a file, or a folder to put ``NAME.yaml`` in; default
    the working directory); an existing file is kept unless ``force``. Returns the path written."""
    source = path(name)
    target = dest or os.path.basename(source)
    if os.path.isdir(target):
        target = os.path.join(target, os.path.basename(source))
    if os.path.exists(target) and not force:
        raise FileExistsError(f"{target!r} exists: pass another DEST, or --force to overwrite it")
    shutil.copyfile(source, target)
    return target
