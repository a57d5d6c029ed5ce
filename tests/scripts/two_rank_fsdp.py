"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the callbacks on a plain Trainer under FSDP2.

accelerate turns FSDP on only for GPU-type distributed setups (``MULTI_GPU``, ``MULTI_XPU``…); on CPU processes it
stays ``MULTI_CPU`` and would run DDP instead. :func:`fsdp_on_cpu` makes the one change a GPU machine would: the
state's distributed type becomes ``FSDP`` with the Trainer's FSDP plugin. Everything after that is the real code
path: accelerate's ``fsdp2_prepare_model`` (``fully_shard`` per decoder layer over gloo), transformers' FSDP
checkpoint saving (sharded, ``torch.distributed.checkpoint``) and loading.

Each rank writes what it measured to ``<out>/rank<R>.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

FSDP_ARGS = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                         "state_dict_type": "SHARDED_STATE_DICT"})


def fsdp_on_cpu():
    """Let accelerate pick FSDP for CPU processes too (what it does on GPUs), so FSDP2 runs over gloo."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__
    if getattr(original, "fsdp_on_cpu", False):
        return

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP   # as accelerate records it

    init.fsdp_on_cpu = True
    state.AcceleratorState.__init__ = init


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


def main(out):
    fsdp_on_cpu()
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter, default_callbacks, keys
    from hf_perf_callbacks.core.flops import shape_of
    from hf_perf_callbacks.tiny import build_model, build_tokenizer
    from tests.conftest import CORPUS, make_trainer

    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    result = {"rank": rank}

    # 1. the four callbacks on a plain Trainer (the scenario in which nothing reached log_history)
    callbacks = default_callbacks()
    meter = callbacks[0]
    plain = make_trainer(tokenizer, os.path.join(out, "plain"), callbacks, max_steps=4, bs=2, ga=2, extra=FSDP_ARGS)
    count = TokenCount(plain)
    plain.train()
    from torch.distributed.tensor import DTensor

    params = list(plain.model.parameters())
    reference = shape_of(build_model(tokenizer))
    counted = torch.tensor([count.tokens], dtype=torch.long)
    dist.all_reduce(counted)
    result.update(
        fsdp=plain.is_fsdp_enabled, sharded=all(isinstance(p, DTensor) for p in params),
        local_numel=sum(p.to_local().numel() for p in params), global_numel=sum(p.numel() for p in params),
        meter_matmul=meter.run.shape.matmul_params, reference_matmul=reference.matmul_params,
        meter_trainable=meter.run.shape.trainable_matmul_params, disabled=[type(c).__name__ for c in callbacks
                                                                       if c.disabled],
        keys=keys_logged(plain), tokens=meter.timeline.total_tokens, independent_tokens=int(counted.item()),
        rates=[entry.get(keys.PERF_TOKENS_PER_SEC) for entry in plain.state.log_history if "loss" in entry],
        device=str(meter.run.device.device), world=meter.run.world)

    # 2. the watchdog: a tiny budget on rank 1 only stops both ranks at one step, with one sharded checkpoint
    watchdog = MemoryWatchdog(limit_gb=0.001 if rank == 1 else None, grace_steps=1)
    stopped = make_trainer(tokenizer, os.path.join(out, "stop"), [watchdog], max_steps=6, bs=2, ga=1,
                           extra=FSDP_ARGS)
    stopped.train()
    result.update(stop_step=stopped.state.global_step, stop_actions=[a["action"] for a in watchdog.actions])
    dist.barrier()
    checkpoint = os.path.join(out, "stop", f"checkpoint-{stopped.state.global_step}")
    result["checkpoint_files"] = sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else []
    # ... and that checkpoint resumes (a fresh trainer, same settings, no tiny budget) to max_steps
    resumed_meter = ThroughputMeter()
    resumed = make_trainer(tokenizer, os.path.join(out, "stop"), [resumed_meter, MemoryWatchdog()], max_steps=4,
                           bs=2, ga=1, extra=FSDP_ARGS)
    resumed.train(resume_from_checkpoint=checkpoint)
    result.update(resumed_step=resumed.state.global_step, resumed_keys=keys_logged(resumed))

    # 3. train_with_tuning: memory that grows with the micro-batch on rank 1 only (2 GB per sample against a 7 GB
    #    budget: a fake device reading) makes the watchdog ask for a smaller micro-batch at step 2; both ranks save
    #    FSDP's sharded checkpoint, take the split and go on in the same process to max_steps
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding
    from tests.test_tuner import MemoryByBatch

    watchdog = MemoryWatchdog(limit_gb=7.0 if rank == 1 else None, grace_steps=1)
    tuner = AdaptiveBatchTuner()                                   # tune on: under FSDP it is skipped, and says so
    tuned = make_trainer(tokenizer, os.path.join(out, "tuned"), [ThroughputMeter(), watchdog, tuner], max_steps=5,
                         bs=4, ga=2, extra=FSDP_ARGS)
    if rank == 1:
        watchdog.device = MemoryByBatch(tuned.args)
    train_with_tuning(tuned)
    args = tuned.args
    lines = [json.loads(x) for x in open(os.path.join(out, "tuned", "perf_log.jsonl"))] if rank == 0 else []
    result.update(tuned_sharding=sharding.sharding(tuned), tuned_step=tuned.state.global_step,
                  tuned_split=[args.per_device_train_batch_size, args.gradient_accumulation_steps],
                  tuned_decisions=[(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions],
                  tuned_actions=[a["action"] for a in watchdog.actions],
                  tuned_checkpoint=sorted(os.listdir(os.path.join(out, "tuned", "checkpoint-2"))),
                  tuned_steps_logged=[x["step"] for x in lines if x["type"] == "step"],
                  tuned_micro_batches=[x.get(keys.TUNER_MICRO_BATCH) for x in lines if x["type"] == "step"],
                  tuned_notes_logged=[x["message"][:40] for x in lines if x["type"] == "event"
                                      and x.get("source") == "tuner" and x.get("kind") == "warning"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def shut_down():
    import time

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()


def restart(out, relaunch: bool):
    """An OOM on rank 0 after the step guard came off (``STABLE_STEPS`` steps after the start): rank 0 records the
    next smaller split and ends its process (the first launch fails). ``relaunch``: the launch a launcher's restart
    (or a person) makes next — ``train_with_tuning`` resumes from the newest checkpoint this run wrote with the
    recorded split, to max_steps (``resume_from_checkpoint=True``: the restart's own detection,
    ``TORCHELASTIC_RESTART_COUNT``, is tested in one process)."""
    fsdp_on_cpu()
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS, make_trainer
    from tests.test_tuner import CUDA_OOM, PlantedOOM

    rank = int(os.environ["RANK"])
    at = sharding.STABLE_STEPS + 2                     # the guard is off from step STABLE_STEPS on
    plant = PlantedOOM(limit=2 if rank == 0 and not relaunch else 99, text=CUDA_OOM, armed_at=at - 1)
    tuner = AdaptiveBatchTuner(tune=False)
    extra = dict(FSDP_ARGS, save_strategy="steps", save_steps=2)
    trainer = plant.attach(make_trainer(build_tokenizer(CORPUS, vocab_size=300), os.path.join(out, "run"),
                                        [plant, tuner], max_steps=at + 2, bs=4, ga=1, extra=extra, length=12))
    train_with_tuning(trainer, resume_from_checkpoint=True if relaunch else None)
    args = trainer.args
    lines = [json.loads(x) for x in open(os.path.join(out, "run", "perf_log.jsonl"))] if rank == 0 else []
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": trainer.state.global_step, "oom_at": at,
                   "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
                   "decisions": [(d.kind, d.step, d.new.micro_batch, d.checkpoint)
                                 for d in tuner.executor.record.decisions],
                   "steps_logged": [x["step"] for x in lines if x["type"] == "step"],
                   "guard_off": [x["step"] for x in lines if x["type"] == "event" and x.get("kind") == "note"
                                 and "guard is off" in x["message"]]}, f)


def local(tensors: dict) -> dict:
    """Each rank's shard of DTensors (the two runs shard alike), plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in tensors.items()}


def recover(out):
    """An OOM planted inside one rank's training step under FSDP2 — in the forward of step 2 on rank 1, and in the
    backward of step 3 on rank 0 — is recovered in the same process on both ranks: 4×1 → 2×2 (effective batch 8
    on 2 ranks kept), from the checkpoint of the last completed step, and the run trains what an unfaulted run
    trains (samples, RNG stream, learning rates, weights and SGD momentum; no gradient clipping). Then the guard
    comes off after its stable steps."""
    fsdp_on_cpu()
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.resize import sharding
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS, make_trainer
    from tests.faults import Trajectory, differences
    from tests.test_tuner import CUDA_OOM, PlantedOOM

    rank = int(os.environ["RANK"])
    if os.environ.get("WITHOUT_RESET_ITER_STATE"):       # as on torch < 2.13: the adapter's own reset
        from torch.distributed.fsdp import FSDPModule

        del FSDPModule.reset_iter_state
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    exact = dict(FSDP_ARGS, optim="sgd", optim_args="momentum=0.9", learning_rate=0.02, max_grad_norm=0.0,
                 lr_scheduler_type="linear")
    result = {"rank": rank}

    def run(name, plant=None, steps=8):
        trajectory = Trajectory()
        callbacks = [trajectory, AdaptiveBatchTuner(tune=False)] + ([plant] if plant else [])
        trainer = make_trainer(tokenizer, os.path.join(out, name), callbacks, max_steps=steps, bs=4, ga=1,
                               extra=exact, length=12)      # rows of one length: the grouping cannot change the loss
        trajectory.attach(trainer)
        if plant is not None:
            plant.attach(trainer)
        train_with_tuning(trainer)
        trajectory.final, trajectory.optimizer = local(trajectory.final), local(trajectory.optimizer)
        ranks = [None, None]               # a step's samples are the union of the ranks' (each split deals them out
        dist.all_gather_object(ranks, trajectory.by_step)  # to the ranks in another order)
        trajectory.by_step = {step: [row for rank in ranks for row in rank.get(step, [])]
                              for step in set().union(*ranks)}
        return trainer, trajectory, callbacks[1]

    _, expected, _ = run("unfaulted")
    for name, plant in (("forward", PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=1, once=True)),
                        ("backward", PlantedOOM(limit=2 if rank == 0 else 99, text=CUDA_OOM, armed_at=2, once=True,
                                                in_backward=True))):
        trainer, got, tuner = run(name, plant)
        args = trainer.args
        result[name] = {"differences": differences(expected, got), "step": trainer.state.global_step,
                        "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps],
                        "decisions": [(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions],
                        "raised": plant.raised, "session": tuner.executor.record.id}
    result["stable_steps"] = sharding.STABLE_STEPS
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "main"
    if mode == "restart":
        restart(sys.argv[1], relaunch=sys.argv[3:] == ["relaunch"])
        shut_down()
    elif mode == "recover":
        recover(sys.argv[1])
        shut_down()
    else:
        main(sys.argv[1])
        shut_down()
