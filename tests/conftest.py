"""Shared fixtures: a tiny random Llama, a locally trained tokenizer, real GRPO and plain Trainers. No hub access."""
from __future__ import annotations

import gc
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# torch on one thread in every test process and the processes they start: the tiny models gain nothing from a second
# thread, and on a 2-core machine shared with other work (CI), or beside a second xdist worker, two threads wait for
# each other (a tuner test and a watchdog test: 99.8 s on two threads, 20.7 s on one, at a load of 4-6)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from hf_perf_callbacks.common.base import Clock
from hf_perf_callbacks.tiny import build_model, build_tokenizer

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is two plus two ? the answer is four",
    "write a short poem about the sea and the sky",
    "count from one to ten : one two three four five six seven eight nine ten",
    "hello world , how are you today ?",
] * 20
PROMPTS = ["what is two plus two ?", "write a short poem about the sea", "hello world ,", "the quick brown fox"]


def pytest_collection_finish(session):
    """Freeze the libraries' objects out of the cyclic garbage collector before the first test.

    Every ``Trainer.train()`` (accelerate's ``free_memory``) and every cache clear of the package
    (``DeviceLayer.empty_cache``) runs a full ``gc.collect()``, which walks every live object: with torch,
    transformers, TRL, peft and datasets imported that is ~440,000 objects and 0.1-0.2 s per call on a 2-core CPU,
    most of a probe test's time. Frozen objects are still freed by reference counting; only the collector skips
    them. Objects the tests create afterwards are collected as before."""
    if session.config.option.collectonly or not session.items:
        return
    from datasets import Dataset  # noqa: F401 - imported here so that their module objects are frozen too
    from peft import LoraConfig, get_peft_model  # noqa: F401
    from transformers import Trainer, TrainingArguments  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401

    gc.collect()
    gc.freeze()


def save_tiny_model(path, corpus, **model_kwargs):
    """Write a tiny model and its tokenizer to ``path`` (a directory ``from_pretrained`` can load)."""
    tokenizer = build_tokenizer(corpus)
    model = build_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """torch on one thread for the test: as fast as two for the tiny models, and no thread spins on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(CORPUS, vocab_size=300)


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [-abs(len(ids) - 8) / 8.0 for ids in completion_ids]


def varied_reward(prompts, completions, completion_ids=None, **kwargs):
    """Rewards that differ within a group even when every completion reaches the length limit (as a tiny random
    model's do), so GRPO learns and a wrong resume shows in the weights."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def make_grpo(tokenizer, output_dir, callbacks, *, max_steps=6, bs=4, ga=2, num_generations=4, completion=12,
              extra=None, model=None, dataset_rows=16, reward=length_reward):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                    num_generations=num_generations, max_completion_length=completion, max_steps=max_steps,
                    learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                    bf16=False, activation_checkpointing=False, disable_tqdm=True, seed=0)
    settings.update(extra or {})
    dataset = Dataset.from_dict({"prompt": (PROMPTS * dataset_rows)[:dataset_rows]})
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return GRPOTrainer(model=model or build_model(tokenizer), reward_funcs=reward, args=GRPOConfig(**settings),
                       train_dataset=dataset, processing_class=tokenizer, peft_config=lora, callbacks=callbacks)


class PlantedClock(Clock):
    """The package's clock plus planted seconds. A test gives it to the callbacks under test (``clock=``) and plants
    a cost (a slow dataset, a slow callback) with :meth:`spend` (wall seconds) or :meth:`spend_cpu` (process CPU
    seconds): the cost is as large as the test needs, takes no real time, and no load on the machine can shrink it
    relative to the real work, so the conclusion cannot flip. ``cpu_only_planted`` makes :meth:`cpu` return the
    planted CPU seconds alone (a test that plants every CPU second of a step), ``wall_only_planted`` makes
    :meth:`wall` return the planted wall seconds alone (a test that checks a figure made of planted seconds exactly:
    the machine's own seconds, however many a load makes them, add nothing)."""

    def __init__(self, cpu_only_planted: bool = False, wall_only_planted: bool = False):
        self.planted = 0.0
        self.planted_cpu = 0.0
        self.cpu_only_planted = cpu_only_planted
        self.wall_only_planted = wall_only_planted

    def wall(self) -> float:
        return self.planted if self.wall_only_planted else time.perf_counter() + self.planted

    def cpu(self) -> float:
        return self.planted_cpu if self.cpu_only_planted else time.process_time() + self.planted_cpu

    def spend(self, seconds: float) -> None:
        self.planted += seconds

    def spend_cpu(self, seconds: float) -> None:
        self.planted_cpu += seconds


class TextDataset(torch.utils.data.Dataset):
    """Causal-LM examples of varying length (so padding exists); optionally slow to load: each item then costs
    ``delay`` planted seconds on ``clock`` (a :class:`PlantedClock`)."""

    def __init__(self, tokenizer, n=64, delay=0.0, clock=None, length=None):
        if delay and clock is None:
            raise ValueError(f"delay={delay!r} needs a PlantedClock as clock")
        self.items = [tokenizer(CORPUS[i % 5] + " " + CORPUS[(i * 3) % 5][: 5 + (i * 7) % 30])["input_ids"]
                      for i in range(n)]
        if length is not None:            # every example ``length`` tokens: no padding, any split computes alike
            self.items = [(ids * length)[:length] for ids in self.items]
        self.delay, self.clock = delay, clock

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.delay:
            self.clock.spend(self.delay)
        return {"input_ids": self.items[i]}


def padded(tokenizer, side):
    """The tokenizer padding on ``side`` (a shallow copy; the session's tokenizer pads left, for generation)."""
    import copy

    if tokenizer.padding_side == side:
        return tokenizer
    other = copy.copy(tokenizer)
    other.padding_side = side
    return other


def make_trainer(tokenizer, output_dir, callbacks, *, max_steps=6, bs=4, ga=2, delay=0.0, clock=None,
                 extra=None, trainer_cls=None, model=None, with_eval=False, length=None, padding_side="right"):
    """A plain Trainer of the tiny causal LM; its collator pads right, as training does (left padding makes the
    loss depend on how rows are grouped into micro-batches: ``padding_side="left"``)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                    max_steps=max_steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    settings.update(extra or {})
    collator = DataCollatorForLanguageModeling(padded(tokenizer, padding_side), mlm=False)
    return (trainer_cls or Trainer)(model=model or build_model(tokenizer), args=TrainingArguments(**settings),
                                    train_dataset=TextDataset(tokenizer, delay=delay, clock=clock, length=length),
                                    data_collator=collator,
                                    eval_dataset=TextDataset(tokenizer, n=16) if with_eval else None,
                                    callbacks=callbacks)


@pytest.fixture(scope="session")
def _demo_run_once(tmp_path_factory):
    from hf_perf_callbacks.demo import build_demo_trainer

    output_dir = str(tmp_path_factory.mktemp("demo_once"))
    trainer = build_demo_trainer(output_dir, max_steps=6, model="tiny")
    trainer.train()
    trainer.save_state()
    return output_dir


@pytest.fixture(scope="module")
def demo_run(_demo_run_once, tmp_path_factory):
    """A real 6-step demo run (tiny model, CPU; perf_log.jsonl and trainer_state.json, no report yet), trained
    once per session and copied fresh for each test module."""
    import shutil

    copy = str(tmp_path_factory.mktemp("demo_run") / "run")
    shutil.copytree(_demo_run_once, copy)
    return copy


def schema_lines(records) -> str:
    """Hand-made run-log records (a run no machine here can make: MPS, two CUDA ranks) as the run log's own writer
    classes write them: each parsed into its typed record and written back by ``to_json``; a run-header fact the
    schema does not know (a renamed field) fails here instead of reaching the reader as an unknown extra."""
    import json

    from hf_perf_callbacks.core.runlog import RunHeader, StepLine, parse_record

    out = []
    for entry in records:
        if entry.get("type") == "step":                       # written as the writer's StepLine writes it
            values = {k: v for k, v in entry.items() if k not in ("type", "step", "time")}
            out.append(json.dumps(StepLine(entry["step"], entry.get("time"), values).to_json()) + "\n")
            continue
        record = parse_record(entry)
        assert record is not None, f"not a run-log record: {entry!r}"
        if isinstance(record, RunHeader):
            assert not record.extra and not record.malformed, \
                f"run facts the schema does not know: {sorted(record.extra) + sorted(record.malformed)}"
        out.append(json.dumps(record.to_json()) + "\n")
    return "".join(out)
