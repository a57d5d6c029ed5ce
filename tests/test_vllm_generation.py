"""GRPO's generation seen wherever TRL generates: HF ``generate``, vLLM server and vLLM colocate give the meter the
same figures (the engine's time, the rollout rate over it, the weight syncs, the reward functions, the generation
batch), and the report's GRPO findings read them on all three.

The vLLM runs drive a real ``GRPOTrainer(use_vllm=True)`` (tiny random Llama with LoRA, CPU) with TRL's own vLLM
code: in server mode its ``VLLMClient`` talks HTTP to a stand-in server on 127.0.0.1 (port 0), in colocate mode
``VLLMGeneration`` drives a stand-in ``vllm.LLM``; vLLM's NCCL weight-transfer engine is stood in (it needs CUDA).
What is stood in and why: :mod:`tests.vllm_double`. The stand-ins spend planted seconds on the test's clock, which
reads planted seconds only here (:class:`PlantedOnly`), so each figure must equal what the engine, the reward
function and the planted training cost were told to spend, exactly. Several ranks, in real time:
``tests/test_vllm_ranks.py``. A real vLLM engine was not measured (no machine here has one).
"""
import json
import os

import pytest

from hf_perf_callbacks import ThroughputMeter, keys
from hf_perf_callbacks.platform import adapter
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.rules import check
from tests.conftest import PlantedClock, length_reward, make_grpo
from tests.vllm_double import EngineScript, StandInLLM, StandInServer, colocate_env, stand_in, supported

BACKENDS = ("transformers", "vllm-server", "vllm-colocate")
GENERATE_SEC = 2.0          # planted per engine call (HF generate, one HTTP completions request, LLM.generate)
TENSOR_SEC = 0.0625         # planted per weight tensor sent to vLLM
REWARD_SEC = 0.25           # planted per call of the reward function
LOSS_SEC = 0.5              # planted per training micro-batch (compute_loss)
LENGTHS = [3, 5, 7, 9, 4, 20]   # the engine's completion lengths, in turn (20: cut at max_completion_length 12)
PEAK_BANDWIDTH = 1e9


class PlantedOnly(PlantedClock):
    """A clock that reads the planted wall seconds alone: the real work (the tiny model, HTTP) takes no time on it."""

    def wall(self) -> float:
        return self.planted


def perf_steps(output_dir):
    return [line for line in map(json.loads, open(os.path.join(output_dir, keys.PERF_LOG))) if line["type"] == "step"]


@pytest.fixture
def engine(tokenizer, monkeypatch, tmp_path):
    """The stand-ins of vLLM for one test: its script (planted clock), the server (started) and a saved model."""
    reason = supported()
    if reason:
        pytest.skip(reason)
    from hf_perf_callbacks.tiny import build_model

    clock = PlantedOnly()
    script = EngineScript(GENERATE_SEC, TENSOR_SEC, LENGTHS, list(range(20, 80)), tokenizer.eos_token_id, clock)
    stand_in(monkeypatch, script)
    colocate_env(monkeypatch)
    model_dir = tmp_path / "model"
    build_model(tokenizer).save_pretrained(model_dir)       # colocate's engine loads what TRL names
    with StandInServer(script) as server:
        yield clock, script, server, str(model_dir)


def run_grpo(backend, tokenizer, output_dir, engine, *, max_steps=3, tensor_sec=TENSOR_SEC, extra=None, meter=None):
    """A GRPO run on ``backend`` with planted costs: (trainer, meter, the engine's script, HF generate's calls)."""
    from transformers import AutoModelForCausalLM

    clock, script, server, model_dir = engine
    script.tensor_sec = tensor_sec

    def slow_reward(*args, **kwargs):
        clock.spend(REWARD_SEC)
        return length_reward(*args, **kwargs)

    meter = meter or ThroughputMeter(clock=clock, peak_bandwidth=PEAK_BANDWIDTH, warmup_window=2,
                                     warmup_tolerance=0.5, max_warmup_steps=2)
    settings = dict(extra or {})
    if backend != "transformers":
        settings.update(use_vllm=True, vllm_mode=backend.removeprefix("vllm-"), vllm_server_base_url=server.url)
    trainer = make_grpo(tokenizer, output_dir, [meter], max_steps=max_steps, extra=settings, reward=slow_reward,
                        model=AutoModelForCausalLM.from_pretrained(model_dir))
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
def test_grpo_figures_equal_what_the_backend_spent(backend, tokenizer, tmp_path, engine):
    trainer, meter, script, hf_calls = run_grpo(backend, tokenizer, tmp_path, engine)
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
        assert step[keys.PERF_PHASE_SEC["rollout_wait"]] == 0.0                 # one process waits for nobody
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


def test_trls_client_talks_to_the_server_as_to_vllm(tokenizer, tmp_path, engine):
    """TRL's own VLLMClient over HTTP: its health check, model and server info, the weight-transfer group, one
    completions request and one sync per step (every base weight announced with its name, dtype and shape, each
    tensor received as announced), the prefix cache reset after each sync; the completions it returned were trained
    on, EOS and ``max_tokens`` honoured (the 20-token one cut at 12, counted as clipped)."""
    trainer, _, script, _ = run_grpo("vllm-server", tokenizer, tmp_path, engine)
    _, _, server, _ = engine
    assert server.requests[:4] == ["/health", "/v1/models", "/server_info", "/get_world_size"]
    assert "/init_weight_transfer_engine" in server.requests
    assert server.requests.count("/v1/completions") == 3 and server.requests.count("/update_weights") == 3
    base = trainer.model.get_base_model()
    names = [n for n, _ in base.named_parameters() if "lora_" not in n]
    assert script.syncs == [len(names)] * 3 and script.pending == 0
    announced = server.updates[0]
    assert len(announced["names"]) == len(names) and set(announced["dtype_names"]) == {"float32"}
    assert all(".base_layer" not in n and "lora_" not in n for n in announced["names"])     # merged, vLLM's names
    assert [c["completions"] for c in script.generate_calls] == [8, 8, 8]
    assert max(c["longest"] for c in script.generate_calls) == trainer.args.max_completion_length
    clipped = [h["completions/clipped_ratio"] for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    assert 0 < max(clipped) < 1                        # cut completions counted as clipped, EOS-ended ones not
    assert trainer.state.num_input_tokens_seen > sum(c["tokens"] for c in script.generate_calls)   # + prompts


def test_trl_refuses_a_cpu_device_for_the_weight_transfer(engine):
    """TRL 1.16's ``init_communicator`` refuses a CPU device (vLLM's NCCL engine needs CUDA) before any transfer:
    the stand-ins leave TRL's function as it is and reach its HTTP path only with the device a CUDA machine passes."""
    from trl.generation import vllm_client

    _, _, server, _ = engine
    client = vllm_client.VLLMClient(base_url=server.url)
    trl_own = vllm_client.VLLMClient.init_communicator.trl_own
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        trl_own(client, device="cpu")
    assert "/init_weight_transfer_engine" not in server.requests
    client.init_communicator(device="cpu")              # the stand-ins' route: "cuda", then TRL's code as written
    assert "/init_weight_transfer_engine" in server.requests and client.communicator is not None


def test_sleep_mode_syncs_from_inside_generate_and_is_timed_once(tokenizer, tmp_path, engine):
    """Colocate with ``vllm_enable_sleep_mode``: the engine discards its weights after each generate (level 2), so
    at the step's second generation (``steps_per_generation=1``, two micro-batches) TRL syncs from inside
    ``VLLMGeneration.generate``, which the meter also wraps: every sync is counted once, inside the generation, and
    the engine's time is its two calls."""
    trainer, meter, script, _ = run_grpo("vllm-colocate", tokenizer, tmp_path, engine, max_steps=2,
                                         extra={"vllm_enable_sleep_mode": True, "steps_per_generation": 1})
    llm = StandInLLM.built[-1]
    assert llm.enable_sleep_mode and llm.sleeps >= 4 and ["weights"] in llm.wake_ups
    steps = perf_steps(tmp_path)
    assert len(script.generate_calls) == 4 and len(script.syncs) == 4      # a sync before each generate
    for i, step in enumerate(steps):
        syncs = sum(script.sync_seconds[2 * i:2 * i + 2])
        tokens = sum(c["tokens"] for c in script.generate_calls[2 * i:2 * i + 2])
        assert step[keys.PERF_WEIGHT_SYNC_SEC] == pytest.approx(syncs, rel=1e-12)
        assert step[keys.PERF_PHASE_SEC["generation"]] == pytest.approx(2 * GENERATE_SEC + syncs, rel=1e-12)
        assert step[keys.PERF_ROLLOUT_TOKENS_PER_SEC] == pytest.approx(tokens / (2 * GENERATE_SEC), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_report_grpo_findings_on_every_backend(backend, tokenizer, tmp_path, engine):
    """The report reads the same figures on the three backends: generation-bound on all, weight syncs where vLLM
    took them (a planted 0.25 s per tensor: over a third of the step). Warmup is declared over after 2 steps at the
    latest (``max_warmup_steps=2``), so the steady steps do not depend on how loaded the machine is."""
    run_grpo(backend, tokenizer, tmp_path, engine, max_steps=7, tensor_sec=0.25)
    m = measurements_from_run(str(tmp_path))
    assert m.generation_backend == backend and m.warmup_done and m.steady_steps >= 3
    steps = perf_steps(tmp_path)
    wall = sum(s[keys.PERF_STEP_WALL_SEC] for s in steps)
    assert m.phase_sec["reward"] / m.wall_sec == pytest.approx(REWARD_SEC * len(steps) / wall)
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


def test_a_fault_in_the_entry_clock_disables_the_meter_not_the_training(tokenizer, tmp_path, engine, monkeypatch):
    """The entry clock runs inside TRL's own generation: a fault there disables the meter with one warning, takes its
    wrappers off the trainer at once, and training goes on to its last step."""
    def broken(kind, result):
        raise RuntimeError("planted")

    monkeypatch.setattr(adapter, "rollout_counts", broken)
    trainer, meter, script, _ = run_grpo("vllm-server", tokenizer, tmp_path, engine, max_steps=2)
    assert meter.disabled and trainer.state.global_step == 2 and len(script.generate_calls) == 2
    assert "_generate" not in trainer.__dict__ and "get_batch_samples" not in trainer.__dict__
