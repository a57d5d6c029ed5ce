"""The compatibility matrix, re-size and resume columns: for every setting a user has × every trainer, an
out-of-memory error planted in step 3's training forward re-sizes the run (2×1 → 1×2, GRPO's generation batch
kept) and the run trains exactly what an unfaulted run trains:

* **re-size exact** — in the same process (``train_with_tuning``'s in-process resume);
* **resume exact** — in a new process: a fresh trainer (seeded at its init as in a new process) on a copy of
  ``output_dir`` as the in-process resume found it (the recovery checkpoint and the split file) resumes with
  ``train_with_tuning(resume_from_checkpoint="last")`` at the recorded split. That the fresh trainer stands for a
  new process is checked for a few cells with a real one (``tests/scripts/resume_cell.py``, ``launch``).

Exactly: the same examples in every optimizer step (GRPO: the same prompts and sampled completions), the same RNG
stream (a digest of every RNG at each step's begin), learning rate at every step, final weights and optimizer
state (SGD with momentum, where Adam would hide a scaled gradient, and no gradient clipping, which rescales the
gradient and hid the left-padding difference; float summation order aside), compared by
:func:`tests.faults.differences`. Each cell trains :data:`STEPS` steps of a tiny model on the CPU, three steps per
epoch, so the resumed run crosses an epoch boundary; GRPO's rewards differ within a group, so it learns. A setting
under which an exact re-size is impossible must be refused up front with one clear line (recorded as refused), or
leave the run at its configured split, said at the start, an OOM saving and ending the run with why (recorded as
``said: <why>``; the cell then re-sizes once with the rule switched off to check that the restriction was needed,
and says so where it was not) — never be silently different.

The cells are the matrix's (``tests/compat.py``: every setting of the metrics column × every trainer, built by its
``build`` with this column's optimizer and step count); each records its outcome per column through
:func:`tests.compat.record` (``yes``, ``no: <what differed>``, ``refused: <message>``), from which
docs/compatibility.md's table is rendered.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.core.rowstream import RowWatch
from hf_perf_callbacks.core.runlog import LOCK_FILE
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.resize import exactness
from hf_perf_callbacks.resize.executor import Executor
from hf_perf_callbacks.resize.plan import InexactResize
from tests import compat
from tests.compat import CELLS, Cell
from tests.conftest import varied_reward
from tests.faults import Fault, Trajectory, differences
from tests.test_compat_matrix import first_line

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = ("resize_exact", "resume_exact", "exact_by")
STEPS, FAULT_AT, PER_EPOCH = compat.RESIZE_STEPS, compat.RESIZE_FAULT_AT, compat.RESIZE_PER_EPOCH
EXACT = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.02, "lr_scheduler_type": "linear",
         "max_grad_norm": 0.0, "report_to": "none", "disable_tqdm": True}
#: the cells in the fast suite: the defaults, and the settings that once made a re-size inexact (the rest: launch)
FAST = {"defaults | Trainer"}         # the fast suite runs one cell; `pytest -m launch` every other


def build(cell: Cell, tokenizer, output_dir, callbacks):
    """The cell's trainer (:func:`tests.compat.build`) at the configured split 2×1, :data:`STEPS` steps of
    :data:`PER_EPOCH` an epoch, SGD with momentum."""
    return compat.build(cell, tokenizer, output_dir, callbacks, steps=STEPS, per_epoch=PER_EPOCH, extra=EXACT,
                        reward=varied_reward)


# ---------------------------------------------------------------- the runs
class CopyAtResume(TrainerCallback):
    """What a new process would find: ``output_dir`` copied once the in-process re-size resumed and its first step
    was checked (the end of the second ``train()`` call's first step, before that step's save), without the lock of
    the live process."""

    def __init__(self, *targets: str):
        self.targets, self.calls, self.copied = targets, 0, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.calls == 2 and not self.copied:
            self.copied = True
            for target in self.targets:
                shutil.copytree(args.output_dir, target, ignore=shutil.ignore_patterns(LOCK_FILE + "*"))


def runs(cell: Cell, tokenizer, tmp_path, copy_to: tuple = (),
         resume: bool = True) -> tuple[Trajectory, Trajectory, Trajectory | None]:
    """(unfaulted, re-sized in process, resumed by a new trainer); ``copy_to``: more copies of what the new trainer
    resumed from."""
    expected = Trajectory()
    expected.attach(build(cell, tokenizer, tmp_path / "plain", [expected])).train()
    fault, resized, resume_dir = Fault("forward", at=FAULT_AT), Trajectory(), str(tmp_path / "resume")
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = build(cell, tokenizer, tmp_path / "run", [fault, resized, CopyAtResume(resume_dir, *copy_to), tuner])
    fault.attach(resized.attach(trainer))
    accumulation = trainer.args.gradient_accumulation_steps
    train_with_tuning(trainer)
    assert fault.fired == 1 and [d.kind for d in tuner.executor.record.decisions] == ["oom"]
    assert tuner.executor.split.micro_batch == 1 and tuner.executor.split.grad_accum == 2 * accumulation
    if not resume:
        return expected, resized, None
    resumed = Trajectory().continues(resized, FAULT_AT - 1)
    again = build(cell, tokenizer, resume_dir, [resumed, AdaptiveBatchTuner(tune=False)])
    train_with_tuning(resumed.attach(again), resume_from_checkpoint="last")
    assert again.args.per_device_train_batch_size == 1             # the recorded split, applied
    return expected, resized, resumed


def _cells():
    for cell in CELLS:
        yield pytest.param(cell, id=cell.id, marks=[] if cell.id in FAST else [pytest.mark.launch])


@pytest.mark.parametrize("cell", list(_cells()))
def test_a_resize_and_a_resume_train_exactly_what_an_unfaulted_run_trains(cell, tokenizer, tmp_path, monkeypatch,
                                                                          one_thread):
    compat.offline_mlflow(monkeypatch, tmp_path / "mlruns")
    try:
        expected, resized, resumed = runs(cell, tokenizer, tmp_path)
    except InexactResize as said:
        record = read_split_file(str(tmp_path / "run"))
        assert record.restricted is not None and record.restricted.reason in str(said)
        assert record.ended and "no smaller split keeps this run exact" in record.ended
        with monkeypatch.context() as off:                       # the re-size refused: was it inexact?
            off.setattr(Executor, "judge_grouping", lambda executor, trainer: None)       # no rule,
            off.setattr(exactness, "check", forced_exact)                                 # no check,
            off.setattr(RowWatch, "fetched", lambda watch, *args, **kwargs: None)         # no row check
            forced_expected, forced, _ = runs(cell, tokenizer, tmp_path / "forced", resume=False)
        needed = differences(forced_expected, forced)
        why = record.restricted.reason + ("" if needed else " (in this cell a forced re-size trained the same)")
        for column in ("resize_exact", "resume_exact"):
            compat.record(cell, column, f"said: {why}")
        measured = any(c.verdict == "inexact" for c in record.checks)
        compat.record(cell, "exact_by", f"{'measured' if measured else 'rule'}: {why}")
        return
    except Exception as error:
        expected_refusal = cell.setting.refused.get(cell.trainer)
        if expected_refusal is None or not re.search(expected_refusal, str(error)):
            for column in COLUMNS:
                compat.record(cell, column, f"no: {first_line(error)}")
            raise
        for column in COLUMNS:
            compat.record(cell, column, f"refused: {first_line(error)}")
        return
    found = {"resize_exact": differences(expected, resized), "resume_exact": differences(expected, resumed)}
    for column, what in found.items():
        compat.record(cell, column, "no: " + "; ".join(what) if what else "yes")
    compat.record(cell, "exact_by", exact_by(read_split_file(str(tmp_path / "run"))))
    assert found == {"resize_exact": [], "resume_exact": []}


def forced_exact(trainer, kind, step, old, new, ours, theirs, **kwargs):
    """A check that says every change is exact (to see what a re-size the rules or the check refused trains)."""
    from hf_perf_callbacks.core.splitfile import ExactnessCheck

    return ExactnessCheck(step=step, kind=kind, old=old, new=new, verdict="exact", why="forced")


def exact_by(record) -> str:
    """How the run's re-size was trusted: ``yes`` (the step it started with showed it: the check of the change),
    else what was recorded instead."""
    checks = record.checks if record is not None else []
    if checks and checks[-1].exact:
        return "yes"
    return f"rule: {checks[-1].why if checks else 'no check of a change was recorded'}"


#: cells whose resume also runs in a real new process: the check that a fresh trainer stands for one
NEW_PROCESS = ("defaults | Trainer", "defaults | GRPOTrainer", "train_sampling_strategy=group_by_length | Trainer")


@pytest.mark.launch
@pytest.mark.parametrize("cell_id", NEW_PROCESS)
def test_a_fresh_trainer_resumes_exactly_as_a_new_process_does(cell_id, tokenizer, tmp_path):
    cell = next(c for c in CELLS if c.id == cell_id)
    expected, resized, resumed = runs(cell, tokenizer, tmp_path, copy_to=(str(tmp_path / "new_process"),))
    root = os.path.dirname(HERE)
    done = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "resume_cell.py"), cell_id,
                           str(tmp_path / "new_process"), str(tmp_path / "trained.pt")], cwd=root,
                          env={**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(tmp_path / "trained.pt", weights_only=False)
    assert saved["micro_batch"] == 1
    other = Trajectory().continues(resized, FAULT_AT - 1)
    other.by_step.update(saved["by_step"])
    other.rng.update(saved["rng"])
    other.rates, other.final, other.optimizer = saved["rates"], saved["final"], saved["optimizer"]
    assert differences(expected, other) == [] and differences(resumed, other) == []
