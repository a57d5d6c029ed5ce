"""``<output_dir>/tuner_split.json``: the tuning session's record, its schema and its one reader. Pure: no torch.

The file is written by one writer only, :class:`~hf_perf_callbacks.resize.record.SplitRecord` (atomically, by
the main process), and read back through :func:`read_split_file` by every reader: the resume of
:func:`~hf_perf_callbacks.train_with_tuning`, the recipe launcher, ``hf-perf report``'s plots and the analysis.

================  ==========================================================================================
field             meaning
================  ==========================================================================================
``version``       the schema version (:data:`VERSION`)
``session``       the tuning session's id: one run, kept across in-process re-sizes and resumes
``world_size``    data-parallel ranks of the run
``configured``    the split the run was configured with (a :class:`~hf_perf_callbacks.core.batching.Split`)
``split``         the split a resume starts with: the one in effect, or the one a pending decision chose
``written``       the checkpoints this run wrote and verified, each with the fingerprint of its files
``decisions``     every :class:`Decision`, oldest first
``ended``         why the tuner gave up (the run ended by an error no split fixes), or null
``restricted``    the splits the run may use when its loss leaves others inexact (:class:`Restriction`: the
                  splits, why, and the setting that makes every split exact), or null
``checks``        the check of every change of the split, made at the step it starts with on that step's rows
                  (:class:`ExactnessCheck`: the change, exact or not and why, what it cost)
================  ==========================================================================================

A split is written with the field names of :class:`~hf_perf_callbacks.core.batching.Split` (``micro_batch``,
``grad_accum``, ``steps_per_generation``) everywhere in the file.

**Applied only when exact** (:func:`split_for_run`): the recorded split is applied to a run being started only when
it is well-formed and exact for that run — ``micro_batch × grad_accum × world`` equals the configured effective batch
and, for GRPO, ``micro_batch × world × steps_per_generation`` equals the configured generation batch. Anything else
is ignored with one warning that names the file, what it holds and the expected values.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeGuard

from .batching import Split, is_grpo
from .runlog import SPLIT_FILE, DecisionDetails, conform
from .stats import iqr, mann_whitney_less, median, ranges_text, step_ranges
from .wording import split_label

logger = logging.getLogger("hf_perf_callbacks")

VERSION = 2


class SplitFileError(ValueError):
    """A split file that does not follow the schema (the message names the field and what it holds)."""


def _whole(value: object, low: int = 1) -> TypeGuard[int]:
    """Whether ``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def split_to_json(split: Split) -> dict[str, int]:
    return {name: value for name, value in dataclasses.asdict(split).items() if value is not None}


def split_from_json(value: object, where: str) -> Split:
    """A :class:`Split` from its JSON form (its field names)."""
    if not isinstance(value, dict):
        raise SplitFileError(f"{where} is {type(value).__name__}, not a mapping of micro_batch and grad_accum")
    micro, accum = value.get("micro_batch"), value.get("grad_accum")
    spg = value.get("steps_per_generation")
    if not (_whole(micro) and _whole(accum)) or not (spg is None or _whole(spg)):
        raise SplitFileError(f"{where} holds micro_batch={micro!r}, grad_accum={accum!r}, steps_per_generation="
                             f"{spg!r}: expected positive integers (steps_per_generation may be null)")
    return Split(micro, accum, spg)


def _list(value: object, kind: type, where: str) -> list[Any]:
    """A list of ``kind``, each item read as :func:`_optional` reads a field (no nulls)."""
    read = [conform(v, kind.__name__) for v in value] if isinstance(value, list) else None
    if read is None or not all(ok and v is not None for ok, v in read):
        raise SplitFileError(f"{where} is {value!r}: expected a list of {kind.__name__}")
    return [v for _, v in read]


def _figures(value: object, where: str) -> dict[str, float | int | str]:
    """A decision's figures: a mapping of names to numbers or words (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float, str)) and not isinstance(v, bool)
            for k, v in value.items()):
        raise SplitFileError(f"{where} is {value!r}: expected a mapping of names to numbers or words")
    return dict(value)


def _optional(value: object, kind: type, where: str) -> Any:
    """``value`` when it is None or of ``kind``, read as :func:`~hf_perf_callbacks.core.runlog.conform` reads a
    logged field (``int``: an integral number, ``float``: a finite one, neither a bool), else a SplitFileError."""
    ok, read = conform(value, kind.__name__)
    if not ok:
        raise SplitFileError(f"{where} is {value!r}: expected {kind.__name__} or null")
    return read


def _optional_fields(cls: type, entry: dict[str, Any], where: str, kinds: dict[str, type]) -> dict[str, Any]:
    """The fields ``kinds`` names, each read from ``entry`` by :func:`_optional` (absent or null: the field's
    default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    read = {name: _optional(entry.get(name), kind, f"{where}.{name}") for name, kind in kinds.items()}
    return {name: defaults[name] if value is None else value for name, value in read.items()}


@dataclass
class Trial:
    """One split measured by the tuner on training steps: its samples of the ranked time (seconds per optimizer
    step outside generation, or the whole step; the slowest rank's), the steps they were measured on, its peak
    memory and cost; the judgement against the baseline split once made."""

    split: Split
    samples: list[float] = field(default_factory=list)
    step_samples: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    peak_gb: float | None = None
    fits: bool = True
    error: str | None = None
    cost_sec: float = 0.0
    p_value: float | None = None            # one-sided Mann-Whitney against the starting split's samples
    gain: float | None = None               # 1 − median / the starting split's median (positive: faster)

    @property
    def median(self) -> float | None:
        return median(self.samples) if self.samples else None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["split"] = split_to_json(self.split)
        if self.samples:
            out["median"] = self.median
        return out

    @classmethod
    def from_json(cls, entry: object, where: str = "trial") -> Trial:
        if not isinstance(entry, dict):
            raise SplitFileError(f"{where} is {type(entry).__name__}, not a mapping")
        return cls(split=split_from_json(entry.get("split"), f"{where}.split"),
                   samples=_list(entry.get("samples", []), float, f"{where}.samples"),
                   step_samples=_list(entry.get("step_samples", []), float, f"{where}.step_samples"),
                   steps=_list(entry.get("steps", []), int, f"{where}.steps"),
                   **_optional_fields(cls, entry, where, {"peak_gb": float, "error": str, "cost_sec": float,
                                                          "p_value": float, "gain": float, "fits": bool}))


#: what a trial's samples measure, by the tuner's ``rank_by`` (the words :meth:`Decision.ranked` reads back from the
#: decision's ``rule``)
RANKED_WORDS = {"non_generation": "step time minus generation", "step": "step time"}
#: the same, as the readers print it beside a median ("s per optimizer step outside generation")
RANKED_UNITS = {"non_generation": "s per optimizer step outside generation", "step": "s per optimizer step"}


@dataclass(frozen=True)
class TrialFigures:
    """Everything a reader prints about one trial of a tuning decision — the report, the console, the plots — computed
    once by :func:`trial_figures` from the samples the split file holds, and worded once (:meth:`words`): a median
    names its samples (the steps they were measured on), a comparison names what it compares with and its direction
    (``change`` > 0: slower), a p-value names its test.

    ======================  ===================================================================================
    field                   meaning
    ======================  ===================================================================================
    ``status``              ``reference`` (the split before the tuning: what the others are compared with),
                            ``measured``, ``not measured``, ``out of memory``, ``over the budget``
    ``median``              median of ``samples`` (seconds, :attr:`unit`)
    ``change``              median / the reference's median − 1, over all the samples of both (0.23: 23% slower)
    ``p_value``             one-sided Mann-Whitney p of "faster than the reference", over all the samples of both
    ======================  ===================================================================================
    """

    split: Split
    label: str
    status: str
    samples: tuple[float, ...]
    steps: tuple[int, ...]
    median: float | None
    quartiles: tuple[float, float] | None
    reference: str | None
    reference_median: float | None
    reference_steps: tuple[int, ...]
    change: float | None
    p_value: float | None
    unit: str
    cost_sec: float
    peak_gb: float | None
    error: str | None

    @property
    def measured(self) -> bool:
        return self.median is not None

    def comparison(self) -> str | None:
        """``23% slower than 4×2``, ``12% faster than 4×2``, ``as fast as 4×2`` (within 0.5%); None without one."""
        if self.change is None or self.reference is None:
            return None
        if abs(self.change) < 0.005:
            return f"as fast as {self.reference}"
        return f"{abs(self.change):.0%} {'slower' if self.change > 0 else 'faster'} than {self.reference}"

    def words(self) -> str:
        """The trial in one line, naming its samples: ``8×1: median 0.696 s per optimizer step outside generation
        over steps 10–13, 23% slower than 4×2 (median 0.566 s over steps 4–7, 16–19; one-sided Mann-Whitney p =
        0.83 that it is faster)``."""
        if self.status in ("out of memory", "over the budget") and not self.measured:
            return f"{self.label}: {self.error or self.status}"
        if not self.measured:
            return f"{self.label}: not measured" + (f" ({self.error})" if self.error else "")
        text = (f"{self.label}: median {self.median:.3g} {self.unit} over step{'s' if len(self.steps) != 1 else ''} "
                f"{ranges_text(step_ranges(self.steps))}")
        compared = self.comparison()
        if compared and self.reference_median is not None:
            reference = ranges_text(step_ranges(self.reference_steps))
            text += (f", {compared} (median {self.reference_median:.3g} s over steps {reference}"
                     + (f"; one-sided Mann-Whitney p = {self.p_value:.2g} that it is faster" if self.p_value is not None
                        else "") + ")")
        if self.status == "over the budget":
            text += ", over the memory budget"
        elif self.status == "out of memory":
            text += f", then {self.error or 'out of memory'}"
        return text


def trial_figures(decision: Decision) -> list[TrialFigures]:
    """The figures of every trial of ``decision`` (:class:`TrialFigures`), the reference first."""
    reference = next((t for t in decision.trials if t.split == decision.old and t.samples), None)
    no_generation = all(t.samples == t.step_samples for t in decision.trials if t.step_samples)
    unit = RANKED_UNITS["step" if no_generation else decision.ranked or "step"]   # no generation: the whole step
    ordered = sorted(decision.trials, key=lambda t: t is not reference)
    return [_trial_figures(t, reference, unit) for t in ordered]


def _trial_status(trial: Trial, is_reference: bool) -> str:
    if is_reference:
        return "reference"
    if trial.error and "memory" in trial.error and "budget" not in trial.error:
        return "out of memory"
    if not trial.fits:
        return "over the budget"
    return "measured" if trial.samples else "not measured"


def _trial_figures(t: Trial, reference: Trial | None, unit: str) -> TrialFigures:
    """One trial's figures against the decision's ``reference`` trial (None: there is none)."""
    is_reference = t is reference
    reference = None if is_reference else reference
    samples = tuple(t.samples)
    change = p = None
    if reference is not None and samples:
        base = median(reference.samples)
        change = median(samples) / base - 1.0 if base > 0 else None
        p = mann_whitney_less(list(samples), reference.samples)
    return TrialFigures(
        split=t.split, label=split_label(t.split), status=_trial_status(t, is_reference),
        samples=samples, steps=tuple(t.steps), median=t.median,
        quartiles=iqr(samples) if samples else None,
        reference=split_label(reference.split) if reference is not None else None,
        reference_median=reference.median if reference is not None else None,
        reference_steps=tuple(reference.steps) if reference is not None else (),
        change=change, p_value=p, unit=unit, cost_sec=t.cost_sec, peak_gb=t.peak_gb, error=t.error)


#: the kinds of decision: ``tune`` (a split measured on the run's own steps kept or left), ``memory_check`` (the
#: configured split did not fit at the worst-case length), ``oom`` (an out-of-memory error re-sized the run),
#: ``watchdog`` (the memory watchdog asked for a smaller micro-batch)
DECISION_KINDS = ("tune", "memory_check", "oom", "watchdog")


@dataclass
class Decision:
    """One change (or confirmation) of the split, with its reason, evidence and cost."""

    kind: str
    step: int
    reason: str
    old: Split
    new: Split
    time: float | None = None
    checkpoint: str | None = None            # the checkpoint the re-size resumed from (None: the start)
    recovery_sec: float | None = None        # from the decision to the next completed step
    trials: list[Trial] = field(default_factory=list)
    cost_sec: float | None = None            # what the decision spent beyond training (switches, slower steps)
    expected_gain_sec: float | None = None   # its expected saving over the rest of the run
    planned_steps: int | None = None
    budget_gb: float | None = None
    rule: str | None = None
    trial: bool = False                      # an OOM of a split the tuning was trying: no re-size of the user's
    # the reason as data. A tune decision's ``reason_code`` is its outcome ("kept_configured",
    # "faster_beyond_noise"), ``ended_by`` why the tuning ended (wording.TUNER_REASONS), ``figures`` the numbers
    # both rest on; ``rank_by``: what its trials' samples measure
    reason_code: str | None = None
    ended_by: str | None = None
    figures: dict[str, float | int | str] = field(default_factory=dict)
    rank_by: str | None = None

    @property
    def ranked(self) -> str | None:
        """What the trials' samples measure (the tuner's ``rank_by``): ``"non_generation"`` (the step time minus
        generation), ``"step"`` (the whole step) or None (not a tune decision)."""
        return self.rank_by if self.rank_by in RANKED_WORDS else None

    def event_details(self) -> DecisionDetails:
        """The details of its ``tuner``/``decision`` event in the perf log (beside the headline and the step)."""
        return DecisionDetails(old_split=self.old.as_args(), new_split=self.new.as_args(), cost_sec=self.cost_sec,
                               expected_gain_sec=self.expected_gain_sec)

    def headline(self) -> str:
        """One line: what changed (or was kept), why, and what it cost."""
        what = {"tune": "tuning", "memory_check": "memory check", "oom": "out of memory", "watchdog": "watchdog"}
        change = f"{self.old} → {self.new}" if self.old != self.new else f"kept {self.new}"
        cost = f"; cost {self.cost_sec:.1f} s" if self.cost_sec else ""
        trial = "; a trial of the tuning, not a re-size" if self.trial else ""
        return f"{what[self.kind]} at step {self.step}: {change} ({self.reason}{cost}{trial})"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(old=split_to_json(self.old), new=split_to_json(self.new), trials=[t.to_json() for t in self.trials])
        return out

    @classmethod
    def from_json(cls, entry: object, where: str = "decision") -> Decision:
        if not isinstance(entry, dict):
            raise SplitFileError(f"{where} is {type(entry).__name__}, not a mapping")
        kind, step = entry.get("kind"), entry.get("step")
        if kind not in DECISION_KINDS:
            raise SplitFileError(f"{where}.kind is {kind!r}: expected one of {', '.join(DECISION_KINDS)}")
        if not _whole(step, 0):
            raise SplitFileError(f"{where}.step is {step!r}: expected an integer >= 0")
        trials = entry.get("trials", [])
        if not isinstance(trials, list):
            raise SplitFileError(f"{where}.trials is {trials!r}: expected a list")
        return cls(kind=kind, step=step, reason=str(entry.get("reason", "")),
                   old=split_from_json(entry.get("old"), f"{where}.old"),
                   new=split_from_json(entry.get("new"), f"{where}.new"),
                   trials=[Trial.from_json(t, f"{where}.trials[{i}]") for i, t in enumerate(trials)],
                   figures=_figures(entry.get("figures", {}), f"{where}.figures"),
                   **_optional_fields(cls, entry, where, {
                       "time": float, "checkpoint": str, "recovery_sec": float, "cost_sec": float,
                       "expected_gain_sec": float, "planned_steps": int, "budget_gb": float, "rule": str,
                       "trial": bool, "reason_code": str, "ended_by": str, "rank_by": str}))


@dataclass
class WrittenCheckpoint:
    """A ``checkpoint-<step>`` this run wrote and verified, with the fingerprint of its files when it was written."""

    step: int
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, entry: object, where: str = "written") -> WrittenCheckpoint:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not _whole(step, 0) or not isinstance(entry.get("fingerprint"), str):
            raise SplitFileError(f"{where} is {entry!r}: expected {{'step': int, 'fingerprint': str}}")
        return cls(entry["step"], entry["fingerprint"])


@dataclass
class Restriction:
    """The splits a run may use (the configured one and those exact under its loss), why the others are left out,
    and the setting that makes every split exact (:func:`hf_perf_callbacks.core.batching.exact_under`)."""

    splits: list[Split]
    reason: str
    fix: str

    def to_json(self) -> dict[str, Any]:
        return {"splits": [split_to_json(s) for s in self.splits], "reason": self.reason, "fix": self.fix}

    @classmethod
    def from_json(cls, entry: object, where: str = "restricted") -> Restriction | None:
        if entry is None:
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("splits"), list) \
                or not isinstance(entry.get("reason"), str) or not isinstance(entry.get("fix"), str):
            raise SplitFileError(f"{where} is {entry!r}: expected {{'splits': [...], 'reason': str, 'fix': str}}")
        return cls([split_from_json(s, f"{where}.splits[{i}]") for i, s in enumerate(entry["splits"])],
                   entry["reason"], entry["fix"])


#: what the check of a change found: ``exact`` (the new split trains the step's rows as the old one does),
#: ``inexact`` (it does not), ``unmeasured`` (no check could be made)
VERDICTS = ("exact", "inexact", "unmeasured")
#: the changes a check is made for: a decision's kind, or ``restart`` (a launcher's restart resumed with a split
#: another process chose) and ``back`` (never checked: the split the run trained before)
CHANGES = ("oom", "watchdog", "tune", "memory_check", "restart")


@dataclass
class ExactnessCheck:
    """The check of one change of the split (:mod:`hf_perf_callbacks.resize.exactness`), made at optimizer step
    ``step`` — the one the new split starts with — on that step's rows, before it trained: the change (``kind``,
    ``old`` → ``new``), the ``verdict``, why (inexact: what differs and by how much; unmeasured: why no check
    could be made), what the new split was compared with (``against``: ``old``, the old split's own micro-batches of
    those rows; ``finer``, a finer cut of the new split's, where the old one no longer fits or never fetched them),
    the rows compared, the passes (forward and backward of those rows each), the seconds and peak device memory it
    cost (None: not read on this device), the sketches' bytes, whether the step drew random numbers, and whether the
    new split fits (False: its own micro-batches ran out of memory in the check, so the run re-sizes further), and
    the padded tokens the new split's micro-batches hold beyond the old split's at that step, every rank's
    (``padded_delta``: what transformers' ``total_flos``, and ``num_input_tokens_seen`` counting padding, count
    differently from here)."""

    step: int
    kind: str
    old: Split
    new: Split
    verdict: str
    why: str = ""
    against: str = ""
    rows: int = 0
    passes: int = 0
    cost_sec: float = 0.0
    peak_gb: float | None = None
    sketch_bytes: int = 0
    drew_rng: bool = False
    fits: bool = True
    padded_delta: int = 0

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    def words(self) -> str:
        """One clause: the verdict and its cost."""
        cost = f"{self.cost_sec:.2f} s, {self.passes} passes over {self.rows} rows"
        if self.exact:
            return f"{self.new} exact on step {self.step}'s rows ({cost})"
        return f"{self.new} {self.verdict} on step {self.step}'s rows: {self.why} ({cost})"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(old=split_to_json(self.old), new=split_to_json(self.new))
        return out

    @classmethod
    def from_json(cls, entry: object, where: str = "checks") -> ExactnessCheck:
        if not isinstance(entry, dict):
            raise SplitFileError(f"{where} is {type(entry).__name__}, not a mapping")
        step, kind, verdict = entry.get("step"), entry.get("kind"), entry.get("verdict")
        if not _whole(step, 0):
            raise SplitFileError(f"{where}.step is {step!r}: expected an integer >= 0")
        if kind not in CHANGES or verdict not in VERDICTS:
            raise SplitFileError(f"{where}: kind={kind!r}, verdict={verdict!r}: expected one of {CHANGES} and "
                                 f"one of {VERDICTS}")
        return cls(step=step, kind=kind, old=split_from_json(entry.get("old"), f"{where}.old"),
                   new=split_from_json(entry.get("new"), f"{where}.new"), verdict=verdict,
                   **_optional_fields(cls, entry, where, {"why": str, "against": str, "rows": int, "passes": int,
                                                          "cost_sec": float, "peak_gb": float, "sketch_bytes": int,
                                                          "padded_delta": int, "drew_rng": bool, "fits": bool}))


@dataclass
class SplitFile:
    """The whole ``tuner_split.json`` (see the module docstring)."""

    session: str
    world_size: int
    configured: Split
    split: Split
    written: list[WrittenCheckpoint] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    ended: str | None = None
    restricted: Restriction | None = None
    checks: list[ExactnessCheck] = field(default_factory=list)
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "session": self.session, "world_size": self.world_size,
                "configured": split_to_json(self.configured), "split": split_to_json(self.split),
                "written": [w.to_json() for w in self.written], "decisions": [d.to_json() for d in self.decisions],
                "ended": self.ended, "restricted": self.restricted.to_json() if self.restricted else None,
                "checks": [c.to_json() for c in self.checks]}

    @classmethod
    def from_json(cls, entry: object) -> SplitFile:
        if not isinstance(entry, dict):
            raise SplitFileError(f"expected a JSON object, found {type(entry).__name__}")
        session, world = entry.get("session"), entry.get("world_size")
        if not isinstance(session, str) or not _whole(world):
            raise SplitFileError(f"session={session!r} and world_size={world!r}: expected a string and an integer >= 1")
        decisions, written, checks = entry.get("decisions", []), entry.get("written", []), entry.get("checks", [])
        if not isinstance(decisions, list) or not isinstance(written, list) or not isinstance(checks, list):
            raise SplitFileError("decisions, written and checks must be lists")
        return cls(session=session, world_size=world,
                   configured=split_from_json(entry.get("configured"), "configured"),
                   split=split_from_json(entry.get("split"), "split"),
                   written=[WrittenCheckpoint.from_json(w, f"written[{i}]") for i, w in enumerate(written)],
                   decisions=[Decision.from_json(d, f"decisions[{i}]") for i, d in enumerate(decisions)],
                   ended=_optional(entry.get("ended"), str, "ended"),
                   restricted=Restriction.from_json(entry.get("restricted")),
                   checks=[ExactnessCheck.from_json(c, f"checks[{i}]") for i, c in enumerate(checks)])

    def write(self, output_dir: str, path: str | None = None) -> str:
        """Write atomically (a temporary file, then a rename) to ``path`` (None: ``output_dir``'s split file); returns
        the path. OSError on failure."""
        path = path or os.path.join(output_dir, SPLIT_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(path + ".tmp", path)
        return path

    def last(self, kind: str) -> Decision | None:
        """The latest decision of ``kind``."""
        return next((d for d in reversed(self.decisions) if d.kind == kind), None)

    def checkpoint(self, step: int) -> WrittenCheckpoint | None:
        return next((w for w in self.written if w.step == step), None)


def read_split_file(output_dir: str, warn: bool = True, session: str | None = None) -> SplitFile | None:
    """``output_dir``'s split file; None when absent, or unreadable or off the schema (one warning naming why), or —
    with ``session`` (the perf log's run) — when it is another run's record."""
    path = os.path.join(output_dir, SPLIT_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = SplitFile.from_json(json.load(f))
    except (OSError, ValueError) as error:                  # SplitFileError and JSON errors are ValueErrors
        if warn:
            logger.warning("[tuner] ignoring %s: %s", path, error)
        return None
    return record if session is None or record.session == session else None


def check_split(split: Split, *, effective_batch: int, world_size: int,
                generation_batch: int | None = None) -> str | None:
    """Why ``split`` does not fit the run, or None when it does."""
    effective = split.effective_batch(world_size)
    if effective != effective_batch:
        return (f"its effective batch {effective} ({split.micro_batch}×{split.grad_accum} over {world_size} "
                f"rank(s)) differs from the run's {effective_batch}")
    if generation_batch is None:
        if split.steps_per_generation is not None:
            return (f"it sets steps_per_generation={split.steps_per_generation} (a GRPO split) but this run has no "
                    f"generation batch")
        return None
    if split.steps_per_generation is None:
        return "it has no steps_per_generation, and this GRPO run has a generation batch"
    generation = split.generation_batch(world_size)
    if generation != generation_batch:
        return (f"its generation batch {generation} ({split.micro_batch}×{split.steps_per_generation} over "
                f"{world_size} rank(s)) differs from the run's {generation_batch}")
    return None


def split_for_run(output_dir: str, *, effective_batch: int, world_size: int,
                  generation_batch: int | None = None) -> Split | None:
    """The recorded split when it is exact for this run (see the module docstring), else None."""
    return recorded_split(read_split_file(output_dir), output_dir, effective_batch=effective_batch,
                          world_size=world_size, generation_batch=generation_batch)


def recorded_split(record: SplitFile | None, output_dir: str, *, effective_batch: int, world_size: int,
                   generation_batch: int | None = None) -> Split | None:
    """:func:`split_for_run` of a record already read (``record``, read from ``output_dir``)."""
    if record is None:
        return None
    why = check_split(record.split, effective_batch=effective_batch, world_size=world_size,
                      generation_batch=generation_batch)
    if why is not None:
        expected = f"effective batch {effective_batch} over {world_size} rank(s)" + (
            f", generation batch {generation_batch}" if generation_batch is not None else "")
        logger.warning("[tuner] ignoring %s: %s (expected %s); starting from the configured split",
                       os.path.join(output_dir, SPLIT_FILE), why, expected)
        return None
    return record.split


class RunGeometry(TypedDict):
    """The keyword arguments of :func:`split_for_run`."""

    effective_batch: int
    world_size: int
    generation_batch: int | None


def run_geometry(args: Any, world_size: int) -> RunGeometry:
    """The keyword arguments of :func:`split_for_run` for a trainer's args (as configured, before any re-size;
    ``args``: a ``TrainingArguments`` or a GRPO config, read by attribute: no transformers import)."""
    effective = Split(args.per_device_train_batch_size, args.gradient_accumulation_steps).effective_batch(world_size)
    generation = getattr(args, "generation_batch_size", None) if is_grpo(args) else None
    return {"effective_batch": effective, "world_size": world_size, "generation_batch": generation}


__all__ = [
    "SplitFile", "SplitFileError", "Decision", "Trial", "TrialFigures", "WrittenCheckpoint", "Restriction",
    "ExactnessCheck", "VERDICTS", "RunGeometry", "read_split_file", "check_split", "split_for_run", "recorded_split",
    "run_geometry", "trial_figures", "split_to_json", "split_from_json"
]
