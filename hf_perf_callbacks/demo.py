"""``hf-perf demo``: a short GRPO + LoRA run on the bundled Wordle task, offline, with every callback attached.

The model is a tiny Llama with random weights and the tokenizer is trained locally, so the run needs no
download and finishes in a minute or two on two CPU cores; the point is the callbacks' report, not the model.
"""
from __future__ import annotations

import os
import tempfile


def build_demo_trainer(output_dir: str, max_steps: int = 30, callbacks=None, seed: int = 0, **overrides):
    """A ``GRPOTrainer`` on Wordle with a tiny random model, LoRA and ``callbacks`` (default: all of them)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from . import default_callbacks
    from .tasks import wordle
    from .tiny import build_model, build_tokenizer

    dataset = wordle.make_dataset(64, seed=seed)
    corpus = list(dataset["prompt"]) + [f"<think>try {w}</think><guess>{w}</guess>" for w in wordle.load_words()]
    tokenizer = build_tokenizer(corpus)
    model = build_model(tokenizer, seed=seed)
    settings = dict(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    num_generations=4, max_completion_length=24, max_steps=max_steps, learning_rate=1e-4,
                    logging_steps=5, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                    activation_checkpointing=False, disable_tqdm=True, seed=seed, beta=0.0)
    settings.update(overrides)
    args = GRPOConfig(**settings)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    return GRPOTrainer(model=model, reward_funcs=wordle.REWARD_FUNCS, args=args, train_dataset=dataset,
                       processing_class=tokenizer, peft_config=lora,
                       callbacks=callbacks if callbacks is not None else default_callbacks(
                           ThroughputMeter={"peak_flops": "calibrate"}))   # a CPU has no table peak


def run_demo(output_dir: str | None = None, max_steps: int = 30) -> str:
    """Train the demo through ``train_with_tuning`` (the tuner probes the splits first), then print the report and
    write its plots and ``perf_report.md``; returns the output directory."""
    from . import train_with_tuning
    from .cli import report_command

    output_dir = output_dir or tempfile.mkdtemp(prefix="hf_perf_demo_")
    trainer = build_demo_trainer(output_dir, max_steps=max_steps)
    train_with_tuning(trainer)
    trainer.save_state()                      # trainer_state.json: log_history with TRL's completion lengths
    print()
    report_command(output_dir)
    print(f"\nperf log: {os.path.join(output_dir, 'perf_log.jsonl')}")
    return output_dir
