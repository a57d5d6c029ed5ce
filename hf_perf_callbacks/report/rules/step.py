"""The training step's rules: waiting for data, duplicate forwards, padding, the micro-batch (and the tuner's
measurement of it).
"""
from __future__ import annotations

import math

from ...dataloader import dataloader_changes
from ...splitfile import Decision, trial_figures
from ..model import MIN_FIXED_LENGTH_STEPS, Facts, Finding, Measurements, Note, Setting, card
from .advice import (
    _amdahl,
    _bullets,
    _memory_cap,
    _memory_cap_facts,
    _pct,
    _phase,
    _split_name,
    _split_setting,
    _splits,
    _tuner_how,
    _under_pressure,
    _yaml,
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
    settings = ", ".join(f"{k}={dl.get(k)}" for k in ("num_workers", "persistent_workers", "prefetch_factor",
                                                         "pin_memory") if k in dl)
    obs = f"The device waited for data {_pct(f)} of the wall time (data-wait phase)" + \
          (f"; DataLoader: {settings}." if settings else ".")
    if workers == 0:
        root = ("Batches are loaded, tokenized and collated on the training process between steps "
                "(`dataloader_num_workers` 0), serially with compute, so the device idles while the CPU prepares "
                "the next batch.")
    else:
        root = f"{workers} DataLoader workers cannot keep up: preparing a batch takes longer than computing one."
    changes = dataloader_changes(m.device_type, dl)
    lines = [line for line, _ in changes]
    setting: Setting = {k: v for _, keys_set in changes for k, v in keys_set.items()}
    predicted = 1.0 / (1.0 - f)
    gain, basis, confidence, formula = _calibrated(
        "input_bound", m, predicted,
        f"workers hide the measured wait: 1/(1 − {f:.2f}) = {predicted:.2f}x")
    return Finding("input_bound", "Input-bound: the device waits for data", obs, root, _bullets(lines), gain,
                   formula, confidence, setting, basis, predicted, reason="no_workers" if workers == 0 else
                   "workers_behind", facts={"data_wait": f, "num_workers": workers})


def _tune_note(m: Measurements, d: Decision) -> Note | None:
    """The tuner's measurement ``d`` (``m.tune``) of splits on this run's own steps, trial by trial, worded once
    (:func:`~hf_perf_callbacks.splitfile.trial_figures`: the numbers the console, the summary and the plots print).
    Checked and fine only when it measured another split and did not cost more than it saves (then
    :func:`rule_tuning_cost` speaks); not judged when it measured none."""
    figures_ = trial_figures(d)
    measured = [t for t in figures_ if t.status != "reference" and t.measured]
    kept = (f"kept the configured {_split_name(d.old)}" if d.new == d.old
            else f"switched from {_split_name(d.old)} to {_split_name(d.new)}")
    reason = f" (the tuner's reason: {d.reason})" if d.reason else ""
    facts: Facts = {"old": _split_name(d.old), "new": _split_name(d.new), "step": d.step,
                    "measured": len([t for t in figures_ if t.measured]), "cost_sec": d.cost_sec,
                    "expected_gain_sec": d.expected_gain_sec, "tuner_reason": d.code, "ended_by": d.ended_by}
    if not measured:
        tried = "; ".join(t.words() for t in figures_ if t.status != "reference")
        base = next((t for t in figures_ if t.status == "reference"), None)
        return Note("small_micro_batch", "Batch split not measured",
                    f"The tuner {kept} at step {d.step} without measuring another split{reason}"
                    + (f"; {base.words()}" if base is not None else "")
                    + (f"; {tried}" if tried else "") + ".", judged=False, reason="tuner_measured_none", facts=facts)
    if rule_tuning_cost(m) is not None:
        return None
    cost = (f" Measuring cost {d.cost_sec:.1f} s" if d.cost_sec is not None else "") + (
        f"; expected saving {d.expected_gain_sec:.1f} s over the rest of the run" if d.expected_gain_sec is not None
        else "") + ("." if d.cost_sec is not None or d.expected_gain_sec is not None else "")
    _, limit = _memory_cap(m)
    return Note("small_micro_batch", "Batch split chosen by measurement",
                f"The tuner measured {len([t for t in figures_ if t.measured])} split(s) on this run's own training "
                f"steps ({'; '.join(t.words() for t in figures_)}) and {kept} at step {d.step}{reason}." + cost
                + (f" No larger micro-batch is advised: {limit}." if limit else ""), reason="tuner_measured",
                facts={**facts, **_memory_cap_facts(m)})


def _small_split_applies(m: Measurements) -> bool:
    """A small micro-batch with accumulation, no memory pressure, the timings judged, and the device under-used
    (low MFU; unknown: a high compute share)."""
    mb, ga, c = m.micro_batch, m.grad_accum, _phase(m, "compute")
    if not (mb and ga and mb <= SMALL_MICRO_BATCH and ga >= 2) or _under_pressure(m) or _too_short(m):
        return False
    if m.mfu is not None and m.mfu >= LOW_MFU:
        return False
    return c > 0 and (m.mfu is not None or c >= HIGH_COMPUTE_SHARE)


def _small_split_root(m: Measurements, ga: int) -> str:
    if m.device_type == "cpu":
        return ("Each micro-batch pays fixed costs (Python and autograd set-up, adapter dispatch, the optimizer's "
                f"accumulation) {ga} times per optimizer step; on a CPU the matmuls of a larger micro-batch run at "
                "about the same FLOP rate, so only those fixed costs can shrink — whether they matter is measured, "
                "not known in advance.")
    return ("With 1–2 sequences per micro-batch the matmuls are too thin to fill the device: each micro-batch "
            f"pays its kernel launches and a forward/backward at low arithmetic intensity, {ga} times per "
            "optimizer step.")


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
    world = max(1, m.world_size or 1)
    effective = mb * ga * world
    cap, why = _memory_cap(m)
    larger = sorted((s for s in _splits(m) if s.micro_batch > mb), key=lambda s: s.micro_batch)
    splits = [s for s in larger if cap is None or s.micro_batch <= cap]
    if not splits:
        if larger and why:
            return Note("small_micro_batch", "Micro-batch kept small by memory",
                        f"Micro-batch {mb} × accumulation {ga}: no larger micro-batch is advised, because {why}.",
                        reason="memory_cap", facts={"micro_batch": mb, "grad_accum": ga, **_memory_cap_facts(m)})
        return None
    manual = next((s for s in splits if s.micro_batch >= 4 * mb), splits[-1])
    setting = _split_setting(m, manual)
    obs = (f"Micro-batch {mb} × accumulation {ga}" + (f" × {world} devices" if world > 1 else "")
           + f" (effective batch {effective})"
           + (f"; MFU {_pct(m.mfu)}" if m.mfu is not None else "") + f"; compute {_pct(c)} of the wall time"
           + (f"; {why}, so nothing above micro-batch {cap} is advised" if why else "") + ".")
    listed = ", ".join(f"{s.micro_batch}×{s.grad_accum}" for s in splits[:6])
    rec = (f"Try {_yaml(setting)} (effective batch {effective} unchanged"
           + (", the generation batch and GRPO's groups too" if m.grpo else "") + f"), or measure instead of "
           f"guessing: {_tuner_how(m)}; the tuner times the exact splits ({listed}) on the run's own steps and keeps "
           f"the fastest that fits memory.")
    return Finding("small_micro_batch", "Small micro-batch", obs, _small_split_root(m, ga), rec, None,
                   "not predicted: a larger micro-batch helps only where per-micro-batch costs dominate (measured "
                   "on GPUs, not on every CPU); the tuner measures it", "low", setting, "try", None,
                   reason="small_split", facts={"micro_batch": mb, "grad_accum": ga, "world_size": world,
                                                "effective_batch": effective, "mfu": m.mfu, "compute": c,
                                                "splits": listed, **_memory_cap_facts(m)})


@card(finding=f"> {DUPLICATE_FORWARDS:g} grad-enabled forwards per micro-batch → a code fix",
      gain="calibrated (CPU, CUDA)")
def rule_duplicate_forward(m: Measurements) -> Finding | None:
    f = m.forwards_per_microbatch
    if f is None or f <= DUPLICATE_FORWARDS:
        return None
    c = _phase(m, "compute") or 1.0
    obs = f"{f:.2f} grad-enabled forward passes per micro-batch (expected 1); compute is {_pct(c)} of the wall time."
    root = ("A custom `compute_loss` / `training_step` (or a metric or reward inside it) runs the model again with "
            "gradients on — e.g. recomputing the loss instead of taking it from the first forward's logits — so "
            "each micro-batch pays for the forward, and its graph and backward, more than once.")
    rec = ("Compute the loss from the first forward's outputs (`outputs = model(**inputs)`; "
           "`loss = loss_fn(outputs.logits, labels)`); run any extra pass (metrics, rewards) under "
           "`torch.no_grad()` or drop it. `perf/forwards_per_microbatch` should read 1.")
    predicted = _amdahl(c, f)
    gain, basis, confidence, formula = _calibrated(
        "duplicate_forward", m, predicted,
        f"compute scales with forwards per micro-batch: 1/((1 − {c:.2f}) + {c:.2f}/{f:.2f}) = {predicted:.2f}x")
    return Finding("duplicate_forward", "Duplicate forward pass", obs, root, rec, gain, formula, confidence, {},
                   basis, predicted, reason="grad_forwards", facts={"forwards_per_microbatch": f, "compute": c})


def _fixed_length_padding(m: Measurements, length: int, p: float, c: float) -> Finding:
    """A Trainer run whose every batch was padded to one ``length`` (``m.fixed_seq_len``): per-batch padding first
    (grouping by length cannot shorten a fixed length)."""
    obs = (f"Every step was padded to exactly {length} positions (`perf/seq_len` {length} on all {m.steps} steps) "
           f"while {_pct(p)} of the positions were padding: about {(1 - p) * length:.0f} real tokens per sequence.")
    root = (f"A fixed length: the collator (or the tokenizer's `padding='max_length'`) pads every batch to {length} "
            f"whatever the lengths of its sequences, so the device computes on the pad positions, and attention on "
            "them quadratically. Grouping by length cannot help: it sorts sequences into batches, and a fixed length "
            f"pads every batch to {length} all the same.")
    if m.trainer_kind == "sft":
        items = [f"let `SFTTrainer`'s own collator pad per batch: drop the fixed-length `data_collator` (and "
                 f"`padding='max_length'` in any tokenization of your own), keeping `max_length: {length}` to bound "
                 "the longest",
                 "`padding_free: true` (flash attention) or `packing: true`: no padding at all",
                 "then `train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before): "
                 "similar lengths in a batch pad less"]
    else:
        items = ["pad per batch, to the longest sequence of each batch: tokenize without `padding='max_length'` and "
                 "collate with `DataCollatorWithPadding(tokenizer)` (causal LM: `DataCollatorForLanguageModeling("
                 f"tokenizer, mlm=False)`) and no fixed `max_length` (keep `truncation=True, max_length={length}` to "
                 "bound the longest)",
                 "with TRL's `SFTTrainer`: its own collator pads per batch (pass no `data_collator`); `padding_free: "
                 "true` or `packing: true` removes the padding altogether",
                 "then `train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before): "
                 "similar lengths in a batch pad less"]
    formula = ("not predicted: per-batch padding keeps the padding up to each batch's longest sequence, which the "
               "log does not record, and a step's costs that do not shrink with its positions (the optimizer step, "
               "per-micro-batch work outside the model's matmuls) cannot be told from those that do in a log padded "
               f"to one length on every step; the pad positions are {_pct(p)} of the positions, compute "
               f"{_pct(c)} of the wall time")
    return Finding("padding_waste", "Padding to a fixed length", obs, root, _bullets(items), None, formula, "medium",
                   {}, "try", None, reason="fixed_length",
                   facts={"length": length, "pad_fraction": p, "compute": c, "trainer_kind": m.trainer_kind,
                          "ceiling_known": False})


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
    if m.fixed_seq_len and not m.grpo:
        return _fixed_length_padding(m, m.fixed_seq_len, p, c)
    k = m.pad_to_multiple_of or 0
    obs = f"{_pct(p)} of the positions in training forwards are padding" + \
          (f" (padded length up to {m.seq_len} tokens)" if m.seq_len else "") + \
          (f"; `pad_to_multiple_of` {k}" if k > 1 else "") + "."
    if k > 1 and m.device_type != "mps":
        parts = 2 if m.grpo else 1               # GRPO pads prompts and completions separately to the multiple
        length = m.seq_len_mean or m.seq_len
        r = min(p, parts * (k - 1) / 2 / length) if length else None
        root = (f"`pad_to_multiple_of: {k}` rounds every padded "
                + ("prompt and every completion block" if m.grpo else "batch") + f" up to a multiple of {k}: "
                "on average (k − 1)/2 extra positions each. It bounds the number of distinct shapes, which only "
                "MPS needs (one Metal graph per shape); on this device it is pure extra compute.")
        rec = "`pad_to_multiple_of: null` (the default: pad to the longest sequence of each batch)"
        if r is None or c <= 0:
            return Finding("padding_waste", "Padding from pad_to_multiple_of", obs, root, rec, None,
                           "not predicted: compute share or sequence length not measured", "low",
                           {"pad_to_multiple_of": None}, "try", None, reason="pad_to_multiple",
                           facts={"pad_fraction": p, "pad_to_multiple_of": k})
        predicted = 1.0 / ((1.0 - c) + c * (1.0 - r))
        gain, basis, confidence, formula = _calibrated(
            "padding_waste", m, predicted,
            f"the rounding adds ≈ {parts} × ({k} − 1)/2 of the mean {length:.0f} padded positions = {_pct(r)}; "
            f"compute on them saved: 1/((1 − {c:.2f}) + {c:.2f} × (1 − {r:.3f})) = {predicted:.2f}x")
        return Finding("padding_waste", "Padding from pad_to_multiple_of", obs, root, rec, gain, formula,
                       confidence, {"pad_to_multiple_of": None}, basis, predicted, reason="pad_to_multiple",
                       facts={"pad_fraction": p, "pad_to_multiple_of": k, "rounding_share": r})
    if m.grpo:
        per_batch = math.ceil((m.micro_batch or 1) / (m.num_generations or 1))
        text = (f"{obs} GRPO pads each micro-batch's completions to its longest one"
                + (" and left-pads its prompts to the longest prompt" if per_batch > 1 else
                   " (each micro-batch holds one prompt, so prompts add none)")
                + ": unequal completion lengths are inherent in sampling and no setting removes that padding"
                + ("; on MPS `pad_to_multiple_of` adds to it on purpose (fewer Metal graphs)" if k > 1 else "")
                + ".")
        return Note("padding_waste", "Padding", text, reason="grpo_inherent",
                    facts={"pad_fraction": p, "prompts_per_micro_batch": per_batch, "pad_to_multiple_of": k,
                           "setting_removes_it": False})
    group = ("`train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before) puts "
             "similar lengths in a batch")
    rest = ["with TRL SFT: `padding_free: true` or `packing: true`",
            "split very long documents into `max_length` chunks"]
    if m.seq_len_min is not None and m.seq_len_min == m.seq_len:   # one length on fewer steps than tell a fixed one
        root = (f"Batches are padded to one length, {m.seq_len} positions, on the steps logged: a fixed length (a "
                f"collator's `max_length`, `padding='max_length'`) or each batch's longest sequence; too few steps "
                f"({MIN_FIXED_LENGTH_STEPS} needed) to tell which. The device computes on the pad positions, "
                f"attention quadratically.")
        items = ["if the collator pads to a fixed length, pad per batch instead (tokenize without "
                 "`padding='max_length'`, collate with `DataCollatorWithPadding`): grouping cannot shorten a fixed "
                 "length", group] + rest
        return Finding("padding_waste", "Padding waste", obs, root, _bullets(items), None,
                       "not predicted: which padding the collator does is not yet known from the log", "low", {},
                       "try", None, reason="one_length_unsure", facts={"pad_fraction": p, "length": m.seq_len})
    root = ("Batches are padded to the longest sequence of each batch (the padded length changed from step to step, "
            "so the padding is per batch): long and short sequences share batches, and the device computes on the "
            "pad positions, attention quadratically.")
    return Finding("padding_waste", "Padding waste", obs, root, _bullets([group] + rest), None,
                   "not predicted: how much padding grouping removes depends on the length distribution", "low",
                   {"train_sampling_strategy": "group_by_length"}, "try", None, reason="per_batch",
                   facts={"pad_fraction": p})
