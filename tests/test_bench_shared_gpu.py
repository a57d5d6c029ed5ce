"""``benchmarks/bench_shared_gpu.py --smoke``: the shared-GPU benchmark's eight runs on CPU stand-ins (another process
holding 512 MiB, memory this process holds outside torch, a 64 MiB leak a step and a slow one, the tiny model; a real
tenant process taking a small machine's free memory at step 10 while the rows grow, and one that gives it back), so
that it is known to work before a GPU session runs it. It starts a Python process (and the holder's): ``launch``."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_run_ends_with_a_checkpoint_no_oom_and_the_causes_named(tmp_path):
    env = {**os.environ, "HF_PERF_RESULTS": str(tmp_path), "OUT": "", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_shared_gpu.py"), "--smoke"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.load(open(tmp_path / "shared_gpu_smoke.json"))
    assert result["passed"] and result["environment"]["torch"] and result["environment"]["date"]
    runs = result["runs"]
    assert set(runs) == {"a_other_process", "b_outside_allocator", "c_tuning", "d_wall_moves", "e_wall_moves_tuning",
                         "f_slow_leak", "g_tenant_returns", "h_tenant_returns_tuning"}
    for name in ("g_tenant_returns", "h_tenant_returns_tuning"):    # a tenant takes memory and gives it back
        lent = runs.pop(name)
        assert lent["stop_step"] is None and lent["steps_trained"] == lent["max_steps"], name
        assert lent["memory_resizes"] == 0 and lent["oom"] is None and lent["error"] is None, name
        assert lent["budget_held_gb"] < lent["budget_before_gb"] and lent["budget_after_gb"] > lent["budget_held_gb"]
    moved, moved_tuning = runs.pop("d_wall_moves"), runs.pop("e_wall_moves_tuning")
    assert moved["stop_step"] == moved["taken_at_step"] == 10 and moved["checkpoints"] == ["checkpoint-10"]
    assert moved["oom"] is None and moved["error"] is None and moved["stop_names_outside"]
    assert moved_tuning["oom"] is None and moved_tuning["error"] is None and moved_tuning["memory_resizes"] >= 1
    assert moved_tuning["tuner_decisions"][0]["step"] == 10 and moved_tuning["checkpoints"]
    for name, run in runs.items():
        assert run["checkpoint"] and run["oom"] is None and run["error"] is None, name
        assert run["stop_step"] < run["max_steps"] and run["stop_names_leak"], name
        budget = [s["limit_gb"] for s in run["budget_per_step"]]
        assert len(budget) == run["stop_step"] and all(b > 0 for b in budget), name
        assert run["used_at_stop_gb"] < run["budget_at_stop_gb"], name
    assert runs["b_outside_allocator"]["held_by"] == "libc malloc"
    assert runs["c_tuning"]["memory_resizes"] == 0 and runs["c_tuning"]["tuner_decisions"] == []
