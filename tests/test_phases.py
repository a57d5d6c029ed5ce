"""Every second of a run on a clock: real tiny Trainers with a planted cost in one phase (a costly callback, a slow
checkpoint save, recompute under gradient checkpointing, a last evaluation after the last step) give that phase's
finding, as data (rule ids, settings, gains); the same run without the cost gives none of them."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import Trainer, TrainerCallback

from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter, keys
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.rules import check
from tests.conftest import PlantedClock, make_trainer

PHASE_RULES = {"saving", "callbacks", "recompute"}
COST = 100.0                  # planted seconds: far above a tiny step on any machine, so no conclusion can flip


def findings(output_dir):
    m = measurements_from_run(str(output_dir))
    found, notes = check(m)
    return m, {f.rule: f for f in found}, {n.rule: n for n in notes}


class CostlyOnLog(TrainerCallback):
    """A user's callback whose ``on_log`` costs ``COST`` planted seconds (a ``model.generate`` at every log)."""

    def __init__(self, clock):
        self.clock = clock

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.clock.spend(COST)


def slow_save_trainer(clock):
    class SlowSave(Trainer):
        def save_model(self, *args, **kwargs):        # inside the checkpoint save
            clock.spend(COST)
            return super().save_model(*args, **kwargs)
    return SlowSave


def test_a_costly_on_log_is_the_callbacks_finding_not_data_wait(tokenizer, tmp_path):
    clock = PlantedClock()
    meter = ThroughputMeter(clock=clock, warmup_window=2, max_warmup_steps=2)
    make_trainer(tokenizer, tmp_path, [meter, CostlyOnLog(clock)], max_steps=8, bs=2, ga=1).train()
    m, found, _ = findings(tmp_path)
    assert m.phase_sec["user_callbacks"] >= 8 * COST and m.phase_sec["data_wait"] < 0.05 * m.wall_sec
    assert m.callback_sec["CostlyOnLog"]["on_log"] >= 8 * COST
    assert "input_bound" not in found and "contention" not in found
    f = found["callbacks"]
    assert f.setting["logging_steps"] > 1 and f.basis == "measured"
    # the gain: the run's own wall time without the on_log seconds the new interval removes; transformers still logs
    # at each multiple of it and once after training (the run's metrics): 8 training logs and that one now
    new = f.setting["logging_steps"]
    on_log = m.callback_sec["CostlyOnLog"]["on_log"] + m.phase_sec["log"]
    assert m.callback_sec["CostlyOnLog"]["on_log"] == pytest.approx(9 * COST, rel=0.01)
    after = 8 // new + 1
    assert f.facts.interval.events_after == after
    assert f.expected_gain == pytest.approx(m.wall_sec / (m.wall_sec - on_log / 9 * (9 - after)))


def test_a_callback_costly_every_step_is_named_without_a_setting(tokenizer, tmp_path):
    clock = PlantedClock()

    class CostlyStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.spend(COST)

    make_trainer(tokenizer, tmp_path, [ThroughputMeter(clock=clock), CostlyStepEnd()], max_steps=6, bs=2,
                 ga=1).train()
    _, found, _ = findings(tmp_path)
    f = found["callbacks"]
    assert "CostlyStepEnd" in f.title and f.setting == {} and f.expected_gain is None
    assert "input_bound" not in found


def test_save_steps_1_is_the_saving_finding_and_not_contention(tokenizer, tmp_path):
    clock = PlantedClock()
    make_trainer(tokenizer, tmp_path, [ThroughputMeter(clock=clock)], max_steps=8, bs=2, ga=1,
                 trainer_cls=slow_save_trainer(clock),
                 extra={"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1}).train()
    m, found, _ = findings(tmp_path)
    assert m.saves == 8 and m.phase_sec["save"] >= 8 * COST           # the last save (after step 8) counted too
    run = read_run(str(tmp_path))
    assert run.summary("perf")["tail_phase_sec"]["save"] >= COST
    f = found["saving"]
    assert f.setting["save_strategy"] == "steps" and f.setting["save_steps"] > 1 and f.basis == "measured"
    new, save, wall = f.setting["save_steps"], m.phase_sec["save"], m.wall_sec
    after = 8 // new + (8 % new != 0)              # at each multiple, and once more at the end of training
    assert f.facts.interval.events_after == after
    assert f.expected_gain == pytest.approx(wall / (wall - save / 8 * (8 - after)))
    assert "contention" not in found and "input_bound" not in found and "callbacks" not in found


def test_recompute_nobody_needs_is_found_where_memory_allows(tokenizer, tmp_path):
    """Gradient checkpointing on (TRL's SFT and GRPO configs' default) on a CPU with memory to spare: the recompute
    is clocked (a planted cost inside every checkpointed layer's MLP) and turning it off is advised; the same
    measurements with a budget the activations would not fit give a note instead."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from hf_perf_callbacks.tiny import build_model

    clock = PlantedClock(wall_only_planted=True)        # the phases below are planted seconds, checked exactly
    model = build_model(tokenizer)
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):     # inside the MLP: in its forward and its recompute
            layer.mlp.gate_proj.register_forward_pre_hook(lambda *_: clock.spend(COST))
    make_trainer(tokenizer, tmp_path, [ThroughputMeter(clock=clock), MemoryWatchdog(clock=clock)], max_steps=6,
                 bs=2, ga=1, model=model, extra={"activation_checkpointing": True}).train()
    m, found, _ = findings(tmp_path)
    assert m.activation_checkpointing and m.recompute_clocked
    # each checkpointed layer's forward ran again in the backward: its planted cost once more, as recompute
    assert m.phase_sec["recompute"] == pytest.approx(6 * 2 * COST)
    assert m.phase_sec["compute"] == pytest.approx(6 * 2 * COST)
    f = found["recompute"]
    assert f.setting == {"activation_checkpointing": False} and f.basis == "measured"
    assert f.expected_gain == pytest.approx(m.wall_sec / (m.wall_sec - m.phase_sec["recompute"]))
    short = dataclasses.replace(m, mem_budget_gb=m.mem_high_water_gb)
    _, notes = check(short)
    assert "recompute" not in {x.rule for x in check(short)[0]} and any(n.rule == "recompute" for n in notes)


def test_a_run_without_these_costs_gets_none_of_their_findings(tokenizer, tmp_path):
    make_trainer(tokenizer, tmp_path, [ThroughputMeter()], max_steps=8, bs=2, ga=1).train()
    m, found, notes = findings(tmp_path)
    assert not PHASE_RULES & set(found) and not PHASE_RULES & set(notes)
    assert m.saves == 0 and m.callback_sec == {}


def test_the_last_evaluation_is_in_the_perf_log(tokenizer, tmp_path):
    clock = PlantedClock()

    class SlowEval(Trainer):
        def evaluate(self, *args, **kwargs):
            clock.spend(COST)
            return super().evaluate(*args, **kwargs)

    meter = ThroughputMeter(clock=clock)
    make_trainer(tokenizer, tmp_path, [meter], max_steps=6, bs=2, ga=1, with_eval=True, trainer_cls=SlowEval,
                 extra={"eval_strategy": "steps", "eval_steps": 2}).train()
    m, found, _ = findings(tmp_path)
    assert m.evaluation is not None and m.evaluation.evals == 3            # after steps 2, 4 and 6 (the last)
    assert m.evaluation.every == 2 and m.phase_sec["eval"] >= 3 * COST
    assert found["evaluation"].setting["eval_steps"] > 2
    lines = [s for s in read_run(str(tmp_path)).unique_steps()]
    total = sum(s.number(keys.PERF_STEP_WALL_SEC) or 0.0 for s in lines)
    assert m.wall_sec == pytest.approx(total + sum(meter.summary["tail_phase_sec"].values()))
