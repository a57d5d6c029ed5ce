"""How the callbacks' metrics reach every reporter, ``log_history``, the console and ``perf_log.jsonl``.

``Trainer.log`` copies ``logs`` into ``state.log_history`` and then calls ``on_log`` on the callbacks in order;
the reporters (TensorBoard, W&B, trackio, MLflow…) come before user callbacks, so keys a user callback adds in
``on_log`` reach neither the reporters nor ``log_history``. The fix is one :class:`RunBus` per trainer, inserted at
index 0 of the callback list: the callbacks publish into it during ``on_step_end`` and the bus merges everything
into the next training log *before* any reporter runs, and into ``log_history[-1]``.

The bus is also the small shared object through which the callbacks talk (signals such as "clear the cache now"
or "use a smaller micro-batch"), and it writes the per-run ``<output_dir>/perf_log.jsonl`` (main process only):
one ``{"type": "step", ...}`` object per optimizer step and one ``{"type": "event", ...}`` per event. The log is
appended to, across resumes and re-sizes; run headers carry the bus's ``session`` so that a reader can tell a
fresh run in a reused ``output_dir`` (a new session starting at step 0) from a resume.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from . import adapter

logger = logging.getLogger("hf_perf_callbacks")

PERF_LOG = "perf_log.jsonl"


class RunBus(TrainerCallback):
    """Shared per-trainer hub: pending metrics, the perf log and signals between callbacks."""

    def __init__(self):
        self.pending: dict[str, float] = {}
        self.record: dict = {}
        self.handler: CallbackHandler | None = None
        self.output_dir: str | None = None
        self.is_main = True
        self.subscribers: dict[str, list[Callable]] = defaultdict(list)
        self.overhead = 0.0
        self.session = uuid.uuid4().hex[:12]    # stamped on run headers: a new process's fresh run restarts the log

    # ------------------------------------------------------------ publishing
    def publish(self, metrics: dict[str, float]) -> None:
        """Metrics for the next training log (later values of a key replace earlier ones)."""
        self.pending.update({k: v for k, v in metrics.items() if _finite(v)})

    def record_step(self, step: int, fields: dict) -> None:
        """Fields for this optimizer step's line in ``perf_log.jsonl``."""
        if self.record and self.record.get("step") != step:
            self.flush()
        if not self.record:
            self.record = {"type": "step", "step": step, "time": round(time.time(), 3)}
        self.record.update({k: v for k, v in fields.items() if v is not None})

    def event(self, source: str, kind: str, message: str, step: int | None = None, **fields) -> dict:
        """Log an event (warning, action, decision) to the console and the perf log; returns it."""
        entry = {"type": "event", "source": source, "kind": kind, "step": step, "message": message, **fields}
        entry["time"] = round(time.time(), 3)
        if self.is_main:
            (logger.warning if kind in ("warning", "action", "stop") else logger.info)("[%s] %s", source, message)
            self._write(entry)
        return entry

    def write(self, entry: dict) -> None:
        """Write any other JSON object (run header, summary) to the perf log; run headers get this bus's session."""
        if self.is_main:
            self._write({**entry, "session": self.session} if entry.get("type") == "run" else entry)

    def flush(self) -> None:
        if self.record and self.is_main:
            self._write(self.record)
        self.record = {}

    def _write(self, entry: dict) -> None:
        if not self.output_dir or self.output_dir == getattr(self, "unwritable", None):
            return
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, PERF_LOG), "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, default=_jsonable) + "\n")
        except OSError as e:  # a full disk must not stop training; said once, not at every step
            logger.warning("could not write %s: %s (the perf log is off for this output_dir)", PERF_LOG, e)
            self.unwritable = self.output_dir

    def add_overhead(self, seconds: float) -> None:
        """Time a callback spent after the step ended (memory sampling, cache clears): not data wait."""
        self.overhead += seconds

    def take_overhead(self) -> float:
        seconds, self.overhead = self.overhead, 0.0
        return seconds

    # ------------------------------------------------------------ signals
    def subscribe(self, signal: str, handler: Callable[..., object]) -> None:
        """Subscribe a bound method; it replaces an earlier subscriber of the same class (a resumed instance)."""
        owner = type(getattr(handler, "__self__", None))
        self.subscribers[signal] = [h for h in self.subscribers[signal]
                                    if type(getattr(h, "__self__", None)) is not owner or owner is type(None)]
        self.subscribers[signal].append(handler)

    def signal(self, signal: str, **payload) -> list:
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

    def has_subscribers(self, signal: str) -> bool:
        return any(not getattr(getattr(h, "__self__", None), "disabled", False) for h in self.subscribers[signal])

    def show_progress(self, text: str) -> None:
        """Show ``text`` beside the tqdm progress bar, when there is one."""
        for bar in adapter.progress_bars(self.handler):
            bar.set_postfix_str(text, refresh=False)

    # ------------------------------------------------------------ trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        self.output_dir = args.output_dir
        self.is_main = state.is_world_process_zero
        self.pending.clear()

    def on_step_begin(self, args, state, control, **kwargs):
        self.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self.pending or _is_eval_log(logs):
            return
        logs.update(self.pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.pending)
        self.pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.flush()


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
    return bus


def _is_eval_log(logs: dict) -> bool:
    return any(k.startswith(("eval_", "test_")) for k in logs) or "train_runtime" in logs


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)
