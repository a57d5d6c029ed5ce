"""What of :func:`~hf_perf_callbacks.train_with_tuning` works when accelerate shards the model (FSDP, DeepSpeed).

=====================================  ===============================  ==========================================
part                                   FSDP2                            DeepSpeed ZeRO (stages 1-3)
=====================================  ===============================  ==========================================
an OOM inside a step, on any rank      every rank re-sizes alike in     one process: re-sized in this process;
                                       the same process while the step  several: the launcher's restart resumes
                                       guard is armed; once it is off,  with the next smaller split (no step
                                       the launcher's restart resumes   guard: DeepSpeed's collectives bypass
                                       with the next smaller split      ``torch.distributed``'s functions)
re-size on the watchdog's request      in the same process              in the same process, a new engine
tuning on the run's steps, memory      skipped                          skipped
check
=====================================  ===============================  ==========================================

The step guard (:class:`~hf_perf_callbacks.resize.agreement.StepGuard`) runs one small exchange before every
collective of the training step on the default group, FSDP2's all-gathers and reduce-scatters included, so an OOM
on one rank re-sizes every rank in the same process (FSDP2's iteration state reset, its sharded checkpoint saved
together; :func:`~hf_perf_callbacks.platform.adapter.fsdp2_prepared_again`). Its exchanges cost a host round trip per
collective, so it comes off after :data:`STABLE_STEPS` steps without a change and is put back by every re-size. An
OOM while it is off, outside the step, under DeepSpeed with several ranks (``deepspeed.comm`` binds
``torch.distributed``'s functions when it starts, so no exchange can run before its collectives) or on a device mesh
of more than one dimension (its sub-groups are not seen) leaves the other ranks inside a collective: the failing rank
records the next smaller split and ends its process, and the launcher's restart (``TORCHELASTIC_RESTART_COUNT``)
resumes every rank with it.

**DeepSpeed** fixes the split in its config when the engine is built, and its engine's setters change only its
bookkeeping; so a re-size goes as transformers' ``auto_find_batch_size`` goes: the split is written to every copy of
the DeepSpeed config (:func:`deepspeed_split`), the engine is destroyed (:func:`release_engine`) and the resumed
``train()`` builds a new one and loads DeepSpeed's checkpoint of the last completed step. docs/tuning.md ("Sharded
training") has the whole story and what was measured.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ..core.batching import Exactness, Split
from ..platform.device import is_oom_error, world_size
from .agreement import ResizeNeeded

if TYPE_CHECKING:
    import torch
    from accelerate.utils import DeepSpeedPlugin
    from transformers import Trainer

logger = logging.getLogger("hf_perf_callbacks")

#: optimizer steps without a change after which the FSDP step guard comes off (its exchanges' cost)
STABLE_STEPS = 3

FSDP_NOTES = ("train_with_tuning under FSDP: an out-of-memory error inside a training step is recovered in this "
              "process on every rank while the step guard is armed (after a start and after each re-size, for "
              f"{STABLE_STEPS} steps); once it is off, such an OOM ends the process and the launcher's restart "
              "resumes from the newest checkpoint with the next smaller split: launch with `torchrun "
              "--max-restarts 2` or `accelerate launch --max_restarts 2` and set save_steps. The tuning on the run's "
              "steps and the memory check are skipped under FSDP; MemoryWatchdog re-sizes before the wall.")
NO_GUARD = ("train_with_tuning under FSDP with a device mesh of more than one dimension: FSDP's collectives run on "
            "sub-groups that the step guard cannot see, so every out-of-memory error ends the process and the "
            "launcher's restart (--max_restarts) resumes with the next smaller split.")
DEEPSPEED_NOTES = ("train_with_tuning under DeepSpeed: its engine keeps the reduced gradient, so no re-size can be "
                   "checked on the step's rows: an out-of-memory error ends the run saved unless "
                   "AdaptiveBatchTuner(accept_unmeasured=True). With it, a re-size (the watchdog's, or an OOM in one "
                   "process) saves DeepSpeed's checkpoint, writes the split to the DeepSpeed config and resumes with a "
                   "new engine in this process; under several ranks an out-of-memory error ends the process and the "
                   "launcher's restart resumes from the newest checkpoint with the next smaller split: launch with "
                   "`accelerate launch --max_restarts 2` and set save_steps. The tuning on the run's steps and the "
                   "memory check are skipped under DeepSpeed; MemoryWatchdog re-sizes before the wall.")

#: the DeepSpeed config's keys that hold the split (DeepSpeed checks micro × accumulation × data-parallel ranks
#: = train batch)
DEEPSPEED_SPLIT_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def sharding(trainer: Trainer) -> str | None:
    """``"fsdp"``, ``"deepspeed"`` or None, from the trainer's accelerator (``Accelerator.distributed_type``)."""
    kind = getattr(getattr(trainer, "accelerator", None), "distributed_type", None)
    name = str(getattr(kind, "value", kind or "")).upper()
    return {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(name)


def start(trainer: Trainer, warn_once: Callable[[str, str], object]) -> tuple[str | None, bool]:
    """Say what is limited under the trainer's sharding (``warn_once(key, message)``: console and perf log); returns
    the sharding and whether the step guard sees its collectives (always, unsharded)."""
    kind = sharding(trainer)
    if kind == "deepspeed":
        warn_once("sharding-limits", DEEPSPEED_NOTES)
        return kind, False                   # deepspeed.comm's collectives bypass the guard's exchanges
    mesh = getattr(getattr(trainer, "accelerator", None), "torch_device_mesh", None)
    guarded = kind is None or getattr(mesh, "ndim", 1) <= 1       # FSDP over the default group, not a 2-D mesh
    if kind == "fsdp":
        warn_once("sharding-limits", FSDP_NOTES if guarded else NO_GUARD)
    return kind, guarded


def deepspeed_plugin(trainer: Trainer) -> DeepSpeedPlugin | None:
    """The DeepSpeed plugin of the trainer's accelerator (``AcceleratorState.deepspeed_plugin``), or None."""
    return getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)


def deepspeed_split(trainer: Trainer) -> bool:
    """Write the split in ``trainer.args`` into every place that holds DeepSpeed's: the plugin's config (the dict
    transformers' ``HfTrainerDeepSpeedConfig`` and ``args.hf_deepspeed_config`` share), the accelerator's copy
    made at ``prepare`` and its gradient-accumulation steps; the next engine is built from them. False without
    DeepSpeed."""
    plugin = deepspeed_plugin(trainer)
    if plugin is None:
        return False
    args, accelerator = trainer.args, trainer.accelerator
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values = dict(zip(DEEPSPEED_SPLIT_KEYS, (micro, accum, micro * accum * world_size())))
    configs = [plugin.deepspeed_config, getattr(getattr(plugin, "hf_ds_config", None), "config", None),
               getattr(getattr(args, "hf_deepspeed_config", None), "config", None),
               getattr(accelerator, "deepspeed_config", None)]
    for config in {id(c): c for c in configs if isinstance(c, dict)}.values():
        config.update(values)
    accelerator.gradient_accumulation_steps = accum
    return True


def release_engine(trainer: Trainer) -> bool:
    """Destroy the trainer's DeepSpeed engine and the accelerator's references to what it prepared
    (``Accelerator.free_memory``), so that the next ``train()`` builds a new engine from the config; False without
    DeepSpeed."""
    if deepspeed_plugin(trainer) is None:
        return False
    trainer.accelerator.free_memory()
    trainer.model_wrapped = cast("torch.nn.Module", trainer.model)      # None only before the trainer's init
    if hasattr(trainer, "deepspeed"):
        trainer.deepspeed = None
    return True


def restarted_by_launcher() -> int:
    """How many times the launcher (torchrun, ``accelerate launch``) restarted this job's workers (0: none)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def restart_message(step: int, split: Split | None, checkpoint: str | None, exactness: Exactness | None = None,
                    kind: str | None = "fsdp") -> str:
    """What happens after an out-of-memory error that the ranks could not agree on under FSDP (or DeepSpeed,
    ``kind``), said on the error: the restart resumes with ``split``; None: no smaller split keeps the run exact
    (``exactness`` says why), so a restart would run out of memory again."""
    why = ("DeepSpeed's collectives are not seen by the step guard" if kind == "deepspeed" else
           f"the step guard is off after {STABLE_STEPS} stable steps, or it struck outside the step")
    what = (f"out of memory under {'DeepSpeed' if kind == 'deepspeed' else 'FSDP'} at step {step} that the "
            f"other ranks cannot learn of inside the step ({why}). This process ends")
    if split is None:
        why = (f"no smaller split keeps this run exact ({exactness.reason}). {exactness.fix}"
               if exactness is not None and exactness.reason else "no smaller split of the batch is left.")
        return (f"{what}; {why} A restart would run out of memory again: lower the run's memory (a shorter "
                f"sequence, activation checkpointing, more ranks) before relaunching.")
    where = checkpoint or "the start"
    return (f"{what}; the launcher's restart (torchrun --max-restarts, accelerate launch --max_restarts) resumes "
            f"every rank from {where} with the split {split} recorded in tuner_split.json. Without restarts, relaunch "
            f"the same command: train_with_tuning resumes with resume_from_checkpoint=True.")


def unagreed_oom(kind: str | None, error: BaseException) -> bool:
    """An out-of-memory error under FSDP, or DeepSpeed with several ranks, that no exchange told the other ranks of
    (they are inside a collective)."""
    sharded = kind == "fsdp" or (kind == "deepspeed" and world_size() > 1)
    return sharded and is_oom_error(error) and not isinstance(error, ResizeNeeded)
