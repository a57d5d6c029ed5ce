"""Ctrl-C and SIGTERM under the launcher, answered once, in one line, in the launcher's terms.

While the launcher trains (:func:`answered`), SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) where the
run is, as Ctrl-C raises ``KeyboardInterrupt``: ``train_with_tuning`` then saves the last completed optimizer step
either way (:meth:`hf_perf_callbacks.resize.executor.Executor.end_run`). The interrupt comes out of the launch as
:class:`Interrupted`, whose one line says what stopped the run, at which step, the checkpoint there is to go on
from, and how to go on: the same command with ``--resume_from_checkpoint``. No traceback, unless
``HF_PERF_TRACEBACK=1`` (:data:`TRACEBACK_ENV`) is set: then the interrupt is raised as it came.

The package's own lines that advise a resume are worded for the Python API
(``train_with_tuning(trainer, resume_from_checkpoint='out/checkpoint-5')``); under the launcher they read as the flag
(``--resume_from_checkpoint out/checkpoint-5``): :class:`LauncherWords`, a logging filter the launcher puts on the
handlers, rewrites the log lines, and the notes on an error that ends the launch (how the run ended and how to go
on) are rewritten before it is raised. The run's own end line after an interrupt (a log line where Python has no
notes) is left out: the launcher's line says it.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Trainer

#: set to 1 to see an interrupt's traceback under the launcher
TRACEBACK_ENV = "HF_PERF_TRACEBACK"
#: the flag of the launcher that resumes a run
RESUME_FLAG = "--resume_from_checkpoint"

#: the Python API's resume advice: ``train_with_tuning(trainer, resume_from_checkpoint=X)``,
#: ``trainer.train(resume_from_checkpoint=X)``, with or without ``hf_perf_callbacks.``
_PYTHON_RESUME = re.compile(r"(?:hf_perf_callbacks\.)?(?:train_with_tuning\(trainer,\s+|trainer\.train\()"
                            r"resume_from_checkpoint=([^)]*)\)")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is as Ctrl-C's ``KeyboardInterrupt`` is (so the run saves and ends alike)."""


class Interrupted(Exception):
    """A launch stopped by Ctrl-C or SIGTERM: ``line`` says it, ``status`` is the exit status."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.line, self.status = line, status


def as_flag(text: str) -> str:
    """``text`` with the Python API's resume advice written as the launcher's flag."""
    def flag(match: re.Match[str]) -> str:
        value = match.group(1).strip().strip("'\"")
        return f"{RESUME_FLAG} {'last' if value in ('...', 'True') else value}"

    return _PYTHON_RESUME.sub(flag, text)


class LauncherWords(logging.Filter):
    """A handler's filter under the launcher: the Python API's resume advice as the flag (:func:`as_flag`); the
    run's end line after an interrupt left out (the launcher's own line says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ..resize.executor import RUN_END

        text = record.getMessage()
        if hasattr(record, RUN_END) and re.match(r"\[tuner\] (KeyboardInterrupt|Terminated):", text):
            return False
        rewritten = as_flag(text)
        if rewritten != text:
            record.msg, record.args = rewritten, None
        return True


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated("SIGTERM")


def newest_checkpoint(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (complete as
    :func:`hf_perf_callbacks.resize.checkpoints.is_complete` says; nothing is moved)."""
    from ..common.outputdir import step_of
    from ..resize.checkpoints import is_complete

    found = sorted(((step, path) for path in glob.glob(os.path.join(output_dir, "checkpoint-*"))
                    if (step := step_of(os.path.basename(path))) is not None), reverse=True)
    return next((path for step, path in found if os.path.isdir(path) and is_complete(path, step)), None)


def interrupt_line(error: KeyboardInterrupt, step: int | None, output_dir: str) -> str:
    """The one line of a run stopped at ``step`` (None: before training began) by ``error``: the signal, the
    checkpoint to go on from (the one the run saved as it stopped, which ``Executor.end_run`` sets on the error as
    :data:`hf_perf_callbacks.resize.executor.RUN_END`, or else the newest complete one) and the flag that resumes
    from it."""
    from ..common.outputdir import step_of
    from ..resize.executor import RUN_END

    what = "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C (SIGINT)"
    if step is None:
        return f"stopped by {what} before training began"
    noted = getattr(error, RUN_END, None)
    path = noted if isinstance(noted, str) else newest_checkpoint(output_dir)
    if path is None:
        return (f"stopped by {what} at step {step}; no checkpoint in {output_dir} to go on from: the run must start "
                f"again (save_steps saves one every N steps)")
    saved = step_of(path)
    where = (f"saved {path}, the last completed step" if saved == step else
             f"the newest checkpoint is {path} (step {saved}; the steps after it are lost)")
    return f"stopped by {what} at step {step}; {where}; go on with the same command and {RESUME_FLAG} {path}"


_running: weakref.ref[Trainer] | None = None     # the trainer the launch runs (one per process), once built


def running(trainer: Trainer) -> None:
    """Name the trainer the launch runs: its step goes into the interrupt's line, its progress bar is closed first."""
    global _running
    _running = weakref.ref(trainer)


@contextlib.contextmanager
def answered(output_dir: str) -> Iterator[None]:
    """The launch's interrupts as the module docstring says (SIGTERM raises only in the main thread, where signals
    go; :class:`LauncherWords` on the root logger's handlers; the step and progress bar of :func:`running`'s)."""
    from ..platform import adapter

    global _running
    _running = None
    words, handlers = LauncherWords(), list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(words)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        yield
    except BaseException as error:
        from ..platform.device import error_chain

        for told in error_chain(error):
            if hasattr(told, "__notes__"):
                told.__notes__[:] = [as_flag(note) for note in told.__notes__]
        shown = os.environ.get(TRACEBACK_ENV, "").lower() in ("1", "true", "yes")
        if not isinstance(error, KeyboardInterrupt) or shown:
            raise
        trainer = _running() if _running is not None else None
        for bar in adapter.progress_bars(trainer.callback_handler if trainer is not None else None):
            bar.close()
        step = trainer.state.global_step if trainer is not None else None
        status = 128 + (signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT)   # as the shells say it
        raise Interrupted(interrupt_line(error, step, output_dir), status) from None
    finally:
        _running = None
        for handler in handlers:
            handler.removeFilter(words)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
