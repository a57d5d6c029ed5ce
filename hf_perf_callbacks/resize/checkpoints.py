"""Which checkpoints a run may resume from: only ones **this run** wrote **completely**.

``output_dir`` can hold an earlier run's ``checkpoint-N`` folders, and a save cut short (out of memory, a full disk, a
kill) leaves a half-written one behind. transformers writes ``trainer_state.json`` last, and marks its just-in-time
(SIGTERM) save in progress with ``checkpoint-is-incomplete.txt``; so a folder is complete when that marker is absent,
``trainer_state.json`` parses and names the folder's step, and a weights file is there (under DeepSpeed: its
``global_step<N>/`` with the ZeRO partitions of the weights). The run records the steps it wrote and verified, each
with a fingerprint (the split file's ``written``); recovery resumes only from those. A folder in the way (an earlier
run's, or a partial one) is moved aside to ``moved_aside/checkpoint-N.<why>-<n>``: out of the ``checkpoint-*`` names
that transformers resumes from and rotates (``save_total_limit``).

A checkpoint written only to switch splits (the tuning's trials) is moved to ``tuner_switch/checkpoint-N`` at once
(:meth:`RunCheckpoints.hide`), so the rotation never deletes a user's checkpoint because of it; it is removed once a
newer one supersedes it or the run ends. Where the user's own ``checkpoint-N`` holds the weights alone
(``save_only_model``), the switch's whole save goes to ``tuner_switch/checkpoint-N`` beside it
(:meth:`RunCheckpoints.record_copy`), and no complete checkpoint is moved or removed before the one replacing it is
complete. Under several ranks only the main process checks and moves the files; the others take its word.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..common.outputdir import INCOMPLETE_MARKER, PREFIX, STATE_FILE, checkpoint_dir, move_aside, step_of
from ..core.splitfile import WrittenCheckpoint, read_split_file
from ..keys import SPLIT_FILE
from ..platform import adapter
from ..platform.device import RngState, gather_floats, is_main_process, rng_state, set_rng_state, world_size

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger("hf_perf_callbacks")

WEIGHT_PREFIXES = ("model", "adapter_model", "pytorch_model")
#: DeepSpeed's own checkpoint inside ``checkpoint-N`` (``engine.save_checkpoint``): ``global_step<N>/`` with each
#: rank's ZeRO partition of the weights (``*model_states.pt``; under ZeRO-3 there is no other weights file) and of
#: the optimizer (``*optim_states.pt``)
DEEPSPEED_DIR = re.compile(r"global_step\d+")
DEEPSPEED_WEIGHTS, DEEPSPEED_OPTIMIZER = "model_states.pt", "optim_states.pt"
SWITCH_DIR = "tuner_switch"                # the folder of output_dir that holds the checkpoints of switches

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
    return (any(name.startswith(WEIGHT_PREFIXES) for name in os.listdir(path))
            or bool(deepspeed_files(path, DEEPSPEED_WEIGHTS)))


def deepspeed_files(path: str, suffix: str) -> list[str]:
    """The files of DeepSpeed's checkpoint in ``path`` (``global_step<N>/*<suffix>``): none when it holds none."""
    try:
        folders = [n for n in os.listdir(path) if DEEPSPEED_DIR.fullmatch(n) and os.path.isdir(os.path.join(path, n))]
        return [os.path.join(f, n) for f in folders for n in os.listdir(os.path.join(path, f)) if n.endswith(suffix)]
    except OSError:
        return []


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
                    for n in names) or bool(deepspeed_files(path, DEEPSPEED_OPTIMIZER))
    return optimizer and "scheduler.pt" in names


#: an RNG file transformers writes per rank, of a rank other than the main process
OTHER_RANKS_RNG = re.compile(r"rng_state_[1-9][0-9]*\.pth")
#: DeepSpeed's ZeRO partition files of a rank other than the main process (each rank writes its own)
OTHER_RANKS_ZERO = re.compile(r"(bf16_)?zero_pp_rank_[1-9][0-9]*_.*")


def fingerprint(path: str) -> str:
    """A fingerprint of a checkpoint's contents, cheap at any model size: every file's name, size and modification
    time, and the bytes of ``trainer_state.json`` (its losses and step are this run's). A folder rewritten by
    another process, or replaced by another run's, no longer matches the fingerprint recorded when it was written.
    The other ranks' RNG files (``rng_state_<rank>.pth``, rank > 0) are left out: each rank writes its own after the
    main process may have fingerprinted the folder (no barrier follows them in transformers' save); so are their
    ZeRO partitions in DeepSpeed's ``global_step<N>/``."""
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if root == path and OTHER_RANKS_RNG.fullmatch(name) or OTHER_RANKS_ZERO.fullmatch(name):
                continue
            full = os.path.join(root, name)
            stat = os.stat(full)
            digest.update(f"{os.path.relpath(full, path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    with open(os.path.join(path, STATE_FILE), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()[:32]


def switch_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, SWITCH_DIR, f"{PREFIX}-{step}")


def add_training_state(staged: str, path: str) -> None:
    """Move the files of the whole checkpoint ``staged`` that the complete checkpoint ``path`` of the same step lacks
    (the optimizer, scheduler, RNG state beside weights saved alone) into ``path``, then remove ``staged``. No file of
    ``path`` is written over, and ``path`` stays complete at every moment: a resume loads the optimizer only with the
    scheduler, so a move cut short leaves a checkpoint that resumes as before (the scheduler goes last)."""
    names = sorted(os.listdir(staged), key=lambda name: name.startswith("scheduler"))
    for name in names:
        if not os.path.exists(os.path.join(path, name)):
            os.replace(os.path.join(staged, name), os.path.join(path, name))
    shutil.rmtree(staged, ignore_errors=True)


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


def resume_point(resume: str | bool | None, output_dir: str, restarts: int = 0) -> str | None:
    """The checkpoint a run resumes from: ``resume`` (a ``checkpoint-N`` folder, ``True`` or ``"last"``: the newest
    complete one, None: none) checked complete, or a clear ValueError; after a launcher's restart (``restarts`` > 0)
    without one, the newest complete checkpoint the job's split file lists. Under several ranks every rank takes the
    main process's checkpoint (each rank reading the folder and the split file on its own could pick another while
    the main process moves a partial checkpoint aside or rewrites the file, and the ranks would then wait in
    different steps' collectives)."""
    if resume is None and restarts:
        resume = _restart_checkpoint(output_dir, restarts)
    found = _checked_resume(resume, output_dir)
    if world_size() == 1:
        return found
    step = step_of(found) if found is not None else None
    chosen = gather_floats([float(step) if step is not None else -1.0])[0][0]
    if chosen < 0:
        return None
    return found if step == int(chosen) else os.path.join(output_dir, f"checkpoint-{int(chosen)}")


def _checked_resume(resume: str | bool | None, output_dir: str) -> str | None:
    if resume is None or resume is False:
        return None
    if resume is True or resume == "last":
        found = newest_complete(output_dir)
        if found is None:
            logger.warning("[tuner] resume_from_checkpoint=%r: no complete checkpoint-N in %s; starting from the "
                           "beginning", resume, output_dir)
            return None
        resume = found
    if not isinstance(resume, str):
        raise ValueError(f"train_with_tuning: resume_from_checkpoint={resume!r} is not allowed: expected a "
                         f"checkpoint-N folder, True, 'last' or None")
    step = step_of(resume)
    if not is_complete(resume, step):
        raise ValueError(f"train_with_tuning: resume_from_checkpoint={resume!r} is not a complete checkpoint (no "
                         f"valid trainer_state.json for step {step}, a weights file missing, or transformers' "
                         f"in-progress marker left): pass an earlier checkpoint-N, or 'last' for the newest "
                         f"complete one")
    return resume


def _restart_checkpoint(output_dir: str, restarts: int) -> str | None:
    """The checkpoint a launcher's restart resumes from: the newest complete one this job's record lists (the split
    file of the run the launcher started first), else None (the restart starts from the beginning)."""
    record = read_split_file(output_dir, warn=False)
    for entry in sorted(record.written if record is not None else [], key=lambda w: -w.step):
        path = checkpoint_dir(output_dir, entry.step)
        if is_complete(path, entry.step):
            logger.warning("[tuner] restarted by the launcher (restart %d): resuming from %s with the split in %s",
                           restarts, path, os.path.join(output_dir, SPLIT_FILE))
            return path
    return None


class RunCheckpoints:
    """The checkpoints one run wrote, each with the fingerprint of its files (:func:`fingerprint`), and where its
    switch checkpoints were moved (:meth:`RunCheckpoints.hide`). Held by the run's
    :class:`~hf_perf_callbacks.resize.executor.Executor`; every commit of the run's record writes them to the split
    file."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.written: list[WrittenCheckpoint] = []
        self.saved_whole: set[int] = set()       # steps of the checkpoints the run saved itself (whole state)
        self.switch_steps: list[int] = []        # checkpoints written only to switch splits (removed when superseded)
        self.hidden: dict[int, str] = {}         # step → where a switch checkpoint was moved (out of checkpoint-*)
        self.copies: dict[int, str] = {}         # step → fingerprint of a switch's whole save in tuner_switch/ beside
                                                 # the user's checkpoint-N of that step (saved with the weights alone)

    def save(self, trainer: Trainer, step: int, switch: bool, rng: RngState | None,
             warn_once: Callable[[str, str], object]) -> tuple[str, bool]:
        """``checkpoint-<step>`` written by this run, verified complete and holding the whole training state
        (weights, optimizer, scheduler and the RNG ``rng`` the next step starts from, whatever ``save_only_model``
        says); returns where it is and whether it was written now (False: this run saved it whole already). A folder
        of that name this run did not write is moved aside first; one that comes out incomplete is moved aside and
        the error raised (a save cut short is moved aside by the trainer's save guard: ``outputdir``). ``switch``:
        written only to switch splits (see the module docstring for where it goes, and for a user's checkpoint of
        the weights alone)."""
        path, main = checkpoint_dir(self.output_dir, step), is_main_process()
        ours = self.is_ours(step)
        if ours and self.resumable(step, bool(trainer.args.save_only_model)):
            return self.location(step), False
        target = switch_dir(self.output_dir, step) if ours else path
        if main:
            _clear(target, step, ours)
        current = rng_state()
        try:
            set_rng_state(rng or current)
            adapter.save_checkpoint(trainer, rotate=not switch, run_dir=os.path.dirname(target) if ours else None)
        finally:
            set_rng_state(current)
        if ours:
            return self._whole_beside(step, target, path, switch), True
        if not self.record(step, whole=True):
            moved = move_aside(path, "partial")
            raise RuntimeError(f"checkpoint-{step} came out incomplete (moved aside to {moved})")
        if switch:
            try:
                return self.hide(step), True
            except OSError as error:          # it stays where it is: rotation may count it, training goes on
                warn_once("hide-switch", f"could not move the switch checkpoint-{step} out of the checkpoint names "
                                         f"({error})")
        return path, True

    def _whole_beside(self, step: int, staged: str, path: str, switch: bool) -> str:
        """The whole save of ``step`` written in ``staged`` beside the user's ``path``: a switch's stays there; a
        recovery's or the run's end's training state joins the user's weights in ``path``."""
        main = is_main_process()
        if switch:
            if not self.record_copy(step):
                moved = move_aside(staged, "partial") if main else None
                raise RuntimeError(f"{staged} came out incomplete (moved aside to {moved})")
            return staged
        every_rank_here()                    # every rank's files are in the staged folder
        try:
            if main:
                if not is_complete(staged, step):
                    moved = move_aside(staged, "partial")
                    raise RuntimeError(f"{staged} came out incomplete (moved aside to {moved})")
                add_training_state(staged, path)
        finally:
            every_rank_here()                # no rank resumes before the files are in place
        if not self.record(step, whole=True):
            raise RuntimeError(f"checkpoint-{step} is not complete after its training state was added")
        return path

    def record(self, step: int, whole: bool = False) -> bool:
        """Record ``checkpoint-<step>`` as this run's, with its fingerprint, when complete (:func:`_mark`). ``whole``:
        saved by the run itself, with the whole training state whatever ``save_only_model`` says. True when recorded."""
        mark = _mark(checkpoint_dir(self.output_dir, step), step)
        if mark is None:
            return False
        self.written = [w for w in self.written if w.step != step] + [WrittenCheckpoint(step, mark)]
        self.hidden.pop(step, None)             # written again where transformers writes it
        if whole:
            self.saved_whole.add(step)
        return True

    def record_copy(self, step: int) -> bool:
        """Record ``tuner_switch/checkpoint-<step>`` as this run's whole save of ``step`` for a switch, written beside
        the user's ``checkpoint-<step>`` (which holds the weights alone and is left as it is) when complete (checked by
        the main process); it is removed like any switch checkpoint. True when recorded."""
        mark = _mark(switch_dir(self.output_dir, step), step)
        if mark is None:
            return False
        self.copies[step] = mark
        if step not in self.switch_steps:
            self.switch_steps.append(step)
        return True

    def location(self, step: int) -> str:
        """Where this run's checkpoint of ``step`` is: ``checkpoint-<step>``, or ``tuner_switch/checkpoint-<step>``
        for a switch checkpoint moved out of the rotation's way or saved beside the user's (:meth:`record_copy`)."""
        if step in self.copies:
            return switch_dir(self.output_dir, step)
        return self.hidden.get(step) or checkpoint_dir(self.output_dir, step)

    def hide(self, step: int) -> str:
        """Move the switch checkpoint of ``step`` to ``tuner_switch/checkpoint-<step>``, out of the names
        transformers' rotation counts (main process; the other ranks take the same path); returns the new path. Its
        fingerprint stays (names, sizes and times move with it). OSError when it cannot be moved."""
        path = switch_dir(self.output_dir, step)
        if is_main_process():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(checkpoint_dir(self.output_dir, step), path)
        self.hidden[step] = path
        return path

    def is_ours(self, step: int) -> bool:
        """Whether ``checkpoint-<step>`` is one this run wrote and its files are still the ones it wrote."""
        mark = self.copies.get(step)
        if mark is None:
            entry = next((w for w in self.written if w.step == step), None)
            if entry is None:
                return False
            mark = entry.fingerprint
        if not is_main_process():
            return True
        path = self.location(step)
        return is_complete(path, step) and fingerprint(path) == mark

    def resumable(self, step: int, save_only_model: bool) -> bool:
        """Whether ``checkpoint-<step>`` holds the optimizer and scheduler state: one the run saved itself (always
        whole), else as its files say (the main process, which wrote them; the other ranks, which cannot see
        them, go by ``save_only_model``, so that every rank decides alike)."""
        if step in self.saved_whole or step in self.copies:
            return True
        if not is_main_process():
            return not save_only_model
        return has_training_state(self.location(step))

    def newest_ours(self, at_most: int, save_only_model: bool) -> str | None:
        """The newest checkpoint this run wrote at a step ≤ ``at_most`` that is still there, unchanged, and holds the
        training state (rotation by ``save_total_limit`` may have removed older ones; another process may have
        replaced one; ``save_only_model`` leaves the weights alone)."""
        for entry in sorted(self.written, key=lambda w: -w.step):
            if entry.step <= at_most and self.is_ours(entry.step) and self.resumable(entry.step, save_only_model):
                return self.location(entry.step)
        return None

    def switched_at(self, step: int, wrote: bool) -> bool:
        """A switch resumed from ``checkpoint-<step>`` (``wrote``: written for the switch, not by a save the run
        makes anyway). The newest such checkpoint stays as the run's fallback; older ones are removed. True when
        the written list changed."""
        return self.drop_switch(step if wrote or step in self.switch_steps else None)

    def drop_switch(self, keep: int | None = None) -> bool:
        """Remove the checkpoints written only for switches (main process; the run's own saves stay), but the one of
        step ``keep``, which stays as the only switch checkpoint. True when any was removed."""
        steps = [s for s in self.switch_steps if s != keep]
        self.switch_steps = [keep] if keep is not None else []
        if not steps:
            return False
        if is_main_process():
            for step in steps:
                shutil.rmtree(self.location(step), ignore_errors=True)
        for step in steps:
            if self.copies.pop(step, None) is None:       # a copy beside the user's: the user's stays this run's
                self.hidden.pop(step, None)
                self.written = [w for w in self.written if w.step != step]
        return True


def _mark(path: str, step: int) -> str | None:
    """The fingerprint of the checkpoint of ``step`` at ``path`` when it is complete (checked by the main process,
    which writes it; the other ranks take its word), None when it is not."""
    if not is_main_process():
        return "written by the main process"
    return fingerprint(path) if is_complete(path, step) else None


def _clear(path: str, step: int, ours: bool) -> None:
    """Make way for a save at ``path``: a leftover of the package's own (``ours``: the folder beside the user's) or a
    folder this run did not write is moved aside (main process)."""
    if not os.path.exists(path):
        return
    moved = move_aside(path, "stale" if ours or is_complete(path, step) else "partial")
    if moved is None and not ours:
        raise RuntimeError(f"{path} is in the way (not written by this run) and could not be moved aside")
    if not ours:
        logger.warning("[tuner] %s was not written by this run: moved aside to %s", path, moved)


def every_rank_here() -> None:
    """Under several ranks, wait until every rank is here (every rank calls it at the same point)."""
    if world_size() > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
