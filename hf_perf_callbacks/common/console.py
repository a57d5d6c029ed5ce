"""What the callbacks show on the console: a compact log line, events as one line each, the progress bar's text.

The callbacks that print each log (transformers' ``ProgressCallback``, ``PrinterCallback``,
``NotebookProgressCallback``) come last in the callback list; their ``on_log`` is given the log through
:func:`console_logs` (the trainer's own keys and :data:`~hf_perf_callbacks.keys.CONSOLE_KEYS`), while the dict every
other callback receives (the reporters, a user's callbacks) keeps every key. An event is one console line of at most
:data:`~hf_perf_callbacks.keys.CONSOLE_WIDTH` characters (:func:`console_line`; the whole text in the perf log); a
move of the memory wall is said once at INFO (every move is in the perf log); a decision is printed once, when made.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from transformers.trainer_callback import CallbackHandler

from ..core.runlog import CALLBACK_PREFIXES, EventKind
from ..core.wording import console_line, wrapped
from ..keys import CONSOLE_KEYS, CONSOLE_WIDTH
from ..platform import adapter

__all__ = ["Console", "console_line", "console_logs", "hide_upstream_deprecations", "EVENT_WIDTH", "LOUD_KINDS",
           "QUIET_ONCE"]

logger = logging.getLogger("hf_perf_callbacks")

#: event kinds said at WARNING on the console (the others at INFO)
LOUD_KINDS: tuple[EventKind, ...] = ("warning", "action", "stop")
#: event kinds said once on the console (INFO; the later ones at DEBUG): a move of the memory wall needs no action
QUIET_ONCE: tuple[EventKind, ...] = ("wall",)
#: the widest "[source] message" of an event: room for a logging prefix (``WARNING hf_perf_callbacks.train: ``)
EVENT_WIDTH = CONSOLE_WIDTH - 36


class Console:
    """One trainer's console: its progress bar and printers (through its callback handler) and the events said."""

    def __init__(self) -> None:
        self.handler: CallbackHandler | None = None
        self.said: set[tuple[str, str]] = set()    # (source, kind) of the events said on the console
        self.quieted: set[int] = set()          # ids of the console printers given the compact log

    def show_progress(self, text: str) -> None:
        """Show ``text`` beside the tqdm progress bar, when there is one."""
        for bar in adapter.progress_bars(self.handler):
            bar.set_postfix_str(text, refresh=False)

    def say(self, text: str) -> None:
        """Print ``text`` on the console on lines of its own: above the tqdm progress bar while there is one (not
        glued to it), else plainly; a line wider than the console's width goes on over indented lines
        (:func:`wrapped`)."""
        text = "\n".join(wrapped(line) for line in text.splitlines())
        bars = adapter.progress_bars(self.handler)
        # the bars cleared, the text out (flushed), the bars again
        with type(bars[0]).external_write_mode() if bars else contextlib.nullcontext():
            print(text, flush=True)

    def announce(self, source: str, kind: EventKind, message: str) -> None:
        """An event's console line: a decision printed once, when made; a quiet kind said once at INFO; the loud
        kinds at WARNING, the others at INFO."""
        line = console_line(f"[{source}] {message}", EVENT_WIDTH)
        if kind == "decision":                           # printed once, when made, whatever the log level
            self.say(console_line(f"[{source}] {message}", CONSOLE_WIDTH))
            logger.debug("%s", line)
        elif kind in QUIET_ONCE and (source, kind) in self.said:
            logger.debug("%s", line)                     # said once already: the perf log has every one
        else:
            self.said.add((source, kind))
            logger.log(logging.WARNING if kind in LOUD_KINDS else logging.INFO, "%s", line)

    def compact(self) -> None:
        """Give the console printers of the trainer the compact log (see the module docstring)."""
        for printer in adapter.console_printers(self.handler):
            if id(printer) in self.quieted:
                continue
            self.quieted.add(id(printer))

            def make(original: Callable[..., Any]) -> Callable[..., Any]:
                def on_log(args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
                    return original(args, state, control,
                                    logs=console_logs(logs) if isinstance(logs, Mapping) else logs, **kwargs)
                return on_log

            adapter.replace_method(printer, "on_log", make)


def console_logs(logs: Mapping[str, Any]) -> dict[str, Any]:
    """A training log as the console shows it: the trainer's own values and the callbacks' headline keys
    (:data:`~hf_perf_callbacks.keys.CONSOLE_KEYS`), not each of their few dozen keys; a whole number as a float, so
    that the printers (which format floats, ``'2'``) show every number alike."""
    return {key: float(value) if isinstance(value, int) and not isinstance(value, bool) else value
            for key, value in logs.items()
            if key in CONSOLE_KEYS or not (isinstance(key, str) and key.startswith(CALLBACK_PREFIXES))}


def hide_upstream_deprecations() -> None:
    """For the package's own commands (``hf-perf demo``, ``hf-perf train``): leave out the transformers deprecations
    that TRL's and peft's own code triggers on every GRPO run with LoRA
    (:data:`hf_perf_callbacks.platform.adapter.SHOWN_BEFORE_A_RESIZE`); any other warning still shows, and a user's
    script that calls the trainer itself still sees them (docs/known-issues.md)."""
    for pattern, category in adapter.SHOWN_BEFORE_A_RESIZE:
        warnings.filterwarnings("ignore", message=pattern, category=category)
