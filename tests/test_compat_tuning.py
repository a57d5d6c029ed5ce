"""The compatibility matrix, tuning table (``tests/compat.py``: :data:`~tests.compat.TUNING` × every trainer): what a
user does while the tuner switches splits on the run's own steps, each cell compared with the same run untuned.

The tuning is driven by planted step times (:class:`tests.test_tuner.PlantedStepTime`: far above the real step, so a
loaded machine cannot flip a decision): the run is configured at 2×2 (SGD with momentum, no gradient clipping), the
tuner measures it on steps 4-6 and asks for 4×1 at the end of step 6. Then, per row:

* ``stop`` — the user's callback stops the run at step 6; ``early_stopping`` — ``EarlyStoppingCallback`` does, in the
  evaluation of step 6: the run ends at step 6, as untuned, the tuning recorded as ended at 2×2;
* ``trial_oom_0`` / ``trial_oom_1`` — 4×1 runs out of memory (planted in the training forward), with
  ``max_resizes=0`` and ``1``: the trial is left and the run trains to its end; with ``1`` a real OOM at step 12 still
  gets its re-size (2×2 → 1×4);
* ``rotation`` — ``save_total_limit=1`` and the user's ``checkpoint-5``; the switch at step 6, the user stops the run
  at step 8, mid-trial: the user's checkpoint stays, as untuned, and ``args``, ``tuner_split.json`` and the decision
  say 2×2.

Every cell: the same end step, samples (GRPO: completions), RNG stream, learning rates, weights and optimizer state as
the untuned run (:func:`tests.faults.differences`). The outcome is recorded through :func:`tests.compat.record`
(column ``tuning``). All cells run under ``launch`` (two short trainings each).
"""
from __future__ import annotations

import os

import pytest
from transformers import EarlyStoppingCallback

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.resize import current_split
from tests import compat
from tests.compat import TUNING_CELLS, Cell, Setting
from tests.conftest import PlantedClock, varied_reward
from tests.faults import Fault, Trajectory, differences
from tests.test_compat_matrix import first_line
from tests.test_compat_resize import EXACT
from tests.test_tuner import CUDA_OOM, PlantedOOM, PlantedStepTime, StopAt

STEPS, PER_EPOCH = 12, 6
SWITCH_AT = 6                       # the tuner asks for 4×1 at the end of this step
TIMES = {4: 50.0, 2: 100.0, 1: 400.0}
SAVES = {"save_strategy": "steps", "save_steps": 5, "save_total_limit": 1}
EVALUATE = {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "loss"}


def build(cell: Cell, tokenizer, path, callbacks, extra: dict):
    setting = Setting(cell.setting.name, evaluate=cell.setting.key == "early_stopping")
    return compat.build(Cell(setting, cell.trainer), tokenizer, path, callbacks, steps=STEPS, per_epoch=PER_EPOCH,
                        extra={**EXACT, "gradient_accumulation_steps": 2, **extra}, reward=varied_reward)


def run(cell: Cell, tokenizer, path, tuned: bool):
    """One run of the cell, tuned (``train_with_tuning`` with the tuning on) or untuned (``trainer.train()``)."""
    key = cell.setting.key
    clock, trajectory = PlantedClock(), Trajectory()
    callbacks = [trajectory, PlantedStepTime(clock, TIMES)]
    tuner = AdaptiveBatchTuner(clock=clock, samples=3, must_pay=False, first_samples=3) if tuned else None
    extra: dict = {}
    if key == "stop":
        callbacks.append(StopAt(SWITCH_AT))
    elif key == "early_stopping":               # no evaluation counts as better: the 6th one ends patience 5
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=SWITCH_AT - 1, early_stopping_threshold=1e9))
        extra = EVALUATE
    elif key == "rotation":
        callbacks.append(StopAt(SWITCH_AT + 2))
        extra = SAVES
    planted = []
    if tuned and key.startswith("trial_oom"):   # 4×1 does not fit (DPO's forward holds chosen and rejected)
        planted.append(PlantedOOM(limit=4 if cell.trainer == "DPOTrainer" else 2, text=CUDA_OOM))
        if key == "trial_oom_1":
            planted.append(Fault("forward", at=12))     # the tuning over: at the configured split
    trainer = build(cell, tokenizer, path, planted + callbacks + ([tuner] if tuner else []), extra)
    trajectory.attach(trainer)
    for plant in planted:
        plant.attach(trainer)
    if tuned:
        train_with_tuning(trainer, max_resizes=1 if key == "trial_oom_1" else 0 if key == "trial_oom_0" else 8)
    else:
        trainer.train()
    return trainer, trajectory, tuner


def check(cell: Cell, tokenizer, tmp_path) -> list[str]:
    """What the tuned run did differently from the untuned one (empty: nothing)."""
    key = cell.setting.key
    tuned, got, tuner = run(cell, tokenizer, tmp_path / "tuned", True)
    plain, expected, _ = run(cell, tokenizer, tmp_path / "plain", False)
    found = differences(expected, got)
    if tuned.state.global_step != plain.state.global_step:
        found.append(f"ended at step {tuned.state.global_step} instead of {plain.state.global_step}")
    kinds = [d.kind for d in tuner.executor.record.decisions if not d.trial]       # the trials' OOMs are the tuning's
    wanted = ["tune", "oom"] if key == "trial_oom_1" else ["tune"]
    if kinds != wanted:
        found.append(f"decisions {kinds} instead of {wanted}")
    decision = next((d for d in tuner.executor.record.decisions if d.kind == "tune"), None)
    split = current_split(tuned.args)
    record = read_split_file(str(tmp_path / "tuned"))
    said = (decision.new if decision else None, record.split if record else None)
    if key != "trial_oom_1" and said != (split, split):
        found.append(f"args say {split}, the tuning's decision {said[0]} and the split file {said[1]}")
    if key in ("stop", "early_stopping", "rotation") and split != Split(2, 2, split.steps_per_generation):
        found.append(f"left at {split} instead of the configured 2×2")
    if key == "rotation":
        def checkpoints(path):
            return sorted(n for n in os.listdir(path) if n.startswith("checkpoint-"))

        if checkpoints(tmp_path / "tuned") != checkpoints(tmp_path / "plain"):
            found.append(f"checkpoints {checkpoints(tmp_path / 'tuned')} instead of "
                         f"{checkpoints(tmp_path / 'plain')}")
    return found


@pytest.mark.launch
@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id) for c in TUNING_CELLS])
def test_the_tuning_ends_where_and_trains_what_the_untuned_run_does(cell, tokenizer, tmp_path, one_thread):
    try:
        found = check(cell, tokenizer, tmp_path)
    except Exception as error:
        compat.record(cell, "tuning", f"no: {first_line(error)}")
        raise
    compat.record(cell, "tuning", "no: " + "; ".join(found) if found else "yes")
    assert found == []
