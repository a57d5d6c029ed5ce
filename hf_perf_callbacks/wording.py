"""The words shared by the live meter's console summary, ``hf-perf report``, its plots and the written analysis: one
wording per fact, so that no two of them describe one figure differently. Pure: no torch, no transformers.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

#: what each phase of a step's wall time is, in words (keys: :data:`hf_perf_callbacks.runlog.PHASES`)
PHASE_WORDS = {"data_wait": "waiting for data", "generation": "generation", "compute": "forward/backward/optimizer",
               "eval": "evaluation", "save": "saving", "log": "logging", "own_callbacks": "this package's callbacks",
               "user_callbacks": "other callbacks", "recompute": "recompute (gradient checkpointing)",
               "unexplained": "unexplained"}

#: what the tuner attached to a plain ``trainer.train()`` says once (console and perf log), and the report with it
TUNER_NEEDS_TRAIN_WITH_TUNING = (
    "AdaptiveBatchTuner is attached to a plain trainer.train(): it logs the split in effect, but tuning on the "
    "run's own steps and in-process re-sizes need train_with_tuning(trainer) (or the recipe launcher, hf-perf "
    "train); under trainer.train() a re-size request saves a checkpoint and stops with the split to resume with")

#: what the throughput of a run is: the steady figure's basis, named once for the summary, the plots and the analysis
THROUGHPUT_BASIS = "tokens per second of training time (evaluation and saving excluded)"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def split_label(split: object) -> str:
    """``8×1`` for a split (a :class:`~hf_perf_callbacks.batching.Split`, or a mapping with ``micro_batch`` and
    ``grad_accum`` or the training-argument names); a string as it is; ``?`` for None or anything else."""
    if isinstance(split, str):
        return split
    if isinstance(split, dict):
        micro = split.get("micro_batch", split.get("per_device_train_batch_size"))
        accum = split.get("grad_accum", split.get("gradient_accumulation_steps"))
    else:
        micro, accum = getattr(split, "micro_batch", None), getattr(split, "grad_accum", None)
    return f"{micro}×{accum}" if micro is not None and accum is not None else "?"


def warmup_words(steps: object, slowdown: object, overhead: object = None, first_step: object = None,
                 levels: int = 1) -> str:
    """What the warmup figures say, without contradicting themselves: ``steps`` of warmup (0: none beyond the first
    step; None: warmup has not finished), the first step's ``slowdown`` against the steady step (below 1: later
    steps slowed, not warmup — or, over ``levels`` > 1 splits at different speeds, another split) and the
    ``overhead`` seconds above steady time. ``first_step``: the step the slowdown is of (the latest ``train()``
    call's first step), named when it is not step 1."""
    n, slow, over = _number(steps), _number(slowdown), _number(overhead)
    if n is None:
        return "warmup not finished (no stable window of steps yet: too few steps for steady figures)"
    at = _number(first_step)
    first = "the first step" if at is None or at == 1 else f"step {at:.0f} (the first of the latest train() call)"
    parts = []
    if n and slow is not None and slow < 0.95:       # the speed settled later, but no slow start: not a warmup
        parts.append(f"the speed settled after {n:.0f} step{'s' if n != 1 else ''}")
    elif n:
        parts.append(f"warmup took {n:.0f} step{'s' if n != 1 else ''}")
        if slow is not None and slow >= 1.05:
            parts.append(f"{first} took {slow:.1f}x the steady step")
        if over:
            parts.append(f"{over:.1f} s above steady time")
    elif slow is not None and slow >= 1.05:
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
                contention_sec: object = None, first_step: object = None) -> str:
    """The summary's warmup line (console and report): :func:`warmup_words` once warmup has finished, else how many
    steps ran without it finishing; the slow early steps the meter put down to other processes when there were."""
    if not done:
        text = (f"not finished after {run_steps} steps (no stable window of steps yet: run longer for steady "
                f"figures)")
    else:
        text = warmup_words(steps, slowdown, overhead, first_step)
    contention = _number(contention_sec)
    if contention is not None and contention >= 0.05:
        text += f"; {contention:.1f} s of the early steps' slowness had no CPU time of this process behind it " \
                f"(other processes)"
    return text


def throughput_line(steady_tokens_per_sec: object, steady_step_sec: object, mean_tokens_per_sec: object) -> str:
    """The summary's throughput line (console and report): the steady figure with its step time, and the mean."""
    def num(value: object, spec: str) -> str:
        v = _number(value)
        return format(v, spec) if v is not None else "n/a"

    text = f"steady tokens/s: {num(steady_tokens_per_sec, ',.0f')}"
    if _number(steady_step_sec) is not None:
        text += f" at {num(steady_step_sec, '.3g')} s per steady step"
    return text + f"   (mean incl. warmup {num(mean_tokens_per_sec, ',.0f')})"


def provisional_line(tokens_per_sec: object, step_sec: object, steps: object, mean_tokens_per_sec: object) -> str:
    """The summary's throughput line of a run too short for steady figures: the rate of the steps it has (``steps``:
    first and last), said to be provisional."""
    rate, sec, mean = _number(tokens_per_sec), _number(step_sec), _number(mean_tokens_per_sec)
    span = list(steps) if isinstance(steps, (list, tuple)) and len(steps) == 2 else None
    over = "" if span is None else f" over step {span[0]}" if span[0] == span[1] else \
        f" over steps {span[0]}–{span[1]}"
    text = "provisional tokens/s: " + (f"{rate:,.0f}{over}" if rate is not None else "n/a")
    if sec is not None:
        text += f" at {sec:.3g} s per step"
    return text + " (too few steps for steady figures)" + (f"   (mean {mean:,.0f})" if mean is not None else "")


def phase_line(phases: Mapping[str, object]) -> str:
    """The summary's time-split line (console and report): each phase with time, in words, as a share of the wall
    time."""
    numbers = [(k, _number(v)) for k, v in phases.items()]
    shares = [(PHASE_WORDS.get(k, k), v) for k, v in numbers if v is not None and v > 0]
    return "time split: " + (", ".join(f"{name} {v:.1%}" for name, v in shares) or "n/a")
