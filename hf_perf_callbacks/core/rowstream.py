"""The rows an optimizer step trains, measured: a digest per row of what the training loop fetched for a step, and
the comparison of two such steps. Pure: no torch, no transformers (a batch's tensors are read through ``tolist``).

A re-size must not change which rows an optimizer step trains. :class:`RowWatch` holds what the run's old split
fetched for the step after the switch (the unfaulted run's rows) and compares, as a multiset, what the new split
fetches for that step before it trains (:func:`difference`). A difference that appears only later — an iterable dataset
whose epoch ends inside an optimizer step (:func:`crosses`) — is caught by watching the row counts of every fetch
until the first epoch end after the switch. transformers fetches a step's micro-batches before ``on_step_begin``
(``Trainer.get_batch_samples``), so both checks run before the step trains.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .batching import Split

#: label value of the tokens a loss ignores (transformers' padding of labels)
IGNORE_INDEX = -100


def _rows_of(value: object) -> list[Any] | None:
    """A batch field as a list of rows (a tensor or array through ``tolist``; a list as it is); None for a scalar."""
    rows = value.tolist() if hasattr(value, "tolist") else value
    return rows if isinstance(rows, list) else None


def _digest(parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def row_digests(batch: object) -> list[str]:          # a micro-batch: whatever the user's collator made
    """One digest per row of a micro-batch: its fields (sorted by name) with padding removed (positions the
    ``attention_mask`` leaves out, labels equal to ``IGNORE_INDEX``), so that the same example padded to another
    micro-batch's length has the same digest. A padding-free batch (one row of examples packed, ``position_ids``
    starting again at 0 for each) gives one digest per packed example. A list of examples (dicts or anything else)
    gives one per example."""
    if isinstance(batch, Mapping):
        return _mapping_digests(batch)
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [_digest(sorted(item.items(), key=lambda kv: kv[0]) if isinstance(item, Mapping) else item)
                for item in batch]
    return [_digest(batch)]


def _mapping_digests(batch: Mapping[str, object]) -> list[str]:
    """:func:`row_digests` of a collated micro-batch (fields of rows)."""
    fields = {name: rows for name, value in batch.items() if (rows := _rows_of(value)) is not None}
    if not fields:
        return []
    # the rows of the batch: input_ids' first dimension where there is one (a padding-free batch also holds flat
    # per-batch lists, cu_seq_lens_*, which are no rows)
    count = len(fields["input_ids"]) if "input_ids" in fields else max(len(rows) for rows in fields.values())
    fields = {name: rows for name, rows in fields.items() if len(rows) == count}
    masks = fields.get("attention_mask")
    if masks is None and "position_ids" in fields and "input_ids" in fields:
        return _packed_digests(fields)
    return [_digest([(name, _unpadded(name, fields[name][i], masks[i] if masks is not None else None))
                     for name in sorted(fields) if name != "attention_mask"]) for i in range(count)]


def _unpadded(name: str, row: object, mask: Sequence[object] | None) -> object:
    """One field's row without its padding: the positions ``mask`` marks (a mask row of the same length), labels
    without ``IGNORE_INDEX`` where there is no mask."""
    if name == "labels" and isinstance(row, list) and mask is None:
        return [v for v in row if v != IGNORE_INDEX]
    if mask is not None and isinstance(row, list) and len(mask) == len(row):
        return [v for v, m in zip(row, mask) if m]
    return row


def _packed_digests(fields: dict[str, list[Any]]) -> list[str]:
    out: list[str] = []
    for row, positions in zip(fields["input_ids"], fields["position_ids"]):
        cuts = [i for i, p in enumerate(positions) if p == 0] + [len(row)]
        out.extend(_digest(row[begin:end]) for begin, end in zip(cuts, cuts[1:]) if end > begin)
    return out


def batch_rows(batch: object) -> int:
    """Rows (examples) of one micro-batch, without hashing them."""
    if isinstance(batch, Mapping):
        sizes = [len(rows) for value in batch.values() if (rows := _rows_of_shape(value)) is not None]
        return max(sizes) if sizes else 0
    return len(batch) if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) else 1


def _rows_of_shape(value: object) -> Sequence[Any] | None:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return range(shape[0]) if len(shape) else None
    return value if isinstance(value, list) else None


@dataclass(frozen=True)
class StepRows:
    """What the training loop fetched for optimizer step ``step`` at ``split``: a digest per row (empty when only
    counted), the rows, the micro-batches fetched and the number asked for (fewer: the data ran out)."""

    step: int
    split: Split
    rows: int
    micro_batches: int
    asked: int
    digests: tuple[str, ...] = ()

    @property
    def short(self) -> bool:
        return self.micro_batches < self.asked


def step_rows(step: int, split: Split, batches: Sequence[object], asked: int, digest: bool = True) -> StepRows:
    """:class:`StepRows` of the micro-batches ``batches`` fetched for ``step`` (``asked``: how many were asked
    for); ``digest=False`` counts the rows without hashing them."""
    digests: tuple[str, ...] = tuple(d for b in batches for d in row_digests(b)) if digest else ()
    rows = len(digests) if digest else sum(batch_rows(b) for b in batches)
    return StepRows(step, split, rows, len(batches), asked, digests)


@dataclass(frozen=True)
class RowDifference:
    """How the rows a step fetched differ from another split's, as a multiset: the rows fetched and expected, how
    many of the expected ones are ``missing`` (of ``split``'s) and how many ``extra`` rows came instead."""

    rows: int
    expected_rows: int
    split: Split
    missing: int
    extra: int

    def words(self) -> str:
        words = [f"{self.rows} rows instead of {self.expected_rows}"] if self.rows != self.expected_rows else []
        if self.missing:
            words.append(f"{self.missing} of {self.split}'s {self.expected_rows} rows missing")
        if self.extra:
            words.append(f"{self.extra} other row{'s' if self.extra != 1 else ''} in their place")
        return ", ".join(words)


def difference(expected: StepRows, got: StepRows) -> RowDifference | None:
    """How the rows ``got`` fetched differ from ``expected``'s as a multiset (None: the same rows)."""
    want, have = Counter(expected.digests), Counter(got.digests)
    if want == have:
        return None
    return RowDifference(got.rows, expected.rows, expected.split, sum((want - have).values()),
                         sum((have - want).values()))


def crosses(rows_left: int, split: Split, world: int = 1) -> bool:
    """Whether ``split``'s optimizer step that begins with ``rows_left`` rows left in an epoch of a dataloader
    without a length (an iterable dataset) goes on into the next epoch: transformers ends an epoch's last
    optimizer step early only when it knows the epoch's length, so when the epoch's last micro-batches are fewer
    than the accumulation, their gradients wait for the next epoch's first micro-batches."""
    per_step = split.micro_batch * world
    batches = -(-rows_left // per_step)
    return 0 < batches < split.grad_accum


def epoch_end(fetched: StepRows, configured: Split, world: int = 1) -> str | None:
    """The epoch's last fetch of a dataloader without a length (fewer rows than a step's, or fewer micro-batches
    than asked for): how the step differs from what ``configured`` (the unfaulted run's split) trains there (None:
    the same rows). The rows left in the epoch are the same under every split, so the step differs exactly when one
    of the two splits goes on into the next epoch and the other does not (:func:`crosses`)."""
    new, old = fetched.short and fetched.micro_batches > 0, crosses(fetched.rows * world, configured, world)
    if new == old:
        return None
    alone, adds = (configured, fetched.split) if new else (fetched.split, configured)
    return f"the epoch ends {fetched.rows} rows into this step: {alone} trains them alone, {adds} adds the next " \
           "epoch's first rows"


def _ends_epoch(fetched: StepRows) -> bool:
    """The fetch holds the epoch's last rows: fewer micro-batches than asked for, or fewer rows than a step's."""
    return fetched.short or fetched.rows < fetched.split.micro_batch * fetched.split.grad_accum


@dataclass
class RowWatch:
    """The row-stream check of one run (pure state; the training loop's fetches are handed to :meth:`fetched`).

    ``armed``: the next fetch is the old split's step after a switch — kept as the reference. After the switch
    (:meth:`switched`) the next fetch is compared with the reference before it trains; then, for a dataloader without
    a length (``sized=False``), every fetch is counted until the first epoch end, which is judged by
    :func:`epoch_end` against ``configured``."""

    configured: Split
    sized: bool = True
    world: int = 1
    armed: bool = False
    reference: StepRows | None = None
    checking: bool = False
    counting: bool = False
    refused: dict[Split, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether the training loop's fetches must be handed over now."""
        return self.armed or self.checking or self.counting

    def arm(self, step: int) -> None:
        """A switch was asked for after ``step``: the next fetch (step ``step + 1`` at the old split) is the
        reference, unless it is held already."""
        if self.reference is None or self.reference.step != step + 1:
            self.reference, self.armed = None, True

    def hold(self, reference: StepRows) -> None:
        """The reference is known already (the step that failed fetched it)."""
        self.reference, self.armed = reference, False

    def switched(self) -> None:
        """A switch was applied: the next fetch is checked."""
        self.armed, self.checking = False, True

    def fetched(self, step: int, split: Split, batches: Sequence[object], asked: int,
                every_rank: Callable[[StepRows], StepRows] | None = None) -> str | None:
        """The training loop fetched ``batches`` (``asked`` were asked for) for optimizer ``step`` at ``split``:
        returns how they differ from what the unfaulted run trains there (None: the same, or nothing to check).
        ``every_rank``: the step's rows on every rank from this rank's (several ranks: a split deals a step's rows
        to the ranks in another order, so only all of them together are the step's rows)."""
        whole = every_rank or (lambda rows: rows)
        if self.armed:
            self.reference, self.armed = whole(step_rows(step, split, batches, asked)), False
            return None
        if self.checking:
            if not batches and self.world == 1:     # a resume at an epoch's end: the next epoch's first fetch is it
                return None
            return self._check(step, split, whole(step_rows(step, split, batches, asked)))
        if self.counting:
            return self._count(step, split, batches, asked)
        return None

    def _check(self, step: int, split: Split, got: StepRows) -> str | None:
        """The first fetch after a switch against the reference (and an epoch's end it reaches)."""
        self.checking = False
        reference = self.reference
        found = difference(reference, got) if reference is not None and reference.step == step else None
        differs = found.words() if found is not None else None
        if differs is None and not self.sized and _ends_epoch(got):
            differs = epoch_end(got, self.configured, self.world)
        self.counting = (differs is None and not self.sized and self.world == 1 and not got.short
                         and split != self.configured)
        return differs

    def _count(self, step: int, split: Split, batches: Sequence[object], asked: int) -> str | None:
        """A fetch after the checked one, counted until the first epoch end (a dataloader without a length)."""
        got = step_rows(step, split, batches, asked, digest=False)
        if not _ends_epoch(got):
            return None
        self.counting = False                             # the first epoch end: every later one is alike
        differs = epoch_end(got, self.configured, self.world)
        self.reference = (step_rows(step, split, batches, asked)    # the unfaulted run trains these rows alone
                          if differs is not None and got.short and got.micro_batches else None)
        return differs

    def refuse(self, split: Split, why: str) -> None:
        self.refused[split] = why
        self.checking = self.counting = False
