"""One :class:`RunBus` per trainer: the object that holds the parts the callbacks share, first in its callback list.

The bus is inserted at index 0 of the trainer's callback list (:func:`bus_for`), so that on each trainer event it
acts before every reporter and every user callback; it hands each event to the part whose job it is and holds the
facts the callbacks hand one another as typed fields. The parts, one job each:

====================  ========================================  ==================================================
field                 part                                      job
====================  ========================================  ==================================================
``merger``            :class:`~.merger.MetricsMerger`           the callbacks' metrics into the next training log
``log``               :class:`~.perflog.PerfLog`                ``perf_log.jsonl``: run headers, step lines, events
``console``           :class:`~.console.Console`                the compact console log, event lines, progress text
``output_lock``       :class:`~.outputdir.OutputDirHold`        one process per ``output_dir``
``requests``          :class:`~.signals.Requests`               the watchdog's requests (cache clear, smaller batch)
``exchange``          :class:`~.exchange.StepExchange`          one cross-rank exchange per optimizer step
``memory``            :class:`MemoryReading`                    the watchdog's reading of the latest step
``memory_facts``      :class:`~.memory.WallFacts`               what sets the memory wall now (a stop names it)
``tuning``            :class:`TuningLink`                       the run's tuning session
``continuing``        bool                                      this ``train()`` ends for an in-process re-size
``own_passes``        bool                                      the package's own forwards and backwards run
                                                                (:meth:`RunBus.own_work`)
``overhead``          float                                     the callbacks' own seconds since the step ended
====================  ========================================  ==================================================

Callers reach a part through its field (``bus.log.event(...)``, ``bus.merger.publish(...)``): the bus adds no
methods of its own in front of them.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from transformers import TrainerCallback, TrainerControl
from transformers.trainer_callback import CallbackHandler

from ..platform import adapter
from .console import Console
from .exchange import StepExchange
from .merger import MetricsMerger, is_training_log
from .outputdir import OutputDirHold
from .perflog import PerfLog
from .signals import Requests

__all__ = ["RunBus", "MemoryReading", "bus_for", "TuningLink"]

if TYPE_CHECKING:
    from ..core.memory import WallFacts

logger = logging.getLogger("hf_perf_callbacks")


@dataclass(frozen=True)
class MemoryReading:
    """The watchdog's reading of one optimizer step, handed to the callbacks after it (the tuner's trials judge a
    split's fit by it): the bytes the step used and the budget then."""

    step: int
    used: float
    budget: float


class TuningLink(Protocol):
    """What the bus and its readers need of the run's executor (it lives a layer up, in
    :mod:`hf_perf_callbacks.resize`, and sets itself as the bus's ``tuning``)."""

    @property
    def output_dir(self) -> str: ...

    @property
    def managed(self) -> bool: ...          # train_with_tuning drives the run (it resumes after a re-size)


class RunBus(TrainerCallback):
    """Holds one trainer's shared parts and facts (see the module docstring) and hands them the trainer's events."""

    def __init__(self) -> None:
        self.merger = MetricsMerger()
        self.console = Console()
        self.log = PerfLog(self.console)
        self.output_lock = OutputDirHold()
        self.requests = Requests()
        self.exchange = StepExchange()
        self.memory: MemoryReading | None = None    # None: no watchdog
        self.memory_facts: WallFacts | None = None
        self.tuning: TuningLink | None = None       # the tuning session of train_with_tuning or the tuner
        self.continuing = False                 # this train() ends for an in-process re-size: the run goes on
        self.own_passes = False                 # the package's own forwards and backwards run (not the run's step)
        self.own_work_clocks: list[Callable[[bool], None]] = []    # told when that work begins (True) and ends
        self.overhead = 0.0                     # seconds the callbacks spent after the step ended: not data wait
        self.begun: object = None               # the TrainerState of the train() call that began last

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """The package's own forwards and backwards run inside a step (the check of a change): the meter counts none
        of them (``own_passes``) and books their seconds as the package's own (``own_work_clocks``)."""
        self.own_passes = True
        for clock in list(self.own_work_clocks):
            clock(True)
        try:
            yield
        finally:
            self.own_passes = False
            for clock in list(self.own_work_clocks):
                clock(False)

    def take_overhead(self) -> float:
        """The callbacks' own seconds since the last take (the meter's, at each step's begin)."""
        seconds, self.overhead = self.overhead, 0.0
        return seconds

    # ------------------------------------------------------------ what the callbacks tell the bus
    def bind(self, args: Any, state: Any) -> None:
        """Follow the trainer's ``output_dir`` and whether this is the main process (at every callback event)."""
        self.log.output_dir, self.log.is_main = args.output_dir, state.is_world_process_zero

    def complete_step(self, args: Any, state: Any, log: Callable[[], object] | None = None) -> None:
        """Write the line of the last optimizer step (``state.global_step``) now: whatever ends a run writes the
        perf line of every step its checkpoint holds. Callbacks that did not see that step's end (a callback before
        them raised in ``on_step_end``) measure it first, from what they measured during the step; ``log`` then
        writes the step's training log if the trainer never did (its values join the line)."""
        for callback in adapter.all_callbacks(self.console.handler):
            ended = getattr(callback, "ended_step", None)
            if ended is not None and ended < state.global_step and not callback.disabled:
                callback.on_step_end(args, state, TrainerControl())
        if log is not None:
            log()
        self.log.flush()

    # ------------------------------------------------------------ trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A ``train()`` call begins: once per call, whether the bus is in the callback list already or joins it
        during this event (a callback added after the trainer's init calls it then, see ``base``)."""
        if self.begun is state:
            return
        self.begun = state
        self.continuing = False
        self.bind(args, state)
        resize = self.output_lock.call_begins(args.output_dir, self.log.is_main)   # another live process: an error
        self.merger.unlogged.clear()
        self.log.open_header(state.global_step, resize)   # train_with_tuning's later calls re-size, not resume
        handler = self.console.handler
        if handler is not None:     # a resume that attached stateful callbacks its checkpoint lacks still saves
            adapter.register_stateful_callbacks(state, handler.callbacks + [control])
        self.console.compact()      # the whole list is the handler's now (the meter's clocks dispatch other events
                                    # to one callback at a time)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.log.flush()                         # every callback has begun: the header goes out now at the latest

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        self.console.compact()
        if logs is None or not is_training_log(logs):
            return
        self.log.record_training_log(state.global_step, logs)
        self.merger.merge(logs, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.log.flush()
        self.output_lock.call_ends(self.continuing)


def bus_for(handler: CallbackHandler) -> RunBus:
    """The trainer's bus, created and put first in its callback list on first use."""
    bus = next((cb for cb in handler.callbacks if isinstance(cb, RunBus)), None) or RunBus()
    if handler.callbacks[:1] != [bus]:
        # A new list, not an in-place insert: the handler may be iterating over the old one right now.
        handler.callbacks = [bus] + [cb for cb in handler.callbacks if cb is not bus]
    bus.console.handler = handler
    bus.output_lock.watch_trainer(adapter.calling_trainer())  # at the trainer's init (or its train())
    return bus
