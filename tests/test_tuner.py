"""AdaptiveBatchTuner and train_with_tuning on real trainers (CPU, tiny random Llama + LoRA).

Out-of-memory errors are planted with a forward pre-hook that raises the exact CUDA or MPS error text once the
micro-batch exceeds a size (the way Composer tests its OOM handling); the MPS device is a fake of the documented
``torch.mps`` readings (no Apple GPU here).
"""
import json
import os

import pytest
import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, train_with_tuning
from hf_perf_callbacks.device import GB, MemorySample
from hf_perf_callbacks.resize import saved_split
from hf_perf_callbacks.throughput import forward_entry
from tests.conftest import make_grpo, make_trainer
from tests.test_watchdog import FakeMPS

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"
MPS_OOM = "MPS backend out of memory (MPS allocated: 17.80 GB, other allocations: 1.20 GB, max allowed: 18.13 GB)"


class PlantedOOM(TrainerCallback):
    """Raises an OOM from the forward pass of micro-batches larger than ``limit`` once ``armed_at`` steps ran
    (hooked on the model when :meth:`attach` is called, so the probe meets it too): the training forward, its
    backward (``in_backward``) or the no-grad forwards of generation (``in_generation``); ``once``: one OOM only."""

    def __init__(self, limit, text, armed_at=0, in_backward=False, in_generation=False, once=False):
        self.limit, self.text, self.armed_at, self.raised, self.step = limit, text, armed_at, 0, 0
        self.in_backward, self.in_generation, self.once = in_backward, in_generation, once

    def attach(self, trainer):
        model = trainer.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        if self.in_backward:                           # raise while gradients flow back through the first layer
            inner.model.layers[0].register_full_backward_hook(
                lambda module, grad_in, grad_out: self.fire(grad_out[0].shape[0]))
        else:
            # the decoder stack: peft before 0.21 calls the causal LM's forward() directly, skipping its hooks
            forward_entry(inner).register_forward_pre_hook(self.check, with_kwargs=True)
        return trainer

    def fire(self, batch):
        if self.step >= self.armed_at and batch > self.limit and not (self.once and self.raised):
            self.raised += 1
            raise torch.OutOfMemoryError(self.text) if self.text == CUDA_OOM else RuntimeError(self.text)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def check(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() is not self.in_generation:
            self.fire(ids.shape[0])


def step_lines(output_dir):
    return [json.loads(line) for line in open(os.path.join(output_dir, "perf_log.jsonl"))
            if json.loads(line)["type"] == "step"]


@pytest.mark.parametrize("text", [CUDA_OOM, MPS_OOM], ids=["cuda-text", "mps-text"])
def test_grpo_oom_mid_run_resizes_and_reaches_max_steps(tokenizer, tmp_path, text):
    plant = PlantedOOM(limit=2, text=text, armed_at=3)
    tuner = AdaptiveBatchTuner(probe=False)
    trainer = plant.attach(make_grpo(tokenizer, tmp_path, [plant, ThroughputMeter(), tuner], max_steps=7, bs=4,
                                     ga=2))
    train_with_tuning(trainer)
    assert trainer.state.global_step == 7 and plant.raised == 1
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8       # effective batch kept
    assert args.generation_batch_size == 8 and args.steps_per_generation == 4              # generation batch kept
    decision = tuner.decisions[-1]
    assert decision["kind"] == "oom" and decision["step"] == 3 and decision["checkpoint"].endswith("checkpoint-3")
    assert (decision["old"]["micro_batch"], decision["new"]["micro_batch"]) == (4, 2)
    assert decision["recovery_sec"] < 30
    steps = [s["step"] for s in step_lines(tmp_path)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]                           # no optimizer step lost or repeated
    assert [s["tuner/micro_batch"] for s in step_lines(tmp_path)] == [4, 4, 4, 2, 2, 2, 2]
    print(f"\n[{text[:4]}] 4×2 → 2×4 after an OOM at step 4; next step after {decision['recovery_sec']:.2f} s")


def test_plain_trainer_oom_at_the_first_step_restarts_at_a_smaller_split(tokenizer, tmp_path):
    plant = PlantedOOM(limit=1, text=MPS_OOM)
    tuner = AdaptiveBatchTuner(probe=False)
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, [plant, tuner], max_steps=4, bs=4, ga=2))
    train_with_tuning(trainer)
    assert trainer.state.global_step == 4
    assert [(d["old"]["micro_batch"], d["new"]["micro_batch"]) for d in tuner.decisions] == [(4, 2), (2, 1)]
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (1, 8)


def test_no_smaller_split_raises_a_clear_error(tokenizer, tmp_path):
    plant = PlantedOOM(limit=0, text=CUDA_OOM)
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, [plant, AdaptiveBatchTuner(probe=False)], max_steps=2,
                                        bs=2, ga=1))
    with pytest.raises(ValueError, match="no exact split smaller than 1×2"):
        train_with_tuning(trainer)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_probe_picks_a_fitting_split_and_leaves_the_trajectory_unchanged(tokenizer, tmp_path):
    plant = PlantedOOM(limit=2, text=CUDA_OOM)
    tuner = AdaptiveBatchTuner(probe_steps=1)
    probed = plant.attach(make_trainer(tokenizer, tmp_path / "probed", [plant, tuner], max_steps=3, bs=8, ga=1))
    train_with_tuning(probed)
    probe = tuner.decisions[0]
    assert probe["kind"] == "probe"
    tried = {t["split"]["micro_batch"]: t for t in probe["trials"]}
    assert "out of memory" in tried[8]["error"] and "out of memory" in tried[4]["error"]
    assert tried[2]["fits"]
    chosen = probe["new"]
    assert chosen["micro_batch"] <= 2 and chosen["micro_batch"] * chosen["grad_accum"] == 8
    # the same split from the start, without a probe: identical losses (weights, RNG, data untouched)
    plain = make_trainer(tokenizer, tmp_path / "plain", [], max_steps=3, bs=chosen["micro_batch"],
                         ga=chosen["grad_accum"])
    plain.train()
    assert losses(probed) == pytest.approx(losses(plain), rel=1e-6)
    print(f"\nprobe: {probe['reason']}")


def test_grpo_probe_keeps_the_generation_batch_and_forces_long_completions(tokenizer, tmp_path):
    tuner = AdaptiveBatchTuner(probe_steps=1)
    trainer = make_grpo(tokenizer, tmp_path, [tuner], max_steps=2, bs=4, ga=2, completion=10)
    config = trainer.generation_config
    train_with_tuning(trainer)
    assert config.min_new_tokens is None                              # restored after the probe
    assert trainer.args.generation_batch_size == 8
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 8
    assert len(tuner.decisions[0]["trials"]) >= 2 and trainer.state.global_step == 2


class MemoryByBatch(FakeMPS):
    """Driver memory grows with the micro-batch: 2 GB per sample (a fake MPS reading)."""

    def __init__(self, trainer_args):
        super().__init__(driver_gb=[0.0])
        self.args = trainer_args

    def memory(self):
        driver = 2.0 * self.args.per_device_train_batch_size
        return MemorySample(allocated=int(driver * GB), reserved=int(driver * GB), device_limit=int(64 * GB),
                            system_total=int(64 * GB), system_available=int(32 * GB))


def test_watchdog_request_resizes_through_train_with_tuning(tokenizer, tmp_path):
    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(probe=False)
    trainer = make_trainer(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2)
    watchdog.device = MemoryByBatch(trainer.args)
    train_with_tuning(trainer)
    assert trainer.state.global_step == 5
    assert [(d["kind"], d["step"]) for d in tuner.decisions] == [("watchdog", 2)]
    assert [a["action"] for a in watchdog.actions] == ["clear_cache", "smaller_batch"]
    assert trainer.args.per_device_train_batch_size == 2 and trainer.args.gradient_accumulation_steps == 4
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4, 5]


def test_without_train_with_tuning_it_saves_stops_and_records_the_split(tokenizer, tmp_path, capsys):
    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(probe=False)
    trainer = make_trainer(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2)
    watchdog.device = MemoryByBatch(trainer.args)
    trainer.train()
    assert trainer.state.global_step == 2 and os.path.isdir(tmp_path / "checkpoint-2")
    out = capsys.readouterr().out
    assert "per_device_train_batch_size=2, gradient_accumulation_steps=4" in out
    assert "resume_from_checkpoint=" in out
    assert saved_split(str(tmp_path)) == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}

    # a later process resumes at the tuned split, with the decision history
    tuner2 = AdaptiveBatchTuner(probe=False)
    resumed = make_trainer(tokenizer, tmp_path, [MemoryWatchdog(limit_gb=7.0), tuner2], max_steps=4, bs=4, ga=2)
    train_with_tuning(resumed, resume_from_checkpoint="last")
    assert resumed.args.per_device_train_batch_size == 2 and resumed.state.global_step == 4
    assert [d["kind"] for d in tuner2.decisions] == ["watchdog"]
    assert [s["tuner/micro_batch"] for s in step_lines(tmp_path) if s["step"] > 2] == [2, 2]


@pytest.mark.parametrize("bad", [{"probe": "yes"}, {"probe_steps": 0}, {"max_micro_batch": 0},
                                 {"probe_patience": 0}, {"rank_by": "speed"}])
def test_tuner_parameters_are_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AdaptiveBatchTuner(**bad)


def test_train_with_tuning_and_default_callbacks_validate(tokenizer, tmp_path):
    from hf_perf_callbacks import default_callbacks

    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    with pytest.raises(ValueError, match="max_resizes=-1"):
        train_with_tuning(trainer, max_resizes=-1)
    with pytest.raises(ValueError, match="probe='yes'"):
        train_with_tuning(trainer, probe="yes")
    with pytest.raises(ValueError, match="ThroughputMeter=5"):
        default_callbacks(ThroughputMeter=5)
    with pytest.raises(ValueError, match="Unknown"):
        default_callbacks(Unknown={})
