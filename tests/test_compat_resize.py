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
state (SGD with momentum, where Adam would hide a scaled gradient; float summation order aside), compared by
:func:`tests.faults.differences`. Each cell trains :data:`STEPS` steps of a tiny model on the CPU, three steps per
epoch, so the resumed run crosses an epoch boundary. A setting under which an exact re-size is impossible must be
refused up front with one clear line (recorded as refused), never be silently different.

The settings keep the names of the matrix's metrics column (``tests/compat.py`` once it lands); each cell records
its outcome per column in :data:`RESULTS` (``yes``, ``no: <what differed>``, ``refused: <message>``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.batching import Split
from hf_perf_callbacks.runlog import LOCK_FILE
from tests.conftest import CORPUS, PROMPTS
from tests.faults import Fault, Trajectory, differences

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "compat_resize_results.json")
COLUMNS = ("resize_exact", "resume_exact")
TRAINERS = ("Trainer", "SFTTrainer", "DPOTrainer", "GRPOTrainer")

STEPS, FAULT_AT, PER_EPOCH = 4, 3, 3      # optimizer steps; the step whose forward runs out of memory; steps/epoch
BATCH = 2                                 # the configured micro-batch (accumulation 1); the re-size goes to 1×2
EXACT = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.02, "lr_scheduler_type": "linear",
         "logging_steps": 1, "seed": 0, "use_cpu": True, "disable_tqdm": True, "report_to": "none"}
SAVE_EVERY_STEP = {"save_strategy": "steps", "save_steps": 1}
EVAL_EVERY_STEP = {"eval_strategy": "steps", "eval_steps": 1}
LENGTHS_UNKNOWN = "Can only automatically infer lengths for datasets whose items are dictionaries with an 'input_ids'"


@dataclass(frozen=True)
class Setting:
    """One row: what a user sets, alone (the metrics column's names)."""

    name: str
    args: dict = field(default_factory=dict)
    iterable: bool = False                        # the training data as a datasets.IterableDataset
    epochs: bool = False                          # num_train_epochs instead of max_steps
    evaluate: bool = False                        # an evaluation dataset
    refused: dict = field(default_factory=dict)   # trainer → regex of the message it may refuse the setting with
                                                  # (allowed, not required: some hold for older versions only)
    fast: tuple = ()                              # trainers whose cell runs in the fast suite (the rest: launch)


SAMPLERS = ("random", "sequential", "group_by_length", "batch_rebalance")
SETTINGS = [
    Setting("defaults", fast=TRAINERS),
    *[Setting(f"include_num_input_tokens_seen={v}", {"include_num_input_tokens_seen": v})
      for v in ("all", "non_padding")],
    *[Setting(f"train_sampling_strategy={v}", {"train_sampling_strategy": v}, fast=("Trainer",),
              refused={"DPOTrainer": LENGTHS_UNKNOWN} if v in ("group_by_length", "batch_rebalance") else {})
      for v in SAMPLERS],
    Setting("save_only_model=True", {**SAVE_EVERY_STEP, "save_only_model": True}, fast=("Trainer",)),
    Setting("save_total_limit=1", {**SAVE_EVERY_STEP, "save_total_limit": 1}, fast=("Trainer",)),
    Setting("save_strategy=no", {"save_strategy": "no"}),
    Setting("save_strategy=steps", SAVE_EVERY_STEP),
    Setting("save_strategy=epoch", {"save_strategy": "epoch"}, epochs=True),
    Setting("load_best_model_at_end=True", {**SAVE_EVERY_STEP, **EVAL_EVERY_STEP, "load_best_model_at_end": True},
            evaluate=True),
    Setting("disable_tqdm=True", {"disable_tqdm": True}),
    Setting("disable_tqdm=False", {"disable_tqdm": False}),
    Setting("torch_compile=True, torch_compile_backend=eager", {"torch_compile": True,
                                                                "torch_compile_backend": "eager"}),
    Setting("activation_checkpointing=True", {"activation_checkpointing": True}),
    Setting("dataloader_num_workers=2", {"dataloader_num_workers": 2}),
    Setting("train_dataset=IterableDataset", iterable=True,
            refused={"GRPOTrainer": "Iterable datasets are not yet supported in GRPOTrainer"}),   # TRL 1.0
    Setting("num_train_epochs=1 (no max_steps)", epochs=True),
    Setting("eval_strategy=steps", EVAL_EVERY_STEP, evaluate=True),
    Setting("report_to=[tensorboard, mlflow]", {"report_to": ["tensorboard", "mlflow"]}),
]


@dataclass(frozen=True)
class Cell:
    setting: Setting
    trainer: str

    @property
    def id(self) -> str:
        return f"{self.setting.name} | {self.trainer}"


CELLS = [Cell(s, t) for s in SETTINGS for t in TRAINERS]


# ---------------------------------------------------------------- a cell's trainer
def varied_reward(prompts, completions, completion_ids=None, **kwargs):
    """Rewards that differ within a group, so GRPO learns and a wrong resume shows in the weights."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _rows(trainer: str, tokenizer, n: int) -> dict:
    texts = [CORPUS[i % 5][: 12 + 9 * (i % 4)] + " " + CORPUS[(i * 3) % 5][: 4 + i % 7] for i in range(n)]
    if trainer == "Trainer":
        return {"input_ids": [tokenizer(t)["input_ids"] for t in texts]}
    if trainer == "SFTTrainer":
        return {"text": texts}
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    if trainer == "DPOTrainer":
        return {"prompt": prompts, "chosen": [f" {t}" for t in texts], "rejected": [" no" for _ in texts]}
    return {"prompt": prompts}


def build(cell: Cell, tokenizer, output_dir, callbacks):
    """The cell's trainer at the configured split: :data:`BATCH` × 1, :data:`PER_EPOCH` steps an epoch."""
    from datasets import Dataset

    from hf_perf_callbacks.tiny import build_model

    setting = cell.setting
    values = dict(EXACT, output_dir=str(output_dir), per_device_train_batch_size=BATCH,
                  gradient_accumulation_steps=1, per_device_eval_batch_size=BATCH)
    values.update({"num_train_epochs": STEPS / PER_EPOCH} if setting.epochs else {"max_steps": STEPS})
    values.update(setting.args)
    if cell.trainer != "Trainer":
        values["bf16"] = False                    # TRL turns it on by default; this is a CPU
    grpo = cell.trainer == "GRPOTrainer"
    rows = PER_EPOCH * (1 if grpo else BATCH)     # GRPO: one prompt × BATCH completions per step
    train = Dataset.from_dict(_rows(cell.trainer, tokenizer, rows))
    train = train.to_iterable_dataset() if setting.iterable else train
    evaluation = Dataset.from_dict(_rows(cell.trainer, tokenizer, BATCH)) if setting.evaluate else None
    common = dict(model=build_model(tokenizer), train_dataset=train, eval_dataset=evaluation, callbacks=callbacks,
                  processing_class=tokenizer)
    if cell.trainer == "Trainer":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        return Trainer(args=TrainingArguments(**values),
                       data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), **common)
    if cell.trainer == "SFTTrainer":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer(args=SFTConfig(**values), **common)
    if cell.trainer == "DPOTrainer":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(args=DPOConfig(**values), ref_model=build_model(tokenizer), **common)
    from trl import GRPOConfig, GRPOTrainer

    values.update(num_generations=BATCH, max_completion_length=6)
    return GRPOTrainer(args=GRPOConfig(**values), reward_funcs=varied_reward, **common)


# ---------------------------------------------------------------- results
def load_results() -> dict:
    try:
        with open(RESULTS, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def record(cell: Cell, column: str, outcome: str) -> None:
    """The one writer of :data:`RESULTS`: ``"yes"``, ``"no: <why>"`` or ``"refused: <message>"``."""
    if column not in COLUMNS or not re.match(r"(yes|no: .+|refused: .+)$", outcome, re.S):
        raise ValueError(f"column={column!r}, outcome={outcome!r}: expected one of {COLUMNS} and 'yes', "
                         f"'no: <why>' or 'refused: <message>'")
    results = load_results()
    results.setdefault(cell.id, {})[column] = outcome
    ordered = {c.id: results[c.id] for c in CELLS if c.id in results}
    lines = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in ordered.items()]
    with open(RESULTS, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:240]


# ---------------------------------------------------------------- the runs
class CopyAtResume(TrainerCallback):
    """What a new process would find: ``output_dir`` copied when the in-process re-size resumes (the begin of the
    second ``train()`` call), without the lock of the live process."""

    def __init__(self, *targets: str):
        self.targets, self.calls = targets, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls += 1
        if self.calls == 2:
            for target in self.targets:
                shutil.copytree(args.output_dir, target, ignore=shutil.ignore_patterns(LOCK_FILE))


def runs(cell: Cell, tokenizer, tmp_path, copy_to: tuple = ()) -> tuple[Trajectory, Trajectory, Trajectory]:
    """(unfaulted, re-sized in process, resumed by a new trainer); ``copy_to``: more copies of what the new trainer
    resumed from."""
    expected = Trajectory()
    expected.attach(build(cell, tokenizer, tmp_path / "plain", [expected])).train()
    fault, resized, resume_dir = Fault("forward", at=FAULT_AT), Trajectory(), str(tmp_path / "resume")
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = build(cell, tokenizer, tmp_path / "run", [fault, resized, CopyAtResume(resume_dir, *copy_to), tuner])
    fault.attach(resized.attach(trainer))
    train_with_tuning(trainer)
    assert fault.fired == 1 and [d.kind for d in tuner.session.decisions] == ["oom"]
    assert tuner.session.split == Split(1, 2, 2 if cell.trainer == "GRPOTrainer" else None)
    resumed = Trajectory().continues(resized, FAULT_AT - 1)
    again = build(cell, tokenizer, resume_dir, [resumed, AdaptiveBatchTuner(tune=False)])
    train_with_tuning(resumed.attach(again), resume_from_checkpoint="last")
    assert again.args.per_device_train_batch_size == 1             # the recorded split, applied
    return expected, resized, resumed


def _cells():
    for cell in CELLS:
        fast = cell.trainer in cell.setting.fast
        yield pytest.param(cell, id=cell.id, marks=[] if fast else [pytest.mark.launch])


@pytest.mark.parametrize("cell", list(_cells()))
def test_a_resize_and_a_resume_train_exactly_what_an_unfaulted_run_trains(cell, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        expected, resized, resumed = runs(cell, tokenizer, tmp_path)
    except Exception as error:
        expected_refusal = cell.setting.refused.get(cell.trainer)
        if expected_refusal is None or not re.search(expected_refusal, str(error)):
            for column in COLUMNS:
                record(cell, column, f"no: {first_line(error)}")
            raise
        for column in COLUMNS:
            record(cell, column, f"refused: {first_line(error)}")
        return
    found = {"resize_exact": differences(expected, resized), "resume_exact": differences(expected, resumed)}
    for column, what in found.items():
        record(cell, column, "no: " + "; ".join(what) if what else "yes")
    assert found == {"resize_exact": [], "resume_exact": []}


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
