"""Which checkpoints a run may resume from: only ones **this run** wrote **completely**.

``output_dir`` can hold an earlier run's ``checkpoint-N`` folders, and a save cut short (out of memory, a full
disk, a kill) leaves a half-written one behind. transformers' ``_save_checkpoint`` writes the weights, optimizer,
scheduler, scaler and RNG state first and ``trainer_state.json`` last, and its just-in-time (SIGTERM) checkpoint
marks a save in progress with ``checkpoint-is-incomplete.txt``; so a folder is complete when that marker is absent,
``trainer_state.json`` parses and names the folder's step, and a weights file is there. The tuner records the steps
this run wrote and verified (its ``written`` list, with its session id); recovery resumes only from those. A folder
in the way (an earlier run's, or a partial one) is moved aside to ``moved_aside/checkpoint-N.<why>-<n>`` inside
``output_dir``: out of the ``checkpoint-*`` names that transformers resumes from and that its rotation
(``save_total_limit``) sorts, so it can be neither resumed from, nor kept as the newest while a complete one is
deleted. A checkpoint written only to switch splits on the run's own steps (the tuning's trials) is moved to
``tuner_switch/checkpoint-N`` right after it is written (:func:`hide`): out of the names transformers' rotation
counts, so ``save_total_limit`` never deletes one of the user's checkpoints because of it; it is resumed from there
and removed once a newer one supersedes it or the run ends. Under several ranks only the main
process (which writes the files) checks and moves them; the others take its word (no rank races another's write).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re

from ..device import is_main_process

logger = logging.getLogger("hf_perf_callbacks")

PREFIX = "checkpoint"
STATE_FILE = "trainer_state.json"          # transformers' TRAINER_STATE_NAME, written last
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"   # transformers' JIT checkpoint sentinel
WEIGHT_PREFIXES = ("model", "adapter_model", "pytorch_model")
_CHECKPOINT = re.compile(rf"^{PREFIX}-(\d+)$")
MOVED_ASIDE = "moved_aside"                # the folder of output_dir that checkpoints are moved aside into
SWITCH_DIR = "tuner_switch"                # the folder of output_dir that holds the checkpoints of switches


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def step_of(path: str) -> int | None:
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def is_complete(path: str, step: int | None = None) -> bool:
    """Whether ``path`` is a whole checkpoint (of ``step`` when given); see the module docstring."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
        return False
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            global_step = json.load(f)["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if step is not None and global_step != step:
        return False
    return any(name.startswith(WEIGHT_PREFIXES) for name in os.listdir(path))


def has_training_state(path: str) -> bool:
    """Whether a checkpoint holds the optimizer and scheduler state, not the weights alone (``save_only_model=True``
    writes only the weights: a resume from them restarts the schedule and the optimizer). The optimizer is
    ``optimizer.pt``/``.bin`` or, sharded (FSDP), a folder named ``optimizer…``, as transformers looks for it."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    optimizer = any(n in ("optimizer.pt", "optimizer.bin") or (n.startswith("optimizer")
                                                                and os.path.isdir(os.path.join(path, n)))
                    for n in names)
    return optimizer and "scheduler.pt" in names


#: an RNG file transformers writes per rank, of a rank other than the main process
OTHER_RANKS_RNG = re.compile(r"rng_state_[1-9][0-9]*\.pth")


def fingerprint(path: str) -> str:
    """A fingerprint of a checkpoint's contents, cheap at any model size: every file's name, size and modification
    time, and the bytes of ``trainer_state.json`` (its losses and step are this run's). A folder rewritten by
    another process, or replaced by another run's, no longer matches the fingerprint recorded when it was written.
    The other ranks' RNG files (``rng_state_<rank>.pth``, rank > 0) are left out: each rank writes its own after the
    main process may have fingerprinted the folder (no barrier follows them in transformers' save)."""
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if root == path and OTHER_RANKS_RNG.fullmatch(name):
                continue
            full = os.path.join(root, name)
            stat = os.stat(full)
            digest.update(f"{os.path.relpath(full, path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    with open(os.path.join(path, STATE_FILE), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()[:32]


def move_aside(path: str, why: str) -> str | None:
    """Move ``path`` to ``moved_aside/<name>.<why>-<n>`` beside it (never read, resumed or rotated as a checkpoint);
    returns the new path (None on failure)."""
    path = os.path.normpath(path)
    folder = os.path.join(os.path.dirname(path), MOVED_ASIDE)
    for n in range(1, 1000):
        target = os.path.join(folder, f"{os.path.basename(path)}.{why}-{n}")
        if not os.path.exists(target):
            try:
                os.makedirs(folder, exist_ok=True)
                os.replace(path, target)
            except OSError as error:
                logger.warning("[tuner] could not move %s aside: %s", path, error)
                return None
            return target
    return None


def switch_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, SWITCH_DIR, f"{PREFIX}-{step}")


def hide(output_dir: str, step: int) -> str:
    """Move ``checkpoint-<step>`` to ``tuner_switch/checkpoint-<step>`` (see the module docstring); returns the new
    path. Its fingerprint stays (names, sizes and times move with it). OSError when it cannot be moved."""
    target = switch_dir(output_dir, step)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
        import shutil

        shutil.rmtree(target)
    os.replace(checkpoint_dir(output_dir, step), target)
    return target


def newest_complete(output_dir: str) -> str | None:
    """``resume_from_checkpoint="last"``: the newest complete ``checkpoint-N``. Newer folders that are not complete
    are moved aside with one warning each (so a partial checkpoint never stays the newest)."""
    if not os.path.isdir(output_dir):
        return None
    found = sorted(((step_of(name), name) for name in os.listdir(output_dir) if step_of(name) is not None),
                   reverse=True)
    for step, name in found:
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        if is_complete(path, step):
            return path
        if not is_main_process():               # the main process moves it; the others only pass it by
            continue
        moved = move_aside(path, "partial")
        logger.warning("[tuner] %s is not a complete checkpoint (no valid %s, a weights file missing or the "
                       "in-progress marker left): moved aside to %s; resuming from an older one",
                       path, STATE_FILE, moved)
    return None
