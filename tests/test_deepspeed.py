"""The callbacks and train_with_tuning under DeepSpeed ZeRO-2 and ZeRO-3.

The launched runs use real DeepSpeed (``deepspeed.initialize`` through transformers' integration and accelerate's
``DeepSpeedPlugin``) on CPU processes over gloo (``DS_ACCELERATOR=cpu``; ``tests/scripts/two_rank_deepspeed.py``);
they are skipped where deepspeed is not importable (the ``deepspeed`` extra; CI runs the subset of
``tests/test_deepspeed_ci.py`` with it). The parts that need no
engine — the split written to every holder of the DeepSpeed config, DeepSpeed's checkpoint layout, ZeRO-3's
partitioned parameters in the FLOPs — run everywhere, on stand-ins built from the documented API (``DeepSpeedEngine``'s
``train_micro_batch_size_per_gpu()``, ``gradient_accumulation_steps()``, ``train_batch_size()``; accelerate's
``DeepSpeedPlugin.deepspeed_config`` and ``hf_ds_config``).
"""
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hf_perf_callbacks import AdaptiveBatchTuner
from hf_perf_callbacks.core.flops import full_numel, shape_of
from hf_perf_callbacks.resize import sharding
from hf_perf_callbacks.resize.checkpoints import fingerprint, has_training_state, is_complete
from tests.conftest import make_trainer

from .deepspeed_sizes import deepspeed_sizes

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_rank_deepspeed.py")
SPLIT_KEYS = sharding.DEEPSPEED_SPLIT_KEYS


# ---------------------------------------------------------------- no engine needed
class Engine:
    """A stand-in for ``DeepSpeedEngine``: its public getters of the split."""

    def __init__(self, config):
        self.config = config

    def train_micro_batch_size_per_gpu(self):
        return self.config["train_micro_batch_size_per_gpu"]

    def gradient_accumulation_steps(self):
        return self.config["gradient_accumulation_steps"]

    def train_batch_size(self):
        return self.config["train_batch_size"]


def deepspeed_trainer(micro, accum):
    """A trainer as transformers leaves it under DeepSpeed: the plugin's config shared with
    ``HfTrainerDeepSpeedConfig`` (``args.hf_deepspeed_config``), the accelerator's copy made at ``prepare``."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
              "zero_optimization": {"stage": 3}}
    prepared = dict(config)
    plugin = SimpleNamespace(deepspeed_config=config, hf_ds_config=SimpleNamespace(config=config))
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), deepspeed_config=prepared,
                                  gradient_accumulation_steps=1)
    args = SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                           hf_deepspeed_config=plugin.hf_ds_config)
    return SimpleNamespace(args=args, accelerator=accelerator, model_wrapped=Engine(prepared))


def test_a_split_is_written_to_every_holder_of_the_deepspeed_config():
    trainer = deepspeed_trainer(2, 2)
    assert sharding.deepspeed_split(trainer)
    plugin = trainer.accelerator.state.deepspeed_plugin
    for config in (plugin.deepspeed_config, plugin.hf_ds_config.config, trainer.accelerator.deepspeed_config):
        assert [config[k] for k in SPLIT_KEYS] == [2, 2, 4]                   # one process: 2 × 2 × 1
    assert plugin.deepspeed_config["zero_optimization"] == {"stage": 3}     # nothing else touched
    assert trainer.accelerator.gradient_accumulation_steps == 2
    sizes = deepspeed_sizes(trainer)
    assert set(sizes) == {"args", "plugin", "hf_deepspeed_config", "engine"}
    assert all(v == [2, 2, 4] for v in sizes.values()), sizes


def test_without_deepspeed_nothing_is_written(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    assert not sharding.deepspeed_split(trainer) and not sharding.release_engine(trainer)
    assert deepspeed_sizes(trainer) == {}


def test_deepspeed_is_taken_at_start_and_says_what_a_resize_does(tokenizer, tmp_path, monkeypatch):
    """No engine here: the accelerator state says ``DEEPSPEED`` (accelerate's own enum)."""
    from accelerate.utils import DistributedType

    from hf_perf_callbacks.resize.executor import Executor

    trainer = make_trainer(tokenizer, tmp_path, [AdaptiveBatchTuner(tune=False)], max_steps=2)
    monkeypatch.setattr(trainer.accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    executor = Executor(trainer.args)
    assert sharding.start(trainer, executor.warn_once) == ("deepspeed", False)        # taken; no step guard
    assert "sharding-limits" in executor.record.said
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not sharding.unagreed_oom("deepspeed", oom)                      # one process: recovered in process
    monkeypatch.setattr(sharding, "world_size", lambda: 2)
    assert sharding.unagreed_oom("deepspeed", oom)                          # several: the launcher's restart
    assert not sharding.unagreed_oom("deepspeed", ValueError("not memory"))


def test_deepspeeds_checkpoint_counts_as_complete_and_holding_the_training_state(tmp_path):
    """The layout DeepSpeed's ``save_checkpoint`` writes inside transformers' ``checkpoint-N`` (ZeRO-3: no weights
    file but the ranks' partitions); the other rank's partitions, written when they are, leave the fingerprint."""
    path = tmp_path / "checkpoint-4"
    inner = path / "global_step4"
    inner.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    (path / "latest").write_text("global_step4")
    assert not is_complete(str(path), 4)                                    # no weights anywhere
    (inner / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"w0")
    assert is_complete(str(path), 4) and not has_training_state(str(path))
    (inner / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o0")
    assert not has_training_state(str(path))                                # the scheduler too
    (path / "scheduler.pt").write_bytes(b"s")
    assert has_training_state(str(path))
    before = fingerprint(str(path))
    (inner / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"w1")
    (inner / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"o1")
    assert fingerprint(str(path)) == before
    (inner / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o0 rewritten")
    assert fingerprint(str(path)) != before


def test_zero3_partitioned_parameters_count_whole_in_the_flops(tokenizer):
    """ZeRO-3 leaves each rank's parameter empty and records the full count as ``ds_numel``."""
    from hf_perf_callbacks.tiny import build_model

    model = build_model(tokenizer)
    whole = shape_of(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            full = module.weight.numel()
            module.weight.data = torch.empty(0)
            module.weight.ds_numel = full
    assert full_numel(torch.zeros(3)) == 3
    assert shape_of(model) == whole and whole.matmul_params > 0


# ---------------------------------------------------------------- real DeepSpeed, launched
def launch(out, stage, *extra, processes=2, timeout=500):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (the deepspeed extra)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(port), SCRIPT, str(out), str(stage), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def launched(tmp_path_factory, stage: int, mode: str):
    """The script's ``mode`` under ZeRO-``stage``, launched once: the stage, its folder, each rank's result, stderr."""
    out = tmp_path_factory.mktemp(f"zero{stage}_{mode}")
    proc = launch(out, stage, mode)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return stage, out, [json.load(open(out / f"rank{r}.json")) for r in (0, 1)], proc.stderr


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero_run(request, tmp_path_factory):
    """The re-size in process (the meter's figures and a stop on one rank: ``tests/test_deepspeed_ci.py``)."""
    return launched(tmp_path_factory, request.param, "tuned")


@pytest.mark.launch
def test_train_with_tuning_resizes_every_rank_in_process_with_a_new_engine_that_agrees(zero_run):
    _, _, (r0, r1), _ = zero_run
    for r in (r0, r1):
        assert r["tuned_sharding"] == "deepspeed" and r["tuned_step"] == 5
        assert r["tuned_decisions"] == [["watchdog", 2, 2]]                 # no tuning decision: skipped
        assert r["tuned_split"] == [2, 4]                                   # 4 × 2 × 2 ranks = 2 × 4 × 2 ranks
        assert r["engines"] == 2                                            # a new engine for the new split
        assert all(v == [2, 4, 16] for v in r["tuned_sizes"].values()), r["tuned_sizes"]
        assert set(r["tuned_sizes"]) == {"args", "plugin", "hf_deepspeed_config", "engine"}
        assert "global_step2" in r["tuned_checkpoint"]
    assert r0["tuned_steps_logged"] == [1, 2, 3, 4, 5]
    assert r0["tuned_micro_batches"] == [4, 4, 2, 2, 2]
    assert r0["tuned_notes_logged"][0].startswith("train_with_tuning under DeepSpeed")
    for r in (r0, r1):                                                      # trains what the unfaulted run trains
        assert r["exact"]["differences"] == [] and r["exact"]["step"] == 6 and r["exact"]["split"] == [2, 2]
    assert r1["exact"]["actions"] == ["clear_cache", "smaller_batch"]


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_an_oom_in_one_process_is_recovered_in_process_and_exactly(tmp_path, stage):
    proc = launch(tmp_path, stage, "one", processes=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.load(open(tmp_path / "rank0.json"))
    assert got["raised"] == 1 and got["decisions"] == [["oom", 3, 2]] and got["step"] == 6     # step 3 failed
    assert got["differences"] == []
    assert all(v == [2, 2, 4] for v in got["sizes"].values()), got["sizes"]


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_grpo_under_zero_resizes_in_process_with_its_groups_kept_and_exactly(tmp_path, stage):
    """GRPO (LoRA, 4 completions a prompt) under ZeRO on 2 ranks: the watchdog's request on rank 1 at step 2 re-sizes
    both ranks in the same process, 4×2 (steps_per_generation 2) → 2×4 (4): the generation batch, the groups and
    the effective batch kept, every copy of the DeepSpeed config and the new engine agreeing; the run trains what
    the run that never re-sized trains (samples of every step over both ranks, learning rates, weights); the meter's
    tokens/s equal on both ranks."""
    proc = launch(tmp_path, stage, "grpo")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for r in (r0, r1):
        assert r["differences"] == []
        plain, resized = r["unfaulted"], r["resized"]
        assert plain["zero_stage"] == resized["zero_stage"] == stage
        assert plain["step"] == resized["step"] == 4 and resized["decisions"] == [["watchdog", 2, 2]]
        assert plain["split"] == [4, 2, 2, 4] and resized["split"] == [2, 4, 4, 4]     # 4 × 2 = 2 × 4 per rank
        assert all(v == [2, 4, 16] for v in resized["sizes"].values()), resized["sizes"]
    assert [f["perf/tokens_per_sec"] for f in r0["resized"]["figures"]] == \
        [f["perf/tokens_per_sec"] for f in r1["resized"]["figures"]]


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_an_oom_under_several_ranks_ends_the_process_and_the_relaunch_resumes_exactly(tmp_path, stage):
    """No step guard under DeepSpeed: an OOM on rank 0 at step 5 ends the first launch (no hang) with the next
    smaller split recorded; the relaunch (what the launcher's restart starts) resumes from checkpoint-4 at 2×2 and
    trains steps 5-8 as the unfaulted run does (samples over both ranks, learning rates, weights)."""
    first = launch(tmp_path, stage, "restart")
    assert first.returncode != 0
    assert "out of memory under DeepSpeed at step 5 that the other ranks cannot learn of" in first.stderr
    record = json.load(open(tmp_path / "run" / "tuner_split.json"))
    assert record["split"] == {"micro_batch": 2, "grad_accum": 2}
    second = launch(tmp_path, stage, "restart", "relaunch")
    assert second.returncode == 0, second.stderr[-4000:]
    for r in (0, 1):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["step"] == 8 and got["split"] == [2, 2]
        assert got["decisions"] == [["oom", 5, 2, str(tmp_path / "run" / "checkpoint-4")]]    # step 5 failed
        assert got["differences"] == []
        assert all(v == [2, 2, 8] for v in got["sizes"].values()), got["sizes"]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_shipped_accelerate_configs_are_trls_zero_configs(stage):
    import yaml

    from hf_perf_callbacks.train import recipes

    config = yaml.safe_load(open(recipes.path(f"accelerate/deepspeed_zero{stage}")))
    assert (config["distributed_type"], config["num_processes"], config["mixed_precision"]) == ("DEEPSPEED", 2, "bf16")
    ds = config["deepspeed_config"]
    assert ds["zero_stage"] == stage and ds["zero3_init_flag"] is (stage == 3)
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_the_shipped_configs_run_under_accelerate_launch(tmp_path, stage):
    """``accelerate launch --config_file <deepspeed_zero{2,3}.yaml>`` (its own DeepSpeed plugin from the launcher's
    environment, nothing in ``TrainingArguments``), on 2 CPU processes: the same figures, stop and exact re-size."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (not a test dependency)")
    from hf_perf_callbacks.train import recipes

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FROM_LAUNCHER": "1"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    proc = subprocess.run([accelerate, "launch", "--config_file", recipes.path(f"accelerate/deepspeed_zero{stage}"),
                           "--mixed_precision", "no", "--main_process_port", str(port), SCRIPT, str(tmp_path),
                           str(stage), "main"], env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for r in (r0, r1):
        assert r["zero_stage"] == stage and r["tokens"] == r["independent_tokens"] > 0
        assert r["stop_step"] == 2 and r["tuned_step"] == 5 and r["engines"] == 2
        assert set(r["tuned_sizes"]) == {"args", "plugin", "engine"}          # no HfTrainerDeepSpeedConfig here
        assert all(v == [2, 4, 16] for v in r["tuned_sizes"].values()), r["tuned_sizes"]
        assert r["exact"]["differences"] == []
    assert r0["rates"] == r1["rates"]
