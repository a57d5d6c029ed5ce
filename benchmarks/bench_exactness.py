"""What the check of a change costs: seconds and memory per change, against one optimizer step of the new split.

Every change of split is checked at the step it starts with, on that step's rows (docs/exactness.md). Cases, each a
run of ``--steps`` optimizer steps under ``train_with_tuning``:

* ``oom``: a full fine-tune of a causal LM (GPU: Qwen2.5-0.5B's shape in bf16, rows of ``--tokens`` tokens; CPU: the
  tests' tiny Llama at hidden 256, 4 layers, float32) at ``--split``; an out-of-memory error planted in the second
  micro-batch of step 4 re-sizes to the next smaller split, checked on step 4's rows against the old split's fetch;
* ``oom, at the wall``: the same, but the old split's micro-batch runs out of memory in the check too (as at a real
  wall): the new split is compared with a finer cut of its own rows;
* ``tuning trial``: the tuning's first trial (a larger split, ``must_pay=False``), checked at its first step;
* ``neftune``: the ``oom`` case with NEFTune's noise (refused: inexact, at the same cost);
* ``grpo``: GRPO+LoRA (GPU: Qwen2.5-0.5B's shape, the Wordle task; CPU: the tests' tiny model), an OOM planted in the
  second micro-batch of step 3: the check runs on the step's buffered completions.

Recorded per case: the check's seconds, passes, rows and verdict, its peak memory (GPU), the median step of the new
split after the change, and the ratio of the two (the target: at most one step of the new split).

Run: ``python benchmarks/bench_exactness.py`` (CUDA when present, else the CPU); results go to
``results/exactness_<device>.json``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
from common import release, write_result
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.common.bus import bus_for
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.throughput import forward_entry


class Steps(TrainerCallback):
    """Each optimizer step's wall seconds (synchronized), peak memory and split."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.peaks, self.splits = cuda, [], [], []

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.seconds.append(time.perf_counter() - self.started)
        self.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0)
        self.splits.append((args.per_device_train_batch_size, args.gradient_accumulation_steps))


class PlantedOOM(TrainerCallback):
    """An out-of-memory error in the training forward of micro-batch ``micro`` of step ``at`` (once); ``wall``: from
    then on, every forward of the old micro-batch's size runs out of memory (the check's too)."""

    def __init__(self, at: int, micro: int = 2, wall: int | None = None):
        self.at, self.micro, self.wall, self.fired, self.step, self.forwards = at, micro, wall, False, 0, 0

    def attach(self, trainer):
        self.bus = bus_for(trainer.callback_handler)
        model = trainer.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        forward_entry(inner).register_forward_pre_hook(self._forward, with_kwargs=True)
        return trainer

    def _forward(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.fired and self.wall is not None and ids is not None and ids.shape[0] >= self.wall:
            raise torch.OutOfMemoryError("CUDA out of memory (planted wall)")
        if self.bus.own_passes or self.fired or self.step + 1 != self.at:
            return
        self.forwards += 1
        if self.forwards == self.micro:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    def on_step_begin(self, args, state, control, **kwargs):
        self.step, self.forwards = state.global_step, 0


class Rows(torch.utils.data.Dataset):
    """Rows of random token ids, lengths spread between half and all of ``tokens`` (so splits pad differently)."""

    def __init__(self, count: int, tokens: int, vocab: int):
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(3, vocab, (int(tokens // 2 + (i * 7919) % (tokens // 2 + 1)),),
                                   generator=generator).tolist() for i in range(count)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def model_and_tokenizer(cuda: bool):
    """GPU: Qwen2.5-0.5B's shape (random weights; the rows are random ids, the tokenizer only pads); CPU: the tests'
    tiny Llama at hidden 256, 4 layers."""
    from hf_perf_callbacks.tiny import build_model, build_tokenizer

    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    if not cuda:
        return build_model(tok, hidden=256, layers=4, heads=4), tok
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config).to(device="cuda"), tok


def summary(check, clock: Steps) -> dict:
    """The check against the median step of the new split after it (its first step, which carries the check and
    the kernels' warm-up for the new shapes, left out)."""
    after = [s for s, split in zip(clock.seconds, clock.splits) if split == (check.new.micro_batch,
                                                                           check.new.grad_accum)][1:]
    step = statistics.median(after) if after else None
    return {"change": f"{check.old} → {check.new}", "kind": check.kind, "step": check.step, "verdict": check.verdict,
            "against": check.against, "why": check.why[:160], "check_sec": check.cost_sec, "passes": check.passes,
            "rows": check.rows, "check_peak_gb": check.peak_gb, "new_split_step_sec": step,
            "check_over_step": check.cost_sec / step if step else None, "sketch_bytes": check.sketch_bytes,
            "steady_peak_gb": max(clock.peaks) if clock.peaks else None}


def full_fine_tune(cuda: bool, micro: int, accum: int, tokens: int, steps: int, extra: dict, fault: PlantedOOM | None,
                   tune: bool = False) -> list[dict]:
    model, tok = model_and_tokenizer(cuda)
    tok = copy.copy(tok)
    tok.padding_side = "right"
    clock = Steps(cuda)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                 max_steps=steps, learning_rate=1e-5, optim="sgd", max_grad_norm=0.0,
                                 logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                                 bf16=cuda, use_cpu=not cuda, seed=0, **extra)
        rows = Rows(micro * accum * steps * 2, tokens, model.config.vocab_size)
        tuner = AdaptiveBatchTuner(tune=tune, must_pay=False, max_rounds=1)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                          callbacks=[*([fault] if fault else []), tuner, clock])
        if fault is not None:
            fault.attach(trainer)
        try:
            train_with_tuning(trainer)
        except ValueError as refused:                  # an inexact change ends the run: its check is the result
            print(f"refused: {str(refused)[:120]}")
        checks = read_split_file(out).checks
    release(trainer, model)
    return [summary(c, clock) for c in checks[:1]]


def grpo(cuda: bool, steps: int) -> list[dict]:
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from hf_perf_callbacks.tasks import wordle

    clock = Steps(cuda)
    fault = PlantedOOM(at=3)
    with tempfile.TemporaryDirectory() as out:
        if cuda:
            from common import qwen05_model, tokenizer

            model, tok, completion = qwen05_model(), tokenizer(), 64
        else:
            model, tok = model_and_tokenizer(False)
            completion = 12
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                          num_generations=8, max_completion_length=completion, max_steps=steps, learning_rate=1e-5,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, bf16=cuda,
                          use_cpu=not cuda, seed=0, activation_checkpointing=False)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=wordle.REWARD_FUNCS, args=args,
                              train_dataset=wordle.make_dataset(64), processing_class=tok, peft_config=lora,
                              callbacks=[fault, AdaptiveBatchTuner(tune=False), clock])
        fault.attach(trainer)
        train_with_tuning(trainer)
        checks = read_split_file(out).checks
    release(trainer, model)
    return [summary(c, clock) for c in checks[:1]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", type=int, nargs=2, default=None, help="micro-batch and accumulation")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", nargs="*", default=None, help="the cases to run (default: all)")
    cli = parser.parse_args()
    cuda = torch.cuda.is_available()
    micro, accum = cli.split or ((8, 2) if cuda else (4, 2))
    tokens = cli.tokens or (512 if cuda else 128)
    cases = {
        "oom": lambda: full_fine_tune(cuda, micro, accum, tokens, cli.steps, {}, PlantedOOM(at=4)),
        "oom, at the wall": lambda: full_fine_tune(cuda, micro, accum, tokens, cli.steps, {},
                                                   PlantedOOM(at=4, wall=micro)),
        "tuning trial": lambda: full_fine_tune(cuda, micro, accum, tokens, cli.steps, {}, None, tune=True),
        "neftune": lambda: full_fine_tune(cuda, micro, accum, tokens, cli.steps, {"neftune_noise_alpha": 5.0},
                                          PlantedOOM(at=4)),
        "grpo": lambda: grpo(cuda, cli.steps),
    }
    results = {}
    for name, case in cases.items():
        if cli.cases and name not in cli.cases:
            continue
        results[name] = case()
        for r in results[name]:
            ratio = f"{r['check_over_step']:.2f}" if r["check_over_step"] is not None else "n/a"
            print(f"{name}: {r['change']} at step {r['step']}: {r['verdict']} against {r['against'] or '-'}, "
                  f"{r['check_sec']:.3f} s, {r['passes']} passes over {r['rows']} rows; step of the new split "
                  f"{r['new_split_step_sec'] or float('nan'):.3f} s: {ratio} step")
    device = torch.cuda.get_device_name().split()[1].lower() if cuda else "cpu"
    print(write_result(f"exactness_{device}", {"cases": results, "threads": torch.get_num_threads(),
                                               "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
