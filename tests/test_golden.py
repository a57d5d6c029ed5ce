"""The rendered report of three planted runs (``tests/synthetic_runs.py``), compared exactly with the files under
``tests/golden/``: the console summary and analysis ``hf-perf report --no-plots`` prints, then ``perf_report.md``.

The runs are seeded and carry no clock, path or version into the text (the run directory is written as ``<run>``),
so a difference is a change of wording or of a number. After a deliberate change of the renderer, rewrite the files
with ``UPDATE_GOLDEN=1 pytest tests/test_golden.py`` and review their diff."""
from __future__ import annotations

import difflib
import os

import pytest

from hf_perf_callbacks.report.command import report_command
from hf_perf_callbacks.report.render import REPORT_FILE
from tests.synthetic_runs import Plan, write_run

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

#: name → the run it renders: a healthy short SFT run, a GRPO run with several findings, a run the tuner re-sized
RUNS = {
    "healthy_sft": Plan(steps=30, grpo=False, warmup=(1.5,)),
    "grpo_findings": Plan(steps=40, reward="constant", clipped=0.8, eval_every=5, eval_sec=3.0,
                          contention={20: 4.0, 21: 4.0}, walls=(12,)),
    "tuned": Plan(steps=60, tune=True, split_sec={1: 1.6, 2: 1.2, 8: 0.8}, noise=0.02),
    "tuned_kept": Plan(steps=80, tune=True, must_pay=False, noise=0.25, warmup=(2.0,)),   # a tuning that saved nothing
}


def rendered(tmp_path, capsys, plan: Plan) -> str:
    out = write_run(str(tmp_path / "run"), plan)
    assert report_command(out, plots=False) == 0
    console = capsys.readouterr().out
    with open(os.path.join(out, REPORT_FILE)) as f:
        report = f.read()
    return (console + "\n---- perf_report.md ----\n" + report).replace(out, "<run>")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_rendered_report_matches_its_golden_file(name, tmp_path, capsys):
    text = rendered(tmp_path, capsys, RUNS[name])
    path = os.path.join(GOLDEN, f"{name}.md")
    if os.environ.get("UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        golden = f.read()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True), f"golden/{name}.md",
                                        "rendered", n=2))
    assert not diff, f"the rendered report changed (UPDATE_GOLDEN=1 rewrites it after review):\n{diff}"


def _rule_scenarios() -> dict[str, object]:
    """name → the Measurements of a unit test of ``tests/test_analysis.py`` whose findings' and notes' words this
    golden file holds (the tests themselves assert the findings' data: reasons, figures, settings)."""
    from hf_perf_callbacks.core.runlog import HF_PERF_TRAIN
    from hf_perf_callbacks.report.model import Contention, Evaluation, Machine, RecipeTarget, Recompile, Rewards
    from tests.test_analysis import evaluation, healthy

    flat = Rewards(logs=8, min=0.0, max=0.0, std_max=0.0, zero_std_min=1.0,
                   funcs={"format_reward": (0.0, 0.0), "solved_reward": (0.0, 0.0)})
    return {
        "contention": healthy(contention=Contention(
            steps=4, step_list=[1, 2, 3, 4], lost_sec=39.9, run_sec=120.0, lost_share=39.9 / 120.0,
            wall_over_cpu=2.6, steady_wall_over_cpu=1.05, other_cores=1.6, source="meter")),
        "input_bound_with_workers": healthy(grpo=False, phases={"data_wait": 0.4, "compute": 0.6},
                                            dataloader={"num_workers": 4, "persistent_workers": True,
                                                        "prefetch_factor": 4, "pin_memory": True}),
        "generation_bound_cuda": healthy(phases={"data_wait": 0.0, "generation": 0.95, "compute": 0.05, "eval": 0.0,
                                                 "save": 0.0}, decode_bandwidth_util=0.008, mfu=0.3),
        "more_steps_per_generation": healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, grad_accum=4,
                                             steps_per_generation=4, phases={"generation": 0.7, "compute": 0.3}),
        "memory_pressure_swapping_mac": healthy(
            device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2, grad_accum=1, num_generations=2,
            max_completion_length=512, completion_mean=None, completion_max=None, completion_p90=None,
            clipped_ratio=None, seq_len=600, swap_growth_gb=6.0, swapout_steps=20, max_pressure=2,
            mem_high_water_gb=40.0, mem_budget_gb=38.0, driver_gb_max=40.0, allocated_gb_at_driver_max=24.0,
            watchdog_actions=[{"step": 4, "action": "clear_cache", "message": "cleared"}]),
        "memory_pressure_near_the_wall": healthy(max_pressure=1, min_steps_to_wall=8.0),
        "no_learning": healthy(logs=12, no_signal_run=12, reward_mean=0.8, temperature=0.7,
                               phases={"data_wait": 0.5, "compute": 0.5}),
        "constant_reward_cut": healthy(rewards=flat, logs=8, no_signal_run=8, clipped_ratio=0.9, completion_max=128.0,
                                       completion_p90=128.0, completion_mean=128.0),
        "completion_budget_note": healthy(device_type="mps", mfu=None, decode_bandwidth_util=None, micro_batch=2,
                                          grad_accum=1, num_generations=2, max_completion_length=512,
                                          completion_mean=60.0, completion_max=80.0, completion_p90=78.0,
                                          clipped_ratio=0.0),
        "warmup_on_a_mac": healthy(device_type="mps", first_step_slowdown=7.3, warmup_steps=10,
                                   warmup_overhead_sec=25.6, steady_step_sec=4.0, steady_tokens_per_sec=254.3,
                                   mfu=None, decode_bandwidth_util=None),
        "warmup_in_a_short_run": healthy(first_step_slowdown=7.3, warmup_steps=3, warmup_overhead_sec=25.6,
                                         steady_step_sec=4.0, steps=10),
        "small_micro_batch_two_devices": healthy(micro_batch=1, grad_accum=8, world_size=2, num_generations=4,
                                                 mfu=0.05),
        "oversubscription_launched": healthy(device_type="cpu", mfu=None, launcher=HF_PERF_TRAIN, machine=Machine(
            steps=12, busy=0.3, other=1.7, load=4.9, cores=2, cores_from="run header", threads=2,
            threads_from="run header", spread=1.9, cpu_spread=1.6, lower_bound=1.4)),
        "evaluation": healthy(evaluation=evaluation(), phases={"compute": 0.4, "eval": 0.6}),
        "nothing_found_no_rewards": healthy(rewards=None, logged=frozenset()),
        "too_short": healthy(device_type="cpu", mfu=None, micro_batch=2, grad_accum=4, num_generations=4,
                             pad_to_multiple_of=32, pad_fraction=0.45, seq_len=96, seq_len_mean=80.0,
                             phases={"generation": 0.6, "compute": 0.4}, steps=2, warmup_done=False, steady_steps=0,
                             warmup_steps=None, forwards_per_microbatch=2.0),
        # issue 51's cases: a slow reward, a compile and a recompile, a stand-in, the ranking by seconds
        "reward_share": healthy(wall_sec=400.0, reward_calls=200, reward_completions=64.0,
                                model_name="Qwen/Qwen2.5-3B-Instruct",
                                model_params=3_090_000_000, phase_sec={"reward": 120.0, "compute": 180.0},
                                rewards=Rewards(logs=40, min=0.2, max=1.4, std_max=0.5, zero_std_min=0.1,
                                                funcs={"format_reward": (0.0, 1.0), "judge_reward": (0.1, 0.9)})),
        "warmup_compile": healthy(device_type="cpu", mfu=0.08, mfu_basis="cpu_time", torch_compile=True,
                                  warmup_child_cpu_sec=23.8, first_step_slowdown=15.0, warmup_steps=2,
                                  warmup_overhead_sec=28.0, wall_sec=120.0, steady_step_sec=2.0,
                                  recompiles=[Recompile(60, 7.5, 0.95)]),
        "warmup_in_band": healthy(device_type="cpu", mfu=None, first_step_slowdown=1.04, warmup_steps=3,
                                  warmup_overhead_sec=0.2, warmup_in_band=True, warmup_tolerance=0.1),
        "stand_in": healthy(device_type="cpu", mfu=None, launcher=HF_PERF_TRAIN, activation_checkpointing=True,
                            recompute_clocked=True, wall_sec=100.0, phase_sec={"recompute": 20.0, "compute": 80.0},
                            mem_high_water_gb=1.0, mem_budget_gb=80.0, micro_batch=1, grad_accum=8, seq_len=64,
                            model_name="/root/.cache/hf_perf_callbacks/smollm2-135m-instruct",
                            model_params=134_515_008, max_completion_length=32, target=RecipeTarget(
                                "mac-16gb-qwen1.5b", "Apple Silicon, 16 GB of unified memory", "mps",
                                "Qwen/Qwen2.5-1.5B-Instruct", 128,
                                {"activation_checkpointing": True, "per_device_train_batch_size": 2})),
        "ranked_by_seconds": healthy(
            wall_sec=200.0, steps=200, training_logs=0, callback_sec={"SlowGenerate": {"on_step_end": 82.0}},
            phase_sec={"user_callbacks": 82.0, "compute": 90.0, "eval": 28.0}, saves=0,
            evaluation=Evaluation(evals=20, every=10, eval_sec=28.0, wall_sec=200.0, train_sec=172.0, steps=200,
                                  share=0.14), compute_metrics_sec=20.0,
            trainer_settings={"compute_metrics": True, "prediction_loss_only": False,
                              "preprocess_logits_for_metrics": False}),
    }


def test_the_rules_words_match_their_golden_file():
    """Each rule's words for the planted measurements of its unit tests (``perf_report.md`` and the console's top
    findings), compared exactly with ``tests/golden/rules.md``."""
    from hf_perf_callbacks.report import check, console_summary, render_markdown

    parts = []
    for name, m in _rule_scenarios().items():
        findings, notes = check(m)
        parts += [f"======== {name} ========", console_summary(findings, notes=notes), "",
                  render_markdown(findings, m, notes), ""]
    text = "\n".join(parts)
    path = os.path.join(GOLDEN, "rules.md")
    if os.environ.get("UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        golden = f.read()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True), "golden/rules.md",
                                        "rendered", n=2))
    assert not diff, f"a rule's words changed (UPDATE_GOLDEN=1 rewrites it after review):\n{diff}"


def test_every_finding_and_note_says_which_case_of_its_rule_it_is():
    """Each finding and note of the planted measurements carries a reason code of its own rule
    (``test_words.REASONS``), the case its words were chosen for."""
    from hf_perf_callbacks.report import check
    from tests.test_words import REASONS

    seen = set()
    for m in _rule_scenarios().values():
        findings, notes = check(m)
        for r in [*findings, *notes]:
            assert r.reason in REASONS[r.rule], (r.rule, r.reason)
            seen.add((r.rule, r.reason))
    assert len(seen) >= 20


def test_the_console_summary_keeps_every_word_within_the_console_width():
    """Every rule's console summary: no line wider than ``CONSOLE_WIDTH``, and each finding's observation whole
    (a long one goes on over indented lines; it used to be printed on one line of up to 473 characters)."""
    from hf_perf_callbacks.keys import CONSOLE_WIDTH
    from hf_perf_callbacks.report import check, console_summary

    long_ones = 0
    for name, m in _rule_scenarios().items():
        findings, notes = check(m)
        text = console_summary(findings, notes=notes)
        assert all(len(line) <= CONSOLE_WIDTH for line in text.splitlines()), name
        flat = " ".join(text.split())
        for f in findings[:3]:
            assert " ".join(f.observation.split()) in flat, (name, f.observation)
            long_ones += len(f"   seen: {f.observation}") > CONSOLE_WIDTH
    assert long_ones >= 5            # the scenarios hold observations wider than the console
