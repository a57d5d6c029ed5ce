"""One cross-rank exchange per optimizer step: every callback's values of the step, gathered with one collective.

A callback that compares or agrees across ranks at its step end (the meter's tokens and training seconds, the
watchdog's decision) contributes its values (:attr:`~hf_perf_callbacks.common.base.PerfCallback.exchange_width` floats)
with the work that needs every rank's values (``finish``). Once every such callback of the trainer has contributed
to the step, one ``all_gather`` carries all of them (in callback-list order, the same on every rank) and each
``finish`` runs with its own columns of every rank's row. A disabled callback contributes zeros, so every rank
takes part in the same collective at the same step and none is left waiting. On one process ``finish`` runs at
once, with its own values.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..platform import adapter
from ..platform.device import gather_floats, world_size

__all__ = ["StepExchange", "Rows"]

#: every rank's values of one callback, in rank order
Rows = list[list[float]]


@dataclass
class _Contribution:
    participant: Any                         # a PerfCallback (read duck-typed: the bus sits below base)
    values: list[float]
    finish: Callable[[Rows], None] | None
    device: torch.device | None


class StepExchange:
    """The contributions of one trainer's callbacks to the step in progress."""

    def __init__(self) -> None:
        self.step = -1
        self.pending: list[_Contribution] = []

    def contribute(self, participant: Any, step: int, values: list[float], finish: Callable[[Rows], None] | None,
                   handler: Any, device: torch.device | None = None) -> None:
        """``participant``'s ``values`` of ``step``; ``finish(rows)`` once every participant has contributed."""
        expected = [cb for cb in adapter.all_callbacks(handler) if getattr(cb, "exchange_width", 0) > 0]
        # one process, or not in the trainer's list: an exchange of its own
        if world_size() == 1 or not any(p is participant for p in expected):
            rows = gather_floats(values, device)
            if finish is not None:
                finish(rows)
            return
        if step != self.step:
            self.step, self.pending = step, []
        self.pending = [c for c in self.pending if c.participant is not participant]
        self.pending.append(_Contribution(participant, list(values), finish, device))
        if len(self.pending) < len(expected):
            return
        order = {id(p): i for i, p in enumerate(expected)}
        ready, self.pending = sorted(self.pending, key=lambda c: order.get(id(c.participant), len(order))), []
        device = next((c.device for c in ready if c.device is not None), None)
        rows = gather_floats([v for c in ready for v in c.values], device)
        start = 0
        for c in ready:
            width = len(c.values)
            if c.finish is not None:
                c.finish([row[start:start + width] for row in rows])
            start += width
