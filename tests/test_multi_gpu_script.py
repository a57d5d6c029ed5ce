"""``benchmarks/multi_gpu.sh --smoke``: the four-GPU and two-node script on CPU processes (gloo, the tiny model), so
that it is known to work before a GPU machine runs it: FSDP2 on two ranks of one host (re-sizes and OOMs inside a
step recovered in the same process), an OOM after the step guard came off resumed by the launcher's restart, and two
``torchrun`` launchers (``--nnodes 2``, one rank each) meeting on localhost. Slow (four launches): ``launch``."""
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
                          capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = {name: out / f"multi_gpu_smoke_{name}.json" for name in ("fsdp", "fsdp_restart", "two_nodes")}
    missing = [name for name, path in files.items() if not path.exists()]
    assert not missing, f"no result of {missing}; the script printed:\n{done.stdout[-4000:]}"
    return {name: json.load(open(path)) for name, path in files.items()}


def test_one_host_fsdp2_figures_resizes_recoveries_and_stop(results):
    run = results["fsdp"]
    assert run["world_size"] == 2 and run["planted_rank"] == 1
    for check in ("callbacks_report_on_every_rank", "tokens_match_independent_count", "logged_once",
                  "resize_same_split", "resize_same_decisions", "resize_in_process_reached_max_steps",
                  "resize_effective_batch_kept", "resize_logged_once", "recover_in_process_on_every_rank",
                  "recover_same_samples_as_unfaulted", "recover_planted_once", "lora_in_process_on_every_rank",
                  "lora_same_samples_as_unfaulted", "lora_planted_once", "stop_same_step", "stop_one_checkpoint",
                  "stop_resumed"):
        assert run[check] is True, check
    guard = run["ranks"]["guard"][0]                      # measured, not judged: a loaded CPU says nothing of 1%
    assert all(guard[arm]["steps"] == 20 for arm in ("plain", "never_armed", "default", "always_on"))


def test_an_oom_after_the_guard_came_off_is_resumed_by_the_relaunch(results):
    restart = results["fsdp_restart"]
    for check in ("started_again", "reached_max_steps", "split_recorded_and_applied", "logged_once"):
        assert restart[check] is True, check


def test_two_launchers_as_two_nodes_log_once_with_global_figures_and_one_decision(results):
    run = results["two_nodes"]
    assert run["nodes"] == 2 and run["world_size"] == 2
    for check in ("callbacks_report_on_every_rank", "tokens_match_independent_count", "logged_once",
                  "resize_same_decisions", "resize_same_split", "resize_in_process_reached_max_steps",
                  "resize_logged_once"):
        assert run[check] is True, check
