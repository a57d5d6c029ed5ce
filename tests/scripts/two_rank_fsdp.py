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
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter, default_callbacks
    from hf_perf_callbacks.flops import shape_of
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
        meter_matmul=meter.shape.matmul_params, reference_matmul=reference.matmul_params,
        meter_trainable=meter.shape.trainable_matmul_params, disabled=[type(c).__name__ for c in callbacks
                                                                       if c.disabled],
        keys=keys_logged(plain), tokens=meter.timeline.total_tokens, independent_tokens=int(counted.item()),
        rates=[entry.get("perf/tokens_per_sec") for entry in plain.state.log_history if "loss" in entry],
        device=str(meter.device.device), world=meter.world)

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
    #    FSDP's sharded checkpoint, record the split and stop there (one process cannot prepare a wrapped model
    #    twice); the relaunch (a fresh trainer, resume_from_checkpoint=True) reaches max_steps at the new split
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
    relaunched = make_trainer(tokenizer, os.path.join(out, "tuned"), [ThroughputMeter(), MemoryWatchdog(),
                                                                      AdaptiveBatchTuner()],
                              max_steps=5, bs=4, ga=2, extra=FSDP_ARGS)
    train_with_tuning(relaunched, resume_from_checkpoint=True)
    args = relaunched.args
    lines = [json.loads(x) for x in open(os.path.join(out, "tuned", "perf_log.jsonl"))] if rank == 0 else []
    result.update(tuned_sharding=sharding.sharding(tuned), tuned_step=tuned.state.global_step,
                  relaunched_step=relaunched.state.global_step,
                  tuned_split=[args.per_device_train_batch_size, args.gradient_accumulation_steps],
                  tuned_decisions=[(d.kind, d.step, d.new.micro_batch) for d in tuner.session.decisions],
                  tuned_actions=[a["action"] for a in watchdog.actions],
                  tuned_checkpoint=sorted(os.listdir(os.path.join(out, "tuned", "checkpoint-2"))),
                  tuned_steps_logged=[x["step"] for x in lines if x["type"] == "step"],
                  tuned_limits_logged=[x["message"][:40] for x in lines if x["type"] == "event"
                                       and x.get("source") == "tuner" and x.get("kind") == "warning"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def shut_down():
    import time

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()


def oom_on_rank1(out):
    """An OOM inside rank 1's step under FSDP: rank 1 raises it at once (rank 0 is inside FSDP's all-gather and is
    ended by the launcher), instead of a re-size that would hang."""
    fsdp_on_cpu()
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from hf_perf_callbacks.tiny import build_tokenizer
    from tests.conftest import CORPUS, make_trainer
    from tests.test_tuner import CUDA_OOM, PlantedOOM

    rank = int(os.environ["RANK"])
    plant = PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=1)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = plant.attach(make_trainer(build_tokenizer(CORPUS, vocab_size=300), os.path.join(out, "run"),
                                        [plant, tuner], max_steps=3, bs=4, ga=1, extra=FSDP_ARGS))
    try:
        train_with_tuning(trainer)
    except torch.OutOfMemoryError:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"reraised": True, "step": trainer.state.global_step,
                       "decisions": [d.to_json() for d in tuner.session.decisions]}, f)
        sys.exit(3)


if __name__ == "__main__":
    if sys.argv[2:] == ["oom"]:
        oom_on_rank1(sys.argv[1])
    else:
        main(sys.argv[1])
        shut_down()
