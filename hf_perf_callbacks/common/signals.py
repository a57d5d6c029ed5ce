"""Requests between callbacks, as typed handlers: the watchdog asks for a cache clear (a :class:`ClearRequest`
handler, the MPSCacheClearer, answers with the bytes freed) and for a smaller micro-batch (a :class:`ShrinkRequest`
handler, the AdaptiveBatchTuner, answers True when it will re-size the run).

A handler is a bound method; a later one of the same class replaces it (a resumed instance). A handler whose
callback is disabled is not asked; one that raises is dropped with one warning: it must not take the caller down.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["ClearRequest", "ShrinkRequest", "Requests"]

logger = logging.getLogger("hf_perf_callbacks")


class ClearRequest(Protocol):
    """Answers the watchdog's request for a cache clear with the bytes it freed."""

    def __call__(self, reason: str, step: int) -> float: ...


class ShrinkRequest(Protocol):
    """Answers the watchdog's request for a smaller micro-batch: True when the run will re-size. ``control``: the
    trainer's control of the step it asks at; ``rows``: the next step's fetched micro-batches (asked before it
    trains)."""

    def __call__(self, reason: str, step: int, control: Any = None, rows: list[Any] | None = None) -> bool: ...


H = TypeVar("H", bound=Callable[..., object])
A = TypeVar("A")


def _live(handler: object) -> bool:
    return not getattr(getattr(handler, "__self__", None), "disabled", False)


def _replace(handlers: list[H], handler: H) -> list[H]:
    """``handlers`` with ``handler`` last, an earlier one of the same class dropped (a resumed instance)."""
    owner = type(getattr(handler, "__self__", None))
    kept = [h for h in handlers if type(getattr(h, "__self__", None)) is not owner or owner is type(None)]
    return [*kept, handler]


class Requests:
    """The handlers of one trainer's requests between callbacks."""

    def __init__(self) -> None:
        self.clearers: list[ClearRequest] = []
        self.shrinkers: list[ShrinkRequest] = []

    def on_clear_request(self, handler: ClearRequest) -> None:
        """``handler`` answers the watchdog's requests for a cache clear (one per callback class)."""
        self.clearers = _replace(self.clearers, handler)

    def on_smaller_batch_request(self, handler: ShrinkRequest) -> None:
        """``handler`` answers the watchdog's requests for a smaller micro-batch (one per callback class)."""
        self.shrinkers = _replace(self.shrinkers, handler)

    def ask_clear(self, reason: str, step: int) -> list[float]:
        """Every cache-clear handler's bytes freed (empty when nobody listens)."""
        return _ask(self.clearers, "clear_cache", lambda handler: float(handler(reason=reason, step=step)))

    def ask_smaller_batch(self, reason: str, step: int, control: Any = None, rows: list[Any] | None = None
                          ) -> list[bool]:
        """Every smaller-batch handler's answer: True when it will re-size the run (empty when nobody listens).
        ``rows``: the next step's fetched micro-batches, when it asks before that step trains."""
        return _ask(self.shrinkers, "smaller_batch",
                    lambda handler: bool(handler(reason=reason, step=step, control=control, rows=rows)))

    def can_shrink(self) -> bool:
        """Whether something answers requests for a smaller micro-batch."""
        return any(_live(h) for h in self.shrinkers)


def _ask(handlers: list[H], request: str, ask: Callable[[H], A]) -> list[A]:
    """``ask(handler)`` of every live handler; one that raises is removed from ``handlers`` with one warning."""
    answers: list[A] = []
    for handler in list(handlers):
        if not _live(handler):
            continue
        try:
            answers.append(ask(handler))
        except Exception as error:  # noqa: BLE001
            handlers.remove(handler)
            logger.warning("subscriber %s of '%s' failed (%s: %s) and was removed", handler, request,
                           type(error).__name__, error)
    return answers
