"""5. Watchdog on a planted GPU leak, over seeds: each step keeps a new tensor of a seeded random size alive; a CUDA
memory fraction just above the budget makes a real OOM the price of missing it. Reported per seed: the step the
leak was detected, the stop step, memory at the stop vs the budget, a checkpoint before any OOM, the error of
``mem/steps_to_wall`` against the true number of steps to the wall (from the planted schedule), and how often the
logged range ``mem/steps_to_wall_low`` … ``_high`` holds that truth (over all forecasts, per seed, and at the forecast
the watchdog acted on: its stop), and what the watchdog read against what was planted (``reading_minus_planted_mb``).

``--smoke`` runs the same on the CPU (the leak in resident memory, the budget above the process RSS, no OOM guard)
with a few seeds, to prove the script works.
"""
import argparse
import gc
import json
import math
import os
import random
import tempfile

import psutil
import torch
from common import GB, median, table, tokenizer, write_result
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from hf_perf_callbacks import MemoryWatchdog
from hf_perf_callbacks.tiny import build_model


class Leak(TrainerCallback):
    def __init__(self, sizes, device="cuda"):
        self.sizes, self.kept, self.device = sizes, [], device

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(self.sizes[state.global_step - 1], dtype=torch.uint8, device=self.device))


class Texts(torch.utils.data.Dataset):
    def __init__(self):
        from hf_perf_callbacks.tasks import wordle

        self.items = [tokenizer()(p, truncation=True, max_length=128)["input_ids"]
                      for p in wordle.make_dataset(64)["prompt"]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def one_seed(seed: int, headroom_gb: float, mean_leak_mb: float, max_steps: int, cpu: bool = False) -> dict:
    rng = random.Random(seed)
    sizes = [int(mean_leak_mb * 2**20 * rng.uniform(0.5, 1.5)) for _ in range(max_steps)]
    gc.collect()
    if cpu:
        model = build_model(tokenizer(), hidden=64, layers=2, heads=2, seed=seed)
        base = psutil.Process().memory_info().rss
        budget = base + headroom_gb * GB
    else:
        torch.cuda.empty_cache()
        model = build_model(tokenizer(), hidden=256, layers=4, heads=4, seed=seed).cuda()
        base = torch.cuda.memory_allocated()
        budget = base + headroom_gb * GB
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (budget + 0.5 * GB) / total))
    out = tempfile.mkdtemp()
    watchdog = MemoryWatchdog(limit_gb=budget / GB, grace_steps=2, trend_window=4, warn_within_steps=6,
                              stop_within_steps=3)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=max_steps, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, seed=seed, bf16=not cpu,
                             use_cpu=cpu)
    trainer = Trainer(model=model, args=args, train_dataset=Texts(),
                      callbacks=[Leak(sizes, "cpu" if cpu else "cuda"), watchdog],
                      data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False))
    oom = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        oom = str(error)[:100]
    lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
    steps = {x["step"]: x for x in lines if x["type"] == "step"}
    events = [x for x in lines if x["type"] == "event" and x["source"] == "mem"]
    stop = watchdog.stopped_at
    errors, held, at_stop = [], [], None
    for s, line in steps.items():                       # true steps to the wall from the planted schedule
        if "mem/steps_to_wall" not in line:
            continue
        used, k = line["mem/device_used_gb"] * GB, 0
        while used < budget and s + k < max_steps:
            used += sizes[s + k]
            k += 1
        if used >= budget and k > 0:
            errors.append(abs(line["mem/steps_to_wall"] - k) / k)
            held.append(line["mem/steps_to_wall_low"] <= k <= line.get("mem/steps_to_wall_high", float("inf")))
            if s == stop:                               # the forecast the watchdog acted on
                at_stop = {"low": line["mem/steps_to_wall_low"], "point": line["mem/steps_to_wall"],
                           "high": line.get("mem/steps_to_wall_high"), "true": k, "held": held[-1]}
    detected = min((e["step"] for e in events), default=None)
    used_at_stop = steps[stop]["mem/device_used_gb"] * GB if stop else None
    result = {"seed": seed, "detected_step": detected, "stop_step": stop, "oom": oom,
              "checkpoint": bool(stop) and os.path.isdir(os.path.join(out, f"checkpoint-{stop}")),
              "budget_gb": budget / GB, "used_at_stop_gb": used_at_stop / GB if used_at_stop else None,
              "stop_fraction_of_budget": used_at_stop / budget if used_at_stop else None,
              "steps_to_wall_median_error": median(errors), "steps_to_wall_errors": errors,
              "range_held": held, "range_coverage": sum(held) / len(held) if held else None, "at_stop": at_stop,
              # what the watchdog read against what was planted: the forecasts can be no better than the readings
              "reading_minus_planted_mb": [round((steps[s]["mem/device_used_gb"] * GB - base - sum(sizes[:s])) / 2**20,
                                                 1) for s in sorted(steps) if "mem/device_used_gb" in steps[s]]}
    if cpu:
        return result
    torch.cuda.set_per_process_memory_fraction(1.0)
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, Leak):
            cb.kept.clear()                    # the next seed starts from a clean device
    del trainer, model, watchdog
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--headroom_gb", type=float, default=3.0)
    p.add_argument("--mean_leak_mb", type=float, default=128.0)
    p.add_argument("--max_steps", type=int, default=80)
    p.add_argument("--smoke", action="store_true", help="CPU, 3 seeds, a small leak in resident memory")
    a = p.parse_args()
    if a.smoke:
        a.seeds, a.headroom_gb, a.mean_leak_mb, a.max_steps = min(a.seeds, 3), 0.25, 16.0, 40
    runs = []
    for seed in range(a.seeds):
        runs.append(one_seed(seed, a.headroom_gb, a.mean_leak_mb, a.max_steps, cpu=a.smoke))
        if not a.smoke:
            torch.cuda.empty_cache()
    saved = sum(r["checkpoint"] and not r["oom"] for r in runs)
    errors = [e for r in runs for e in r["steps_to_wall_errors"]]
    held = [h for r in runs for h in r["range_held"]]
    seeds_covered = sum(r["range_coverage"] is not None and r["range_coverage"] >= 0.9 for r in runs)
    held_at_stop = sum(bool(r["at_stop"] and r["at_stop"]["held"]) for r in runs)
    result = {"seeds": a.seeds, "checkpointed_before_oom": saved, "median_steps_to_wall_error": median(errors),
              "p90_steps_to_wall_error": sorted(errors)[int(0.9 * (len(errors) - 1))] if errors else None,
              "range_coverage": sum(held) / len(held) if held else None, "forecasts": len(held),
              "seeds_with_range_coverage_90": seeds_covered, "seeds_range_held_at_stop": held_at_stop,
              "runs": runs, "settings": vars(a),
              "targets": {"checkpointed": a.seeds, "steps_to_wall_error": 0.2, "range_coverage": 0.9,
                          "seeds_with_range_coverage_90": math.ceil(0.9 * a.seeds)}}
    write_result("watchdog_smoke" if a.smoke else "watchdog", result)
    print(table(["seed", "detected", "stopped", "used/budget", "checkpoint", "OOM", "stw median err",
                 "range coverage"],
                [[r["seed"], r["detected_step"], r["stop_step"], r["stop_fraction_of_budget"], r["checkpoint"],
                  bool(r["oom"]), r["steps_to_wall_median_error"], r["range_coverage"]] for r in runs]))
    print(table(["checkpointed before OOM", "median stw error", "p90 stw error", "range coverage",
                 "seeds with coverage >= 90%", "range held at the stop", "targets"],
                [[f"{saved}/{a.seeds}", result["median_steps_to_wall_error"], result["p90_steps_to_wall_error"],
                  result["range_coverage"], f"{seeds_covered}/{a.seeds}", f"{held_at_stop}/{a.seeds}",
                  f"{a.seeds}/{a.seeds}, <= 20% or the range holding >= 90% in 9 of 10 seeds"]]))


if __name__ == "__main__":
    main()
