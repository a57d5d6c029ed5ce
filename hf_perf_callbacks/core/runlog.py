"""The run log ``<output_dir>/perf_log.jsonl``: its records, every logged metric key, its writer and its one reader.

One JSON object per line, appended to across resumes and re-sizes (main process only):

===========  ===========================================================================================
``type``     record
===========  ===========================================================================================
``run``      :class:`RunHeader` — one per ``train()`` call, written by the bus with its ``session``: the
             facts the callbacks handed it (device, peaks, model, batch geometry, memory budget)
``step``     :class:`StepLine` — one per optimizer step: every callback's fields for that step and, on a
             logging step, the trainer's own log under ``log/<key>``
``event``    :class:`EventLine` — a warning, action, decision or note, with its step
``summary``  :class:`SummaryLine` — a callback's end-of-run summary
===========  ===========================================================================================

**Events.** An event's ``kind`` is one of :data:`EventKind`; its other fields are its details, one frozen type per
shape (:data:`EventDetails`), written and read through that type (:class:`EventLine`).

**Steady steps.** The meter decides a few steps late that warmup has ended (it needs confirming steps), so a
step line's ``perf/steady`` is 1 only for steps known to be steady when the line was written. From the decision on,
every step line of that ``train()`` call also carries ``perf/first_steady_step``: the steps from it up to that line
are steady too. A reader of a killed run (no summary) thus finds the meter's steady steps exactly
(:func:`hf_perf_callbacks.report.figures.steady_steps`); each step line's ``perf/train_sec`` is the training time its
throughput was computed from.

The trainer's own log in the step lines: at a logging step the bus copies every numeric value of the trainer's
training log (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``; GRPO's ``reward``, ``reward_std``,
``frac_reward_zero_std``, ``rewards/<func>/mean``, ``completions/mean_length``, ``completions/clipped_ratio``…:
whatever the trainer logged, never the callbacks' own ``perf/``, ``mem/``, ``tuner/``, ``cache/`` keys) into that
step's line as ``log/<key>`` (:data:`TRAINER_LOG`: ``log/loss``, ``log/reward``, ``log/completions/clipped_ratio``),
so that a reader needs no ``trainer_state.json``. Evaluation logs and the end-of-training summary are not copied.

:func:`read_run` is the one reader. A run header of a new session starting at step 0 is a fresh run in a reused
``output_dir``: it replaces the lines of the earlier run(s) (counted in ``replaced_runs``); a resume (the same
session, or ``resumed_from_step`` > 0) keeps them. Lines before the first run header belong to the first run. An
event logged without a step gets the step of the step line before it (before any: the session's start step), so
every event has one. A header field of another type than its own (a newer or older writer) reads as unset and is
kept in ``RunHeader.malformed`` (a summary's, in ``SummaryLine.malformed``); step values are read through
:func:`number`.

Pure: no torch, no transformers.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict, TypeGuard, TypeVar, get_args

from ..keys import *  # noqa: F403 -- the keys and file names stay importable from here (runlog.PERF_MFU)
from ..keys import PERF_LOG
from ..keys import __all__ as _KEYS

logger = logging.getLogger("hf_perf_callbacks")

HOW_TO = ("perf_log.jsonl is written into the trainer's output_dir during trainer.train() when the callbacks are "
          "attached: `from hf_perf_callbacks import default_callbacks; trainer = Trainer(..., "
          "callbacks=default_callbacks())`. `hf-perf demo --output_dir DIR` makes a sample run.")


class ReportError(ValueError):
    """The run directory cannot be reported on (missing, or without a readable perf log)."""


def number(value: object) -> float | None:
    """A logged value as a finite float, else None (bools count as 0/1: a bool is an int)."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def strict_number(value: object) -> float | None:
    """A value as a finite float when it is a number and not a bool, else None."""
    return None if isinstance(value, bool) else number(value)


#: a run header's ``launcher`` when the recipe launcher started the run (the report words its advice as recipe keys)
HF_PERF_TRAIN = "hf-perf train"
#: what a run's MFU is measured against (the run header's ``mfu_basis``): the device table's peak, a peak the user
#: gave, a matmul calibrated at the start (on wall time), or — a CPU calibrated — per CPU second of the process
MFU_BASES = ("table", "given", "calibrated", "cpu_time")

# ---------------------------------------------------------------- records

@dataclass
class RunHeader:
    """One ``train()`` call: the bus's session and the facts the callbacks handed it (None: not described)."""

    session: str | None = None
    resumed_from_step: int = 0
    sources: list[str] = field(default_factory=list)      # the callbacks that described the run
    time: float | None = None
    launcher: str | None = None                            # the command that started the run (HF_PERF_TRAIN)
    # the launcher: what the recipe it ran was written for (its ``recipe``, ``machine``, ``device_type``, ``model``,
    # ``max_completion_length``, ``memory``: the recipe's own values of the settings that size memory), before any
    # command-line override; a run on another model, device or length stood in for it
    target: dict[str, Any] = field(default_factory=dict)
    resize: bool | None = None            # True: this call continues the run after train_with_tuning's in-process
    #                                       re-size or switch of split (not a resume)
    # ThroughputMeter
    device: str | None = None
    device_type: str | None = None
    world_size: int | None = None
    grpo: bool | None = None
    token_source: str | None = None
    period: int | None = None
    peak_flops: float | None = None
    mfu_basis: str | None = None          # what MFU is against: MFU_BASES
    peak_flops_per_cpu_sec: float | None = None   # CPU, calibrated: the calibration's FLOPs per CPU second
    warmup_tolerance: float | None = None   # the meter's stable band: a step within it of the steady step is steady
    peak_bandwidth: float | None = None
    dtype: str | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    max_completion_length: int | None = None
    num_generations: int | None = None
    steps_per_generation: int | None = None
    pad_to_multiple_of: int | None = None
    temperature: float | None = None
    use_vllm: bool | None = None
    generation_backend: str | None = None      # how TRL generated: "transformers", "vllm-server", "vllm-colocate"
    vllm_enable_sleep_mode: bool | None = None
    weight_sync_steps: int | None = None       # async GRPO: optimizer steps between two weight transfers
    activation_checkpointing: bool | None = None
    model: dict[str, Any] = field(default_factory=dict)
    dataloader: dict[str, Any] = field(default_factory=dict)
    # the settings of the phases a user controls: save_strategy, save_steps, save_only_model, save_total_limit,
    # logging_strategy, logging_steps, eval_strategy, eval_steps, activation_checkpointing (as the trainer ran them)
    trainer_settings: dict[str, Any] = field(default_factory=dict)
    torch_threads: int | None = None      # torch.get_num_threads() of the training process
    cpu_cores: int | None = None          # os.cpu_count(): logical cores of the machine
    # MemoryWatchdog
    budget_gb: float | None = None
    device_limit_gb: float | None = None
    system_total_gb: float | None = None
    warn_within_steps: float | None = None    # how many steps away the wall makes the watchdog warn and act
    extra: dict[str, Any] = field(default_factory=dict)   # fields this version does not know
    malformed: dict[str, Any] = field(default_factory=dict)   # known fields of another type (another writer): unset

    def describe(self, source: str, **facts: object) -> None:
        """Add a callback's facts; an unknown fact name is a ``ValueError`` naming it and the allowed names."""
        unknown = set(facts) - _FACTS
        if unknown:
            raise ValueError(f"run facts {sorted(unknown)} from {source!r} are not allowed: expected some of "
                             f"{sorted(_FACTS)}")
        if source not in self.sources:
            self.sources.append(source)
        for name, value in facts.items():
            setattr(self, name, value)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "run"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("extra", "malformed"):
                out.update(value)
            elif value is not None and value != {}:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> RunHeader:
        """The header of a parsed line (a field of another type: in ``malformed``, see the module docstring)."""
        known, malformed = _conformed({k: v for k, v in entry.items() if k in _HEADER_FIELDS and k not in _OWN_FIELDS},
                                      HEADER_KINDS)
        sources = entry.get("sources")
        sources = ([str(s) for s in sources] if isinstance(sources, list)
                   else [str(entry["source"])] if "source" in entry else [])
        extra = {k: v for k, v in entry.items() if k not in _HEADER_FIELDS and k not in ("type", "source")}
        known["resumed_from_step"] = int(known.get("resumed_from_step") or 0)
        return cls(**known, sources=sources, extra=extra, malformed=malformed)


_HEADER_FIELDS = {f.name for f in dataclasses.fields(RunHeader)}
_OWN_FIELDS = ("sources", "extra", "malformed")
_FACTS = _HEADER_FIELDS - {"session", "resumed_from_step", "time", *_OWN_FIELDS}


def conform(value: object, kind: str) -> tuple[bool, object]:
    """(True, ``value`` as ``kind``) when it is None or of that kind — ``"int"`` (an integral finite number, not a
    bool), ``"float"`` (a finite number, not a bool), ``"bool"`` (true/false or 0/1), ``"str"``, ``"dict"``,
    ``"list"``, ``"any"`` — else (False, None): the typed accessor of a logged field."""
    if value is None:
        return True, None
    if kind in ("int", "float"):
        v = strict_number(value)
        if v is None or (kind == "int" and not v.is_integer()):
            return False, None
        return True, int(v) if kind == "int" else v
    if kind == "bool":
        return (True, bool(value)) if isinstance(value, bool) or value in (0, 1) else (False, None)
    kinds = {"str": str, "dict": dict, "list": list, "any": object}
    return (True, value) if isinstance(value, kinds[kind]) else (False, None)


def _conformed(fields: Mapping[str, Any], kinds: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``fields`` of their kind (:func:`conform`; a field without one is of any), as that kind, and the others."""
    typed: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for name, value in fields.items():
        ok, read = conform(value, kinds.get(name, "any"))
        if ok:
            typed[name] = read
        else:
            others[name] = value
    return typed, others


@dataclass
class StepLine:
    """One optimizer step: every callback's fields for it (metric key → value)."""

    step: int
    time: float | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def number(self, key: str) -> float | None:
        return number(self.values.get(key))

    def to_json(self) -> dict[str, Any]:
        return {"type": "step", "step": self.step, "time": self.time, **self.values}


#: every kind of event a callback writes: ``warning`` (said at WARNING), ``action`` (the watchdog acted), ``stop``
#: (the watchdog stopped training), ``decision`` (the tuner changed or kept the split), ``info`` (a cache clear),
#: ``note`` (informational), ``wall`` (where the memory wall is, or that it moved)
EventKind = Literal["warning", "action", "stop", "decision", "info", "note", "wall"]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)


@dataclass
class EventLine:
    """A warning, action, decision or note of one callback (``source``), with the step it happened at.

    ``details`` holds the event's fields as written (JSON); read them through the detail type of the event's shape
    (:data:`EventDetails`): ``WallMove.from_details(e.details).why``, never ``e.details["why"]``. A kind this version
    does not know (a newer writer) reads as ``info``."""

    source: str
    kind: EventKind
    message: str
    step: int | None = None
    time: float | None = None
    details: dict[str, Any] = field(default_factory=dict)   # the detail type's to_details(): see the class docstring
    step_inferred: bool = field(default=False, compare=False)   # the reader set ``step`` from the line's position

    def to_json(self) -> dict[str, Any]:
        return {"type": "event", "source": self.source, "kind": self.kind, "step": self.step,
                "message": self.message, **self.details, "time": self.time}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> EventLine:
        details = {k: v for k, v in entry.items() if k not in ("type", "source", "kind", "message", "step", "time")}
        step = number(entry.get("step"))
        kind = entry.get("kind")
        return cls(str(entry.get("source", "?")), kind if _is_event_kind(kind) else "info",
                   str(entry.get("message", "")), int(step) if step is not None else None, number(entry.get("time")),
                   details)


def _is_event_kind(kind: object) -> TypeGuard[EventKind]:
    return kind in EVENT_KINDS


# ---------------------------------------------------------------- event details
# ``to_details`` gives the JSON fields exactly as the perf log holds them (their order, and which are written as
# null); ``from_details`` tolerates any log: a missing field or one of another type (or empty text) reads as None.

def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _split_args(value: object) -> dict[str, Any] | str | None:
    """A logged split: the trainer arguments that set it (a mapping), or a string as it is."""
    return value if isinstance(value, (dict, str)) else None


#: how :meth:`_Details.from_details` reads a field, by its annotation
_READERS: dict[str, Callable[[object], object]] = {"float | None": strict_number, "str | None": _text,
                                                   "bool": lambda value: value is not False,
                                                   "dict[str, Any] | str | None": _split_args}
_D = TypeVar("_D", bound="_Details")


class _Details:
    """Writes every field of a detail type in order (:meth:`to_details`) and reads each back by its annotation."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_details(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_details(cls: type[_D], details: Mapping[str, Any]) -> _D:
        return cls(**{f.name: _READERS[str(f.type)](details.get(f.name)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class StopFigures(_Details):
    """What a watchdog stop adds to its :class:`ActionDetails`: the memory held outside the run, the memory the
    next steps need beyond the budget, the budget (GiB; None: not known)."""

    outside_gb: float | None
    need_gb: float | None
    budget_gb: float | None


@dataclass(frozen=True)
class ActionDetails(_Details):
    """A ``mem`` ``action`` or ``stop`` event: the watchdog's action (``clear_cache``, ``smaller_batch``, ``stop``,
    ``stop_suppressed``), its pressure level then, the steps to the wall then, and a stop's figures."""

    action: str | None
    level: str | None = None
    steps_to_wall: float | None = None
    stop: StopFigures | None = None

    def to_details(self) -> dict[str, Any]:
        return {"action": self.action, "level": self.level, "steps_to_wall": self.steps_to_wall,
                **(self.stop.to_details() if self.stop is not None else {})}

    @classmethod
    def from_details(cls, details: Mapping[str, Any]) -> ActionDetails:
        action = details.get("action")
        stopped = any(k in details for k in ("outside_gb", "need_gb", "budget_gb"))
        return cls(str(action) if action is not None else None, _text(details.get("level")),
                   strict_number(details.get("steps_to_wall")), StopFigures.from_details(details) if stopped else None)


@dataclass(frozen=True)
class WallMove(_Details):
    """A ``mem`` ``wall`` event: where the memory wall is (``moved`` False: at the start) and why (None: no cause
    known), the budget now and before, the memory outside the run and what the run can reach (GiB)."""

    why: str | None
    moved: bool = True
    budget_gb: float | None = None
    before_gb: float | None = None
    outside_gb: float | None = None
    reachable_gb: float | None = None


@dataclass(frozen=True)
class DecisionDetails(_Details):
    """A ``tuner`` ``decision`` event: the split before and after (the trainer arguments that set it), what the
    decision cost beyond training and its expected saving (seconds)."""

    old_split: dict[str, Any] | str | None
    new_split: dict[str, Any] | str | None
    cost_sec: float | None = None
    expected_gain_sec: float | None = None

    @classmethod
    def from_details(cls, details: Mapping[str, Any]) -> DecisionDetails | None:   # type: ignore[override]
        """The decision's details, or None for an event without a new split (not a decision)."""
        return super().from_details(details) if "new_split" in details else None


@dataclass(frozen=True)
class CacheClear(_Details):
    """A ``cache`` ``info`` event: the memory a clear freed (GB) and the seconds it took."""

    freed_gb: float | None
    seconds: float | None = None


@dataclass(frozen=True)
class NoteDetails(_Details):
    """A ``note`` event's details: what the note says is needed (``train_with_tuning``: the tuner is attached but
    no re-size can happen without it)."""

    needs: str | None


@dataclass(frozen=True)
class WarningFigures(_Details):
    """The figures of a ``warning`` event (each warning writes the ones it is about; None: not written): a leak's
    growth per step (MiB), the completion length at which a step stops fitting and the steps until then, the
    model's forward passes per micro-batch, the share of time spent waiting for data."""

    leak_mib_per_step: float | None = None
    completion_wall_tokens: float | None = None
    steps_to_wall: float | None = None
    forwards_per_microbatch: float | None = None
    data_wait_fraction: float | None = None

    def to_details(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_details().items() if v is not None}


#: the details of an event, one type per shape (:meth:`EventLine.details` holds their ``to_details()``)
EventDetails = ActionDetails | WallMove | DecisionDetails | CacheClear | NoteDetails | WarningFigures


class _MeterSummaryBase(TypedDict):
    steps: int
    tokens: float
    train_seconds: float
    warmup_done: bool
    warmup_steps: int | None
    warmup_overhead_sec: float
    first_step_slowdown: float | None
    steady_step_sec: float | None
    steady_tokens_per_sec: float | None
    mean_tokens_per_sec: float | None
    phases: dict[str, float]
    device: str
    world_size: int
    peak_flops: float | None
    warmup_measured_on: str
    first_steady_step: int | None
    steady_step_count: int
    early_contention_sec: float
    contention_steps: list[int]


class MeterSummary(_MeterSummaryBase, total=False):
    """The ThroughputMeter's end-of-run summary (``source="perf"``); ``mfu`` and ``hfu`` only when the device's
    peak is known. A run too short for steady figures (warmup not decided) has ``provisional: True`` and its rate
    over the steps it has (``provisional_tokens_per_sec``, ``provisional_step_sec``, ``provisional_steps``: first
    and last step); its ``mfu``/``hfu`` are then of that provisional rate."""

    mfu: float
    hfu: float
    provisional: bool
    provisional_tokens_per_sec: float
    provisional_step_sec: float
    provisional_steps: list[int]
    phase_sec: dict[str, float]            # seconds per phase, the whole run (the steps and the tail)
    tail_phase_sec: dict[str, float]       # seconds per phase after the last step (its log, evaluation, save)
    callback_sec: dict[str, dict[str, float]]   # callback class → event → seconds (the meter's own left out)
    recompute_clocked: bool                # the recompute phase was clocked (a CPU with gradient checkpointing)
    tail_callback_sec: dict[str, float]    # callback class → seconds after the last step (in callback_sec too)
    compute_metrics_sec: float             # seconds in the trainer's compute_metrics (inside the eval phase)
    warmup_in_band: bool | None            # the latest call's warmup steps each within the stable band of steady


class WatchdogAction(TypedDict):
    """One rung of the MemoryWatchdog's ladder it took: at which step, which action, and why."""

    step: int | None
    action: str | None
    message: str | None


class WatchdogSummary(TypedDict):
    """The MemoryWatchdog's end-of-run summary (``source="mem"``)."""

    high_water_gb: float
    budget_gb: float
    actions: list[WatchdogAction]
    stopped_at: int | None


class ClearerSummary(TypedDict):
    """The MPSCacheClearer's end-of-run summary (``source="cache"``)."""

    clears: int
    freed_gb: float
    seconds: float
    interval: int


def _kinds(summary: type) -> dict[str, str]:
    """Each key's :func:`conform` kind, from its annotation (``"int | None"`` → ``"int"``, ``"list[int]"`` →
    ``"list"``)."""
    return {name: str(getattr(kind, "__forward_arg__", kind)).split(" |")[0].split("[")[0]
            for name, kind in summary.__annotations__.items()}


#: the type of each run header field, and of each summary value the readers use per source (:func:`conform`'s
#: kinds): read off their types
HEADER_KINDS = _kinds(RunHeader)
SUMMARY_KINDS = {"perf": _kinds(MeterSummary), "mem": _kinds(WatchdogSummary), "cache": _kinds(ClearerSummary)}


@dataclass
class SummaryLine:
    """A callback's end-of-run summary. A value of another type than :data:`SUMMARY_KINDS` gives it (a newer or
    older writer) reads as absent and is kept in ``malformed``."""

    source: str
    values: dict[str, Any] = field(default_factory=dict)
    malformed: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": "summary", "source": self.source, **self.values, **self.malformed}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> SummaryLine:
        source = str(entry.get("source"))
        values, malformed = _conformed({k: v for k, v in entry.items() if k not in ("type", "source")},
                                       SUMMARY_KINDS.get(source, {}))
        return cls(source, values, malformed)


Record = RunHeader | StepLine | EventLine | SummaryLine
_RECORDS: dict[object, type[RunHeader] | type[EventLine] | type[SummaryLine]] = {
    "run": RunHeader, "event": EventLine, "summary": SummaryLine}


def parse_record(entry: object) -> RunHeader | EventLine | SummaryLine | None:
    """The run header, event or summary of one parsed JSON line; None for anything else (a step line is read by
    :func:`parse_lines`, compact: :class:`ReadStep`)."""
    if not isinstance(entry, dict):
        return None
    record = _RECORDS.get(entry.get("type"))
    return record.from_json(entry) if record is not None else None


# ---------------------------------------------------------------- writer
class LogWriter:
    """Appends records to ``<output_dir>/perf_log.jsonl``. A failed write (full disk, read-only directory) logs one
    warning per file and training goes on; later writes are tried again, silently. A last line cut short (a process
    killed while writing it) is ended before the next record is appended, so that record is a line of its own (the
    cut line stays, unreadable and counted by the reader)."""

    def __init__(self) -> None:
        self.failed: set[str] = set()

    def append(self, output_dir: str | None, record: Record) -> bool:
        """Append ``record``; False when it could not be written (or there is no ``output_dir``)."""
        if not output_dir:
            return False
        path = os.path.join(output_dir, PERF_LOG)
        line = (json.dumps(record.to_json(), default=_jsonable) + "\n").encode("utf-8")
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(path, "ab+") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line          # the last line was cut: end it first
                f.write(line)
        except OSError as error:  # a full disk must not stop training
            if path not in self.failed:
                self.failed.add(path)
                logger.warning("could not write %s: %s (warned once; the perf log misses the lines that fail)",
                               path, error)
            return False
        return True


def _jsonable(value: object) -> object:
    if hasattr(value, "item"):          # a 0-d tensor or numpy scalar
        return value.item()
    return str(value)


# ---------------------------------------------------------------- reader
class ReadStep:
    """A step line as the reader keeps it: read-only and compact (the same reading interface as :class:`StepLine`:
    ``step``, ``time``, ``values``, :meth:`get`, :meth:`number`). The finite numbers of a line
    are one ``array('d')`` under a key tuple shared by every line with the same keys (8 bytes a value, a long run's
    log in a bounded share of memory); any other value (None, a string, a flag, a list) is kept as written."""

    __slots__ = ("step", "time", "_keys", "_numbers", "_others")

    def __init__(self, step: int, time: float | None, keys: _KeyIndex, numbers: array[float],
                 others: dict[str, Any] | None = None):
        self.step, self.time, self._keys, self._numbers, self._others = step, time, keys, numbers, others

    @property
    def values(self) -> Mapping[str, Any]:
        """The line's fields (metric key → value), read-only."""
        return LogRow(self, "", step=False)

    def get(self, key: str, default: Any = None) -> Any:
        others = self._others
        if others is not None and key in others:
            return others[key]
        at = self._keys.get(key)
        return default if at is None else self._numbers[at]

    def number(self, key: str) -> float | None:
        return number(self.get(key))

    def has_prefix(self, prefix: str) -> bool:
        """Whether any field's key starts with ``prefix``."""
        return bool(self._keys.prefixed(prefix)) or any(k.startswith(prefix) for k in self._others or ())

    def non_numbers(self) -> list[str]:
        """The keys whose value is not a finite number (None aside)."""
        bad = [k for k, v in (self._others or {}).items() if v is not None and number(v) is None]
        total = sum(self._numbers)
        if total - total != 0.0:                                 # an inf or a nan somewhere: find them
            bad += [k for k, v in zip(self._keys, self._numbers) if v - v != 0.0]
        return bad

    def __repr__(self) -> str:
        return f"ReadStep(step={self.step}, time={self.time}, values={dict(self.values)!r})"


class LogRow(Mapping[str, Any]):
    """The fields of a step line under ``prefix`` as a read-only mapping over the line, the prefix removed, without
    copying it: the trainer's own log of one step (``log/reward`` read as ``reward``, and ``step``), or every field
    (no prefix, no ``step``: :attr:`ReadStep.values`). A long run's logs cost a small object each."""

    __slots__ = ("_line", "_prefix", "_step")

    def __init__(self, line: ReadStep, prefix: str, step: bool = True):
        self._line, self._prefix, self._step = line, prefix, step

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        if key == "step" and self._step:
            return self._line.step
        return self._line.get(self._prefix + key, default)

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        yield from (k[n:] for k, _ in self._line._keys.prefixed(self._prefix))
        if self._line._others:
            yield from (k[n:] for k in self._line._others if k.startswith(self._prefix))
        if self._step:
            yield "step"

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _MISSING) is not _MISSING


class _KeyIndex(dict[str, int]):
    """A key set's positions (key → index into a line's numbers), shared by every line with those keys; it keeps
    the keys under each prefix asked for."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__((k, i) for i, k in enumerate(names))
        self._prefixed: dict[str, list[tuple[str, int]]] = {}

    def prefixed(self, prefix: str) -> list[tuple[str, int]]:
        found = self._prefixed.get(prefix)
        if found is None:
            found = self._prefixed[prefix] = [(k, i) for k, i in self.items() if k.startswith(prefix)]
        return found


_MISSING = object()
_STEP_HEAD = ("type", "step", "time")


def _pack(entry: dict[str, Any], key_sets: dict[tuple[str, ...], _KeyIndex]) -> ReadStep | None:
    """A parsed step entry as a :class:`ReadStep` line, sharing one key index per distinct key set."""
    step = number(entry.get("step"))
    if step is None:
        return None
    names = tuple(entry)
    values = list(entry.values())
    if names[:3] == _STEP_HEAD:                           # the writer's order: type, step, time first
        names, values = names[3:], values[3:]
    else:
        kept = [(k, v) for k, v in zip(names, values) if k not in _STEP_HEAD]
        names, values = tuple(k for k, _ in kept), [v for _, v in kept]
    others: dict[str, Any] | None = None
    try:
        numbers = array("d", values)                        # numbers (a flag reads as 0/1, as number() does)
    except TypeError:                                       # None, strings, lists: kept as they are
        others = {k: v for k, v in zip(names, values) if not isinstance(v, (int, float))}
        pairs = [(k, v) for k, v in zip(names, values) if k not in others]
        names, numbers = tuple(k for k, _ in pairs), array("d", [v for _, v in pairs])
    index = key_sets.get(names)
    if index is None:
        index = key_sets[names] = _KeyIndex(names)
    return ReadStep(int(step), number(entry.get("time")), index, numbers, others)


@dataclass
class RunLog:
    """A parsed run directory: the latest run's headers, step lines and events, and the summaries written after its
    last header (a resumed session killed before its end shows no stale summary)."""

    output_dir: str
    headers: list[RunHeader] = field(default_factory=list)
    steps: list[ReadStep] = field(default_factory=list)
    events: list[EventLine] = field(default_factory=list)
    summaries: dict[str, SummaryLine] = field(default_factory=dict)
    skipped_lines: int = 0
    replaced_runs: int = 0          # earlier runs started afresh in the same output_dir, dropped
    _unique: tuple[int, list[ReadStep]] | None = field(default=None, repr=False, compare=False)
    #: what the readers computed once from this run (``figures.figures``): the report, plots and analysis share it
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def column(self, key: str) -> array[float]:
        """``key``'s value on every line of :meth:`unique_steps`, in order, as one array (NaN where a line has no
        finite number under it); read once per parsed run and kept (8 bytes a line), so that the readers pass over
        a long run's lines once per key, not once per figure."""
        name = "column:" + key
        found = self.cache.get(name)
        if found is None:
            nan = math.nan
            values: list[float] = []
            append = values.append
            last_index: _KeyIndex | None = None
            at: int | None = None
            for line in self.unique_steps():
                if line._keys is not last_index:            # a key set's position of ``key``, looked up once
                    last_index, at = line._keys, line._keys.get(key)
                if line._others is not None and key in line._others:
                    v = number(line._others[key])
                    append(nan if v is None else v)
                elif at is None:
                    append(nan)
                else:
                    v = line._numbers[at]
                    append(v if v - v == 0.0 else nan)
            found = self.cache[name] = array("d", values)
        return found

    def step_numbers(self) -> list[int]:
        """The step of every line of :meth:`unique_steps`, in order."""
        found = self.cache.get("steps")
        if found is None:
            found = self.cache["steps"] = [s.step for s in self.unique_steps()]
        return found

    def keys_logged(self) -> frozenset[str]:
        """Every key the step lines hold (from each distinct key set once, not from every line)."""
        sets = {id(s._keys): s._keys for s in self.steps}
        others = {k for s in self.steps if s._others for k in s._others}
        return frozenset(k for index in sets.values() for k in index) | others

    def unique_steps(self) -> list[ReadStep]:
        """Step lines ordered by step, one per step (a step re-run after a resume keeps its latest line); computed
        once per parse."""
        if self._unique is None or self._unique[0] != len(self.steps):
            by_step = {s.step: s for s in self.steps}
            self._unique = (len(self.steps), [by_step[k] for k in sorted(by_step)])
        return self._unique[1]

    def summary(self, source: str) -> dict[str, Any]:
        """The summary of ``source`` ("perf", "mem", "cache", "tuner"), or {} when none was written."""
        found = self.summaries.get(source)
        return found.values if found else {}

    def header(self, source: str | None = None) -> RunHeader:
        """The latest run header (described by ``source`` when given), or an empty one."""
        for h in reversed(self.headers):
            if source is None or source in h.sources:
                return h
        return RunHeader()


def parse_lines(lines: Iterable[str], output_dir: str = "") -> RunLog:
    """Parse perf-log lines, one at a time (see the module docstring for fresh runs and resumes); garbled lines are
    counted. Step lines are kept compact (:class:`ReadStep`)."""
    run = RunLog(output_dir=output_dir)
    key_sets: dict[tuple[str, ...], _KeyIndex] = {}           # one key index per distinct key set of the lines
    summaries: dict[str, SummaryLine] = {}
    session = None
    current = 0                                         # the step the latest step line completed
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except (ValueError, TypeError):
            entry = None
        if isinstance(entry, dict) and entry.get("type") == "step":
            read = _pack(entry, key_sets)
            if read is None:
                run.skipped_lines += 1
                continue
            run.steps.append(read)
            current = read.step
            continue
        record = parse_record(entry)
        if record is None:
            run.skipped_lines += 1
        elif isinstance(record, RunHeader):
            if record.session is not None and record.session != session:
                if run.headers and not record.resumed_from_step and (run.steps or run.events):
                    run.replaced_runs += 1              # a fresh run in a reused output_dir: start over
                    run.headers, run.steps, run.events = [], [], []
                session = record.session
            run.headers.append(record)
            summaries = {}
            current = record.resumed_from_step
        elif isinstance(record, EventLine):
            if record.step is None:                     # logged without one: after the step completed before it
                record.step, record.step_inferred = current, True
            run.events.append(record)
        else:
            summaries[record.source] = record
    run.summaries = summaries
    return run


def read_run(output_dir: str | os.PathLike[str]) -> RunLog:
    """Read ``OUTPUT_DIR/perf_log.jsonl`` line by line. Raises :class:`ReportError` (a ``ValueError``) when
    ``output_dir`` is not a directory, has no perf log, or the log holds nothing readable."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        raise ReportError(f"{output_dir!r} is not a directory: expected a training run's output_dir holding "
                          f"{PERF_LOG}. {HOW_TO}")
    path = os.path.join(output_dir, PERF_LOG)
    if not os.path.isfile(path):
        raise ReportError(f"no {PERF_LOG} in {output_dir!r}: the run was trained without the hf_perf_callbacks "
                          f"callbacks, or this is not its output_dir. {HOW_TO}")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            run = parse_lines(f, output_dir)
    except OSError as error:
        raise ReportError(f"cannot read {path}: {error}") from error
    if not (run.headers or run.steps or run.events or run.summaries):
        what = f"only {run.skipped_lines} unreadable line(s)" if run.skipped_lines else "nothing"
        raise ReportError(f"{path} holds {what}: the run stopped before its first step was logged, or the log was "
                          f"written by something else. {HOW_TO}")
    return run


__all__ = [
    "HOW_TO", "ReportError", "number", "strict_number", "RunHeader", "HEADER_KINDS", "conform", "StepLine", "EventKind",
    "EVENT_KINDS", "EventLine", "StopFigures", "ActionDetails", "WallMove", "DecisionDetails", "CacheClear",
    "NoteDetails", "WarningFigures", "EventDetails", "MeterSummary", "WatchdogAction", "WatchdogSummary",
    "ClearerSummary", "SUMMARY_KINDS", "SummaryLine", "Record", "parse_record", "LogWriter", "ReadStep", "LogRow",
    "RunLog", "parse_lines", "read_run"
]
__all__ += _KEYS        # the keys and file names, importable from here too
