"""``<output_dir>/tuner_split.json``: the split a tuner chose, read back only when it fits the run.

One rule for :func:`~hf_perf_callbacks.resize.train_with_tuning` and the recipe launcher
(:func:`split_for_run`): the recorded split is applied only when it is well-formed (positive integers) and exact
for the run being started — ``micro_batch × grad_accum × world`` equals the configured effective batch and, for
GRPO, ``micro_batch × world × steps_per_generation`` equals the configured generation batch. Anything else is
ignored with one warning that names the file, what it holds and the expected values; the run starts from its own
configured split.
"""
from __future__ import annotations

import json
import logging
import os

from ..batching import Split
from ..runlog import SPLIT_FILE

logger = logging.getLogger("hf_perf_callbacks")



def read_record(output_dir: str) -> dict | None:
    """The whole JSON object in ``output_dir``'s split file (None when absent or unreadable, with one warning)."""
    path = os.path.join(output_dir, SPLIT_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        logger.warning("[tuner] ignoring unreadable %s: %s", path, error)
        return None
    if not isinstance(record, dict):
        logger.warning("[tuner] ignoring %s: expected a JSON object, found %s", path, type(record).__name__)
        return None
    return record


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_split(split, *, effective_batch: int, world_size: int, generation_batch: int | None = None) -> str | None:
    """Why ``split`` (the file's ``"split"`` mapping) does not fit the run, or None when it does."""
    if not isinstance(split, dict):
        return f"its 'split' is {type(split).__name__}, not a mapping"
    micro, accum = split.get("per_device_train_batch_size"), split.get("gradient_accumulation_steps")
    spg = split.get("steps_per_generation")
    if not (_positive_int(micro) and _positive_int(accum)):
        return (f"per_device_train_batch_size={micro!r} and gradient_accumulation_steps={accum!r} must be positive "
                f"integers")
    effective = Split(micro, accum).effective_batch(world_size)
    if effective != effective_batch:
        return (f"its effective batch {effective} ({micro}×{accum} over {world_size} rank(s)) differs from the run's "
                f"{effective_batch}")
    if generation_batch is None:
        if spg is not None:
            return f"it sets steps_per_generation={spg!r} (a GRPO split) but this run has no generation batch"
        return None
    if spg is None:                    # an older record: the generation batch stays, when it divides exactly
        if generation_batch % (micro * world_size):
            return (f"the run's generation batch {generation_batch} is not a whole number of micro-batches of "
                    f"{micro} over {world_size} rank(s)")
        return None
    if not _positive_int(spg):
        return f"steps_per_generation={spg!r} must be a positive integer for a GRPO run"
    generation = Split(micro, accum, spg).generation_batch(world_size)
    if generation != generation_batch:
        return (f"its generation batch {generation} ({micro}×{spg} over {world_size} rank(s)) differs from the "
                f"run's {generation_batch}")
    return None


def split_for_run(output_dir: str, *, effective_batch: int, world_size: int,
                  generation_batch: int | None = None) -> Split | None:
    """The recorded split when it is exact for this run (see the module docstring), else None."""
    record = read_record(output_dir)
    if record is None:
        return None
    why = check_split(record.get("split"), effective_batch=effective_batch, world_size=world_size,
                      generation_batch=generation_batch)
    if why is not None:
        expected = f"effective batch {effective_batch} over {world_size} rank(s)" + (
            f", generation batch {generation_batch}" if generation_batch is not None else "")
        logger.warning("[tuner] ignoring %s: %s (expected %s); starting from the configured split",
                       os.path.join(output_dir, SPLIT_FILE), why, expected)
        return None
    split = record["split"]
    spg = split.get("steps_per_generation")
    if generation_batch is not None and spg is None:
        spg = generation_batch // (split["per_device_train_batch_size"] * world_size)
    return Split(split["per_device_train_batch_size"], split["gradient_accumulation_steps"], spg)


def run_geometry(args, world_size: int) -> dict:
    """The keyword arguments of :func:`split_for_run` for a trainer's args (as configured, before any re-size)."""
    effective = Split(args.per_device_train_batch_size, args.gradient_accumulation_steps).effective_batch(world_size)
    generation = getattr(args, "generation_batch_size", None) if hasattr(args, "num_generations") else None
    return {"effective_batch": effective, "world_size": world_size, "generation_batch": generation}
