"""How the callbacks' metrics reach every reporter, ``log_history``, the console and ``perf_log.jsonl``; the
signals between callbacks.

``Trainer.log`` copies ``logs`` into ``state.log_history`` and then calls ``on_log`` on the callbacks in order;
the reporters (TensorBoard, W&B, trackio, MLflow…) come before user callbacks, so keys a user callback adds in
``on_log`` reach neither the reporters nor ``log_history``. The fix is one :class:`RunBus` per trainer, inserted at
index 0 of the callback list: the callbacks publish into it during ``on_step_end`` and the bus merges everything
into the next training log *before* any reporter runs, and into ``log_history[-1]``.

Only training logs get the metrics (:func:`is_training_log`): not an evaluation's log, not the end-of-training
summary.

**The console stays readable.** The callbacks that print each log (transformers' ``ProgressCallback``,
``PrinterCallback``, ``NotebookProgressCallback``) come last in the list; their ``on_log`` is given the log through
:func:`console_logs` (the trainer's own keys and :data:`~hf_perf_callbacks.keys.CONSOLE_KEYS`), while the dict every
other callback receives (the reporters, a user's callbacks) keeps every key. An event is one console line of at most
:data:`~hf_perf_callbacks.keys.CONSOLE_WIDTH` characters (:func:`console_line`; the whole text in the perf log); a
move of the memory wall is said once at INFO (every move is in the perf log); a decision is printed once, when made.

The bus is also the small shared object through which the callbacks talk (the signals below; the run's tuning
session, :attr:`RunBus.tuning`, seen here only as a :class:`TuningLink`), and it writes the run log
``<output_dir>/perf_log.jsonl`` (main process only; records and reader in :mod:`hf_perf_callbacks.runlog`):
one run header per ``train()`` call with the run's ``session`` and the facts the callbacks handed it
(:meth:`RunBus.describe_run`), one step line per optimizer step (at a logging step with every numeric value of the
trainer's own training log as ``log/<key>``: ``log/loss``, ``log/reward``), one line per event and the summaries.
The header is written once every callback has begun (at the first step, or at the first step line or summary);
events from before it wait and follow it. **Each fresh ``train()`` is its own run**: one that starts at step 0 gets
a new session (a resume keeps it), unless a tuning session pins it (:meth:`RunBus.pin_session`: its in-process
re-sizes and resumes are one run).

A run resumed from a checkpoint written without the callbacks (or without any other ``ExportableState`` callback it
now has, such as ``EarlyStoppingCallback``) gets their entries in ``state.stateful_callbacks`` at train begin,
without which transformers' next save raises ``KeyError``
(:func:`~hf_perf_callbacks.adapter.register_stateful_callbacks`).

**One process per ``output_dir``.** While a ``train()`` call runs, the main process holds
``<output_dir>/.hf_perf.lock`` (:class:`OutputDirLock`, a ``filelock.FileLock``: released
by the OS when the process dies): two processes training into one ``output_dir`` would interleave their perf logs and
resume from each other's checkpoints, so a second one is refused with ``OutputDirBusy`` before it writes anything.
The lock is released, and its file removed, when ``train()`` ends, by an error too (the bus wraps the trainer's
``train`` when it joins the trainer; :func:`~hf_perf_callbacks.train_with_tuning` holds it across its in-process
re-sizes). Where the file system cannot hold a lock (read-only, no ``flock``) one warning says so and training goes
on without it, as transformers trains there.

Requests between callbacks are typed methods, not strings: the watchdog asks for a cache clear
(:meth:`RunBus.ask_clear`; a :class:`ClearRequest` handler, the MPSCacheClearer, answers with the bytes freed) and
for a smaller micro-batch (:meth:`RunBus.ask_smaller_batch`; a :class:`ShrinkRequest` handler, the
AdaptiveBatchTuner, answers True when it will re-size the run).
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from filelock import FileLock, Timeout
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from . import adapter
from .keys import CONSOLE_KEYS, CONSOLE_WIDTH
from .runlog import (
    CALLBACK_PREFIXES,
    LOCK_FILE,
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

__all__ = ["RunBus", "OutputDirBusy", "OutputDirLock", "ClearRequest", "ShrinkRequest", "MemoryReading", "bus_for",
           "console_line", "console_logs", "is_training_log", "wrapped"]

if TYPE_CHECKING:
    from .memory import WallFacts

logger = logging.getLogger("hf_perf_callbacks")


class OutputDirBusy(RuntimeError):
    """Another live process is training into the same ``output_dir`` (``holder`` names it: ``pid N on host``)."""

    output_dir: str | None = None
    holder: str | None = None


#: the file beside the lock naming the process that holds it (read by a refused process)
HOLDER_FILE = LOCK_FILE + ".holder"
#: output_dir (real path) → its lock, held by this process (re-entrant within the process)
_HELD: dict[str, Any] = {}            # FileLock objects


class OutputDirLock:
    """This process's hold on one ``output_dir`` (see "One process per ``output_dir``" in the module docstring)."""

    def __init__(self) -> None:
        self.key: str | None = None           # the real path of the output_dir held
        self.output_dir: str | None = None
        self.unlockable: set[str] = set()     # output_dirs warned about: no lock there

    def acquire(self, output_dir: str) -> bool:
        """Hold ``output_dir`` for this process; True when held. Raises :class:`OutputDirBusy` naming the holder
        when another process holds it; a file system that cannot hold the lock is one warning and no lock."""
        key = os.path.realpath(output_dir)
        if key == self.key:
            return True
        self.release()
        if key in _HELD:                      # another trainer of this process holds it: the same process
            self.key, self.output_dir = key, output_dir
            return True
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
                try:
                    os.remove(path)
                except OSError:
                    pass                                    # nothing to tidy
            if key not in self.unlockable:
                self.unlockable.add(key)
                logger.warning("cannot lock %s (%s: %s): training goes on without the one-process-per-output_dir "
                               "check (warned once)", output_dir, type(error).__name__, error)
            return False
        try:
            with open(os.path.join(output_dir, HOLDER_FILE), "w", encoding="utf-8") as f:
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        except OSError:
            pass                                           # the lock holds without the holder's name
        _HELD[key] = lock
        self.key, self.output_dir = key, output_dir
        return True

    def release(self) -> None:
        """Release the hold, removing the lock's files first (while still held, so no other process takes a lock on
        a file about to be removed)."""
        key, output_dir, self.key, self.output_dir = self.key, self.output_dir, None, None
        lock = _HELD.pop(key, None) if key is not None else None
        if lock is None or output_dir is None:
            return
        for name in (HOLDER_FILE, LOCK_FILE):
            try:
                os.remove(os.path.join(output_dir, name))
            except OSError:
                pass                                       # gone already, or not removable: released all the same
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

#: the watchdog asks for a cache clear
SIGNAL_CLEAR = "clear_cache"
#: the watchdog asks for a smaller micro-batch
SIGNAL_SMALLER_BATCH = "smaller_batch"


@dataclass(frozen=True)
class MemoryReading:
    """The watchdog's reading of one optimizer step, handed to the callbacks after it (the tuner's trials judge a
    split's fit by it): the bytes the step used and the budget then."""

    step: int
    used: float
    budget: float


class ClearRequest(Protocol):
    """Answers the watchdog's request for a cache clear with the bytes it freed."""

    def __call__(self, reason: str, step: int) -> float: ...


class ShrinkRequest(Protocol):
    """Answers the watchdog's request for a smaller micro-batch: True when the run will re-size. ``control``: the
    trainer's control of the step it asks at; ``rows``: the next step's fetched micro-batches (asked before it
    trains)."""

    def __call__(self, reason: str, step: int, control: Any = None, rows: list[Any] | None = None) -> bool: ...


class TuningLink(Protocol):
    """What the bus and its readers need of the run's tuning session (the session itself lives a layer up, in
    :mod:`hf_perf_callbacks.resize`, and attaches itself: :meth:`RunBus.attach_tuning`)."""

    @property
    def output_dir(self) -> str: ...

    @property
    def managed(self) -> bool: ...          # train_with_tuning drives the run (it resumes after a re-size)


class RunBus(TrainerCallback):
    """Shared per-trainer hub: metrics for the next log, the perf log and signals between callbacks."""

    def __init__(self):
        self.unlogged: dict[str, float] = {}       # metrics for the next training log
        self.step_line: StepLine | None = None      # this optimizer step's line, written when the next begins
        self.memory: MemoryReading | None = None    # the watchdog's reading of the latest step (None: no watchdog)
        self.handler: CallbackHandler | None = None
        self.output_dir: str | None = None
        self.is_main = True
        self.subscribers: dict[str, list[Callable]] = defaultdict(list)
        self.overhead = 0.0
        self.session = uuid.uuid4().hex[:12]    # on run headers: a fresh run restarts the log
        self.pinned = False                     # a tuning session fixed the session (see pin_session)
        self.trained = False                    # a train() call has begun on this bus
        self.begun = None                       # the TrainerState of the train() call that began last
        self.tuning: TuningLink | None = None       # the tuning session of train_with_tuning or the tuner
        self.standing: dict = {}                # run facts of every train() call of this trainer (see mark_runs)
        self.continuing = False                 # this train() ends for an in-process re-size: the run goes on
        # this train() call's header while it is not written yet; the first call's is opened here, as the bus
        # joins the callback list during the callbacks' on_train_begin and misses its own
        self.header: RunHeader | None = RunHeader(session=self.session)
        self.start_known = False                # the header's resumed_from_step is known
        self.held: list[EventLine] = []         # events waiting for the header
        # the watchdog's facts of the memory wall (what holds memory outside the run, a leak), every step: a stop or
        # a re-size that gives up names them
        self.memory_facts: WallFacts | None = None
        self.writer = LogWriter()
        self.lock = OutputDirLock()
        self.holding = 0                        # train_with_tuning calls holding the lock across their train() calls
        self.watched: set[int] = set()          # ids of the trainers whose train() releases the lock when it ends
        self.own_passes = False                 # the package's own forwards and backwards run (not the run's step)
        self.said: set[tuple[str, str]] = set()    # (source, kind) of the events said on the console
        self.quieted: set[int] = set()          # ids of the console printers given the compact log
        self.calls_held = 0                     # train() calls begun while train_with_tuning holds the lock

    # ------------------------------------------------------------ publishing
    def publish(self, metrics: Mapping[str, float | None]) -> None:
        """Metrics for the next training log (later values of a key replace earlier ones; None and values that are
        not finite numbers are left out)."""
        self.unlogged.update({k: v for k, v in metrics.items() if _finite(v)})

    def withdraw(self, *keys: str) -> None:
        """Take metrics back from the next training log (a value that no longer holds, e.g. a stale forecast)."""
        for key in keys:
            self.unlogged.pop(key, None)

    def record_step(self, step: int, fields: dict) -> None:
        """Fields for this optimizer step's line in ``perf_log.jsonl``."""
        if self.step_line is not None and self.step_line.step != step:
            self.flush()
        if self.step_line is None:
            self.step_line = StepLine(step, round(time.time(), 3))
        self.step_line.values.update({k: v for k, v in fields.items() if v is not None})

    def describe_run(self, source: str, step: int, **facts) -> None:
        """A callback's facts for this ``train()`` call's run header (see :class:`~hf_perf_callbacks.runlog.RunHeader`
        for the names); ``step`` is where the call starts (``state.global_step``)."""
        if self.header is None:                  # the bus missed on_train_begin (not in the callback list)
            self.header, self.start_known = RunHeader(session=self.session), False
        if not self.start_known:
            self.header.resumed_from_step, self.start_known = step, True
        self.header.describe(source, **facts)

    def event(self, source: str, kind: EventKind, message: str, step: int | None = None,
              details: EventDetails | None = None) -> dict:
        """Log an event (warning, action, decision) to the console and the perf log; returns its JSON object.
        ``details``: its fields, through the type of its shape (:data:`~hf_perf_callbacks.runlog.EventDetails`)."""
        entry = EventLine(source, kind, message, step, round(time.time(), 3),
                          details.to_details() if details is not None else {})
        if self.is_main:
            line = console_line(f"[{source}] {message}", EVENT_WIDTH)
            if kind == "decision":                           # printed once, when made, whatever the log level
                self.say(console_line(f"[{source}] {message}", CONSOLE_WIDTH))
                logger.debug("%s", line)
            elif kind in QUIET_ONCE and (source, kind) in self.said:
                logger.debug("%s", line)                     # said once already: the perf log has every one
            else:
                self.said.add((source, kind))
                logger.log(logging.WARNING if kind in LOUD_KINDS else logging.INFO, "%s", line)
            if self.header is not None:
                self.held.append(entry)
            else:
                self._append(entry)
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

    def complete_step(self, args, state, log: Callable[[], object] | None = None) -> None:
        """Write the line of the last optimizer step (``state.global_step``) now: whatever ends a run writes the
        perf line of every step its checkpoint holds. Callbacks that did not see that step's end (a callback before
        them raised in ``on_step_end``) measure it first, from what they measured during the step; ``log`` then
        writes the step's training log if the trainer never did (its values join the line)."""
        from transformers import TrainerControl

        for callback in adapter.all_callbacks(self.handler):
            ended = getattr(callback, "ended_step", None)
            if ended is not None and ended < state.global_step and not callback.disabled:
                callback.on_step_end(args, state, TrainerControl())
        if log is not None:
            log()
        self.flush()

    def _emit(self, record: Record) -> None:
        if self.is_main:
            self._write_header()
            self._append(record)

    def _write_header(self) -> None:
        header, self.header = self.header, None
        if header is None or not self.is_main:
            return
        header.time = round(time.time(), 3)
        self._append(header)
        held, self.held = self.held, []
        for event in held:
            self._append(event)

    def _append(self, record: Record) -> None:
        self.writer.append(self.output_dir, record)

    def add_overhead(self, seconds: float) -> None:
        """Time a callback spent after the step ended (memory sampling, cache clears): not data wait."""
        self.overhead += seconds

    def take_overhead(self) -> float:
        seconds, self.overhead = self.overhead, 0.0
        return seconds

    # ------------------------------------------------------------ requests between callbacks
    def on_clear_request(self, handler: ClearRequest) -> None:
        """``handler`` answers the watchdog's requests for a cache clear (one per callback class)."""
        self._subscribe(SIGNAL_CLEAR, handler)

    def on_smaller_batch_request(self, handler: ShrinkRequest) -> None:
        """``handler`` answers the watchdog's requests for a smaller micro-batch (one per callback class)."""
        self._subscribe(SIGNAL_SMALLER_BATCH, handler)

    def ask_clear(self, reason: str, step: int) -> list[float]:
        """Every cache-clear handler's bytes freed (empty when nobody listens)."""
        return [float(freed) for freed in self._signal(SIGNAL_CLEAR, reason=reason, step=step)]

    def ask_smaller_batch(self, reason: str, step: int, control: Any = None, rows: list[Any] | None = None
                          ) -> list[bool]:
        """Every smaller-batch handler's answer: True when it will re-size the run (empty when nobody listens).
        ``rows``: the next step's fetched micro-batches, when it asks before that step trains."""
        payload: dict[str, Any] = {"reason": reason, "step": step, "control": control}
        if rows is not None:
            payload["rows"] = rows
        return [bool(answer) for answer in self._signal(SIGNAL_SMALLER_BATCH, **payload)]

    def can_shrink(self) -> bool:
        """Whether something answers requests for a smaller micro-batch."""
        return self._has_subscribers(SIGNAL_SMALLER_BATCH)

    def _subscribe(self, signal: str, handler: Callable[..., object]) -> None:
        """Subscribe a bound method; it replaces an earlier subscriber of the same class (a resumed instance)."""
        owner = type(getattr(handler, "__self__", None))
        self.subscribers[signal] = [h for h in self.subscribers[signal]
                                    if type(getattr(h, "__self__", None)) is not owner or owner is type(None)]
        self.subscribers[signal].append(handler)

    def _signal(self, signal: str, **payload: Any) -> list[Any]:
        """Call every subscriber of ``signal``; returns their answers (empty when nobody listens).

        A subscriber that raises is dropped with one warning: it must not take the caller down with it.
        """
        answers = []
        for handler in list(self.subscribers[signal]):
            if getattr(getattr(handler, "__self__", None), "disabled", False):
                continue
            try:
                answers.append(handler(**payload))
            except Exception as error:  # noqa: BLE001
                self.subscribers[signal].remove(handler)
                logger.warning("subscriber %s of '%s' failed (%s: %s) and was removed", handler, signal,
                               type(error).__name__, error)
        return answers

    def _has_subscribers(self, signal: str) -> bool:
        return any(not getattr(getattr(h, "__self__", None), "disabled", False) for h in self.subscribers[signal])

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
        if bars:
            bars[0].write(text)
        else:
            print(text, flush=True)

    def _compact_console(self) -> None:
        """Give the console printers of the trainer the compact log (see "The console stays readable" above)."""
        for printer in adapter.console_printers(self.handler):
            if id(printer) in self.quieted:
                continue
            self.quieted.add(id(printer))

            def make(original):
                def on_log(args, state, control, logs=None, **kwargs):
                    return original(args, state, control,
                                    logs=console_logs(logs) if isinstance(logs, Mapping) else logs, **kwargs)
                return on_log

            adapter.replace_method(printer, "on_log", make)

    # ------------------------------------------------------------ the output_dir lock
    def watch_trainer(self, trainer) -> None:
        """Release the output-dir lock whenever ``trainer.train()`` ends, by an error too (its ``train`` wrapped
        once)."""
        if trainer is None or id(trainer) in self.watched:
            return
        self.watched.add(id(trainer))

        def make(original):
            def train(*args, **kwargs):
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

    # ------------------------------------------------------------ what the callbacks tell the bus
    def attach_tuning(self, tuning: TuningLink) -> None:
        """The run's tuning session (one per ``train_with_tuning`` call, or the tuner's own)."""
        self.tuning = tuning

    def continue_run(self, continuing: bool) -> None:
        """Whether this ``train()`` call ends for an in-process re-size (the run goes on: no end-of-run output,
        the lock stays held)."""
        self.continuing = continuing

    def bind(self, args, state) -> None:
        """Follow the trainer's ``output_dir`` and whether this is the main process (at every callback event)."""
        self.output_dir, self.is_main = args.output_dir, state.is_world_process_zero

    def note_memory_facts(self, facts: WallFacts | None) -> None:
        """The watchdog's latest facts of the memory wall (a stop or a re-size that gives up names them)."""
        self.memory_facts = facts

    # ------------------------------------------------------------ trainer events
    def mark_runs(self, **facts) -> None:
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

    def on_train_begin(self, args, state, control, **kwargs):
        """A ``train()`` call begins: once per call, whether the bus is in the callback list already or joins it
        during this event (a callback added after the trainer's init calls it then, see ``base``)."""
        if self.begun is state:
            return
        self.begun = state
        if self.trained and not self.pinned and state.global_step == 0:
            self.session = uuid.uuid4().hex[:12]          # a fresh run of the same trainer: a run of its own
        self.trained = True
        self.continuing = False
        self.output_dir = args.output_dir
        self.is_main = state.is_world_process_zero
        if self.is_main and args.output_dir:
            self.lock.acquire(args.output_dir)         # another live process in this output_dir: a clear error
        self.unlogged.clear()
        if self.step_line is not None:
            self.flush()
        self.header = RunHeader(session=self.session, resumed_from_step=state.global_step)   # replaces an unused one
        if self.standing:
            self.header.describe("bus", **self.standing)
        if self.holding:                                # train_with_tuning's later calls re-size, not resume
            self.calls_held += 1
            if self.calls_held > 1:
                self.header.describe("bus", resize=True)
        self.start_known = True
        self._register_stateful(state, control)
        self._compact_console()      # the whole list is the handler's now (the meter's clocks dispatch other events
                                     # to one callback at a time)

    def on_step_begin(self, args, state, control, **kwargs):
        self.flush()                             # every callback has begun: the header goes out now at the latest

    def _register_stateful(self, state, control) -> None:
        """A resume that attached stateful callbacks the checkpoint was written without must still save."""
        if self.handler is not None:
            adapter.register_stateful_callbacks(state, self.handler.callbacks + [control])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._compact_console()
        if logs is None or not is_training_log(logs):
            return
        if self.step_line is not None and self.step_line.step == state.global_step:   # the step's line is pending
            self.record_step(state.global_step, {TRAINER_LOG + k: v for k, v in logs.items()
                                                 if _finite(v) and not k.startswith(CALLBACK_PREFIXES)})
        if not self.unlogged:
            return
        logs.update(self.unlogged)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.unlogged)
        self.unlogged = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.flush()
        if not self.continuing and not self.holding:
            self.lock.release()


#: event kinds said at WARNING on the console (the others at INFO)
LOUD_KINDS: tuple[EventKind, ...] = ("warning", "action", "stop")
#: event kinds said once on the console (INFO; the later ones at DEBUG): a move of the memory wall needs no action
QUIET_ONCE: tuple[EventKind, ...] = ("wall",)
#: the widest "[source] message" of an event: room for a logging prefix (``WARNING hf_perf_callbacks.train: ``)
EVENT_WIDTH = CONSOLE_WIDTH - 36


def console_logs(logs: Mapping) -> dict:
    """A training log as the console shows it: the trainer's own values and the callbacks' headline keys
    (:data:`~hf_perf_callbacks.keys.CONSOLE_KEYS`), not each of their few dozen keys."""
    return {key: value for key, value in logs.items()
            if key in CONSOLE_KEYS or not (isinstance(key, str) and key.startswith(CALLBACK_PREFIXES))}


def console_line(text: str, width: int = CONSOLE_WIDTH) -> str:
    """``text`` as one console line of at most ``width`` characters: its first line, cut at the last clause boundary
    (``: ``, ``; ``, ``. ``, `` (``, ``, ``) that fits, or at a space, and ended by `` …`` when cut."""
    lines = text.strip().splitlines() or [""]
    first = lines[0].rstrip()
    if len(first) <= width and len(lines) == 1:
        return first
    room = width - 2
    if len(first) <= room:
        return first + " …"
    head = first[:room]
    cut = max(head.rfind(mark) for mark in (": ", "; ", ". ", " (", ", "))
    if cut < width // 2:
        cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else head).rstrip(" :;,.(") + " …"


def wrapped(line: str, width: int = CONSOLE_WIDTH) -> str:
    """``line`` as lines of at most ``width`` characters, broken after its clauses (``; ``, ``, ``, a space) and
    continued with an indent; nothing is left out."""
    out, indent = [], "    "
    rest = line.rstrip()
    while len(rest) > width:
        head = rest[:width]
        cut = max(head.rfind("; "), head.rfind(", "))
        cut = cut + 1 if cut > width // 3 else head.rfind(" ")
        if cut <= len(indent):
            cut = width
        out.append(rest[:cut].rstrip())
        rest = indent + rest[cut:].lstrip()
    out.append(rest)
    return "\n".join(out)


def bus_for(handler: CallbackHandler) -> RunBus:
    """The trainer's bus, created and put first in its callback list on first use."""
    for cb in handler.callbacks:
        if isinstance(cb, RunBus):
            bus = cb
            break
    else:
        bus = RunBus()
    if handler.callbacks[:1] != [bus]:
        # A new list, not an in-place insert: the handler may be iterating over the old one right now.
        handler.callbacks = [bus] + [cb for cb in handler.callbacks if cb is not bus]
    bus.handler = handler
    bus.watch_trainer(adapter.calling_trainer())      # at the trainer's init (or its train()): found on the stack
    return bus


#: the keys only the end-of-training log carries all of (transformers 5.23-5.24 ``Trainer._finalize_training``:
#: ``speed_metrics("train", ...)``, ``total_flos``, ``train_loss``)
END_OF_TRAINING_KEYS = frozenset({"train_runtime", "total_flos", "train_loss"})


def is_training_log(logs: dict) -> bool:
    """A log of training steps (``Trainer._maybe_log_save_evaluate``), not an evaluation's or the end-of-training
    summary.

    * An evaluation log (``Trainer.evaluate``/``predict``; TRL's trainers add their evaluation metrics to it) holds
      ``<prefix>_runtime`` for its metric prefix (``eval``, ``eval_<dataset>``, ``test``, any ``metric_key_prefix``)
      or keys starting with ``eval_`` or ``test_``.
    * The end-of-training summary holds every key of :data:`END_OF_TRAINING_KEYS`.
    * A training log may hold ``train_runtime`` and ``train_tokens_per_second``: transformers adds them to every log
      while ``include_num_input_tokens_seen`` is on, so neither key alone tells a summary.
    """
    if END_OF_TRAINING_KEYS <= logs.keys():
        return False
    return not any(k.startswith(("eval_", "test_")) or (k.endswith("_runtime") and k != "train_runtime")
                   for k in logs)


def _finite(value) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
