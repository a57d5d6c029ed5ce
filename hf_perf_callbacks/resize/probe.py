"""The pre-flight probe: a few real optimizer steps per exact split at the worst-case length.

GRPO completions are forced to ``max_completion_length``; otherwise the longest examples are used. Largest
micro-batch first, at learning rate 0, with weights, RNG, data and callbacks restored afterwards. It picks the split
with the shortest median step time minus generation (``rank_by="non_generation"``, the default: the generation
batch is the same for every split, and HF ``generate`` is launch-bound and jitters by tens of percent, so whole step
times rank by noise) or the shortest whole step time (``"step"``), among those whose peak memory stays under the
watchdog's budget.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict

import torch
from transformers import TrainerCallback

from .. import adapter
from ..batching import Split
from ..device import (GB, DeviceLayer, gather_floats, is_main_process, rng_state, set_rng_state, training_device,
                      world_size)
from ..stats import median
from ..watchdog import MemoryWatchdog
from .agreement import recoverable
from .callback import AdaptiveBatchTuner, apply_split, current_split, find_callback, fmt_split


class _ProbeTimer(TrainerCallback):
    """Times optimizer steps (minus generation) and tracks peak memory during a probe run."""

    def __init__(self, device: DeviceLayer):
        self.device = device
        self.steps: list[tuple[float, float]] = []   # (step seconds, generation seconds)
        self.peak = 0.0
        self.generation = adapter.GenerationClock()

    def on_step_begin(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.start = time.perf_counter()
        self.generation.reset()

    def on_step_end(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.steps.append((time.perf_counter() - self.start, self.generation.seconds))
        self.peak = max(self.peak, float(self.device.memory().used))


def run_probe(trainer, tuner: AdaptiveBatchTuner) -> Split:
    args = trainer.args
    device = DeviceLayer(training_device())
    watchdog = find_callback(trainer, MemoryWatchdog) or MemoryWatchdog()
    budget = min(r[0] for r in gather_floats([watchdog.budget_bytes(device)], device.device))   # the tightest rank
    limit = tuner.config["max_micro_batch"]
    candidates = [s for s in tuner.candidates(args) if limit is None or s.micro_batch <= limit]
    original = current_split(args)
    saved = _snapshot(trainer, tuner.config["probe_steps"])
    trials: list[dict] = []
    best: dict | None = None
    slower = 0
    key = "step_time" if tuner.config["rank_by"] == "step" else "split_time"
    started = time.perf_counter()
    try:
        for split in candidates:
            trial = _probe_one(trainer, split, device, tuner.config["probe_steps"])
            trial["fits"] = trial.get("error") is None and trial["peak"] <= budget
            trials.append(trial)
            if not trial["fits"]:
                continue
            if best is None or trial[key] < best[key]:
                best, slower = trial, 0
            elif trial[key] > 1.05 * best[key]:
                slower += 1
                if slower >= tuner.config["probe_patience"]:
                    break
    finally:
        _restore(trainer, saved)
    chosen = Split(**best["split"]) if best else original
    seconds = time.perf_counter() - started
    apply_split(trainer, chosen)
    tuner.split = chosen
    why = (f"fastest split under the {budget / GB:.2f} GB budget: {seconds:.1f} s probing "
           + "; ".join(_fmt_trial(t) for t in trials)) if best else "no candidate fitted: keeping the configured split"
    tuner.decisions.append({"kind": "probe", "step": 0, "reason": why, "old": asdict(original),
                            "new": asdict(chosen), "trials": trials, "probe_sec": seconds})
    tuner.persist()
    if is_main_process():
        print(f"AdaptiveBatchTuner probe: {original} → {chosen} ({why})")
    return chosen


def _probe_one(trainer, split: Split, device: DeviceLayer, steps: int) -> dict:
    apply_split(trainer, split)
    trainer.args.max_steps = steps + 1
    timer = _ProbeTimer(device)
    trainer.callback_handler.callbacks = [cb for cb in trainer.callback_handler.callbacks
                                          if type(cb).__name__ == "DefaultFlowCallback"] + [timer]
    stop_watching = adapter.watch_generate(trainer.model, timer.generation)
    device.reset_peak()
    trial = {"split": asdict(split)}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001
        if not recoverable(error):
            raise
        trial["error"] = f"out of memory: {str(error).splitlines()[0][:120]}"
    finally:
        stop_watching()
        adapter.forget_last_train(trainer)
        device.empty_cache()
    measured = timer.steps[1:] or timer.steps
    failed = "error" in trial or not measured
    split_time = median([s - g for s, g in measured]) if not failed else 0.0
    step_time = median([s for s, _ in measured]) if not failed else 0.0
    # every rank must judge the trial alike: the slowest rank's times, the highest peak, any rank's failure
    rows = gather_floats([split_time, step_time, timer.peak, float(failed)], device.device)
    if max(r[3] for r in rows) > 0:
        trial.setdefault("error", "out of memory on another rank")
    else:
        trial["split_time"], trial["step_time"] = max(r[0] for r in rows), max(r[1] for r in rows)
    trial["peak"] = max(r[2] for r in rows)
    return trial


def _snapshot(trainer, probe_steps: int) -> dict:
    args = trainer.args
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "max_steps", "learning_rate", "output_dir", "save_strategy", "logging_strategy",
            "report_to", "eval_strategy")
    saved = {"args": {k: getattr(args, k) for k in keys if hasattr(args, k)},
             "callbacks": list(trainer.callback_handler.callbacks),
             "dataset": trainer.train_dataset,
             "params": {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()
                        if p.requires_grad},
             "rng": rng_state(),
             "generation_config": getattr(trainer, "generation_config", None)}
    probe_dir = tempfile.mkdtemp(prefix="hf_perf_probe_")
    saved["probe_dir"] = probe_dir
    args.output_dir, args.learning_rate = probe_dir, 0.0
    for key, value in (("save_strategy", "no"), ("logging_strategy", "no"), ("eval_strategy", "no")):
        if hasattr(args, key):
            setattr(args, key, value)
    args.report_to = []
    if saved["generation_config"] is not None:          # GRPO: generate the longest completions
        config = saved["generation_config"]
        saved["min_new_tokens"] = config.min_new_tokens
        config.min_new_tokens = getattr(args, "max_completion_length", None)
    split = current_split(args)
    if hasattr(args, "num_generations"):              # prompts for every probe step of the largest candidate
        needed = split.micro_batch * world_size() * split.steps_per_generation // args.num_generations
    else:
        needed = split.micro_batch * split.grad_accum * world_size()
    trainer.train_dataset = _longest(trainer.train_dataset, needed * (probe_steps + 1))
    return saved


def _restore(trainer, saved: dict) -> None:
    args = trainer.args
    for key, value in saved["args"].items():
        setattr(args, key, value)
    trainer.callback_handler.callbacks = saved["callbacks"]
    trainer.train_dataset = saved["dataset"]
    if saved["generation_config"] is not None:
        saved["generation_config"].min_new_tokens = saved["min_new_tokens"]
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name in saved["params"]:
                param.copy_(saved["params"][name])
    set_rng_state(saved["rng"])
    trainer.state = type(trainer.state)()
    shutil.rmtree(saved["probe_dir"], ignore_errors=True)
    adapter.forget_last_train(trainer)
    DeviceLayer(training_device()).empty_cache()


def _longest(dataset, count: int):
    """The ``count`` longest examples (worst-case memory), when lengths can be read; else the dataset itself."""
    try:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError):
        return dataset
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:max(1, count)]
    if hasattr(dataset, "select"):
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)


def _length(example) -> int:
    if "input_ids" in example:
        return len(example["input_ids"])
    prompt = example["prompt"]
    return len(prompt) if isinstance(prompt, str) else sum(len(m.get("content", "")) for m in prompt)


def _fmt_trial(t: dict) -> str:
    split = fmt_split(t["split"])
    if t.get("error"):
        return f"{split}: {t['error']}"
    return (f"{split}: {t['step_time']:.3f} s/step ({t['split_time']:.3f} s w/o generation), peak "
            f"{t['peak'] / GB:.2f} GB"
            + ("" if t["fits"] else " (over budget)"))
