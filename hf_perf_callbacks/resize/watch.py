"""What a change of split is checked on, on a real trainer: the micro-batches the training loop fetches
(``Trainer.get_batch_samples``, watched through :mod:`~hf_perf_callbacks.platform.adapter` only while a change is
pending or was just applied, so that other steps pay nothing). The old split's fetch of the step a change starts with is
the reference (the step an out-of-memory error left, or the step after a switch was asked for); the new split's fetch of
that step is compared with it: its rows first (:class:`~hf_perf_callbacks.core.rowstream.RowWatch`, as a multiset,
before the step trains; an iterable dataset's first epoch end after it), then — by the executor, at the step's begin —
its gradients (:mod:`~hf_perf_callbacks.resize.exactness`). :class:`ChangeRefused` stops a change whose rows differ.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.batching import Split
from ..core.rowstream import RowWatch, StepRows, step_rows
from ..core.splitfile import ExactnessCheck
from ..platform import adapter
from ..platform.device import gather_floats, world_size
from .exactness import Fetched

if TYPE_CHECKING:
    from transformers import Trainer


class ChangeRefused(BaseException):
    """The change to ``split`` at optimizer step ``step`` is refused before that step trained (``why``): its rows
    differ from the unfaulted run's (``check`` None), or its gradients do, or they could not be compared (``check``
    says which). :func:`~hf_perf_callbacks.train_with_tuning` goes back to ``expected``'s split from the same
    checkpoint, or ends the run there. A ``BaseException``, as :class:`~hf_perf_callbacks.resize.executor.SwitchSplit`:
    the package's fault isolation and the user's ``except Exception`` let it through."""

    def __init__(self, step: int, split: Split, why: str, expected: Split | None,
                 check: ExactnessCheck | None = None, rows: Fetched | None = None) -> None:
        super().__init__(f"step {step} at {split}: {why}")
        self.step, self.split, self.why, self.expected, self.check = step, split, why, expected, check
        self.rows = rows                    # the new split's micro-batches of the step, where it was checked


def every_rank(rows: StepRows) -> StepRows:
    """The step's rows on every rank (two collectives: the counts, then each row's digest cut to 48 bits, which a
    float carries exactly)."""
    counts = [int(r[0]) for r in gather_floats([float(len(rows.digests))])]
    mine = [float(int(d[:12], 16)) for d in rows.digests] + [-1.0] * (max(counts) - len(rows.digests))
    gathered = gather_floats(mine) if max(counts) else [[] for _ in counts]
    digests = tuple(f"{int(v):012x}" for rank, values in enumerate(gathered) for v in values[:counts[rank]])
    return dataclasses.replace(rows, rows=len(digests), digests=digests)


class ChangeWatch:
    """The fetches a change is checked on, for one trainer (see the module docstring). ``rows`` False (GRPO, whose
    dataloader yields prompts that its generation turns into the trained rows, the same generation batches under
    every split): nothing is fetched here; GRPO's change is checked on its buffered completions."""

    def __init__(self, trainer: Trainer, configured: Split, split_of: Callable[[object], Split], rows: bool,
                 sized: bool) -> None:
        self.trainer, self.split_of, self.rows = trainer, split_of, rows
        self.world = world_size()
        self.watch = RowWatch(configured, sized=sized, world=self.world)
        self.theirs: Fetched | None = None      # the old split's fetch of the step a change starts with
        self.ours: Fetched | None = None        # the new split's fetch of it, once fetched
        self.expecting = False                  # a change was applied: its first fetch is ours
        self._undo: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self.expecting or self.watch.active

    def _sync(self) -> None:
        """The hook on while a fetch is wanted, off otherwise."""
        if self.active and self._undo is None:
            self._undo = adapter.watch_batch_samples(self.trainer, self._fetched)
        elif not self.active and self._undo is not None:
            self._undo()
            self._undo = None

    def _fetched(self, batches: list[Any], asked: int, num_items: Any) -> None:      # the user's micro-batches
        step, split = self.trainer.state.global_step + 1, self.split_of(self.trainer.args)
        armed, checking = self.watch.armed, self.watch.checking
        expected = self.watch.reference.split if self.watch.reference is not None else self.watch.configured
        why = self.watch.fetched(step, split, batches, asked, every_rank if self.world > 1 else None)
        if armed:
            self.theirs = Fetched(split, list(batches), num_items)
        if self.expecting and batches:              # none: a resume at an epoch's end; the next fetch is it
            self.expecting = False
            self.ours = Fetched(split, list(batches), num_items)
        if self.world > 1 and checking:                     # every rank fetched this step: they decide together
            if any(r[0] for r in gather_floats([1.0 if why else 0.0])) and why is None:
                why = "another rank's rows differ"
        self._sync()
        if why is not None:
            raise ChangeRefused(step, split, f"the rows differ ({why})", expected)

    def arm(self) -> None:
        """A switch was asked for after the step that ended last: the old split's next fetch is the reference."""
        if not self.rows:
            return
        self.theirs = None
        self.watch.arm(self.trainer.state.global_step)
        self._sync()

    def hold(self, batches: list[Any] | None, step: int, split: Split, num_items: Any = None) -> None:
        """``batches``: what ``split`` fetched for ``step``, which an error left before it trained (the reference;
        None: unknown, so the rows compare with nothing and the gradients with a finer cut)."""
        self.theirs = Fetched(split, list(batches), num_items) if batches is not None else None
        if not self.rows:
            return
        if self.world > 1:                                  # every rank recovers together: all of them, or none
            if min(r[0] for r in gather_floats([float(batches is not None)])) > 0 and batches is not None:
                self.watch.hold(every_rank(step_rows(step, split, batches, len(batches))))
        elif batches is not None:
            self.watch.hold(step_rows(step, split, batches, len(batches)))

    def expect(self) -> None:
        """A change was applied: the next fetch is the step it starts with (its rows are checked before it trains,
        and kept for its gradients' check)."""
        self.ours = None
        if not self.rows:
            return
        self.expecting = True
        self.watch.switched()
        self._sync()

    def taken(self) -> tuple[Fetched | None, Fetched | None]:
        """(the old split's fetch, the new one's) of the step the change starts with, once both are in (the old one
        stays the reference until the change is confirmed: a refused trial's successor is checked against it)."""
        ours, self.ours = self.ours, None
        return self.theirs, ours

    def refuse(self, split: Split, why: str) -> None:
        self.watch.refuse(split, why)
        self._sync()

    def close(self) -> None:
        self.watch.armed = self.watch.checking = self.watch.counting = False
        self.expecting = False
        self.theirs = self.ours = None
        self._sync()
