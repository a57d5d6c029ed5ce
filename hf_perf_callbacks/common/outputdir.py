"""One process per ``output_dir``: this process's hold on the directory it trains into.

While a ``train()`` call runs, the main process holds ``<output_dir>/.hf_perf.lock`` (:class:`OutputDirLock`, a
``filelock.FileLock``: released by the OS when the process dies): two processes training into one ``output_dir``
would interleave their perf logs and resume from each other's checkpoints, so a second one is refused with
:class:`OutputDirBusy` before it writes anything. The lock is released, and its file removed, when ``train()`` ends,
by an error too (:meth:`OutputDirHold.watch_trainer` wraps the trainer's ``train``;
:func:`~hf_perf_callbacks.train_with_tuning` holds it across its in-process re-sizes: :meth:`OutputDirHold.hold`).
Where the file system cannot hold a lock (read-only, no ``flock``) one warning says so and training goes on without
it, as transformers trains there.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
from collections.abc import Callable
from typing import Any

from filelock import FileLock, Timeout

from ..core.runlog import LOCK_FILE
from ..platform import adapter
from ..platform.device import is_main_process

__all__ = ["OutputDirBusy", "OutputDirLock", "OutputDirHold", "HOLDER_FILE", "move_aside",
           "checkpoint_dir", "step_of", "STATE_FILE", "PREFIX", "MOVED_ASIDE", "INCOMPLETE_MARKER"]

logger = logging.getLogger("hf_perf_callbacks")

# ------------------------------------------------------------ the output_dir's checkpoints
PREFIX = "checkpoint"
STATE_FILE = "trainer_state.json"          # transformers' TRAINER_STATE_NAME, written last
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"   # transformers' JIT checkpoint sentinel
_CHECKPOINT = re.compile(rf"^{PREFIX}-(\d+)$")
MOVED_ASIDE = "moved_aside"                # the folder of output_dir that checkpoints are moved aside into


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def step_of(path: str) -> int | None:
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def set_aside_partial(path: str) -> None:
    """A save of ``path`` was cut short (Ctrl-C, SIGTERM, an error): the folder, when it is not a complete checkpoint,
    is moved aside (main process), so that neither transformers' ``get_last_checkpoint`` nor ``--resume_from_checkpoint
    last`` resumes from it."""
    if is_main_process() and os.path.isdir(path) and not _state_written(path):
        moved = move_aside(path, "partial")
        logger.warning("[run] the save of %s was cut short: moved aside to %s (a resume picks the newest complete "
                       "checkpoint)", os.path.basename(path), moved)


def _state_written(path: str) -> bool:
    """Whether a checkpoint's save reached its end: ``trainer_state.json``, which transformers writes last, parses
    and transformers' in-progress marker is gone (the whole check of a checkpoint: ``resize/checkpoints.py``)."""
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return not os.path.exists(os.path.join(path, INCOMPLETE_MARKER))


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


class OutputDirBusy(RuntimeError):
    """Another live process is training into the same ``output_dir`` (``holder`` names it: ``pid N on host``)."""

    output_dir: str | None = None
    holder: str | None = None


#: the file beside the lock naming the process that holds it (read by a refused process)
HOLDER_FILE = LOCK_FILE + ".holder"
#: output_dir (real path) → its lock, held by this process (re-entrant within the process)
_HELD: dict[str, FileLock] = {}


class OutputDirLock:
    """This process's hold on one ``output_dir`` (see "One process per ``output_dir``" in the module docstring)."""

    def __init__(self) -> None:
        self.key: str | None = None           # the real path of the output_dir held
        self.output_dir: str | None = None
        self.unlockable: set[str] = set()     # output_dirs warned about: no lock there

    def acquire(self, output_dir: str) -> None:
        """Hold ``output_dir`` for this process. Raises :class:`OutputDirBusy` naming the holder when another process
        holds it; a file system that cannot hold the lock is one warning and no lock."""
        key = os.path.realpath(output_dir)
        if key == self.key:
            return
        self.release()
        if key in _HELD:                      # another trainer of this process holds it: the same process
            self.key, self.output_dir = key, output_dir
            return
        path = os.path.join(output_dir, LOCK_FILE)
        try:
            os.makedirs(output_dir, exist_ok=True)
            probe = path + ".probe"                        # a read-only directory fails here, plainly
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.remove(probe)
            lock = FileLock(path, timeout=0)
            try:
                lock.acquire()
            except Timeout:
                holder = _read_holder(output_dir)
                busy = OutputDirBusy(
                    f"output_dir {output_dir!r} is being written by another training process ({holder}): two runs "
                    f"in one output_dir interleave their perf logs and resume from each other's checkpoints. This "
                    f"run did not start and wrote nothing there: give it its own output_dir, or start it again once "
                    f"that process has ended")
                busy.output_dir, busy.holder = output_dir, holder
                raise busy from None
        except (OSError, NotImplementedError) as error:    # read-only, or no flock: transformers trains there
            if isinstance(error, NotImplementedError):      # filelock left its file on a file system without flock
                with contextlib.suppress(OSError):          # nothing to tidy
                    os.remove(path)
            if key not in self.unlockable:
                self.unlockable.add(key)
                logger.warning("cannot lock %s (%s: %s): training goes on without the one-process-per-output_dir "
                               "check (warned once)", output_dir, type(error).__name__, error)
            return
        with contextlib.suppress(OSError):                 # the lock holds without the holder's name
            with open(os.path.join(output_dir, HOLDER_FILE), "w", encoding="utf-8") as f:
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        _HELD[key] = lock
        self.key, self.output_dir = key, output_dir

    def release(self) -> None:
        """Release the hold, removing the lock's files first (while still held, so no other process takes a lock on
        a file about to be removed)."""
        key, output_dir, self.key, self.output_dir = self.key, self.output_dir, None, None
        lock = _HELD.pop(key, None) if key is not None else None
        if lock is None or output_dir is None:
            return
        for name in (HOLDER_FILE, LOCK_FILE):
            with contextlib.suppress(OSError):             # gone already, or not removable: released all the same
                os.remove(os.path.join(output_dir, name))
        try:
            lock.release()
        except OSError as error:                           # the hold ends with the descriptor anyway
            logger.warning("releasing the lock of %s: %s", output_dir, error)


def _read_holder(output_dir: str) -> str:
    try:
        with open(os.path.join(output_dir, HOLDER_FILE), encoding="utf-8") as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


class OutputDirHold:
    """One trainer's hold on its ``output_dir`` across its ``train()`` calls: taken when a call begins (main process),
    released when ``train()`` ends unless :func:`~hf_perf_callbacks.train_with_tuning` holds it across its calls."""

    def __init__(self) -> None:
        self.lock = OutputDirLock()
        self.holding = 0                        # train_with_tuning calls holding the lock across their train() calls
        self.watched: set[int] = set()          # ids of the trainers whose train() releases the lock when it ends
        self.calls_held = 0                     # train() calls begun while train_with_tuning holds the lock

    def watch_trainer(self, trainer: Any) -> None:
        """Release the lock whenever ``trainer.train()`` ends, by an error too (its ``train`` wrapped once), and move
        a checkpoint whose save was cut short out of the names a resume picks (:func:`set_aside_partial`)."""
        if trainer is None or id(trainer) in self.watched:
            return
        self.watched.add(id(trainer))
        adapter.guard_saves(trainer, set_aside_partial)

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def train(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                finally:
                    if not self.holding:
                        self.lock.release()
            return train

        adapter.replace_method(trainer, "train", make)

    def hold(self, output_dir: str) -> None:
        """Hold the lock across several ``train()`` calls (train_with_tuning); raises :class:`OutputDirBusy`."""
        self.lock.acquire(output_dir)
        self.holding += 1
        self.calls_held = 0                     # train() calls begun in this hold: the later ones are re-sizes

    def unhold(self) -> None:
        self.holding = max(0, self.holding - 1)
        if not self.holding:
            self.lock.release()

    def call_begins(self, output_dir: str | None, is_main: bool) -> bool:
        """A ``train()`` call begins: hold ``output_dir`` (main process; another live process there raises
        :class:`OutputDirBusy`). True when the call is a re-size of a train_with_tuning hold (not its first call)."""
        if is_main and output_dir:
            self.lock.acquire(output_dir)
        if not self.holding:
            return False
        self.calls_held += 1
        return self.calls_held > 1

    def call_ends(self, continuing: bool) -> None:
        """A ``train()`` call ends: release the lock unless the run goes on (a re-size) or a hold keeps it."""
        if not continuing and not self.holding:
            self.lock.release()
