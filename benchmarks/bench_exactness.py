"""The exactness check's cost: seconds and memory per split checked, against one optimizer step of the same run.

A full fine-tune of a causal LM (GPU: Qwen2.5-0.5B's shape in bf16, rows of ``--tokens`` tokens; CPU: the tests'
tiny Llama at hidden 256, 4 layers, float32) under ``train_with_tuning`` at the split ``--split``: the check runs
at the first step (every other split of the effective batch), then ``--steps`` steps train. Recorded:

* the check's seconds, passes and seconds per split checked, against the median of the steady steps (steps 3 on);
* the peak memory during the check against the steady steps' peak (GPU), the sketches' bytes;
* the verdicts of a plain loss (every split exact) and of NEFTune (every split but the configured one inexact).

The plain case runs twice: first in a fresh process (its passes at new micro-batch shapes pay the kernels' and the
allocator's warm-up, as a re-size to those splits would), then warm.

Run: ``python benchmarks/bench_exactness.py`` (CUDA when present, else the CPU); results go to
``results/exactness_<device>.json``.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from common import release, write_result
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.splitfile import read_split_file


class Steps(TrainerCallback):
    """Each optimizer step's wall seconds (synchronized) and peak memory."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.peaks = cuda, [], []

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.seconds.append(time.perf_counter() - self.started)
        self.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0)


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
    """GPU: Qwen2.5-0.5B's shape (:func:`common.qwen05_model`'s config; the rows are random ids, the tokenizer only
    pads); CPU: the tests' tiny Llama at hidden 256, 4 layers."""
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


PASSES: list[dict] = []
CHECK_PEAK: list[float] = []


def timed_passes(cuda: bool) -> None:
    """Each pass of the check timed (synchronized), and the sketch's share of it."""
    from hf_perf_callbacks.resize import measured

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def wrap_pass(original):
        def timed(trainer, model, split, *args):
            sync()
            started = time.perf_counter()
            out = original(trainer, model, split, *args)
            sync()
            PASSES.append({"split": str(split), "sec": time.perf_counter() - started, "sketch_sec": SKETCH.pop(0)})
            return out
        return timed

    SKETCH: list[float] = []

    def wrap_sketch(original):
        def timed(*args, **kwargs):
            sync()
            started = time.perf_counter()
            out = original(*args, **kwargs)
            SKETCH.append(time.perf_counter() - started)
            return out
        return timed

    def wrap_measure(original):
        def peaked(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            out = original(*args, **kwargs)
            CHECK_PEAK.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
            return out
        return peaked

    measured._pass = wrap_pass(measured._pass)
    measured.sketch = wrap_sketch(measured.sketch)
    measured.measure = wrap_measure(measured.measure)


def run(cuda: bool, micro: int, accum: int, tokens: int, steps: int, extra: dict) -> dict:
    PASSES.clear()
    model, tok = model_and_tokenizer(cuda)
    tok = copy.copy(tok)
    tok.padding_side = "right"                        # training pads right (left padding is refused by rule)
    clock = Steps(cuda)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                 max_steps=steps, learning_rate=1e-5, optim="sgd", max_grad_norm=0.0,
                                 logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                                 bf16=cuda, use_cpu=not cuda, seed=0, **extra)
        rows = Rows(micro * accum * steps, tokens, model.config.vocab_size)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                          callbacks=[AdaptiveBatchTuner(tune=False), clock])
        train_with_tuning(trainer)
        check = read_split_file(out).measured
    release(trainer, model)
    steady = clock.seconds[2:] or clock.seconds
    step = statistics.median(steady)
    checked = len(check.exact) + len(check.inexact) - 1
    return {"split": f"{micro}×{accum}", "tokens": tokens, "extra": extra,
            "check_sec": check.cost_sec, "passes": check.passes, "splits_checked": checked,
            "check_sec_per_split": check.cost_sec / max(checked, 1), "step_sec": step,
            "check_per_split_over_step": check.cost_sec / max(checked, 1) / step,
            "check_peak_gb": CHECK_PEAK.pop() if CHECK_PEAK else None, "first_step_peak_gb": clock.peaks[0],
            "steady_peak_gb": max(clock.peaks[2:] or clock.peaks), "sketch_bytes": check.sketch_bytes,
            "exact": [str(s) for s in check.exact], "inexact": {str(s): w for s, w in check.inexact.items()},
            "drew_rng": check.drew_rng, "passes_timed": list(PASSES)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", type=int, nargs=2, default=None, help="micro-batch and accumulation")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    cli = parser.parse_args()
    cuda = torch.cuda.is_available()
    timed_passes(cuda)
    micro, accum = cli.split or ((8, 2) if cuda else (4, 2))
    tokens = cli.tokens or (512 if cuda else 128)
    cases = {"plain": {}, "neftune": {"neftune_noise_alpha": 5.0}}
    first_run = run(cuda, micro, accum, tokens, cli.steps, {})    # a run's first passes at new shapes pay warm-up
    results = {name: run(cuda, micro, accum, tokens, cli.steps, extra) for name, extra in cases.items()}
    results["plain, first in the process"] = first_run
    for name, r in results.items():
        print(f"{name}: check {r['check_sec']:.2f} s, {r['passes']} passes for {r['splits_checked']} splits "
              f"({r['check_per_split_over_step']:.2f} step per split; step {r['step_sec']:.3f} s); peak "
              f"{r['check_peak_gb']:.2f} GiB in the check vs {r['steady_peak_gb']:.2f} GiB steady; "
              f"sketches {r['sketch_bytes']} B; inexact {sorted(r['inexact'])}")
    device = torch.cuda.get_device_name().split()[1].lower() if cuda else "cpu"
    print(write_result(f"exactness_{device}", {"cases": results}))


if __name__ == "__main__":
    main()
