"""GRPO's generation seen wherever TRL generates: HF ``generate``, vLLM server and vLLM colocate give the meter the
same figures (rollout and training time, completion tokens/s, weight-sync and reward time, the generation batch),
and the report's GRPO findings read them on all three.

The vLLM runs drive a real ``GRPOTrainer(use_vllm=True)`` (tiny random Llama with LoRA, CPU) whose vLLM side is a
**test double built from TRL 1.16's documented API** (``trl.generation.vllm_client.VLLMClient`` for server mode,
``vllm.LLM`` for colocate; see :mod:`tests.vllm_double`), because no machine this project uses has vLLM. The double
spends planted seconds on the test's clock and returns completions of given lengths; the clock here reads planted
seconds only (:class:`PlantedOnly`), so every figure the meter reports must equal what the double, the reward
function and the planted training cost were told to spend, exactly. A real vLLM engine was not measured.
"""
import json
import os

import pytest

from hf_perf_callbacks import ThroughputMeter, adapter, keys
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.rules import check
from tests.conftest import PlantedClock, length_reward, make_grpo
from tests.vllm_double import EngineScript, use_vllm_double

BACKENDS = ("transformers", "vllm-server", "vllm-colocate")
GENERATE_SEC = 2.0          # planted per generate call (HF generate or the vLLM double)
TENSOR_SEC = 0.0625         # planted per weight tensor sent to vLLM
REWARD_SEC = 0.25           # planted per call of the reward function
LOSS_SEC = 0.5              # planted per training micro-batch (compute_loss)
LENGTHS = [3, 5, 7, 9, 4]   # the double's completion lengths, in turn
PEAK_BANDWIDTH = 1e9


class PlantedOnly(PlantedClock):
    """A clock that reads the planted wall seconds alone: the real work of the tiny model takes no time on it."""

    def wall(self) -> float:
        return self.planted


def perf_steps(output_dir):
    return [line for line in map(json.loads, open(os.path.join(output_dir, keys.PERF_LOG))) if line["type"] == "step"]


def run_grpo(backend, tokenizer, output_dir, monkeypatch, *, max_steps=3, tensor_sec=TENSOR_SEC, extra=None):
    """A GRPO run on ``backend`` with planted costs: (trainer, meter, the double's script, HF generate's calls)."""
    clock = PlantedOnly()
    script = EngineScript(clock, GENERATE_SEC, tensor_sec, LENGTHS, list(range(20, 80)))
    use_vllm_double(monkeypatch, script)

    def slow_reward(*args, **kwargs):
        clock.spend(REWARD_SEC)
        return length_reward(*args, **kwargs)

    meter = ThroughputMeter(clock=clock, peak_bandwidth=PEAK_BANDWIDTH, warmup_window=2, warmup_tolerance=0.5)
    settings = dict(extra or {})
    if backend != "transformers":
        settings.update(use_vllm=True, vllm_mode=backend.removeprefix("vllm-"))
    trainer = make_grpo(tokenizer, output_dir, [meter], max_steps=max_steps, extra=settings, reward=slow_reward)
    loss = trainer.compute_loss

    def slow_loss(*args, **kwargs):
        clock.spend(LOSS_SEC)
        return loss(*args, **kwargs)

    trainer.compute_loss = slow_loss
    hf_calls = []
    if backend == "transformers":               # planted inside the model's own generate, under the meter's wrapper
        generate = trainer.model.generate

        def slow_generate(*args, **kwargs):
            clock.spend(GENERATE_SEC)
            out = generate(*args, **kwargs)
            hf_calls.append(out.shape[0])
            return out

        trainer.model.generate = slow_generate
    trainer.train()
    return trainer, meter, script, hf_calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_figures_equal_what_the_backend_spent(backend, tokenizer, tmp_path, monkeypatch):
    trainer, meter, script, hf_calls = run_grpo(backend, tokenizer, tmp_path, monkeypatch)
    steps = perf_steps(tmp_path)
    assert meter.backend == backend and len(steps) == 3
    vllm = backend != "transformers"
    calls = script.generate_calls if vllm else [{"completions": n} for n in hf_calls]
    assert len(calls) == 3 and len(script.syncs) == (3 if vllm else 0)        # one generation and sync per step
    ga = trainer.args.gradient_accumulation_steps
    for i, (step, call) in enumerate(zip(steps, calls)):
        sync = script.sync_seconds[i] if vllm else 0.0
        tokens = call["tokens"] if vllm else step[keys.TRAINER_LOG + "completions/mean_length"] * call["completions"]
        generation = step[keys.PERF_PHASE_SEC["generation"]]
        assert generation == pytest.approx(GENERATE_SEC + sync, rel=1e-12)    # HF: generate nested, counted once
        assert step[keys.PERF_PHASE_SEC["reward"]] == pytest.approx(REWARD_SEC, rel=1e-12)   # its own phase
        assert step[keys.PERF_PHASE_SEC["compute"]] == pytest.approx(ga * LOSS_SEC, rel=1e-12)
        assert step[keys.PERF_TRAIN_SEC] == pytest.approx(GENERATE_SEC + sync + REWARD_SEC + ga * LOSS_SEC)
        assert step[keys.PERF_GENERATION_BATCH] == call["completions"] == 8      # 4 per micro-batch × 2
        assert step[keys.PERF_COMPLETION_TOKENS] == pytest.approx(tokens)
        assert step[keys.PERF_ROLLOUT_TOKENS_PER_SEC] == pytest.approx(tokens / GENERATE_SEC, rel=1e-12)
        assert step[keys.PERF_REWARD_SEC] == pytest.approx(REWARD_SEC)
        if vllm:
            assert step[keys.PERF_WEIGHT_SYNC_SEC] == pytest.approx(sync, rel=1e-12) and sync > 0
        else:
            assert keys.PERF_WEIGHT_SYNC_SEC not in step
        if backend == "vllm-colocate":        # the engine decodes the batch until its longest completion
            expected = meter.run.weight_bytes * call["longest"] / GENERATE_SEC / PEAK_BANDWIDTH
            assert step[keys.PERF_DECODE_BANDWIDTH_UTIL] == pytest.approx(expected, rel=1e-12)
        elif backend == "vllm-server":        # the engine runs on the server's devices: no figure for this one
            assert keys.PERF_DECODE_BANDWIDTH_UTIL not in step
        else:
            assert step[keys.PERF_DECODE_BANDWIDTH_UTIL] > 0
    header = next(line for line in map(json.loads, open(tmp_path / keys.PERF_LOG)) if line["type"] == "run")
    assert header["generation_backend"] == backend


def test_the_server_double_is_called_as_trl_calls_the_client(tokenizer, tmp_path, monkeypatch):
    """What GRPOTrainer did with the server double: the documented calls, one generate and one sync per step, every
    tensor of the model sent, the prefix cache reset after each sync, and the completions it returned trained on."""
    trainer, _, script, _ = run_grpo("vllm-server", tokenizer, tmp_path, monkeypatch)
    client = trainer.vllm_generation.vllm_client
    assert client.communicator is not None and client.server_info_calls >= 1
    base = trainer.model.get_base_model()
    tensors = sum(1 for name, _ in base.named_parameters() if "lora_" not in name)
    assert script.syncs == [tensors] * 3 and script.pending == 0
    assert [c["completions"] for c in script.generate_calls] == [8, 8, 8]
    assert trainer.state.num_input_tokens_seen > sum(c["tokens"] for c in script.generate_calls)   # + prompts


@pytest.mark.parametrize("backend", BACKENDS)
def test_report_grpo_findings_on_every_backend(backend, tokenizer, tmp_path, monkeypatch):
    """The report reads the same figures on the three backends: generation-bound on all, weight syncs where vLLM
    took them (a planted 0.25 s per tensor: over a third of the step)."""
    run_grpo(backend, tokenizer, tmp_path, monkeypatch, max_steps=7, tensor_sec=0.25)
    m = measurements_from_run(str(tmp_path))
    assert m.generation_backend == backend and m.warmup_done and m.steady_steps >= 3
    steps = perf_steps(tmp_path)
    wall = sum(s[keys.PERF_STEP_WALL_SEC] for s in steps)
    assert m.reward_share == pytest.approx(REWARD_SEC * len(steps) / wall)
    findings, _ = check(m)
    by_rule = {f.rule: f for f in findings}
    assert "generation_bound" in by_rule
    assert by_rule["generation_bound"].setting == {"steps_per_generation": 4}     # CPU: no vLLM to advise
    if backend == "transformers":
        assert m.weight_sync_share is None and "weight_sync" not in by_rule
        return
    sync = sum(s[keys.PERF_WEIGHT_SYNC_SEC] for s in steps)
    assert m.weight_sync_share == pytest.approx(sync / wall) and m.weight_sync_share > 0.3
    assert m.weight_syncs == len(steps)
    assert by_rule["weight_sync"].setting == {"steps_per_generation": 4}


def test_generation_entry_watch_is_undone_and_ignores_other_trainers(tokenizer, tmp_path):
    """The entry wrappers come off the trainer when the meter closes; a trainer without ``_generate`` is not
    watched."""
    meter = ThroughputMeter()
    trainer = make_grpo(tokenizer, tmp_path, [meter], max_steps=1)
    trainer.train()
    assert "_generate" not in trainer.__dict__ and "_calculate_rewards" not in trainer.__dict__
    assert adapter.generation_backend(object()) is None
    assert adapter.watch_generation_entry(object(), meter)() is None


def test_a_fault_in_the_entry_clock_disables_the_meter_not_the_training(tokenizer, tmp_path, monkeypatch):
    """The entry clock runs inside TRL's own generation: a fault there disables the meter with one warning, takes its
    wrappers off the trainer at once, and training goes on to its last step."""
    def broken(kind, result):
        raise RuntimeError("planted")

    monkeypatch.setattr(adapter, "rollout_counts", broken)
    trainer, meter, script, _ = run_grpo("vllm-server", tokenizer, tmp_path, monkeypatch, max_steps=2)
    assert meter.disabled and trainer.state.global_step == 2 and len(script.generate_calls) == 2
    assert "_generate" not in trainer.__dict__ and "get_batch_samples" not in trainer.__dict__
