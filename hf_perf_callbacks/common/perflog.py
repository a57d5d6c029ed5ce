"""Writes one trainer's run log, ``<output_dir>/perf_log.jsonl`` (main process only; records and reader in
:mod:`hf_perf_callbacks.core.runlog`).

One run header per ``train()`` call with the run's ``session`` and the facts the callbacks handed it
(:meth:`PerfLog.describe_run`), one step line per optimizer step (at a logging step with every numeric value of the
trainer's own training log as ``log/<key>``: ``log/loss``, ``log/reward``), one line per event and the summaries. The
header is written once every callback has begun (at the first step, or at the first step line or summary); events from
before it wait and follow it. **Each fresh ``train()`` is its own run**: one that starts at step 0 gets a new session (a
resume keeps it), unless a tuning session pins it (:meth:`PerfLog.pin_session`: its in-process re-sizes and resumes are
one run). An event is also said on the console (:class:`~hf_perf_callbacks.common.console.Console`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..core.runlog import (
    CALLBACK_PREFIXES,
    TRAINER_LOG,
    EventDetails,
    EventKind,
    EventLine,
    LogWriter,
    Record,
    RunHeader,
    StepLine,
    SummaryLine,
)
from .console import Console
from .merger import finite

__all__ = ["PerfLog"]


class PerfLog:
    """The run log of one trainer: its session, the pending run header and step line, the events held for the
    header."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.output_dir: str | None = None
        self.is_main = True
        self.session = uuid.uuid4().hex[:12]    # on run headers: a fresh run restarts the log
        self.pinned = False                     # a tuning session fixed the session (see pin_session)
        self.trained = False                    # a train() call has begun
        self.standing: dict[str, Any] = {}      # run facts of every train() call of this trainer (see mark_runs)
        self.step_line: StepLine | None = None  # this optimizer step's line, written when the next begins
        # this train() call's header while it is not written yet; the first call's is opened here, as the bus
        # joins the callback list during the callbacks' on_train_begin and misses its own
        self.header: RunHeader | None = RunHeader(session=self.session)
        self.start_known = False                # the header's resumed_from_step is known
        self.held: list[EventLine] = []         # events waiting for the header
        self.writer = LogWriter()

    def open_header(self, step: int, resize: bool) -> None:
        """A ``train()`` call begins at ``step``: its run header (replaces an unused one); a fresh call of a trainer
        that trained before is a run of its own. ``resize``: an in-process re-size of train_with_tuning, not a
        resume."""
        if self.step_line is not None:
            self.flush()
        if self.trained and not self.pinned and step == 0:
            self.session = uuid.uuid4().hex[:12]
        self.trained = True
        self.header = RunHeader(session=self.session, resumed_from_step=step)
        if self.standing:
            self.header.describe("bus", **self.standing)
        if resize:
            self.header.describe("bus", resize=True)
        self.start_known = True

    def mark_runs(self, **facts: Any) -> None:
        """Facts that hold for every ``train()`` call of this trainer (e.g. ``launcher="hf-perf train"``): each
        run header carries them."""
        self.standing.update(facts)
        if self.header is not None:
            self.header.describe("bus", **facts)

    def pin_session(self, session: str) -> None:
        """Log every ``train()`` call as the run ``session`` (a tuning session's re-sizes and resumes are one run)."""
        self.session, self.pinned = session, True
        if self.header is not None:
            self.header.session = session

    def record_step(self, step: int, fields: Mapping[str, Any]) -> None:
        """Fields for this optimizer step's line in ``perf_log.jsonl``."""
        if self.step_line is not None and self.step_line.step != step:
            self.flush()
        if self.step_line is None:
            self.step_line = StepLine(step, round(time.time(), 3))
        self.step_line.values.update({k: v for k, v in fields.items() if v is not None})

    def record_training_log(self, step: int, logs: Mapping[str, Any]) -> None:
        """The trainer's own values of the training log of ``step`` join its pending step line as ``log/<key>``."""
        if self.step_line is not None and self.step_line.step == step:
            self.record_step(step, {TRAINER_LOG + k: v for k, v in logs.items()
                                    if finite(v) and not k.startswith(CALLBACK_PREFIXES)})

    def describe_run(self, source: str, step: int, **facts: Any) -> None:
        """A callback's facts for this ``train()`` call's run header (:class:`~hf_perf_callbacks.core.runlog.RunHeader`
        names them); ``step`` is where the call starts (``state.global_step``)."""
        if self.header is None:                  # the bus missed on_train_begin (not in the callback list)
            self.header, self.start_known = RunHeader(session=self.session), False
        if not self.start_known:
            self.header.resumed_from_step, self.start_known = step, True
        self.header.describe(source, **facts)

    def event(self, source: str, kind: EventKind, message: str, step: int | None = None,
              details: EventDetails | None = None) -> dict[str, Any]:
        """Log an event (warning, action, decision) to the console and the perf log; returns its JSON object.
        ``details``: its fields, through the type of its shape (:data:`~hf_perf_callbacks.core.runlog.EventDetails`)."""
        entry = EventLine(source, kind, message, step, round(time.time(), 3),
                          details.to_details() if details is not None else {})
        if self.is_main:
            self.console.announce(source, kind, message)
            if self.header is not None:
                self.held.append(entry)
            else:
                self.writer.append(self.output_dir, entry)
        return entry.to_json()

    def write_summary(self, source: str, values: Mapping[str, Any]) -> None:
        """A callback's end-of-run summary."""
        self._emit(SummaryLine(source, dict(values)))

    def flush(self) -> None:
        """Write the pending step line (and the run header first, when it is still due)."""
        line, self.step_line = self.step_line, None
        if line is not None:
            if self.header is not None and not self.start_known:     # nobody described the run: the call began
                self.header.resumed_from_step = max(0, line.step - 1)  # one step before its first step line
            self._emit(line)
        else:
            self._write_header()

    def _emit(self, record: Record) -> None:
        if self.is_main:
            self._write_header()
            self.writer.append(self.output_dir, record)

    def _write_header(self) -> None:
        header, self.header = self.header, None
        if header is None or not self.is_main:
            return
        header.time = round(time.time(), 3)
        self.writer.append(self.output_dir, header)
        held, self.held = self.held, []
        for event in held:
            self.writer.append(self.output_dir, event)
