"""The analysis on real CPU runs: short completions (a note, not a finding), a slow dataset (input-bound), and a
GRPO run that cannot learn (every reward 0) with the MPS-only ``pad_to_multiple_of`` on a CPU."""
import torch

from hf_perf_callbacks import ThroughputMeter, default_callbacks
from hf_perf_callbacks.analysis import check, measurements_from_run, write_analysis
from hf_perf_callbacks.runlog import read_run
from hf_perf_callbacks.tiny import build_model
from tests.conftest import PlantedClock, make_grpo, make_trainer


def test_short_completions_are_a_note_with_the_cap(tokenizer, tmp_path):
    model = build_model(tokenizer)
    eos = tokenizer.eos_token_id

    def favour_eos(module, inputs, logits):    # EOS becomes likely: completions end after a few tokens
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[eos] = 6.0
        return logits + bias

    model.lm_head.register_forward_hook(favour_eos)
    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=6,
                        completion=64, model=model)
    trainer.train()
    trainer.save_state()
    m = measurements_from_run(str(tmp_path))
    assert m.max_completion_length == 64 and m.completion_max is not None and m.completion_max < 16
    findings, notes = check(m)
    assert "completion_budget" not in [f.rule for f in findings]         # no completion reached the limit
    assert "`max_completion_length: " in {n.rule: n for n in notes}["completion_budget"].text
    path, _, _ = write_analysis(read_run(tmp_path))
    text = open(path).read()
    assert "## Checked and fine" in text and "max_completion_length" in text.split("## Checked and fine")[1]


def test_slow_dataset_yields_the_input_bound_finding(tokenizer, tmp_path):
    # each example costs 1 planted second, far above any real step time; warmup (decided on CPU time on a CPU
    # device, which a loaded machine makes noisy) is capped at 2 steps: this test is about data wait, not warmup
    clock = PlantedClock()
    callbacks = default_callbacks(AdaptiveBatchTuner={"tune": False}, ThroughputMeter={"clock": clock, "max_warmup_steps": 2})
    trainer = make_trainer(tokenizer, tmp_path, callbacks, max_steps=8, delay=1.0, clock=clock)
    trainer.train()
    trainer.save_state()
    findings = {f.rule: f for f in check(measurements_from_run(str(tmp_path)))[0]}
    f = findings["input_bound"]
    assert f.setting["dataloader_num_workers"] == 2 and f.predicted_gain > 1.4


def test_a_run_that_cannot_learn_is_the_first_finding(tokenizer, tmp_path):
    # seen: every reward 0 for 12 steps (frac_reward_zero_std 1, loss and grad norm 0) reported as "Healthy run";
    # the recipe's MPS-only pad_to_multiple_of 32 on a CPU is named as the padding's cause
    def zero_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=4,
                        bs=2, ga=2, num_generations=2, reward=zero_reward, extra={"pad_to_multiple_of": 32})
    trainer.train()
    trainer.save_state()
    m = measurements_from_run(str(tmp_path))
    assert m.pad_to_multiple_of == 32 and m.steps_per_generation == 2 and m.no_signal_run == 4
    findings, _ = check(m)
    assert findings[0].rule == "no_learning"
    assert findings[0].setting["num_generations"] == 4
    padding = {f.rule: f for f in findings}["padding_waste"]
    assert padding.setting == {"pad_to_multiple_of": None} and "MPS" in padding.root_cause
    path, _, _ = write_analysis(read_run(tmp_path))
    text = open(path).read()
    assert "Healthy" not in text and "## 1. The run cannot learn" in text
