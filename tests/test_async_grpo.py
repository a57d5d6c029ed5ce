"""TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo`` in TRL 1.16) read right by the callbacks: the run is
GRPO (backend ``vllm-async``), the training step's wait for rollouts is ``rollout_wait`` (TRL's own
``perf/rollout_wait_s``, read, not measured again), the weight transfer is the step's generation and
``perf/weight_sync_sec`` (not logging), the tokens are the ones trained (TRL's ``batch/trained_tokens_per_step``:
completion tokens, no prompt, no packing padding), TRL's own keys are not doubled under other names, the report's GRPO
findings read them, the watchdog runs as on any trainer and the tuner refuses at its start with the reason.

What runs for real: the trainer, its rollout worker (a spawned process, ``aiohttp``) and its weight-transfer client,
against the stand-in vLLM server of :mod:`tests.vllm_double` on 127.0.0.1 (port 0), which spends real time:
a planted cost per completion request and per weight tensor (:data:`PLANTED`). Stood in besides (no machine here has
them): vLLM's NCCL weight-transfer engine (see :mod:`tests.vllm_double`); TRL's tree attention kernel
(``packing._flash_attn`` loads FlashAttention-3 from the hub and runs on CUDA only: :func:`varlen_attention` is the
same arithmetic in torch); TRL's peak-FLOPs helper (``get_peak_flops_per_device`` calls ``torch.cuda``: no peak on a
CPU). TRL 1.18's stable ``trl.AsyncGRPOTrainer`` may rename these internals; the adapter's functions are where the
package reads them.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.rules import check
from hf_perf_callbacks.resize.callback import _cannot_cut
from tests.conftest import PROMPTS, varied_reward
from tests.vllm_double import _PORTS, EngineScript, StandInServer, packed_nccl_broadcast_producer, trainer_init

TENSOR_SEC = 0.1            # per weight tensor the server receives
LENGTH = 6                  # every completion: 5 tokens and EOS (below max_completion_length 8)
SAMPLES = 4                 # per optimizer step: micro-batch 4 × 1 × 1 process
STEPS = 6

pytestmark = pytest.mark.launch            # the rollout worker is a spawned process (it imports torch and TRL)


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                     **kwargs):
    """``flash_attn_varlen_func`` of FlashAttention in torch: each segment's queries attend to its keys, causal
    from the bottom right (a segment's queries are the last of its keys); grouped K/V heads repeated."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
        attended = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].repeat_interleave(groups, 1).transpose(0, 1),
            v[ks:ke].repeat_interleave(groups, 1).transpose(0, 1), attn_mask=mask, scale=softmax_scale)
        out[qs:qe] = attended.transpose(0, 1)
    return out


@pytest.fixture
def async_trl(monkeypatch):
    """TRL's async GRPO with vLLM's and CUDA's parts stood in (see the module docstring)."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (the test extra)")
    try:
        from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing, weight_transfer
    except ImportError:
        pytest.skip("this TRL has no trl.experimental.async_grpo (TRL 1.16's)")
    import inspect

    if "_step_trained_tokens" not in inspect.getsource(async_grpo_trainer):
        pytest.skip("this TRL's AsyncGRPOTrainer predates TRL 1.16's, whose boundary the stand-ins take")
    for module in (weight_transfer, async_rollout_worker):
        monkeypatch.setattr(module, "is_vllm_available", lambda *a, **k: True)
    for name, value in (("get_ip", lambda: "127.0.0.1"), ("get_open_port", lambda: next(_PORTS)),
                        ("_HAS_STATEFUL_TRAINER_ENGINE", True), ("open_trainer_endpoint", trainer_init),
                        ("packed_nccl_broadcast_producer", packed_nccl_broadcast_producer)):
        monkeypatch.setattr(weight_transfer, name, value, raising=False)
    monkeypatch.setattr(packing, "_flash_attn", lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
    return async_grpo_trainer


#: how the tiny chat template's assistant turn reads back (TRL's rollout worker parses each completion with the
#: tokenizer's response template; TRL knows the templates of the hub's chat templates, not of this one)
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
                     "fields": {"content": {"close_pattern": r"</s>\s*|$", "content": "text"}}}


def run_async(tokenizer, tmp_path, callbacks, script):
    import copy

    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from hf_perf_callbacks.tiny import build_model

    model_dir = str(tmp_path / "model")
    build_model(tokenizer).save_pretrained(model_dir)
    tokenizer = copy.copy(tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    with StandInServer(script, model=model_dir) as server:
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=SAMPLES,
                               gradient_accumulation_steps=1, num_generations=SAMPLES, max_completion_length=8,
                               max_steps=STEPS, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                               bf16=False, dtype="float32", learning_rate=1e-3, vllm_server_base_url=server.url,
                               vllm_server_timeout=30, token_budget=0, max_inflight_tasks=SAMPLES,
                               weight_sync_steps=1, disable_tqdm=True, seed=0)
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 4]})
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=varied_reward, args=args, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=callbacks)
        trainer.train()
    return trainer, server


def steps_of(output_dir):
    lines = [json.loads(line) for line in open(os.path.join(output_dir, keys.PERF_LOG))]
    return [x for x in lines if x["type"] == "step"], next(x for x in lines if x["type"] == "run")


#: the two plantings: a step bound by its weight transfer (0.1 s a tensor), and one bound by generation (3 s a
#: request, four in flight: four samples every 3 s while the trainer's own step takes a fraction of that)
PLANTED = {"weight_sync": (0.5, TENSOR_SEC), "rollout_wait": (3.0, 0.005)}


@pytest.mark.parametrize("bound", sorted(PLANTED))
def test_async_grpo_figures_are_trls_and_what_was_planted(bound, tokenizer, tmp_path, async_trl):
    generate_sec, tensor_sec = PLANTED[bound]
    script = EngineScript(generate_sec, tensor_sec, [LENGTH], list(range(20, 80)), tokenizer.eos_token_id)
    meter = ThroughputMeter(warmup_window=2, warmup_tolerance=0.5, max_warmup_steps=2)
    watchdog, tuner = MemoryWatchdog(), AdaptiveBatchTuner()
    trainer, server = run_async(tokenizer, tmp_path, [meter, watchdog, tuner], script)
    steps, header = steps_of(trainer.args.output_dir)
    assert trainer.state.global_step == STEPS and len(steps) == STEPS
    assert header["grpo"] and header["generation_backend"] == "vllm-async" and header["weight_sync_steps"] == 1
    tensors = len(server.updates[0]["names"])
    assert script.syncs == [tensors] * (STEPS + 1)                 # the cold sync and one after every step
    trl_logs = [h for h in trainer.state.log_history if "perf/rollout_wait_s" in h]
    assert len(trl_logs) == STEPS
    for i, (step, trl) in enumerate(zip(steps, trl_logs)):
        # the wait for rollouts: TRL's own figure, moved out of the batch fetch (read, not measured twice)
        assert step[keys.PERF_PHASE_SEC["rollout_wait"]] == pytest.approx(trl["perf/rollout_wait_s"], rel=1e-9)
        # tokens trained: 4 completions of 6 tokens a step (no prompt, no padding of the packed rows)
        assert step[keys.PERF_TOKENS] == trl["batch/trained_tokens_per_step"] == SAMPLES * LENGTH
        # the step's generation: its weight transfer (the first step's also the rollout worker's start)
        generation, sync = step[keys.PERF_PHASE_SEC["generation"]], step[keys.PERF_WEIGHT_SYNC_SEC]
        assert generation > sync if i == 0 else generation == pytest.approx(sync, rel=1e-3)
        assert step[keys.PERF_PHASE_SEC["log"]] < 0.5 * sync                    # not booked as logging
        if bound == "weight_sync":      # the planted transfer (a sleep lasts at least its time; a loaded machine
            planted = tensors * tensor_sec  # adds to it), and TRL's figure of the same transfer (logged a step later)
            assert sync >= planted
            if i:
                assert abs(sync - trl_logs[i - 1]["perf/weight_sync_s"]) < 0.25 * planted
        elif i >= 2:        # the trainer spends most of its step waiting for the planted generation
            assert step[keys.PERF_PHASE_SEC["rollout_wait"]] > 0.5 * step[keys.PERF_STEP_WALL_SEC]
    if bound == "rollout_wait":    # generation paces the trainer: a step per generation (3 s and the worker's work)
        walls = [step[keys.PERF_STEP_WALL_SEC] for step in steps[2:]]
        assert 0.95 * generate_sec <= sum(walls) / len(walls) < 2 * generate_sec       # not two generations
    # TRL's own keys are not doubled under the package's names in the reporters
    for entry in trainer.state.log_history:
        assert not {keys.PERF_TOKENS_PER_SEC, keys.PERF_STEP_TIME, keys.PERF_MFU} & set(entry)
    assert any(keys.MEM_DEVICE_USED_GB in entry for entry in trainer.state.log_history)     # the watchdog ran
    events = [x for x in map(json.loads, open(os.path.join(trainer.args.output_dir, keys.PERF_LOG)))
              if x["type"] == "event" and x.get("source") == "tuner"]
    assert tuner.disabled and [e["message"] for e in events] == [_cannot_cut(trainer)]      # refused at its start
    m = measurements_from_run(trainer.args.output_dir)
    assert m.grpo and m.generation_backend == "vllm-async" and m.staleness_mean is not None
    findings, _ = check(m)
    by_rule = {f.rule: f for f in findings}
    assert "callbacks" not in by_rule and "generation_bound" not in by_rule    # no logging cost; it does not generate
    assert bound in by_rule, sorted(by_rule)
    if bound == "weight_sync":
        assert by_rule["weight_sync"].setting == {"weight_sync_steps": 2}
