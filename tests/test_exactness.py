"""Exactness at the moment of change (hf_perf_callbacks/resize/exactness.py, executor.py, watch.py).

Every change of split is checked at the optimizer step it starts with, on the rows that step trains, at that step's
model state, before it trains; a change that trains other gradients is refused before anything changes, with a
complete checkpoint and a true reason; an unmeasured one is never used (unless the run accepts it); and with no
change, train_with_tuning leaves no trace: it trains what trainer.train() trains, bit for bit.

Every comparison is against the same run unfaulted (SGD with momentum, a linear schedule, no clipping: clipping
would hide a loss that depends on the split) or against plain ``trainer.train()``.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.sketch import LOSS, RTOL, WIDTH, compare, rtol_for, sketch
from hf_perf_callbacks.core.splitfile import ExactnessCheck, SplitFile, read_split_file
from hf_perf_callbacks.resize.checkpoints import is_complete
from hf_perf_callbacks.resize.plan import InexactResize, Refused
from hf_perf_callbacks.tiny import build_model
from tests.conftest import PlantedClock, TextDataset, padded
from tests.faults import Fault, Trajectory, differences
from tests.test_tuner import PlantedStepTime

SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.02, "lr_scheduler_type": "linear",
       "max_grad_norm": 0.0}


# ------------------------------------------------------------ the sketch and the record (pure)
def _grads(scale: float = 1.0, extra: float = 0.0):
    torch.manual_seed(0)
    big = torch.randn(70_000)                       # more than one block
    small = torch.randn(3, 5)
    return [("big", big * scale), ("small", small + extra), ("none", None)]


def test_the_same_gradients_sketch_the_same_and_a_changed_parameter_is_named():
    reference = sketch(_grads(), loss=2.0)
    assert reference.projections.shape == (3, WIDTH) and reference.nbytes == 3 * WIDTH * 8
    assert compare(reference, reference, sketch(_grads(), loss=2.0), RTOL[torch.float32]).same
    assert compare(reference, reference, sketch(_grads(scale=1 + 1e-7), loss=2.0), RTOL[torch.float32]).same
    moved = compare(reference, reference, sketch(_grads(extra=1e-2), loss=2.0), RTOL[torch.float32])
    assert not moved.same and moved.where == "small" and moved.relative > moved.tolerance


def test_noise_of_the_repeated_grouping_widens_the_tolerance_and_the_loss_is_compared():
    reference = sketch(_grads(), loss=2.0)
    assert compare(reference, sketch(_grads(extra=5e-3), loss=2.0), sketch(_grads(extra=1e-2), loss=2.0),
                   RTOL[torch.float32]).same                                         # within 8× the noise
    loss_only = compare(reference, reference, sketch(_grads(), loss=2.5), RTOL[torch.float32])
    assert not loss_only.same and loss_only.where == LOSS
    with pytest.raises(ValueError, match="different parameters"):
        compare(sketch(_grads(), 1.0), sketch(_grads(), 1.0), sketch(_grads()[:2], 1.0), 1e-4)
    assert rtol_for(torch.bfloat16) > rtol_for(torch.float16) > rtol_for(torch.float32) > rtol_for(torch.float64)


def test_every_check_is_recorded_in_the_split_file_and_read_back():
    check = ExactnessCheck(step=5, kind="oom", old=Split(4, 2), new=Split(2, 4), verdict="inexact",
                           why="lm_head.weight differs", against="old", rows=4, passes=3, cost_sec=0.5,
                           sketch_bytes=2016, drew_rng=True)
    record = SplitFile(session="s", world_size=1, configured=Split(4, 2), split=Split(4, 2), checks=[check])
    assert SplitFile.from_json(record.to_json()).checks == [check]
    with pytest.raises(ValueError, match="verdict"):
        ExactnessCheck.from_json({**check.to_json(), "verdict": "maybe"})


# ------------------------------------------------------------ runs
class WarmingAuxLoss(Trainer):
    """A user's loss: the library's (num_items_in_batch passed on) plus a per-micro-batch z-loss whose weight warms up
    with ``state.global_step``: 0 at the first step, so only a check at a later step can see it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        weight = 0.05 * self.state.global_step
        loss = loss + weight * torch.logsumexp(outputs.logits, dim=-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def micro_batch_mean(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func that names num_items_in_batch but divides by the micro-batch's own tokens."""
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    own = (targets != -100).sum()
    return total / own if num_items_in_batch is not None else total / own       # it reads the name, no more


def weights_over_padded_length(outputs, labels, num_items_in_batch=None):
    """Token weights spread over the micro-batch's padded length, summed over the step's label tokens."""
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="none").view(targets.shape)
    return (each * torch.linspace(0.5, 1.5, each.shape[-1])).sum() / num_items_in_batch


class FirstRowsAlike(torch.utils.data.Dataset):
    """The first ``alike`` rows share one length (a per-micro-batch mean looks exact on them); later rows vary."""

    def __init__(self, tokenizer, n=64, alike=16):
        varied = TextDataset(tokenizer, n=n)
        same = TextDataset(tokenizer, n=alike, length=12)
        self.items = same.items + varied.items[alike:]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def build(tokenizer, out, callbacks, *, steps=6, bs=4, ga=2, extra=None, trainer_cls=Trainer, dataset=None,
          model=None, collator=None, padding_side="right", eval_dataset=None):
    settings = dict(output_dir=str(out), per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                    max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                    disable_tqdm=True, seed=0, dataloader_num_workers=0, **SGD)
    settings.update(extra or {})
    torch.manual_seed(0)
    return trainer_cls(model=model or build_model(tokenizer), args=TrainingArguments(**settings),
                       train_dataset=dataset if dataset is not None else TextDataset(tokenizer),
                       data_collator=collator or DataCollatorForLanguageModeling(padded(tokenizer, padding_side),
                                                                                  mlm=False),
                       eval_dataset=eval_dataset, callbacks=callbacks)


def run(tokenizer, out, *, tuned=True, fault=None, tuner=None, more=(), **kw):
    """A run recorded by a Trajectory: through train_with_tuning (``tuned``) or plain ``trainer.train()``."""
    trajectory = Trajectory()
    tuner = tuner if tuner is not None else AdaptiveBatchTuner(tune=False)
    callbacks = [trajectory, *more, *([fault] if fault else []), *([tuner] if tuned else [])]
    trainer = build(tokenizer, out, callbacks, **kw)
    trajectory.attach(trainer)
    if fault is not None:
        fault.attach(trainer)
    train_with_tuning(trainer) if tuned else trainer.train()
    return trainer, trajectory, tuner


def refused_run(tokenizer, out, **kw):
    """A faulted run that must end refused: the error, the tuner and the trajectory so far."""
    trajectory, tuner = Trajectory(), AdaptiveBatchTuner(tune=False)
    fault = kw.pop("fault")
    trainer = build(tokenizer, out, [trajectory, fault, tuner], **kw)
    trajectory.attach(trainer)
    fault.attach(trainer)
    with pytest.raises(InexactResize) as refused:
        train_with_tuning(trainer)
    return refused.value, tuner, trainer


def checks(out) -> list[ExactnessCheck]:
    record = read_split_file(str(out))
    return record.checks if record is not None else []


# ------------------------------------------------------------ checked at the moment of change, on that step's rows
def test_a_resize_of_the_plain_loss_is_checked_on_its_steps_rows_and_trains_the_unfaulted_run(tokenizer, tmp_path):
    _, expected, _ = run(tokenizer, tmp_path / "plain", tuned=False)
    trainer, got, tuner = run(tokenizer, tmp_path / "run", fault=Fault("forward", at=4, micro_batch=2))
    assert differences(expected, got) == []
    [check] = checks(tmp_path / "run")
    assert (check.step, check.kind, check.old, check.new, check.verdict, check.against) == (
        4, "oom", Split(4, 2), Split(2, 4), "exact", "old")
    assert check.passes == 2 and check.rows == 4 and check.cost_sec > 0        # one old micro-batch, both ways
    [decision] = tuner.executor.record.decisions
    assert (decision.kind, decision.step) == ("oom", 4)                        # the step that ran out of memory


def test_a_loss_that_warms_with_the_step_is_refused_at_the_change_not_passed_at_step_one(tokenizer, tmp_path):
    """The z-loss weight is 0 at step 1 (a check there passes) and 0.15 at step 4: the OOM re-size at step 4 is
    refused on step 4's rows, the run ends with checkpoint-3 complete and a reason naming step 4."""
    error, tuner, trainer = refused_run(tokenizer, tmp_path, fault=Fault("forward", at=4),
                                        trainer_cls=WarmingAuxLoss)
    [check] = checks(tmp_path)
    assert (check.step, check.verdict, check.new) == (4, "inexact", Split(2, 4)) and isinstance(error, Refused)
    assert error.checkpoint.endswith("checkpoint-3") and is_complete(error.checkpoint, 3)
    assert trainer.state.global_step == 3 and tuner.executor.record.decisions == []    # nothing changed


def test_the_tunings_trial_of_a_warming_loss_is_refused_and_the_run_trains_what_plain_train_trains(tokenizer,
                                                                                               tmp_path):
    """With no OOM at all, the tuning's 8×1 trial (faster by its planted step time) is checked at its first step
    and refused: the run never trains at 8×1 and equals trainer.train()."""
    _, expected, _ = run(tokenizer, tmp_path / "plain", tuned=False, trainer_cls=WarmingAuxLoss, steps=14)
    clock = PlantedClock()
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False)
    trainer, got, _ = run(tokenizer, tmp_path / "tuned", trainer_cls=WarmingAuxLoss, steps=14, tuner=tuner,
                          more=[PlantedStepTime(clock, {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0})])
    assert differences(expected, got) == []
    refused = [c for c in checks(tmp_path / "tuned") if c.verdict != "exact"]
    assert refused and all(c.kind == "tune" for c in refused) and Split(8, 1) in {c.new for c in refused}
    assert trainer.args.per_device_train_batch_size == 4


def test_a_per_micro_batch_mean_hidden_by_alike_first_rows_is_found_on_the_rows_of_the_change(tokenizer, tmp_path):
    dataset = FirstRowsAlike(tokenizer)
    error, _, _ = refused_run(tokenizer, tmp_path, fault=Fault("forward", at=5), dataset=dataset,
                              extra={"dataloader_drop_last": False}, trainer_cls=_with_loss(micro_batch_mean))
    [check] = checks(tmp_path)
    assert check.step == 5 and check.verdict == "inexact" and "grouped" in check.why


def _with_loss(func):
    class WithLoss(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, compute_loss_func=func, **kwargs)
    return WithLoss


def test_token_weights_over_the_padded_length_are_refused(tokenizer, tmp_path):
    refused_run(tokenizer, tmp_path, fault=Fault("forward", at=3), trainer_cls=_with_loss(weights_over_padded_length))
    assert [c.verdict for c in checks(tmp_path)] == ["inexact"]


def test_neftune_noise_is_refused_as_drawn_per_micro_batch(tokenizer, tmp_path):
    refused_run(tokenizer, tmp_path, fault=Fault("forward", at=3), extra={"neftune_noise_alpha": 5.0})
    [check] = checks(tmp_path)
    assert check.verdict == "inexact" and check.drew_rng


class OldSplitOOMs(TrainerCallback):
    """The wall: every forward of ``limit`` rows or more runs out of memory after step ``armed_at`` (the old split's
    micro-batch no longer fits; the check's own first pass at it fails too)."""

    def __init__(self, limit, armed_at, every_size=False):
        self.limit, self.armed_at, self.every_size, self.step = limit, armed_at, every_size, 0

    def attach(self, trainer):
        from tests.faults import forward_entry

        forward_entry(trainer.model).register_forward_pre_hook(self._forward, with_kwargs=True)
        return trainer

    def _forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and self.step >= self.armed_at - 1 and ids is not None:
            if ids.shape[0] >= self.limit or self.every_size:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def test_where_the_old_split_no_longer_fits_a_finer_cut_decides(tokenizer, tmp_path):
    """At the wall the configured micro-batch of 4 fails everywhere from step 3: the check compares 2×4 with the
    same rows cut at 1, and the plain loss goes on exactly."""
    _, expected, _ = run(tokenizer, tmp_path / "plain", tuned=False)
    wall = OldSplitOOMs(limit=4, armed_at=3)
    trainer, got, _ = run(tokenizer, tmp_path / "run", fault=wall)
    assert differences(expected, got) == []
    [check] = checks(tmp_path / "run")
    assert (check.step, check.verdict, check.against) == (3, "exact", "finer")


def test_where_only_one_row_fits_the_change_is_unmeasured_and_the_run_ends_saved_naming_the_setting(tokenizer,
                                                                                                  tmp_path):
    """From step 3 only one-row micro-batches fit: 2×4 does not fit in its check, and 1×8, which fits, has no
    grouping of the step's rows at a size that fits to be compared with. The run ends like an inexact re-size,
    saved, naming why and accept_unmeasured."""
    error, tuner, trainer = refused_run(tokenizer, tmp_path, fault=OldSplitOOMs(limit=2, armed_at=3))
    assert [(c.new, c.fits, c.verdict) for c in checks(tmp_path)] == [(Split(2, 4), False, "unmeasured"),
                                                                     (Split(1, 8), True, "unmeasured")]
    assert "accept_unmeasured=True" in str(error) and tuner.executor.record.decisions == []
    assert error.checkpoint.endswith("checkpoint-2") and is_complete(error.checkpoint, 2)
    assert trainer.state.global_step == 2


def test_accept_unmeasured_goes_on_at_the_unmeasured_split_and_says_so(tokenizer, tmp_path):
    tuner = AdaptiveBatchTuner(tune=False, accept_unmeasured=True)
    trainer, _, _ = run(tokenizer, tmp_path, fault=OldSplitOOMs(limit=2, armed_at=3), tuner=tuner)
    assert trainer.state.global_step == 6 and trainer.args.per_device_train_batch_size == 1
    assert [(d.old, d.new) for d in tuner.executor.record.decisions] == [(Split(4, 2), Split(1, 8))]
    assert f"unmeasured-{Split(1, 8)}" in tuner.executor.record.said                       # said once


# ------------------------------------------------------------ no trace when nothing changes
class Augmented(torch.utils.data.Dataset):
    """``__getitem__`` draws random numbers (an augmentation): every read must come in the same order."""

    def __init__(self, tokenizer, n=64):
        self.base, self.reads = TextDataset(tokenizer, n=n), []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.reads.append(i)
        ids = list(self.base[i]["input_ids"])
        cut = random.randint(0, 2) + int(torch.randint(0, 2, (1,)))
        return {"input_ids": ids[: max(4, len(ids) - cut)]}


class CountingCollator(DataCollatorForLanguageModeling):
    """A stateful collator: each call's count changes the batch (a curriculum of truncation)."""

    calls = 0

    def __call__(self, features, *args, **kwargs):
        type(self).calls += 1
        trimmed = [{"input_ids": f["input_ids"][: 8 + type(self).calls % 5]} for f in features]
        return super().__call__(trimmed, *args, **kwargs)


class OnePassStream(torch.utils.data.IterableDataset):
    """A stream that can be read once: every row read is counted."""

    def __init__(self, tokenizer, n=64):
        self.items, self.read = TextDataset(tokenizer, n=n).items, 0

    def __iter__(self):
        for ids in self.items:
            self.read += 1
            yield {"input_ids": ids}


def buffered_model(tokenizer):
    """A model with a buffer its training forwards advance (a running mean, as BatchNorm's statistics)."""
    model = build_model(tokenizer)
    model.register_buffer("seen", torch.zeros(()))

    def count(module, args, kwargs):
        if module.training:
            module.seen += 1
    model.register_forward_pre_hook(count, with_kwargs=True)
    return model


def _no_trace_setting(name, tokenizer):
    if name == "random __getitem__":
        return {"dataset": Augmented(tokenizer)}
    if name == "stateful collator":
        CountingCollator.calls = 0
        return {"collator": CountingCollator(padded(tokenizer, "right"), mlm=False)}
    if name == "one-pass stream":
        return {"dataset": OnePassStream(tokenizer)}
    if name == "model buffers":
        return {"model": buffered_model(tokenizer)}
    if name == "dataloader workers":
        return {"extra": {"dataloader_num_workers": 1}}
    if name == "group by length":
        return {"extra": {"train_sampling_strategy": "group_by_length"}}
    if name == "a sampler with its own generator":
        return {"trainer_cls": OwnGeneratorSampler}
    raise AssertionError(name)


class OwnGeneratorSampler(Trainer):
    """A user's trainer whose sampler shuffles with a generator of its own (it draws nothing from the global RNG)."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(7))


NO_TRACE = ["random __getitem__", "stateful collator", "one-pass stream", "model buffers", "dataloader workers",
            "group by length", "a sampler with its own generator"]


@pytest.mark.parametrize("setting", NO_TRACE)
def test_with_no_change_train_with_tuning_trains_bit_for_bit_what_train_trains(tokenizer, tmp_path, setting):
    runs = []
    for tuned in (False, True):
        kw = _no_trace_setting(setting, tokenizer)
        trainer, trajectory, _ = run(tokenizer, tmp_path / str(tuned), tuned=tuned, **kw)
        seen = {"reads": list(getattr(kw.get("dataset"), "reads", [])),
                "stream": getattr(kw.get("dataset"), "read", None), "collator": CountingCollator.calls,
                "buffer": float(trainer.model.seen) if hasattr(trainer.model, "seen") else None}
        runs.append((trajectory, seen))
    (plain, plain_seen), (tuned, tuned_seen) = runs
    assert differences(plain, tuned, rtol=0, atol=0) == [] and plain_seen == tuned_seen
    assert checks(tmp_path / "True") == []                                        # nothing was checked


def sft_packing(tokenizer, out, callbacks):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.conftest import CORPUS

    texts = [CORPUS[i % 5][: 12 + 9 * (i % 4)] for i in range(64)]
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=5,
                     packing=True, max_length=32, logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, bf16=False, seed=0, disable_tqdm=True, **SGD)
    torch.manual_seed(0)
    return SFTTrainer(model=build_model(tokenizer), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                      processing_class=tokenizer, callbacks=callbacks)


@pytest.mark.parametrize("trainer", ["SFT packing", "GRPO"])
def test_with_no_change_a_trl_trainer_trains_bit_for_bit_what_train_trains(tokenizer, tmp_path, trainer):
    runs = []
    for tuned in (False, True):
        if trainer == "GRPO":
            _, trajectory = grpo_run(tokenizer, tmp_path / str(tuned), "grpo", tuned=tuned)
        else:
            trajectory = Trajectory()
            built = trajectory.attach(sft_packing(tokenizer, tmp_path / str(tuned),
                                                  [trajectory, *([AdaptiveBatchTuner(tune=False)] if tuned else [])]))
            train_with_tuning(built) if tuned else built.train()
        runs.append(trajectory)
    assert differences(*runs, rtol=0, atol=0) == [] and checks(tmp_path / "True") == []


def test_a_trainer_used_again_after_train_with_tuning_ends_runs_plain(tokenizer, tmp_path):
    """The executor leaves the trainer's bus when train_with_tuning ends (by Ctrl-C too): a plain train() afterwards
    is not driven by the ended run."""
    trainer, _, tuner = run(tokenizer, tmp_path, fault=Fault("forward", at=3))
    ended = tuner.executor
    trainer.args.max_steps = 2
    trainer.train()
    assert tuner.executor is not ended and not tuner.executor.managed


def test_a_refusal_message_names_the_step_that_ran_out_of_memory(tokenizer, tmp_path):
    error, _, trainer = refused_run(tokenizer, tmp_path, fault=Fault("forward", at=5), trainer_cls=WarmingAuxLoss)
    assert "in step 5" in str(error) and trainer.state.global_step == 4
    assert os.path.isdir(tmp_path / "checkpoint-4")


# ------------------------------------------------------------ GRPO: checked on its buffered completions
def grpo_run(tokenizer, out, loss_type, fault=None, tuned=True):
    from tests.conftest import make_grpo, varied_reward

    trajectory = Trajectory()
    callbacks = [trajectory, *([fault] if fault else []), *([AdaptiveBatchTuner(tune=False)] if tuned else [])]
    trainer = trajectory.attach(make_grpo(tokenizer, out, callbacks, max_steps=4, completion=6, reward=varied_reward,
                                          extra={**SGD, "learning_rate": 0.01, "loss_type": loss_type}))
    if fault is not None:
        fault.attach(trainer)
    train_with_tuning(trainer) if tuned else trainer.train()
    return trainer, trajectory


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", pytest.param("dr_grpo", marks=pytest.mark.launch),
                                       pytest.param("luspo", marks=pytest.mark.launch),
                                       pytest.param("cispo", marks=pytest.mark.launch)])
def test_a_grpo_resize_is_checked_on_the_completions_its_step_trains(tokenizer, tmp_path, loss_type):
    """An OOM in step 3's second micro-batch: the resumed step generates the same completions, and the check compares
    them grouped 4×2 and 2×4 before they train; each exact loss type goes on as the unfaulted run."""
    _, expected = grpo_run(tokenizer, tmp_path / "plain", loss_type, tuned=False)
    trainer, got = grpo_run(tokenizer, tmp_path / "run", loss_type, Fault("forward", at=3, micro_batch=2))
    assert differences(expected, got) == []
    [check] = checks(tmp_path / "run")
    assert (check.step, check.verdict, check.against, check.new.micro_batch) == (3, "exact", "old", 2)


def test_a_grpo_loss_that_depends_on_the_grouping_is_refused_on_its_completions(tokenizer, tmp_path):
    """A user's GRPO loss with a per-micro-batch term that warms up with the step (the rules allow its loss type):
    refused on step 3's completions, saved at checkpoint-2."""
    from trl import GRPOTrainer

    class WarmingGRPO(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss + 0.05 * self.state.global_step * inputs["completion_mask"].float().mean()

    from tests.conftest import make_grpo, varied_reward

    fault = Fault("forward", at=3, micro_batch=2)
    trainer = make_grpo(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)], max_steps=4, completion=6,
                        reward=varied_reward, extra={**SGD, "learning_rate": 0.01})
    trainer.__class__ = WarmingGRPO
    fault.attach(trainer)
    with pytest.raises(InexactResize, match="inexact on that step's rows"):
        train_with_tuning(trainer)
    assert [(c.step, c.verdict) for c in checks(tmp_path)] == [(3, "inexact")]
    assert is_complete(str(tmp_path / "checkpoint-2"), 2)


# ------------------------------------------------------------ the loose ends of "nothing lost"
def test_an_interrupted_stop_save_of_the_watchdog_leaves_no_folder_a_resume_picks(tokenizer, tmp_path):
    """MemoryWatchdog alone asks for a checkpoint and a stop at step 2; Ctrl-C while transformers writes its optimizer
    file leaves a partial checkpoint-2: it is moved aside, transformers' get_last_checkpoint finds none, and a resume
    with resume_from_checkpoint=True starts cleanly."""
    from transformers.trainer_utils import get_last_checkpoint

    from hf_perf_callbacks import MemoryWatchdog
    from tests.test_tuner import MemoryByBatch

    watchdog = MemoryWatchdog(limit_gb=7.0, grace_steps=1)
    fault = Fault("save:optimizer", at=2, error="interrupt")
    trainer = build(tokenizer, tmp_path, [watchdog], steps=5)
    watchdog.device = MemoryByBatch(trainer.args)
    with fault.planted_save(), pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert get_last_checkpoint(str(tmp_path)) is None
    assert os.listdir(tmp_path / "moved_aside") == ["checkpoint-2.partial-1"]
    again = build(tokenizer, tmp_path, [], steps=2)
    again.train(resume_from_checkpoint=get_last_checkpoint(str(tmp_path)))
    assert again.state.global_step == 2


def test_a_resize_records_by_how_much_the_padding_counters_differ_from_here(tokenizer, tmp_path):
    """num_input_tokens_seen counting padding ("all") and total_flos count each micro-batch's padded rows: after a
    re-size they count the new split's padding. The check records the difference at its step (and a note says it)."""
    from hf_perf_callbacks.core.runlog import read_run

    _, plain, _ = run(tokenizer, tmp_path / "plain", tuned=False, extra={"include_num_input_tokens_seen": "all"})
    trainer, _, _ = run(tokenizer, tmp_path / "run", fault=Fault("forward", at=3, micro_batch=2),
                        extra={"include_num_input_tokens_seen": "all"})
    [check] = checks(tmp_path / "run")
    assert check.padded_delta < 0                              # 2-row micro-batches pad less than 4-row ones
    notes = [e for e in read_run(str(tmp_path / "run")).events if e.step == 3 and e.kind == "note"]
    assert len(notes) == 1


def test_an_evaluation_out_of_memory_keeps_the_configured_batchs_eval_loss(tokenizer, tmp_path):
    """The evaluation batch of 8 runs out of memory and is halved: eval_loss is still the batch of 8's figure."""
    from tests.conftest import TextDataset

    settings = dict(steps=4, extra={"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 8},
                    eval_dataset=TextDataset(tokenizer, n=16))
    plain = build(tokenizer, tmp_path / "plain", [], **settings)
    plain.train()
    fault = Fault("eval", at=0, times=10**6, limit=4)
    trainer = build(tokenizer, tmp_path / "run", [fault, AdaptiveBatchTuner(tune=False)], **settings)
    fault.attach(trainer)
    train_with_tuning(trainer)
    losses = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (plain, trainer)]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-6, abs=1e-7)


class EpochStream(torch.utils.data.IterableDataset):
    """An iterable dataset whose epoch is 16 rows: two optimizer steps of 4×2."""

    def __init__(self, tokenizer):
        self.items = TextDataset(tokenizer, n=16).items

    def __iter__(self):
        return iter({"input_ids": ids} for ids in self.items)


def test_a_resize_at_an_iterable_datasets_epoch_boundary_goes_on_as_a_plain_resume_does(tokenizer, tmp_path):
    """An OOM in the first step of the second epoch (step 3): the resume from checkpoint-2 first meets the end of the
    skipped first epoch (no rows), then the second epoch's rows, which are the unfaulted run's: no refusal."""
    _, expected, _ = run(tokenizer, tmp_path / "plain", tuned=False, dataset=EpochStream(tokenizer))
    _, got, _ = run(tokenizer, tmp_path / "run", fault=Fault("forward", at=3), dataset=EpochStream(tokenizer))
    assert differences(expected, got) == []
    assert [c.verdict for c in checks(tmp_path / "run")] == ["exact"]


def tiny_mixtral(tokenizer):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            pad_token_id=tokenizer.pad_token_id))


def test_a_resume_that_restored_fewer_weights_than_saved_is_completed(tokenizer, tmp_path):
    """A mixture of experts (Mixtral-style): transformers saves its experts under legacy names and its resume does
    not convert them back, so trainer.train(resume_from_checkpoint=...) leaves the router and experts at their
    initial values; train_with_tuning's resume loads them converted and trains what the unbroken run trains."""
    extra = {"save_strategy": "steps", "save_steps": 2}
    unbroken, expected, _ = run(tokenizer, tmp_path / "run", tuned=False, steps=4, extra=extra,
                                model=tiny_mixtral(tokenizer))
    resumed = {}
    for how in ("trainer.train", "train_with_tuning"):
        trainer = build(tokenizer, tmp_path / "run", [], steps=4, extra=extra, model=tiny_mixtral(tokenizer))
        checkpoint = str(tmp_path / "run" / "checkpoint-2")
        if how == "trainer.train":
            trainer.train(resume_from_checkpoint=checkpoint)
        else:
            train_with_tuning(trainer, resume_from_checkpoint=checkpoint)
        resumed[how] = max((trainer.model.state_dict()[k] - v).abs().max().item()
                           for k, v in unbroken.model.state_dict().items())
    assert resumed["trainer.train"] > 1e-6                       # transformers' own resume (docs/known-issues.md)
    assert resumed["train_with_tuning"] < 1e-6
