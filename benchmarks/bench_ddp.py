"""Two GPUs, NCCL:
``accelerate launch --config_file recipes/accelerate/multi_gpu.yaml benchmarks/bench_ddp.py``.

GRPO+LoRA on the 0.5B-shaped random model, bf16, DDP over two ranks:
1. throughput is aggregated (global = sum over ranks, per device beside it) and logged once; the callbacks'
   cross-rank collectives (with ``train_with_tuning``'s step guard) are counted and timed per optimizer step;
2. an OOM forced on rank 1 only (a CUDA memory fraction on that rank) re-sizes both ranks to the same split, and the
   run reaches max_steps with the same effective batch;
3. a watchdog stop on rank 1 only (a tiny budget there) stops both ranks at the same step with one checkpoint;
4. the step guard's cost: one flag exchange's latency, and an A/B of plain ``trainer.train()`` against
   ``train_with_tuning`` (arms interleaved, an independent clock).
"""
import functools
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from common import GB, StepClock, grpo_trainer, median, sweep_limit_gb, table, write_result

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, MPSCacheClearer, ThroughputMeter, train_with_tuning
from hf_perf_callbacks import throughput as throughput_module
from hf_perf_callbacks import watchdog as watchdog_module
from hf_perf_callbacks.platform.device import gather_floats
from hf_perf_callbacks.resize import agreement as agreement_module
from hf_perf_callbacks.resize import callback as tuner_module

COLLECTIVES = {"calls": 0, "seconds": 0.0}
RANK = int(os.environ.get("RANK", 0))
STEPS = 14                                  # the throughput scenario: enough for the warmup to end and a window
SHARED = f"/tmp/hf_perf_ddp/{os.getppid()}"  # one fresh directory per launch, shared by both ranks (same parent)


def count_collectives():
    """Count and time every cross-rank exchange the callbacks make (they all go through gather_floats)."""
    for module in (throughput_module, watchdog_module, agreement_module, tuner_module):
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
    callbacks = [meter, MemoryWatchdog(), MPSCacheClearer(), AdaptiveBatchTuner(tune=False)]
    trainer = grpo_trainer(out, callbacks, 8, 2, steps, 32, ddp_timeout=180)
    COLLECTIVES.update(calls=0, seconds=0.0)
    train_with_tuning(trainer)                 # with the step guard: its OOM agreement is counted too
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


def guard_overhead(steps: int, rounds: int) -> dict:
    """A/B of train_with_tuning's step guard (OOM agreement before each collective of the step, explicit gradient
    averaging) against plain ``trainer.train()``, same callbacks, arms interleaved; an independent clock."""
    arms = {"plain": [], "guarded": []}
    exchanges = []
    for r in range(rounds):
        for arm in arms:
            clock = StepClock()
            callbacks = [ThroughputMeter(), MemoryWatchdog(), MPSCacheClearer(), AdaptiveBatchTuner(tune=False), clock]
            trainer = grpo_trainer(os.path.join(SHARED, f"ab_{arm}_{r}"), callbacks, 8, 2, steps, 32, ddp_timeout=180)
            COLLECTIVES.update(calls=0, seconds=0.0)
            trainer.train() if arm == "plain" else train_with_tuning(trainer)
            if arm == "guarded":
                exchanges.append(COLLECTIVES["calls"] / steps)
            arms[arm] += [(w, w - g) for w, g in zip(clock.walls[2:], clock.generation[2:])]   # first 2: warm-up
    out = {"rank": RANK, "steps_per_arm": len(arms["plain"]), "collectives_per_step_guarded": median(exchanges)}
    for arm, rows in arms.items():
        out[f"{arm}_step_sec"] = median([w for w, _ in rows])
        out[f"{arm}_non_generation_sec"] = median([n for _, n in rows])
    out["step_ratio"] = out["guarded_step_sec"] / out["plain_step_sec"]
    out["non_generation_ratio"] = out["guarded_non_generation_sec"] / out["plain_non_generation_sec"]
    return out


def exchange_latency(n: int = 200) -> float:
    """Microseconds of one flag exchange (what the guard adds per collective) with both ranks in step."""
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(10):
        gather_floats([0.0, 1.0], device)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        gather_floats([0.0, 1.0], device)
    return 1e6 * (time.perf_counter() - start) / n


def oom_on_rank1(steps: int, limit_gb: float) -> dict:
    gpu = int(os.environ.get("LOCAL_RANK", RANK))          # this rank's GPU, before any trainer has set it
    if RANK == 1:
        total = torch.cuda.get_device_properties(gpu).total_memory
        torch.cuda.set_per_process_memory_fraction(limit_gb * GB / total, gpu)
    tuner = AdaptiveBatchTuner(tune=False, memory_check=False)    # the OOM path is measured, not the memory check
    trainer = grpo_trainer(os.path.join(SHARED, "oom"), [ThroughputMeter(), tuner], 32, 1, steps, 32, ddp_timeout=180)
    start = time.perf_counter()
    train_with_tuning(trainer)
    torch.cuda.set_per_process_memory_fraction(1.0, gpu)
    args = trainer.args
    return {"rank": RANK, "limit_gb": limit_gb if RANK == 1 else None, "reached": trainer.state.global_step,
            "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
            "effective_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * 2,
            "generation_batch": args.generation_batch_size, "seconds": time.perf_counter() - start,
            "decisions": [{k: d.to_json()[k] for k in ("kind", "step", "old", "new", "recovery_sec", "reason")}
                          for d in tuner.executor.record.decisions]}


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
    limit = sweep_limit_gb()
    skip = set(sys.argv[1:])                   # e.g. "oom": run only the other scenarios
    results = {}
    if "oom" not in skip:                      # first: the memory fraction assumes a process holding nothing else
        results["oom"] = oom_on_rank1(4, limit)
    for name, scenario in (("throughput", lambda: throughput(STEPS)), ("stop", lambda: stop_on_rank1(8)),
                           ("exchange_us", exchange_latency), ("guard", lambda: guard_overhead(10, 2))):
        gc.collect()
        torch.cuda.empty_cache()
        results[name] = scenario()
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if RANK == 0:
        by_rank = {k: [g[k] for g in gathered] for k in results}
        t0, t1 = by_rank["throughput"]
        payload = {"ranks": by_rank, "global_tokens_per_sec_equal_on_ranks":
                   t0["steady_tokens_per_sec"] == t1["steady_tokens_per_sec"],
                   "logged_once": t0["perf_log_steps"] == list(range(1, STEPS + 1)),
                   "oom_same_split": ("oom" in by_rank and by_rank["oom"][0]["split"] == by_rank["oom"][1]["split"]),
                   "oom_reached_max_steps": ("oom" in by_rank and all(o["reached"] == 4 for o in by_rank["oom"])),
                   "oom_effective_batch_kept": ("oom" in by_rank and all(o["effective_batch"] == 64
                                                                         for o in by_rank["oom"])),
                   "scenarios_skipped": sorted(skip),
                   "stop_same_step": by_rank["stop"][0]["stopped_at_step"] == by_rank["stop"][1]["stopped_at_step"]}
        write_result("ddp", payload)
        print(table(["rank", "steady tok/s (global)", "per device", "collectives/step",
                     "ms in them/step (incl. waiting)"],
                    [[t["rank"], t["steady_tokens_per_sec"], (t["steady_tokens_per_sec"] or 0) / t["world"],
                      t["collectives_per_step"], t["collective_ms_per_step"]] for t in (t0, t1)]))
        g = by_rank["guard"][0]
        print(f"flag exchange {by_rank['exchange_us'][0]:.0f} µs; guard A/B over {g['steps_per_arm']} steps per arm: "
              f"step {g['plain_step_sec']:.3f} → {g['guarded_step_sec']:.3f} s ({g['step_ratio']:.3f}×), "
              f"non-generation {g['plain_non_generation_sec']:.3f} → {g['guarded_non_generation_sec']:.3f} s "
              f"({g['non_generation_ratio']:.3f}×), {g['collectives_per_step_guarded']:.0f} collectives/step")
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
