"""SplitRecord: what a run decided about its split, and the one writer of ``tuner_split.json``. Pure: no trainer, no
torch (its tests run without either).

=====================  ============================================================================================
operation              what it does
=====================  ============================================================================================
:meth:`snapshot`       the split facts a transition of :mod:`~hf_perf_callbacks.resize.plan` reads, with every split
                       of the run's batch and the kind of the last decision
:meth:`commit`         a change carried out (its plan's state, a decision, a check, why the run ended): applied and
                       written once; on a rank that leaves for the launcher's restart, to that rank's own file too
:meth:`adopt`          continue a recorded run (a resume in a new process): its id, state, decisions and checks,
                       merged with what any other rank recorded before the restart (:func:`merged`)
:meth:`file`           the record itself, as the :class:`~hf_perf_callbacks.core.splitfile.SplitFile` the file holds
=====================  ============================================================================================

The checkpoints a run wrote are the executor's (:class:`~hf_perf_callbacks.resize.checkpoints.RunCheckpoints`):
every commit is handed their list, which the file holds beside the record's own facts.

**Any rank's decision reaches the restart.** An out-of-memory error that the ranks cannot agree on (the others
wait inside a collective) ends the failing rank's process, and the launcher restarts every rank. The main process
writes ``tuner_split.json``; a rank other than 0 that leaves commits its decision to ``tuner_split.rank<k>.json``
(:func:`rank_file`), and the restart adopts the main record merged with every rank's (:func:`merged`): the newest
decision wins, so the relaunch resumes every rank with the split the failing rank chose, whichever rank it was.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..core.batching import Exactness, Split
from ..core.splitfile import Decision, ExactnessCheck, Restriction, SplitFile, WrittenCheckpoint
from ..keys import SPLIT_FILE
from .plan import SplitState

_RANK_FILE = re.compile(r"\.rank(\d+)\.json$")


def rank_file(output_dir: str, rank: int) -> str:
    """Where rank ``rank`` (> 0) records a decision for the launcher's restart."""
    return os.path.join(output_dir, f"{SPLIT_FILE.removesuffix('.json')}.rank{rank}.json")


@dataclass(frozen=True)
class Change:
    """What one change of the run adds to its record (everything optional): the plan's state once carried out
    (``state``), a decision taken (``decision``), the check made at the change (``check``), why the run ended
    (``ended``), and whether this rank leaves for the launcher's restart (``restart``: written to its own file too,
    where it is not the main process)."""

    state: SplitState | None = None
    decision: Decision | None = None
    check: ExactnessCheck | None = None
    ended: str | None = None
    restart: bool = False


@dataclass
class SplitRecord:
    """The record of one run's split (see the module docstring): its id, its split facts (one frozen
    :class:`~hf_perf_callbacks.resize.plan.SplitState`), its decisions, the checks of its changes, why it ended, and
    the notes said once. ``main``: this process writes ``tuner_split.json``; ``rank``: its rank."""

    output_dir: str
    state: SplitState
    world: int = 1
    main: bool = True
    rank: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    decisions: list[Decision] = field(default_factory=list)
    checks: list[ExactnessCheck] = field(default_factory=list)
    ended: str | None = None
    said: set[str] = field(default_factory=set)
    _written: dict[str, object] | None = field(default=None, repr=False)     # what the file holds now

    @classmethod
    def start(cls, output_dir: str, configured: Split, world: int = 1, main: bool = True,
              rank: int = 0) -> SplitRecord:
        """A new run's record at its configured split."""
        return cls(output_dir, SplitState(configured, configured), world, main, rank)

    # ------------------------------------------------------------ the four operations
    def snapshot(self, every: Sequence[Split]) -> SplitState:
        """The state a transition reads: every split of the run's batch (``every``, largest micro-batch first) and
        the kind of the last decision as they are now."""
        return replace(self.state, every=tuple(every),
                       last_decision=self.decisions[-1].kind if self.decisions else None)

    def commit(self, change: Change, written: Sequence[WrittenCheckpoint], write: bool = True) -> str | None:
        """Apply ``change`` and write the record once, with the checkpoints ``written``, when what the file holds
        changed: ``tuner_split.json`` on the main process; a rank's own file where it is not and the change is its
        decision for the restart (``write`` False: applied only, written by a later commit). Returns the path
        written (None: none). OSError when the file cannot be written (the facts stay in memory)."""
        if change.state is not None:
            self.state = replace(change.state, every=(), last_decision=None)
        if change.decision is not None:
            self.decisions.append(change.decision)
        if change.check is not None:
            self.checks.append(change.check)
        if change.ended is not None:
            self.ended = change.ended
        if not write:
            return None
        if change.restart and not self.main:
            return self.file(written).write(self.output_dir, rank_file(self.output_dir, self.rank))
        record = self.file(written)
        if not self.main or record.to_json() == self._written or (
                self._written is None and _nothing(record)
                and not os.path.exists(os.path.join(self.output_dir, SPLIT_FILE))):
            return None                 # nothing happened: no file (an earlier run's is replaced)
        path = record.write(self.output_dir)
        self._written = record.to_json()
        return path

    def adopt(self, found: SplitFile) -> None:
        """Continue the recorded run ``found`` (a resume in a new process, already merged with the ranks' files):
        its id, configured split and the split it resumes with, its decisions and checks."""
        self.id, self.decisions, self.checks = found.session, list(found.decisions), list(found.checks)
        restricted = found.restricted
        exactness = (Exactness(tuple(restricted.splits), restricted.reason, restricted.fix) if restricted is not None
                     else self.state.exactness)
        self.state = replace(self.state, configured=found.configured, exactness=exactness)

    def file(self, written: Sequence[WrittenCheckpoint]) -> SplitFile:
        """The record as the split file holds it."""
        exactness = self.state.exactness
        restricted = (Restriction(list(exactness.splits), exactness.reason, exactness.fix or "")
                      if exactness is not None and exactness.reason is not None else None)
        return SplitFile(session=self.id, world_size=self.world, configured=self.state.configured,
                         split=self.state.resume_split, written=list(written), decisions=list(self.decisions),
                         ended=self.ended, restricted=restricted, checks=list(self.checks))

    # ------------------------------------------------------------ notes said once
    def first_time(self, key: str) -> bool:
        """Whether the note ``key`` is said now for the first time in this run (and remember it)."""
        if key in self.said:
            return False
        self.said.add(key)
        return True


def _nothing(record: SplitFile) -> bool:
    """Whether ``record`` holds nothing but the configured split."""
    return (record.split == record.configured and not (record.written or record.decisions or record.checks)
            and record.ended is None and record.restricted is None)


def _rank_paths(output_dir: str) -> list[str]:
    """The files :func:`rank_file` names in ``output_dir``."""
    found = glob.glob(os.path.join(glob.escape(output_dir), f"{SPLIT_FILE.removesuffix('.json')}.rank*.json"))
    return sorted(path for path in found if _RANK_FILE.search(path) is not None)


def rank_files(output_dir: str) -> list[SplitFile]:
    """The records that ranks other than 0 wrote for the launcher's restart (an unreadable one is skipped)."""
    found = []
    for path in _rank_paths(output_dir):
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:    # ValueError: JSON,
            found.append(SplitFile.from_json(json.load(f)))                                   # SplitFileError
    return found


def merged(main: SplitFile | None, ranks: Sequence[SplitFile]) -> SplitFile | None:
    """The main record with what other ranks of the same run decided before the restart: a rank's decisions that the
    main record lacks are added, and the record whose newest decision is newest sets the split to resume with (a
    rank's record of another run, or older than the main one, changes nothing)."""
    if main is None:
        return None
    newest, best = _newest(main), main
    decisions = list(main.decisions)
    for other in ranks:
        if other.session != main.session:
            continue
        decisions += [d for d in other.decisions if d not in decisions]
        if _newest(other) > newest:
            newest, best = _newest(other), other
    decisions.sort(key=lambda d: (d.step, d.time or 0.0))
    return replace(main, split=best.split, decisions=decisions)


def _newest(record: SplitFile) -> float:
    return max((d.time or 0.0 for d in record.decisions), default=0.0)


def clear_rank_files(output_dir: str) -> None:
    """Remove the ranks' restart records once the main record holds them (the main process, after adopting)."""
    for path in _rank_paths(output_dir):
        with contextlib.suppress(OSError):
            os.remove(path)
