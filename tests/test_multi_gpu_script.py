"""``benchmarks/multi_gpu.sh --smoke``: the four-GPU and two-node script on CPU processes (gloo, the tiny model), so
that it is known to work before a GPU session runs it: FSDP2 on two ranks of one host, an OOM refused at once, and
two ``torchrun`` launchers (``--nnodes 2``, one rank each) meeting on localhost. Slow (three launches): ``launch``."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu")
    env = {**os.environ, "PYTHON": sys.executable, "HF_PERF_RESULTS": str(out), "OUT": ""}
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "multi_gpu.sh"), "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {name: json.load(open(out / f"multi_gpu_smoke_{name}.json")) for name in ("fsdp", "fsdp_oom", "two_nodes")}


def test_one_host_fsdp2_figures_resize_and_stop(results):
    run = results["fsdp"]
    assert run["world_size"] == 2 and run["planted_rank"] == 1
    for check in ("callbacks_report_on_every_rank", "tokens_match_independent_count", "logged_once",
                  "resize_same_split", "resize_same_decisions", "resize_stopped_together",
                  "resize_relaunch_reached_max_steps", "resize_effective_batch_kept", "resize_logged_once",
                  "stop_same_step", "stop_one_checkpoint", "stop_resumed"):
        assert run[check] is True, check


def test_an_oom_under_fsdp_ends_the_launch_at_once_with_the_message(results):
    oom = results["fsdp_oom"]
    assert oom["ended_at_once"] and not oom["hung"] and oom["planted_rank_record"]["reraised"]


def test_two_launchers_as_two_nodes_log_once_with_global_figures_and_one_decision(results):
    run = results["two_nodes"]
    assert run["nodes"] == 2 and run["world_size"] == 2
    for check in ("callbacks_report_on_every_rank", "tokens_match_independent_count", "logged_once",
                  "resize_same_decisions", "resize_same_split", "resize_relaunch_reached_max_steps",
                  "resize_logged_once"):
        assert run[check] is True, check
