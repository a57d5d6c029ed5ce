"""The row-stream check on a real trainer: :class:`~hf_perf_callbacks.rowstream.RowWatch` fed with what the training
loop fetches (``Trainer.get_batch_samples``, hooked through :mod:`~hf_perf_callbacks.adapter` only while a switch is
pending or was just applied, so that other steps pay nothing), and :class:`RowsDiffer` raised before a step whose
rows differ from the unfaulted run's trains. The session owns it (:func:`~hf_perf_callbacks.resize.recovery.refuse_rows`
acts on a difference).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import adapter
from ..batching import Split, is_grpo
from ..device import gather_floats, world_size
from ..rowstream import RowWatch, StepRows, step_rows

if TYPE_CHECKING:
    from transformers import Trainer


class RowsDiffer(BaseException):
    """The rows that the split in effect fetched for optimizer step ``step`` differ from the unfaulted run's
    (``why``), found before the step trained: :func:`~hf_perf_callbacks.train_with_tuning` goes back to
    ``expected``'s split. A ``BaseException``, as :class:`~hf_perf_callbacks.resize.session.SwitchSplit`."""

    def __init__(self, step: int, split: Split, why: str, expected: Split | None) -> None:
        super().__init__(f"the rows of step {step} differ under {split}: {why}")
        self.step, self.split, self.why, self.expected = step, split, why, expected


def every_rank(rows: StepRows) -> StepRows:
    """The step's rows on every rank (two collectives: the counts, then each row's digest cut to 48 bits, which a
    float carries exactly)."""
    counts = [int(r[0]) for r in gather_floats([float(len(rows.digests))])]
    mine = [float(int(d[:12], 16)) for d in rows.digests] + [-1.0] * (max(counts) - len(rows.digests))
    gathered = gather_floats(mine) if max(counts) else [[] for _ in counts]
    digests = tuple(f"{int(v):012x}" for rank, values in enumerate(gathered) for v in values[:counts[rank]])
    return dataclasses.replace(rows, rows=len(digests), digests=digests)


class RowCheck:
    """The row-stream check of one trainer's run (see the module docstring). Off for GRPO, whose dataloader yields
    prompts that its generation turns into the trained rows (the same generation batches under every split)."""

    def __init__(self, trainer: Trainer, configured: Split, split_of: Callable[[object], Split]) -> None:
        from .grouping import examples

        self.trainer, self.split_of = trainer, split_of
        self.enabled = not is_grpo(trainer.args)
        self.watch = RowWatch(configured, sized=examples(trainer.train_dataset) is not None, world=world_size())
        self._undo: Callable[[], None] | None = None

    def _sync(self) -> None:
        """The hook on while the watch needs the fetches, off otherwise."""
        if self.enabled and self.watch.active and self._undo is None:
            self._undo = adapter.watch_batch_samples(self.trainer, self._fetched)
        elif not (self.enabled and self.watch.active) and self._undo is not None:
            self._undo()
            self._undo = None

    def _fetched(self, batches: list[Any], asked: int) -> None:      # the user's micro-batches
        step, split = self.trainer.state.global_step + 1, self.split_of(self.trainer.args)
        expected = self.watch.reference.split if self.watch.reference is not None else self.watch.configured
        checking = self.watch.checking
        why = self.watch.fetched(step, split, batches, asked, every_rank if world_size() > 1 else None)
        if world_size() > 1 and checking:                   # every rank fetched this step: they decide together
            if any(r[0] for r in gather_floats([1.0 if why else 0.0])) and why is None:
                why = "another rank's rows differ"
        self._sync()
        if why is not None:
            raise RowsDiffer(step, split, why, expected)

    def arm(self) -> None:
        """A switch was asked for after the step that ended last: the old split's next fetch is the reference."""
        self.watch.arm(self.trainer.state.global_step)
        self._sync()

    def hold(self, batches: list[Any] | None, step: int, split: Split) -> None:
        """The micro-batches ``batches`` that ``split`` fetched for ``step`` (the step an error left) are the
        reference (None: unknown, the check compares nothing)."""
        if not self.enabled:
            return
        if world_size() > 1:                                # every rank recovers together: all of them, or none
            if min(r[0] for r in gather_floats([float(batches is not None)])) > 0 and batches is not None:
                self.watch.hold(every_rank(step_rows(step, split, batches, len(batches))))
        elif batches is not None:
            self.watch.hold(step_rows(step, split, batches, len(batches)))

    def switched(self) -> None:
        """A switch was applied: the next fetch is checked before it trains."""
        self.watch.switched()
        self._sync()

    def refuse(self, split: Split, why: str) -> None:
        self.watch.refuse(split, why)
        self._sync()

    def close(self) -> None:
        self.watch.armed = self.watch.checking = self.watch.counting = False
        self._sync()
