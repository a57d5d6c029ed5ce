"""Recipes and the recipe launcher: every recipe parses and validates; every single-device recipe trains 2 steps on a
tiny local model (CPU, offline) through ``train.main`` in this process, and one under ``accelerate launch``; the DDP
and FSDP recipes run on 2 CPU processes (the launched runs are marked ``launch``); typos and impossible combinations
fail early with the fix."""
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from hf_perf_callbacks import keys, train
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.splitfile import SplitFile, read_split_file
from hf_perf_callbacks.core.validation import closest, did_you_mean
from hf_perf_callbacks.tasks import wordle
from hf_perf_callbacks.train import arguments, build, checks, launch, recipes
from tests.conftest import save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = recipes.recipe_names()
SINGLE = [name for name in NAMES if "ddp" not in name and "fsdp" not in name]
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
CPU = ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--max_completion_length", "8",
       "--max_steps", "2", "--dataset_size", "16", "--logging_steps", "1"]


def recipe_path(name):
    return recipes.path(name)


def target(name):
    """(device, world size) a recipe is written for."""
    return ("mps" if name.startswith("mac") else "cuda"), (2 if "ddp" in name or "fsdp" in name else 1)


def values_of(config: dict, args=()):
    return arguments.raw_values(arguments.make_parser(), config, list(args))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    corpus = list(wordle.make_dataset(64, seed=0)["prompt"])
    corpus += [f"<think>try {w}</think><guess>{w}</guess>" for w in wordle.load_words()]
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")), corpus)


def accelerate_launch(cmd, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)            # its own process group: a hang kills every rank
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("the launch hung for 240 s:\n" + out[-2000:] + err[-6000:])
    assert proc.returncode == 0, out[-2000:] + err[-6000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check_run(out, world_size=1) -> list[dict]:
    """Two optimizer steps ran, logged once each, with the adapter saved; returns the step lines of perf_log.jsonl."""
    state = json.load(open(os.path.join(out, "trainer_state.json")))
    assert state["global_step"] == 2
    lines = [json.loads(line) for line in open(os.path.join(out, "perf_log.jsonl"))]
    steps = [line for line in lines if line["type"] == "step"]
    assert [line["step"] for line in steps] == [1, 2]
    header = next(line for line in lines if line["type"] == "run" and "perf" in line["sources"])
    assert header["world_size"] == world_size
    assert os.path.exists(os.path.join(out, "adapter_model.safetensors"))
    return steps


# ---------------------------------------------------------------- the recipes themselves
@pytest.mark.parametrize("name", NAMES)
def test_recipe_parses_and_validates_for_its_machine(name):
    config = arguments.read_recipe(recipe_path(name))
    parser = arguments.make_parser()
    arguments.check_keys(parser, config, [])
    values = arguments.raw_values(parser, config, [])
    device, world = target(name)
    checks.check_recipe(values, device=device, bf16_supported=True, world_size=world)
    assert values["dataset"] == "wordle" and values["beta"] == 0
    assert values["use_peft"] is ("fsdp" not in name)               # the FSDP recipe is a full fine-tune
    assert values["max_completion_length"] == 128
    if "fsdp" not in name:                                           # its checkpoints are ~85 GiB, not MBs
        assert values["save_steps"] == 50 and values["save_total_limit"] == 3
    assert values["dtype"] == "bfloat16"
    if device == "mps":
        assert values["activation_checkpointing"] is True and values["bf16"] is False
        assert values["dataloader_num_workers"] == 0
        assert values["callback_kwargs"]["MemoryWatchdog"]["limit_gb"] > 0
    build.build_callbacks([n for n in values["callbacks"]], values.get("callback_kwargs") or {})
    build.resolve_reward_funcs(values["reward_funcs"], values["max_completion_length"])


@pytest.mark.parametrize("name", NAMES)
def test_recipe_builds_grpo_config_on_this_cpu(name, tmp_path):
    recipe, args, model_args = train.parse_recipe(["--config", recipe_path(name), "--use_cpu", "true",
                                                   "--bf16", "false", "--output_dir", str(tmp_path)])
    assert args.generation_batch_size % args.num_generations == 0
    assert recipe.callbacks
    if model_args.use_peft:
        assert model_args.lora_target_modules == "all-linear"


@pytest.mark.parametrize("name", NAMES)
def test_every_non_default_line_says_why(name):
    for line in open(recipe_path(name), encoding="utf-8"):
        if re.match(r"^\s*\w+:\s*\S", line) and not line.lstrip().startswith("#"):
            assert " # " in line, f"{name}: no comment on {line.strip()!r}"


MAC_TIERS = ("mac-16gb-qwen1.5b", "mac-32gb-qwen3b", "mac-64gb-qwen7b")
MPS_DRIVER_FACTOR = 2        # MPS driver memory / CUDA allocator peak the tiers assume (the recipes' README.md)
TIER_MARGIN = 0.15           # what 2 × the estimate must leave of the budget


def tier_estimate(recipe: dict, model_name: str) -> float:
    """The recipe's estimated peak (GiB) with ``model_name`` in place of its model: the recipes' README.md's inputs."""
    from hf_perf_callbacks.estimate import QWEN25, estimate_grpo_memory, lora_param_count

    m = QWEN25[model_name]
    micro, accum = recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"]
    assert recipe["lora_target_modules"] == ["all-linear"] and not recipe["bf16"]
    return estimate_grpo_memory(m, micro_batch=micro, num_generations=recipe["num_generations"],
                                generation_batch=micro * accum, prompt_tokens=200,
                                max_completion_length=recipe["max_completion_length"], dtype_bytes=2,
                                lora_params=lora_param_count(m, recipe["lora_r"]),
                                activation_checkpointing=recipe["activation_checkpointing"], lm_head="torch",
                                lora_input_bytes=4)["peak"] / 1024**3


def fits(recipe: dict, model_name: str) -> bool:
    budget = recipe["callback_kwargs"]["MemoryWatchdog"]["limit_gb"]
    return MPS_DRIVER_FACTOR * tier_estimate(recipe, model_name) <= (1 - TIER_MARGIN) * budget


def test_mac_tiers_step_up_in_model_and_budget():
    budgets = [yaml.safe_load(open(recipe_path(n)))["callback_kwargs"]["MemoryWatchdog"]["limit_gb"]
               for n in MAC_TIERS]
    assert budgets == sorted(budgets) and 9 <= budgets[0] <= 11
    assert sorted(NAMES) == sorted(MAC_TIERS + ("cuda-1gpu-qwen1.5b", "cuda-ddp-qwen1.5b", "cuda-fsdp-qwen7b"))


@pytest.mark.parametrize("name", MAC_TIERS)
def test_each_mac_tier_runs_the_largest_model_that_fits(name):
    from hf_perf_callbacks.estimate import QWEN25

    recipe = yaml.safe_load(open(recipe_path(name)))
    by_size = sorted(QWEN25, key=lambda n: QWEN25[n]["params"])
    chosen = recipe["model_name_or_path"]
    assert fits(recipe, chosen)
    larger = by_size[by_size.index(chosen) + 1:]
    assert not any(fits(recipe, n) for n in larger)
    # the split is the largest micro-batch of the Mac recipes' splits that still fits the same batch
    assert recipe["per_device_train_batch_size"] == 2 and recipe["gradient_accumulation_steps"] == 4
    assert recipe["max_completion_length"] == 128 and recipe["activation_checkpointing"]   # field report's lessons
    assert f"runs/{name}" == recipe["output_dir"] and chosen.split("-")[1].lower() in name


def test_readme_tier_table_matches_the_recipes():
    text = open(os.path.join(recipes.DIR, "README.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (\d+) GiB \| (Qwen2\.5-[\w.-]+) \| (\d+) × (\d+) \| ([\d.]+) \| ([^|]+) \| ([\d.]+) \| "
                      r"(\d+) \| (\d+) % \|", text, flags=re.M)
    assert len(rows) == len(MAC_TIERS)
    for name, (ram, model, micro, accum, est, measured, doubled, budget, margin) in zip(MAC_TIERS, rows):
        recipe = yaml.safe_load(open(recipe_path(name)))
        assert name.startswith(f"mac-{ram}gb") and recipe["model_name_or_path"] == f"Qwen/{model}"
        assert (int(micro), int(accum)) == (recipe["per_device_train_batch_size"],
                                            recipe["gradient_accumulation_steps"])
        value = tier_estimate(recipe, recipe["model_name_or_path"])
        assert est == f"{value:.2f}" and doubled == f"{MPS_DRIVER_FACTOR * value:.2f}"
        assert int(budget) == recipe["callback_kwargs"]["MemoryWatchdog"]["limit_gb"]
        assert int(margin) == round(100 * (1 - MPS_DRIVER_FACTOR * value / int(budget)))
        assert measured.strip() == "pending GPU run" or float(measured) > 0


def test_accelerate_configs():
    load = lambda n: yaml.safe_load(open(recipes.path(f"accelerate/{n}")))  # noqa: E731
    mps, single, multi = load("mps"), load("single_gpu"), load("multi_gpu")
    assert (mps["distributed_type"], mps["num_processes"], mps["mixed_precision"]) == ("NO", 1, "no")
    assert (single["distributed_type"], single["num_processes"]) == ("NO", 1)
    assert (multi["distributed_type"], multi["num_processes"], multi["mixed_precision"]) == ("MULTI_GPU", 2, "bf16")


# ---------------------------------------------------------------- 2 optimizer steps on a tiny model (CPU)
#: the recipe that also runs under `accelerate launch`; it runs the whole path (tuner and report), the others
#: skip both to stay fast
FULL = "mac-16gb-qwen1.5b"


def recipe_flags(name, tiny_model, out) -> list[str]:
    """The launcher's flags for ``name`` on this CPU: the recipe, the tiny model, 2 optimizer steps."""
    extra = [] if name == FULL else ["--tune", "false", "--report", "false"]
    return ["--config", recipe_path(name), "--model_name_or_path", tiny_model, "--output_dir", str(out), *CPU,
            *extra]


def check_trained(out, name, world_size=1) -> list[dict]:
    """:func:`check_run`, and the recipe's own batch split trained with a finite loss; for the full path, the tuner's
    tuning decision and the report."""
    steps = check_run(out, world_size)
    recipe = arguments.read_recipe(recipe_path(name))
    effective = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] * world_size
    assert [s[keys.TUNER_EFFECTIVE_BATCH] for s in steps] == [effective, effective]
    state = json.load(open(os.path.join(out, "trainer_state.json")))
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(loss == loss and abs(loss) != float("inf") for loss in losses)
    from hf_perf_callbacks.core.runlog import read_run

    assert read_run(out).header().launcher == "hf-perf train"        # the report words its advice as recipe keys
    recorded = os.path.exists(os.path.join(out, "tuner_split.json"))
    if name == FULL:
        assert os.path.exists(os.path.join(out, "perf_report.md"))
        assert recorded and read_split_file(out).decisions[0].kind == "tune"          # two steps: too short to tune
    else:
        assert not os.path.exists(os.path.join(out, "perf_report.md"))
    return steps


@pytest.mark.launch
@pytest.mark.parametrize("name", [FULL])
def test_recipe_trains_two_steps_under_accelerate(name, tiny_model, tmp_path):
    """The real launcher, once: ``accelerate launch --cpu -m hf_perf_callbacks.train`` (the in-process test below
    trains every single-device recipe the same way, without a new process)."""
    out = tmp_path / "out"
    proc = accelerate_launch([ACCELERATE, "launch", "--num_processes", "1", "--cpu", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_perf_callbacks.train",
                   *recipe_flags(name, tiny_model, out)], tmp_path)
    check_trained(out, name)
    assert "the perf report failed" not in proc.stderr


@pytest.fixture
def launcher_process(tmp_path, monkeypatch):
    """What ``launch`` gives a launched process, for ``train.main`` run in this one: its environment (restored
    afterwards, with anything the run adds), its working directory and ``sys.path`` (restored), and the package's
    log level (``train.main`` raises it to INFO; put back) and torch's threads (the launcher chooses them; put
    back)."""
    import logging

    import torch

    environ = dict(os.environ)
    level, threads = logging.getLogger("hf_perf_callbacks").level, torch.get_num_threads()
    for key, value in {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
                       "WANDB_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    for key in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    logging.getLogger("hf_perf_callbacks").setLevel(level)
    torch.set_num_threads(threads)
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


@pytest.mark.parametrize("name", SINGLE)
def test_recipe_trains_two_steps_in_process(name, tiny_model, tmp_path, launcher_process, caplog, capsys):
    """Every single-device recipe's settings train 2 optimizer steps through ``train.main`` with the flags the
    launched test passes, in this process (no new interpreter to import torch, transformers and TRL again)."""
    out = tmp_path / "out"
    assert train.main(recipe_flags(name, tiny_model, out)) == 0
    check_trained(out, name)
    captured = capsys.readouterr()
    err = captured.err
    assert "the perf report failed" not in caplog.text + err and "the analysis failed" not in err
    check_compact_console(captured.out, out)


def check_compact_console(out: str, output_dir) -> None:
    """The console's log lines are TRL's own dict plus the callbacks' headline keys (``keys.CONSOLE_KEYS``), while
    ``log_history`` keeps every key of the callbacks."""
    import ast

    printed = [ast.literal_eval(line) for line in re.findall(r"\{'loss'.*?\}", out)]
    history = [h for h in json.load(open(os.path.join(output_dir, "trainer_state.json")))["log_history"]
               if "loss" in h]
    assert len(printed) == len(history) == 2
    for shown, logged in zip(printed, history):
        callbacks = {k for k in logged if k.startswith(("perf/", "mem/", "tuner/", "cache/"))}
        assert len(callbacks - set(keys.CONSOLE_KEYS)) >= 10                   # the full set reached log_history
        assert set(shown) == set(logged) - {"step", "total_flos"} - (callbacks - set(keys.CONSOLE_KEYS))
        assert {"reward", "loss", keys.PERF_TOKENS_PER_SEC, keys.TUNER_MICRO_BATCH} <= set(shown)


@pytest.mark.launch
def test_ddp_recipe_runs_on_two_cpu_processes(tiny_model, tmp_path):
    out = tmp_path / "out"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    accelerate_launch([ACCELERATE, "launch", "--config_file", recipes.path("accelerate/multi_gpu"),
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
            "-m", "hf_perf_callbacks.train", "--config", recipe_path("cuda-ddp-qwen1.5b"),
            "--model_name_or_path", tiny_model, "--output_dir", str(out), *CPU, "--tune", "false",
            "--report", "false"], tmp_path)
    steps = check_run(out, world_size=2)
    recipe = arguments.read_recipe(recipe_path("cuda-ddp-qwen1.5b"))
    effective = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] * 2
    assert [s[keys.TUNER_EFFECTIVE_BATCH] for s in steps] == [effective, effective]   # both ranks counted
    assert all(s[keys.PERF_TOKENS_PER_SEC] > 0 for s in steps[1:])


def test_fsdp_accelerate_config():
    fsdp = yaml.safe_load(open(recipes.path("accelerate/fsdp")))
    assert (fsdp["distributed_type"], fsdp["num_processes"], fsdp["mixed_precision"]) == ("FSDP", 2, "bf16")
    config = fsdp["fsdp_config"]
    assert config["fsdp_version"] == 2 and config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT" and config["fsdp_offload_params"] is False
    recipe = arguments.read_recipe(recipe_path("cuda-fsdp-qwen7b"))
    assert config["fsdp_activation_checkpointing"] and recipe["activation_checkpointing"] is False   # not both


def test_the_fsdp_recipe_needs_sharding_and_fits_when_sharded():
    """Its full fine-tune does not fit one 80 GiB GPU (DDP's full copy) but does, sharded over its GPUs, under the
    watchdog's default budget (0.85 × 80e9 bytes here, below the 67.3 GiB an H100 gives), by the package's memory
    model."""
    from hf_perf_callbacks.estimate import QWEN25, estimate_grpo_memory

    values = values_of(arguments.read_recipe(recipe_path("cuda-fsdp-qwen7b")))
    gpus = yaml.safe_load(open(recipes.path("accelerate/fsdp")))["num_processes"]
    settings = dict(micro_batch=values["per_device_train_batch_size"], num_generations=values["num_generations"],
                    generation_batch=values["per_device_train_batch_size"] * values["gradient_accumulation_steps"],
                    prompt_tokens=200, max_completion_length=values["max_completion_length"], dtype_bytes=2,
                    lora_params=0, activation_checkpointing=True, full_finetune=True)
    model = QWEN25[values["model_name_or_path"]]
    gpu = 80e9
    assert estimate_grpo_memory(model, shards=1, **settings)["weights"] > gpu
    assert estimate_grpo_memory(model, shards=gpus, **settings)["peak"] < 0.85 * gpu


@pytest.mark.launch
def test_fsdp_recipe_runs_on_two_cpu_processes(tiny_model, tmp_path, monkeypatch):
    """The recipe with its accelerate config on 2 CPU processes, FSDP2 over gloo: accelerate turns FSDP on only for
    GPU processes, so the launched processes load ``tests/scripts/two_rank_fsdp.py``'s switch through a
    ``sitecustomize`` (the one thing a GPU machine does differently); the rest is the real path: sharded GRPO full
    fine-tune, a sharded checkpoint, the final model gathered into one file."""
    out, shim = tmp_path / "out", tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests', 'scripts')!r})\n"
        "from two_rank_fsdp import fsdp_on_cpu\n"
        "fsdp_on_cpu()\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PYTHONPATH", f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    accelerate_launch([ACCELERATE, "launch", "--config_file", recipes.path("accelerate/fsdp"),
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
            "-m", "hf_perf_callbacks.train", "--config", recipe_path("cuda-fsdp-qwen7b"),
            "--model_name_or_path", tiny_model, "--output_dir", str(out), *CPU, "--save_steps", "2",
            "--report", "false"], tmp_path)
    state = json.load(open(out / "trainer_state.json"))
    assert state["global_step"] == 2
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(os.listdir(out / "checkpoint-2"))   # sharded
    assert os.path.exists(out / "model.safetensors")                      # the final model, gathered
    lines = [json.loads(line) for line in open(out / "perf_log.jsonl")]
    steps = [line for line in lines if line["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2] and all(s[keys.PERF_TOKENS_PER_SEC] > 0 for s in steps)
    assert any(line["type"] == "event" and "under FSDP" in line["message"] for line in lines)


# ---------------------------------------------------------------- typos fail first, naming the closest key
def write_recipe(tmp_path, **changes):
    config = yaml.safe_load(open(recipe_path("mac-16gb-qwen1.5b")))
    config.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture
def nothing_heavy(monkeypatch):
    """Fail the test if the launcher gets as far as loading a model."""
    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the recipe was rejected")
    monkeypatch.setattr(launch, "build_model", boom)


def test_typo_in_recipe_names_the_key_and_closest_match(tmp_path, capsys, nothing_heavy):
    path = write_recipe(tmp_path, lora_rank=8)
    assert train.main(["--config", path, "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    names = arguments.field_names()
    assert closest("lora_rank", names) == "lora_r"          # not local_rank: the same first word
    assert "'lora_rank'" in err and did_you_mean("lora_rank", names) in err


def test_typo_on_command_line_names_the_flag_and_closest_match(tmp_path, capsys, nothing_heavy):
    assert train.main(["--config", write_recipe(tmp_path), "--learning_rat", "1e-5"]) == 2
    err = capsys.readouterr().err
    names = arguments.field_names()
    assert closest("learning_rat", names) == "learning_rate"
    assert "'--learning_rat'" in err and did_you_mean("learning_rat", names, "--") in err


def test_all_typos_are_reported_at_once(tmp_path):
    parser = arguments.make_parser()
    with pytest.raises(train.RecipeError) as error:
        arguments.check_keys(parser, {"lora_rank": 8, "num_generation": 4, "env": {"A": "1"}}, ["--max_step", "3"])
    text = str(error.value)
    assert "'lora_r'" in text and "'num_generations'" in text and "'--max_steps'" in text and "env" not in text


@pytest.mark.parametrize("values, world, expected", [
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_generations": 3}, 2, Split(2, 3, 3)),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_generations": 4,
      "steps_per_generation": 4}, 1, Split(2, 3, 4)),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_generations": 4,
      "generation_batch_size": 16}, 2, Split(2, 3, 4)),
])
def test_batch_geometry_returns_the_splits_generation_batch(values, world, expected):
    assert checks.check_batch_geometry(values, world) == expected.generation_batch(world)


def test_batch_geometry_suggests_the_next_whole_group_accumulation():
    values = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 3, "num_generations": 4}
    with pytest.raises(train.RecipeError, match=r"gradient_accumulation_steps \(3\) = 3, .* multiple of 4, e\.g\. 4,"):
        checks.check_batch_geometry(values, 1)


def test_the_launchers_default_callbacks_are_default_callbacks():
    """One list of the package's callbacks: the launcher's default builds what ``default_callbacks()`` builds."""
    from hf_perf_callbacks import default_callbacks

    names = [type(callback).__name__ for callback in default_callbacks()]
    assert train.RecipeArguments().callbacks == names
    assert [type(c).__name__ for c in build.build_callbacks(train.RecipeArguments().callbacks, {})] == names


def test_recipe_fields_do_not_collide_with_trl():
    import dataclasses

    from trl import GRPOConfig, ModelConfig

    ours = {f.name for f in dataclasses.fields(train.RecipeArguments)}
    theirs = {f.name for cls in (GRPOConfig, ModelConfig) for f in dataclasses.fields(cls)}
    assert not ours & theirs


def test_command_line_overrides_yaml(tmp_path):
    recipe, args, model_args = train.parse_recipe(["--config", write_recipe(tmp_path), "--use_cpu", "true",
                                                   "--max_steps", "7", "--callbacks", "ThroughputMeter",
                                                   "--callback_kwargs", '{"ThroughputMeter": {"window_steps": 3}}',
                                                   "--output_dir", str(tmp_path / "o")])
    assert args.max_steps == 7 and recipe.callbacks == ["ThroughputMeter"]
    assert recipe.callback_kwargs == {"ThroughputMeter": {"window_steps": 3}}
    assert build.build_callbacks(recipe.callbacks, recipe.callback_kwargs)[0].window_steps == 3


# ---------------------------------------------------------------- impossible combinations: one test per check
GRPO_DEFAULTS = dict(use_cpu=True, bf16=False)


def test_batch_rule_says_what_to_change():
    values = values_of({**GRPO_DEFAULTS, "num_generations": 2, "per_device_train_batch_size": 1,
                        "gradient_accumulation_steps": 3})
    with pytest.raises(train.RecipeError) as error:
        checks.check_recipe(values, device="cpu", bf16_supported=True)
    text = str(error.value)
    assert "gradient_accumulation_steps (3) = 3" in text and "num_generations (2)" in text and "e.g. 4" in text


def test_batch_rule_is_checked_before_grpo_config(tmp_path, capsys, nothing_heavy):
    path = write_recipe(tmp_path, gradient_accumulation_steps=3)        # 2 × 3 = 6, num_generations 8
    assert train.main(["--config", path, "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    assert "generation_batch_size = per_device_train_batch_size (2)" in err and "multiple of 4, e.g. 4" in err


def test_batch_rule_counts_the_world_size():
    values = values_of({**GRPO_DEFAULTS, "num_generations": 4, "per_device_train_batch_size": 1,
                        "gradient_accumulation_steps": 2})
    with pytest.raises(train.RecipeError, match="world size \\(1\\)"):
        checks.check_recipe(values, device="cpu", bf16_supported=True, world_size=1)
    checks.check_recipe(values, device="cpu", bf16_supported=True, world_size=2)     # 1 × 2 × 2 = 4


def test_num_generations_below_two():
    values = values_of({**GRPO_DEFAULTS, "num_generations": 1, "per_device_train_batch_size": 2})
    with pytest.raises(train.RecipeError, match="num_generations=1 .* at least 2"):
        checks.check_recipe(values, device="cpu", bf16_supported=True)


def test_generation_batch_and_steps_per_generation_together():
    values = values_of({**GRPO_DEFAULTS, "generation_batch_size": 16, "steps_per_generation": 2})
    with pytest.raises(train.RecipeError, match="set only one"):
        checks.check_recipe(values, device="cpu", bf16_supported=True)


def test_generation_batch_must_split_into_micro_batches():
    values = values_of({**GRPO_DEFAULTS, "generation_batch_size": 12, "per_device_train_batch_size": 8})
    with pytest.raises(train.RecipeError, match="generation_batch_size=12 .* multiple of"):
        checks.check_recipe(values, device="cpu", bf16_supported=True)


def test_eval_batch_rule():
    values = values_of({**GRPO_DEFAULTS, "num_generations": 4, "per_device_train_batch_size": 4,
                        "eval_dataset_size": 8, "eval_strategy": "steps", "per_device_eval_batch_size": 6})
    with pytest.raises(train.RecipeError, match="per_device_eval_batch_size .* multiple of 4"):
        checks.check_recipe(values, device="cpu", bf16_supported=True)


def test_too_few_wordle_prompts_for_one_generation_batch():
    values = values_of({**GRPO_DEFAULTS, "num_generations": 2, "per_device_train_batch_size": 8,
                        "dataset_size": 3})
    with pytest.raises(train.RecipeError, match="dataset_size=3 is too small: .* 4 prompts"):
        checks.check_recipe(values, device="cpu", bf16_supported=True)


def test_bf16_on_mps_before_macos_14():
    values = values_of({"bf16": True, "dtype": "float32"})
    with pytest.raises(train.RecipeError, match="bf16: false .* macOS 14"):
        checks.check_recipe(values, device="mps", bf16_supported=False)


def test_bf16_dtype_on_mps_before_macos_14():
    values = values_of({"bf16": False, "dtype": "bfloat16"})
    with pytest.raises(train.RecipeError, match="dtype: bfloat16 .* macOS 14"):
        checks.check_recipe(values, device="mps", bf16_supported=False)


def test_trl_default_bf16_on_a_cpu_only_machine():
    values = values_of({})                                   # bf16 unset: TRL turns it on
    with pytest.raises(train.RecipeError, match="TRL then turns bf16 on.*use_cpu: true"):
        checks.check_recipe(values, device="cpu", bf16_supported=False)
    checks.check_recipe(values_of({"use_cpu": True}), device="cpu", bf16_supported=False)


def test_bf16_on_old_cuda():
    values = values_of({"bf16": True})
    with pytest.raises(train.RecipeError, match="fp16: true .* Ampere"):
        checks.check_recipe(values, device="cuda", bf16_supported=False)


def test_accelerate_bf16_on_a_device_without_bf16():
    values = values_of({"bf16": False, "dtype": "float16"})
    with pytest.raises(train.RecipeError, match="mixed_precision: bf16 .* --mixed_precision no"):
        checks.check_recipe(values, device="mps", bf16_supported=False, accelerate_mixed_precision="bf16")


@pytest.mark.parametrize("init_kwargs", [{"device_map": "auto"}, '{"device_map": "auto"}'])
def test_device_map_auto_on_mps(init_kwargs):
    values = values_of({"bf16": False, "model_init_kwargs": init_kwargs})
    with pytest.raises(train.RecipeError, match="TRL #7220"):
        checks.check_recipe(values, device="mps", bf16_supported=True)
    checks.check_recipe(values, device="cuda", bf16_supported=True)       # fine off MPS


def test_this_machine_is_detected():
    kind, bf16, _ = checks.detect_device(use_cpu=True)
    assert (kind, bf16) == ("cpu", True)


def test_an_xpu_is_detected_as_itself(monkeypatch):
    """No XPU here: a DeviceLayer posing as one (type and name, as torch.xpu reports them) stands in."""
    from hf_perf_callbacks.platform import device

    class FakeXPU(device.DeviceLayer):
        def __init__(self):
            super().__init__("cpu")
            self.type, self._name = "xpu", "Intel(R) Data Center GPU Max 1550"

    monkeypatch.setattr(device, "DeviceLayer", FakeXPU)
    monkeypatch.setattr(checks, "no_gpu_visible", lambda: False)       # a machine with a GPU's device files
    assert checks.detect_device() == ("xpu", True, "Intel XPU Intel(R) Data Center GPU Max 1550")


# ---------------------------------------------------------------- names, resume, the tuner's split
def test_unknown_callback_and_reward_names_suggest_the_closest():
    with pytest.raises(train.RecipeError, match="did you mean 'MemoryWatchdog'"):
        build.build_callbacks(["MemoryWatchdg"], {})
    with pytest.raises(train.RecipeError, match="did you mean 'think_format_reward'"):
        build.resolve_reward_funcs(["think_format_rewrd"], 128)
    with pytest.raises(train.RecipeError, match="cannot import module"):
        build.resolve_reward_funcs(["no_such_pkg.reward"], 128)
    with pytest.raises(train.RecipeError, match="twice"):
        build.build_callbacks(["ThroughputMeter", "ThroughputMeter"], {})
    with pytest.raises(train.RecipeError, match="callback_kwargs\\['MemoryWatchdog'\\]"):
        build.build_callbacks(["MemoryWatchdog"], {"MemoryWatchdog": {"limit": 3}})
    assert build.build_callbacks(["none"], {}) == []                    # the recipe's word for no callbacks


def test_trl_reward_names_resolve():
    funcs = build.resolve_reward_funcs(["think_format_reward", "get_soft_overlong_punishment"], 128)
    assert all(callable(f) for f in funcs)


def test_resume_last_without_checkpoint(tmp_path):
    with pytest.raises(train.RecipeError, match="no complete checkpoint-N folder"):
        checks.resolve_checkpoint("last", str(tmp_path))
    complete_checkpoint(tmp_path, 4)
    complete_checkpoint(tmp_path, 12)
    (tmp_path / "checkpoint-13").mkdir()                       # a partial one: moved aside, never the newest
    assert checks.resolve_checkpoint("last", str(tmp_path)).endswith("checkpoint-12")
    assert not (tmp_path / "checkpoint-13").exists()
    assert (tmp_path / "moved_aside" / "checkpoint-13.partial-1").is_dir()
    with pytest.raises(train.RecipeError, match="no such directory"):
        checks.resolve_checkpoint(str(tmp_path / "nope"), str(tmp_path))


def complete_checkpoint(output_dir, step):
    """The files that make a checkpoint folder complete for the resume check: weights and trainer_state.json."""
    path = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, "model.safetensors"), "wb").close()
    with open(os.path.join(path, "trainer_state.json"), "w") as fh:
        json.dump({"global_step": step}, fh)
    return path


def record_split(output_dir, split):
    """The split file of a run the tuner re-sized (written by the tuning session's record, the file's one writer),
    and a checkpoint to resume from."""
    complete_checkpoint(output_dir, 2)
    SplitFile(session="recorded", world_size=1, configured=Split(2, 4, 4), split=split).write(output_dir)


def test_saved_split_is_applied_on_resume_and_keeps_the_generation_batch(tmp_path, caplog):
    out = str(tmp_path / "o")
    record_split(out, Split(1, 8, 8))
    with caplog.at_level("INFO", logger="hf_perf_callbacks.train"):
        _, args, _ = train.parse_recipe(["--config", write_recipe(tmp_path), "--use_cpu", "true",
                                         "--output_dir", out, "--resume_from_checkpoint", "last"])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 8)
    assert args.generation_batch_size == 8 and args.steps_per_generation == 8      # recipe: 2 × 4 = 8
    assert args.resume_from_checkpoint.endswith("checkpoint-2")
    assert any(out in r.getMessage() and str(Split(1, 8, 8).as_args()) in r.getMessage() for r in caplog.records)


def test_saved_split_is_not_applied_to_a_fresh_run(tmp_path, caplog):
    out = str(tmp_path / "o")
    record_split(out, Split(1, 8, 8))
    with caplog.at_level("INFO", logger="hf_perf_callbacks.train"):
        _, args, _ = train.parse_recipe(["--config", write_recipe(tmp_path), "--use_cpu", "true",
                                         "--output_dir", out])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)      # the recipe's
    assert args.resume_from_checkpoint is None and str(Split(1, 8, 8).as_args()) not in caplog.text


def test_saved_split_of_another_effective_batch_is_not_applied(tmp_path, caplog):
    out = str(tmp_path / "o")
    record_split(out, Split(1, 8, 8))
    with caplog.at_level("INFO", logger="hf_perf_callbacks.train"):
        _, args, _ = train.parse_recipe(["--config", write_recipe(tmp_path), "--use_cpu", "true",
                                         "--output_dir", out, "--resume_from_checkpoint", "last",
                                         "--gradient_accumulation_steps", "8"])     # the recipe's batch is now 16
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8)
    assert "effective batch 8 (1×8 over 1 rank(s)) differs from the run's 16" in caplog.text
    assert "applying the split" not in caplog.text


def test_saved_split_with_steps_per_generation_replaces_generation_batch_size(tmp_path):
    out = str(tmp_path / "o")
    record_split(out, Split(1, 8, 8))
    _, args, _ = train.parse_recipe(["--config", write_recipe(tmp_path, generation_batch_size=8), "--use_cpu", "true",
                                     "--output_dir", out, "--resume_from_checkpoint", "last"])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 8)
    assert args.steps_per_generation == 8 and args.generation_batch_size == 8


def test_local_dataset_files(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}", "target": i}) + "\n" for i in range(10)))
    data, held_out = build.build_datasets(train.RecipeArguments(dataset=str(rows), eval_dataset_size=2), seed=0,
                                          conversational=False)
    assert (len(data), len(held_out)) == (8, 2) and "target" in data.column_names
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(train.RecipeError, match="no 'prompt' column"):
        build.build_datasets(train.RecipeArguments(dataset=str(bad)), seed=0, conversational=False)
    with pytest.raises(train.RecipeError, match="no such file"):
        build.build_datasets(train.RecipeArguments(dataset=str(tmp_path / "nope.json")), seed=0, conversational=False)


def test_wordle_datasets_follow_the_sizes():
    data, held_out = build.build_datasets(train.RecipeArguments(dataset_size=6, eval_dataset_size=3), seed=0,
                                          conversational=True)
    assert (len(data), len(held_out)) == (6, 3) and data[0]["prompt"][0]["role"] == "user"
    assert not set(data["secret"]) & set(held_out["secret"])


def test_a_failing_report_does_not_fail_the_finished_run(monkeypatch, caplog):
    def broken(output_dir, plots=True):
        raise RuntimeError("plot backend missing")
    from hf_perf_callbacks import report as run_report

    monkeypatch.setattr(run_report, "report_command", broken)
    with caplog.at_level("ERROR", logger="hf_perf_callbacks.train"):
        launch._report("runs/x")
    assert "hf-perf report runs/x" in caplog.text


# ---------------------------------------------------------------- bf16 on every device kind
@pytest.mark.parametrize("device, fix", [("cpu", "set use_cpu: true"), ("mps", "macOS 14"), ("cuda", "Ampere"),
                                         ("xpu", "dtype: float16 or float32")])
def test_bf16_weights_on_a_device_without_bf16(device, fix):
    values = values_of({"bf16": False, "dtype": "bfloat16"})
    with pytest.raises(train.RecipeError, match=f"dtype: bfloat16 loads the weights in bf16 .*{re.escape(fix)}"):
        checks.check_recipe(values, device=device, bf16_supported=False)
    checks.check_recipe(values, device=device, bf16_supported=True)
    checks.check_recipe(values_of({"bf16": False, "dtype": "bfloat16", "use_cpu": True}), device=device,
                       bf16_supported=False)                    # the CPU chosen on purpose: bf16 is its business


@pytest.mark.parametrize("kind, bf16, expected", [
    ("mps", True, ("mps", True, "Apple MPS")),
    ("mps", False, ("mps", False, "Apple MPS on macOS older than 14")),
    ("cuda", True, ("cuda", True, "CUDA GPU NVIDIA H100 80GB HBM3")),
    ("cuda", False, ("cuda", False, "CUDA GPU NVIDIA H100 80GB HBM3"))])
def test_each_device_kind_is_detected(kind, bf16, expected, monkeypatch):
    """No GPU or Mac here: a DeviceLayer posing as one (its type, name and bf16 answer) stands in."""
    from hf_perf_callbacks.platform import device

    class FakeDevice(device.DeviceLayer):
        def __init__(self):
            super().__init__("cpu")
            self.type, self._name = kind, "NVIDIA H100 80GB HBM3"

        def bf16_supported(self):
            return bf16

    monkeypatch.setattr(device, "DeviceLayer", FakeDevice)
    monkeypatch.setattr(checks, "no_gpu_visible", lambda: False)       # a machine with a GPU's device files
    assert checks.detect_device() == expected
    assert checks.detect_device(use_cpu=True)[:2] == ("cpu", True)


def test_a_cpu_only_machine_without_use_cpu_is_detected_as_such(monkeypatch):
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    kind, bf16, _ = checks.detect_device()
    assert (kind, bf16) == ("cpu", False)
    monkeypatch.setattr(checks, "no_gpu_visible", lambda: False)       # asked of torch: the same answer
    assert checks.detect_device()[:2] == ("cpu", False)


def test_a_linux_machine_without_gpu_device_files_is_a_cpu_without_torch(monkeypatch):
    monkeypatch.setattr(checks.sys, "platform", "linux")
    monkeypatch.setattr(checks.glob, "glob", lambda pattern: [])
    assert checks.no_gpu_visible()
    monkeypatch.setattr(checks.glob, "glob", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else [])
    assert not checks.no_gpu_visible()
    monkeypatch.setattr(checks.sys, "platform", "darwin")
    monkeypatch.setattr(checks.glob, "glob", lambda pattern: [])
    assert not checks.no_gpu_visible()                          # a Mac: torch says whether MPS is there


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_on_this_cpu_without_use_cpu_is_refused(name, tmp_path, capsys, nothing_heavy, monkeypatch):
    """The README's promise: a recipe's bf16 (weights or autocast) on a machine without a GPU and without
    ``use_cpu: true`` stops before the model loads, naming use_cpu (the Mac recipes train bf16 weights without
    autocast; the CUDA ones set bf16: true)."""
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    for key in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert train.main(["--config", name, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "on a machine without a GPU, and use_cpu is not set" in err and "set use_cpu: true" in err


# ---------------------------------------------------------------- malformed values: one line, exit 2
MALFORMED = [
    ({"callbacks": 5}, "callbacks=5 is not allowed: expected a list of strings"),
    ({"callbacks": [1, 2]}, "callbacks=[1, 2] is not allowed"),
    ({"reward_funcs": 3}, "reward_funcs=3 is not allowed: expected a list of strings"),
    ({"callback_kwargs": [1]}, "callback_kwargs=[1] is not allowed: expected a mapping, a string or null"),
    ({"callback_kwargs": {"MemoryWatchdog": 5}}, "callback_kwargs['MemoryWatchdog']=5 is not allowed"),
    ({"dataset": 5}, "dataset=5 is not allowed: expected a string"),
    ({"dataset_size": -1}, "dataset_size=-1 is too small"),
    ({"max_steps": "abc"}, "recipe.yaml: max_steps='abc' is not allowed: expected an integer"),
    ({"max_steps": 2.5}, "max_steps=2.5 is not allowed: expected an integer"),
    ({"learning_rate": "fast"}, "learning_rate='fast' is not allowed: expected a number"),
    ({"tune": "maybe"}, "tune='maybe' is not allowed: expected true or false"),
    ({"eval_strategy": "sometimes"}, "eval_strategy='sometimes' is not allowed: expected one of no, steps, epoch"),
    ({"output_dir": 5}, "output_dir=5 is not allowed: expected a string or null"),
    ({"lora_target_modules": 5}, "lora_target_modules=5 is not allowed: expected a list of strings or null"),
    ({"max_completion_length": -5}, "max_completion_length=-5 is not allowed: expected an integer >= 1"),
]


@pytest.mark.parametrize("change, message", MALFORMED, ids=[next(iter(c)) + "=" + repr(next(iter(c.values())))
                                                              for c, _ in MALFORMED])
def test_a_malformed_value_is_one_line(change, message, tmp_path, capsys, nothing_heavy):
    assert train.main(["--config", write_recipe(tmp_path, **change), "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf_perf_callbacks.train: error: ") and message in err


def test_a_malformed_flag_is_one_line(tmp_path, capsys, nothing_heavy):
    """argparse's own errors (a flag's value it cannot convert) without the thousand-line usage."""
    assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--num_generations", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--num_generations" in err and "usage" not in err


@pytest.mark.parametrize("model, reason", [("/no/such/model", "no such folder"), ("./missing", "no such folder")])
def test_a_model_that_cannot_be_loaded_is_one_line(model, reason, tmp_path, capsys, nothing_heavy,
                                                   launcher_process):
    assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--model_name_or_path", model,
                       "--callbacks", "none", "--output_dir", str(tmp_path / "o")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"model_name_or_path={model!r} cannot be loaded ({reason}" in line and "hub model id" in line


def test_a_hub_model_offline_says_how_to_get_it_here(tmp_path, capsys, nothing_heavy, launcher_process):
    """A hub id that is not in the cache, on a machine with HF_HUB_OFFLINE (the tests' and this launcher's setting):
    the line names the offline mode and the two ways on, not "name a local model folder or a hub model id"."""
    model = "Qwen/Qwen2.5-0.5B-Instruct-not-cached"
    assert train.main(["--config", write_recipe(tmp_path), "--use_cpu", "true", "--model_name_or_path", model,
                       "--callbacks", "none", "--output_dir", str(tmp_path / "o")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"model_name_or_path={model!r} cannot be loaded (HF_HUB_OFFLINE is set, and it is not in the local " \
           f"Hugging Face cache)" in line
    assert f"`hf download {model} --local-dir DIR`" in line and build.PACKAGED_MODEL in line
    assert "name a local model folder or a hub model id" not in line


def test_a_hub_model_without_network_is_told_apart_from_a_missing_folder(monkeypatch):
    """Without the offline flag, transformers' "couldn't connect" (no network) gets the same advice; a missing
    folder and any other failure keep theirs. (The error is transformers' own text for that case.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    no_network = OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
                         "them in the cached files.\nCheck your internet connection")
    line = build.model_load_error("Qwen/Qwen2.5-0.5B-Instruct", no_network)
    assert "(the hub cannot be reached from this machine, and it is not in the local Hugging Face cache)" in line
    assert build.PACKAGED_MODEL in line
    assert "(no such folder)" in build.model_load_error("/no/such/model", no_network)
    other = build.model_load_error("nobody/x", OSError("nobody/x is not a local folder and is not a valid model"))
    assert "(nobody/x is not a local folder and is not a valid model): name a local model folder" in other


# ---------------------------------------------------------------- the quick trial, TRL's CLI
@pytest.mark.parametrize("name", NAMES)
def test_the_quick_trial_flags_apply_to_every_recipe(name, tmp_path):
    recipe, args, _ = train.parse_recipe(["--config", name, "--use_cpu", "true", "--bf16", "false",
                                          *train.QUICK_TRIAL.split()])
    tunes = arguments.read_recipe(recipes.resolve(name)).get("tune", True)        # the recipe's own tune key stays
    assert (args.max_steps, args.max_completion_length, recipe.tune) == (2, 32, tunes)


def test_train_help_lists_the_launcher_keys_and_the_quick_trial(capsys):
    from hf_perf_callbacks import cli

    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tune / --no_tune" in out and "--callback_kwargs" in out and train.QUICK_TRIAL in out
    assert len(out.splitlines()) < 40


def test_trl_grpo_cli_cannot_take_a_recipe():
    """What the recipes README says of ``trl grpo --config RECIPE`` (TRL's own CLI): its parser knows none of the
    launcher's keys and hands them on to ``accelerate launch`` as launch flags; its script has no callbacks option."""
    import dataclasses

    from trl.scripts import grpo

    *_, config_rest, cli_rest = grpo.make_parser(prog="trl grpo").parse_args_and_config(
        ["--config", recipe_path("mac-16gb-qwen1.5b")], return_remaining_strings=True,
        separate_remaining_strings=True)
    flags = {arg for arg in config_rest if arg.startswith("--")}
    assert flags == {"--dataset", "--dataset_size", "--callbacks", "--callback_kwargs"} and not cli_rest
    assert not any("callback" in f.name for f in dataclasses.fields(grpo.GRPOScriptArguments))


def test_a_trl_grpo_yaml_gets_one_line_with_what_runs(tmp_path, capsys, nothing_heavy):
    """A ``trl grpo`` YAML (its script keys) or command shape brought to the launcher: one line saying what to rename
    or remove, and that the rest of the same YAML runs with ``hf-perf train --config``; nothing loads."""
    assert {"dataset_name", "dataset_train_split", "reward_model_name_or_path"} <= arguments.trl_script_keys()
    assert not arguments.trl_script_keys() & set(train.field_names())          # reward_funcs, model keys: the same here
    path = write_recipe(tmp_path, dataset_name="trl-lib/DeepMath-103K", dataset_train_split="train",
                        reward_model_name_or_path=None, use_cpu=True)
    assert train.main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage" not in err
    assert (f"`trl grpo` script keys dataset_name, dataset_train_split, reward_model_name_or_path in {path}: rename "
            f"dataset_name → dataset, dataset_train_split → dataset_split; remove reward_model_name_or_path") in err
    assert f"runs as is: hf-perf train --config {path}" in err and "cannot attach callbacks" in err

    assert train.main(["--config", "mac-16gb-qwen1.5b", "--dataset_name=x"]) == 2
    assert "`trl grpo` script key dataset_name on the command line: rename dataset_name → dataset" in \
        capsys.readouterr().err
    assert train.main(["grpo", "--config", "mac-16gb-qwen1.5b"]) == 2
    err = capsys.readouterr().err
    assert "'grpo' is a `trl` command word" in err and "drop the word: hf-perf train --config R.yaml" in err
    assert train.main(["--config", "mac-16gb-qwen1.5b", "--accelerate_config", "multi_gpu"]) == 2
    assert "accelerate launch --config_file C.yaml -m hf_perf_callbacks.train" in capsys.readouterr().err


def test_the_compact_console_also_compacts_the_printer_of_disable_tqdm(tmp_path, capsys):
    """Under ``disable_tqdm`` transformers prints logs with ``PrinterCallback``: the launcher's compact console
    prints the short dict, and the dict the other callbacks get keeps every key."""
    import torch
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(str(tmp_path), disable_tqdm=True, report_to="none", use_cpu=True)
    trainer = Trainer(torch.nn.Linear(1, 1), args)
    launch.compact_console(trainer)
    printers = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, (PrinterCallback, ProgressCallback))]
    assert len(printers) == 1 and isinstance(printers[0], PrinterCallback)
    logs = {"loss": 0.5, keys.PERF_TOKENS_PER_SEC: 900.0, keys.PERF_PHASE_SHARE["generation"]: 0.5,
            keys.MEM_PRESSURE: 0, keys.TUNER_MICRO_BATCH: 2, keys.CACHE_CLEARS: 0}
    printers[0].on_log(args, TrainerState(), TrainerControl(), logs=logs)
    assert capsys.readouterr().out.strip() == "{'loss': '0.5', 'perf/tokens_per_sec': '900', 'tuner/micro_batch': '2'}"
    assert len(logs) == 6


def test_a_busy_output_dir_is_one_line_and_exit_2_before_the_model_loads(tiny_model, tmp_path, launcher_process,
                                                                           capsys, monkeypatch):
    """Another live process trains into the output_dir: the launcher refuses with one line and exit code 2, before
    it loads the tokenizer or the model, and writes nothing there."""
    from hf_perf_callbacks.train import launch

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hf_perf_callbacks.common.outputdir import "
                               "OutputDirLock; OutputDirLock().acquire(sys.argv[1]); print('locked', flush=True); "
                               "time.sleep(120)", str(out)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loaded = []
    monkeypatch.setattr(launch, "build_tokenizer", lambda *a, **k: loaded.append("tokenizer"))
    monkeypatch.setattr(launch, "build_model", lambda *a, **k: loaded.append("model"))
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(os.listdir(out))
        assert train.main(recipe_flags(SINGLE[0], tiny_model, out)) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid}" in err[0] and len(err[0]) - len(str(out)) <= keys.CONSOLE_WIDTH
    assert loaded == [] and sorted(os.listdir(out)) == before


# ---------------------------------------------------------------- the early checks: before torch, transformers, TRL
def test_the_stand_ins_have_the_real_classes_fields_types_and_defaults():
    """The early checks parse a recipe with stand-ins of GRPOConfig and ModelConfig read from the installed sources
    (schema.stand_in): the same fields in the same order, the same defaults where the source writes a literal, the
    same types (an Enum read from its source has the real one's values; a class not read is Unresolved)."""
    import dataclasses
    import enum
    import typing

    from hf_perf_callbacks.train import schema

    early, real = arguments.early_classes(), arguments.recipe_classes()
    assert [c.__name__ for c in early] == [c.__name__ for c in real] and early[1] is not real[1]

    def same_type(fake, true) -> bool:
        if fake == true:
            return True
        if fake is schema.Unresolved:
            return isinstance(true, type) and true not in (int, float, str, bool, list, dict)
        if isinstance(fake, type) and issubclass(fake, enum.Enum):
            return isinstance(true, type) and issubclass(true, enum.Enum) and \
                [m.value for m in fake] == [m.value for m in true]
        fake_args, true_args = typing.get_args(fake), typing.get_args(true)
        return (typing.get_origin(fake) == typing.get_origin(true) and len(fake_args) == len(true_args)
                and all(same_type(a, b) for a, b in zip(fake_args, true_args)))

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    for fake, true in zip(early[1:], real[1:]):
        hints = typing.get_type_hints(true)
        fields = [f for f in dataclasses.fields(true) if f.init]
        assert [f.name for f in dataclasses.fields(fake)] == [f.name for f in fields]
        read = {f.name: f for f in schema.class_fields("trl", true.__name__)}
        unknown = [f.name for f in fields if read[f.name].default is schema.UNKNOWN]
        assert len(unknown) <= 3, unknown                  # nearly every default is a literal in the source
        made_hints = typing.get_type_hints(fake)            # the annotations: a parser rewrites a field's .type
        for f, made in zip(fields, dataclasses.fields(fake)):
            assert same_type(made_hints[f.name], hints[f.name]), (f.name, made_hints[f.name], hints[f.name])
            if f.name not in unknown:
                value = default(f)
                assert default(made) == (value.value if isinstance(value, enum.Enum) else value), f.name


def test_the_early_checks_import_no_torch_transformers_or_trl_trainer(tmp_path):
    """Each mistake is answered by check_early in a process that then holds no torch, no transformers' trainer and
    no TRL trainer (the recipe's fields are read from the sources)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: abc\n")
    cases = [["--config", str(bad)], ["--config", FULL, "--lora_rank", "3"], ["--config", FULL, "--max_steps", "2"],
             ["--config", FULL, "--use_cpu", "true", "--callback_kwargs", '{"MemoryWatchdog": {"limit_gib": 3}}'],
             ["--config", FULL, "--use_cpu", "true", "--resume_from_checkpoint", "last", "--output_dir",
              str(tmp_path / "none")]]
    code = ("import json, sys\nfrom hf_perf_callbacks.train import launch, RecipeError\nlines = []\n"
            f"for argv in {cases!r}:\n"
            "    try:\n        launch.check_early(argv)\n    except RecipeError as error:\n"
            "        lines.append(str(error))\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
            "'transformers.training_args', 'transformers.trainer', 'trl.trainer')))\n"
            "print(json.dumps({'lines': lines, 'heavy': heavy}))\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["heavy"] == []
    lines = result["lines"]                             # each case's words: the tests of each check above
    assert len(lines) == len(cases)
    assert str(bad) in lines[0] and "'abc'" in lines[0] and "'--lora_r'" in lines[1] and "bf16" in lines[2]
    assert "'limit_gb'" in lines[3] and "resume_from_checkpoint=last" in lines[4]


@pytest.mark.parametrize("kwargs, message", [
    ({"ThroughputMeter": {"window_step": 5}}, "unknown argument 'window_step' (did you mean 'window_steps'?)"),
    ({"ThroughputMeter": {"window_steps": "many"}}, "window_steps='many' is not allowed: expected an integer"),
    ({"MemoryWatchdog": {"stop": "yes"}}, "stop='yes' is not allowed: expected true or false"),
    ({"AdaptiveBatchTuner": {"max_micro_batch": 2.5}}, "max_micro_batch=2.5 is not allowed: expected an integer or "
                                                       "null"),
])
def test_a_callback_argument_is_checked_against_the_callbacks_own_signature(kwargs, message):
    with pytest.raises(train.RecipeError, match=re.escape(message)):
        checks.check_callback_arguments(list(kwargs), kwargs)
    checks.check_callback_arguments(["ThroughputMeter"], {"ThroughputMeter": {"window_steps": 5}})   # a valid one


def test_the_bf16_refusal_on_a_cpu_says_a_hub_model_needs_packaged_offline():
    values = values_of({"model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "bf16": False, "dtype": "bfloat16"})
    with pytest.raises(train.RecipeError, match="Qwen/Qwen2.5-1.5B-Instruct comes from the Hugging Face hub: "
                                                "offline, add --model_name_or_path packaged"):
        checks.check_recipe(values, device="cpu", bf16_supported=False)
    with pytest.raises(train.RecipeError) as local:
        checks.check_recipe(values_of({"model_name_or_path": "packaged", "bf16": True}), device="cpu",
                            bf16_supported=False)
    assert "hub" not in str(local.value)


# ---------------------------------------------------------------- Ctrl-C and SIGTERM under the launcher
from transformers import TrainerCallback  # noqa: E402 - the interrupting callback below, named by its dotted path


class InterruptAt(TrainerCallback):
    """A recipe's callback (``callbacks: [..., tests.test_recipes.InterruptAt]``) that interrupts the run at the end
    of ``step``: Ctrl-C's KeyboardInterrupt, a real SIGTERM sent to this process, or (``error``) a RuntimeError."""

    def __init__(self, step=1, how="SIGINT"):
        self.step, self.how = step, how

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if self.how == "error":
                raise RuntimeError("planted failure")
            if self.how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
            raise KeyboardInterrupt


def interrupted_flags(tiny_model, out, how=None):
    """The full recipe's flags for 2 steps; with ``how``, :class:`InterruptAt` stops it at step 1."""
    flags = ["--config", recipe_path(FULL), "--model_name_or_path", tiny_model, "--output_dir", str(out), *CPU,
             "--report", "false"]
    if how is None:
        return flags
    return [*flags, "--callbacks", *train.RecipeArguments().callbacks, "tests.test_recipes.InterruptAt",
            "--callback_kwargs", json.dumps({"tests.test_recipes.InterruptAt": {"step": 1, "how": how}})]


@pytest.mark.parametrize("how, status, words", [("SIGINT", 130, "Ctrl-C (SIGINT)"), ("SIGTERM", 143, "SIGTERM")])
def test_an_interrupt_is_one_line_with_the_launchers_flag_and_the_resume_goes_on(how, status, words, tiny_model,
                                                                                 tmp_path, launcher_process,
                                                                                 capsys, caplog):
    """Ctrl-C or SIGTERM at step 1 under the launcher: the step saved, one line that says so in the launcher's
    terms (the flag and the checkpoint the run saved, not the Python call), no traceback; the same command with
    that flag then trains on to max_steps."""
    from hf_perf_callbacks.train import interrupts

    out = tmp_path / "out"
    assert train.main(interrupted_flags(tiny_model, out, how)) == status
    captured = capsys.readouterr()
    said = captured.out + captured.err + caplog.text
    (line,) = [text for text in captured.err.splitlines() if "stopped by" in text]
    saved = re.fullmatch(f"hf_perf_callbacks.train: stopped by {re.escape(words)} at step 1; saved (.+), the last "
                         f"completed step; go on with the same command and --resume_from_checkpoint (.+)", line)
    assert saved and saved.group(1) == saved.group(2) and os.path.isdir(saved.group(1))
    assert os.path.basename(saved.group(1)) == "checkpoint-1"
    assert "train_with_tuning(" not in said and "Traceback" not in said and said.count("checkpoint-1") == 2
    assert signal.getsignal(signal.SIGTERM) is not interrupts._raise_terminated        # the handler before is back
    capsys.readouterr()
    assert train.main([*interrupted_flags(tiny_model, out), "--resume_from_checkpoint", saved.group(1)]) == 0
    assert json.load(open(out / "trainer_state.json"))["global_step"] == 2


def test_an_error_that_ends_a_launch_says_how_to_go_on_once_in_the_launchers_terms(tiny_model, tmp_path,
                                                                                  launcher_process, caplog):
    """Any other error ends the launch with its traceback: the step saved, and the one note on the error (no log line
    besides) names the checkpoint with the launcher's flag, not the Python call."""
    with pytest.raises(RuntimeError, match="planted failure") as raised:
        train.main(interrupted_flags(tiny_model, tmp_path / "out", "error"))
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    [note] = raised.value.__notes__
    assert f"saved {checkpoint} " in note and f"--resume_from_checkpoint {checkpoint}" in note
    assert "train_with_tuning(" not in note and all(len(line) <= keys.CONSOLE_WIDTH for line in note.splitlines())
    assert str(raised.value) not in note and checkpoint not in caplog.text          # said once, by the error


def test_an_interrupt_shows_its_traceback_when_asked(tiny_model, tmp_path, launcher_process, monkeypatch):
    monkeypatch.setenv("HF_PERF_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        train.main(interrupted_flags(tiny_model, tmp_path / "out", "SIGINT"))


def test_the_python_apis_resume_advice_reads_as_the_flag():
    from hf_perf_callbacks.train import interrupts

    assert interrupts.as_flag("a; train_with_tuning(trainer, resume_from_checkpoint='o/checkpoint-5'); b") == \
        "a; --resume_from_checkpoint o/checkpoint-5; b"
    assert interrupts.as_flag("hf_perf_callbacks.train_with_tuning(trainer, resume_from_checkpoint='c');"
                              "trainer.train(resume_from_checkpoint=...)") == \
        f"{interrupts.RESUME_FLAG} c;{interrupts.RESUME_FLAG} last"


def test_where_python_has_no_notes_the_end_is_one_log_line_the_launcher_words_or_leaves_out(caplog):
    """Python 3.10 has no exception notes: the end of a run is then its one log line, which under the launcher reads
    as the flag, and after an interrupt is left out (the launcher's own line says it). The errors below stand in
    for 3.10's: ``add_note`` is hidden from them."""
    import logging

    from hf_perf_callbacks.resize.executor import RUN_END, _tell
    from hf_perf_callbacks.train import interrupts

    def without_notes(base):
        return type(base.__name__, (base,), {"add_note": property(lambda self: (_ for _ in ()).throw(
            AttributeError("add_note")))})

    advice = "saved o/checkpoint-2; resume with train_with_tuning(trainer, resume_from_checkpoint='o/checkpoint-2')"
    words = interrupts.LauncherWords()
    with caplog.at_level(logging.ERROR, logger="hf_perf_callbacks"):
        for error in (without_notes(RuntimeError)("planted"), without_notes(interrupts.Terminated)("SIGTERM")):
            assert not hasattr(error, "add_note")
            _tell(error, advice, "o/checkpoint-2")
    failed, stopped = caplog.records
    assert getattr(failed, RUN_END) == getattr(stopped, RUN_END) == "o/checkpoint-2"
    assert words.filter(failed) and failed.getMessage().endswith(f"{interrupts.RESUME_FLAG} o/checkpoint-2")
    assert not words.filter(stopped)


# ---------------------------------------------------------------- torch's threads, and signs of life of a slow step
def test_the_launcher_chooses_torchs_threads_as_the_demo_and_says_what_step_1_does(tiny_model, tmp_path,
                                                                                  launcher_process, monkeypatch,
                                                                                  caplog, capsys):
    """Other work keeping 1.5 of the 2 cores busy: the launcher trains on 1 torch thread, as the demo would
    (demo.set_threads), and says so in one line; before step 1 a line says what the first step does."""
    import logging

    import torch

    from hf_perf_callbacks import demo

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "other_busy_cores", lambda seconds=1.0: 1.5)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torch.set_num_threads(2)
    caplog.set_level(logging.INFO, "hf_perf_callbacks")
    from hf_perf_callbacks.core.runlog import HF_PERF_TRAIN
    from hf_perf_callbacks.core.wording import argument_hint
    from hf_perf_callbacks.train.progress import first_step_line

    flags = [f if f != "2" else "1" for f in interrupted_flags(tiny_model, tmp_path / "out")]     # --max_steps 1
    assert train.main(flags) == 0
    assert torch.get_num_threads() == 1
    said = [r.getMessage() for r in caplog.records]
    demo_says = demo.set_threads()                # the demo's own line at that load (planted above)
    assert [line for line in said if line.startswith(demo_says.split(":")[0])] == [demo_says]
    args = train.parse_recipe(flags)[1]
    assert capsys.readouterr().out.count(first_step_line(args)) == 1
    assert args.dataloader_pin_memory is False                       # a CPU: nothing to pin for (torch would warn)
    hint = argument_hint("ThroughputMeter", "peak_flops", "calibrate", HF_PERF_TRAIN)   # a CPU: no peak known
    assert len([line for line in said if hint in line]) == 1


def test_a_slow_step_says_how_it_goes_and_a_fast_one_stays_quiet():
    """StepPulse on a planted clock: step 1 (a 60 s generation, then 10 s per micro-batch) says its generation,
    its pace after the first micro-batch and a micro-batch every 20 s; step 2 (after a slow one) says its
    generation; step 3, after a fast step 2, nothing."""
    from types import SimpleNamespace

    from hf_perf_callbacks.train.progress import StepPulse

    now, said = [0.0], []
    pulse = StepPulse(said.append, clock=lambda: now[0], every=20.0)
    args = SimpleNamespace(gradient_accumulation_steps=4, per_device_train_batch_size=2, steps_per_generation=None,
                           max_completion_length=32, num_generations=8, world_size=1)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)

    def step(generation, micro_batch):
        pulse.on_step_begin(args, state, None)
        pulse.entry_started("rollout")
        now[0] += generation
        pulse.entry_finished("rollout", ([[0]] * 8, [[1] * 8] * 8))
        for i in range(4):
            now[0] += micro_batch
            if i < 3:
                pulse.on_substep_end(args, state, None)
        state.global_step += 1
        pulse.on_step_end(args, state, None)

    pulse.on_train_begin(args, state, None)
    step(60.0, 10.0)
    assert said == ["step 1 generates 8 completions (≤ 32 tokens), then trains 4 micro-batches of 2: the slowest "
                    "step (warm-up); a step over 20 s says how it goes",
                    "step 1: generating …", "step 1: generated 8 completions, 64 tokens in 1 min 00 s",
                    "step 1: micro-batch 1 of 4 done at 1 min 10 s; at this pace the step takes about 1 min 40 s",
                    "step 1: micro-batch 3 of 4 done at 1 min 30 s"]
    said.clear()
    step(1.0, 0.25)
    assert said == ["step 2: generating …", "step 2: generated 8 completions, 64 tokens in 1 s"]
    said.clear()
    step(1.0, 0.25)
    assert said == []
