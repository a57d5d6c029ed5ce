"""What of :func:`~hf_perf_callbacks.train_with_tuning` works when accelerate shards the model (FSDP, DeepSpeed).

=====================================  ===============================  ==========================================
part                                   FSDP2                            DeepSpeed ZeRO
=====================================  ===============================  ==========================================
an OOM inside a step, on any rank      every rank re-sizes alike in     refused at start (``ValueError``): its
                                       the same process while the step  config fixes the micro-batch when the
                                       guard is armed; once it is off,  engine is built; use ``trainer.train()``,
                                       the launcher's restart resumes   a re-size request then saves, stops and
                                       with the next smaller split      prints the split
re-size on the watchdog's request      in the same process              —
tuning on the run's steps, memory      skipped                          —
check
=====================================  ===============================  ==========================================

**The step guard** (:class:`~hf_perf_callbacks.resize.agreement.StepGuard`) runs one small exchange before every
collective of the training step on the default group — FSDP2's all-gathers and reduce-scatters included — so a rank
that ran out of memory leaves its step and the others learn of it before their next collective, as under DDP. After
the OOM every rank resets FSDP2's iteration state (its parameters resharded; torch's
``FSDPModule.reset_iter_state``), saves FSDP's sharded checkpoint of the last completed step together, and
``train()`` resumes from it with the next smaller exact split (accelerate is kept from wrapping the wrapped model a
second time: :func:`~hf_perf_callbacks.adapter.fsdp2_prepared_again`). The exchanges cost a host round trip per
collective, so the guard comes off after :data:`STABLE_STEPS` optimizer steps without a change, and is put back by
every re-size (MosaicML Composer does the same with its FSDP hooks). An OOM while it is off — or one outside the
step (``optimizer.step``, a save) — leaves the other ranks inside a collective: the rank that ran out of memory
records the next smaller split (the main process writes it to ``tuner_split.json``) and ends its process, and the
launcher's own restart (``torchrun --max-restarts N``, ``accelerate launch --max_restarts N``) starts every rank
again; ``train_with_tuning`` sees the restart (``TORCHELASTIC_RESTART_COUNT``) and resumes from the newest checkpoint
this run wrote with the recorded split, no person in the loop. Not seen by the guard: collectives on sub-groups of a
2-D device mesh (HSDP, tensor parallelism): there no guard is installed, every OOM takes the restart path.

The tuning on the run's steps and the memory check stay off under FSDP: the watchdog re-sizes before the wall.
"""
from __future__ import annotations

import logging
import os

from ..batching import Exactness, Split
from ..device import error_line, is_oom_error

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


def guardable(trainer) -> bool:
    """Whether the step guard sees the collectives of the trainer's sharding: FSDP over the whole world (the default
    group), not a device mesh of more than one dimension."""
    mesh = getattr(getattr(trainer, "accelerator", None), "torch_device_mesh", None)
    return mesh is None or getattr(mesh, "ndim", 1) <= 1


def start(trainer, session) -> tuple[str | None, bool]:
    """Refuse what cannot work under the trainer's sharding, say what is limited; returns the sharding and whether
    the step guard sees its collectives (always, unsharded)."""
    kind = sharding(trainer)
    if kind == "deepspeed":
        raise ValueError(DEEPSPEED_REFUSED)
    guarded = kind is None or guardable(trainer)
    if kind == "fsdp":
        session.warn_once("sharding-limits", FSDP_NOTES if guarded else NO_GUARD)  # console and perf log
    return kind, guarded


def restarted_by_launcher() -> int:
    """How many times the launcher (torchrun, ``accelerate launch``) restarted this job's workers (0: none)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def restart_message(error: BaseException, step: int, split: Split | None, checkpoint: str | None,
                    exactness: Exactness | None = None) -> str:
    """What happens after an out-of-memory error that the ranks could not agree on under FSDP: the restart resumes
    with ``split``; None: no smaller split keeps the run exact (``exactness`` says why), so a restart would run out
    of memory again."""
    what = (f"[tuner] out of memory under FSDP at step {step} that the other ranks cannot learn of inside the step "
            f"(the step guard is off after {STABLE_STEPS} stable steps, or it struck outside the step): "
            f"{error_line(error)[:120]}. This process ends")
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
    """An out-of-memory error under FSDP that no exchange told the other ranks of (they are inside a collective)."""
    from .agreement import ResizeNeeded

    return kind == "fsdp" and is_oom_error(error) and not isinstance(error, ResizeNeeded)
