"""What of :func:`~hf_perf_callbacks.train_with_tuning` works when accelerate shards the model (FSDP, DeepSpeed).

=====================================  =========  ============================================================
part                                   FSDP       DeepSpeed ZeRO
=====================================  =========  ============================================================
re-size on the watchdog's request      save,      refused at start (``ValueError``): its config fixes the
(checkpoint → resume, every rank       stop,      micro-batch when the engine is built; use ``trainer.train()``,
alike, effective batch exact)          relaunch   a re-size request then saves, stops and prints the split
tuning on the run's steps, memory       skipped    —
check
OOM inside a step recovered in         refused    —
lockstep
=====================================  =========  ============================================================

Under FSDP every forward and backward runs FSDP's own all-gathers and reduce-scatters. A rank that runs out of
memory inside a step leaves the others waiting in one of them; the cross-rank agreement cannot tell them (it would
have to run inside FSDP's hooks, which would leave half-gathered parameters behind), and a tuning trial or a memory
check that runs out of memory on one rank is the same case. So under FSDP no step guard is installed, neither tuning
nor the memory check runs (a switch would need a new process anyway), and an OOM
is raised at once on its rank, which ends the run through the launcher instead of hanging until the NCCL timeout.
Re-sizing still works through the watchdog, which asks for a smaller micro-batch before the wall at a step
boundary, where every rank is outside FSDP's collectives. The checkpoint of that re-size is FSDP's (sharded, as
configured) and the new split is recorded, but the resume needs a new process: accelerate cannot prepare a model
that FSDP2 has already wrapped a second time (on 2 H200s, with the recipe's activation checkpointing: "Could not
find the transformer layer class Qwen2DecoderLayer in the model"). So under FSDP the run stops there, every rank at
the same step, and says how to relaunch; the relaunch (``train_with_tuning(trainer,
resume_from_checkpoint=True)`` or the recipe launcher with ``--resume_from_checkpoint last``) loads the sharded
checkpoint on every rank and applies the recorded split.
"""
from __future__ import annotations

import logging

from ..device import is_oom_error

logger = logging.getLogger("hf_perf_callbacks")

FSDP_LIMITS = ("train_with_tuning under FSDP: an out-of-memory error inside a training step cannot be recovered "
               "(the other ranks wait inside FSDP's own all-gather/reduce-scatter, which the cross-rank agreement "
               "cannot see), so such an OOM ends the run at once; the tuning and the memory check are skipped for the "
               "same reason. Re-sizing works through MemoryWatchdog's request before the wall: a sharded checkpoint "
               "and the next smaller split recorded on every rank, then the run stops and is relaunched with "
               "resume_from_checkpoint (one process cannot prepare an FSDP2-wrapped model twice). Keep "
               "MemoryWatchdog attached, and start from a split that fits (a smaller per_device_train_batch_size "
               "with a larger gradient_accumulation_steps).")
FSDP_OOM = ("[tuner] out of memory under FSDP: not recoverable in lockstep (the other ranks wait inside FSDP's "
            "collectives). Restart from the last checkpoint with a smaller per_device_train_batch_size and a larger "
            "gradient_accumulation_steps (same effective batch); MemoryWatchdog re-sizes before the wall when it "
            "sees memory growing.")
DEEPSPEED_REFUSED = ("train_with_tuning does not support DeepSpeed: the DeepSpeed config fixes the micro-batch "
                     "(train_micro_batch_size_per_gpu) when the engine is built, so a resume in the same process "
                     "cannot change it. Use trainer.train() with the callbacks instead: a re-size request then saves "
                     "a checkpoint, stops and prints the split to restart with (a new process builds a new engine). "
                     "Or shard with FSDP (`hf-perf recipes path accelerate/fsdp`), under which train_with_tuning "
                     "re-sizes.")


def sharding(trainer) -> str | None:
    """``"fsdp"``, ``"deepspeed"`` or None, from the trainer's accelerator (``Accelerator.distributed_type``)."""
    kind = getattr(getattr(trainer, "accelerator", None), "distributed_type", None)
    name = str(getattr(kind, "value", kind or "")).upper()
    return {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(name)


def start(trainer, session) -> str | None:
    """Refuse what cannot work under the trainer's sharding, say what is limited; returns the sharding."""
    kind = sharding(trainer)
    if kind == "deepspeed":
        raise ValueError(DEEPSPEED_REFUSED)
    if kind == "fsdp":
        session.warn_once("sharding-limits", FSDP_LIMITS)     # console and perf log
    return kind


def raise_oom(kind: str | None, error: BaseException) -> None:
    """Under FSDP an out-of-memory error is not recovered: say so and what to do, then let it end the run."""
    if kind == "fsdp" and is_oom_error(error):
        logger.error(FSDP_OOM)
        raise error


def relaunch_message(output_dir: str, step: int, split) -> str:
    """What to do after a re-size under FSDP stopped the run (see the module docstring)."""
    return (f"[tuner] under FSDP the re-size takes effect in a new process: checkpoint-{step} (sharded) is saved in "
            f"{output_dir} and the split {split} is recorded there. Relaunch the same command with "
            f"train_with_tuning(trainer, resume_from_checkpoint=True), or the recipe launcher with "
            f"--resume_from_checkpoint last: every rank loads the checkpoint and uses the new split (effective batch "
            f"unchanged).")
