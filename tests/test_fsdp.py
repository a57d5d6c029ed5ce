"""The callbacks and the tuner under FSDP2, and the device taken from the process, never from the model.

The two-process runs use real FSDP2 over gloo (``fully_shard`` per decoder layer through accelerate's
``fsdp2_prepare_model``, transformers' sharded FSDP checkpoints); accelerate only turns FSDP on for GPU processes, so
``tests/scripts/two_rank_fsdp.py`` makes that one switch for CPU processes (see its docstring). DeepSpeed:
``tests/test_deepspeed.py``.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.estimate import (
    FULL_BYTES_PER_PARAM,
    QWEN25,
    estimate_grpo_memory,
    layer_param_count,
    lora_param_count,
)
from hf_perf_callbacks.platform import device as dev
from hf_perf_callbacks.platform.device import DeviceLayer, exchange_device, training_device
from hf_perf_callbacks.resize import sharding
from tests.conftest import make_trainer

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_rank_fsdp.py")


def _gib(value: float) -> str:
    """Bytes as GiB with two decimals, as the recipes' README FSDP table shows them."""
    return f"{value / 1024**3:.2f}"


def torchrun(out, *extra, timeout=400, launcher=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as probe:                      # a free port: a fixed one may still be in TIME_WAIT
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = ["--rdzv-endpoint", f"localhost:{port}"] if "--rdzv-backend" in launcher else ["--master_port", str(port)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *where, *launcher,
           SCRIPT, str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- two ranks, FSDP2 over gloo
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    proc = torchrun(out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, [json.load(open(out / f"rank{r}.json")) for r in (0, 1)], proc.stderr


@pytest.mark.launch
def test_the_callbacks_report_on_both_ranks_under_fsdp2(fsdp_run):
    _, ranks, stderr = fsdp_run
    for r in ranks:
        assert r["fsdp"] and r["sharded"]                      # really sharded: every parameter is a DTensor
        assert r["disabled"] == [] and r["keys"] == ["mem", "perf", "tuner"]
        assert r["world"] == 2 and r["device"].startswith("cpu")
    assert "disabled after an internal error" not in stderr


@pytest.mark.launch
def test_global_tokens_per_second_is_equal_on_both_ranks_and_matches_an_independent_count(fsdp_run):
    _, (r0, r1), _ = fsdp_run
    assert r0["rates"] == r1["rates"] and all(rate > 0 for rate in r0["rates"])
    assert r0["tokens"] == r1["tokens"] == r0["independent_tokens"] > 0     # both ranks' tokens, counted once


@pytest.mark.launch
def test_flops_are_those_of_the_unsharded_model(fsdp_run):
    _, ranks, _ = fsdp_run
    for r in ranks:
        assert r["local_numel"] * 2 == r["global_numel"]                   # each rank holds half of every weight
        assert r["meter_matmul"] == r["reference_matmul"] == r["meter_trainable"]   # full fine-tune, whole model


@pytest.mark.launch
def test_the_perf_log_is_written_once_by_rank_zero(fsdp_run):
    out, _, _ = fsdp_run
    lines = [json.loads(line) for line in open(out / "plain" / "perf_log.jsonl")]
    assert [line["step"] for line in lines if line["type"] == "step"] == [1, 2, 3, 4]
    assert sum(line["type"] == "run" and "perf" in line["sources"] for line in lines) == 1


@pytest.mark.launch
def test_a_watchdog_stop_on_one_rank_stops_both_with_one_sharded_checkpoint_that_resumes(fsdp_run):
    out, (r0, r1), _ = fsdp_run
    assert r1["stop_actions"] == ["clear_cache", "stop"] and r0["stop_actions"] == ["stop"]
    assert r0["stop_step"] == r1["stop_step"] == 2
    assert sorted(d for d in os.listdir(out / "stop") if d.startswith("checkpoint-")) == ["checkpoint-2"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(r0["checkpoint_files"])     # FSDP's sharded format
    assert r0["resumed_step"] == r1["resumed_step"] == 4 and "perf" in r0["resumed_keys"]


@pytest.mark.launch
def test_train_with_tuning_resizes_every_rank_through_an_fsdp_checkpoint_in_the_same_process(fsdp_run):
    _, (r0, r1), _ = fsdp_run
    assert r0["tuned_sharding"] == "fsdp"
    assert r1["tuned_actions"] == ["clear_cache", "smaller_batch"] and r0["tuned_actions"] == ["smaller_batch"]
    assert r0["tuned_decisions"] == r1["tuned_decisions"] == [["watchdog", 2, 2]]   # no tuning decision: skipped
    assert r0["tuned_split"] == r1["tuned_split"] == [2, 4]                 # 4 × 2 × 2 ranks = 2 × 4 × 2 ranks
    assert r0["tuned_step"] == r1["tuned_step"] == 5                        # on to max_steps in this process
    assert "pytorch_model_fsdp_0" in r0["tuned_checkpoint"]                  # the re-size went through FSDP's save
    assert r0["tuned_steps_logged"] == [1, 2, 3, 4, 5]
    assert r0["tuned_micro_batches"] == [4, 4, 2, 2, 2]
    assert r0["tuned_notes_logged"][0] == "train_with_tuning under FSDP: an out-of-"   # said, in the perf log


@pytest.mark.launch
@pytest.mark.parametrize("reset", ["reset_iter_state", "without_it"])
def test_an_oom_inside_one_ranks_step_under_fsdp2_is_recovered_in_process_and_exactly(tmp_path, reset, monkeypatch):
    """An OOM planted in rank 1's forward (step 2) and in rank 0's backward (step 3, after some layers' gradients
    were reduce-scattered) re-sizes both ranks 4×1 → 2×2 in the same process, and each run trains what the unfaulted
    run trains: the samples of every step (over both ranks), the RNG stream, the learning rates, the weights and the
    SGD momentum (no gradient clipping); both ranks' records carry the run's one id. A hang would run into the
    subprocess timeout (``TimeoutExpired``). ``without_it``: as on torch < 2.13, which has no
    ``FSDPModule.reset_iter_state``: the adapter's own reset."""
    if reset == "without_it":
        monkeypatch.setenv("WITHOUT_RESET_ITER_STATE", "1")
    proc = torchrun(tmp_path, "recover")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for case, struck in (("forward", 1), ("backward", 2)):
        for r in ranks:
            got = r[case]
            assert got["differences"] == [], (case, got["differences"])
            assert got["step"] == 8 and got["split"] == [2, 2]                # 4 × 1 × 2 ranks = 2 × 2 × 2 ranks
            assert got["decisions"] == [["oom", struck + 1, 2]]                # the step that ran out of memory
        assert [r[case]["raised"] for r in ranks] == ([0, 1] if case == "forward" else [1, 0])
        assert ranks[0][case]["session"] == ranks[1][case]["session"]     # one run's id: a restart merges by it


@pytest.mark.launch
def test_an_oom_after_the_guard_came_off_ends_the_process_with_the_split_recorded_for_the_relaunch(tmp_path):
    """Once the split ran ``STABLE_STEPS`` steps the step guard is off (its exchanges cost a host round trip per
    collective): an OOM on rank 0 then ends its process — the launch fails, no hang — with the next smaller split and
    the checkpoint to resume from recorded; the relaunch (what a launcher's restart starts) resumes from the newest
    checkpoint of this run (``save_steps=2``: checkpoint-4) at 2×2 and reaches max_steps, every step logged once."""
    first = torchrun(tmp_path, "restart")
    assert first.returncode != 0
    assert "out of memory under FSDP at step 5 that the other ranks cannot learn of" in first.stderr
    record = json.load(open(tmp_path / "run" / "tuner_split.json"))
    assert record["split"] == {"micro_batch": 2, "grad_accum": 2}
    assert [(d["kind"], d["step"], d["checkpoint"]) for d in record["decisions"]] == [
        ("oom", 5, str(tmp_path / "run" / "checkpoint-4"))]
    second = torchrun(tmp_path, "restart", "relaunch")
    assert second.returncode == 0, second.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["step"] == r1["step"] == r0["oom_at"] + 2
    assert r0["split"] == r1["split"] == [2, 2]
    assert r0["steps_logged"] == list(range(1, r0["oom_at"] + 3))
    assert r0["guard_off"] == [sharding.STABLE_STEPS]                        # said in the perf log, at its step


@pytest.mark.parametrize("rank", [0, 1])
def test_a_launchers_restart_resumes_from_the_runs_newest_checkpoint_with_the_recorded_split(tokenizer, tmp_path,
                                                                                            monkeypatch, rank):
    """A restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, as torchrun and ``accelerate launch --max_restarts``
    set it) runs the same script, ``train_with_tuning(trainer)``: it resumes from the newest checkpoint the run's record
    lists, at the split the rank that ran out of memory recorded for the restart — the main process in the split file,
    rank 1 in its own file, which the restart merges — checked at its first step; a first start (count 0) starts from
    the beginning."""
    from hf_perf_callbacks.core.splitfile import read_split_file
    from hf_perf_callbacks.resize.executor import Executor
    from hf_perf_callbacks.resize.record import rank_files

    def trainer(folder, steps, save=True):
        extra = {"save_strategy": "steps", "save_steps": 2} if save else {}
        return make_trainer(tokenizer, folder, [AdaptiveBatchTuner(tune=False)], max_steps=steps, bs=4, ga=1,
                            extra=extra)

    train_with_tuning(trainer(tmp_path, 4))
    failing = Executor(trainer(tmp_path, 4).args)        # what the OOM's rank records before its process ends
    recorded = read_split_file(str(tmp_path))
    failing.record.adopt(recorded)
    failing.checkpoints.written = list(recorded.written)
    failing.record.main, failing.record.rank = rank == 0, rank
    failing.record_for_restart(4, torch.OutOfMemoryError("CUDA out of memory"), "fsdp")
    assert len(rank_files(str(tmp_path))) == rank                       # rank 1: its own file, not the main one
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = trainer(tmp_path, 6)
    train_with_tuning(restarted)
    assert restarted.state.global_step == 6 and rank_files(str(tmp_path)) == []     # merged, then cleared
    assert (restarted.args.per_device_train_batch_size, restarted.args.gradient_accumulation_steps) == (2, 2)
    [check] = read_split_file(str(tmp_path)).checks
    assert (check.kind, check.verdict, check.against) == ("restart", "exact", "finer")
    lines = [json.loads(x) for x in open(tmp_path / "perf_log.jsonl")]
    assert [x["step"] for x in lines if x["type"] == "step"] == [1, 2, 3, 4, 5, 6]      # resumed at 4, none twice
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    fresh = trainer(tmp_path / "fresh", 2, save=False)
    train_with_tuning(fresh)
    assert fresh.state.global_step == 2 and fresh.args.per_device_train_batch_size == 4


# ---------------------------------------------------------------- the device comes from the process
def test_the_training_device_is_the_accelerators_not_the_models(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    trainer.model.to("meta")            # where FSDP's rank-efficient loading leaves a model before prepare
    from accelerate.state import PartialState

    assert training_device() == torch.device(PartialState().device) == torch.device(trainer.args.device)
    assert DeviceLayer().device == training_device()


def test_under_a_launcher_before_accelerate_the_local_rank_picks_the_gpu(monkeypatch):
    """No GPU here: ``torch.cuda.is_available`` and ``device_count`` are replaced by fakes (documented API)."""
    import accelerate.state

    monkeypatch.setattr(accelerate.state, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("backend, given, expected", [
    ("nccl", "cpu", "cuda:1"),                   # a CPU tensor cannot go over NCCL: the process's GPU instead
    ("nccl", None, "cuda:1"),
    ("nccl", "cuda:1", "cuda:1"),
    ("gloo", "cuda:1", "cpu"),                   # gloo here carries CPU tensors
    ("cuda:nccl,cpu:gloo", "cpu", "cpu"),        # accelerate's FSDP backend with offload: the gloo part takes it
])
def test_exchanges_never_put_a_cpu_tensor_on_nccl(monkeypatch, backend, given, expected):
    """``get_backend`` is replaced (no NCCL here); the training device stands for a GPU rank."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dev, "training_device", lambda: torch.device("cuda", 1))
    assert exchange_device(given) == torch.device(expected)


# ---------------------------------------------------------------- the memory model learns sharding
SEVEN_B = QWEN25["Qwen/Qwen2.5-7B-Instruct"]
GRPO = dict(micro_batch=2, num_generations=8, generation_batch=8, prompt_tokens=200, max_completion_length=128,
            dtype_bytes=2, activation_checkpointing=True)


def test_shards_divide_weights_gradients_and_optimizer_state_only():
    lora = lora_param_count(SEVEN_B, 16)
    one = estimate_grpo_memory(SEVEN_B, lora_params=lora, **GRPO)
    two = estimate_grpo_memory(SEVEN_B, lora_params=lora, shards=2, **GRPO)
    assert two["weights"] == one["weights"] / 2 and two["lora"] == one["lora"] / 2
    for part in ("kv_cache", "activations", "logits"):                   # per rank, not sharded
        assert two[part] == one[part]
    assert "gathered" not in one
    assert two["gathered"] == 2 * SEVEN_B.vocab * SEVEN_B.hidden * 2    # embedding > one layer here
    assert SEVEN_B.vocab * SEVEN_B.hidden > layer_param_count(SEVEN_B) == 233_053_184
    assert two["total"] == pytest.approx(sum(two[k] for k in ("weights", "lora", "gathered", "kv_cache",
                                                               "activations", "logits")))
    assert two["peak"] == pytest.approx(two["weights"] + two["lora"] + two["gathered"]
                                        + max(two["generation"], two["training"]))


def test_a_full_fine_tune_counts_sixteen_bytes_per_parameter_over_the_shards():
    full = estimate_grpo_memory(SEVEN_B, lora_params=0, full_finetune=True, shards=4, **GRPO)
    assert full["weights"] == SEVEN_B.params * FULL_BYTES_PER_PARAM / 4 and full["lora"] == 0


@pytest.mark.parametrize("overrides, match", [
    (dict(shards=0), "shards=0"),
    (dict(shards=1.5), "shards=1.5"),
    (dict(full_finetune="yes"), "full_finetune"),
    (dict(full_finetune=True, lora_params=10), "lora_params=10 is not allowed with full_finetune"),
])
def test_invalid_sharding_inputs_name_the_parameter(overrides, match):
    with pytest.raises(ValueError, match=match):
        estimate_grpo_memory(SEVEN_B, **{"lora_params": 0, **GRPO, **overrides})


def test_recipes_readme_fsdp_table_matches_the_function():
    from hf_perf_callbacks.train import recipes

    readme = os.path.join(recipes.DIR, "README.md")
    rows = [line for line in open(readme, encoding="utf-8") if "| `cuda-fsdp-qwen7b.yaml` | Qwen2.5-7B" in line
            and line.count("|") == 12]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
        _, _, model, micro, shards, weights, gathered, kv, act, logits, peak = cells
        est = estimate_grpo_memory(QWEN25[f"Qwen/{model}"], **{**GRPO, "micro_batch": int(micro),
                                                               "generation_batch": int(micro) * 4},
                                   lora_params=0, full_finetune=True, shards=int(shards), lm_head="triton")
        assert [weights, gathered, kv, act, logits, peak] == [
            _gib(est.get(k, 0.0)) for k in ("weights", "gathered", "kv_cache", "activations", "logits",
                                            "peak")], row


def test_a_checkpoints_fingerprint_ignores_the_rng_file_another_rank_writes_late(tmp_path):
    """Each rank writes its own ``rng_state_<rank>.pth`` into the checkpoint after the main process may have
    fingerprinted the folder (seen under FSDP: rank 1's file 10 ms after ``trainer_state.json``): a late one must not
    make the run's own checkpoint look rewritten; the main process's files and the state still count."""
    from hf_perf_callbacks.resize.checkpoints import fingerprint

    (tmp_path / "trainer_state.json").write_text('{"global_step": 4}')
    (tmp_path / "rng_state_0.pth").write_bytes(b"0")
    before = fingerprint(str(tmp_path))
    (tmp_path / "rng_state_1.pth").write_bytes(b"1")
    (tmp_path / "rng_state_12.pth").write_bytes(b"12")
    assert fingerprint(str(tmp_path)) == before
    (tmp_path / "rng_state_0.pth").write_bytes(b"00")
    assert fingerprint(str(tmp_path)) != before
    (tmp_path / "rng_state_0.pth").write_bytes(b"0")
    (tmp_path / "trainer_state.json").write_text('{"global_step": 5}')
    assert fingerprint(str(tmp_path)) != before
