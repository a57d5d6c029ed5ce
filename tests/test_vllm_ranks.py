"""GRPO's generation on two ranks (gloo, CPU; ``tests/scripts/two_rank_vllm.py``), in real time: each rank's
generation is the engine call it makes or waits for, the time a rank waits for another's weight sync is its own
phase (``rollout_wait``), and the rollout rate is every rank's completion tokens over the engine's time, at most
the rate the engines were given and far from half or twice it, on vLLM server (TRL's client against the stand-in
server), vLLM colocate and HF ``generate``. What is stood in and why: :mod:`tests.vllm_double`. The planted costs
(2 s an engine call, 0.1 s a weight tensor) are large against the HTTP and the tiny model's work, and a loaded
machine only adds to them, so it cannot move the figures past the bounds below.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.scripts.two_rank_vllm import GENERATE_SEC, TENSOR_SEC
from tests.vllm_double import supported

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_rank_vllm.py")
BACKENDS = ("vllm-server", "vllm-colocate", "transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    reason = supported()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("vllm_ranks")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]


@pytest.mark.launch
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rollout_rate_on_two_ranks_is_the_planted_one(ranks, backend):
    r0, r1 = (r[backend] for r in ranks)
    assert r0["steps"] == r1["steps"] == 3 and r0["logged"] == r1["logged"]         # global figures, equal
    if backend == "vllm-server":          # one server for both ranks: rank 0's one call a step
        tokens = r0["engine_tokens"]
        assert r1["engine_calls"] == 0 and len(tokens) == 3
    elif backend == "vllm-colocate":      # each rank's own engine, at once
        tokens = [a + b for a, b in zip(r0["engine_tokens"], r1["engine_tokens"])]
    else:           # HF: the engine is the model itself, its decode real work on top of the planted cost
        tokens = [a + b for a, b in zip(r0["hf_tokens"], r1["hf_tokens"])]
        engine = [max(a, b) for a, b in zip(r0["hf_sec"], r1["hf_sec"])]        # as the test's own clock read it
        rates = [entry["perf/rollout_tokens_per_sec"] for entry in r0["logged"]]
        assert rates == pytest.approx([t / e for t, e in zip(tokens, engine)], rel=0.05)
    # at most the planted rate (an engine call lasts at least its planted seconds; a loaded machine only slows it),
    # and far from half or twice it (one rank's tokens, or both ranks' seconds, would be)
    planted = [t / GENERATE_SEC for t in tokens]
    rates = [entry["perf/rollout_tokens_per_sec"] for entry in r0["logged"]]
    assert all(0.75 * p < rate <= p * (1 + 1e-6) for rate, p in zip(rates, planted)), (rates, planted)


@pytest.mark.launch
def test_the_rank_that_waits_for_rank_0s_weight_sync_names_the_wait(ranks):
    """Server mode: rank 0 sends every weight (0.1 s each) while rank 1 waits for it in TRL's gather: rank 1's wait is
    ``rollout_wait``, its generation the server's call it waits for, not rank 0's sync."""
    r0, r1 = (r["vllm-server"] for r in ranks)
    sync = sum(r0["syncs"]) * TENSOR_SEC
    assert len(r0["syncs"]) == 3 and sync > 3 * GENERATE_SEC            # the sync is the larger cost
    assert r1["phase_sec"]["rollout_wait"] > 0.5 * sync
    assert r1["phase_sec"]["generation"] < 3 * GENERATE_SEC + 0.5 * sync
    assert r0["phase_sec"]["generation"] >= 3 * GENERATE_SEC + sync     # rank 0's own sync is its generation's
