"""The memory check: one optimizer step at the worst-case length, before training, where memory is tight.

A run's longest examples (GRPO: completions forced to ``max_completion_length``) may come hours into training, and the
watchdog's growth forecast does not see a length spike coming. So on CUDA and MPS (never on a CPU, where the run
swaps long before it fails), where GRPO's worst-case peak (:func:`~hf_perf_callbacks.estimate.estimate_grpo_memory`)
times ``ALLOCATOR_OVERHEAD`` reaches ``TIGHT`` of the budget or cannot be estimated, :func:`check_memory` runs ONE
optimizer step of the configured split on the longest examples at learning rate 0 and restores weights, RNG, data and
callbacks (it reads the training set's rows: ``memory_check=False`` is the run with no trace). When the step runs out
of memory on any rank or passes the watchdog's budget, the largest allowed split that fits is staged: the run's first
step checks it on its own rows (:mod:`~hf_perf_callbacks.resize.exactness`), and the ``memory_check`` decision is
committed once it passed. No timing rounds: the tuning measures speed on the run's own steps.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
from transformers import TrainerCallback

from ..core.batching import Split, current_split, is_grpo
from ..core.flops import text_config
from ..core.memory import budget_bytes
from ..core.splitfile import Trial
from ..estimate import estimate_grpo_memory, model_from_config
from ..platform import adapter
from ..platform.device import (
    GB,
    DeviceLayer,
    error_line,
    gather_floats,
    rng_state,
    set_rng_state,
    training_device,
    world_size,
)
from .agreement import recoverable
from .executor import Executor, Staged

if TYPE_CHECKING:
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerBase,
        Trainer,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOConfig

    from ..common.base import Clock
    from ..estimate import ModelShape
    from ..platform.device import RngState

#: what the allocator holds beyond the live tensors the estimate counts: CUDA's caching allocator, and MPS driver
#: memory (about twice the live tensors on a Mac; recipes/README.md)
ALLOCATOR_OVERHEAD = {"cuda": 1.25, "mps": 2.0}
#: the estimated worst-case peak (with that overhead) at which memory counts as tight, as a share of the budget
TIGHT = 0.5


def wanted(setting: bool | None, device_type: str) -> bool:
    """Whether the check may run: the tuner's ``memory_check`` setting, or (None) on CUDA and MPS only."""
    return setting if setting is not None else device_type in ("cuda", "mps")


def estimated_peak(trainer: Trainer, device_type: str) -> float | None:
    """GRPO's live-tensor peak in bytes at the worst-case length (the longest prompt, every completion at
    ``max_completion_length``) for the split in effect, from the model's config; None when it cannot be estimated
    (not GRPO, an unknown architecture, prompts that cannot be measured)."""
    args = cast("GRPOConfig", trainer.args)          # its GRPO fields are read past is_grpo only
    if not is_grpo(args):
        return None
    try:
        facts, weight_bytes, lora_params = _model_facts(trainer.model)
        split = current_split(args)
        generation_batch = split.generation_batch(world_size())
        if generation_batch is None:                    # no steps_per_generation: no generation batch to size
            return None
        return estimate_grpo_memory(
            facts, micro_batch=split.micro_batch, num_generations=cast(int, args.num_generations),  # None: raises,
            generation_batch=generation_batch, prompt_tokens=_longest_prompt_tokens(trainer),
            max_completion_length=cast(int, args.max_completion_length),                             # no estimate
            dtype_bytes=2 if (args.bf16 or args.fp16) else weight_bytes, lora_params=lora_params,
            activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)
                                          or getattr(args, "gradient_checkpointing", False)),
            lm_head="triton" if device_type == "cuda" else "torch", full_finetune=not lora_params)["peak"]
    except Exception:  # noqa: BLE001 - no estimate: the check runs (safety first)
        return None


def _model_facts(model: Any) -> tuple[ModelShape, int, int]:
    """The model's facts from its config (a peft wrapper's base model), the bytes of one frozen weight (of any
    weight without peft) and the trainable LoRA parameters (0 without peft)."""
    peft = hasattr(model, "peft_config")
    inner = model.get_base_model() if peft else model
    config = text_config(inner)
    facts = model_from_config({**config.to_dict(), "params": sum(p.numel() for n, p in inner.named_parameters()
                                                                  if "lora_" not in n)})
    weight = next(p for p in inner.parameters() if not p.requires_grad) if peft else next(inner.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad) if peft else 0
    return facts, weight.element_size(), lora


def _longest_prompt_tokens(trainer: Trainer) -> int:
    """Tokens of the dataset's longest prompt (longest by characters), as the trainer's tokenizer encodes it."""
    dataset: Any = trainer.train_dataset                # the user's: a datasets.Dataset or any indexable rows
    prompts = dataset["prompt"] if hasattr(dataset, "column_names") else [dataset[i]["prompt"]
                                                                           for i in range(len(dataset))]
    longest = max(prompts, key=lambda p: len(p) if isinstance(p, str) else sum(len(m.get("content", "")) for m in p))
    tokenizer = cast("PreTrainedTokenizerBase", trainer.processing_class)      # GRPO's: a tokenizer
    if isinstance(longest, str):
        return len(tokenizer(longest)["input_ids"])
    return len(tokenizer.apply_chat_template(longest, tokenize=True, add_generation_prompt=True))


def tight(trainer: Trainer, budget: float, device_type: str) -> tuple[bool, str]:
    """Whether the check is worth its step (see the module docstring), and why."""
    peak = estimated_peak(trainer, device_type)
    if peak is None:
        return True, "no estimate of the worst-case peak"
    held = peak * ALLOCATOR_OVERHEAD.get(device_type, 1.0)
    why = (f"estimated worst-case peak {peak / GB:.2f} GiB × {ALLOCATOR_OVERHEAD.get(device_type, 1.0)} for the "
           f"allocator = {held / GB:.2f} GiB against the budget {budget / GB:.2f} GiB")
    return held >= TIGHT * budget, why


class _PeakWatch(TrainerCallback):
    """The peak memory of the step."""

    def __init__(self, device: DeviceLayer) -> None:
        self.device, self.peak, self.steps = device, 0.0, 0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self.steps += 1
        self.peak = max(self.peak, float(self.device.memory().used))


def check_memory(trainer: Trainer, session: Executor, candidates: list[Split], clock: Clock | None = None,
                 force: bool = False) -> Split:
    """Run the check (see the module docstring; ``force``: whether memory is tight or not); returns the split that
    fits (the configured one when it does)."""
    wall = clock.wall if clock is not None else time.perf_counter
    device = DeviceLayer(training_device())
    sample = device.memory()
    budget = budget_bytes(device.type, sample.device_limit, sample.hard_limit, sample.system_total,
                          reachable=sample.reachable)
    budget = min(r[0] for r in gather_floats([budget], device.device))          # the tightest rank
    started = wall()
    configured = current_split(trainer.args)
    needed, why = (True, "asked for (memory_check=True)") if force else tight(trainer, budget, device.type)
    needed = max(r[0] for r in gather_floats([float(needed)], device.device)) > 0   # any rank tight: all check
    if not needed:
        session.decided(session.decide(
            "memory_check", f"skipped: memory is not tight ({why})", configured, 0, old=configured,
            cost_sec=max(r[0] for r in gather_floats([wall() - started], device.device)), budget_gb=budget / GB))
        return configured
    smaller = sorted((s for s in candidates if s.micro_batch < configured.micro_batch), key=lambda s: -s.micro_batch)
    trials = _trials(trainer, session, [configured, *smaller], device, budget, wall)
    chosen = next((t.split for t in trials if t.fits), configured)
    cost = max(r[0] for r in gather_floats([wall() - started], device.device))
    reason = _why_chosen(trials, why)
    decision = session.decide("memory_check", reason, chosen, 0, old=configured, trials=trials, cost_sec=cost,
                              budget_gb=budget / GB)
    session.apply(trainer, chosen)
    if chosen == configured:
        session.decided(decision)
    else:                                   # its first step is checked on its rows before it trains
        session.stage(Staged("memory_check", configured, chosen, 1, replace(session.state, split=chosen), decision))
    return chosen


def _trials(trainer: Trainer, session: Executor, splits: list[Split], device: DeviceLayer, budget: float,
            wall: Callable[[], float]) -> list[Trial]:
    """One step at each split in turn, up to the first that fits; the trainer is left as it was."""
    saved = _snapshot(trainer)
    trials: list[Trial] = []
    try:
        for split in splits:
            trials.append(_step(trainer, session, split, device, budget, wall))
            if trials[-1].fits:
                break
    finally:
        _restore(trainer, saved)
    return trials


def _why_chosen(trials: list[Trial], why: str) -> str:
    """The memory check's decision in words: what fit at the worst-case length."""
    if trials[0].fits:
        return f"the configured split fits at the worst-case length (peak {trials[0].peak_gb:.2f} GiB; {why})"
    if trials[-1].fits:
        return (f"the configured split does not fit at the worst-case length ({trials[0].error}): the largest exact "
                f"split that does")
    return "no exact split fits at the worst-case length: keeping the configured split (the OOM path decides)"


def check_or_warn(trainer: Trainer, session: Executor, clock: Clock | None = None, force: bool = False) -> None:
    """The memory check over the splits the run may use; a failure of its own (a memory reading, an exchange) is one
    warning and the configured split."""
    configured = session.split
    try:
        check_memory(trainer, session, session.snapshot().allowed(), clock=clock, force=force)
    except Exception as error:  # noqa: BLE001 - the check is a safety net, never a reason to stop
        session.apply(trainer, configured)
        session.warn_once("memory-check", f"the memory check failed ({type(error).__name__}: {error}); training "
                                          f"goes on at the configured split {configured} without it")


def _step(trainer: Trainer, session: Executor, split: Split, device: DeviceLayer, budget: float,
          wall: Callable[[], float]) -> Trial:
    """One optimizer step at ``split`` on the longest examples: its peak (every rank's highest) and any failure."""
    started = wall()
    session.apply(trainer, split)
    trainer.args.max_steps = 1
    watch = _PeakWatch(device)
    trainer.callback_handler.callbacks = [cb for cb in trainer.callback_handler.callbacks
                                          if type(cb).__name__ == "DefaultFlowCallback"] + [watch]
    device.reset_peak()
    error = None
    try:
        trainer.train()
    except Exception as raised:             # only an out-of-memory error is a finding of the check
        if not recoverable(raised):
            raise
        error = f"out of memory: {error_line(raised)[:120]}"
    finally:
        adapter.forget_last_train(trainer)
        device.empty_cache()
    rows = gather_floats([watch.peak, float(error is not None or watch.steps == 0), wall() - started], device.device)
    peak = max(r[0] for r in rows)
    trial = Trial(split, peak_gb=peak / GB, cost_sec=max(r[2] for r in rows))
    if max(r[1] for r in rows) > 0:
        trial.fits, trial.error = False, error or "out of memory on another rank"
    elif peak > budget:
        trial.fits, trial.error = False, f"peak {peak / GB:.2f} GiB over the budget {budget / GB:.2f} GiB"
    return trial


class _Saved(TypedDict):
    """What :func:`_snapshot` set aside for :func:`_restore`."""

    args: dict[str, Any]                              # TrainingArguments' values, by field name
    callbacks: list[TrainerCallback]
    dataset: Any                                      # the user's training set
    params: dict[str, torch.Tensor]
    rng: RngState
    generation_config: GenerationConfig | None
    min_new_tokens: int | None                        # the generation config's, before the check forced it
    dir: str                                          # the check's output_dir


def _snapshot(trainer: Trainer) -> _Saved:
    args = cast("GRPOConfig", trainer.args)          # num_generations is read for GRPO only
    keys = ("max_steps", "learning_rate", "output_dir", "save_strategy", "logging_strategy", "report_to",
            "eval_strategy")                            # the split is the session's (it applies the chosen one)
    config = getattr(trainer, "generation_config", None)
    saved: _Saved = {"args": {k: getattr(args, k) for k in keys if hasattr(args, k)},
                     "callbacks": list(trainer.callback_handler.callbacks),
                     "dataset": trainer.train_dataset,
                     "params": {n: p.detach().to("cpu", copy=True) for n, p in
                                cast(torch.nn.Module, trainer.model).named_parameters() if p.requires_grad},
                     "rng": rng_state(), "generation_config": config,
                     "min_new_tokens": config.min_new_tokens if config is not None else None,
                     "dir": tempfile.mkdtemp(prefix="hf_perf_memcheck_")}
    args.output_dir, args.learning_rate = saved["dir"], 0.0
    for key, value in (("save_strategy", "no"), ("logging_strategy", "no"), ("eval_strategy", "no")):
        if hasattr(args, key):
            setattr(args, key, value)
    args.report_to = []
    if config is not None:                              # GRPO: generate the longest completions
        config.min_new_tokens = getattr(args, "max_completion_length", None)
    split = current_split(args)
    needed = (cast(int, split.generation_batch(world_size())) // cast(int, args.num_generations) if is_grpo(args)
              else split.effective_batch(world_size()))
    trainer.train_dataset = _longest(trainer.train_dataset, needed)
    return saved


def _restore(trainer: Trainer, saved: _Saved) -> None:
    args = trainer.args
    for key, value in saved["args"].items():
        setattr(args, key, value)
    trainer.callback_handler.callbacks = saved["callbacks"]
    trainer.train_dataset = saved["dataset"]
    if saved["generation_config"] is not None:
        saved["generation_config"].min_new_tokens = saved["min_new_tokens"]
    with torch.no_grad():
        for name, param in cast(torch.nn.Module, trainer.model).named_parameters():     # set since init
            if name in saved["params"]:
                param.copy_(saved["params"][name])
    set_rng_state(saved["rng"])
    trainer.state = type(trainer.state)()
    shutil.rmtree(saved["dir"], ignore_errors=True)
    adapter.forget_last_train(trainer)
    DeviceLayer(training_device()).empty_cache()


def _longest(dataset: Any, count: int) -> Any:        # the user's training set (its rows, or a subset of them)
    """The ``count`` longest examples (worst-case memory), when lengths can be read; else the dataset itself."""
    try:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError):
        return dataset
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:max(1, count)]
    if hasattr(dataset, "select"):
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)


def _length(example: Any) -> int:                    # a row of the user's training set
    if "input_ids" in example:
        return len(example["input_ids"])
    prompt = example["prompt"]
    return len(prompt) if isinstance(prompt, str) else sum(len(m.get("content", "")) for m in prompt)
