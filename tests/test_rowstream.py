"""The row-stream check of a re-size: the rows the new split fetches for a step are compared with what the old split
fetched for it (the unfaulted run's rows) before the step trains, and an iterable dataset's epoch end is judged when
it comes. Real Trainer runs (CPU, tiny causal LM, SGD with momentum) compared with the same run unfaulted."""
from __future__ import annotations

import json

import torch

from hf_perf_callbacks import AdaptiveBatchTuner, keys, train_with_tuning
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.rowstream import (
    RowDifference,
    RowWatch,
    crosses,
    difference,
    epoch_end,
    row_digests,
    step_rows,
)
from hf_perf_callbacks.core.splitfile import read_split_file
from tests.conftest import PlantedClock, TextDataset, make_trainer
from tests.faults import Fault, Trajectory, differences
from tests.test_faults import step_lines
from tests.test_tuner import FASTER_LARGER, PlantedStepTime

SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear",
       "max_grad_norm": 0.0}


def test_a_rows_digest_ignores_padding_and_the_comparison_is_a_multiset():
    a = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
         "labels": torch.tensor([[5, 6, 7], [8, 9, -100]])}
    b = {"input_ids": torch.tensor([[8, 9]]), "attention_mask": torch.tensor([[1, 1]]),
         "labels": torch.tensor([[8, 9]])}
    assert row_digests(a)[1] == row_digests(b)[0] and row_digests(a)[0] != row_digests(b)[0]
    one, two = Split(2, 1), Split(1, 2)
    first = step_rows(3, one, [a], 1)
    assert difference(first, step_rows(3, two, [b, {k: v[:1] for k, v in a.items()}], 2)) is None   # other order
    differs = difference(first, step_rows(3, two, [b, b], 2))        # b twice: a's first row missing, b extra
    assert differs == RowDifference(rows=2, expected_rows=2, split=one, missing=1, extra=1)
    # packed rows (padding-free): one digest per example, cut where the positions start again
    packed = {"input_ids": torch.tensor([[8, 9, 5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
    assert len(row_digests(packed)) == 2


def test_a_padding_free_batch_gives_one_digest_per_packed_example_whatever_else_it_holds():
    """TRL's padding-free collator packs a micro-batch's examples into one row and adds flat per-batch lists
    (``cu_seq_lens_q``: one entry per example, plus one), which are no rows."""
    a, b = [5, 6, 7], [8, 9]

    def packed(*examples):
        ids = [t for e in examples for t in e]
        cuts = [0]
        for e in examples:
            cuts.append(cuts[-1] + len(e))
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids]),
                "position_ids": torch.tensor([[p for e in examples for p in range(len(e))]]),
                "cu_seq_lens_q": torch.tensor(cuts), "max_length_q": max(map(len, examples))}

    together = row_digests(packed(a, b))
    assert len(together) == 2
    assert sorted(together) == sorted(row_digests(packed(a)) + row_digests(packed(b)))


def test_an_iterable_epoch_end_inside_a_step_is_judged_against_the_configured_split():
    # 62 rows, effective batch 8: the last step of an epoch holds 6 rows
    assert not crosses(6, Split(4, 2)) and not crosses(6, Split(8, 1))
    assert crosses(6, Split(2, 4)) and crosses(6, Split(1, 8)) and not crosses(0, Split(2, 4))
    short = step_rows(8, Split(2, 4), [{"input_ids": torch.ones(2, 3)}] * 3, 4, digest=False)
    assert epoch_end(short, Split(4, 2)) is not None and epoch_end(short, Split(1, 8)) is None
    watch = RowWatch(Split(4, 2), sized=False)
    watch.arm(2)
    assert watch.active and watch.fetched(3, Split(4, 2), [{"input_ids": torch.ones(4, 3)}] * 2, 2) is None
    watch.switched()
    assert watch.fetched(3, Split(2, 4), [{"input_ids": torch.ones(2, 3)}] * 4, 4) is None
    assert watch.counting                                   # until the first epoch end after the switch
    assert watch.fetched(8, Split(2, 4), [{"input_ids": torch.ones(2, 3)}] * 3, 4) is not None
    assert not watch.active and watch.reference is not None and watch.reference.rows == 6


def trajectory_run(tokenizer, path, callbacks=(), tuned=False, dataset=None, **kwargs) -> tuple:
    got = Trajectory()
    trainer = got.attach(make_trainer(tokenizer, path, [got, *callbacks], **kwargs))
    if dataset is not None:
        trainer.train_dataset = dataset
    for callback in callbacks:
        if isinstance(callback, Fault):
            callback.attach(trainer)
    train_with_tuning(trainer) if tuned else trainer.train()
    return trainer, got


def test_a_resize_within_the_second_epoch_of_a_length_grouped_run_trains_the_unfaulted_rows(tokenizer, tmp_path):
    """The length-grouped sampler draws each epoch's order from the global RNG when the epoch's iterator is made: a
    re-size at step 11 (8 steps an epoch) resumes within epoch 2 and makes its iterator with that epoch's RNG again,
    and the check compares step 12's rows at 2×4 with 4×2's before the step trains."""
    extra = {**SGD, "train_sampling_strategy": "group_by_length"}
    _, expected = trajectory_run(tokenizer, tmp_path / "plain", max_steps=13, extra=extra)
    tuner, fault = AdaptiveBatchTuner(tune=False), Fault("forward", at=12)
    trainer, got = trajectory_run(tokenizer, tmp_path / "run", [fault, tuner], tuned=True, max_steps=13, extra=extra)
    assert fault.fired == 1 and trainer.state.epoch > 1
    assert [(d.kind, d.step, d.new) for d in tuner.executor.record.decisions] == [("oom", 12, Split(2, 4))]
    reference = tuner.executor.watch.watch.reference
    assert (reference.step, reference.split, reference.rows) == (12, Split(4, 2), 8)    # compared, and the same
    assert differences(expected, got) == []


def test_a_tuning_switch_within_a_later_epoch_of_a_length_grouped_run_trains_the_unfaulted_rows(tokenizer, tmp_path):
    """The tuner's switch 2×4 → 8×1 after step 7 falls within epoch 2 (40 rows: 5 steps an epoch)."""
    extra = {**SGD, "train_sampling_strategy": "group_by_length"}
    rows = TextDataset(tokenizer, n=40, length=16)
    clock = PlantedClock()
    _, expected = trajectory_run(tokenizer, tmp_path / "plain", bs=2, ga=4, max_steps=12, extra=extra, dataset=rows)
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)
    trainer, got = trajectory_run(tokenizer, tmp_path / "run", [PlantedStepTime(clock, FASTER_LARGER), tuner],
                                  tuned=True, bs=2, ga=4, max_steps=12, extra=extra, dataset=rows)
    micro = [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path / "run")]
    assert micro[:8] == [2] * 7 + [8]                                            # switched after step 7
    assert differences(expected, got) == []


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_an_iterable_dataset_whose_epoch_ends_inside_a_step_goes_back_to_the_split_that_trains_it(tokenizer,
                                                                                                     tmp_path):
    """62 rows, 4×2: step 8 trains the epoch's last 6 rows alone. An OOM at step 3 re-sizes to 2×4, whose step 8
    would wait for the next epoch's first 8 rows (14 rows): found when step 8's rows are fetched, before it trains;
    the run goes back to 4×2 from step 7, 2×4 is left for the run, and it trains what the unfaulted run trains."""
    data = TextDataset(tokenizer, n=62)
    rows = Rows([data[i] for i in range(62)])
    _, expected = trajectory_run(tokenizer, tmp_path / "plain", max_steps=9, extra=SGD, dataset=rows)
    assert {s: len(r) for s, r in expected.trained().items()}[8] == 6
    tuner, fault = AdaptiveBatchTuner(tune=False), Fault("forward", at=3)
    trainer, got = trajectory_run(tokenizer, tmp_path / "run", [fault, tuner], tuned=True, max_steps=9, extra=SGD,
                                  dataset=rows)
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path / "run")] == [4, 4] + [2] * 5 + [4, 4]
    executor = tuner.executor
    assert not executor.state.exactness.allows(Split(2, 4)) and Split(2, 4) not in executor.snapshot().allowed()
    assert "2×4 refused at step 8 (the rows differ" in read_split_file(str(tmp_path / "run")).restricted.reason
    assert differences(expected, got) == []


def test_a_recorded_split_that_is_not_exact_for_the_longer_run_is_not_applied(tokenizer, tmp_path):
    """dataloader_drop_last=True, 66 rows: 4×2 drops 2 an epoch, 2×4 none. A 4-step run re-sizes to 2×4 (exact
    there: it ends before the epoch's end) and records it; a 10-step run resumed from its checkpoint-4 crosses the
    epoch's end, so the recorded 2×4 is not applied: it trains at 4×2, what the unfaulted run trains."""
    extra = {**SGD, "lr_scheduler_type": "constant", "dataloader_drop_last": True, "save_strategy": "steps",
             "save_steps": 2}
    rows = TextDataset(tokenizer, n=66)
    _, expected = trajectory_run(tokenizer, tmp_path / "plain", max_steps=10, extra=extra, dataset=rows)
    first_tuner = AdaptiveBatchTuner(tune=False)
    _, first = trajectory_run(tokenizer, tmp_path / "run", [Fault("forward", at=3), first_tuner], tuned=True,
                              max_steps=4, extra=extra, dataset=rows)
    assert read_split_file(str(tmp_path / "run")).split == Split(2, 4)
    tuner, got = AdaptiveBatchTuner(tune=False), Trajectory()
    trainer = got.attach(make_trainer(tokenizer, tmp_path / "run", [got, tuner], max_steps=10, extra=extra))
    trainer.train_dataset = rows
    train_with_tuning(trainer, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    assert {s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path / "run") if s["step"] > 4} == {4}
    assert differences(expected, got.continues(first, 4)) == []


def test_a_plain_map_style_resize_is_checked_allowed_and_exact(tokenizer, tmp_path):
    """64 rows, 8 steps an epoch, an OOM at step 3 (4×2 → 2×4) and the run crossing its epoch's end: the check
    compares step 3's rows and allows the split; the run trains what the unfaulted run trains."""
    _, expected = trajectory_run(tokenizer, tmp_path / "plain", max_steps=10, extra=SGD)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer, got = trajectory_run(tokenizer, tmp_path / "run", [Fault("forward", at=3), tuner], tuned=True,
                                  max_steps=10, extra=SGD)
    watch = tuner.executor.watch.watch
    assert (watch.reference.step, watch.reference.rows, watch.refused) == (3, 8, {})
    assert trainer.args.per_device_train_batch_size == 2 and tuner.executor.state.exactness.allows(Split(2, 4))
    assert differences(expected, got) == []
    assert json.loads((tmp_path / "run" / "tuner_split.json").read_text()).get("restricted") is None
