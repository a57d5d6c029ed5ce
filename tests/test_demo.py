"""``hf-perf demo``: model choice, the progress lines with real completions, and the tiny demo's trainer."""
import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_perf_callbacks import cli, demo
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
    progress.on_log(args, state, TrainerControl(), logs={"perf/step_time": 1.0})        # not a training log: silent
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step   7  reward 1.25 (format 0.25, valid_word 0.25, letters 0.25")
    assert "zero-std groups 50%" in out[0] and "ended at EOS: 21" in out[0] and "clipped 25%" in out[0]
    assert out[1].strip() == "[penny] <think>a</think><guess>crane</guess>" and len(out) == 2


def test_tiny_demo_trainer_uses_the_wordle_rewards(tmp_path):
    trainer = demo.build_demo_trainer(str(tmp_path), model="tiny", callbacks=[])
    assert [f.__name__ for f in trainer.reward_funcs] == [f.__name__ for f in REWARD_FUNCS]
    assert trainer.args.max_steps == demo.DEFAULT_STEPS["tiny"] and trainer.args.num_generations == 4
