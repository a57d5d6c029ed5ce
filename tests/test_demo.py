"""``hf-perf demo``: model choice, the progress lines with real completions, and the tiny demo's trainer."""
import os

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_perf_callbacks import cli, demo, keys
from hf_perf_callbacks.tasks.wordle import REWARD_FUNCS, format_reward


@pytest.mark.parametrize(("argv", "expected"), [
    ([], {"model": "real", "max_steps": None}),
    (["--model", "tiny"], {"model": "tiny", "max_steps": None}),
    (["--model", "tiny", "--max_steps", "3"], {"model": "tiny", "max_steps": 3}),
])
def test_demo_flags_reach_run_demo(monkeypatch, tmp_path, argv, expected):
    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda output_dir, **kwargs: seen.update(kwargs, output_dir=output_dir))
    assert cli.main(["demo", "--output_dir", str(tmp_path), *argv]) == 0
    assert seen == {**expected, "output_dir": str(tmp_path)}


def test_unknown_demo_model_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--model", "huge"])
    assert exit_.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model='huge' is not allowed: expected one of 'real', 'tiny'"):
        demo.build_demo_trainer("unused", model="huge")


def test_sampler_keeps_the_latest_completions_and_the_reward(tmp_path, capsys):
    sampler = demo.CompletionSampler(format_reward)
    completions = [[{"role": "assistant", "content": "<think>a</think><guess>crane</guess>"}],
                   [{"role": "assistant", "content": "The word is\n   POLAR."}]]
    rewards = sampler(["p", "p"], completions, completion_ids=None, secret=["penny", "penny"])
    assert sampler.__name__ == "format_reward"
    assert rewards == format_reward(["p", "p"], completions) == [1.0, 0.0]
    assert sampler.latest == [("penny", "<think>a</think><guess>crane</guess>"), ("penny", "The word is\n   POLAR.")]

    progress = demo._progress_callback(sampler, shown=1)
    logs = {"reward": 1.25, "frac_reward_zero_std": 0.5, "completions/mean_length": 30.0,
            "completions/mean_terminated_length": 21.0, "completions/clipped_ratio": 0.25,
            **{f"rewards/{f.__name__}/mean": 0.25 for f in REWARD_FUNCS}}
    state = TrainerState()
    state.global_step = 7
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    progress.on_log(args, state, TrainerControl(), logs=logs)
    progress.on_log(args, state, TrainerControl(), logs={keys.PERF_STEP_TIME: 1.0})        # not a training log: silent
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step   7  reward 1.25 (format 0.25, valid_word 0.25, letters 0.25")
    assert "zero-std groups 50%" in out[0] and "(mean of those that ended at EOS: 21)" in out[0]
    assert "clipped 25%" in out[0]
    assert out[1].strip() == "[penny] <think>a</think><guess>crane</guess>" and len(out) == 2


def test_tiny_demo_trainer_uses_the_wordle_rewards(tmp_path):
    trainer = demo.build_demo_trainer(str(tmp_path), model="tiny", callbacks=[])
    assert [f.__name__ for f in trainer.reward_funcs] == [f.__name__ for f in REWARD_FUNCS]
    assert trainer.args.max_steps == demo.DEFAULT_STEPS["tiny"] and trainer.args.num_generations == 4


@pytest.mark.parametrize(("threads", "other", "cores", "expected"), [
    (2, 0.0, 2, 2),        # an idle 2-core machine: torch's default stays
    (2, 0.4, 2, 2),        # 2.4 asked of 2 cores: within the rule's margin (OVERSUBSCRIBED)
    (2, 1.3, 2, 1),        # 3.3 asked of 2 cores: the one core the others leave free
    (2, 3.5, 2, 1),        # a saturated machine: at least one thread
    (8, 3.0, 8, 5),        # 11 of 8: the five free cores
    (1, 1.5, 2, 1),        # already at one thread
])
def test_the_demo_chooses_its_threads_by_the_analysis_rule(threads, other, cores, expected, monkeypatch):
    import torch

    from hf_perf_callbacks.report.rules.machine import OVERSUBSCRIBED, free_cores, oversubscribed

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(threads)
        monkeypatch.setattr(demo, "other_busy_cores", lambda: other)
        monkeypatch.setattr(demo.os, "cpu_count", lambda: cores)
        demo.set_threads()
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
    assert (expected < threads) == (oversubscribed(threads, other, cores) and free_cores(cores, other) < threads)
    assert oversubscribed(2, 1.3, 2) and not oversubscribed(2, OVERSUBSCRIBED - 0.01, 2)


def test_the_demo_sets_its_threads_and_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    """A planted reading of other processes' load (never this machine's): the demo's first line says the thread
    count it took and why, before the trainer is built; OMP_NUM_THREADS set by the user is kept."""
    import torch

    class Built(Exception):
        pass

    def stop(*args, **kwargs):
        raise Built

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "other_busy_cores", lambda: 1.3)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo, "build_demo_trainer", stop)
    try:
        torch.set_num_threads(2)
        with pytest.raises(Built):
            demo.run_demo(str(tmp_path), model="tiny")
        assert capsys.readouterr().out.splitlines() == ["torch on 1 thread: 2 cores, 1.3 busy with other work"]
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(demo, "other_busy_cores", lambda: 0.2)
        assert demo.set_threads() == "torch on 2 threads: 2 cores, 0.2 busy with other work"
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert demo.set_threads() == "torch on 2 threads: OMP_NUM_THREADS=2"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_other_busy_cores_reads_the_machine_less_this_process(monkeypatch):
    """The reading itself, on planted psutil counters: 3 busy CPU seconds of the machine over a 2-second window, of
    which 0.5 are this process's own, are 1.25 cores of other work."""
    import psutil

    class Times:
        def __init__(self, busy):
            self.user, self.system, self.idle = busy, 0.0, 100.0

        def __iter__(self):
            return iter((self.user, self.system, self.idle))

    readings = iter([Times(10.0), Times(13.0)])
    clock, own = iter([0.0, 2.0]), iter([1.0, 1.5])
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(readings))
    monkeypatch.setattr(demo.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(demo.time, "process_time", lambda: next(own))
    monkeypatch.setattr(demo.time, "sleep", lambda seconds: None)
    assert demo.other_busy_cores(2.0) == pytest.approx(1.25)


def test_the_demo_says_each_figure_once_and_no_upstream_deprecation(monkeypatch, tmp_path, capsys, recwarn):
    """A real tiny demo: the callbacks' summaries once, the report after them without its own summary (the same
    figures), the plots and the analysis; none of transformers' checkpointing deprecations TRL and peft call."""
    import torch

    from hf_perf_callbacks import report

    reports, original = [], report.report_command

    def report_command(output_dir, **kwargs):
        reports.append((output_dir, kwargs))
        return original(output_dir, **kwargs)

    threads = torch.get_num_threads()
    monkeypatch.setattr(demo, "other_busy_cores", lambda: 0.0)
    monkeypatch.setattr(report, "report_command", report_command)
    try:
        demo.run_demo(str(tmp_path), max_steps=6, model="tiny")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert reports == [(str(tmp_path), {"summary": False})]            # the report, without its summary
    assert out.count("tokens/s:") == 1 and out.count("MFU") == 1        # the steady figures said once
    assert os.path.exists(os.path.join(tmp_path, "perf_report.md"))
    assert not [w for w in recwarn if "gradient_checkpointing" in str(w.message)]
