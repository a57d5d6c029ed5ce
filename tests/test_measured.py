"""Exactness measured on the run's own rows (hf_perf_callbacks/resize/measured.py, hf_perf_callbacks/sketch.py).

Every setting here is one the rules of ``batching.exact_under`` let through (they allowed every split for each of
them): the check at the run's first step must show which splits train what the configured split trains, on real
Trainers with a tiny model. An out-of-memory error after the check must not re-size to a split it showed inexact.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, ThroughputMeter, keys, train_with_tuning
from hf_perf_callbacks.batching import Split
from hf_perf_callbacks.resize.session import InexactResize
from hf_perf_callbacks.resize.tuning import OnRunTuning
from hf_perf_callbacks.runlog import read_run
from hf_perf_callbacks.sketch import RTOL, WIDTH, compare, rtol_for, sketch
from hf_perf_callbacks.splitfile import ExactnessCheck, SplitFile, read_split_file
from tests.conftest import make_trainer, padded
from tests.faults import Fault, Trajectory, differences

CONFIGURED = Split(4, 2)
SMALLER = [Split(2, 4), Split(1, 8)]


# ------------------------------------------------------------ the sketch (pure)
def _grads(scale: float = 1.0, extra: float = 0.0):
    torch.manual_seed(0)
    big = torch.randn(70_000)                       # more than one block
    small = torch.randn(3, 5)
    return [("big", big * scale), ("small", small + extra), ("none", None)]


def test_the_same_gradients_sketch_the_same_and_a_changed_parameter_is_named():
    reference = sketch(_grads(), loss=2.0)
    assert reference.projections.shape == (3, WIDTH)
    assert reference.nbytes == 3 * WIDTH * 8
    same = sketch(_grads(), loss=2.0)
    assert compare(reference, reference, same, RTOL[torch.float32]).same
    rounded = sketch(_grads(scale=1 + 1e-7), loss=2.0)          # rounding-sized: the same
    assert compare(reference, reference, rounded, RTOL[torch.float32]).same
    moved = compare(reference, reference, sketch(_grads(extra=1e-2), loss=2.0), RTOL[torch.float32])
    assert not moved.same and moved.where == "small" and moved.relative > moved.tolerance


def test_noise_of_the_repeated_grouping_widens_the_tolerance_and_the_loss_is_compared():
    reference = sketch(_grads(), loss=2.0)
    noisy_repeat = sketch(_grads(extra=5e-3), loss=2.0)
    candidate = sketch(_grads(extra=1e-2), loss=2.0)
    assert compare(reference, noisy_repeat, candidate, RTOL[torch.float32]).same   # within 8× the noise
    loss_only = compare(reference, reference, sketch(_grads(), loss=2.5), RTOL[torch.float32])
    assert not loss_only.same and loss_only.where == "the loss"


def test_sketches_of_other_parameters_are_refused_and_the_dtype_sets_the_rounding():
    with pytest.raises(ValueError, match="different parameters"):
        compare(sketch(_grads(), 1.0), sketch(_grads(), 1.0), sketch(_grads()[:2], 1.0), 1e-4)
    assert rtol_for(torch.bfloat16) > rtol_for(torch.float16) > rtol_for(torch.float32) > rtol_for(torch.float64)
    assert rtol_for(torch.int8) == RTOL[torch.float32]


def test_the_check_is_recorded_in_the_split_file_and_read_back():
    check = ExactnessCheck(exact=[CONFIGURED, Split(8, 1)], inexact={Split(2, 4): "lm_head.weight differs"},
                           rows=8, passes=4, cost_sec=0.5, sketch_bytes=2016, drew_rng=True)
    record = SplitFile(session="s", world_size=1, configured=CONFIGURED, split=CONFIGURED, measured=check)
    again = SplitFile.from_json(record.to_json())
    assert again.measured == check
    assert SplitFile.from_json({**record.to_json(), "measured": None}).measured is None


def test_the_tuning_never_tries_a_split_left_out_after_it_was_planned():
    tuning = OnRunTuning(CONFIGURED, [Split(8, 1), *SMALLER], planned_steps=100)
    tuning.leave_out({Split(8, 1), Split(1, 8)})
    assert tuning.larger == [] and tuning.smaller == [Split(2, 4)]


# ------------------------------------------------------------ real trainers: settings the rules let through
class ZLossTrainer(Trainer):
    """A user's loss: the library's loss (num_items_in_batch passed on) plus a z-loss added per micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 1e-3 * torch.logsumexp(outputs.logits, dim=-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def micro_batch_mean(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func that names num_items_in_batch but divides by the micro-batch's own tokens."""
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    own = (targets != -100).sum()
    return total / own if num_items_in_batch is not None else total / own


def _token_losses(outputs, labels):
    logits, targets = outputs.logits[..., :-1, :], labels[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="none").view(targets.shape)


def weighted_tokens(outputs, labels, num_items_in_batch=None):
    """Token-level loss weights by position (later tokens weigh more), summed and divided by the step's label
    tokens: a loss over the whole step."""
    each = _token_losses(outputs, labels)
    return (each * (0.5 + 0.05 * torch.arange(each.shape[-1]))).sum() / num_items_in_batch


def weights_over_padded_length(outputs, labels, num_items_in_batch=None):
    """Token-level weights spread over the micro-batch's padded length: the same token weighs differently in
    another split, though the sum is divided by the step's label tokens."""
    each = _token_losses(outputs, labels)
    return (each * torch.linspace(0.5, 1.5, each.shape[-1])).sum() / num_items_in_batch


def _aux_loss_model(tokenizer):
    """A user's model whose forward adds an auxiliary loss of its own: a mean over the micro-batch's last hidden
    states, added once per forward (the library's loss, with num_items_in_batch, is left as it is)."""
    from transformers import LlamaForCausalLM

    from hf_perf_callbacks.tiny import build_model

    class AuxLossLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            kwargs["output_hidden_states"] = True
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
            if out.loss is not None:
                out.loss = out.loss + 0.1 * out.hidden_states[-1].pow(2).mean()
            return out

    torch.manual_seed(0)
    return AuxLossLlama(build_model(tokenizer).config)


def _mixtral(tokenizer):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.02, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False))


def _own_collate(tokenizer):
    left = padded(tokenizer, "left")

    def collate(features):                          # no .tokenizer attribute: the rules never see its padding
        batch = left.pad(features, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch

    return collate


def _run(tokenizer, tmp_path, name, *, steps=1, fault=None, model=None, trainer_cls=None, extra=None,
         collate=None, callbacks=()):
    trainer = make_trainer(tokenizer, tmp_path / name, [AdaptiveBatchTuner(tune=False), *callbacks], max_steps=steps,
                           bs=CONFIGURED.micro_batch, ga=CONFIGURED.grad_accum, model=model, trainer_cls=trainer_cls,
                           extra={"optim": "sgd", "max_grad_norm": 0.0, **(extra or {})})
    if collate is not None:
        trainer.data_collator = collate
    if fault is not None:
        trainer.add_callback(fault)
        fault.attach(trainer)
    return trainer


def _measured(trainer) -> ExactnessCheck:
    record = read_split_file(trainer.args.output_dir)
    assert record is not None and record.measured is not None
    return record.measured


CASES = {
    "neftune": dict(extra={"neftune_noise_alpha": 5.0}),
    "z-loss in compute_loss": dict(trainer_cls=ZLossTrainer),
    "compute_loss_func, mean per micro-batch": dict(loss_func=micro_batch_mean),
    "token weights over the padded length": dict(loss_func=weights_over_padded_length),
    "own collate padding left": dict(collate="left"),
    "router loss of a mixture of experts": dict(model="mixtral"),
    "auxiliary loss in the model's own forward": dict(model="aux"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_split_the_rules_allowed_is_shown_inexact_on_the_runs_rows(tokenizer, tmp_path, case):
    spec = dict(CASES[case])
    loss_func = spec.pop("loss_func", None)
    if spec.pop("collate", None):
        spec["collate"] = _own_collate(tokenizer)
    model = spec.pop("model", None)
    if model is not None:
        spec["model"] = _mixtral(tokenizer) if model == "mixtral" else _aux_loss_model(tokenizer)
    trainer = _run(tokenizer, tmp_path, "run", **spec)
    if loss_func is not None:
        trainer.compute_loss_func = loss_func
    train_with_tuning(trainer)
    check = _measured(trainer)
    # without the tuning only smaller splits can be used: each measured on one configured micro-batch of rows
    assert check.skipped is None and check.rows == CONFIGURED.micro_batch
    assert check.exact == [CONFIGURED]
    assert set(check.inexact) == set(SMALLER)
    assert check.drew_rng == (case == "neftune")
    assert check.passes == 4 and 0 < check.sketch_bytes < 64 * 1024      # reference, its repeat, two splits
    assert read_split_file(trainer.args.output_dir).restricted.splits == [CONFIGURED]


def _lora(tokenizer):
    from peft import LoraConfig, get_peft_model

    from hf_perf_callbacks.tiny import build_model

    return get_peft_model(build_model(tokenizer), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=["q_proj", "v_proj"],
                                                             task_type="CAUSAL_LM"))


EXACT_CASES = {
    "plain": {},
    "token weights over num_items_in_batch": {"loss_func": weighted_tokens},
    "label smoothing": {"extra": {"label_smoothing_factor": 0.1}},
    "gradient checkpointing": {"extra": {"gradient_checkpointing": True}},
    "bf16 autocast": {"extra": {"bf16": True}},
    "LoRA": {"model": "lora"},
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_a_loss_over_the_whole_step_is_shown_exact_for_every_split(tokenizer, tmp_path, case):
    spec = dict(EXACT_CASES[case])
    loss_func = spec.pop("loss_func", None)
    if spec.pop("model", None):
        spec["model"] = _lora(tokenizer)
    trainer = _run(tokenizer, tmp_path, "run", **spec)
    if loss_func is not None:
        trainer.compute_loss_func = loss_func
    train_with_tuning(trainer)
    check = _measured(trainer)
    assert check.inexact == {} and check.exact == [CONFIGURED, *SMALLER]
    assert check.passes == 3                         # the repeat runs only when a split differs
    assert read_split_file(trainer.args.output_dir).restricted is None


def test_with_the_tuning_a_larger_split_is_measured_on_its_own_micro_batch_of_rows(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path / "run", [AdaptiveBatchTuner(tune=True)], max_steps=1,
                           bs=CONFIGURED.micro_batch, ga=CONFIGURED.grad_accum,
                           extra={"optim": "sgd", "max_grad_norm": 0.0, "neftune_noise_alpha": 5.0})
    train_with_tuning(trainer)
    check = _measured(trainer)
    assert set(check.inexact) == {Split(8, 1), *SMALLER} and check.rows == 8       # 8×1 against 4×2 on 8 rows
    assert check.passes == 7                      # two row counts: a reference and a repeat each, three splits


def test_a_split_shown_exact_re_sizes_to_what_the_unfaulted_run_trains(tokenizer, tmp_path):
    """Token weights by position over the step's label tokens: shown exact, so an OOM re-sizes 4×2 → 2×4, and the
    run trains the unfaulted run's samples, RNG stream, schedule, weights and optimizer state."""
    settings = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.02, "max_grad_norm": 0.0}
    expected = Trajectory()
    plain = make_trainer(tokenizer, tmp_path / "plain", [expected], max_steps=4, bs=4, ga=2, extra=settings)
    plain.compute_loss_func = weighted_tokens
    expected.attach(plain).train()
    fault, got = Fault("forward", at=3), Trajectory()
    trainer = make_trainer(tokenizer, tmp_path / "run", [fault, got, AdaptiveBatchTuner(tune=False)], max_steps=4,
                           bs=4, ga=2, extra=settings)
    trainer.compute_loss_func = weighted_tokens
    fault.attach(got.attach(trainer))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.args.per_device_train_batch_size == 2
    assert _measured(trainer).exact == [CONFIGURED, *SMALLER]
    assert differences(expected, got) == []


def test_an_oom_after_the_check_is_not_resized_to_a_split_it_showed_inexact(tokenizer, tmp_path):
    fault = Fault("forward", at=2)
    trainer = _run(tokenizer, tmp_path, "run", steps=3, fault=fault, trainer_cls=ZLossTrainer)
    with pytest.raises(InexactResize):
        train_with_tuning(trainer)
    assert fault.fired == 1
    assert trainer.args.per_device_train_batch_size == CONFIGURED.micro_batch      # never re-sized
    record = read_split_file(trainer.args.output_dir)
    assert record is not None and record.restricted is not None
    assert record.restricted.splits == [CONFIGURED]
    assert not any(d.kind == "oom" and d.new != CONFIGURED for d in record.decisions)


def test_the_check_leaves_the_run_as_it_was_and_the_meter_counts_none_of_its_passes(tokenizer, tmp_path):
    class Weights(TrainerCallback):
        first: dict | None = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.first is None:
                self.first = {n: p.detach().clone() for n, p in model.named_parameters()}

    checked, plain = Weights(), Weights()
    meter = ThroughputMeter()
    trainer = _run(tokenizer, tmp_path, "checked", steps=2, callbacks=[checked, meter])
    train_with_tuning(trainer)
    assert _measured(trainer).passes == 3
    control = make_trainer(tokenizer, tmp_path / "plain", [plain], max_steps=2, bs=4, ga=2,
                           extra={"optim": "sgd", "max_grad_norm": 0.0})
    control.train()
    assert all(torch.equal(checked.first[n], plain.first[n]) for n in plain.first)     # the same first step
    steps = [r for r in read_run(str(tmp_path / "checked")).steps if keys.PERF_FORWARDS_PER_MICROBATCH in r.values]
    assert steps and all(r.values[keys.PERF_FORWARDS_PER_MICROBATCH] == 1.0 for r in steps)


@pytest.mark.parametrize("trainer_name", ["SFTTrainer", "DPOTrainer"])
def test_trl_figures_logged_after_the_check_equal_a_run_without_it(tokenizer, tmp_path, trainer_name):
    """TRL's compute_loss adds to its logged metrics on every call (SFT, DPO: the tokens trained so far): the
    check's passes take back what they added."""
    from tests import compat

    cell = next(c for c in compat.CELLS if c.id == f"defaults | {trainer_name}")
    extra = {"gradient_accumulation_steps": 2, "report_to": "none", "optim": "sgd", "max_grad_norm": 0.0}
    logged = {}
    for name in ("checked", "plain"):
        callbacks = [AdaptiveBatchTuner(tune=False)] if name == "checked" else []
        trainer = compat.build(cell, tokenizer, str(tmp_path / name), callbacks, steps=2, extra=extra)
        train_with_tuning(trainer) if name == "checked" else trainer.train()
        logged[name] = [{k: v for k, v in h.items() if k not in ("train_runtime", "train_samples_per_second",
                                                                 "train_steps_per_second") and "tuner/" not in k}
                        for h in trainer.state.log_history]
        if name == "checked":
            assert _measured(trainer).passes >= 2
    assert logged["checked"] == logged["plain"]
