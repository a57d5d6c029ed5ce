"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU, ``DS_ACCELERATOR=cpu``): the callbacks and
``train_with_tuning`` under DeepSpeed ZeRO (stage given on the command line), through transformers' own DeepSpeed
integration (``TrainingArguments(deepspeed=...)``, accelerate's ``DeepSpeedPlugin``, ``deepspeed.initialize``).

DeepSpeed keeps each rank's part of the reduced gradient inside its engine, so a re-size under it cannot be checked
on the step's rows (docs/exactness.md): the tuners here accept an unmeasured split (``accept_unmeasured=True``),
as a DeepSpeed user does to re-size at all. Each rank writes what it measured to ``<out>/rank<R>.json``. A rank
still running after ``HANG_DUMP_SEC`` (default 300) prints every thread's stack and exits: a hang fails with where
it hung.
"""
import faulthandler
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist


def zero_config(stage: int) -> dict:
    """TRL's ``deepspeed_zero{2,3}.yaml`` as a config dict: the split and clipping left to the Trainer (``auto``)."""
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    return config


def ds_args(stage: int, **extra) -> dict:
    """The Trainer's DeepSpeed settings; on a GPU machine (``benchmarks/deepspeed.sh``) the GPUs, else CPU. Under
    ``accelerate launch`` with a DeepSpeed config (``FROM_LAUNCHER=1``) the launcher's plugin instead."""
    launcher = {} if os.environ.get("FROM_LAUNCHER") else {"deepspeed": zero_config(stage)}
    return dict(use_cpu=not torch.cuda.is_available(), **launcher, **extra)


class TokenCount:
    """Independent of the meter: non-padding tokens of every training micro-batch, read off the inputs."""

    def __init__(self, trainer):
        self.tokens = 0
        original = trainer.training_step

        def counted(model, inputs, num_items_in_batch=None):
            self.tokens += int(inputs["attention_mask"].sum())
            return original(model, inputs, num_items_in_batch)

        trainer.training_step = counted


def keys_logged(trainer):
    return sorted({k.split("/")[0] for entry in trainer.state.log_history for k in entry if "/" in k})


def full_weights(trainer) -> dict:
    """Every weight, whole (ZeRO-3 partitions gathered on every rank), as CPU copies."""
    import deepspeed

    params = dict(trainer.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}


def no_compiled_op():
    """On a CPU, DeepSpeed builds one C++ op the first time its communication starts: its shared-memory all-reduce
    (``deepspeed_shm_comm``, 3.5 min on 2 cores, then cached), which only ``inference_all_reduce`` calls, never
    training. ``build_shm_op`` returning None is DeepSpeed's own path where the op is not available (any platform but
    Linux): every collective then goes through the process group (gloo), as it does anyway in training."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        import importlib

        # the module itself: the name ``deepspeed.comm.torch`` is torch after ``deepspeed.comm``'s star import
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def main(out, stage, parts=("meter", "tuned")):
    """``parts``: ``meter`` (1-2: the figures, a stop on one rank), ``tuned`` (3-4: the re-size in process)."""
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS

    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    result = {"rank": rank, "stage": stage}
    if "meter" in parts:
        result.update(meter_and_stop(tokenizer, out, stage, rank))
    if "tuned" in parts:
        result.update(tuned_in_process(tokenizer, out, stage, rank))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def meter_and_stop(tokenizer, out, stage, rank):
    from hf_perf_callbacks import MemoryWatchdog, default_callbacks, keys
    from hf_perf_callbacks.core.flops import shape_of
    from hf_perf_callbacks.tiny import build_model
    from tests.conftest import make_trainer

    result = {}
    # 1. the four callbacks on a plain Trainer
    callbacks = default_callbacks()
    meter = callbacks[0]
    plain = make_trainer(tokenizer, os.path.join(out, "plain"), callbacks, max_steps=4, bs=2, ga=2,
                         extra=ds_args(stage))
    count = TokenCount(plain)
    plain.train()
    counted = torch.tensor([count.tokens], dtype=torch.long, device=plain.args.device)
    dist.all_reduce(counted)
    engine = plain.model_wrapped
    result.update(
        deepspeed=plain.is_deepspeed_enabled, engine=type(engine).__name__, zero_stage=engine.zero_optimization_stage(),
        disabled=[type(c).__name__ for c in callbacks if c.disabled], keys=keys_logged(plain),
        tokens=meter.timeline.total_tokens, independent_tokens=int(counted.item()),
        rates=[entry.get(keys.PERF_TOKENS_PER_SEC) for entry in plain.state.log_history if "loss" in entry],
        device=str(meter.run.device.device), world=meter.run.world, meter_matmul=meter.run.shape.matmul_params,
        reference_matmul=shape_of(build_model(tokenizer)).matmul_params)

    # 2. the watchdog: a tiny budget on rank 1 only stops both ranks at one step, with one DeepSpeed checkpoint
    watchdog = MemoryWatchdog(limit_gb=0.001 if rank == 1 else None, grace_steps=1)
    stopped = make_trainer(tokenizer, os.path.join(out, "stop"), [watchdog], max_steps=6, bs=2, ga=1,
                           extra=ds_args(stage))
    stopped.train()
    result.update(stop_step=stopped.state.global_step, stop_actions=[a["action"] for a in watchdog.actions])
    dist.barrier()
    checkpoint = os.path.join(out, "stop", f"checkpoint-{stopped.state.global_step}")
    result["checkpoint_files"] = sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else []
    return result


def tuned_in_process(tokenizer, out, stage, rank):
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter, keys
    from tests.conftest import make_trainer

    result = {}
    # 3. train_with_tuning: memory that grows with the micro-batch on rank 1 only (a fake device reading) makes the
    #    watchdog ask for a smaller micro-batch at step 2; both ranks save DeepSpeed's checkpoint, build a new engine
    #    for the new split and go on in the same process to max_steps
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding
    from tests.deepspeed_sizes import deepspeed_sizes
    from tests.test_tuner import MemoryByBatch

    watchdog = MemoryWatchdog(limit_gb=7.0 if rank == 1 else None, grace_steps=1)
    tuner = AdaptiveBatchTuner(accept_unmeasured=True)             # tune on: under DeepSpeed it is skipped
    tuned = make_trainer(tokenizer, os.path.join(out, "tuned"), [ThroughputMeter(), watchdog, tuner], max_steps=5,
                         bs=4, ga=2, extra=ds_args(stage))
    if rank == 1:
        watchdog.device = MemoryByBatch(tuned.args)
    first_engine = []
    tuned.add_callback(type("FirstEngine", (__import__("transformers").TrainerCallback,), {
        "on_train_begin": lambda self, *a, **k: first_engine.append(id(tuned.model_wrapped))})())
    train_with_tuning(tuned)
    args = tuned.args
    lines = [json.loads(x) for x in open(os.path.join(out, "tuned", "perf_log.jsonl"))] if rank == 0 else []
    result.update(tuned_sharding=sharding.sharding(tuned), tuned_step=tuned.state.global_step,
                  tuned_split=[args.per_device_train_batch_size, args.gradient_accumulation_steps],
                  tuned_sizes=deepspeed_sizes(tuned), engines=len(set(first_engine)),
                  tuned_decisions=[(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions],
                  tuned_actions=[a["action"] for a in watchdog.actions],
                  tuned_checkpoint=sorted(os.listdir(os.path.join(out, "tuned", "checkpoint-2"))),
                  tuned_steps_logged=[x["step"] for x in lines if x["type"] == "step"],
                  tuned_micro_batches=[x.get(keys.TUNER_MICRO_BATCH) for x in lines if x["type"] == "step"],
                  tuned_notes_logged=[x["message"][:45] for x in lines if x["type"] == "event"
                                      and x.get("source") == "tuner" and x.get("kind") == "warning"])

    # 4. the same re-size is exact: the run trains what an unfaulted run trains (samples of every step over both
    #    ranks, learning rates, weights; SGD with momentum, no gradient clipping)
    _, expected = exact_run(tokenizer, out, stage, "unfaulted")
    watchdog = MemoryWatchdog(limit_gb=7.0 if rank == 1 else None, grace_steps=1)
    trainer, got = exact_run(tokenizer, out, stage, "resized", watchdog)
    result["exact"] = {"differences": compare(expected, got), "step": trainer.state.global_step,
                       "split": [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps],
                       "actions": [a["action"] for a in watchdog.actions]}
    return result


EXACT = dict(optim="sgd", optim_args="momentum=0.9", learning_rate=0.02, max_grad_norm=0.0, lr_scheduler_type="linear")


def exact_run(tokenizer, out, stage, name, *callbacks, steps=6, plant=None, resume=None, save_steps=None):
    """One run of ``train_with_tuning`` at 4×1 for the exactness comparisons; returns the trainer and what it
    trained (every rank's samples per step, the learning rates, the whole weights)."""
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from tests.conftest import make_trainer
    from tests.faults import SampleRecorder
    from tests.test_tuner import MemoryByBatch

    recorder = SampleRecorder()
    saves = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    planted = [plant] if plant is not None else []
    trainer = make_trainer(tokenizer, os.path.join(out, name),
                           [recorder, AdaptiveBatchTuner(tune=False, accept_unmeasured=True), *callbacks, *planted],
                           max_steps=steps, bs=4,
                           ga=1, extra=ds_args(stage, **EXACT, **saves), length=12)
    recorder.attach(trainer)
    for callback in callbacks:
        if getattr(callback, "limit_gb", None) == 7.0:
            callback.device = MemoryByBatch(trainer.args)
    if plant is not None:
        plant.attach(trainer)
    train_with_tuning(trainer, resume_from_checkpoint=resume)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, recorder.by_step)
    samples = {step: sorted(row for each in ranks for row in each.get(step, [])) for step in set().union(*ranks)}
    rates = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    return trainer, {"samples": samples, "rates": rates, "weights": full_weights(trainer)}


def compare(expected: dict, got: dict, steps=None) -> list[str]:
    """What ``got`` trained differently from ``expected`` (only ``steps`` when given); empty: the same."""
    found = []

    def keep(by_step: dict) -> dict:
        return {s: v for s, v in by_step.items() if steps is None or s in steps}

    if keep(got["samples"]) != keep(expected["samples"]):
        wanted = keep(expected["samples"])
        found.append(f"other samples at steps {sorted(s for s in wanted if got['samples'].get(s) != wanted[s])}")
    if keep(got["rates"]) != keep(expected["rates"]):
        found.append(f"learning rates {got['rates']} instead of {expected['rates']}")
    a, b = expected["weights"], got["weights"]
    if set(a) != set(b) or not all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-4, atol=1e-6) for k in a):
        worst = max((b[k].double() - a[k].double()).abs().max().item() for k in a) if set(a) == set(b) else None
        found.append(f"weights differ (largest |difference| {worst})")
    return found


def restart(out, stage, relaunch: bool, oom_rank: int = 0):
    """An out-of-memory error on rank ``oom_rank`` at step 5 under several ranks: DeepSpeed's collectives are not
    guarded, so that rank records the next smaller split and ends its process (the first launch fails).
    ``relaunch``: the launch a launcher's restart (or a person) makes next resumes from the newest checkpoint of this
    run (``save_steps=2``: checkpoint-4) with the recorded split, to max_steps; it is compared with an unfaulted run
    made by the first launch."""
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS
    from tests.test_tuner import CUDA_OOM, PlantedOOM

    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    unfaulted = os.path.join(out, f"unfaulted_rank{rank}.pt")
    if not relaunch:
        _, expected = exact_run(tokenizer, out, stage, "unfaulted", steps=8, save_steps=2)
        torch.save(expected, unfaulted)
        plant = PlantedOOM(limit=2 if rank == oom_rank else 99, text=CUDA_OOM, armed_at=4)
        exact_run(tokenizer, out, stage, "run", steps=8, save_steps=2, plant=plant)
        return
    trainer, got = exact_run(tokenizer, out, stage, "run", steps=8, save_steps=2, resume=True)
    from hf_perf_callbacks.core.splitfile import read_split_file
    from tests.deepspeed_sizes import deepspeed_sizes

    record = read_split_file(os.path.join(out, "run"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": trainer.state.global_step, "sizes": deepspeed_sizes(trainer),
                   "split": [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps],
                   "decisions": [(d.kind, d.step, d.new.micro_batch, d.checkpoint) for d in record.decisions],
                   "differences": compare(torch.load(unfaulted, weights_only=False), got, steps=set(range(5, 9)))}, f)


def one_process(out, stage):
    """One process: an out-of-memory error planted in the forward of step 3 is recovered in this process with a
    new engine (4×1 → 2×2), and the run trains what the unfaulted run trains."""
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS
    from tests.test_tuner import CUDA_OOM, PlantedOOM

    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    _, expected = exact_run(tokenizer, out, stage, "unfaulted")
    plant = PlantedOOM(limit=2, text=CUDA_OOM, armed_at=2, once=True)
    trainer, got = exact_run(tokenizer, out, stage, "recovered", plant=plant)
    from hf_perf_callbacks.core.splitfile import read_split_file
    from tests.deepspeed_sizes import deepspeed_sizes

    record = read_split_file(os.path.join(out, "recovered"))
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump({"step": trainer.state.global_step, "raised": plant.raised,
                   "sizes": deepspeed_sizes(trainer),
                   "decisions": [(d.kind, d.step, d.new.micro_batch) for d in record.decisions],
                   "differences": compare(expected, got)}, f)


def grpo(out, stage):
    """GRPO (LoRA, SGD with momentum) under ZeRO: the meter's GRPO figures on every rank, and the watchdog's request
    on rank 1 at step 2 (memory that grows with the micro-batch) re-sizing both ranks in this process, 4×2 → 2×4, with
    the prompt groups and the generation batch kept: the same samples, learning rates and weights as a run that never
    re-sized."""
    from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys, train_with_tuning
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS, make_grpo, varied_reward
    from tests.deepspeed_sizes import deepspeed_sizes
    from tests.faults import SampleRecorder
    from tests.test_tuner import MemoryByBatch

    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    result = {"rank": rank, "stage": stage}
    runs = {}
    for name in ("unfaulted", "resized"):
        meter, recorder, tuner = (ThroughputMeter(), SampleRecorder(),
                                  AdaptiveBatchTuner(tune=False, accept_unmeasured=True))
        callbacks = [recorder, meter, tuner]
        watchdog = MemoryWatchdog(limit_gb=7.0 if rank == 1 else None, grace_steps=1) if name == "resized" else None
        trainer = make_grpo(tokenizer, os.path.join(out, f"grpo_{name}"), callbacks + ([watchdog] if watchdog else []),
                            max_steps=4, bs=4, ga=2, reward=varied_reward, extra=ds_args(stage, **EXACT))
        if watchdog is not None and rank == 1:
            watchdog.device = MemoryByBatch(trainer.args)
        recorder.attach(trainer)
        train_with_tuning(trainer)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, recorder.by_step)
        samples = {step: sorted(row for each in ranks for row in each.get(step, [])) for step in set().union(*ranks)}
        rates = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
        runs[name] = {"samples": samples, "rates": rates, "weights": full_weights(trainer)}
        figures = [{k: entry.get(k) for k in (keys.PERF_ROLLOUT_TOKENS_PER_SEC, keys.PERF_GENERATION_BATCH,
                                              keys.PERF_COMPLETION_TOKENS, keys.PERF_TOKENS_PER_SEC)}
                   for entry in trainer.state.log_history if "loss" in entry]
        result[name] = {"step": trainer.state.global_step, "figures": figures,
                        "split": [trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps,
                                  trainer.args.steps_per_generation, trainer.args.num_generations],
                        "sizes": deepspeed_sizes(trainer), "zero_stage":
                            trainer.model_wrapped.zero_optimization_stage(),
                        "decisions": [(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions],
                        "actions": [a["action"] for a in watchdog.actions] if watchdog else []}
    result["differences"] = compare(runs["unfaulted"], runs["resized"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def shut_down():
    import time

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(int(os.environ.get("HANG_DUMP_SEC", "300")), exit=True)
    no_compiled_op()
    mode = sys.argv[3] if len(sys.argv) > 3 else "main"
    if mode == "main":
        main(sys.argv[1], int(sys.argv[2]))
    elif mode in ("meter", "tuned"):
        main(sys.argv[1], int(sys.argv[2]), parts=(mode,))
    elif mode in ("restart", "restart_rank1"):      # an OOM on rank 0, or on rank 1
        restart(sys.argv[1], int(sys.argv[2]), relaunch="relaunch" in sys.argv[4:],
                oom_rank=int(mode == "restart_rank1"))
    elif mode == "one":
        one_process(sys.argv[1], int(sys.argv[2]))
    elif mode == "grpo":
        grpo(sys.argv[1], int(sys.argv[2]))
    shut_down()
