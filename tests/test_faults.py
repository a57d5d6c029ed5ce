"""Crash-consistent re-sizing under every fault: real Trainer and GRPOTrainer runs (CPU, tiny models) with a fault
planted at each phase of a step (:mod:`tests.faults`), processes killed at a step, and stale, partial or corrupted
state left in ``output_dir``. Each test asserts the invariants of :mod:`hf_perf_callbacks.resize.loop`: every
optimizer step trained once (``perf_log.jsonl`` and ``trainer_state.json``), the effective batch kept, a resume only
from a checkpoint this run wrote completely (its weights equal the weights at that step), nothing lost that could
have been saved.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from hf_perf_callbacks import (
    AdaptiveBatchTuner,
    MemoryWatchdog,
    MPSCacheClearer,
    ThroughputMeter,
    default_callbacks,
    keys,
    train_with_tuning,
)
from hf_perf_callbacks.common.outputdir import MOVED_ASIDE
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.runlog import SPLIT_FILE
from hf_perf_callbacks.core.splitfile import SplitFile, read_split_file, split_for_run
from hf_perf_callbacks.resize.checkpoints import is_complete, step_of
from hf_perf_callbacks.tiny import build_model
from tests.conftest import make_grpo, make_trainer
from tests.faults import SAVE_FILES, Fault, Trajectory, checkpoint_weights, differences, same

pytestmark = pytest.mark.launch   # many trainings each: with the launch suite, to keep `make test` quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVES = {"save_strategy": "steps", "save_steps": 2}


def step_lines(output_dir):
    with open(os.path.join(output_dir, "perf_log.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["type"] == "step"]


def checkpoints(output_dir):
    return sorted((step_of(n), n) for n in os.listdir(output_dir) if step_of(n) is not None)


def assert_crash_consistent(trainer, fault, output_dir, max_steps, effective, generation=None):
    """The invariants every recovered run must hold."""
    assert trainer.state.global_step == max_steps
    steps = [s["step"] for s in step_lines(output_dir)]
    assert steps == list(range(1, max_steps + 1)), steps                       # each step trained once
    logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert logged == list(range(1, max_steps + 1)), logged
    assert {s[keys.TUNER_EFFECTIVE_BATCH] for s in step_lines(output_dir)} == {effective}
    args = trainer.args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == effective
    if generation is not None:
        assert args.generation_batch_size == generation
        assert args.per_device_train_batch_size * args.steps_per_generation == generation
    for step, resumed in fault.resumed.items():                                 # resumed = what this run saved
        assert same(resumed, checkpoint_weights(os.path.join(output_dir, f"checkpoint-{step}")))
        assert same(resumed, fault.after[step]), f"resumed at {step} from weights this run did not have"
    newest = checkpoints(output_dir)[-1]
    assert is_complete(os.path.join(output_dir, newest[1]), newest[0])        # no partial one is the newest


#: phases a smaller micro-batch recovers from (an OOM in GRPO's generation is not one: see tests/test_recovery.py)
STEP_PHASES = [("trainer", "forward"), ("trainer", "backward"), ("trainer", "optimizer"),
               ("grpo", "forward"), ("grpo", "optimizer")]


@pytest.mark.parametrize("kind,phase", STEP_PHASES + [("trainer", f"save:{f}") for f in SAVE_FILES],
                         ids=lambda v: str(v))
def test_an_oom_at_any_phase_loses_and_repeats_no_step(tokenizer, tmp_path, kind, phase):
    saving = phase.startswith("save:")
    fault = Fault(phase, at=2 if saving else 3)
    tuner = AdaptiveBatchTuner(tune=False)
    if kind == "grpo":
        max_steps, effective, generation = 3, 8, 8
        trainer = make_grpo(tokenizer, tmp_path, [fault, tuner], max_steps=3, bs=4, ga=2, completion=6,
                            extra=SAVES)
    else:
        max_steps, effective, generation = 4, 8, None
        trainer = make_trainer(tokenizer, tmp_path, [fault, tuner], max_steps=4, bs=4, ga=2, extra=SAVES)
    fault.attach(trainer)
    with fault.planted_save():
        train_with_tuning(trainer)
    assert fault.fired == 1
    decision = tuner.executor.record.decisions[-1]
    assert decision.kind == "oom" and (decision.old.micro_batch, decision.new.micro_batch) == (4, 2)
    assert_crash_consistent(trainer, fault, str(tmp_path), max_steps, effective, generation)
    resumed_at = 2                      # step 3 failed (or checkpoint-2's save): back to this run's checkpoint-2
    assert decision.checkpoint.endswith(f"checkpoint-{resumed_at}") and list(fault.resumed) == [resumed_at]
    if saving:                                     # the half-written folder was moved aside, never resumed from
        assert os.path.isdir(tmp_path / MOVED_ASIDE / "checkpoint-2.partial-1")
        assert not is_complete(str(tmp_path / MOVED_ASIDE / "checkpoint-2.partial-1"), 2)


def test_an_earlier_runs_checkpoint_is_never_resumed_from(tokenizer, tmp_path):
    stale = tmp_path / "checkpoint-2"                   # a complete checkpoint-2 of another run (other weights)
    build_model(tokenizer, seed=1).save_pretrained(stale)
    (stale / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    stale_weights = checkpoint_weights(str(stale))
    fault = Fault("forward", at=3)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, tuner], max_steps=4, bs=4, ga=2))
    train_with_tuning(trainer)
    assert_crash_consistent(trainer, fault, str(tmp_path), 4, 8)
    assert not same(fault.resumed[2], stale_weights)
    assert os.path.isdir(tmp_path / MOVED_ASIDE / "checkpoint-2.stale-1")
    assert [w.step for w in tuner.executor.checkpoints.written] == [2]


@pytest.mark.parametrize("error", ["oom", "other"])
def test_a_run_that_must_end_saves_its_last_step_first(tokenizer, tmp_path, error):
    # micro-batch 1 has no smaller split (oom); any other error is raised (other): both save checkpoint-2 first
    fault = Fault("forward", at=3, error=error)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)],
                                        max_steps=4, bs=1, ga=2))
    with pytest.raises((ValueError, RuntimeError)) as raised:
        train_with_tuning(trainer)
    assert ("no exact split smaller" if error == "oom" else "planted failure") in str(raised.value)
    note = " ".join(getattr(raised.value, "__notes__", []) + getattr(raised.value.__cause__, "__notes__", []))
    assert "checkpoint-2" in note and "resume_from_checkpoint" in note
    assert is_complete(str(tmp_path / "checkpoint-2"), 2)
    assert same(checkpoint_weights(str(tmp_path / "checkpoint-2")), fault.after[2])
    # and a later run resumes from it: steps 3 and 4 are trained once
    again = Fault("forward", at=99)
    resumed = again.attach(make_trainer(tokenizer, tmp_path, [again, AdaptiveBatchTuner(tune=False)],
                                        max_steps=4, bs=1, ga=2))
    train_with_tuning(resumed, resume_from_checkpoint="last")
    assert resumed.state.global_step == 4 and same(again.resumed[2], fault.after[2])
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4]


def test_max_resizes_zero_re_raises_without_side_effects(tokenizer, tmp_path):
    fault = Fault("forward", at=2)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)],
                                        max_steps=3, bs=4, ga=2))
    import torch

    with pytest.raises(torch.OutOfMemoryError):
        train_with_tuning(trainer, max_resizes=0)
    assert checkpoints(str(tmp_path)) == [] and not os.path.exists(tmp_path / SPLIT_FILE)
    assert trainer.args.per_device_train_batch_size == 4


@pytest.mark.parametrize("limit", [2, 0], ids=["retried-smaller", "skipped"])
def test_an_oom_in_evaluation_never_changes_the_training_split(tokenizer, tmp_path, caplog, limit):
    """Each attempt of an evaluation makes a new dataloader iterator, which draws from torch's global RNG: the retry
    starts from the RNG the failed attempt started from, so training goes on with the stream of a run whose
    evaluation fitted (the same RNG at every step, weights and optimizer state); the evaluation batch is the user's
    again after the run."""
    fault = Fault("eval", at=0, times=10**6, limit=limit)
    tuner = AdaptiveBatchTuner(tune=False)
    settings = dict(max_steps=4, bs=4, ga=2, with_eval=True, extra={"eval_strategy": "steps", "eval_steps": 2,
                                                                    "per_device_eval_batch_size": 8})
    got = Trajectory()
    trainer = got.attach(fault.attach(make_trainer(tokenizer, tmp_path, [fault, tuner, got], **settings)))
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        train_with_tuning(trainer)
    assert trainer.state.global_step == 4 and tuner.executor.record.decisions == []
    assert {s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path)} == {4}
    evals = [h["step"] for h in trainer.state.log_history if "eval_loss" in h]
    if limit:
        assert evals == [2, 4]
        expected = Trajectory()
        expected.attach(make_trainer(tokenizer, tmp_path / "fits", [expected], **settings)).train()
        assert differences(expected, got) == []
    else:
        assert evals == [] and caplog.text.count("evaluations are skipped") == 1      # said once, not per eval
    assert trainer.args.per_device_eval_batch_size == 8


def test_faults_inside_the_package_never_end_training(tokenizer, tmp_path, monkeypatch, caplog):
    """The memory check's exchange, the memory readings and the cache clears fail (planted); training goes on."""
    from hf_perf_callbacks.platform.device import DeviceLayer
    from hf_perf_callbacks.resize import memcheck

    def broken(*args, **kwargs):
        raise RuntimeError("planted sensor failure")

    monkeypatch.setattr(memcheck, "gather_floats", broken)
    monkeypatch.setattr(DeviceLayer, "empty_cache", broken)
    monkeypatch.setattr(DeviceLayer, "memory", broken)
    fault = Fault("forward", at=2)
    tuner = AdaptiveBatchTuner(tune=False, memory_check=True)
    watchdog = MemoryWatchdog(limit_gb=64)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, watchdog, tuner], max_steps=3, bs=4, ga=2))
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        train_with_tuning(trainer)
    assert trainer.state.global_step == 3 and watchdog.disabled
    assert [d.kind for d in tuner.executor.record.decisions] == ["oom"]                 # no memory-check decision
    assert caplog.text.count("the memory check failed") == 1
    assert caplog.text.count("emptying the device cache failed") == 1
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3]


def test_unwritable_logs_warn_once(tokenizer, tmp_path, caplog):
    (tmp_path / "perf_log.jsonl").mkdir()              # neither file can be written
    (tmp_path / SPLIT_FILE).mkdir()
    fault = Fault("forward", at=2)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, ThroughputMeter(), tuner], max_steps=4,
                                        bs=4, ga=2, extra=SAVES))
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        train_with_tuning(trainer)
    assert trainer.state.global_step == 4 and tuner.executor.split.micro_batch == 2
    assert caplog.text.count(f"could not write {tmp_path / 'perf_log.jsonl'}") == 1
    assert caplog.text.count(f"could not write the split file in {tmp_path}") == 1


@pytest.mark.parametrize("restore", [False, True], ids=["plain", "restore_callback_states"])
def test_decision_history_survives_every_resume(tokenizer, tmp_path, restore):
    extra = {"restore_callback_states_from_checkpoint": restore, **SAVES}
    fault = Fault("forward", at=2, times=2)                 # two OOMs at step 2: 4×2 → 2×4 → 1×8
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)],
                                        max_steps=3, bs=4, ga=2, extra=extra))
    train_with_tuning(trainer)
    assert [s[keys.TUNER_RESIZES] for s in step_lines(tmp_path)] == [0, 2, 2]
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path)] == [4, 1, 1]
    record = read_split_file(str(tmp_path))
    assert len(record.decisions) == 2 and record.split == Split(1, 8)
    # a new process resumes from checkpoint-2 at the recorded split, with the whole history
    tuner = AdaptiveBatchTuner(tune=False)
    resumed = make_trainer(tokenizer, tmp_path, [tuner], max_steps=4, bs=4, ga=2, extra=extra)
    train_with_tuning(resumed, resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    from hf_perf_callbacks.resize.callback import find_callback

    live = find_callback(resumed, AdaptiveBatchTuner)          # with restore_callback_states: a rebuilt instance
    assert live.executor.record.decisions == record.decisions and live.executor.record.id == record.session
    assert resumed.args.per_device_train_batch_size == 1
    assert step_lines(tmp_path)[-1][keys.TUNER_RESIZES] == 2


def written(split: Split, world: int = 1) -> str:
    """A split file as the writer (the tuning session's record) writes it."""
    return json.dumps(SplitFile(session="s", world_size=world, configured=split, split=split).to_json())


#: malformed files are written by hand; well-formed ones that do not fit the run through the writer's own schema
BAD_RECORDS = {
    "not-json": "{\"split\": ",
    "not-an-object": "[1, 2]",
    "split-missing": json.dumps({"session": "s", "world_size": 1}),
    "strings": json.dumps({"session": "s", "world_size": 1, "split": {"micro_batch": "2", "grad_accum": 4}}),
    "booleans": json.dumps({"session": "s", "world_size": 1, "split": {"micro_batch": True, "grad_accum": 8}}),
    "3x3-is-not-8": written(Split(3, 3)),
    "16-not-8": written(Split(8, 2)),
    "grpo-split-on-a-plain-run": written(Split(2, 4, 4)),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_split_file_that_does_not_fit_the_run_is_ignored_with_one_warning(tmp_path, caplog, name):
    (tmp_path / SPLIT_FILE).write_text(BAD_RECORDS[name])
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        assert split_for_run(str(tmp_path), effective_batch=8, world_size=1) is None
    warnings = [r for r in caplog.records if SPLIT_FILE in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].getMessage()


def test_grpo_split_files_are_checked_against_the_generation_batch(tmp_path, caplog):
    def record(split):
        (tmp_path / SPLIT_FILE).write_text(written(split))
        return split_for_run(str(tmp_path), effective_batch=8, world_size=1, generation_batch=16)

    assert record(Split(2, 4, 8)) == Split(2, 4, 8)
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        assert record(Split(2, 4, 4)) is None
    assert "generation batch 8" in caplog.text and "generation batch 16" in caplog.text


def test_auto_find_batch_size_is_refused(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, [AdaptiveBatchTuner(tune=False)], max_steps=1,
                           extra={"auto_find_batch_size": True})
    with pytest.raises(ValueError, match="auto_find_batch_size=True is not allowed"):
        train_with_tuning(trainer)


@pytest.mark.parametrize("cls,bad", [(AdaptiveBatchTuner, {"samples": 0}), (AdaptiveBatchTuner, {"bogus": 1}),
                                     (MemoryWatchdog, {"limit_gb": -1}), (ThroughputMeter, {"window_steps": 0}),
                                     (MPSCacheClearer, {"interval_steps": 0}), (ThroughputMeter, {"bogus": 1})])
def test_wrong_arguments_name_the_class_and_the_key(cls, bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=rf"{cls.__name__}.*{key}"):
        cls(**bad)
    with pytest.raises(ValueError, match=rf"{cls.__name__}.*{key}"):
        default_callbacks(**{cls.__name__: bad})


def run_script(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "fault_run.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.launch
def test_sigkill_while_saving_then_resume_from_the_last_complete_checkpoint(tokenizer, tmp_path, caplog):
    done = run_script("sigkill", str(tmp_path))
    assert done.returncode == -9, done.stderr[-2000:]                   # killed while writing checkpoint-2
    assert is_complete(str(tmp_path / "checkpoint-1"), 1) and not is_complete(str(tmp_path / "checkpoint-2"), 2)
    (tmp_path / SPLIT_FILE).write_text(written(Split(3, 3)))                            # corrupted: 9 ≠ 8
    fault = Fault("forward", at=99)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, AdaptiveBatchTuner(tune=False)],
                                        max_steps=4, bs=4, ga=2, extra={"save_strategy": "steps", "save_steps": 1}))
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        train_with_tuning(trainer, resume_from_checkpoint="last")
    assert list(fault.resumed) == [1]
    assert same(fault.resumed[1], checkpoint_weights(str(tmp_path / "checkpoint-1")))
    assert os.path.isdir(tmp_path / MOVED_ASIDE / "checkpoint-2.partial-1")
    assert is_complete(str(tmp_path / "checkpoint-4"), 4)
    assert trainer.args.per_device_train_batch_size == 4 and "3×3 over 1 rank(s)" in caplog.text
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]


@pytest.mark.launch
def test_sigterm_checkpoint_still_works_after_an_in_process_resize(tmp_path):
    done = run_script("sigterm", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]                    # not killed by SIGTERM's default action
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["resizes"] == 1 and result["micro_batch"] == 2
    step = result["global_step"]
    assert 4 <= step < 8 and is_complete(str(tmp_path / f"checkpoint-{step}"), step)     # the JIT checkpoint


def test_resuming_from_a_partial_checkpoint_is_refused_with_its_name(tokenizer, tmp_path):
    partial = tmp_path / "checkpoint-3"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 16)               # trainer_state.json never written
    trainer = make_trainer(tokenizer, tmp_path, [AdaptiveBatchTuner(tune=False)], max_steps=1)
    with pytest.raises(ValueError, match=r"checkpoint-3.*not a complete checkpoint"):
        train_with_tuning(trainer, resume_from_checkpoint=str(partial))
