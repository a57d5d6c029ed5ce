"""The training step's rules: waiting for data, duplicate forwards, padding, the micro-batch (and the tuner's
measurement of it).
"""
from __future__ import annotations

import dataclasses
import math

from ...core.dataloader import dataloader_changes
from ...core.splitfile import Decision, trial_figures
from ...core.wording import split_label
from ..facts import DuplicateForward, FixedLength, InputBound, MemoryCap, Padding, SmallSplit, TunerMeasured
from ..model import Finding, Measurements, Note, Setting, card
from ..words import finding, note
from .advice import (
    _memory_cap,
    _phase,
    _saved,
    _split_setting,
    _splits,
    _under_pressure,
)
from .basis import CALIBRATION, _calibrated, _too_short
from .run import rule_tuning_cost

DATA_WAIT_FRACTION = 0.1
SMALL_MICRO_BATCH = 2
LOW_MFU = 0.2
HIGH_COMPUTE_SHARE = 0.5
DUPLICATE_FORWARDS = 1.05
PAD_FRACTION = 0.2


@card(finding=f"data wait ≥ {DATA_WAIT_FRACTION:.0%} → DataLoader settings",
      gain=f"calibrated on CUDA (within {CALIBRATION[('input_bound', 'cuda')][1]:.0%}); not on CPUs (missed by "
                "38%, below)")
def rule_input_bound(m: Measurements) -> Finding | None:
    f = _phase(m, "data_wait")
    if f < DATA_WAIT_FRACTION or _too_short(m):
        return None
    dl = m.dataloader or {}
    workers = dl.get("num_workers") or 0
    changes = dataloader_changes(m.device_type, dl)
    setting: Setting = {k: v for _, keys_set in changes for k, v in keys_set.items()}
    predicted = 1.0 / (1.0 - f)
    gain, basis, confidence, calibration = _calibrated("input_bound", m, predicted)
    return finding("input_bound", "no_workers" if workers == 0 else "workers_behind",
                   InputBound(f, m.device_type, predicted, dl, calibration), setting, gain, confidence, basis,
                   predicted, stake_sec=m.phase_sec.get("data_wait"))


def _tune_note(m: Measurements, d: Decision) -> Note | None:
    """The tuner's measurement ``d`` (``m.tune``) of splits on this run's own steps, trial by trial, worded once
    (:func:`~hf_perf_callbacks.core.splitfile.trial_figures`: the numbers the console, the summary and the plots print).
    Checked and fine only when it measured another split and did not cost more than it saves (then
    :func:`rule_tuning_cost` speaks); not judged when it measured none."""
    figures_ = trial_figures(d)
    measured = len([t for t in figures_ if t.measured])
    if not [t for t in figures_ if t.status != "reference" and t.measured]:
        return note("small_micro_batch", "tuner_measured_none", TunerMeasured(d, measured, None), judged=False)
    if rule_tuning_cost(m) is not None:
        return None
    return note("small_micro_batch", "tuner_measured", TunerMeasured(d, measured, _memory_cap(m)[1]))


def _small_split_applies(m: Measurements) -> bool:
    """A small micro-batch with accumulation, no memory pressure, the timings judged, and the device under-used
    (low MFU; unknown: a high compute share)."""
    mb, ga, c = m.micro_batch, m.grad_accum, _phase(m, "compute")
    if not (mb and ga and mb <= SMALL_MICRO_BATCH and ga >= 2) or _under_pressure(m) or _too_short(m):
        return False
    if m.mfu is not None and m.mfu >= LOW_MFU:
        return False
    return c > 0 and (m.mfu is not None or c >= HIGH_COMPUTE_SHARE)


@card(finding=f"micro-batch ≤ {SMALL_MICRO_BATCH}, low MFU, no tuner measurement → a larger exact split (never one "
              "that ran out of memory), or the tuner",
      gain="no",
      note="the tuner measured another split and paid: its trials (fine); it measured none: not judged")
def rule_small_micro_batch(m: Measurements) -> Finding | Note | None:
    if m.tune:
        return _tune_note(m, m.tune)
    mb, ga, c = m.micro_batch, m.grad_accum, _phase(m, "compute")
    if not _small_split_applies(m) or not mb or not ga:
        return None
    cap, hit = _memory_cap(m)
    larger = sorted((s for s in _splits(m) if s.micro_batch > mb), key=lambda s: s.micro_batch)
    splits = [s for s in larger if cap is None or s.micro_batch <= cap]
    if not splits:
        return note("small_micro_batch", "memory_cap", MemoryCap(mb, ga, hit)) if larger and hit else None
    manual = next((s for s in splits if s.micro_batch >= 4 * mb), splits[-1])
    return finding("small_micro_batch", "small_split",
                   SmallSplit(mb, ga, max(1, m.world_size or 1), m.mfu, c, tuple(split_label(s) for s in splits[:6]),
                              hit, m.device_type, m.grpo, bool(m.launcher), m.tuner_attached),
                   _split_setting(m, manual), None, "low", "try", None)


@card(finding=f"> {DUPLICATE_FORWARDS:g} grad-enabled forwards per micro-batch → a code fix",
      gain="calibrated (CPU, CUDA)")
def rule_duplicate_forward(m: Measurements) -> Finding | None:
    f = m.forwards_per_microbatch
    if f is None or f <= DUPLICATE_FORWARDS:
        return None
    c = _phase(m, "compute") or 1.0
    predicted = 1.0 / ((1.0 - c) + c / f)              # compute, c of the time, runs f forwards where 1 would do
    gain, basis, confidence, calibration = _calibrated("duplicate_forward", m, predicted)
    return finding("duplicate_forward", "grad_forwards", DuplicateForward(f, c, predicted, calibration), {}, gain,
                   confidence, basis, predicted, stake_sec=_saved(m, predicted))


def _padded_sec(m: Measurements, p: float, c: float) -> float | None:
    """The seconds of compute spent on pad positions, at most (the pad share of the compute seconds)."""
    return p * c * m.wall_sec if m.wall_sec else None


@card(finding="a Trainer padded to one length on every step (`perf/seq_len` constant) → per-batch padding first "
              "(grouping cannot shorten a fixed length; for an `SFTTrainer` run, recognised by its own logs, "
              "SFTTrainer's own collator, not transformers' `DataCollatorForLanguageModeling`); "
              "`pad_to_multiple_of` off MPS → `null`; per-batch padding → `group_by_length` (try)",
      gain="calibrated on CPUs (`pad_to_multiple_of`); try elsewhere, and no ceiling the log cannot support (one "
           "padded length on every step cannot tell the per-step costs that do not shrink from those that do)",
      note="GRPO padding to the longest completion")
def rule_padding_waste(m: Measurements) -> Finding | Note | None:
    p = m.pad_fraction
    if p is None or p < PAD_FRACTION:
        return None
    c = _phase(m, "compute")
    if m.fixed_seq_len and not m.grpo:           # per-batch padding first: grouping cannot shorten a fixed length
        return finding("padding_waste", "fixed_length", FixedLength(m.fixed_seq_len, p, c, m.trainer_kind, m.steps),
                       {}, None, "medium", "try", None, stake_sec=_padded_sec(m, p, c))
    k = m.pad_to_multiple_of or 0
    facts = Padding(p, k, m.seq_len, m.grpo, compute=c)
    if k > 1 and m.device_type != "mps":
        parts = 2 if m.grpo else 1               # GRPO pads prompts and completions separately to the multiple
        length = m.seq_len_mean or m.seq_len
        r = min(p, parts * (k - 1) / 2 / length) if length else None
        if r is None or c <= 0:
            return finding("padding_waste", "pad_to_multiple", facts, {"pad_to_multiple_of": None}, None, "low",
                           "try", None, stake_sec=_padded_sec(m, p, c))
        predicted = 1.0 / ((1.0 - c) + c * (1.0 - r))
        gain, basis, confidence, calibration = _calibrated("padding_waste", m, predicted)
        facts = dataclasses.replace(facts, rounding_share=r, pad_parts=parts, mean_length=length,
                                    predicted=predicted, calibration=calibration)
        return finding("padding_waste", "pad_to_multiple", facts, {"pad_to_multiple_of": None}, gain, confidence,
                       basis, predicted, stake_sec=_saved(m, predicted))
    if m.grpo:
        per_batch = math.ceil((m.micro_batch or 1) / (m.num_generations or 1))
        return note("padding_waste", "grpo_inherent", dataclasses.replace(facts, prompts_per_micro_batch=per_batch))
    if m.seq_len_min is not None and m.seq_len_min == m.seq_len:   # one length on fewer steps than tell a fixed one
        return finding("padding_waste", "one_length_unsure", facts, {}, None, "low", "try", None,
                       stake_sec=_padded_sec(m, p, c))
    return finding("padding_waste", "per_batch", facts, {"train_sampling_strategy": "group_by_length"}, None, "low",
                   "try", None, stake_sec=_padded_sec(m, p, c))
