"""3. Tuner quality: GRPO+LoRA (0.5B-shaped) at a fixed effective batch (8 generations × 4 prompts = 32
completions per optimizer step). Throughput of (a) the split the tuner's probe chooses, (b) every exact split,
(c) micro-batch 1; and the tuner under a small forced memory budget (``set_per_process_memory_fraction``).

Splits are ranked by the split-dependent time (step minus generation: generation does not depend on the split and
varies by ±12% between identical batches), reported as training tokens/s; end-to-end tokens/s beside it.
"""
import argparse
import json
import subprocess
import sys
import tempfile

import torch
from common import GB, StepClock, grpo_trainer, median, release, table, write_result

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, train_with_tuning
from hf_perf_callbacks.batching import exact_splits


def measure(clock: StepClock, skip: int = 1) -> dict:
    walls, gens, tokens = clock.walls[skip:], clock.generation[skip:], clock.tokens[skip:]
    rest = [w - g for w, g in zip(walls, gens)]
    return {"step_s": median(walls), "non_generation_s": median(rest), "tokens_per_step": median(tokens),
            "tokens_per_sec": median(tokens) / median(walls), "train_tokens_per_sec": median(tokens) / median(rest)}


def sweep_one(micro: int, accum: int, a) -> dict:
    clock = StepClock()
    trainer = grpo_trainer(tempfile.mkdtemp(), [clock], micro, accum, a.steps, a.completion)
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        return {"split": f"{micro}×{accum}", "error": str(error)[:120]}
    result = {"split": f"{micro}×{accum}", "micro": micro, "accum": accum,
              "peak_gb": torch.cuda.max_memory_allocated() / GB, **measure(clock)}
    release(trainer)
    return result


def tuned(a, start: tuple[int, int], limit_gb: float | None = None) -> dict:
    clock = StepClock()
    tuner = AdaptiveBatchTuner(probe_steps=a.probe_steps, rank_by=a.rank_by)
    watchdog = MemoryWatchdog(limit_gb=limit_gb)      # its budget bounds the probe; its high-water mark is the peak
    trainer = grpo_trainer(tempfile.mkdtemp(), [clock, tuner, watchdog], start[0], start[1], a.steps, a.completion)
    train_with_tuning(trainer)
    probe = tuner.decisions[0]
    result = {"chosen": f"{trainer.args.per_device_train_batch_size}×{trainer.args.gradient_accumulation_steps}",
              "probe_sec": probe["probe_sec"], "trials": probe["trials"], "reason": probe["reason"],
              "peak_gb": watchdog.high_water / GB, **measure(clock)}
    release(trainer)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--probe_steps", type=int, default=2)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--part", default="all", choices=["all", "sweep", "tuned", "budget"])
    p.add_argument("--limit_gb", type=float, default=None)
    p.add_argument("--rank_by", default="non_generation", choices=["step", "non_generation"])
    a = p.parse_args()
    if a.part == "all":                    # each part in its own process (a memory fraction is per process)
        parts = {}
        for part in ("sweep", "tuned"):
            parts[part] = _child(part, a)
        sweep = [r for r in parts["sweep"] if "error" not in r]
        peaks = {r["split"]: r["peak_gb"] for r in sweep}
        limit = 0.5 * (peaks["8×4"] + peaks["16×2"])           # only splits up to 8 completions fit
        parts["budget"] = _child("budget", a, limit)
        report(parts["sweep"], parts["tuned"], parts["budget"], limit, a)
        return
    if a.part == "sweep":
        rows = [sweep_one(s.micro_batch, s.grad_accum, a) for s in exact_splits(32, 1, 32, 8)]
        print("RESULT", json.dumps(rows))
    elif a.part == "tuned":
        print("RESULT", json.dumps(tuned(a, (4, 8))))
    else:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (a.limit_gb + 0.5) * GB /
                                                       torch.cuda.get_device_properties(0).total_memory))
        print("RESULT", json.dumps(tuned(a, (32, 1), limit_gb=a.limit_gb)))


def _child(part: str, a, limit: float | None = None):
    cmd = [sys.executable, __file__, "--part", part, "--steps", str(a.steps), "--probe_steps", str(a.probe_steps),
           "--completion", str(a.completion), "--rank_by", a.rank_by] + (["--limit_gb", str(limit)] if limit else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def report(sweep, tuned_run, budget_run, limit, a):
    ok = [r for r in sweep if "error" not in r]
    best = max(ok, key=lambda r: r["train_tokens_per_sec"])
    one = next(r for r in ok if r["micro"] == 1)
    result = {"sweep": sweep, "tuned": tuned_run, "budget": {**budget_run, "limit_gb": limit},
              "best_split": best["split"],
              "tuned_vs_best_train": tuned_run["train_tokens_per_sec"] / best["train_tokens_per_sec"],
              "tuned_vs_best_end_to_end": tuned_run["tokens_per_sec"] / max(r["tokens_per_sec"] for r in ok),
              "tuned_vs_micro1_train": tuned_run["train_tokens_per_sec"] / one["train_tokens_per_sec"],
              "tuned_vs_micro1_end_to_end": tuned_run["tokens_per_sec"] / one["tokens_per_sec"],
              "budget_respected": budget_run["peak_gb"] <= limit, "settings": vars(a),
              "targets": {"tuned_vs_best": 0.95}}
    write_result("tuner", result)
    print(table(["split", "step s", "non-gen s", "train tok/s", "end-to-end tok/s", "peak GB"],
                [[r["split"], r["step_s"], r["non_generation_s"], r["train_tokens_per_sec"], r["tokens_per_sec"],
                  r["peak_gb"]] for r in ok] + [[f"tuner: {tuned_run['chosen']}", tuned_run["step_s"],
                                                 tuned_run["non_generation_s"], tuned_run["train_tokens_per_sec"],
                                                 tuned_run["tokens_per_sec"], tuned_run["peak_gb"]]]))
    print(table(["tuned/best (train)", "tuned/best (e2e)", "tuned/micro-1 (train)", "tuned/micro-1 (e2e)",
                 "probe s", f"budget {limit:.2f} GB: chosen", "peak GB"],
                [[result["tuned_vs_best_train"], result["tuned_vs_best_end_to_end"], result["tuned_vs_micro1_train"],
                  result["tuned_vs_micro1_end_to_end"], tuned_run["probe_sec"], budget_run["chosen"],
                  budget_run["peak_gb"]]]))


if __name__ == "__main__":
    main()
