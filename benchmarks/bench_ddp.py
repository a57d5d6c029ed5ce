"""Two GPUs, NCCL: ``accelerate launch --config_file recipes/accelerate/multi_gpu.yaml benchmarks/bench_ddp.py``.

GRPO+LoRA on the 0.5B-shaped random model, bf16, DDP over two ranks:
1. throughput is aggregated (global = sum over ranks, per device beside it) and logged once; the callbacks'
   cross-rank collectives are counted and timed per optimizer step;
2. an OOM forced on rank 1 only (a CUDA memory fraction on that rank) re-sizes both ranks to the same split, and the
   run reaches max_steps with the same effective batch;
3. a watchdog stop on rank 1 only (a tiny budget there) stops both ranks at the same step with one checkpoint.
"""
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from common import GB, RESULTS, grpo_trainer, median, table, write_result

from hf_perf_callbacks import (AdaptiveBatchTuner, MemoryWatchdog, MPSCacheClearer, ThroughputMeter,
                               train_with_tuning)
from hf_perf_callbacks import throughput as throughput_module
from hf_perf_callbacks import tuner as tuner_module
from hf_perf_callbacks import watchdog as watchdog_module

COLLECTIVES = {"calls": 0, "seconds": 0.0}
RANK = int(os.environ.get("RANK", 0))
SHARED = "/tmp/hf_perf_ddp"                 # one directory for both ranks (the same machine)


def count_collectives():
    """Count and time every cross-rank exchange the callbacks make (they all go through gather_floats)."""
    for module in (throughput_module, watchdog_module, tuner_module):
        original = module.gather_floats

        @functools.wraps(original)
        def counted(values, device=None, _original=original):
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return _original(values, device)
            finally:
                torch.cuda.synchronize()
                COLLECTIVES["calls"] += 1
                COLLECTIVES["seconds"] += time.perf_counter() - start

        module.gather_floats = counted


def throughput(steps: int) -> dict:
    out = os.path.join(SHARED, "throughput")
    meter = ThroughputMeter(warmup_window=3)
    callbacks = [meter, MemoryWatchdog(), MPSCacheClearer(), AdaptiveBatchTuner(probe=False)]
    trainer = grpo_trainer(out, callbacks, 8, 2, steps, 32, ddp_timeout=180)
    COLLECTIVES.update(calls=0, seconds=0.0)
    trainer.train()
    s = meter.summary
    result = {"rank": RANK, "steady_tokens_per_sec": s["steady_tokens_per_sec"],
              "mean_tokens_per_sec": s["mean_tokens_per_sec"], "world": s["world_size"], "tokens": s["tokens"],
              "tokens_seen": trainer.state.num_input_tokens_seen, "warmup_steps": s["warmup_steps"],
              "collectives_per_step": COLLECTIVES["calls"] / steps,
              "collective_ms_per_step": 1000 * COLLECTIVES["seconds"] / steps,
              "steady_step_sec": s["steady_step_sec"]}
    if RANK == 0:
        lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
        result["perf_log_steps"] = [x["step"] for x in lines if x["type"] == "step"]
        result["per_device_logged"] = [x.get("perf/tokens_per_sec_per_device") for x in lines if x["type"] == "step"]
    return result


def oom_on_rank1(steps: int, limit_gb: float) -> dict:
    if RANK == 1:
        torch.cuda.set_per_process_memory_fraction(limit_gb * GB / torch.cuda.get_device_properties(0).total_memory)
    tuner = AdaptiveBatchTuner(probe=False)
    trainer = grpo_trainer(os.path.join(SHARED, "oom"), [ThroughputMeter(), tuner], 32, 1, steps, 32, ddp_timeout=180)
    start = time.perf_counter()
    train_with_tuning(trainer)
    torch.cuda.set_per_process_memory_fraction(1.0)
    args = trainer.args
    return {"rank": RANK, "limit_gb": limit_gb if RANK == 1 else None, "reached": trainer.state.global_step,
            "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
            "effective_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * 2,
            "generation_batch": args.generation_batch_size, "seconds": time.perf_counter() - start,
            "decisions": [{k: d.get(k) for k in ("kind", "step", "old", "new", "recovery_sec", "reason")}
                          for d in tuner.decisions]}


def stop_on_rank1(steps: int) -> dict:
    out = os.path.join(SHARED, "stop")
    watchdog = MemoryWatchdog(limit_gb=0.01 if RANK == 1 else None, grace_steps=2)
    trainer = grpo_trainer(out, [watchdog], 8, 2, steps, 32, ddp_timeout=180)
    trainer.train()
    return {"rank": RANK, "stopped_at_step": trainer.state.global_step, "watchdog_stopped_at": watchdog.stopped_at,
            "actions": [a["action"] for a in watchdog.actions],
            "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))}


def main():
    count_collectives()
    with open(os.path.join(RESULTS, "tuner.json")) as f:
        peaks = {r["split"]: r["peak_gb"] for r in json.load(f)["sweep"] if "peak_gb" in r}
    limit = 0.5 * (peaks["16×2"] + peaks["32×1"])
    skip = set(sys.argv[1:])                   # e.g. "oom": run only the other scenarios
    results = {"throughput": throughput(8), "stop": stop_on_rank1(8)}
    if "oom" not in skip:
        results["oom"] = oom_on_rank1(4, limit)
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if RANK == 0:
        by_rank = {k: [g[k] for g in gathered] for k in results}
        t0, t1 = by_rank["throughput"]
        payload = {"ranks": by_rank, "global_tokens_per_sec_equal_on_ranks":
                   t0["steady_tokens_per_sec"] == t1["steady_tokens_per_sec"],
                   "logged_once": t0["perf_log_steps"] == list(range(1, 9)),
                   "oom_same_split": ("oom" in by_rank and by_rank["oom"][0]["split"] == by_rank["oom"][1]["split"]),
                   "scenarios_skipped": sorted(skip),
                   "stop_same_step": by_rank["stop"][0]["stopped_at_step"] == by_rank["stop"][1]["stopped_at_step"]}
        write_result("ddp", payload)
        print(table(["rank", "steady tok/s (global)", "per device", "collectives/step", "ms/step"],
                    [[t["rank"], t["steady_tokens_per_sec"], (t["steady_tokens_per_sec"] or 0) / t["world"],
                      t["collectives_per_step"], t["collective_ms_per_step"]] for t in (t0, t1)]))
        if "oom" in by_rank:
            print(table(["rank", "OOM: split after", "effective", "reached", "decisions"],
                        [[o["rank"], "×".join(map(str, o["split"])), o["effective_batch"], o["reached"],
                          "; ".join(f"{d['kind']}@{d['step']}: {d['old']['micro_batch']}→{d['new']['micro_batch']}"
                                    for d in o["decisions"])] for o in by_rank["oom"]]))
        print(table(["rank", "stopped at", "actions", "checkpoints"],
                    [[s["rank"], s["stopped_at_step"], ",".join(s["actions"]), ",".join(s["checkpoints"])]
                     for s in by_rank["stop"]]))
    dist.barrier()


if __name__ == "__main__":
    os.makedirs(SHARED, exist_ok=True)
    main()
