"""The installed package carries its recipes: they are in the built wheel, ``hf-perf recipes`` lists, copies and
locates them, ``--config NAME`` takes a packaged recipe's name; the docs' links resolve; no import cycle."""
import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from hf_perf_callbacks import cli, train
from hf_perf_callbacks.train import recipes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hf_perf_callbacks")


RECIPES = os.path.join(ROOT, "recipes")
INSTALLED = "hf_perf_callbacks/recipes/"          # where the wheel puts the recipes folder


def folder_files(folder: str) -> dict[str, bytes]:
    """``{path relative to folder: bytes}`` of every file under ``folder`` (no caches)."""
    found = {}
    for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
        if os.path.isfile(path) and "__pycache__" not in path:
            found[os.path.relpath(path, folder).replace(os.sep, "/")] = open(path, "rb").read()
    return found


def build_wheel(tmp_path) -> str:
    """The wheel built the way pip builds it (setuptools, from a copy of the project: nothing is written into the
    checkout); its path."""
    pytest.importorskip("setuptools", minversion="77")      # the build backend pyproject.toml names
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), source)
    for folder in ("hf_perf_callbacks", "recipes"):
        shutil.copytree(os.path.join(ROOT, folder), source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".",
                           "-w", str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    return wheel


def test_the_wheel_carries_the_recipes_folder_byte_for_byte(tmp_path):
    """The top-level ``recipes/`` (YAMLs, accelerate configs, README) is the one source: the wheel holds exactly its
    files, unchanged, under ``hf_perf_callbacks/recipes/``; every package folder of the source is in the wheel (the
    package list in pyproject.toml is explicit); and ``hf-perf recipes path`` run from the unpacked wheel alone
    names the file inside it."""
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name[len(INSTALLED):]: archive.read(name) for name in archive.namelist()
                   if name.startswith(INSTALLED)}
        names = set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    source = folder_files(RECIPES)
    assert len(source) == len(recipes.recipe_names()) + len(recipes.accelerate_names()) + 1 >= 11   # + README.md
    assert shipped == source
    packages = {os.path.relpath(os.path.dirname(p), ROOT).replace(os.sep, "/") + "/__init__.py"
                for p in glob.glob(os.path.join(PACKAGE, "**", "__init__.py"), recursive=True)}
    assert packages - names == set()
    proc = subprocess.run([sys.executable, "-c", "import sys; from hf_perf_callbacks.cli import main; "
                           "sys.exit(main(['recipes', 'path', 'accelerate/fsdp']))"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "installed")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "installed" / "hf_perf_callbacks" / "recipes" / "accelerate" /
                                      "fsdp.yaml")


def test_the_checkout_reads_the_top_level_folder():
    """From a checkout (``PYTHONPATH=<checkout>``, an editable install) the recipes are the top-level folder's."""
    assert os.path.samefile(recipes.DIR, RECIPES)
    assert recipes.path("accelerate/mps") == os.path.join(RECIPES, "accelerate", "mps.yaml")


def test_one_copy_of_each_recipe():
    """The recipes live only in the top-level folder: no second copy among the project's files."""
    proc = subprocess.run(["git", "ls-files", "*.yaml"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        pytest.skip("not a git checkout")
    tracked = [os.path.basename(p) for p in proc.stdout.split()]
    assert all(tracked.count(os.path.basename(p)) == 1 for p in folder_files(RECIPES) if p.endswith(".yaml"))


# ---------------------------------------------------------------- hf-perf recipes
def test_recipes_lists_each_recipe_with_its_machine_and_model(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    machines = {"mac-16gb-qwen1.5b": "Apple Silicon, 16 GB", "mac-32gb-qwen3b": "Apple Silicon, 32 GB",
                "mac-64gb-qwen7b": "Apple Silicon, 64 GB", "cuda-1gpu-qwen1.5b": "1 NVIDIA GPU ≥ 24 GB",
                "cuda-ddp-qwen1.5b": "2 NVIDIA GPUs ≥ 24 GB", "cuda-fsdp-qwen7b": "2 NVIDIA GPUs of 80 GB"}
    assert sorted(machines) == recipes.recipe_names()
    for name, machine in machines.items():
        (line,) = [line for line in out.splitlines() if line.split()[:1] == [name]]
        config = yaml.safe_load(open(recipes.path(name), encoding="utf-8"))
        assert config["model_name_or_path"] in line and machine in line and "GRPO" not in line
    for name in recipes.accelerate_names():
        assert any(line.split()[:1] == [name] for line in out.splitlines())


def test_recipes_list_is_the_bare_command(capsys):
    assert cli.main(["recipes"]) == 0
    bare = capsys.readouterr().out
    assert cli.main(["recipes", "list"]) == 0
    assert capsys.readouterr().out == bare and "mac-16gb-qwen1.5b" in bare
    with pytest.raises(SystemExit) as exit_:
        cli.main(["recipes", "--help"])
    assert exit_.value.code == 0 and "list" in capsys.readouterr().out


def test_recipes_copy_writes_the_packaged_file_and_keeps_an_existing_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["recipes", "copy", "mac-32gb-qwen3b"]) == 0
    copied = tmp_path / "mac-32gb-qwen3b.yaml"
    assert copied.read_bytes() == open(recipes.path("mac-32gb-qwen3b"), "rb").read()
    assert "hf-perf train --config mac-32gb-qwen3b.yaml" in capsys.readouterr().out
    copied.write_text("# mine\n")
    assert cli.main(["recipes", "copy", "mac-32gb-qwen3b"]) == 2               # not overwritten
    assert "--force" in capsys.readouterr().err and copied.read_text() == "# mine\n"
    assert cli.main(["recipes", "copy", "mac-32gb-qwen3b", "--force"]) == 0
    assert copied.read_bytes() == open(recipes.path("mac-32gb-qwen3b"), "rb").read()
    (tmp_path / "cfg").mkdir()
    assert cli.main(["recipes", "copy", "accelerate/mps.yaml", "cfg"]) == 0     # into a folder, .yaml optional
    assert yaml.safe_load((tmp_path / "cfg" / "mps.yaml").read_text())["distributed_type"] == "NO"


def test_recipes_path_prints_the_packaged_file(capsys):
    assert cli.main(["recipes", "path", "accelerate/fsdp"]) == 0
    path = capsys.readouterr().out.strip()
    assert os.path.isfile(path) and yaml.safe_load(open(path))["distributed_type"] == "FSDP"


def test_an_unknown_name_lists_the_names(capsys):
    assert cli.main(["recipes", "path", "mac-16gb"]) == 2
    err = capsys.readouterr().err
    assert "'mac-16gb'" in err and all(name in err for name in recipes.recipe_names() + recipes.accelerate_names())


# ---------------------------------------------------------------- --config NAME
def test_config_takes_a_packaged_recipe_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, args, model_args = train.parse_recipe(["--config", "mac-16gb-qwen1.5b", "--use_cpu", "true"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-1.5B-Instruct" and args.output_dir == "runs/mac-16gb-qwen1.5b"
    _, args, _ = train.parse_recipe(["--config=cuda-1gpu-qwen1.5b.yaml", "--use_cpu", "true", "--bf16", "false"])
    assert args.per_device_train_batch_size == 8


def test_a_file_of_that_path_wins_over_the_packaged_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(open(recipes.path("mac-16gb-qwen1.5b")))
    (tmp_path / "mac-16gb-qwen1.5b").write_text(yaml.safe_dump({**config, "max_steps": 7}))
    _, args, _ = train.parse_recipe(["--config", "mac-16gb-qwen1.5b", "--use_cpu", "true"])
    assert args.max_steps == 7


def test_an_unknown_config_fails_with_the_names(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", "recipes/mac-16gb-qwen1.5b.yaml"]) == 2    # a clone's former path
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err and "--config mac-16gb-qwen1.5b" in err
    assert all(name in err for name in recipes.recipe_names())


# ---------------------------------------------------------------- docs and layers
def test_the_docs_links_resolve():
    """Every relative link of the READMEs points at a file or folder of the project."""
    for readme in (os.path.join(ROOT, "README.md"), os.path.join(recipes.DIR, "README.md")):
        text = open(readme, encoding="utf-8").read()
        links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)
                 if not link.startswith(("http://", "https://", "#"))]
        assert links
        missing = [link for link in links if not os.path.exists(os.path.join(os.path.dirname(readme), link))]
        assert not missing, f"{readme}: {missing}"


def test_the_recipes_readme_names_every_recipe():
    text = open(os.path.join(recipes.DIR, "README.md"), encoding="utf-8").read()
    assert all(f"`{name}`" in text for name in recipes.recipe_names())


def test_no_module_imports_the_command_line():
    """``cli`` imports the commands; nothing imports ``cli`` back (no cycle)."""
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        if os.path.basename(path) in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
                assert "cli" not in names and not (node.module or "").endswith(".cli"), path


def test_the_docs_give_the_launchers_quick_trial():
    for readme in (os.path.join(ROOT, "README.md"), os.path.join(recipes.DIR, "README.md")):
        assert train.QUICK_TRIAL in open(readme, encoding="utf-8").read(), readme


def test_the_public_names_resolve_and_the_errors_a_caller_catches_are_exported():
    """``from hf_perf_callbacks import *`` gives every name of ``__all__`` (the lazy ones loaded on use), the errors
    a caller of ``train_with_tuning``, the lock or the report catches among them, and the ``TYPE_CHECKING`` block
    names the same lazy names for type checkers."""
    import inspect

    import hf_perf_callbacks as package

    namespace: dict = {}
    exec("from hf_perf_callbacks import *", namespace)
    assert set(package.__all__) <= set(namespace)
    for error in ("UnfixableOOM", "InexactResize", "PeerFailed", "OutputDirBusy", "ReportError"):
        assert issubclass(namespace[error], Exception)
    source = inspect.getsource(package)
    checked = source[source.index("if TYPE_CHECKING:"):source.index("def __getattr__")]
    assert all(name in checked for name in package._LAZY)
