"""FSDP2 over several GPUs: ``accelerate launch --config_file recipes/accelerate/fsdp.yaml
[--num_processes N] benchmarks/bench_fsdp.py`` (or ``torchrun ... benchmarks/bench_fsdp.py --fsdp_args``, FSDP from
``TrainingArguments``, as a multi-node launch without an accelerate config does).

A plain ``Trainer`` full fine-tune of a Qwen2.5-0.5B-shaped model (random weights, built on the CPU as a user's
model is before ``accelerator.prepare``), bf16, sharded by FSDP2 (one unit per decoder layer). The planted rank is
the last one (on the second node of a two-node launch):

1. ``throughput`` — ``callbacks=default_callbacks()``: every rank's ``log_history`` gets ``perf/``, ``mem/`` and
   ``tuner/`` keys, no callback disables itself, global tokens/s is equal on every rank and matches an independent
   count (non-padding tokens of every micro-batch's inputs, summed over ranks, over a synchronized wall clock of the
   same steps); the perf log is written once;
2. ``resize`` — ``train_with_tuning``: the planted rank's watchdog reads 2 GiB per sample against a 7 GiB budget, so
   it asks for a smaller micro-batch; every rank saves the sharded checkpoint, takes the same split and goes on in
   the same process to ``max_steps`` with the effective batch kept.
3. ``recover`` — an OOM planted inside a step (the planted rank's forward at step 2, rank 0's backward at step 3)
   under ``train_with_tuning``: every rank re-sizes 4×1 → 2×2 in the same process and trains the unfaulted run's
   samples (over all ranks) to ``max_steps``; the weights' difference from the unfaulted run is set beside the
   difference between two unfaulted runs at 4×1 and 2×2 (bf16: summation order alone differs that much).
4. ``lora`` — the same forward OOM with a LoRA adapter (r16, every linear layer) on the FSDP2-sharded model.
5. ``guard`` — the step guard's cost: the same run with plain ``trainer.train()``, and under ``train_with_tuning``
   with the guard never armed, as by default (off after ``STABLE_STEPS``) and on for the whole run; median step
   time over the steps after the first five.
6. ``stop`` — a watchdog stop on the planted rank only stops every rank at one step with one checkpoint, which a
   fresh trainer resumes.

``restart`` (a separate launch): an OOM on rank 0 after the guard came off ends its process with the next smaller
split recorded; the launcher's restart (``--max_restarts``) or ``restart --relaunch`` (the same command again)
resumes every rank from the newest checkpoint with it, to ``max_steps``.

Arguments: ``--smoke`` (CPU processes, gloo, the tests' tiny model, FSDP2 switched on for CPU processes as in
``tests/scripts/two_rank_fsdp.py``), ``--fsdp_args``, ``--scenarios a,b``, ``--name NAME`` (the results file,
``benchmarks/results/NAME.json``), ``restart``. ``HF_PERF_BENCH_DIR``: the output directory shared by every rank (by
default one per launcher process; a two-node launch has two launchers, so it sets one).
"""
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "scripts"))

import torch
import torch.distributed as dist
from common import GB, table, tokenizer, write_result
from transformers import TrainerCallback

from hf_perf_callbacks.core.runlog import read_run


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


SMOKE = "--smoke" in sys.argv
RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
PLANTED = WORLD - 1                            # the rank whose memory is planted: on the last node
STEPS = 6 if SMOKE else 12
SHARED = os.environ.get("HF_PERF_BENCH_DIR") or f"/tmp/hf_perf_fsdp/{os.getppid()}"   # every rank's output_dir
SCENARIOS = option("--scenarios", "throughput,resize,recover,lora,guard,stop").split(",")
FSDP_ARGS = {}                                 # with accelerate's FSDP config, accelerate turns FSDP on
if SMOKE:
    from two_rank_fsdp import FSDP_ARGS as CPU_FSDP_ARGS
    from two_rank_fsdp import fsdp_on_cpu

    fsdp_on_cpu()
    FSDP_ARGS = CPU_FSDP_ARGS                  # the tiny Llama's decoder layers, sharded checkpoints
elif "--fsdp_args" in sys.argv:                # torchrun: FSDP2 from TrainingArguments, as the accelerate config sets
    FSDP_ARGS = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                                             "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True,
                                             "activation_checkpointing": True})
NAME = option("--name", "fsdp_smoke" if SMOKE else "fsdp")     # a smoke run never overwrites the GPU figures


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
    """Wordle prompts and guesses as causal-LM examples of varying length (so padding exists); ``length``: every
    example cut to that many tokens (no padding: how rows are grouped into micro-batches cannot change the loss)."""

    def __init__(self, n=512, length=None):
        from hf_perf_callbacks.tasks import wordle

        tok = tokenizer()
        prompts = list(wordle.make_dataset(n, seed=0)["prompt"])
        self.items = [tok(p[: 80 + (i * 37) % 400])["input_ids"] for i, p in enumerate(prompts)]
        if length is not None:
            self.items = [(ids * length)[:length] for ids in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def make(output_dir, callbacks, micro, accum, steps, length=None, lora=False, **extra):
    import copy

    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    padded_right = copy.copy(tokenizer())     # training pads right (left padding leaves no other split exact)
    padded_right.padding_side = "right"

    settings = dict(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                    max_steps=steps, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none",
                    bf16=not SMOKE, use_cpu=SMOKE, disable_tqdm=True, seed=0, ddp_timeout=180, **FSDP_ARGS)
    settings.update(extra)
    model = build_model()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    return Trainer(model=model, args=TrainingArguments(**settings), train_dataset=Texts(length=length),
                   data_collator=DataCollatorForLanguageModeling(padded_right, mlm=False), callbacks=callbacks)


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
              "training_device": str(meter.run.device.device), "sharded": trainer.is_fsdp_enabled,
              "disabled": [type(c).__name__ for c in callbacks if c.disabled],
              "prefixes_logged": sorted({k.split("/")[0] for k in logged}),
              "peak_gb": callbacks[1].high_water / GB}
    if RANK == 0:
        lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
        result["perf_log_steps"] = [x["step"] for x in lines if x["type"] == "step"]
    return result


def resize_on_planted_rank() -> dict:
    from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, train_with_tuning
    from hf_perf_callbacks.platform.device import DeviceLayer, MemorySample, training_device

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
    watchdog = MemoryWatchdog(limit_gb=7.0 if RANK == PLANTED else None, grace_steps=1)
    tuner = AdaptiveBatchTuner()                  # tune on: under FSDP it is skipped, with the reason logged
    trainer = make(out, [ThroughputMeter(), watchdog, tuner], 4, 2, 6)
    if RANK == PLANTED:
        watchdog.device = PlantedMemory(trainer.args)
    start = time.perf_counter()
    train_with_tuning(trainer)                    # saves, takes the smaller split and goes on, in this process
    args = trainer.args
    world = dist.get_world_size()
    result = {"rank": RANK, "reached": trainer.state.global_step, "seconds": time.perf_counter() - start,
              "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
              "effective_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
              "decisions": [{k: d.to_json()[k] for k in ("kind", "step", "old", "new", "recovery_sec")}
                            for d in tuner.executor.record.decisions],
              "actions": [a["action"] for a in watchdog.actions],
              "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))}
    if RANK == 0:
        checkpoint = os.path.join(out, "checkpoint-2")
        result["checkpoint_files"] = sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else []
        lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
        result["notes_logged"] = [x["message"] for x in lines if x["type"] == "event" and x["source"] == "tuner"
                                  and x["kind"] == "warning"]
        result["perf_log_steps"] = [x["step"] for x in lines if x["type"] == "step"]
    return result


class PlantedOOM(TrainerCallback):
    """An out-of-memory error on ``rank`` at optimizer step ``at`` (1-based), once: in the decoder's forward, or
    while gradients flow back through the first decoder layer (``backward``)."""

    def __init__(self, rank: int, at: int, backward: bool = False):
        self.rank, self.at, self.backward, self.step, self.raised = rank, at, backward, 0, 0

    def attach(self, trainer):
        from hf_perf_callbacks.throughput import forward_entry

        inner = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        if self.backward:
            inner.model.layers[0].register_full_backward_hook(lambda *_: self.fire())
        else:
            forward_entry(inner).register_forward_pre_hook(lambda *_: self.fire() if torch.is_grad_enabled() else None)

    def fire(self):
        if RANK == self.rank and self.step + 1 == self.at and not self.raised:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (planted on rank {RANK})")

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def weights_of(trainer) -> dict:
    """This rank's shard of every trainable weight, in float32 on the CPU."""
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().float().cpu()
            for n, p in trainer.model.named_parameters() if p.requires_grad}


def largest_difference(a: dict, b: dict) -> float:
    """The largest |a − b| over every weight, the largest over all ranks."""
    local = max((a[k] - b[k]).abs().max().item() for k in a) if a else 0.0
    return max(gathered(local))


def run_recorded(name: str, micro: int, accum: int, plant: PlantedOOM | None = None, lora: bool = False,
                 steps: int = 8) -> dict:
    """One optimizer run under ``train_with_tuning`` (SGD with momentum, no clipping, rows of one length): what each
    step trained (the union over ranks), the weights, the decisions, the split at the end."""
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from tests.faults import SampleRecorder

    class Start(TrainerCallback):
        """The weights as the first train() begins (already sharded)."""

        weights: dict | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            if self.weights is None:
                self.weights = weights_of(trainer)

    recorder, tuner, begin = SampleRecorder(), AdaptiveBatchTuner(tune=False), Start()
    callbacks = [recorder, tuner, begin] + ([plant] if plant else [])
    trainer = make(os.path.join(SHARED, name), callbacks, micro, accum, steps, length=64, lora=lora, optim="sgd",
                   optim_args="momentum=0.9", learning_rate=1e-2 if lora else 1e-3, max_grad_norm=0.0)
    recorder.attach(trainer)
    if plant is not None:
        plant.attach(trainer)
    start = time.perf_counter()
    train_with_tuning(trainer)
    seconds = time.perf_counter() - start
    by_rank = gathered(recorder.by_step)
    samples = {step: sorted(row for rank in by_rank for row in rank.get(step, [])) for step in range(1, steps + 1)}
    args = trainer.args
    return {"samples": samples, "weights": weights_of(trainer), "start_weights": begin.weights, "seconds": seconds,
            "reached": trainer.state.global_step, "split": [args.per_device_train_batch_size,
                                                            args.gradient_accumulation_steps],
            "decisions": [(d.kind, d.step, d.new.micro_batch, d.recovery_sec) for d in tuner.executor.record.decisions],
            "raised": plant.raised if plant else 0}


def recover(lora: bool = False) -> dict:
    """Planted OOMs inside one rank's step, recovered in the same process on every rank (see the module docstring)."""
    name = "lora" if lora else "recover"
    expected = run_recorded(f"{name}_unfaulted", 4, 1, lora=lora)
    cases = {"forward": PlantedOOM(PLANTED, at=2)}      # inside the guard's first STABLE_STEPS steps
    if not lora:
        cases["backward"] = PlantedOOM(0, at=3, backward=True)
    result = {"rank": RANK}
    floor = None
    if not lora:                                  # the same samples at 2×2 from the start: bf16's summation order
        other = run_recorded(f"{name}_unfaulted_2x2", 2, 2)
        floor = largest_difference(expected["weights"], other["weights"])
    change = largest_difference(expected["weights"], expected["start_weights"])
    for case, plant in cases.items():
        got = run_recorded(f"{name}_{case}", 4, 1, plant=plant, lora=lora)
        result[case] = {"same_samples": got["samples"] == expected["samples"], "reached": got["reached"],
                        "split": got["split"], "decisions": got["decisions"], "raised": got["raised"],
                        "seconds": got["seconds"], "unfaulted_seconds": expected["seconds"],
                        "largest_weight_difference": largest_difference(expected["weights"], got["weights"])}
    result.update(unfaulted_4x1_vs_2x2_difference=floor, largest_weight_change=change)
    return result


def guard_cost() -> dict:
    """Median step time (steps 6 on) of the same full fine-tune, the same callback attached: plain ``train()``;
    ``train_with_tuning`` with the guard never armed (its own per-step bookkeeping alone), as it runs by default (off
    after ``STABLE_STEPS``), and on for the whole run. The guard's cost once stable is default / never armed."""
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding

    steps, result = 20, {"rank": RANK, "stable_steps": sharding.STABLE_STEPS}
    default = sharding.STABLE_STEPS
    arms = {"plain": None, "never_armed": 0, "default": default, "always_on": 10**9}
    for arm, stable in arms.items():                          # every arm with the same callback attached
        trainer = make(os.path.join(SHARED, f"guard_{arm}"), [AdaptiveBatchTuner(tune=False)], 8 if not SMOKE else 2,
                       2, steps)
        clock = Independent(trainer)
        trainer.add_callback(clock)
        sharding.STABLE_STEPS = default if stable is None else stable
        try:
            trainer.train() if stable is None else train_with_tuning(trainer)
        finally:
            sharding.STABLE_STEPS = default
        walls = [max(r) for r in zip(*gathered(clock.walls))]                 # the slowest rank's step
        late = sorted(walls[5:])                                             # steps 6 on: warm, guard off by default
        result[arm] = {"median_step_sec": late[len(late) // 2], "steps": len(walls)}
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    median = {arm: result[arm]["median_step_sec"] for arm in arms}
    result["default_over_never_armed"] = median["default"] / median["never_armed"]
    result["always_on_over_never_armed"] = median["always_on"] / median["never_armed"]
    result["never_armed_over_plain"] = median["never_armed"] / median["plain"]
    return result


def stop_on_planted_rank() -> dict:
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter

    out = os.path.join(SHARED, "stop")
    watchdog = MemoryWatchdog(limit_gb=0.01 if RANK == PLANTED else None, grace_steps=2)
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


def restart_after_the_guard(relaunch: bool) -> None:
    """An OOM on rank 0 after the step guard came off: rank 0 records the next smaller split and ends its process.
    The next attempt — the launcher's own restart (``--max_restarts``), or ``relaunch``: the same command started
    again — resumes from the newest checkpoint with that split, to ``max_steps`` (the OOM is planted in the first
    attempt of the first launch only)."""
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding

    attempt, at, steps = sharding.restarted_by_launcher(), sharding.STABLE_STEPS + 3, sharding.STABLE_STEPS + 5
    plant = PlantedOOM(0 if attempt == 0 and not relaunch else -1, at=at)
    tuner = AdaptiveBatchTuner(tune=False)
    out = os.path.join(SHARED, "restart")
    trainer = make(out, [plant, tuner], 4, 1, steps, save_strategy="steps", save_steps=2)
    plant.attach(trainer)
    start = time.perf_counter()
    train_with_tuning(trainer, resume_from_checkpoint=True if relaunch else None)
    args = trainer.args
    lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))] if RANK == 0 else []
    mine = {"rank": RANK, "attempt": attempt, "relaunch": relaunch, "reached": trainer.state.global_step,
            "target": steps, "oom_at": at, "seconds_this_attempt": time.perf_counter() - start,
            "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
            "decisions": [(d.kind, d.step, d.new.micro_batch, d.checkpoint) for d in tuner.executor.record.decisions],
            "perf_log_steps": [x["step"] for x in lines if x["type"] == "step"],
            # what the report reads: a step the first launch logged after its checkpoint (rank 0 may finish the
            # step before the other rank's OOM ends the launch) is re-run by the relaunch, whose line replaces it
            "read_steps": [s.step for s in read_run(out).unique_steps()] if RANK == 0 else [],
            "guard_off_at": [x["step"] for x in lines if x["type"] == "event" and "guard is off" in x["message"]]}
    everyone = gathered(mine)
    if RANK == 0:
        logged = everyone[0]["perf_log_steps"]       # twice only for steps after the checkpoint the relaunch resumed
        resumed = max((int(d[3].rsplit("-", 1)[1]) for d in mine["decisions"] if d[3]), default=0)
        write_result(NAME + "_restart", {
            "ranks": everyone, "started_again": all(r["attempt"] >= 1 or r["relaunch"] for r in everyone),
            "reached_max_steps": all(r["reached"] == steps for r in everyone),
            "split_recorded_and_applied": all(r["split"] == [2, 2] for r in everyone),
            "logged_once": everyone[0]["read_steps"] == list(range(1, steps + 1)) and all(
                step > resumed for step in set(logged) if logged.count(step) > 1)})


def same_decisions(a: dict, b: dict) -> bool:
    """The ranks decided alike: kind, step and splits (each rank's own recovery time differs)."""
    keep = ("kind", "step", "old", "new")
    return [{k: d[k] for k in keep} for d in a["decisions"]] == [{k: d[k] for k in keep} for d in b["decisions"]]


def checks(by_rank: dict) -> dict:
    """What must hold on every rank (each check names its scenario)."""
    out = {}
    if "throughput" in by_rank:
        t = by_rank["throughput"]
        out.update({
            "callbacks_report_on_every_rank": all(r["prefixes_logged"] == ["mem", "perf", "tuner"] and not r["disabled"]
                                                  for r in t),
            "global_tokens_per_sec_equal_on_ranks": len({r["steady_tokens_per_sec"] for r in t}) == 1,
            "tokens_match_independent_count": len({r["meter_tokens"] for r in t} | {t[0]["independent_tokens"]}) == 1,
            "logged_once": t[0]["perf_log_steps"] == list(range(1, STEPS + 1))})
    if "resize" in by_rank:
        r = by_rank["resize"]
        out.update({
            "resize_same_split": len({tuple(x["split"]) for x in r}) == 1,
            "resize_same_decisions": all(same_decisions(r[0], x) for x in r) and bool(r[0]["decisions"]),
            "resize_in_process_reached_max_steps": all(x["reached"] == 6 for x in r),
            "resize_effective_batch_kept": all(x["effective_batch"] == 4 * 2 * WORLD for x in r),
            "resize_logged_once": r[0]["perf_log_steps"] == list(range(1, 7))})
    for name in ("recover", "lora"):
        if name in by_rank:
            cases = [c for c in ("forward", "backward") if c in by_rank[name][0]]
            out[f"{name}_in_process_on_every_rank"] = all(
                x[c]["reached"] == 8 and x[c]["split"] == [2, 2] and len(x[c]["decisions"]) == 1
                for x in by_rank[name] for c in cases)
            out[f"{name}_same_samples_as_unfaulted"] = all(x[c]["same_samples"] for x in by_rank[name] for c in cases)
            out[f"{name}_planted_once"] = all(sum(x[c]["raised"] for x in by_rank[name]) == 1 for c in cases)
    if "guard" in by_rank:
        out["guard_cost_at_most_1pct_once_stable"] = by_rank["guard"][0]["default_over_never_armed"] <= 1.01
    if "stop" in by_rank:
        s = by_rank["stop"]
        out.update({"stop_same_step": len({x["stopped_at_step"] for x in s}) == 1,
                    "stop_one_checkpoint": len(s[0]["checkpoints"]) == 1,
                    "stop_resumed": all(x["resumed_to"] == x["target"] for x in s)})
    return out


def main():
    if "restart" in sys.argv[1:]:
        restart_after_the_guard(relaunch="--relaunch" in sys.argv)
        return
    scenarios = {"throughput": throughput, "resize": resize_on_planted_rank, "recover": recover,
                 "lora": lambda: recover(lora=True), "guard": guard_cost, "stop": stop_on_planted_rank}
    results = {}
    for name in SCENARIOS:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results[name] = scenarios[name]()
    everything = gathered(results)
    if RANK != 0:
        return
    by_rank = {k: [g[k] for g in everything] for k in results}
    payload = {"mode": f"smoke (CPU, gloo), {WORLD} ranks" if SMOKE else f"{WORLD} GPUs, NCCL",
               "world_size": WORLD, "planted_rank": PLANTED, "nodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
               "ranks": by_rank, **checks(by_rank)}
    if "throughput" in by_rank:
        t0 = by_rank["throughput"][0]
        payload["meter_vs_independent_tokens_per_sec"] = (
            t0["steady_tokens_per_sec"] / t0["independent_tokens_per_sec"] - 1
            if t0["steady_tokens_per_sec"] and t0["independent_tokens_per_sec"] else None)
        print(table(["rank", "steady tok/s (global)", "independent", "MFU", "peak GB", "keys", "disabled"],
                    [[t["rank"], t["steady_tokens_per_sec"], t["independent_tokens_per_sec"], t["mfu"], t["peak_gb"],
                      ",".join(t["prefixes_logged"]), ",".join(t["disabled"]) or "-"] for t in by_rank["throughput"]]))
    if "resize" in by_rank:
        print(table(["rank", "re-size: split after", "effective", "reached", "decisions"],
                    [[r["rank"], "×".join(map(str, r["split"])), r["effective_batch"], r["reached"],
                      "; ".join(f"{d['kind']}@{d['step']}: {d['old']['micro_batch']}→{d['new']['micro_batch']}"
                                for d in r["decisions"])] for r in by_rank["resize"]]))
    for name in ("recover", "lora"):
        if name in by_rank:
            print(table(["rank", f"{name}: case", "reached", "split", "same samples", "|Δw| vs unfaulted", "raised"],
                        [[x["rank"], c, x[c]["reached"], "×".join(map(str, x[c]["split"])), x[c]["same_samples"],
                          x[c]["largest_weight_difference"], x[c]["raised"]]
                         for x in by_rank[name] for c in ("forward", "backward") if c in x]))
    if "guard" in by_rank:
        g = by_rank["guard"][0]
        print(table(["guard", "median step s"], [[arm, g[arm]["median_step_sec"]]
                                                for arm in ("plain", "never_armed", "default", "always_on")]))
    if "stop" in by_rank:
        print(table(["rank", "stopped at", "actions", "checkpoints", "resumed to"],
                    [[s["rank"], s["stopped_at_step"], ",".join(s["actions"]), ",".join(s["checkpoints"]),
                      s["resumed_to"]] for s in by_rank["stop"]]))
    write_result(NAME, payload)
    print("checks:", {k: v for k, v in payload.items() if isinstance(v, bool)})


if __name__ == "__main__":
    os.makedirs(SHARED, exist_ok=True)
    main()
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()
