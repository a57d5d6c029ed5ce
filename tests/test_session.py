"""The tuning session owns the split, the decisions, the checkpoints this run wrote and the run's identity: whatever
ends a call leaves one split; each fresh run is its own; another process's files are never taken for this run's."""
import os
import shutil
import subprocess
import sys

import pytest
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, ThroughputMeter, keys, train_with_tuning
from hf_perf_callbacks.common.outputdir import OutputDirBusy
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.runlog import LOCK_FILE, SPLIT_FILE, read_run
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.platform import adapter
from hf_perf_callbacks.resize import current_split
from tests.conftest import PlantedClock, make_trainer
from tests.faults import Fault, SampleRecorder
from tests.test_tuner import PlantedStepTime, step_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Interrupt(TrainerCallback):
    """Ctrl-C at the begin of the ``at``-th train() call (after a switch applied its split) or inside step ``step``."""

    def __init__(self, at_call=None, step=None):
        self.at_call, self.step, self.calls = at_call, step, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls += 1
        if self.calls == self.at_call:
            raise KeyboardInterrupt

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:         # the step's micro-batches ran, its optimizer step did not
            raise KeyboardInterrupt


def consistent(trainer, tuner) -> Split:
    """The trainer's args, the dataloader batch size and the session agree on one split."""
    split = current_split(trainer.args)
    assert adapter.train_batch_size(trainer) == split.micro_batch
    assert tuner.executor.split == split
    return split


@pytest.mark.parametrize("where", ["switch", "step"])
def test_ctrl_c_leaves_one_split_that_the_next_train_trains_and_logs(tokenizer, tmp_path, where):
    clock = PlantedClock()
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)
    stop = Interrupt(at_call=2) if where == "switch" else Interrupt(step=5)
    trainer = make_trainer(tokenizer, tmp_path, [stop, PlantedStepTime(clock, {8: 50.0, 4: 100.0, 2: 200.0,
                                                                               1: 400.0}), tuner],
                           max_steps=12, bs=2, ga=4, length=16)
    with pytest.raises(KeyboardInterrupt):
        train_with_tuning(trainer)
    split = consistent(trainer, tuner)
    samples = SampleRecorder()
    samples.attach(trainer).add_callback(samples)
    trainer.remove_callback(stop)
    trainer.args.max_steps = 2
    trainer.train()                                                  # a plain train() afterwards
    logged = [s[keys.TUNER_EFFECTIVE_BATCH] for s in step_lines(tmp_path)][-2:]
    trained = [len(rows) for rows in samples.trained().values()]
    assert logged == trained == [split.effective_batch()] * 2        # what it logs is what it trains


def test_a_second_fresh_run_of_one_trainer_is_a_run_of_its_own(tokenizer, tmp_path):
    fault = Fault("forward", at=2)
    tuner, meter = AdaptiveBatchTuner(tune=False), ThroughputMeter()
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, meter, tuner], max_steps=3, bs=4, ga=2))
    train_with_tuning(trainer)
    first = tuner.executor.record.id
    assert [d.kind for d in tuner.executor.record.decisions] == ["oom"]
    trainer.args.max_steps = 2
    train_with_tuning(trainer)                                       # again, from step 0: a new run
    assert tuner.executor.record.id != first and tuner.executor.record.decisions == []
    run = read_run(str(tmp_path))
    assert [s.step for s in run.steps] == [1, 2] and run.replaced_runs == 1
    assert [s.get(keys.TUNER_RESIZES) for s in run.steps] == [0, 0]
    assert meter.summary["steps"] == 2                               # the meter counts this run only
    # the split file holds this run's record now (no change: no check), not the first run's decisions
    record = read_split_file(str(tmp_path), session=run.header().session)
    assert record is not None and record.session == tuner.executor.record.id != first
    assert record.decisions == [] and record.checks == []


def test_a_plain_fresh_train_after_another_is_its_own_run_too(tokenizer, tmp_path):
    meter = ThroughputMeter()
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=2)
    trainer.train()
    trainer.train()
    run = read_run(str(tmp_path))
    assert [s.step for s in run.steps] == [1, 2] and run.replaced_runs == 1 and meter.summary["steps"] == 2


def test_a_checkpoint_another_process_rewrote_is_never_resumed_from(tokenizer, tmp_path):
    """checkpoint-2 of this run is replaced by another run's checkpoint-2 (same name, other weights) before an
    OOM inside optimizer.step at step 3 needs to go back: the fingerprint no longer matches, so the run refuses to
    resume from it instead of training on another run's weights."""
    other = tmp_path / "other"
    make_trainer(tokenizer, other, [], max_steps=2, extra={"save_strategy": "steps", "save_steps": 2,
                                                            "learning_rate": 0.5}).train()

    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:                   # after transformers saved this run's checkpoint-2
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                shutil.rmtree(tmp_path / "run" / "checkpoint-2")
                shutil.copytree(other / "checkpoint-2", tmp_path / "run" / "checkpoint-2")

    fault = Fault("optimizer", at=3)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path / "run", [fault, tuner, Replace()], max_steps=4,
                                        extra={"save_strategy": "steps", "save_steps": 2}))
    with pytest.raises(RuntimeError, match="before this run saved any complete checkpoint"):
        train_with_tuning(trainer)
    assert [w.step for w in tuner.executor.checkpoints.written] == [2] and not tuner.executor.checkpoints.is_ours(2)


def test_a_second_process_in_the_same_output_dir_is_refused_naming_the_first(tokenizer, tmp_path):
    """A live process holds the output_dir: plain train() and train_with_tuning are refused before they write
    anything, with a message for a run that never started (no checkpoint to save, nothing to resume)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hf_perf_callbacks.common.outputdir import "
                               "OutputDirLock; OutputDirLock().acquire(sys.argv[1]); print('locked', flush=True); "
                               "time.sleep(120)", str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter()], max_steps=1)
        with pytest.raises(OutputDirBusy, match=f"another training process \\(pid {holder.pid} on "):
            trainer.train()
        tuned = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), AdaptiveBatchTuner(tune=False)], max_steps=1)
        with pytest.raises(OutputDirBusy) as refused:
            train_with_tuning(tuned)
        said = str(refused.value) + " ".join(getattr(refused.value, "__notes__", []))
        assert "did not start" in said and "checkpoint-0" not in said and "must start again" not in said
        assert not os.path.exists(tmp_path / SPLIT_FILE) and tuned.state.global_step == 0
    finally:
        holder.kill()
        holder.wait()
    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter()], max_steps=1)
    trainer.train()                                      # the lock died with its process
    assert trainer.state.global_step == 1


def another_process_can_lock(output_dir) -> bool:
    """Whether a process of its own (filelock alone: a fast start) can take the output_dir's lock now."""
    done = subprocess.run([sys.executable, "-c", "import sys; from filelock import FileLock, Timeout\ntry:\n"
                           "    FileLock(sys.argv[1], timeout=0).acquire(); print('free')\nexcept Timeout:\n"
                           "    print('held')", os.path.join(str(output_dir), LOCK_FILE)], capture_output=True,
                          text=True, timeout=120)
    return done.stdout.strip() == "free"


@pytest.mark.parametrize("how", ["trainer.train", "train_with_tuning"])
def test_the_lock_is_released_and_its_file_removed_when_train_ends_by_an_error_too(tokenizer, tmp_path, how):
    """A run that ended with an error in a process that lives on (a notebook) does not keep the output_dir from the
    resume command it printed; a run that ended normally leaves no lock file behind."""
    class Fails(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("planted failure")

    callbacks = [ThroughputMeter(), AdaptiveBatchTuner(tune=False), Fails()]
    trainer = make_trainer(tokenizer, tmp_path / "failed", callbacks, max_steps=3)
    with pytest.raises(RuntimeError, match="planted failure"):
        trainer.train() if how == "trainer.train" else train_with_tuning(trainer)
    assert not os.path.exists(tmp_path / "failed" / LOCK_FILE) and another_process_can_lock(tmp_path / "failed")
    ended = make_trainer(tokenizer, tmp_path / "ended", [ThroughputMeter()], max_steps=1)
    ended.train() if how == "trainer.train" else train_with_tuning(ended)
    assert not [n for n in os.listdir(tmp_path / "ended") if n.startswith(LOCK_FILE)]


@pytest.mark.parametrize("filesystem", ["read-only", "no flock"])
def test_an_output_dir_that_cannot_hold_a_lock_trains_as_transformers_does(tokenizer, tmp_path, monkeypatch, caplog,
                                                                          filesystem):
    """Faked for the lock file alone (this machine runs as root, where a read-only directory stays writable): a
    read-only file system fails to open it (EROFS), a file system without flock fails flock with ENOSYS (filelock's
    documented cases). The run trains to its end, with at most one warning."""
    import builtins
    import errno
    import fcntl
    import logging

    if filesystem == "read-only":
        real_open, real_os_open = builtins.open, os.open

        def refuse(path):
            if str(path).endswith(LOCK_FILE) or LOCK_FILE + "." in str(path):
                raise OSError(errno.EROFS, "Read-only file system", str(path))

        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: refuse(path) or real_open(path, *a, **k))
        monkeypatch.setattr(os, "open", lambda path, *a, **k: refuse(path) or real_os_open(path, *a, **k))
    else:
        def no_flock(fd, operation):
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(fcntl, "flock", no_flock)
    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), AdaptiveBatchTuner(tune=False)], max_steps=2)
    with caplog.at_level(logging.WARNING):
        train_with_tuning(trainer)
        trainer.train()                                  # a second call: not warned again
    assert trainer.state.global_step == 2
    assert caplog.text.count("cannot lock") <= 1


@pytest.mark.parametrize("step", [True, -1, 2.5, "4", None])
def test_a_written_checkpoint_whose_step_is_not_a_step_is_malformed(step):
    # a bool is an int to isinstance: a hand-edited `"step": true` must not read as checkpoint-1
    from hf_perf_callbacks.core.splitfile import SplitFileError, WrittenCheckpoint

    assert WrittenCheckpoint.from_json({"step": 4, "fingerprint": "ab"}) == WrittenCheckpoint(4, "ab")
    with pytest.raises(SplitFileError, match="expected"):
        WrittenCheckpoint.from_json({"step": step, "fingerprint": "ab"})


@pytest.mark.parametrize("grouping, expected", [("right padding", Split(1, 8)), ("dropout", None)])
def test_a_launcher_restart_resumes_only_with_a_smaller_split_the_rules_allow(tokenizer, tmp_path, monkeypatch,
                                                                             grouping, expected):
    """Under FSDP an out-of-memory error the ranks could not agree on ends the process and records the split the
    launcher's restart resumes with (checked at its first step): the next smaller split the run's rules allow, none
    where only the configured one is (dropout: each micro-batch draws its own masks), and the message says the
    restart would fail again."""
    from hf_perf_callbacks.core.batching import Grouping
    from hf_perf_callbacks.resize import grouping as grouping_module
    from hf_perf_callbacks.resize import plan, sharding
    from hf_perf_callbacks.resize.executor import Executor

    facts = Grouping(rows=64) if grouping == "right padding" else Grouping(dropout=True, rows=64)
    monkeypatch.setattr(grouping_module, "read_grouping", lambda trainer, planned, world: facts)
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=4, bs=2, ga=4, length=16)
    executor = Executor(trainer.args)
    executor.judge_grouping(trainer)
    assert plan.on_restart(executor.snapshot()).new == expected
    message = sharding.restart_message(3, expected, None, executor.state.exactness)
    if expected is None:
        assert "would run out of memory again" in message and executor.state.exactness.fix in message
    else:
        assert f"with the split {expected}" in message
