"""Memory of GRPO + LoRA per Qwen2.5 size at the Mac recipes' settings: the CUDA allocator's peak against
``hf_perf_callbacks.estimate``'s prediction, point by point.

For each model size (0.5B, 1.5B, 3B, 7B: the shapes of the public ``config.json`` files, written below; random
weights built directly on the GPU in bf16, nothing downloaded), each distinct memory-relevant setting of the Mac
recipes (``recipes/mac-*.yaml``: micro-batch, generation batch, LoRA rank and targets, activation
checkpointing, ``bf16``, ``pad_to_multiple_of``) and each ``max_completion_length`` (256, 512), a short GRPO + LoRA run
(``--steps`` optimizer steps, completions forced to the maximum length with ``min_new_tokens``) records

- ``peak_allocated_gb`` (``torch.cuda.max_memory_allocated``) and ``peak_reserved_gb``, both in GiB, minus what
  was still allocated before the model was built (``baseline_gb``);
- the same peak split into the generation phase (``generate``) and the rest (training forward/backward, optimizer);
- the prompt and training sequence lengths actually seen, and ``estimate_grpo_memory`` at exactly that point, with
  ``error`` = estimate / measured − 1 (target: within ±15 %).

Results are written to ``benchmarks/results/memory_tiers.json`` after every point (a timeout keeps what was
measured); points are skipped once ``--budget_s`` seconds have passed.

    python benchmarks/bench_memory_tiers.py             # one GPU; about 5-7 minutes on an H100
    python benchmarks/bench_memory_tiers.py --smoke     # CPU, tiny shapes: proves the script end to end
"""
from __future__ import annotations

import argparse
import gc
import glob
import os
import sys
import tempfile
import time

import torch
import yaml
from common import GB, environment, table, tokenizer, write_result

from hf_perf_callbacks import estimate
from hf_perf_callbacks.train import recipes

#: Hugging Face config keys of Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct (each model's config.json on the hub).
QWEN25_CONFIGS = {
    "Qwen2.5-0.5B": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-3B": dict(num_hidden_layers=36, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
#: CPU smoke shape (same architecture, tiny).
TINY = {"tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)}

#: Recipe keys that change memory (the rest — learning rate, saving, logging — does not).
MEMORY_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "lora_r",
               "lora_alpha", "lora_dropout", "lora_target_modules", "activation_checkpointing", "bf16", "dtype",
               "pad_to_multiple_of", "beta")


def mac_settings(pattern: str = "mac-*.yaml") -> list[dict]:
    """The distinct memory-relevant settings of the Mac recipes, each with the recipes that use it."""
    settings: dict[tuple, dict] = {}
    for path in sorted(glob.glob(os.path.join(recipes.DIR, pattern))):
        recipe = yaml.safe_load(open(path, encoding="utf-8"))
        values = {key: recipe.get(key) for key in MEMORY_KEYS}
        values["generation_batch"] = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"]
        # num_generations only groups the generation batch; it does not change what is held
        key = tuple(str(values[k]) for k in MEMORY_KEYS if k != "num_generations")
        entry = settings.setdefault(key, {**values, "recipes": []})
        entry["recipes"].append(os.path.basename(path))
    return list(settings.values())


def model_dict(config: dict, params: int) -> dict:
    """``hf_perf_callbacks.estimate``'s model dict for a config above."""
    return estimate.model_from_config({**config, "head_dim": None, "params": params})


def build_model(config: dict, device: str):
    """Random Qwen2 weights in bf16, built on ``device`` directly (a 7B takes seconds, not minutes)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    tok = tokenizer()
    cfg = Qwen2Config(**config, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model


class PhasePeaks:
    """Allocator peaks of the generation phase and of the rest, and the sequence lengths seen (a ``generate``
    wrapper and a forward pre-hook; peaks are reset around each ``generate`` call)."""

    def __init__(self, model, cuda: bool):
        self.cuda, self.generation, self.other = cuda, 0, 0
        self.prompt_len = self.generated_len = self.train_seq = 0
        original = model.generate

        def generate(*args, **kwargs):
            self._cut("other")
            out = original(*args, **kwargs)
            self.prompt_len = max(self.prompt_len, kwargs["input_ids"].shape[1])
            self.generated_len = max(self.generated_len, out.shape[1] - kwargs["input_ids"].shape[1])
            self._cut("generation")
            return out

        model.generate = generate
        model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        if torch.is_grad_enabled() and kwargs.get("input_ids") is not None:
            self.train_seq = max(self.train_seq, kwargs["input_ids"].shape[1])

    def _cut(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            setattr(self, phase, max(getattr(self, phase), torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()

    def finish(self) -> None:
        self._cut("other")


def run_point(name: str, config: dict, setting: dict, completion: int, steps: int, device: str) -> dict:
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from hf_perf_callbacks.tasks import wordle

    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    model = build_model(config, device)
    params = sum(p.numel() for p in model.parameters())
    out_dir = tempfile.mkdtemp(prefix="mem_tiers_")
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, max_completion_length=completion,
        per_device_train_batch_size=setting["per_device_train_batch_size"],
        gradient_accumulation_steps=setting["gradient_accumulation_steps"],
        num_generations=setting["num_generations"], activation_checkpointing=setting["activation_checkpointing"],
        bf16=bool(setting["bf16"]) and cuda, beta=setting["beta"] or 0.0,
        pad_to_multiple_of=setting["pad_to_multiple_of"], learning_rate=1e-5, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=not cuda,
        generation_kwargs={"min_new_tokens": completion})     # every completion at its maximum: the worst case
    targets = setting["lora_target_modules"]
    lora = LoraConfig(r=setting["lora_r"], lora_alpha=setting["lora_alpha"], lora_dropout=setting["lora_dropout"],
                      target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=wordle.REWARD_FUNCS, args=args,
                          train_dataset=wordle.make_dataset(64, seed=0), processing_class=tokenizer(),
                          peft_config=lora)
    lora_params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    phases = PhasePeaks(trainer.model, cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    phases.finish()
    seconds = time.perf_counter() - start
    reserved = torch.cuda.max_memory_reserved() if cuda else None

    m = model_dict(config, params)
    prompt_tokens = max(phases.train_seq - completion, 0)
    triton = cuda and _triton()
    est = estimate.estimate_grpo_memory(
        m, micro_batch=setting["per_device_train_batch_size"], num_generations=setting["num_generations"],
        generation_batch=setting["generation_batch"], prompt_tokens=prompt_tokens, max_completion_length=completion,
        dtype_bytes=2, lora_params=lora_params, activation_checkpointing=setting["activation_checkpointing"],
        lm_head="triton" if triton else "torch", lora_input_bytes=2 if args.bf16 else 4)
    peak = max(phases.generation, phases.other) - baseline if cuda else None
    row = {"model": name, "recipes": setting["recipes"], "micro_batch": setting["per_device_train_batch_size"],
           "generation_batch": setting["generation_batch"], "max_completion_length": completion,
           "activation_checkpointing": setting["activation_checkpointing"], "bf16_autocast": args.bf16,
           "params": params, "lora_params": lora_params, "prompt_len": phases.prompt_len,
           "generated_len": phases.generated_len, "train_seq": phases.train_seq,
           "lm_head": "triton" if triton else "torch",
           "baseline_gb": baseline / GB,
           "peak_allocated_gb": peak / GB if peak is not None else None,
           "generation_peak_gb": (phases.generation - baseline) / GB if cuda else None,
           "training_peak_gb": (phases.other - baseline) / GB if cuda else None,
           "peak_reserved_gb": reserved / GB if reserved is not None else None,
           "estimate_gb": {k: v / GB for k, v in est.items()},
           "error": est["peak"] / peak - 1 if peak else None, "seconds": seconds,
           "forced_to_max": phases.generated_len == completion}
    del trainer, model, phases
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def _triton() -> bool:
    from transformers.utils import is_triton_available

    return is_triton_available()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, short completions")
    p.add_argument("--models", nargs="*", default=None, help=f"subset of {list(QWEN25_CONFIGS)}")
    p.add_argument("--completions", nargs="*", type=int, default=None, help="default 256 512 (smoke: 8 16)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per point")
    p.add_argument("--budget_s", type=float, default=450.0, help="skip the remaining points after this many s")
    p.add_argument("--output", default=None, help="JSON path (default results/memory_tiers.json; smoke: a temp dir)")
    a = p.parse_args(argv)
    if a.smoke:
        device, configs, completions = "cpu", TINY, a.completions or [8, 16]
        name = os.path.join(tempfile.mkdtemp(prefix="mem_tiers_smoke_"), "memory_tiers_smoke")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
            return 2
        device, configs, completions = "cuda", QWEN25_CONFIGS, a.completions or [256, 512]
        name = "memory_tiers"
    if a.models:
        configs = {k: configs[k] for k in a.models}
    if a.output:
        name = a.output[:-5] if a.output.endswith(".json") else a.output
    settings = mac_settings()
    points = [(m, s, c) for c in completions for m in configs for s in settings]
    rows: list[dict] = []
    start = time.perf_counter()
    for model_name, setting, completion in points:
        label = f"{model_name} micro {setting['per_device_train_batch_size']} completion {completion}"
        if time.perf_counter() - start > a.budget_s:
            rows.append({"model": model_name, "recipes": setting["recipes"], "max_completion_length": completion,
                         "micro_batch": setting["per_device_train_batch_size"], "skipped": "time budget"})
            continue
        print(f"-- {label}", flush=True)
        try:
            rows.append(run_point(model_name, configs[model_name], setting, completion, a.steps, device))
        except torch.OutOfMemoryError as error:
            rows.append({"model": model_name, "recipes": setting["recipes"], "max_completion_length": completion,
                         "micro_batch": setting["per_device_train_batch_size"], "oom": str(error)[:200]})
            gc.collect()
            torch.cuda.empty_cache()
        _write(name, rows, a, settings, device)
    _summary(rows)
    print(f"wrote {name}.json")
    return 0


def _write(name: str, rows: list[dict], a, settings, device) -> None:
    measured = [r for r in rows if r.get("error") is not None]
    payload = {"settings": {"steps": a.steps, "device": device, "recipe_settings": settings},
               "points": rows, "max_abs_error": max((abs(r["error"]) for r in measured), default=None),
               "target_abs_error": 0.15}
    if os.path.isabs(name):
        import json

        with open(f"{name}.json", "w", encoding="utf-8") as f:
            json.dump({"benchmark": "memory_tiers", "environment": environment(), **payload}, f, indent=1,
                      default=float)
    else:
        write_result(name, payload)


def _summary(rows: list[dict]) -> None:
    done = [r for r in rows if "peak_allocated_gb" in r]
    print(table(["model", "micro", "completion", "seq", "peak GiB", "gen GiB", "train GiB", "reserved GiB",
                 "estimate GiB", "error", "s"],
                [[r["model"], r["micro_batch"], r["max_completion_length"], r["train_seq"],
                  _num(r["peak_allocated_gb"]), _num(r["generation_peak_gb"]), _num(r["training_peak_gb"]),
                  _num(r["peak_reserved_gb"]), r["estimate_gb"]["peak"], _num(r["error"]), r["seconds"]]
                 for r in done]))
    for r in rows:
        if "peak_allocated_gb" not in r:
            print(f"{r['model']} micro {r['micro_batch']} completion {r['max_completion_length']}: "
                  f"{r.get('skipped') or r.get('oom')}")


def _num(value):
    return "n/a" if value is None else float(value)


if __name__ == "__main__":
    sys.exit(main())
