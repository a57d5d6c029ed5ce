"""Two GPUs, FSDP2: ``accelerate launch --config_file hf_perf_callbacks/recipes/accelerate/fsdp.yaml benchmarks/bench_fsdp.py``.

A plain ``Trainer`` full fine-tune of a Qwen2.5-0.5B-shaped model (random weights, built on the CPU as a user's
model is before ``accelerator.prepare``), bf16, sharded by FSDP2 (the accelerate config's transformer-based wrap):

1. ``callbacks=default_callbacks()``: every rank's ``log_history`` gets ``perf/``, ``mem/`` and ``tuner/`` keys, no
   callback disables itself, global tokens/s is equal on both ranks and matches an independent count (non-padding
   tokens of every micro-batch's inputs, summed over ranks, over a synchronized wall clock of the same steps); the
   perf log is written once;
2. ``train_with_tuning``: rank 1's watchdog reads a planted figure of 2 GiB per sample against a 7 GiB budget, so
   it asks for a smaller micro-batch; both ranks re-size alike through an FSDP sharded checkpoint, reach
   ``max_steps`` and keep the effective batch. (An OOM inside a step is refused under FSDP: ``fsdp_run.sh`` plants
   one on rank 1 in a separate launch and checks that the run ends at once with the message.)
3. a watchdog stop on rank 1 only stops both ranks at one step with one checkpoint, which a fresh trainer resumes.

``--smoke``: the same on two CPU processes (``torchrun --nproc_per_node 2``, gloo) with a tiny model, FSDP2 switched
on for CPU processes as in ``tests/scripts/two_rank_fsdp.py``. ``oom`` (first argument): the refusal scenario.
"""
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "scripts"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import GB, table, tokenizer, write_result  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

SMOKE = "--smoke" in sys.argv
RANK = int(os.environ.get("RANK", 0))
STEPS = 6 if SMOKE else 12
SHARED = f"/tmp/hf_perf_fsdp/{os.getppid()}"   # one fresh directory per launch, shared by both ranks (same parent)
FSDP_ARGS = {}                                 # on GPUs the accelerate config turns FSDP on
if SMOKE:
    from two_rank_fsdp import FSDP_ARGS as CPU_FSDP_ARGS
    from two_rank_fsdp import fsdp_on_cpu

    fsdp_on_cpu()
    FSDP_ARGS = CPU_FSDP_ARGS                  # the tiny Llama's decoder layers, sharded checkpoints
NAME = "fsdp_smoke" if SMOKE else "fsdp"       # a smoke run never overwrites the GPU figures


def build_model():
    """Qwen2.5-0.5B's shape (random weights) on the CPU; ``--smoke``: the tests' tiny Llama."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_perf_callbacks.tiny import build_model as tiny

    tok = tokenizer()
    if SMOKE:
        return tiny(tok)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config)


class Texts(torch.utils.data.Dataset):
    """Wordle prompts and guesses as causal-LM examples of varying length (so padding exists)."""

    def __init__(self, n=512):
        from hf_perf_callbacks.tasks import wordle

        tok = tokenizer()
        prompts = list(wordle.make_dataset(n, seed=0)["prompt"])
        self.items = [tok(p[: 80 + (i * 37) % 400])["input_ids"] for i, p in enumerate(prompts)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def make(output_dir, callbacks, micro, accum, steps, **extra):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                    max_steps=steps, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none",
                    bf16=not SMOKE, use_cpu=SMOKE, disable_tqdm=True, seed=0, ddp_timeout=180, **FSDP_ARGS)
    settings.update(extra)
    return Trainer(model=build_model(), args=TrainingArguments(**settings), train_dataset=Texts(),
                   data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False), callbacks=callbacks)


def synchronize():
    if torch.cuda.is_available() and not SMOKE:
        torch.cuda.synchronize()


class Independent(TrainerCallback):
    """Not the package's: a synchronized wall clock at every optimizer-step end and the non-padding tokens of every
    micro-batch's inputs (from a wrapped ``training_step``)."""

    def __init__(self, trainer):
        self.walls, self.tokens, self._tokens = [], [], 0
        original = trainer.training_step

        def counted(model, inputs, *args, **kwargs):
            self._tokens += int(inputs["attention_mask"].sum())
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = counted

    def on_train_begin(self, args, state, control, **kwargs):
        synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        now = time.perf_counter()
        self.walls.append(now - self.start)
        self.start = now
        self.tokens.append(self._tokens)
        self._tokens = 0


def gathered(values):
    """Every rank's list of numbers (same length), as [rank][i]."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def throughput() -> dict:
    from hf_perf_callbacks import default_callbacks

    out = os.path.join(SHARED, "throughput")
    callbacks = default_callbacks(ThroughputMeter={"warmup_window": 3})   # steady figures within 12 steps
    meter = callbacks[0]
    trainer = make(out, callbacks, 8 if not SMOKE else 2, 2, STEPS)
    clock = Independent(trainer)
    trainer.add_callback(clock)
    trainer.train()
    s = meter.summary
    rows = gathered([clock.walls, clock.tokens])
    warmup = s["warmup_steps"] if s["warmup_done"] else 0
    steady = range(warmup, STEPS)
    # the global rate over the meter's steady steps: tokens of both ranks over the slower rank's wall time
    tokens = sum(rows[r][1][i] for r in range(len(rows)) for i in steady)
    seconds = sum(max(rows[r][0][i] for r in range(len(rows))) for i in steady)
    independent = tokens / seconds if seconds else None
    logged = [k for entry in trainer.state.log_history for k in entry if "/" in k]
    result = {"rank": RANK, "steady_tokens_per_sec": s["steady_tokens_per_sec"], "warmup_steps": s["warmup_steps"],
              "mean_tokens_per_sec": s["mean_tokens_per_sec"], "independent_tokens_per_sec": independent,
              "meter_tokens": s["tokens"], "independent_tokens": sum(sum(r[1]) for r in rows),
              "mfu": s.get("mfu"), "world": s["world_size"], "device": s["device"],
              "training_device": str(meter.device.device), "sharded": trainer.is_fsdp_enabled,
              "disabled": [type(c).__name__ for c in callbacks if c.disabled],
              "prefixes_logged": sorted({k.split("/")[0] for k in logged}),
              "peak_gb": callbacks[1].high_water / GB}
    if RANK == 0:
        lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
        result["perf_log_steps"] = [x["step"] for x in lines if x["type"] == "step"]
    return result


def resize_on_rank1() -> dict:
    from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, train_with_tuning
    from hf_perf_callbacks.device import DeviceLayer, MemorySample, training_device

    class PlantedMemory(DeviceLayer):
        """The real device, except that ``used`` reads 2 GiB per sample of the current micro-batch."""

        def __init__(self, args):
            super().__init__(training_device())
            self.args = args

        def memory(self):
            real = super().memory()
            used = int(2 * GB * self.args.per_device_train_batch_size)
            return MemorySample(allocated=used, reserved=used, peak=used, device_limit=real.device_limit,
                                system_total=real.system_total, system_available=real.system_available)

    out = os.path.join(SHARED, "resize")
    watchdog = MemoryWatchdog(limit_gb=7.0 if RANK == 1 else None, grace_steps=1)
    tuner = AdaptiveBatchTuner()                  # tune on: under FSDP it is skipped, with the reason logged
    trainer = make(out, [ThroughputMeter(), watchdog, tuner], 4, 2, 6)
    if RANK == 1:
        watchdog.device = PlantedMemory(trainer.args)
    start = time.perf_counter()
    train_with_tuning(trainer)                    # saves, records the split and stops at the re-size (FSDP)
    stopped = trainer.state.global_step
    trainer = make(out, [ThroughputMeter(), MemoryWatchdog(), AdaptiveBatchTuner()], 4, 2, 6)     # the relaunch
    train_with_tuning(trainer, resume_from_checkpoint=True)
    args = trainer.args
    world = dist.get_world_size()
    result = {"rank": RANK, "stopped": stopped, "reached": trainer.state.global_step,
              "seconds": time.perf_counter() - start,
              "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
              "effective_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
              "decisions": [{k: d.to_json()[k] for k in ("kind", "step", "old", "new", "recovery_sec")}
                            for d in tuner.session.decisions],
              "actions": [a["action"] for a in watchdog.actions],
              "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))}
    if RANK == 0:
        checkpoint = os.path.join(out, "checkpoint-2")
        result["checkpoint_files"] = sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else []
        lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
        result["limits_logged"] = [x["message"] for x in lines if x["type"] == "event" and x["source"] == "tuner"
                                   and x["kind"] == "warning"]
    return result


def stop_on_rank1() -> dict:
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter

    out = os.path.join(SHARED, "stop")
    watchdog = MemoryWatchdog(limit_gb=0.01 if RANK == 1 else None, grace_steps=2)
    trainer = make(out, [watchdog], 4, 1, 8)
    trainer.train()
    stopped = trainer.state.global_step
    dist.barrier()
    checkpoints = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    resumed = make(out, [ThroughputMeter(), MemoryWatchdog()], 4, 1, stopped + 2)
    if checkpoints:
        resumed.train(resume_from_checkpoint=os.path.join(out, checkpoints[-1]))
    return {"rank": RANK, "stopped_at_step": stopped, "watchdog_stopped_at": watchdog.stopped_at,
            "actions": [a["action"] for a in watchdog.actions], "checkpoints": checkpoints,
            "resumed_to": resumed.state.global_step, "target": stopped + 2}


def oom_on_rank1() -> None:
    """An OOM inside rank 1's step: refused under FSDP, raised at once; rank 1 records it, the launcher ends rank 0."""
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning

    class PlantedOOM(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            self.step = state.global_step

    plant = PlantedOOM()
    trainer = make(os.path.join(SHARED, "oom"), [plant, AdaptiveBatchTuner(tune=False)], 4, 1, 4)
    plant.step = 0

    def raise_on_rank1(module, args, kwargs):
        if RANK == 1 and plant.step >= 1 and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted on rank 1)")

    trainer.model.register_forward_pre_hook(raise_on_rank1, with_kwargs=True)
    start = time.perf_counter()
    try:
        train_with_tuning(trainer)
    except torch.OutOfMemoryError:
        write_result(NAME + "_oom", {"rank": RANK, "reraised": True, "step": trainer.state.global_step,
                                  "seconds_to_raise": time.perf_counter() - start})
        raise


def same_decisions(a: dict, b: dict) -> bool:
    """The ranks decided alike: kind, step and splits (each rank's own recovery time differs)."""
    keep = ("kind", "step", "old", "new")
    return [{k: d[k] for k in keep} for d in a["decisions"]] == [{k: d[k] for k in keep} for d in b["decisions"]]


def main():
    if "oom" in sys.argv[1:]:
        oom_on_rank1()
        return
    results = {}
    for name, scenario in (("throughput", throughput), ("resize", resize_on_rank1), ("stop", stop_on_rank1)):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results[name] = scenario()
    everything = gathered(results)
    if RANK != 0:
        return
    by_rank = {k: [g[k] for g in everything] for k in results}
    t0, t1 = by_rank["throughput"]
    r0, r1 = by_rank["resize"]
    s0, s1 = by_rank["stop"]
    error = ((t0["steady_tokens_per_sec"] / t0["independent_tokens_per_sec"] - 1)
             if t0["steady_tokens_per_sec"] and t0["independent_tokens_per_sec"] else None)
    payload = {
        "mode": "smoke (CPU, gloo)" if SMOKE else "2 GPUs, NCCL", "ranks": by_rank,
        "callbacks_report_on_every_rank": all(t["prefixes_logged"] == ["mem", "perf", "tuner"] and not t["disabled"]
                                              for t in (t0, t1)),
        "global_tokens_per_sec_equal_on_ranks": t0["steady_tokens_per_sec"] == t1["steady_tokens_per_sec"],
        "meter_vs_independent_tokens_per_sec": error,
        "tokens_match_independent_count": t0["meter_tokens"] == t0["independent_tokens"] == t1["meter_tokens"],
        "logged_once": t0["perf_log_steps"] == list(range(1, STEPS + 1)),
        "resize_same_split": r0["split"] == r1["split"], "resize_same_decisions": same_decisions(r0, r1),
        "resize_stopped_together": r0["stopped"] == r1["stopped"],
        "resize_relaunch_reached_max_steps": r0["reached"] == r1["reached"] == 6,
        "resize_effective_batch_kept": r0["effective_batch"] == r1["effective_batch"] == 4 * 2 * 2,
        "stop_same_step": s0["stopped_at_step"] == s1["stopped_at_step"],
        "stop_one_checkpoint": len(s0["checkpoints"]) == 1, "stop_resumed": s0["resumed_to"] == s0["target"]}
    write_result(NAME, payload)
    print(table(["rank", "steady tok/s (global)", "independent", "MFU", "peak GB", "keys", "disabled"],
                [[t["rank"], t["steady_tokens_per_sec"], t["independent_tokens_per_sec"], t["mfu"], t["peak_gb"],
                  ",".join(t["prefixes_logged"]), ",".join(t["disabled"]) or "-"] for t in (t0, t1)]))
    print(f"meter vs independent: {error:+.2%}" if error is not None else "meter vs independent: n/a (no steady)")
    print(table(["rank", "re-size: split after", "effective", "reached", "decisions"],
                [[r["rank"], "×".join(map(str, r["split"])), r["effective_batch"], r["reached"],
                  "; ".join(f"{d['kind']}@{d['step']}: {d['old']['micro_batch']}→{d['new']['micro_batch']}"
                            for d in r["decisions"])] for r in (r0, r1)]))
    print(table(["rank", "stopped at", "actions", "checkpoints", "resumed to"],
                [[s["rank"], s["stopped_at_step"], ",".join(s["actions"]), ",".join(s["checkpoints"]),
                  s["resumed_to"]] for s in (s0, s1)]))
    print("checks:", {k: v for k, v in payload.items() if isinstance(v, bool)})


if __name__ == "__main__":
    os.makedirs(SHARED, exist_ok=True)
    main()
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()
