"""The words shared by the live meter's console summary, ``hf-perf report``, its plots and the written analysis: one
wording per fact, so that no two of them describe one figure differently. Pure: no torch, no transformers.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..keys import CONSOLE_WIDTH
from .runlog import HF_PERF_TRAIN, strict_number

#: what each phase of a step's wall time is, in words (keys: :data:`hf_perf_callbacks.core.runlog.PHASES`)
PHASE_WORDS = {"data_wait": "waiting for data", "generation": "generation", "rollout_wait": "waiting for rollouts",
               "reward": "reward functions",
               "compute": "forward/backward/optimizer",
               "eval": "evaluation", "save": "saving", "log": "logging", "own_callbacks": "this package's callbacks",
               "user_callbacks": "other callbacks", "recompute": "recompute (gradient checkpointing)",
               "unexplained": "unexplained"}

#: what the tuner attached to a plain ``trainer.train()`` says once (console and perf log), and the report with it
TUNER_NEEDS_TRAIN_WITH_TUNING = (
    "AdaptiveBatchTuner is attached to a plain trainer.train(): it logs the split in effect, but tuning on the "
    "run's own steps and in-process re-sizes need train_with_tuning(trainer) (or the recipe launcher, hf-perf "
    "train); under trainer.train() a re-size request saves a checkpoint and stops with the split to resume with")


#: how a callback's arguments were written: ``default_callbacks(...)`` (each callback it builds carries it as
#: ``built_by``), the recipe launcher (the run's ``launcher``, :data:`~hf_perf_callbacks.core.runlog.HF_PERF_TRAIN`:
#: ``callback_kwargs:`` in a YAML), or the class itself
BUILT_BY_DEFAULT_CALLBACKS = "default_callbacks"


def argument_hint(callback: str, argument: str, value: str, written: str | None = None) -> str:
    """A callback's argument in the form its user wrote the callbacks in (``written``): a recipe's (YAML)
    ``callback_kwargs: {ThroughputMeter: {peak_flops: calibrate}}``, ``default_callbacks(ThroughputMeter={"peak_flops":
    "calibrate"})``, else ``ThroughputMeter(peak_flops="calibrate")``; ``value`` is a string value."""
    if written == HF_PERF_TRAIN:
        return f"callback_kwargs: {{{callback}: {{{argument}: {value}}}}}"
    if written == BUILT_BY_DEFAULT_CALLBACKS:
        return f'default_callbacks({callback}={{"{argument}": "{value}"}})'
    return f'{callback}({argument}="{value}")'


def split_label(split: object) -> str:
    """``8×1`` for a split (a :class:`~hf_perf_callbacks.core.batching.Split`, or a mapping with ``micro_batch`` and
    ``grad_accum`` or the training-argument names); a string as it is; ``?`` for None or anything else."""
    if isinstance(split, str):
        return split
    if isinstance(split, dict):
        micro = split.get("micro_batch", split.get("per_device_train_batch_size"))
        accum = split.get("grad_accum", split.get("gradient_accumulation_steps"))
    else:
        micro, accum = getattr(split, "micro_batch", None), getattr(split, "grad_accum", None)
    return f"{micro}×{accum}" if micro is not None and accum is not None else "?"


def warmup_case(steps: object, slowdown: object, in_band: object = None) -> str:
    """Which warmup :func:`warmup_words` describes, as a code: ``not_finished``; ``settled`` (the speed settled
    after some steps, with no slow start — or every one of them within the steady band, ``in_band``: not a warmup);
    ``warmup`` (it took some steps); ``first_only`` (only the first step was slow); ``none`` (the first step ran at
    the steady speed, or faster)."""
    n, slow = strict_number(steps), strict_number(slowdown)
    if n is None:
        return "not_finished"
    if n and ((slow is not None and slow < 0.95) or in_band is True):
        return "settled"
    if n:
        return "warmup"
    return "first_only" if slow is not None and slow >= 1.05 else "none"


def warmup_words(steps: object, slowdown: object, overhead: object = None, first_step: object = None,
                 levels: int = 1, in_band: object = None, tolerance: object = None) -> str:
    """What the warmup figures say, without contradicting themselves: ``steps`` of warmup (0: none beyond the first
    step; None: warmup has not finished), the first step's ``slowdown`` against the steady step (below 1: later
    steps slowed, not warmup — or, over ``levels`` > 1 splits at different speeds, another split) and the
    ``overhead`` seconds above steady time. ``first_step``: the step the slowdown is of (the latest ``train()``
    call's first step), named when it is not step 1. ``in_band``: every warmup step ran within ``tolerance`` of the
    steady step time (the meter's stable band): the speed settled, at no cost worth naming."""
    n, slow, over = strict_number(steps), strict_number(slowdown), strict_number(overhead)
    case = warmup_case(steps, slowdown, in_band)
    if n is None:
        return "warmup not finished (no stable window of steps yet: too few steps for steady figures)"
    at = strict_number(first_step)
    first = "the first step" if at is None or at == 1 else f"step {at:.0f} (the first of the latest train() call)"
    parts = []
    band = strict_number(tolerance)
    if case == "settled":                            # the speed settled later, but no slow start: not a warmup
        parts.append(f"the speed settled after {n:.0f} step{'s' if n != 1 else ''}" + (
            f", each within {band:.0%} of the steady step (the meter's stable band): no warmup cost"
            if in_band is True and band is not None and (slow is None or slow >= 0.95) else ""))
    elif case == "warmup":
        parts.append(f"warmup took {n:.0f} step{'s' if n != 1 else ''}")
        if slow is not None and slow >= 1.05:
            parts.append(f"{first} took {slow:.1f}x the steady step")
        if over:
            parts.append(f"{over:.1f} s above steady time")
    elif case == "first_only":
        parts.append(f"only {first} was slow ({slow:.1f}x the steady step); no warmup beyond it")
    elif slow is None or slow >= 0.95:
        parts.append(f"no warmup: {first} ran at the steady speed")
    else:
        parts.append("no warmup")
    if slow is not None and slow < 0.95:
        again = first if at is None or at == 1 else "it"        # a named step is named once
        parts.append(f"{again} was faster than the steady level ({slow:.2f}x), which mixes {levels} splits at "
                     f"different speeds (each split's own level is in the throughput plot)" if levels > 1 else
                     f"{again} was faster than the steady level ({slow:.2f}x): later steps slowed down — "
                     f"longer sequences or other processes, not warmup")
    return "; ".join(parts)


def value_range(values: list[float], spec: str = ".2f") -> str:
    """``1.20`` when the values print alike, else ``1.20–1.50`` (lowest to highest)."""
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}–{high}"


def steady_words(steady: list[int] | tuple[int, ...], ranges: str) -> str:
    """Which steps the steady figures are over: ``the steady figures are over 17 steps (14–30)``."""
    n = len(steady)
    return f"the steady figures are over {n} step{'s' if n != 1 else ''} ({ranges})" if n else \
        "no steady steps yet"


def warmup_line(done: object, steps: object, slowdown: object, overhead: object, run_steps: object,
                contention_sec: object = None, first_step: object = None, in_band: object = None,
                tolerance: object = None) -> str:
    """The summary's warmup line (console and report): :func:`warmup_words` once warmup has finished, else how many
    steps ran without it finishing; the slow early steps the meter put down to other processes when there were."""
    if not done:
        text = (f"not finished after {run_steps} steps (no stable window of steps yet: run longer for steady "
                f"figures)")
    else:
        text = warmup_words(steps, slowdown, overhead, first_step, in_band=in_band, tolerance=tolerance)
    contention = strict_number(contention_sec)
    if contention is not None and contention >= 0.05:
        text += f"; {contention:.1f} s of the early steps' slowness had no CPU time of this process behind it " \
                f"(other processes)"
    return text


def throughput_line(steady_tokens_per_sec: object, steady_step_sec: object, mean_tokens_per_sec: object) -> str:
    """The summary's throughput line (console and report): the steady figure with its step time, and the mean."""
    def num(value: object, spec: str) -> str:
        v = strict_number(value)
        return format(v, spec) if v is not None else "n/a"

    text = f"steady tokens/s: {num(steady_tokens_per_sec, ',.0f')}"
    if strict_number(steady_step_sec) is not None:
        text += f" at {num(steady_step_sec, '.3g')} s per steady step"
    return text + f"   (mean incl. warmup {num(mean_tokens_per_sec, ',.0f')})"


def provisional_line(tokens_per_sec: object, step_sec: object, steps: object, mean_tokens_per_sec: object) -> str:
    """The summary's throughput line of a run too short for steady figures: the rate of the steps it has (``steps``:
    first and last), said to be provisional."""
    rate, sec, mean = strict_number(tokens_per_sec), strict_number(step_sec), strict_number(mean_tokens_per_sec)
    span = list(steps) if isinstance(steps, (list, tuple)) and len(steps) == 2 else None
    over = "" if span is None else f" over step {span[0]}" if span[0] == span[1] else \
        f" over steps {span[0]}–{span[1]}"
    text = "provisional tokens/s: " + (f"{rate:,.0f}{over}" if rate is not None else "n/a")
    if sec is not None:
        text += f" at {sec:.3g} s per step"
    return text + " (too few steps for steady figures)" + (f"   (mean {mean:,.0f})" if mean is not None else "")


#: what an MFU figure is against, by the run header's ``mfu_basis`` (:data:`hf_perf_callbacks.core.runlog.MFU_BASES`)
MFU_BASIS_WORDS = {
    "table": "of the device's peak FLOP/s (the device table's), on training time",
    "given": "of the peak FLOP/s given (peak_flops), on training time",
    "calibrated": "of a matmul's FLOP/s measured at the start (peak_flops='calibrate'), on training time",
    "cpu_time": "per CPU second: model FLOPs per second of this process's CPU time against the start's calibration "
                "matmul per CPU second (on a shared CPU a wall-time figure moves with the load, during the "
                "calibration too)"}


#: the same, in a few words (the report's run line)
MFU_BASIS_SHORT = {"table": "of the device's peak", "given": "of the given peak",
                   "calibrated": "of the calibrated peak", "cpu_time": "per CPU second"}


def mfu_words(mfu: object, basis: object, provisional: bool = False) -> str:
    """``MFU 6.5% per CPU second (...)``: the figure with what it is against (:data:`MFU_BASIS_WORDS`)."""
    value = strict_number(mfu)
    if value is None:
        return "MFU n/a"
    what = MFU_BASIS_WORDS.get(str(basis), "")
    return f"MFU {value:.1%}" + (" (provisional)" if provisional else "") + (f" {what}" if what else "")


def phase_line(phases: Mapping[str, object]) -> str:
    """The summary's time-split line (console and report): each phase with time, in words, as a share of the wall
    time."""
    numbers = [(k, strict_number(v)) for k, v in phases.items()]
    shares = [(PHASE_WORDS.get(k, k), v) for k, v in numbers if v is not None and v > 0]
    return "time split: " + (", ".join(f"{name} {v:.1%}" for name, v in shares) or "n/a")


# ------------------------------------------------------------------ the tuner's reasons, from their codes and figures
#: a figure of a typed reason: a number, or a split's label, or words a caller passed on
Figure = float | int | str

#: why the tuning on the run's own steps ended, or left a candidate: :class:`hf_perf_callbacks.resize.tuning.Why`'s
#: codes (their words: :func:`tuner_reason`); the first four end the tuning before or between its trials
TUNER_REASONS = ("too_short", "round_too_long", "cannot_pay_back", "unknown_length", "no_other_split", "slower",
                 "not_faster", "not_separable", "over_budget", "failed", "memory_pressure", "run_ended", "oom_ended",
                 "ended")
#: the words of the codes that callers end the tuning with (``OnRunTuning.end``)
TUNER_ENDED_WORDS = {"memory_pressure": "memory pressure ended the tuning",
                     "run_ended": "the run ended before the tuning did",
                     "oom_ended": "out of memory ended the tuning"}


def evidence_words(verdict: object, f: Mapping[str, Figure], prefix: str = "") -> str:
    """The sequential test's evidence for ``verdict`` ("faster" or "slower") from its figures (``candidate``,
    ``baseline``, ``ratio``, ``slower_ratio``, ``bound``, ``spread``, ``error``, ``min_gain``; each under
    ``prefix``)."""
    def get(key: str) -> Figure:
        return f[prefix + key]

    candidate, baseline = get("candidate"), get("baseline")
    if verdict == "slower":
        return (f"{candidate}'s fastest step {float(get('slower_ratio')):.2f}× {baseline}'s slowest, beyond the "
                f"noise bound {float(get('bound')):.2f}× (sequential test, spread {float(get('spread')):.2f}, "
                f"error <= {float(get('error')):.2g} a look)")
    gain = float(get("min_gain"))
    return (f"{baseline}'s fastest step {float(get('ratio')):.2f}× {candidate}'s slowest, beyond the noise bound "
            f"{float(get('bound')) / (1 - gain):.2f}× (the noise and {gain:.0%}; sequential test, spread "
            f"{float(get('spread')):.2f}, error <= {float(get('error')):.2g} a look)")


def saving_words(f: Mapping[str, Figure]) -> str:
    """How the tuner reckoned what a round can plausibly save a step, from its figures (``how`` "measured": the
    candidate's median ``gain`` plus its ``std_error``; else the baseline's ``median`` less its ``iqr``)."""
    if f["how"] == "measured":
        return (f"{f['candidate']}'s median gain {float(f['gain']):.3f} s/step over {f['baseline']} plus its "
                f"standard error {float(f['std_error']):.3f} s")
    return (f"{f['baseline']}'s median {float(f['median']):.3f} s/step, the most a split could save, less its "
            f"interquartile range {float(f['iqr']):.3f} s: a saving within the noise cannot be told from it")


def tuner_reason(code: str, f: Mapping[str, Figure]) -> str:
    """Why the tuning ended or left a candidate, in words, from its code (:data:`TUNER_REASONS`) and figures: the one
    place these sentences are written."""
    if code == "too_short":
        return (f"too short to pay back: measuring this split and trying one other takes {f['needed']} steps and "
                f"{f['left']} are left")
    if code == "round_too_long":
        return f"too short to pay back: a round takes {f['round_steps']} steps and {f['left']} are left"
    if code == "unknown_length":
        return "the run's length is unknown: no trial can be weighed against its pay-back"
    if code == "cannot_pay_back":
        saving, after, margin = float(f["saving"]), int(f["steps_after"]), float(f["margin"])
        how = saving_words(f)
        return (f"cannot pay back: a round could plausibly save {saving:.3f} s/step ({how}) × {after} steps = "
                f"{after * saving:.1f} s after it, less than "
                + (f"{margin:g} × its reckoned cost (no switch of this run measured yet), " if margin != 1 else
                   "its cost, ")
                + f"{float(f['cost']):.1f} s (a switch there and back, its steps at the noise)")
    if code == "no_other_split":
        return "no other split to try"
    if code == "slower":
        return f"{f['candidate']} slower: {evidence_words('slower', f)}"
    if code == "not_faster":
        return f"{f['candidate']} not faster beyond the noise in {f['rounds']} round(s)"
    if code == "not_separable":
        return f"{f['candidate']} not separable from the noise and no round left that could pay back"
    if code == "over_budget":
        return f"{f['candidate']} passed the memory budget"
    if code == "failed":
        return f"{f['candidate']} {f['why']}"
    if code in TUNER_ENDED_WORDS:
        return TUNER_ENDED_WORDS[code]
    return str(f.get("why", code))


def tuning_outcome(outcome: str, f: Mapping[str, Figure], note: str) -> str:
    """A ``tune`` decision's reason: its outcome (its ``reason_code``: ``kept_configured``, or ``faster_beyond_noise``
    by the sequential test at once or by Mann-Whitney over its rounds) with the figures it rests on, then why the
    tuning ended (``note``, :func:`tuner_reason`'s words)."""
    if outcome == "kept_configured":
        return f"kept the configured split: {note}" if note else "kept the configured split"
    head = (f"{f['kept']} faster than {f['start']} beyond the noise (median {float(f['median_kept']):.3f} vs "
            f"{float(f['median_start']):.3f} s over {f['steps_kept']} and {f['steps_start']} steps")
    evidence = f"; {evidence_words('faster', f, 'seq_')}" if "seq_ratio" in f else f", p={float(f['p']):.2g}"
    return f"{head}{evidence}); {note}"


def console_line(text: str, width: int = CONSOLE_WIDTH) -> str:
    """``text`` as one console line of at most ``width`` characters: its first line, cut at the last clause boundary
    (``: ``, ``; ``, ``. ``, `` (``, ``, ``) that fits, or at a space, and ended by `` …`` when cut."""
    lines = text.strip().splitlines() or [""]
    first = lines[0].rstrip()
    if len(first) <= width and len(lines) == 1:
        return first
    room = width - 2
    if len(first) <= room:
        return first + " …"
    head = first[:room]
    cut = max(head.rfind(mark) for mark in (": ", "; ", ". ", " (", ", "))
    if cut < width // 2:
        cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else head).rstrip(" :;,.(") + " …"


def wrapped(line: str, width: int = CONSOLE_WIDTH, indent: str = "    ") -> str:
    """``line`` as lines of at most ``width`` characters, broken after its clauses (``; ``, ``, ``, a space) and
    continued with ``indent``; nothing is left out."""
    out = []
    rest = line.rstrip()
    while len(rest) > width:
        head = rest[:width]
        cut = max(head.rfind("; "), head.rfind(", "))
        cut = cut + 1 if cut > width // 3 else head.rfind(" ")
        if cut <= len(indent):
            cut = width
        out.append(rest[:cut].rstrip())
        rest = indent + rest[cut:].lstrip()
    out.append(rest)
    return "\n".join(out)
