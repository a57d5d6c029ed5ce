"""The compatibility matrix: every setting a user has in ``TrainingArguments`` × every trainer, one cell each, and the
one file the cells' results are recorded in.

* :data:`SETTINGS` (rows) × :data:`TRAINERS` (columns) = :data:`CELLS`, the single list every column is checked on.
* :data:`COLUMNS`: the properties a cell is checked for. ``metrics`` (``tests/test_compat_matrix.py``): the
  callbacks' keys reach ``log_history``, the reporters and ``perf_log.jsonl`` on every step. ``resize_exact`` and
  ``resume_exact`` (``tests/test_compat_resize.py``): a planted out-of-memory error re-sizes the run, in the same
  process and through a new one, and it trains exactly what an unfaulted run trains. A cell not yet run reads "not
  yet measured".
* :data:`TUNING` (rows) × :data:`TRAINERS` = :data:`TUNING_CELLS`: what a user does while the tuner switches
  splits on the run's own steps (a stop on a switch's step, a trial that runs out of memory, ``save_total_limit``),
  checked in the column ``tuning`` (``tests/test_compat_tuning.py``) against the same run untuned.
* A setting may exist for some trainers only (:attr:`Setting.only`); its other cells read "n/a". A re-size cell
  whose setting leaves no other split exact records ``said: <why>``: the run restricted its splits, said why at the
  start, and an OOM saved and ended it with that message instead of re-sizing inexactly.
* :func:`record` is the one writer of ``tests/compat_results.json`` (cell → column → outcome); the tables of
  docs/compatibility.md are rendered from it by ``python -m tests.compat_table``. It records only runs on the pinned
  versions (:data:`TABLE_VERSIONS` as in ``constraints.txt``): the table describes those; on other versions (CI's oldest
  set) every cell is still checked, and a refusal listed for it is allowed.

A cell runs :data:`STEPS` optimizer steps of a tiny model (``tests/conftest.py``) on the CPU, ``logging_steps=1``,
reporting to TensorBoard (and MLflow where the setting says so), with ``default_callbacks()`` attached. A setting
that a trainer cannot run must be refused there before its first step with one clear message, listed in
:attr:`Setting.refused` (a listed refusal is allowed, not required: some hold for older versions only; on the
pinned versions the recorded outcome and docs/compatibility.md's table say which happened); any other error fails
the cell.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
from dataclasses import dataclass, field

from transformers import TrainingArguments

from tests.conftest import CORPUS, PROMPTS, length_reward, padded

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "compat_results.json")
CONSTRAINTS = os.path.join(os.path.dirname(HERE), "constraints.txt")
#: the libraries whose versions the table is for
TABLE_VERSIONS = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "tensorboard", "mlflow-skinny")

#: optimizer steps per cell (one epoch of each cell's dataset, so that epoch-based settings end at the same step)
STEPS = 2
BATCH = 2                                         # per-device micro-batch; GRPO: one prompt × 2 generations
#: the re-size and resume columns: optimizer steps, steps per epoch (the resumed run crosses an epoch boundary),
#: the step whose training forward runs out of memory
RESIZE_STEPS, RESIZE_PER_EPOCH, RESIZE_FAULT_AT = 4, 3, 3

#: column → its heading in docs/compatibility.md's table
COLUMNS = {"metrics": "metrics reach the reporters", "resize_exact": "re-size exact", "resume_exact": "resume exact",
           "exact_by": "exact by"}
#: the tuning table's one column
TUNING_COLUMNS = {"tuning": "the run ends where, and trains what, the untuned run does"}
NOT_MEASURED = "not yet measured"

TRAINERS = ("Trainer", "SFTTrainer", "DPOTrainer", "GRPOTrainer")

#: every value transformers offers, read from TrainingArguments itself (a new sampler gets a row by itself)
SAMPLING_STRATEGIES = tuple(next(f for f in dataclasses.fields(TrainingArguments)
                                 if f.name == "train_sampling_strategy").metadata["choices"])

#: the samplers that need each example's length; transformers reads it from ``input_ids``, which DPO's tokenized
#: examples do not have (``prompt_ids``, ``chosen_ids``…), unless the dataset has a ``length`` column
LENGTH_SAMPLERS = ("group_by_length", "batch_rebalance")
LENGTHS_UNKNOWN = "Can only automatically infer lengths for datasets whose items are dictionaries with an 'input_ids'"

SAVE_EVERY_STEP = {"save_strategy": "steps", "save_steps": 1}
EVAL_EVERY_STEP = {"eval_strategy": "steps", "eval_steps": 1}


@dataclass(frozen=True)
class Setting:
    """One row: what a user sets, alone, on top of each trainer's defaults."""

    name: str                                     # as the user writes it
    args: dict = field(default_factory=dict)      # TrainingArguments (TRL config) values
    iterable: bool = False                        # the training data as a datasets.IterableDataset
    epochs: bool = False                          # num_train_epochs=1 instead of max_steps
    evaluate: bool = False                        # an evaluation dataset
    refused: dict = field(default_factory=dict)   # trainer → regex of the message it refuses the setting with
    slow: bool = False                            # runs under the `launch` marker
    padding_side: str = "right"                   # the plain Trainer's collator (training pads right)
    override: bool = False                        # the trainer's compute_loss overridden, num_items_in_batch unread
    short_by: int = 0                             # examples per epoch this many short of whole optimizer steps
    only: tuple = TRAINERS                        # the trainers the setting exists for

    def reporters(self) -> list[str]:
        return self.args.get("report_to", ["tensorboard"])


SETTINGS = [
    Setting("defaults"),
    *[Setting(f"include_num_input_tokens_seen={value}", {"include_num_input_tokens_seen": value})
      for value in ("all", "non_padding")],
    *[Setting(f"train_sampling_strategy={value}", {"train_sampling_strategy": value},
              refused={"DPOTrainer": LENGTHS_UNKNOWN} if value in LENGTH_SAMPLERS else {})
      for value in SAMPLING_STRATEGIES],
    Setting("save_only_model=True", {**SAVE_EVERY_STEP, "save_only_model": True}),
    Setting("save_total_limit=1", {**SAVE_EVERY_STEP, "save_total_limit": 1}),
    Setting("save_strategy=no", {"save_strategy": "no"}),
    Setting("save_strategy=steps", SAVE_EVERY_STEP),
    Setting("save_strategy=epoch", {"save_strategy": "epoch"}, epochs=True),
    Setting("load_best_model_at_end=True", {**SAVE_EVERY_STEP, **EVAL_EVERY_STEP, "load_best_model_at_end": True},
            evaluate=True),
    Setting("disable_tqdm=True", {"disable_tqdm": True}),
    Setting("disable_tqdm=False", {"disable_tqdm": False}),
    # inductor took 77 s for one Trainer cell on a 2-core CPU, eager 9 s: the cells compile with dynamo, eager
    Setting("torch_compile=True, torch_compile_backend=eager",
            {"torch_compile": True, "torch_compile_backend": "eager"}, slow=True),
    Setting("activation_checkpointing=True", {"activation_checkpointing": True}),
    Setting("dataloader_num_workers=2", {"dataloader_num_workers": 2}),
    Setting("train_dataset=IterableDataset", iterable=True,
            refused={"GRPOTrainer": "Iterable datasets are not yet supported in GRPOTrainer"}),   # TRL 1.0
    Setting("num_train_epochs=1 (no max_steps)", epochs=True),
    Setting("eval_strategy=steps", EVAL_EVERY_STEP, evaluate=True),
    Setting("report_to=[tensorboard, mlflow]", {"report_to": ["tensorboard", "mlflow"]}),
    # settings under which the loss can depend on how examples are grouped into micro-batches
    Setting("tokenizer padding_side=left", padding_side="left", slow=True),
    Setting("max_grad_norm=1.0 (clipping; the re-size columns otherwise train without)", {"max_grad_norm": 1.0},
            slow=True),
    Setting("dataloader_drop_last=True, an odd number of examples", {"dataloader_drop_last": True}, short_by=1,
            slow=True),
    Setting("gradient_accumulation_steps=2, an uneven last step (DPO: uneven pairs)",
            {"gradient_accumulation_steps": 2}, short_by=1, only=("Trainer", "SFTTrainer", "DPOTrainer"), slow=True),
    Setting("compute_loss overridden, num_items_in_batch not passed on", override=True, slow=True),
    Setting("loss_type=bnpo", {"loss_type": "bnpo"}, only=("GRPOTrainer",), slow=True),
    Setting("padding_free=True", {"padding_free": True, "max_length": None}, only=("SFTTrainer",), slow=True),
]


@dataclass(frozen=True)
class Scenario:
    """One row of the tuning table: what happens while the tuner switches splits on the run's own steps."""

    name: str
    key: str                                      # what tests/test_compat_tuning.py plants
    only: tuple = TRAINERS


TUNING = [
    Scenario("a callback stops the run at the step where the tuner switches", "stop"),
    Scenario("EarlyStoppingCallback stops it at that step", "early_stopping"),
    Scenario("a trial split runs out of memory, max_resizes=0", "trial_oom_0"),
    Scenario("a trial split runs out of memory, max_resizes=1, then a real OOM", "trial_oom_1"),
    Scenario("save_total_limit=1, a switch after the user's last checkpoint, stopped mid-trial", "rotation"),
]


@dataclass(frozen=True)
class Cell:
    setting: Setting | Scenario
    trainer: str

    @property
    def id(self) -> str:
        return f"{self.setting.name} | {self.trainer}"


CELLS = [Cell(setting, trainer) for setting in SETTINGS for trainer in TRAINERS if trainer in setting.only]
TUNING_CELLS = [Cell(scenario, trainer) for scenario in TUNING for trainer in TRAINERS if trainer in scenario.only]


# ---------------------------------------------------------------- building a cell's trainer


def offline_mlflow(monkeypatch, tracking_dir) -> None:
    """MLflow's local file store in ``tracking_dir``, offline. transformers logs to MLflow asynchronously (mlflow
    >= 2.8); with several writer threads the file store's ``make_containing_dirs`` (exists, then makedirs) races when
    two steps first create one key folder (``tuner/``), and the losing batch's metrics are dropped in the worker
    thread. One writer thread: what arrives is what was sent."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tracking_dir}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")


def build(cell: Cell, tokenizer, output_dir: str, callbacks: list, *, steps: int = STEPS,
          per_epoch: int | None = None, extra: dict | None = None, reward=length_reward):
    """The cell's trainer: a tiny model, an in-memory dataset of exactly ``per_epoch`` (default ``steps``) steps per
    epoch, ``steps`` optimizer steps (epochs-based settings: as many epochs as that takes); ``extra``: arguments
    under the setting's own (another column's optimizer, say); ``reward``: GRPO's reward function."""
    from datasets import Dataset

    from hf_perf_callbacks.tiny import build_model

    setting = cell.setting
    per_epoch = per_epoch or steps
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                  logging_steps=1, use_cpu=True, seed=0, report_to=["tensorboard"])
    values.update({"num_train_epochs": steps / per_epoch} if setting.epochs else {"max_steps": steps})
    if cell.trainer != "Trainer":
        values["bf16"] = False                    # TRL turns it on by default; this is a CPU
    if setting.evaluate:
        values["per_device_eval_batch_size"] = BATCH
    values.update(extra or {})
    values.update(setting.args)
    accumulation = values["gradient_accumulation_steps"]
    if cell.trainer == "GRPOTrainer":               # GRPO: one prompt (BATCH completions) per micro-batch
        rows = per_epoch * accumulation - setting.short_by
    else:
        rows = per_epoch * BATCH * accumulation - setting.short_by
    train_rows, eval_rows = _rows(cell.trainer, tokenizer, rows), _rows(cell.trainer, tokenizer, BATCH)
    train = Dataset.from_dict(train_rows)
    train = train.to_iterable_dataset() if setting.iterable else train
    evaluation = Dataset.from_dict(eval_rows) if setting.evaluate else None
    model = build_model(tokenizer)
    common = dict(model=model, train_dataset=train, eval_dataset=evaluation, callbacks=callbacks)
    if cell.trainer == "Trainer":
        from transformers import DataCollatorForLanguageModeling, Trainer

        return _overridden(Trainer, setting)(
            args=TrainingArguments(**values), processing_class=tokenizer,
            data_collator=DataCollatorForLanguageModeling(padded(tokenizer, setting.padding_side), mlm=False),
            **common)
    if cell.trainer == "SFTTrainer":
        from trl import SFTConfig, SFTTrainer

        return _overridden(SFTTrainer, setting)(args=SFTConfig(**values), processing_class=tokenizer, **common)
    if cell.trainer == "DPOTrainer":
        from trl import DPOConfig, DPOTrainer

        return _overridden(DPOTrainer, setting)(args=DPOConfig(**values), ref_model=build_model(tokenizer),
                                                processing_class=tokenizer, **common)
    from trl import GRPOConfig, GRPOTrainer

    values.update(num_generations=BATCH, max_completion_length=8)
    return _overridden(GRPOTrainer, setting)(args=GRPOConfig(**values), reward_funcs=reward,
                                             processing_class=tokenizer, **common)


def _overridden(trainer_cls, setting: Setting):
    """The trainer class, or (``setting.override``) a user's subclass whose ``compute_loss`` calls the trainer's
    without passing ``num_items_in_batch`` on (as overrides written for older transformers do)."""
    if not setting.override:
        return trainer_cls

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return trainer_cls.compute_loss(self, model, inputs, return_outputs)

    return type(f"My{trainer_cls.__name__}", (trainer_cls,), {"compute_loss": compute_loss,
                                                               "__module__": __name__})


def _rows(trainer: str, tokenizer, n: int) -> dict:
    """``n`` examples in the format each trainer takes, of varying length (so padding exists)."""
    texts = [CORPUS[i % 5][: 12 + 9 * (i % 4)] for i in range(n)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    if trainer == "Trainer":
        return {"input_ids": [tokenizer(text)["input_ids"] for text in texts]}
    if trainer == "SFTTrainer":
        return {"text": texts}
    if trainer == "DPOTrainer":
        return {"prompt": prompts, "chosen": [f" {t}" for t in texts], "rejected": [" no" for _ in texts]}
    return {"prompt": prompts}


# ---------------------------------------------------------------- results
def pinned_versions() -> dict[str, str]:
    """:data:`TABLE_VERSIONS` as ``constraints.txt`` pins them."""
    pins = {}
    with open(CONSTRAINTS, encoding="utf-8") as f:
        for line in f:
            name, _, version = line.split("#")[0].strip().partition("==")
            if name in TABLE_VERSIONS:
                pins[name] = version
    return pins


def installed_versions() -> dict[str, str]:
    """The installed versions of :data:`TABLE_VERSIONS` (a local build suffix such as ``+cpu`` dropped)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in TABLE_VERSIONS:
        try:
            found[name] = version(name).split("+")[0]
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def load_results() -> dict:
    """cell id → column → outcome, as last recorded (``{}`` when nothing is)."""
    try:
        with open(RESULTS, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def record(cell: Cell, column: str, outcome: str) -> bool:
    """Record a cell's outcome for ``column``: ``"yes"``, ``"no: <why>"``, ``"refused: <message>"`` or ``"said:
    <why>"``; True when recorded (on the pinned versions only). The one writer of the results file; entries of cells
    no longer in :data:`CELLS` or :data:`TUNING_CELLS` are dropped."""
    allowed = TUNING_COLUMNS if isinstance(cell.setting, Scenario) else COLUMNS
    if column not in allowed:
        raise ValueError(f"column={column!r} is not allowed: expected one of {sorted(allowed)}")
    if not re.match(r"(yes|no: .+|refused: .+|said: .+|rule: .+|measured: .+)$", outcome, re.S):
        raise ValueError(f"outcome={outcome!r} is not allowed: expected 'yes', 'no: <why>', 'refused: <message>', "
                         f"'said: <why>', 'rule: <why>' or 'measured: <why>'")
    if installed_versions() != pinned_versions():
        return False
    with open(RESULTS + ".lock", "w") as lock:          # the suite's workers record at once: one at a time,
        fcntl.flock(lock, fcntl.LOCK_EX)               # and a reader never sees a half-written file
        results = load_results()
        results.setdefault(cell.id, {})[column] = outcome
        ordered = {c.id: results[c.id] for c in CELLS + TUNING_CELLS if c.id in results}
        lines = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                 for k, v in ordered.items()]
        with open(RESULTS + ".tmp", "w", encoding="utf-8") as f:
            f.write("{\n" + ",\n".join(lines) + "\n}\n")             # one cell a line: a diff names the cell
        os.replace(RESULTS + ".tmp", RESULTS)
    return True
