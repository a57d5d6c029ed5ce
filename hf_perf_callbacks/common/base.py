"""What every callback of the package shares: fault isolation, the bus, and resume-safe state.

* **Own time is not data wait.** The time of every event between an optimizer step's end and the next one's begin
  goes to the bus as overhead, which the meter takes out of the data-wait phase.
* **One exchange per step.** The callbacks that agree across ranks at a step's end contribute to the bus's one
  exchange of the step (:meth:`PerfCallback._exchange`, :mod:`hf_perf_callbacks.common.exchange`).
* **Faults stay inside.** Every ``on_*`` event of a subclass wears the shell :func:`hook` (a subclass defining an
  undecorated one is refused at its definition): an exception disables that callback with one warning and training
  goes on; under several ranks it still joins its per-step exchange with neutral values, so no rank is left waiting.
  The shell also joins the callback to the trainer's :class:`~hf_perf_callbacks.common.bus.RunBus`.
* **Arguments.** A callback's constructor wears the shell :func:`arguments`: a bad argument is a ``ValueError``
  naming the class and the key.
* **Resume.** State is exported through ``ExportableState`` and read back from ``trainer_state.json`` at
  ``on_train_begin`` of a resumed run, whether or not ``restore_callback_states_from_checkpoint`` is set. A
  callback keeps its settings as attributes named like its constructor's arguments (as transformers' own callbacks
  do); ``state()["args"]`` is derived from them, so transformers can rebuild an equal instance.
* **One clock.** Every time a callback reads comes from its :class:`Clock` (wall and process CPU seconds), given
  to its constructor (``clock=``); tests pass a planted one instead of sleeping.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.runlog import WarningFigures
from ..core.validation import UnknownKeyword, check_keywords
from ..platform.adapter import calling_handler
from ..platform.device import gather_floats, world_size
from .bus import RunBus, bus_for
from .exchange import Rows

logger = logging.getLogger("hf_perf_callbacks")


#: events between one optimizer step's end and the next one's begin: the time spent in them is the callbacks' own
#: work (memory sampling, cache clears, exchanges), which the meter must not count as waiting for data
BETWEEN_STEPS = ("on_step_end", "on_log", "on_save", "on_evaluate")


class Clock:
    """Wall seconds (:func:`time.perf_counter`) and the process's CPU seconds, all threads (:func:`time.process_time`);
    a test passes a subclass whose planted costs a loaded machine cannot shrink (see the module docstring)."""

    def wall(self) -> float:
        return time.perf_counter()

    def cpu(self) -> float:
        return time.process_time()


SYSTEM_CLOCK = Clock()


#: the attribute :func:`hook` sets on the methods it wraps
HOOK_MARK = "__perf_hook__"


def hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """The shell of a trainer event (an ``on_*`` method) of a :class:`PerfCallback`, written at each hook:

    1. a disabled callback does nothing (at ``on_step_end`` it still joins the step's cross-rank exchange, also for
       a step number an earlier ``train()`` call of the run has seen);
    2. the callback joins the trainer's bus (at ``on_init_end``, ``on_train_begin`` or its first event), the bus sees
       the ``train()`` call begin, and follows the trainer's ``output_dir``;
    3. at ``on_train_begin``: a resumed run restores the exported state, a fresh run of the same instance starts
       over (:meth:`PerfCallback.start_fresh`);
    4. the event's own time between steps goes to the bus as overhead (not data wait);
    5. an exception disables the callback with one warning (its ``close()`` removes any hooks): training goes on.
    """
    name = method.__name__
    if not name.startswith("on_"):
        raise TypeError(f"@hook decorates a trainer event (on_*), not {name}")

    @functools.wraps(method)
    def guarded(self: PerfCallback, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if name == "on_train_begin":
            self.collective_step = -1    # a new call may replay a step number (a rewind): it joins that step again
        if self.disabled:
            if name == "on_step_end":
                self._stand_in(state)
            return None
        try:
            if name in ("on_init_end", "on_train_begin") or self.bus is None:
                self._attach()
            bus = self._bus
            bus.bind(args, state)
            if name == "on_train_begin":
                bus.on_train_begin(args, state, control)          # once per call, also when it joined just now
                if state.global_step > 0:
                    self._restore_from(state)
                elif self.began:                 # a fresh run of the same trainer: a run of its own
                    self.start_fresh()
                self.began = True
                self.ended_step = state.global_step
            started = self.clock.wall()
            try:
                return method(self, args, state, control, **kwargs)
            finally:
                if name == "on_step_end":
                    self.ended_step = state.global_step
                if name in BETWEEN_STEPS:
                    bus.overhead += self.clock.wall() - started
        except Exception as error:  # noqa: BLE001 - a callback must never take training down
            self._disable(name, error)
            if name == "on_step_end":
                try:
                    self._stand_in(state)
                except Exception:  # noqa: BLE001
                    pass
            return None

    setattr(guarded, HOOK_MARK, True)
    return guarded


class ArgumentError(ValueError):
    """A callback constructor's bad argument, naming the class and the key (a ``ValueError``)."""


class UnknownArgument(ArgumentError, UnknownKeyword):
    """A keyword a callback's constructor does not take, with the closest one it does (also a ``TypeError``)."""


def arguments(init: Callable[..., None]) -> Callable[..., None]:
    """The shell of a callback's constructor, written at its ``__init__``: a bad argument raises a ``ValueError``
    naming the class and the key (an unknown keyword too, with the closest one it takes: also a ``TypeError``)."""
    owner = init.__qualname__.split(".")[-2]
    parameters = inspect.signature(init).parameters
    keywords = [p for p in parameters if p != "self"]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not open_ended:
            try:
                check_keywords(owner, kwargs, keywords)
            except UnknownKeyword as error:
                raise UnknownArgument(str(error)) from None
        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError) as error:
            if isinstance(error, ArgumentError):        # an inner constructor (super().__init__) named it already
                raise
            raise ArgumentError(f"{owner}: {error} (allowed keywords: {', '.join(keywords)})") from None

    return __init__


T = TypeVar("T")


class Made(Generic[T]):
    """A callback's attribute that one of its events makes (``_run: Made[Run] = Made("run")`` reads ``self.run``):
    read before then, a RuntimeError names the callback, the attribute and the event."""

    def __init__(self, attribute: str, event: str = "on_train_begin") -> None:
        self.attribute, self.event = attribute, event

    def __get__(self, callback: Any, owner: type | None = None) -> T:
        value = getattr(callback, self.attribute)
        if value is None:
            raise RuntimeError(f"{type(callback).__name__} has no {self.attribute} yet: it gets one at {self.event}")
        return value  # type: ignore[no-any-return]


class PerfCallback(TrainerCallback, ExportableState):
    """Base class of the package's callbacks."""

    source = "perf"
    exchange_width = 0                   # floats this callback gathers across ranks once per optimizer step

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bare = [name for name, value in vars(cls).items()
                if name.startswith("on_") and callable(value) and not getattr(value, HOOK_MARK, False)]
        if bare:
            raise TypeError(f"{cls.__name__}.{bare[0]} is a trainer event of a PerfCallback: decorate it with "
                            f"@hook (hf_perf_callbacks.common.base.hook), which isolates its faults and joins the bus")

    def __init__(self, clock: Clock | None = None):
        if clock is not None and not isinstance(clock, Clock):
            raise ValueError(f"clock={clock!r} is not allowed: expected a hf_perf_callbacks.common.base.Clock "
                             f"(or None)")
        self.clock = clock or SYSTEM_CLOCK
        self.began = False                       # a train() call has begun with this callback
        self.disabled = False
        self.bus: RunBus | None = None
        self.collective_step = -1        # the last optimizer step whose cross-rank exchange this rank joined
        self.ended_step: int | None = None   # the last optimizer step whose on_step_end this callback ran

    #: the trainer's bus, which every ``on_*`` event attaches before its body runs (:func:`hook`)
    _bus: Made[RunBus] = Made("bus", "its first trainer event")

    @hook
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Join the trainer's bus at its init, so that the bus sees the first ``train()`` begin."""

    def _disable(self, name: str, error: Exception) -> None:
        """Disable this callback after its own fault in ``name``: one warning, its hooks removed; training goes on."""
        self.disabled = True
        logger.warning("%s disabled after an internal error in %s: %s: %s. Training continues without it.",
                       type(self).__name__, name, type(error).__name__, error, exc_info=True)
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def _exchange_device(self) -> Any:
        return getattr(getattr(self, "device", None), "device", None)

    def _exchange(self, step: int, values: list[float], finish: Callable[[Rows], None]) -> None:
        """Join ``step``'s one cross-rank exchange (:class:`~hf_perf_callbacks.common.exchange.StepExchange`) with
        ``values`` (:attr:`exchange_width` floats); ``finish(rows)`` runs with every rank's values once every callback
        of the trainer has contributed (at once on one process). A fault in ``finish`` disables this callback."""
        self.collective_step = step

        def guarded(rows: Rows) -> None:
            if self.disabled:
                return
            try:
                finish(rows)
            except Exception as error:  # noqa: BLE001 - a callback must never take training down
                self._disable("on_step_end", error)

        self._bus.exchange.contribute(self, step, values, guarded, self._bus.console.handler, self._exchange_device())

    def neutral_exchange(self, step: int) -> None:
        """Join ``step``'s cross-rank exchange with zeros (a rank that has nothing to report)."""
        if not self.exchange_width:
            return
        if self.bus is None:                             # never attached: an exchange of its own
            gather_floats([0.0] * self.exchange_width, self._exchange_device())
            return
        self.bus.exchange.contribute(self, step, [0.0] * self.exchange_width, None, self.bus.console.handler,
                                     self._exchange_device())

    def _stand_in(self, state: Any) -> None:
        """A disabled (or failed) callback still joins the step's exchange, so the other ranks do not wait forever."""
        if world_size() > 1 and self.collective_step != state.global_step:
            self.collective_step = state.global_step
            self.neutral_exchange(state.global_step)

    def _attach(self) -> None:
        handler = calling_handler()
        if handler is not None:
            self.bus = bus_for(handler)
        elif self.bus is None:
            self.bus = RunBus()
            logger.warning("%s could not find the trainer's callback handler: its metrics reach the console and "
                           "log_history but not the reporters", type(self).__name__)

    # ------------------------------------------------------------ state
    def settings(self) -> dict[str, Any]:
        """The constructor's arguments as this instance holds them (attributes of the same names; the clock is not
        a setting)."""
        names = [n for n in inspect.signature(type(self).__init__).parameters if n not in ("self", "clock")]
        return {name: getattr(self, name) for name in names}

    def state(self) -> dict[str, Any]:
        return {"args": self.settings(), "attributes": {"saved": self.export()}}

    def export(self) -> dict[str, Any]:
        """JSON-serialisable counters that must survive a resume (override)."""
        return {}

    def load(self, saved: dict[str, Any]) -> None:
        """Restore what :meth:`export` returned (override)."""

    def start_fresh(self) -> None:
        """Forget what earlier runs of this instance counted: a ``train()`` from step 0 is a run of its own
        (override; a resume keeps accumulating)."""

    def _restore_from(self, state: Any) -> None:
        entry = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(entry, list):  # two instances of one class: transformers keeps a list
            entry = entry[0]
        saved = (entry or {}).get("attributes", {}).get("saved") if isinstance(entry, dict) else None
        if saved:
            self.load(saved)

    def close(self) -> None:
        """Undo anything attached to the model (hooks, wrappers); called when disabled or at train end."""

    def warn(self, message: str, step: int | None = None, figures: WarningFigures | None = None) -> None:
        self._bus.log.event(self.source, "warning", message, step=step, details=figures)
