"""The analysis on real CPU runs: a GRPO run whose completions end far before max_completion_length gets the
completion-budget finding; a plain Trainer behind a slow dataset gets the input-bound finding."""
import torch

from hf_perf_callbacks import ThroughputMeter, default_callbacks
from hf_perf_callbacks.analysis import analyze, measurements_from_run, write_perf_report
from hf_perf_callbacks.runlog import read_run
from hf_perf_callbacks.tiny import build_model
from tests.conftest import PlantedClock, make_grpo, make_trainer


def test_short_completions_yield_the_completion_budget_finding(tokenizer, tmp_path):
    model = build_model(tokenizer)
    eos = tokenizer.eos_token_id

    def favour_eos(module, inputs, logits):    # EOS becomes likely: completions end after a few tokens
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[eos] = 6.0
        return logits + bias

    model.lm_head.register_forward_hook(favour_eos)
    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"probe": False}), max_steps=6,
                        completion=64, model=model)
    trainer.train()
    trainer.save_state()
    m = measurements_from_run(str(tmp_path))
    assert m.max_completion_length == 64 and m.completion_max is not None and m.completion_max < 16
    findings = {f.rule: f for f in analyze(m)}
    budget = findings["completion_budget"]
    assert "max_completion_length" in budget.recommendation
    path, _ = write_perf_report(read_run(tmp_path))
    assert "max_completion_length" in open(path).read()


def test_slow_dataset_yields_the_input_bound_finding(tokenizer, tmp_path):
    clock = PlantedClock()                 # each example costs 1 planted second: far above any real step time
    callbacks = default_callbacks(AdaptiveBatchTuner={"probe": False})
    next(c for c in callbacks if isinstance(c, ThroughputMeter)).clock = clock
    trainer = make_trainer(tokenizer, tmp_path, callbacks, max_steps=8, delay=1.0, clock=clock)
    trainer.train()
    trainer.save_state()
    findings = {f.rule: f for f in analyze(measurements_from_run(str(tmp_path)))}
    assert "input_bound" in findings
    assert "dataloader_num_workers" in findings["input_bound"].recommendation
    assert findings["input_bound"].expected_gain > 1.4
