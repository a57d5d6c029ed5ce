"""Two CPU processes (torchrun, gloo): global throughput is identical on both ranks and logged once."""
import json
import os
import socket
import subprocess
import sys

import pytest

from hf_perf_callbacks.core.runlog import LOCK_FILE

#: every test here starts two ranks with torch.distributed.run (deselected by default; `pytest -m launch`)
pytestmark = pytest.mark.launch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_rank_meter.py")


def torchrun(script, out, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as probe:                      # a free port: a fixed one may still be in TIME_WAIT
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           script, str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    proc = torchrun(SCRIPT, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    return out, ranks


def test_global_tokens_per_second_is_equal_on_both_ranks(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert r0["world"] == r1["world"] == 2
    assert r0["grpo_rates"] == r1["grpo_rates"] and any(r0["grpo_rates"])
    assert r0["grpo_rollout_rates"] == r1["grpo_rollout_rates"] and len(r0["grpo_rollout_rates"]) == 4   # every rank
    assert r0["grpo_tokens"] == r1["grpo_tokens"] == r0["grpo_seen"]      # GRPO's counter is already global
    assert r0["plain_rates"] == r1["plain_rates"] and any(r0["plain_rates"])
    assert r0["plain_token_source"] == "hook"
    assert r0["plain_tokens"] == r1["plain_tokens"] > 0                   # own counts summed over ranks


def test_perf_log_is_written_by_the_main_process_only(two_rank_run):
    out, _ = two_rank_run
    for run in ("grpo", "plain"):
        lines = [json.loads(line) for line in open(out / run / "perf_log.jsonl")]
        steps = [line["step"] for line in lines if line["type"] == "step"]
        assert steps == [1, 2, 3, 4]                                       # once each, not once per rank
        assert sum(line["type"] == "run" for line in lines) == 1


def test_a_watchdog_stop_on_one_rank_stops_both_with_one_checkpoint(two_rank_run):
    out, (r0, r1) = two_rank_run
    assert r1["stop_actions"] == ["clear_cache", "stop"]                # rank 1 decided
    assert r0["stop_actions"] == ["stop"]                               # rank 0 followed
    assert r0["stop_step"] == r1["stop_step"] == 2
    assert sorted(n for n in os.listdir(out / "stop") if n != LOCK_FILE) == ["checkpoint-2", "perf_log.jsonl"]


def test_an_oom_on_one_rank_resizes_both_ranks_without_deadlock(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert (r0["oom_raised"], r1["oom_raised"]) == (0, 1)               # planted on rank 1 only
    assert r0["oom_decisions"] == r1["oom_decisions"] == [["oom", 3, 2]]      # the step that ran out
    assert r0["oom_split"] == r1["oom_split"] == [2, 2]                 # effective batch 4 × 1 × 2 ranks kept
    assert r0["oom_step"] == r1["oom_step"] == 4


def test_the_memory_check_agrees_across_ranks_when_one_rank_runs_out_of_memory(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert r0["check_trials"] == r1["check_trials"]
    assert [fits for micro, fits in r0["check_trials"] if micro > 2] == [False] * sum(
        micro > 2 for micro, _ in r0["check_trials"])                       # rank 1's OOM counts for both
    assert r0["check_split"] == r1["check_split"] and r0["check_split"][0] <= 2
    assert r0["check_step"] == r1["check_step"] == 2


def test_the_tuning_on_the_runs_steps_takes_the_same_decisions_on_every_rank(two_rank_run):
    """Each rank's step times are planted differently: both judge the slowest rank's samples, so they keep the
    same split, measured on the same steps with the same samples."""
    _, (r0, r1) = two_rank_run
    assert r0["tune_decisions"] == r1["tune_decisions"] and r0["tune_decisions"][0][0] == "tune"
    assert r0["tune_split"] == r1["tune_split"] == [4, 1] and r0["tune_step"] == r1["tune_step"] == 13
    # 2×2 measured on steps 4-7; 4×1 (1.67× faster on the slowest rank) kept by the sequential test on its second
    # measured step (11, after 2 warm-up steps)
    assert r0["tune_decisions"][0][1] == 11
    samples = dict((micro, s) for micro, s in r0["tune_decisions"][0][3])
    assert len(samples[4]) == 2 and min(samples[4]) >= 60.0            # rank 1's (slower) time counts for both


def test_an_oom_in_one_ranks_backward_resizes_both_without_deadlock(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert (r0["backward_raised"], r1["backward_raised"]) == (0, 1)
    assert r0["backward_split"] == r1["backward_split"] == [2, 2] and r0["backward_step"] == r1["backward_step"] == 3


def test_guarded_steps_average_gradients_exactly_like_ddp(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert r0["guarded_weight_change"] > 1e-4                              # training moved the weights
    assert r0["grpo_guarded_step"] == r1["grpo_guarded_step"] == 2         # GRPO under the guard too
    assert r0["guarded_vs_ddp_max_weight_diff"] < 1e-6 and r1["guarded_vs_ddp_max_weight_diff"] < 1e-6


def test_an_oom_on_one_rank_before_trls_own_collectives_resizes_both(two_rank_run):
    """Rank 0 still has TRL's gathers (rewards after generation, metrics after the loss) ahead when rank 1 runs out
    of memory: without the agreement before each collective of the step, rank 0 would wait in them for ever."""
    _, (r0, r1) = two_rank_run
    where = "grpo_forward_oom"
    assert (r0[where]["raised"], r1[where]["raised"]) == (0, 1)
    assert r0[where]["decisions"] == r1[where]["decisions"] == [["oom", 2, 2]]
    assert r0[where]["split"] == r1[where]["split"] == [2, 2, 8]          # generation batch 8 kept
    assert r0[where]["step"] == r1[where]["step"] == 3
    assert r0["collectives_restored"] and r1["collectives_restored"]    # the wrapping ends with train_with_tuning


def test_an_oom_in_generation_on_one_rank_ends_every_rank_alike_without_a_resize(two_rank_run):
    """Generation's memory does not shrink with the micro-batch: the ranks agree on where the OOM struck, make no
    re-size, and every rank ends with the same cause after step 1 was saved."""
    out, (r0, r1) = two_rank_run
    where = "grpo_generation_oom"
    assert (r0[where]["raised"], r1[where]["raised"]) == (0, 1)
    assert r0[where]["ended"][0] == r1[where]["ended"][0] == "UnfixableOOM"
    assert r1[where]["ended"][1].startswith("out of memory in generation (out of memory on a rank: MPS backend")
    assert r0[where]["ended"][1].startswith("out of memory in generation (out of memory on a rank: out of memory "
                                            "on another rank")
    assert r0[where]["decisions"] == r1[where]["decisions"] == []
    assert r0[where]["split"] == r1[where]["split"] == [4, 1, 8] and r0[where]["step"] == 1
    assert (out / where / "checkpoint-1" / "trainer_state.json").is_file()


def test_another_error_in_one_ranks_step_is_raised_on_every_rank(two_rank_run):
    """A reward function failing on rank 1: rank 1 raises it, rank 0 raises PeerFailed at the same step instead of
    waiting in TRL's reward gather until the launcher's timeout; the script then goes on (both ranks in step)."""
    _, (r0, r1) = two_rank_run
    assert r1["failure"] == ["ValueError", 1] and r0["failure"] == ["PeerFailed", 1]


def test_an_oom_outside_the_step_on_one_rank_ends_the_run_instead_of_hanging(tmp_path):
    """Re-sizing after an OOM outside the guarded step would pair mismatched collectives (a hang until the
    timeout): rank 1 raises it, no decision is made, and the launcher ends the run (a hang would run into the
    subprocess timeout, which raises ``TimeoutExpired``; gloo's own timeout is 30 minutes)."""
    proc = torchrun(os.path.join(os.path.dirname(SCRIPT), "two_rank_outside_oom.py"), tmp_path)
    assert proc.returncode != 0
    rank1 = json.load(open(tmp_path / "rank1.json"))
    assert rank1 == {"reraised": True, "step": 1, "decisions": []}
    assert "out of memory outside the training step" in proc.stderr


def test_an_oom_no_smaller_split_fixes_exactly_saves_on_every_rank_and_names_the_checkpoint(tmp_path):
    """Left padding leaves only the configured split exact: the ranks agree on rank 1's OOM at step 3, save
    checkpoint-2 together (an agreed stop, like an OOM no micro-batch fixes), and both raise ``InexactResize``
    naming it; the split file's ``ended`` says the same."""
    from hf_perf_callbacks.core.splitfile import read_split_file
    from hf_perf_callbacks.resize.checkpoints import is_complete

    proc = torchrun(os.path.join(os.path.dirname(SCRIPT), "two_rank_inexact.py"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    assert (r0["planted"], r1["planted"]) == (0, 1) and r0["step"] == r1["step"] == 2
    assert r0["raised"] == r1["raised"] == "InexactResize" and r0["decisions"] == r1["decisions"] == []
    assert r0["checkpoint"] == r1["checkpoint"] == checkpoint and is_complete(checkpoint, 2)
    assert r0["not_saved"] == r1["not_saved"] == "" and f"resume_from_checkpoint={checkpoint!r}" in r0["message"]
    ended = read_split_file(str(tmp_path / "run")).ended            # the error's own words, said by it alone
    assert r0["notes"] == r1["notes"] == [] and r0["message"] in ended


def test_a_resume_reads_the_split_file_once_for_every_rank(two_rank_run):
    """Rank 1's own reading of the split file is withheld (as if the main process rewrote it at that moment): both
    ranks still resume at the split the main process read, with its history."""
    _, (r0, r1) = two_rank_run
    assert r0["main_process_value"] == r1["main_process_value"] == 0
    assert r0["resumed_split"] == r1["resumed_split"] == r0["oom_split"] == [2, 2]
    assert r0["resumed_decisions"] == r1["resumed_decisions"] >= 1


def test_the_meter_and_the_watchdog_take_one_collective_per_step_also_with_one_rank_disabled(tmp_path):
    """Their step ends share one exchange (not one each); rank 1's meter disabled by a fault at step 2 still joins
    it with zeros, so both ranks finish every step."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "two_rank_exchange.py")
    proc = torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"exchange{r}.json")) for r in (0, 1))
    for result in (r0, r1):
        assert result["both"]["per_step"] == {"1": 1, "2": 1, "3": 1, "4": 1}
        assert result["faulted"]["per_step"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert r1["faulted"]["meter_disabled"] is True and r0["faulted"]["meter_disabled"] is False


def test_a_resize_on_two_ranks_is_checked_on_every_ranks_rows_with_one_verdict(tmp_path):
    """Rank 1 runs out of memory; both ranks check 2×2 on their own rows, summing their sketches: the plain loss
    goes on exactly on both (the weights of the unfaulted two-rank run), a loss warming up with the step is refused
    on both with one reason (tests/scripts/two_rank_exactness.py)."""
    proc = torchrun(os.path.join(os.path.dirname(SCRIPT), "two_rank_exactness.py"), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for name in ("resized", "refused"):
        assert r0[name]["planted"] == 0 and r1[name]["planted"] == 1
    resized = r0["resized"]
    assert resized["split"] == r1["resized"]["split"] == [2, 2] and resized["step"] == r1["resized"]["step"] == 5
    assert resized["same_weights"] and r1["resized"]["same_weights"]
    [check] = resized["checks"]
    assert (check["step"], check["verdict"]) == (3, "exact")
    refused = r0["refused"]
    assert refused["raised"] == r1["refused"]["raised"] == "Refused"             # an InexactResize
    assert refused["message"] == r1["refused"]["message"]
    assert refused["step"] == r1["refused"]["step"] == 2 and [c["verdict"] for c in refused["checks"]] == ["inexact"]
