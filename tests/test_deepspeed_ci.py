"""The DeepSpeed subset CI runs (``.ci/run``, on the pinned set, with the ``deepspeed`` extra): under ZeRO-2 and
ZeRO-3 on two CPU ranks (gloo, ``DS_ACCELERATOR=cpu``, ``tests/scripts/two_rank_deepspeed.py``), the meter's figures,
a stop on one rank, and an out-of-memory error on rank 1 through the restart. The rest of the DeepSpeed tests are in
``tests/test_deepspeed.py``. DeepSpeed's one C++ op on a CPU (its shared-memory all-reduce, which training never
calls) is not built: the script says why.
"""
import json

import pytest

from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.resize.record import merged, rank_files
from tests.test_deepspeed import launch, launched


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero_meter(request, tmp_path_factory):
    return launched(tmp_path_factory, request.param, "meter")


@pytest.mark.launch
def test_the_meters_figures_are_global_and_equal_on_every_rank_under_zero(zero_meter):
    stage, _, (r0, r1), stderr = zero_meter
    for r in (r0, r1):
        assert r["deepspeed"] and r["engine"] == "DeepSpeedEngine" and r["zero_stage"] == stage
        assert r["disabled"] == [] and r["keys"] == ["mem", "perf", "tuner"] and r["world"] == 2
        assert r["meter_matmul"] == r["reference_matmul"] > 0               # ZeRO-3: the unpartitioned model
    assert r0["rates"] == r1["rates"] and all(rate > 0 for rate in r0["rates"])
    assert r0["tokens"] == r1["tokens"] == r0["independent_tokens"] > 0     # both ranks' tokens, counted once
    assert "disabled after an internal error" not in stderr
    assert "deepspeed_shm_comm" not in stderr                               # no op compiled


@pytest.mark.launch
def test_a_watchdog_stop_on_one_rank_stops_every_rank_with_deepspeeds_checkpoint(zero_meter):
    _, _, (r0, r1), _ = zero_meter
    assert r1["stop_actions"] == ["clear_cache", "stop"] and r0["stop_actions"] == ["stop"]
    assert r0["stop_step"] == r1["stop_step"] == 2
    assert {"global_step2", "latest", "scheduler.pt", "trainer_state.json"} <= set(r0["checkpoint_files"])


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_an_oom_on_rank_1_reaches_the_restart_and_the_relaunch_resumes_exactly(tmp_path, stage):
    """An OOM on rank 1 at step 5 (no step guard under DeepSpeed) ends the first launch with the next smaller split
    recorded for the restart, whatever rank ran out; the relaunch resumes every rank from checkpoint-4 at 2×2 and
    trains steps 5-8 as the unfaulted run does (samples over both ranks, learning rates, weights)."""
    first = launch(tmp_path, stage, "restart_rank1")
    assert first.returncode != 0
    run = str(tmp_path / "run")
    assert [str(r.split) for r in rank_files(run)] == ["2×2"]                   # rank 1's decision, in its own file
    assert str(merged(read_split_file(run), rank_files(run)).split) == "2×2"     # what the restart reads
    second = launch(tmp_path, stage, "restart_rank1", "relaunch")
    assert second.returncode == 0, second.stderr[-4000:]
    for r in (0, 1):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["step"] == 8 and got["split"] == [2, 2]
        assert [d[:3] for d in got["decisions"]] == [["oom", 5, 2]]              # step 5 failed, on rank 1
        assert got["differences"] == []
