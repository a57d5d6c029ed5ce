"""A recovery is exact under the settings users have, and whatever ends a run ends it cleanly: real Trainer and
GRPOTrainer runs (CPU, tiny models) with a fault planted (:mod:`tests.faults`), compared with the same run unfaulted
(every sample marked, the RNG stream digested at every step, SGD with momentum so that a lost optimizer state or a
scaled gradient shows in the weights).
"""
from __future__ import annotations

import json
import os

import pytest
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys, train_with_tuning
from hf_perf_callbacks.common.outputdir import MOVED_ASIDE
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.resize.checkpoints import has_training_state, is_complete
from hf_perf_callbacks.resize.oomsite import UnfixableOOM
from tests.conftest import make_grpo, make_trainer, varied_reward
from tests.faults import Fault, Trajectory, differences
from tests.test_faults import step_lines

SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear"}


def unfaulted(tokenizer, path, **kwargs) -> Trajectory:
    trajectory = Trajectory()
    trajectory.attach(make_trainer(tokenizer, path, [trajectory], **kwargs)).train()
    return trajectory


def test_save_only_model_recovery_checkpoints_hold_the_whole_training_state(tokenizer, tmp_path):
    """transformers saves checkpoint-2 with the weights alone; an OOM at step 3 goes back to it: the session saves it
    again, whole, so the schedule and SGD's momentum go on as in an unfaulted run."""
    extra = {**SGD, "save_strategy": "steps", "save_steps": 2, "save_only_model": True}
    expected = unfaulted(tokenizer, tmp_path / "plain", max_steps=5, extra=extra)
    fault, got = Fault("forward", at=3), Trajectory()
    trainer = fault.attach(got.attach(make_trainer(tokenizer, tmp_path / "run", [fault, got,
                                                   AdaptiveBatchTuner(tune=False)], max_steps=5, extra=extra)))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.args.save_only_model                  # the user's setting is left alone
    assert has_training_state(str(tmp_path / "run" / "checkpoint-2"))
    assert not has_training_state(str(tmp_path / "run" / "checkpoint-4"))    # transformers' own save: weights only
    assert differences(expected, got) == []


@pytest.mark.parametrize("at", [6, 9], ids=["within-an-epoch", "first-step-of-an-epoch"])
def test_a_recovery_resumes_the_rng_stream_where_transformers_restores_it(tokenizer, tmp_path, at):
    """The length-grouped sampler draws its order from the global RNG when an epoch's iterator is made: a recovery
    from the last step of an epoch (8 steps an epoch here) must hold the RNG from before that iterator, one within
    an epoch the RNG its next step started from; either way the run trains what an unfaulted run trains."""
    extra = {**SGD, "train_sampling_strategy": "group_by_length"}
    expected = unfaulted(tokenizer, tmp_path / "plain", max_steps=10, extra=extra)
    fault, got = Fault("forward", at=at), Trajectory()
    trainer = fault.attach(got.attach(make_trainer(tokenizer, tmp_path / "run", [fault, got,
                                                   AdaptiveBatchTuner(tune=False)], max_steps=10, extra=extra)))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.state.epoch > 1
    assert differences(expected, got) == []


def test_an_oom_while_writing_a_checkpoint_under_save_total_limit_keeps_the_complete_one(tokenizer, tmp_path,
                                                                                        monkeypatch):
    """The half-written checkpoint-4 is moved aside out of the checkpoint namespace: rotation (which sorts by step
    when the saves fall within one second, planted here) can no longer keep it as the newest and delete the
    complete one."""
    import transformers.trainer_utils

    monkeypatch.setattr(transformers.trainer_utils.os.path, "getmtime", lambda path: 0.0)
    extra = {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 1}
    fault = Fault("save:optimizer", at=4)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)], max_steps=5,
                                        extra=extra))
    with fault.planted_save():
        train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.state.global_step == 5
    assert is_complete(str(tmp_path / "checkpoint-5"), 5) and not (tmp_path / "checkpoint-4.partial-1").exists()
    assert os.listdir(tmp_path / MOVED_ASIDE) == ["checkpoint-4.partial-1"]
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bs", [4, 1], ids=["re-sizes", "saves-and-ends"])
def test_a_bare_memory_error_re_sizes_or_saves_and_ends(tokenizer, tmp_path, bs):
    fault = Fault("forward", at=3, error="bare")
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, tuner], max_steps=4, bs=bs, ga=2))
    if bs == 1:
        with pytest.raises(ValueError, match="no exact split smaller") as raised:
            train_with_tuning(trainer)
        assert "by MemoryError: MemoryError; saved" in read_split_file(str(tmp_path)).ended
        [note] = raised.value.__cause__.__notes__                          # what the error does not say, once
        assert note.startswith("[tuner] saved ") and "checkpoint-2" in note and "MemoryError" not in note
        assert is_complete(str(tmp_path / "checkpoint-2"), 2)
        return
    train_with_tuning(trainer)
    [decision] = tuner.executor.record.decisions
    assert decision.kind == "oom" and decision.reason.startswith("out of memory: MemoryError")
    assert decision.new == Split(2, 4)
    assert trainer.state.global_step == 4 and [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4]


def test_after_giving_up_the_split_file_holds_the_last_split_that_completed_steps(tokenizer, tmp_path):
    fault = Fault("forward", at=3, times=3)                 # 4×2, 2×4 and 1×8 all run out of memory at step 3
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)], max_steps=4))
    with pytest.raises(ValueError, match="no exact split smaller than 1×8"):
        train_with_tuning(trainer)
    record = read_split_file(str(tmp_path))
    assert record.split == Split(4, 2) and "training ended at step 2" in record.ended
    assert [(d.old, d.new) for d in record.decisions] == [(Split(4, 2), Split(2, 4)), (Split(2, 4), Split(1, 8))]


def test_a_run_stopped_before_a_resize_was_checked_records_the_split_that_trained(tokenizer, tmp_path):
    """Ctrl-C as the in-process re-size resumes, before 2×4's first step was checked: the record keeps 4×2, the split
    that trained the run (a resume re-sizes again, checked), and no decision that never took effect."""
    from tests.test_session import Interrupt

    fault = Fault("forward", at=3)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, Interrupt(at_call=2),
                                                              AdaptiveBatchTuner(tune=False)], max_steps=4))
    with pytest.raises(KeyboardInterrupt):
        train_with_tuning(trainer)
    record = read_split_file(str(tmp_path))
    assert record.split == Split(4, 2) and record.decisions == [] and "KeyboardInterrupt" in record.ended


class Raises(TrainerCallback):
    """A user callback (or, as ``on_log``, a reporter) that raises at optimizer step ``at``."""

    def __init__(self, event: str, at: int):
        self.event, self.at = event, at
        setattr(self, event, self.maybe_raise)

    def maybe_raise(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise RuntimeError(f"planted failure in {self.event}")


@pytest.mark.parametrize("event", ["on_step_end", "on_log"])
def test_a_callback_raising_at_a_step_leaves_every_step_of_the_checkpoint_in_the_perf_log(tokenizer, tmp_path,
                                                                                          event):
    """The user's callback comes first (on_step_end: the package's callbacks never see step 3 end) or a reporter
    raises in on_log: checkpoint-3 is saved, and so is step 3's line; the resume trains steps 4 and 5 once."""
    callbacks = [ThroughputMeter(), MemoryWatchdog(limit_gb=64), AdaptiveBatchTuner(tune=False)]
    raising = Raises(event, at=3)
    trainer = make_trainer(tokenizer, tmp_path, [raising, *callbacks] if event == "on_step_end" else callbacks,
                           max_steps=5)
    if event == "on_log":               # the reporters run before user callbacks, right after the bus
        trainer.callback_handler.callbacks.insert(1, raising)
    with pytest.raises(RuntimeError, match="planted failure"):
        train_with_tuning(trainer)
    assert is_complete(str(tmp_path / "checkpoint-3"), 3)
    line = step_lines(tmp_path)[-1]
    assert line["step"] == 3 and keys.PERF_STEP_WALL_SEC in line and keys.MEM_DEVICE_USED_GB in line
    assert line[keys.TUNER_MICRO_BATCH] == 4
    # step 3's training log, as the loop would have written it: in log_history, the checkpoint and the perf line
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == [1, 2, 3] and {"grad_norm", "learning_rate"} <= set(logged[3])
    assert line["log/loss"] == logged[3]["loss"] and line["log/learning_rate"] == logged[3]["learning_rate"]
    with open(tmp_path / "checkpoint-3" / "trainer_state.json") as f:
        saved = [h["step"] for h in json.load(f)["log_history"] if "loss" in h]
    assert saved == [1, 2, 3]
    resumed = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), AdaptiveBatchTuner(tune=False)], max_steps=5)
    train_with_tuning(resumed, resume_from_checkpoint="last")
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4, 5]
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4, 5]
    plain = make_trainer(tokenizer, tmp_path / "plain", [], max_steps=5)
    plain.train()                                       # the same losses and learning rates as an unfaulted run
    for key in ("loss", "learning_rate"):
        expected = {h["step"]: h[key] for h in plain.state.log_history if "loss" in h}
        assert {h["step"]: h[key] for h in resumed.state.log_history if "loss" in h} == pytest.approx(expected,
                                                                                                      rel=1e-5)


def recorder(seen):
    def reward(prompts, completions, completion_ids=None, **kwargs):
        seen.append(tuple(tuple(ids) for ids in completion_ids))
        return varied_reward(prompts, completions, completion_ids)
    return reward


def test_a_grpo_recovery_checkpoint_holds_the_rng_its_next_step_starts_from(tokenizer, tmp_path):
    """An OOM in step 3's training forward, after step 3's generation drew from the RNG: the recovery checkpoint-2
    holds the RNG step 3 started from, so the resumed run samples the completions of an unfaulted run."""
    plain, seen = [], []
    make_grpo(tokenizer, tmp_path / "plain", [], max_steps=4, completion=6, reward=recorder(plain)).train()
    fault = Fault("forward", at=3)
    trainer = fault.attach(make_grpo(tokenizer, tmp_path / "run", [fault, AdaptiveBatchTuner(tune=False)],
                                     max_steps=4, completion=6, reward=recorder(seen)))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.args.per_device_train_batch_size == 2
    assert seen[2] == plain[2] and seen[3:] == plain[2:]          # the failed attempt's rollout, then the same again


def grpo_oom(tokenizer, path, reward, fault=None):
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = make_grpo(tokenizer, path, [fault, tuner] if fault else [tuner], max_steps=4, completion=6,
                        reward=reward)
    if fault:
        fault.attach(trainer)
    with pytest.raises(UnfixableOOM) as raised:
        train_with_tuning(trainer)
    assert tuner.executor.record.decisions == [] and trainer.args.per_device_train_batch_size == 4     # no re-size
    record = read_split_file(str(path))
    assert record.split == Split(4, 2, 2) and record.ended.startswith("training ended at step 2 by UnfixableOOM")
    assert str(raised.value) in record.ended                              # the cause and its fix, whole
    assert is_complete(str(path / "checkpoint-2"), 2)
    [note] = raised.value.__notes__                               # what was saved, not the error's words again
    assert "saved" in note and "checkpoint-2" in note and str(raised.value) not in note
    return str(raised.value)


def test_an_oom_in_grpo_generation_is_named_and_not_re_sized(tokenizer, tmp_path):
    message = grpo_oom(tokenizer, tmp_path, varied_reward, Fault("generation", at=3))
    assert message.startswith("out of memory in generation (CUDA out of memory")
    assert "generation_batch_size" in message and "max_completion_length=6" in message and "use_vllm" in message


def test_an_oom_in_a_reward_function_is_named_and_not_re_sized(tokenizer, tmp_path):
    calls = []

    def judge(prompts, completions, completion_ids=None, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError()
        return varied_reward(prompts, completions, completion_ids)

    message = grpo_oom(tokenizer, tmp_path, judge)
    assert message.startswith("out of memory in the reward function 'judge' (MemoryError)")


def test_the_watchdog_stop_says_to_resume_through_the_interface_that_ran(tokenizer, tmp_path):
    from tests.test_watchdog import FakeMPS

    messages = {}
    for how in ("train", "train_with_tuning"):
        watchdog = MemoryWatchdog(limit_gb=7.0, grace_steps=1)
        trainer = make_trainer(tokenizer, tmp_path / how, [watchdog, AdaptiveBatchTuner(tune=False)], max_steps=5,
                               bs=1, ga=8)                     # no smaller micro-batch: the watchdog stops
        watchdog.device = FakeMPS(driver_gb=[12.0])
        trainer.train() if how == "train" else train_with_tuning(trainer)
        [stop] = [a["message"] for a in watchdog.actions if a["action"] == "stop"]
        messages[how] = stop
    assert "Resume with trainer.train(resume_from_checkpoint=" in messages["train"]
    assert "Resume with train_with_tuning(trainer, resume_from_checkpoint=" in messages["train_with_tuning"]


def test_a_resume_in_a_later_epoch_draws_that_epochs_order_from_a_sampler_with_its_own_generator():
    """GRPO's RepeatSampler shuffles with a generator of its own and has no set_epoch, and transformers 5 no longer
    fast-forwards the epochs a resume skips: a fresh dataloader would draw the first epoch's order again. The tuner
    advances it by the epochs trained (seen in the re-size matrix: GRPO with two prompts an epoch, re-sized at the
    epoch's end, trained other prompts in the second epoch)."""
    import torch
    from trl.trainer.utils import RepeatSampler

    from hf_perf_callbacks.resize.callback import advance_sampler

    def loader():
        sampler = RepeatSampler(list(range(8)), mini_repeat_count=2, batch_size=2, repeat_count=1, shuffle=True,
                                seed=0)
        return torch.utils.data.DataLoader(list(range(8)), batch_size=4, sampler=sampler)

    once = loader()
    orders = [[int(i) for batch in once for i in batch] for _ in range(3)]      # epochs 0, 1, 2 of one run
    assert orders[0] != orders[1]
    resumed = loader()
    assert advance_sampler(resumed, 2) == 2
    assert [int(i) for batch in resumed for i in batch] == orders[2]
    sequential = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    assert advance_sampler(sequential, 2) == 0                                    # nothing shuffled: untouched


def counters(history) -> dict[int, tuple]:
    return {h["step"]: (h.get("num_input_tokens_seen"), h.get("loss")) for h in history if "loss" in h}


@pytest.mark.parametrize("tokens", ["non_padding", True], ids=["non_padding", "all"])
def test_a_step_left_mid_way_counts_no_tokens_and_no_flos(tokenizer, tmp_path, tokens):
    """An OOM in step 3's second micro-batch, after the first was trained and counted: the tokens and FLOPs of the
    left step are taken back, so every log, the recovery checkpoint and the end of the run count what an unfaulted
    run counts (examples of one length: every split counts alike)."""
    import json

    extra = {**SGD, "include_num_input_tokens_seen": tokens}
    settings = dict(max_steps=5, extra=extra, length=12)
    plain = make_trainer(tokenizer, tmp_path / "plain", [], **settings)
    plain.train()
    fault = Fault("forward", at=3, micro_batch=2)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path / "run", [fault, AdaptiveBatchTuner(tune=False)],
                                        **settings))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.args.per_device_train_batch_size == 2
    assert trainer.state.num_input_tokens_seen == plain.state.num_input_tokens_seen > 0
    assert trainer.state.total_flos == plain.state.total_flos > 0
    got, expected = counters(trainer.state.log_history), counters(plain.state.log_history)
    assert {s: t for s, (t, _) in got.items()} == {s: t for s, (t, _) in expected.items()}
    with open(tmp_path / "run" / "checkpoint-2" / "trainer_state.json") as f:
        saved = json.load(f)
    assert saved["num_input_tokens_seen"] == expected[2][0]
    assert saved["total_flos"] == pytest.approx(plain.state.total_flos * 2 / 5, rel=1e-12)


@pytest.mark.parametrize("kind", ["oom", "switch"])
def test_the_loss_logged_after_a_resize_covers_the_steps_of_the_unfaulted_runs_window(tokenizer, tmp_path, kind):
    """logging_steps=4, a re-size in step 6 resumes from checkpoint-5: step 8's loss is the mean of steps 5-8, as in
    the unfaulted run (step 5's loss is carried into the resumed train()), not of 6-8; and the left step's first
    micro-batch adds nothing to it."""
    extra = {**SGD, "logging_steps": 4}
    plain = make_trainer(tokenizer, tmp_path / "plain", [], max_steps=10, extra=extra)
    plain.train()
    fault = Fault("forward", at=6, micro_batch=2)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, tmp_path / "run", [fault, tuner] if kind == "oom" else [tuner],
                           max_steps=10, extra=extra)
    if kind == "oom":
        fault.attach(trainer)
    else:                                   # the watchdog's re-size: a switch at the begin of step 6
        class Asks(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 5:
                    tuner.executor.request_switch(Split(2, 4), "planted")
        trainer.add_callback(Asks())
    train_with_tuning(trainer)
    assert trainer.args.per_device_train_batch_size == 2
    got, expected = counters(trainer.state.log_history), counters(plain.state.log_history)
    assert sorted(got) == sorted(expected) == [4, 8]
    assert {s: loss for s, (_, loss) in got.items()} == pytest.approx({s: loss for s, (_, loss) in expected.items()},
                                                                      rel=1e-5)


#: GRPO settings where a step replays completions generated at an earlier step (generation batch 8 each)
REPLAYS = {"num_iterations": dict(bs=4, ga=2, extra={"num_iterations": 2}),
           "steps_per_generation": dict(bs=2, ga=2, extra={"steps_per_generation": 4})}


@pytest.mark.parametrize("setting", list(REPLAYS))
def test_a_grpo_resize_in_a_step_that_replays_completions_replays_the_same_ones(tokenizer, tmp_path, setting):
    """Step 2 trains completions generated at step 1 (num_iterations=2, or steps_per_generation=4 over 2
    accumulation steps); an OOM in its second micro-batch resumes from checkpoint-1 at a smaller micro-batch: the
    buffered completions are kept, re-split for the new micro-batch, and step 2 trains the same rows as the unfaulted
    run, from the same RNG, to the same weights and momentum; tokens and logged windows as unfaulted too."""
    config = REPLAYS[setting]
    extra = {**SGD, "learning_rate": 0.01, **config["extra"]}
    settings = dict(max_steps=4, completion=6, bs=config["bs"], ga=config["ga"], reward=varied_reward)
    expected = Trajectory()
    plain = expected.attach(make_grpo(tokenizer, tmp_path / "plain", [expected], extra=extra, **settings))
    plain.train()
    fault, got = Fault("forward", at=2, micro_batch=2), Trajectory()
    trainer = fault.attach(got.attach(make_grpo(tokenizer, tmp_path / "run", [fault, got,
                                                AdaptiveBatchTuner(tune=False)], extra=extra, **settings)))
    train_with_tuning(trainer)
    assert fault.fired == 1 and trainer.args.per_device_train_batch_size == config["bs"] // 2
    assert trainer.args.generation_batch_size == plain.args.generation_batch_size
    assert differences(expected, got) == []
    assert trainer.state.num_input_tokens_seen == plain.state.num_input_tokens_seen
    for key in ("loss", "reward", "num_tokens"):
        assert {h["step"]: h[key] for h in trainer.state.log_history if key in h} == pytest.approx(
            {h["step"]: h[key] for h in plain.state.log_history if key in h}, rel=1e-5, abs=1e-7), key


def test_a_grpo_resize_that_could_not_replay_the_buffer_saves_and_ends_with_why(tokenizer, tmp_path, monkeypatch):
    """A buffer that cannot be re-split (planted: its completions counted as images) is refused before the re-size
    changes anything: no oom decision, the split in effect kept, checkpoint-1 saved, the reason and what to change
    in the error and the split file."""
    from hf_perf_callbacks.platform import adapter
    from hf_perf_callbacks.resize.plan import InexactResize

    monkeypatch.setattr(adapter, "IMAGE_KEYS", ("completion_ids",))
    fault, tuner = Fault("forward", at=2, micro_batch=2), AdaptiveBatchTuner(tune=False)
    trainer = fault.attach(make_grpo(tokenizer, tmp_path, [fault, tuner], max_steps=3, completion=6,
                                     extra=REPLAYS["num_iterations"]["extra"]))
    with pytest.raises(InexactResize, match="num_iterations=2") as raised:
        train_with_tuning(trainer)
    assert "images" in str(raised.value) and "per_device_train_batch_size=2" in str(raised.value)
    assert tuner.executor.record.decisions == [] and trainer.args.per_device_train_batch_size == 4
    record = read_split_file(str(tmp_path))
    assert record.split == Split(4, 2, 2) and record.ended.startswith("training ended at step 1 by ReplayLost")
    assert is_complete(str(tmp_path / "checkpoint-1"), 1)


def told(error: BaseException) -> str:
    """Everything the error says: its message and the notes on it and on its cause."""
    cause = error.__cause__
    return " ".join([str(error), *getattr(error, "__notes__", []), *getattr(cause, "__notes__", [])])


@pytest.mark.parametrize("at", [3, 1], ids=["saved", "nothing-to-save"])
def test_an_inexact_resize_says_one_thing_what_was_saved_or_why_not(tokenizer, tmp_path, at):
    """Left padding leaves no smaller split exact: an OOM at step 3 saves checkpoint-2 and the error names it as the
    checkpoint to go on from; at step 1 nothing was trained, so nothing is saved and the error says why, never that
    the run is saved."""
    from hf_perf_callbacks.resize import InexactResize

    fault = Fault("forward", at=at)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)], max_steps=4,
                                        padding_side="left"))
    with pytest.raises(InexactResize) as raised:
        train_with_tuning(trainer)
    inexact, record = raised.value, read_split_file(str(tmp_path))
    assert not hasattr(raised.value, "__notes__") and str(inexact) in record.ended     # said once, by the error
    if at == 3:
        checkpoint = str(tmp_path / "checkpoint-2")
        assert inexact.checkpoint == checkpoint and is_complete(checkpoint, 2)
        assert f"resume_from_checkpoint={checkpoint!r}" in str(inexact)              # to go on anyway at 2×4
        assert f"train_with_tuning(trainer, resume_from_checkpoint={checkpoint!r})" in record.ended
        assert "not saved" not in told(inexact) and "start again" not in told(inexact)
    else:
        assert inexact.checkpoint is None and not any(n.startswith("checkpoint-") for n in os.listdir(tmp_path))
        assert "no optimizer step was completed" in told(inexact) and "resume_from_checkpoint=" not in told(inexact)
        assert "is saved" not in told(inexact)


def test_an_inexact_resize_every_rank_agreed_on_saves_the_last_completed_step(tokenizer, tmp_path, monkeypatch):
    """Under several ranks the ranks agree on an OOM inside the step and every rank raises ``ResizeNeeded``
    together, so every rank can save, as for any agreed stop. One process stands for them here: it counts two ranks
    once training runs, and the agreement's error is planted at step 3 (two real ranks:
    tests/test_distributed.py)."""
    from hf_perf_callbacks.resize import InexactResize

    tuner = AdaptiveBatchTuner(tune=False)

    class SeesTwoRanks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            tuner.executor.world = 2

    fault = Fault("forward", at=3, error="agreed")
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, tuner, SeesTwoRanks()], max_steps=4,
                                        padding_side="left"))
    with pytest.raises(InexactResize) as raised:
        train_with_tuning(trainer)
    checkpoint = str(tmp_path / "checkpoint-2")
    assert raised.value.checkpoint == checkpoint and is_complete(checkpoint, 2)
    assert not hasattr(raised.value, "__notes__") and str(raised.value) in read_split_file(str(tmp_path)).ended


FASTER_LARGER = {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0}    # the tuner measures 2×4 and asks for 8×1 after step 7
SWITCHING = {**SGD, "max_grad_norm": 0.0}


def switching_run(tokenizer, path, callbacks, tuned=True, **kwargs):
    """A run of 2×4 whose tuning switches to 8×1 at the end of step 7 (planted step times; no padding, so every
    split trains the same loss)."""
    from tests.conftest import PlantedClock
    from tests.test_tuner import PlantedStepTime

    clock = PlantedClock()
    tuner = [AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)] if tuned else []
    return make_trainer(tokenizer, path, [*callbacks, PlantedStepTime(clock, FASTER_LARGER), *tuner], bs=2, ga=4,
                        length=16, **kwargs)


@pytest.mark.parametrize("where", ["resize", "switch"])
def test_ctrl_c_while_the_package_saves_its_own_checkpoint_saves_and_says_how_to_resume(tokenizer, tmp_path, where):
    """Ctrl-C lands while the package writes its own checkpoint: a re-size's (an OOM at step 3, checkpoint-2) or a
    tuning switch's (checkpoint-7). The half-written folder is moved aside, the step is saved whole, the split file
    says how the run ended, the error carries the resume command, and ``resume_from_checkpoint="last"`` trains what
    the uninterrupted run trains."""
    at = 2 if where == "resize" else 7
    settings = {"max_steps": at + 2, "extra": SWITCHING, "bs": 2, "ga": 4, "length": 16}
    interrupt, got = Fault("save:optimizer", at=at, error="interrupt"), Trajectory()
    if where == "resize":
        fault = Fault("forward", at=3)
        trainer = fault.attach(got.attach(make_trainer(tokenizer, tmp_path / "run", [fault, got,
                                                       AdaptiveBatchTuner(tune=False)], **settings)))
    else:
        trainer = got.attach(switching_run(tokenizer, tmp_path / "run", [got], max_steps=at + 2, extra=SWITCHING))
    with interrupt.planted_save(), pytest.raises(KeyboardInterrupt) as raised:
        train_with_tuning(trainer)
    assert interrupt.fired == 1
    checkpoint = str(tmp_path / "run" / f"checkpoint-{at}")
    assert is_complete(checkpoint, at) and has_training_state(checkpoint)
    record = read_split_file(str(tmp_path / "run"))
    [note] = raised.value.__notes__                   # the file's end line, less the error's own words
    assert record.ended is not None and note.startswith("[tuner] saved ")
    assert " ".join(note.removeprefix("[tuner] ").split()) in " ".join(record.ended.split())
    assert f"resume_from_checkpoint={checkpoint!r}" in record.ended and f"resume_from_checkpoint={checkpoint!r}" in note
    assert os.listdir(tmp_path / "run" / MOVED_ASIDE) == [f"checkpoint-{at}.partial-1"]
    again, seen = Trajectory().continues(got, at), Fault("forward", at=99)
    resumed = seen.attach(again.attach(make_trainer(tokenizer, tmp_path / "run", [again, seen,
                                                    AdaptiveBatchTuner(tune=False)], **settings)))
    train_with_tuning(resumed, resume_from_checkpoint="last")
    assert list(seen.resumed) == [at]
    assert differences(unfaulted(tokenizer, tmp_path / "plain", **settings), again) == []


def test_the_users_weights_only_checkpoint_at_a_switch_step_is_never_rewritten_or_moved(tokenizer, tmp_path):
    """``save_only_model=True`` and ``save_steps`` on the tuning's switch step (7): the switch's whole-state checkpoint
    goes to the package's own folder; the user's checkpoint-7 and checkpoint-14 stay where the user's settings put
    them, with the same files as untuned (the weights alone), and the run trains what the untuned run trains."""
    import torch

    from tests.faults import checkpoint_weights
    from tests.test_tuner import find_tuner

    settings = {"max_steps": 14, "extra": {**SWITCHING, "save_strategy": "steps", "save_steps": 7,
                                           "save_only_model": True}}
    got, expected = Trajectory(), Trajectory()
    tuned = got.attach(switching_run(tokenizer, tmp_path / "tuned", [got], **settings))
    train_with_tuning(tuned)
    assert any(d.kind == "tune" for d in find_tuner(tuned).executor.record.decisions)
    expected.attach(switching_run(tokenizer, tmp_path / "plain", [expected], tuned=False, **settings)).train()
    assert differences(expected, got) == []

    def users(path):
        return {n: sorted(os.listdir(path / n)) for n in os.listdir(path) if n.startswith("checkpoint-")}

    assert users(tmp_path / "tuned") == users(tmp_path / "plain") and sorted(users(tmp_path / "plain")) == [
        "checkpoint-14", "checkpoint-7"]
    assert os.listdir(tmp_path / "tuned" / "tuner_switch") == []        # the switch's own save, removed at the end
    for name in users(tmp_path / "plain"):
        assert not has_training_state(str(tmp_path / "tuned" / name))
        mine, theirs = checkpoint_weights(str(tmp_path / "tuned" / name)), checkpoint_weights(str(tmp_path / "plain"
                                                                                                  / name))
        assert all(torch.allclose(mine[k], theirs[k], rtol=1e-4, atol=1e-6) for k in theirs)
