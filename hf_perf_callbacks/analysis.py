"""The run explains itself: rule-based performance analysis of a run's ``perf_log.jsonl`` (+ ``trainer_state.json``).

:func:`measurements` reduces a parsed run log (:func:`hf_perf_callbacks.runlog.read_run`) to :class:`Measurements`;
every rule in :data:`RULES` is a pure function of those and returns one :class:`Finding` (observation, root cause,
recommendation with the exact config key and value, expected gain with its formula, confidence) or None.
:func:`analyze` ranks the findings by expected gain; :func:`write_perf_report` writes ``<output_dir>/perf_report.md``.
The headline figures are :func:`hf_perf_callbacks.figures.figures`, the same as ``hf-perf report`` prints. The
DataLoader advice (:func:`dataloader_advice`) is also the ThroughputMeter's data-wait warning.

Rules (thresholds are the module constants named here):

=====================  ============================================================================================
rule                   fires when
=====================  ============================================================================================
``warmup``             first step ≥ ``WARMUP_SLOWDOWN`` × the steady step, or warmup overhead ≥ ``WARMUP_SHARE`` of
                       the run's time (normal one-time costs; a gain only when warmup is a large share of the run)
``input_bound``        data wait ≥ ``DATA_WAIT_FRACTION`` of wall time → DataLoader settings for the device;
                       gain 1/(1 − f)
``generation_bound``   GRPO, generation ≥ ``GENERATION_SHARE`` of wall time → vLLM / static cache (CUDA), shorter
                       completions / larger generation batches (MPS, CPU); Amdahl
``completion_budget``  GRPO, p90 (else max) completion < ``COMPLETION_SLACK`` × ``max_completion_length``
                       with clipped ratio ≤ ``CLIPPED_SMALL`` → next power of two ≥ ``COMPLETION_HEADROOM`` ×
                       observed; or clipped ratio ≥ ``CLIPPED_LARGE`` → completions are cut off (quality note, no cut)
``memory_pressure``    swap grew ≥ ``SWAP_GROWTH_GB`` or swap-outs on any step, pressure level ≥ 1, driver memory
                       > ``DRIVER_BLOAT_RATIO`` × live tensors (and ≥ ``DRIVER_BLOAT_MIN_GB`` more), or the wall
                       ≤ ``STEPS_TO_WALL`` steps away; swapping → "up to" ``SWAP_SLOWDOWN``
``small_micro_batch_low_mfu``
                       micro-batch ≤ ``SMALL_MICRO_BATCH`` with accumulation ≥ 2, no memory pressure, and MFU <
                       ``LOW_MFU`` (MFU unknown: compute share ≥ ``HIGH_COMPUTE_SHARE``) → AdaptiveBatchTuner
``duplicate_forward``  forwards per micro-batch > ``DUPLICATE_FORWARDS``; Amdahl on the compute share
``padding_waste``      pad fraction ≥ ``PAD_FRACTION`` → length grouping / packing / dynamic padding; Amdahl
=====================  ============================================================================================

Memory estimates (shown with their formulas in the findings) use the run header's model config and the memory model
of :mod:`hf_perf_callbacks.estimate` (the one behind the recipes' memory table), per token:
KV cache = 2 × layers × kv_heads × head_dim × bytes (:func:`~hf_perf_callbacks.estimate.kv_cache_bytes_per_token`);
activations = layers × (6·hidden + 2·kv_heads·head_dim + 4·intermediate) × bytes without activation checkpointing
and (layers × hidden + 6·hidden + 2·kv_heads·head_dim + 4·intermediate) × bytes with it
(:func:`~hf_perf_callbacks.estimate.activation_bytes_per_token`); logits = vocab × 4 bytes (fp32 log-softmax,
:func:`~hf_perf_callbacks.estimate.logits_bytes_per_token`). ``bytes`` is the model's bytes per parameter.
"""
from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from . import estimate
from . import runlog as keys
from .batching import Split, exact_splits, next_smaller
from .device import GB
from .figures import figures, last_value
from .runlog import RunLog, read_run

REPORT_FILE = "perf_report.md"
CONSOLE_WIDTH = 160

WARMUP_SLOWDOWN = 2.0        # first step / steady step worth explaining
WARMUP_SHARE = 0.1           # warmup overhead / run time at which warmup costs real time
DATA_WAIT_FRACTION = 0.1
DATA_WAIT_CLEAR = 0.3        # above this the data wait is unambiguous (the phase also holds logging time)
GENERATION_SHARE = 0.5
GENERATION_SPEEDUP = 2.0     # assumed generation speed-up from the remedies, for the ranked estimate
LAUNCH_BOUND_UTIL = 0.1      # decode bandwidth utilisation below which decode is launch-bound
COMPLETION_SLACK = 0.5
COMPLETION_HEADROOM = 1.25
CLIPPED_SMALL = 0.05
CLIPPED_LARGE = 0.5
SWAP_GROWTH_GB = 0.25
STEPS_TO_WALL = 20.0         # the watchdog's default warn distance
MEM_GRACE_STEPS = 3          # first steps' trend (allocator ramp) ignored for steps-to-wall
DRIVER_BLOAT_RATIO = 1.5
DRIVER_BLOAT_MIN_GB = 0.5
HIGH_WATER_FRACTION = 0.75   # CUDA: reserved ≫ allocated only matters this close to the budget
SWAP_SLOWDOWN = 226 / 40     # measured: 3B + LoRA GRPO on a Mac, 226 s/it swapping → 40 s/it without
SMALL_MICRO_BATCH = 2
LOW_MFU = 0.2
HIGH_COMPUTE_SHARE = 0.5
LARGER_BATCH_SPEEDUP = 2.0   # assumed speed-up of the compute part (measured: 17x for 1×32 → 16×2 on an H100)
DUPLICATE_FORWARDS = 1.05
PAD_FRACTION = 0.2


@dataclass
class Measurements:
    """Everything the rules look at (the pure input of every rule; None = not measured)."""

    device_type: str
    world_size: int
    grpo: bool
    micro_batch: int | None
    grad_accum: int | None
    max_completion_length: int | None
    num_generations: int | None
    activation_checkpointing: bool | None
    model: dict
    dataloader: dict
    steps: int
    warmup_steps: int | None
    warmup_overhead_sec: float | None
    first_step_slowdown: float | None
    steady_step_sec: float | None
    steady_tokens_per_sec: float | None
    mfu: float | None
    phases: dict[str, float]                 # fractions of wall time
    pad_fraction: float | None
    forwards_per_microbatch: float | None
    decode_bandwidth_util: float | None
    completion_mean: float | None
    completion_max: float | None
    completion_p90: float | None             # 90th percentile of the per-log longest completion
    clipped_ratio: float | None
    mem_high_water_gb: float | None
    mem_budget_gb: float | None
    driver_gb_max: float | None
    allocated_gb_at_driver_max: float | None
    max_pressure: int | None
    swap_growth_gb: float | None
    swapout_steps: int
    min_steps_to_wall: float | None
    watchdog_actions: list[dict]
    seq_len: int | None = None               # longest padded training sequence (tokens), for memory estimates


@dataclass
class Finding:
    rule: str
    title: str
    observation: str
    root_cause: str
    recommendation: str
    expected_gain: float                     # multiplicative speed-up bound (1.0 = none), used for ranking
    gain_formula: str
    confidence: str                          # "high" | "medium" | "low"


# ------------------------------------------------------------------ helpers
def _bullets(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _sentence(parts: list[str]) -> str:
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _gb(nbytes: float) -> str:
    gb = nbytes / GB
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{nbytes / 1024**2:.0f} MB"


def _amdahl(share: float, speedup: float) -> float:
    """End-to-end speed-up when a part taking ``share`` of the time gets ``speedup`` times faster."""
    return 1.0 / ((1.0 - share) + share / speedup)


def _next_pow2(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def _phase(m: Measurements, name: str) -> float:
    return float(m.phases.get(name) or 0.0)


def _dims(model: dict) -> dict | None:
    """The run header's model facts as :mod:`~hf_perf_callbacks.estimate`'s model dict plus ``bytes`` (bytes per
    parameter, default 2); None when layers, hidden size or attention heads are unknown."""
    if not (model.get("num_hidden_layers") and model.get("hidden_size") and model.get("num_attention_heads")):
        return None
    return {**estimate.model_from_config(model), "bytes": model.get("bytes_per_param") or 2}


def _known(compute: Callable, *args):
    """``compute(*args)``, or None when the model facts it needs are missing from the run header."""
    try:
        return compute(*args)
    except ValueError:
        return None


def _kv_per_token(model: dict) -> int | None:
    d = _dims(model)
    return _known(estimate.kv_cache_bytes_per_token, d, d["bytes"]) if d else None


def _act_per_token(model: dict, checkpointing: bool) -> int | None:
    d = _dims(model)
    return _known(estimate.activation_bytes_per_token, d, d["bytes"], checkpointing) if d else None


def _logits_per_token(model: dict) -> int:
    d = _dims(model)
    return (_known(estimate.logits_bytes_per_token, d) or 0) if d else 0


def _kv_formula(model: dict) -> str:
    d = _dims(model)
    return f"2 × {d['layers']} layers × {d['kv_heads']} kv_heads × {d['head_dim']} head_dim × {d['bytes']} B"


def _act_formula(model: dict, checkpointing: bool) -> str:
    """The activation bytes per token as :func:`estimate.activation_bytes_per_token` computes them, with numbers."""
    d = _dims(model)
    block = (f"(6 × {d['hidden']} + 2 × {d['kv_heads']} × {d['head_dim']} + 4 × {d['intermediate']}) "
             f"block elements")
    if checkpointing:
        return f"({d['layers']} layers × {d['hidden']} hidden + {block}) × {d['bytes']} B"
    return f"{d['layers']} layers × {block} × {d['bytes']} B"


def _train_formula(model: dict, checkpointing: bool) -> str:
    """Activations plus logits per training token, as text."""
    d = _dims(model)
    logits = f" + {d['vocab']} vocab × {estimate.LOGIT_BYTES} B logits" if _logits_per_token(model) else ""
    return f"{_act_formula(model, checkpointing)}{logits}"


def _generated_per_call(m: Measurements) -> int | None:
    """Completions generated together per device: micro-batch × accumulation (TRL's default generation batch)."""
    if m.micro_batch and m.grad_accum:
        return m.micro_batch * m.grad_accum
    return m.num_generations


def _completion_target(m: Measurements) -> tuple[int, float, str] | None:
    """(new max_completion_length, the observed length it is based on, its name) when there is room to cut."""
    limit = m.max_completion_length
    basis, name = ((m.completion_p90, "p90 of the per-log longest completion") if m.completion_p90 is not None
                   else (m.completion_max, "longest completion"))
    if not (m.grpo and limit and basis is not None and basis > 0):
        return None
    if basis >= COMPLETION_SLACK * limit or (m.clipped_ratio or 0.0) > CLIPPED_SMALL:
        return None
    new = _next_pow2(COMPLETION_HEADROOM * basis)
    return (new, basis, name) if new < limit else None


def _training_tokens(m: Measurements) -> tuple[int, str] | None:
    """Tokens of one training micro-batch (micro-batch × padded length) for activation estimates."""
    if not m.micro_batch:
        return None
    if m.seq_len:
        return m.micro_batch * m.seq_len, f"{m.micro_batch} × {m.seq_len} tokens"
    return None


def _memory_freed_by_cut(m: Measurements, old: int, new: int) -> tuple[float, str] | None:
    """Memory a completion cap of ``new`` instead of ``old`` frees at the cap: generation KV cache + training
    activations and logits (:mod:`~hf_perf_callbacks.estimate`'s per-token bytes × the tokens cut)."""
    kv = _kv_per_token(m.model)
    n = _generated_per_call(m)
    if kv is None or not n:
        return None
    cut = old - new
    kv_total = kv * cut * n
    parts = [f"KV cache = {_kv_formula(m.model)} × ({old} − {new}) tokens × {n} sequences = {_gb(kv_total)}"]
    total = kv_total
    ckpt = bool(m.activation_checkpointing)
    act = _act_per_token(m.model, ckpt)
    if act and m.micro_batch:
        train = (act + _logits_per_token(m.model)) * cut * m.micro_batch
        total += train
        parts.append(f"training activations and logits = ({_train_formula(m.model, ckpt)}) × {cut} tokens × "
                     f"{m.micro_batch} micro-batch = {_gb(train)}")
    return total, "; ".join(parts)


def _splits(m: Measurements) -> list[Split]:
    """Exact splits of this run's effective batch (GRPO: keeping the generation batch and whole prompt groups),
    largest micro-batch first; empty when the batch is unknown or the geometry is not a valid one."""
    if not (m.micro_batch and m.grad_accum):
        return []
    world = max(1, m.world_size or 1)
    effective = m.micro_batch * m.grad_accum * world
    grpo = m.grpo and m.num_generations and m.num_generations >= 2
    try:
        return exact_splits(effective, world, effective if grpo else None, m.num_generations if grpo else None)
    except ValueError:
        return []


# ------------------------------------------------------------------ rules
def rule_warmup(m: Measurements) -> Finding | None:
    slow, overhead, steady = m.first_step_slowdown, m.warmup_overhead_sec, m.steady_step_sec
    if slow is None and overhead is None:
        return None
    share = None
    if overhead is not None and steady and m.steps:
        share = overhead / (m.steps * steady + overhead)
    if not ((slow is not None and slow >= WARMUP_SLOWDOWN) or (share is not None and share >= WARMUP_SHARE)):
        return None
    parts = []
    if slow is not None:
        parts.append(f"the first step took {slow:.1f}x the steady step"
                     + (f" ({steady:.2f} s)" if steady else ""))
    if m.warmup_steps is not None:
        parts.append(f"warmup ended after {m.warmup_steps} steps")
    if overhead is not None:
        parts.append(f"it cost {overhead:.1f} s above steady time"
                     + (f", {_pct(share)} of the run's ~{m.steps * steady + overhead:.0f} s" if share is not None
                        else ""))
    causes = {"mps": "Metal shader compilation and MPSGraph building for each new shape",
              "cuda": "CUDA context set-up, kernel selection and cuBLAS/cuDNN autotuning",
              "xpu": "kernel compilation (JIT) on first use"}
    root = ("Normal one-time costs of a fresh process: the optimizer's state (AdamW moments) is allocated at the "
            f"first step, {causes.get(m.device_type, 'first-touch memory allocation')}, the allocator grows its "
            "cache to the working set, and autograd sets up its buffers. They do not recur once warmup is over.")
    rec = ("Nothing to fix. Judge speed by `perf/steady_tokens_per_sec`"
           + (f" ({m.steady_tokens_per_sec:,.0f} tok/s)" if m.steady_tokens_per_sec else "")
           + ", measured after warmup, not by the first steps or the run's mean.")
    if share is not None and share >= WARMUP_SHARE:
        target = 0.05
        steps_needed = math.ceil(overhead * (1 - target) / (target * steady))
        rec += (f" This run is short, so warmup is {_pct(share)} of its time: for benchmarks run ≥ {steps_needed} "
                f"steps (warmup < 5%) or compare steady figures only; for sweeps keep one process warm instead of "
                f"restarting it.")
        gain = 1.0 / (1.0 - share)
        formula = (f"a long run amortises the {overhead:.1f} s: mean step → steady step, "
                   f"1/(1 − {share:.2f}) = {gain:.2f}x")
        confidence = "medium"
    else:
        gain = 1.0
        formula = ("nothing to gain: the warmup overhead is "
                   + (f"{_pct(share)} of the run" if share is not None else "a one-time cost") + " (1.0x)")
        confidence = "high"
    return Finding("warmup", "Warmup: slow first steps (normal)", _sentence(parts), root, rec, gain, formula,
                   confidence)


def dataloader_advice(device_type: str, dataloader: dict) -> list[str]:
    """The DataLoader settings to change when the device waits for data, one line each (the meter's warning and the
    ``input_bound`` finding both give this advice): ``dataloader`` holds the run's ``num_workers``,
    ``persistent_workers``, ``prefetch_factor`` and ``pin_memory``."""
    dl = dataloader or {}
    workers = dl.get("num_workers") or 0
    target = {"cuda": 4, "xpu": 4}.get(device_type, 2)
    if workers >= target:
        target = 2 * workers
    lines = [f"`dataloader_num_workers: {target}` (now {workers})"]
    if dl.get("persistent_workers") is not True:
        lines.append("`dataloader_persistent_workers: true` (workers survive epochs instead of restarting)")
    if not dl.get("prefetch_factor") or dl["prefetch_factor"] < 2:
        lines.append("`dataloader_prefetch_factor: 2` (batches each worker prepares ahead)")
    if device_type == "cuda":
        if dl.get("pin_memory") is not True:
            lines.append("`dataloader_pin_memory: true` (page-locked host memory: faster, asynchronous copies)")
    elif device_type == "mps":
        lines[0] += (" (transformers starts more than one worker with fork on MPS; if workers hang, set "
                     "`dataloader_multiprocessing_context: spawn`, which needs a picklable dataset and collator)")
        lines.append("`dataloader_pin_memory: false` (unified memory: nothing to pin)")
    else:
        lines[0] += " (workers share the CPU cores with training: raise only while cores are idle)"
    lines.append("pre-tokenize once (`dataset.map(tokenize, batched=True)` before building the trainer) so the "
                 "per-step work is only collation")
    return lines


def rule_input_bound(m: Measurements) -> Finding | None:
    f = _phase(m, "data_wait")
    if f < DATA_WAIT_FRACTION:
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
        root = (f"{workers} DataLoader workers cannot keep up: preparing a batch takes longer than computing one.")
    gain = 1.0 / (1.0 - f)
    return Finding("input_bound", "Input-bound: the device waits for data", obs, root,
                   _bullets(dataloader_advice(m.device_type, dl)), gain,
                   f"removing the data wait bounds the speed-up: 1/(1 − {f:.2f}) = {gain:.1f}x",
                   "high" if f >= DATA_WAIT_CLEAR else "medium")


def rule_generation_bound(m: Measurements) -> Finding | None:
    g = _phase(m, "generation")
    if not m.grpo or g < GENERATION_SHARE:
        return None
    u = m.decode_bandwidth_util
    obs = f"Generation (rollouts) took {_pct(g)} of the wall time"
    if m.steady_step_sec:
        obs += f" (≈ {g * m.steady_step_sec:.2f} s of a {m.steady_step_sec:.2f} s step)"
    launch_bound = u is not None and u < LAUNCH_BOUND_UTIL
    if u is not None:
        obs += f"; decode read the weights at {_pct(u)} of peak memory bandwidth"
        obs += " — launch-bound, not bandwidth-bound" if launch_bound else ""
    obs += "."
    root = ("HF `generate` decodes one token per step for the whole batch and launches every layer's kernels for "
            "each token; at small batch each step is bounded by kernel-launch and Python overhead rather than by "
            "memory bandwidth or FLOPs. Generation does not depend on the training split, so it dominates a GRPO "
            "step.")
    target = _completion_target(m)
    clipped = m.clipped_ratio or 0.0
    lines = []
    if m.device_type == "cuda":
        lines += ["`use_vllm: true` with `vllm_mode: colocate` (paged KV cache and CUDA graphs remove the per-token "
                  "launch overhead; `vllm_gpu_memory_utilization: 0.3` leaves room for training)",
                  "or, without vLLM, `cache_implementation: static` (fixed-shape KV cache, no re-allocation per "
                  "token)"]
    if target:
        lines.append(f"`max_completion_length: {target[0]}` (the {target[2]} is {target[1]:.0f} tokens; decode "
                     f"steps = the longest completion of a batch)")
    elif m.device_type != "cuda" and clipped < CLIPPED_LARGE:
        lines.append("a shorter `max_completion_length` if the task's answers are short (decode steps = the "
                     "longest completion of a batch)")
    if m.grad_accum and not _under_pressure(m):
        lines.append(f"`steps_per_generation: {2 * m.grad_accum}` (one generate call for two optimizer steps: "
                     f"twice the sequences per decode step for the same launch cost; rollouts are one step stale)")
    if m.device_type != "cuda" and m.num_generations and m.num_generations > 2 and m.micro_batch \
            and m.micro_batch % 2 == 0:
        lines.append(f"`num_generations: {max(2, m.num_generations // 2)}` with `per_device_train_batch_size: "
                     f"{m.micro_batch // 2}` (same prompts, half the completions per step: faster steps, but fewer "
                     f"samples per step and noisier group advantages)")
    if clipped >= CLIPPED_LARGE:
        lines.append(f"do not shorten `max_completion_length`: {_pct(clipped)} of completions are already cut at "
                     f"the limit")
    if not lines:
        lines.append("a shorter `max_completion_length` if the task's answers are short")
    gain = _amdahl(g, GENERATION_SPEEDUP)
    ceiling = 1.0 / (1.0 - g)
    formula = (f"Amdahl with generation {GENERATION_SPEEDUP:.0f}x faster (assumed): 1/((1 − {g:.2f}) + {g:.2f}/"
               f"{GENERATION_SPEEDUP:.0f}) = {gain:.2f}x; ceiling (generation free) 1/(1 − {g:.2f}) = {ceiling:.1f}x")
    confidence = "medium" if m.device_type == "cuda" and (u is None or launch_bound) else "low"
    return Finding("generation_bound", "Generation-bound GRPO step", obs, root, _bullets(lines), gain, formula,
                   confidence)


def rule_completion_budget(m: Measurements) -> Finding | None:
    limit = m.max_completion_length
    if not m.grpo or not limit:
        return None
    clipped = m.clipped_ratio
    stats = ", ".join(f"{name} {value:.0f}" for name, value in (("mean", m.completion_mean),
                                                               ("p90 of per-log max", m.completion_p90),
                                                               ("max", m.completion_max)) if value is not None)
    obs = (f"Completion lengths: {stats or 'n/a'} tokens against `max_completion_length` {limit}"
           + (f"; clipped ratio {_pct(clipped)}" if clipped is not None else "") + ".")
    if clipped is not None and clipped >= CLIPPED_LARGE:
        return Finding(
            "completion_budget", "Completions cut off at max_completion_length", obs,
            f"{_pct(clipped)} of completions reach the limit without an end-of-sequence token: the answers are "
            f"truncated, so rewards judge unfinished text (a quality issue, not a speed one).",
            f"Do not shorten `max_completion_length` ({limit}). If answers need the room, raise it (e.g. "
            f"`max_completion_length: {2 * limit}`); set `mask_truncated_completions: true` to keep truncated "
            f"completions out of the loss; reward finishing within the budget.",
            1.0, "no speed-up: a quality note (1.0x)", "high")
    target = _completion_target(m)
    if not target:
        return None
    new, basis, name = target
    freed = _memory_freed_by_cut(m, limit, new)
    root = (f"The limit is {limit / basis:.1f}x what the task uses. A completion that never emits end-of-sequence "
            f"decodes to the limit, holds the whole generation batch for {limit} decode steps and pads every "
            f"training sequence of its batch to {limit} tokens; a static KV cache is sized for the limit.")
    rec = (f"`max_completion_length: {new}` (next power of two ≥ {COMPLETION_HEADROOM} × {basis:.0f} = "
           f"{COMPLETION_HEADROOM * basis:.0f}, the {name}).")
    if m.completion_max is not None and m.completion_max > new:
        rec += f" The longest observed completion ({m.completion_max:.0f}) would be cut."
    if freed:
        rec += f" At the limit this frees ≈ {_gb(freed[0])}: {freed[1]}."
    g = _phase(m, "generation")
    n = _generated_per_call(m)
    r = clipped or 0.0
    if r > 0 and g > 0 and n:
        p = 1 - (1 - r) ** n
        gain = 1.0 / (1.0 - g * p * (1 - new / limit))
        formula = (f"a batch of {n} holds a runaway with P = 1 − (1 − {r:.3f})^{n} = {p:.2f}; generation "
                   f"shrinks by P × (1 − {new}/{limit}): 1/(1 − {g:.2f} × {p:.2f} × {1 - new / limit:.2f}) = "
                   f"{gain:.2f}x")
        confidence = "low"
    else:
        gain = 1.0
        formula = ("no completion reached the limit, so time is unchanged (1.0x); the gain is memory headroom"
                   + (f" (≈ {_gb(freed[0])} at the limit)" if freed else "") + " and a bound on runaway rollouts")
        confidence = "high" if m.completion_p90 is not None else "medium"
    return Finding("completion_budget", "max_completion_length far above what completions use", obs, root, rec,
                   gain, formula, confidence)


def _swapping(m: Measurements) -> bool:
    return (m.swap_growth_gb or 0.0) >= SWAP_GROWTH_GB or m.swapout_steps > 0


def _under_pressure(m: Measurements) -> bool:
    return _swapping(m) or (m.max_pressure or 0) >= 1 or (
        m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL)


def rule_memory_pressure(m: Measurements) -> Finding | None:
    swapping = _swapping(m)
    gap = (m.driver_gb_max - m.allocated_gb_at_driver_max) if (
        m.driver_gb_max is not None and m.allocated_gb_at_driver_max is not None) else 0.0
    near = (m.mem_high_water_gb is not None and m.mem_budget_gb
            and m.mem_high_water_gb >= HIGH_WATER_FRACTION * m.mem_budget_gb)
    bloat = (gap >= DRIVER_BLOAT_MIN_GB and m.driver_gb_max > DRIVER_BLOAT_RATIO * m.allocated_gb_at_driver_max
             and (m.device_type == "mps" or near or swapping or (m.max_pressure or 0) >= 1))
    if not (_under_pressure(m) or bloat):
        return None
    facts = []
    if swapping:
        facts.append(f"swap grew by {m.swap_growth_gb or 0:.2f} GB" +
                     (f" with swap-outs on {m.swapout_steps} steps" if m.swapout_steps else ""))
    if m.max_pressure:
        facts.append(f"memory pressure reached {('warn', 'critical')[min(m.max_pressure, 2) - 1]} "
                     f"(level {m.max_pressure})")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        facts.append(f"high-water mark {m.mem_high_water_gb:.2f} GB of a {m.mem_budget_gb:.2f} GB budget "
                     f"({_pct(m.mem_high_water_gb / m.mem_budget_gb)})")
    if m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL:
        facts.append(f"the budget was {m.min_steps_to_wall:.0f} steps away at the current growth")
    if bloat:
        facts.append(f"the allocator held {m.driver_gb_max:.2f} GB while live tensors were "
                     f"{m.allocated_gb_at_driver_max:.2f} GB ({gap:.2f} GB cached)")
    if m.watchdog_actions:
        acts = ", ".join(f"{a.get('action')} at step {a.get('step')}" for a in m.watchdog_actions[:5])
        facts.append(f"the watchdog acted {len(m.watchdog_actions)} times ({acts})")
    obs = _sentence(facts)
    if m.device_type == "mps":
        root = ("Unified memory: Metal memory (weights, activations, the allocator's cache) competes with the OS and "
                "other apps; past the working set macOS compresses and then swaps pages to SSD, and every kernel "
                "that touches a swapped page waits for it.")
    elif m.device_type == "cuda":
        root = ("The GPU works close to its memory limit: the caching allocator retries, fragments and finally "
                "raises out-of-memory; a GPU does not swap, it stops.")
    else:
        root = "Training memory is close to physical RAM: the OS swaps and every step waits for page-ins."
    if swapping and m.grpo:
        root += (" In GRPO the peak is the training forward/backward over prompt + completion tokens (activations "
                 "and full-vocabulary logits) on top of the generation KV cache.")
    lines = []
    items: list[tuple[float, str]] = []        # (bytes freed, recommendation): the largest first
    tokens = _training_tokens(m)
    ckpt_on = bool(m.activation_checkpointing)
    act_now = _act_per_token(m.model, ckpt_on)
    if m.activation_checkpointing is False:
        text = ("`activation_checkpointing: true` (`gradient_checkpointing` before transformers 5; ~20–30% more "
                "compute)")
        saved = 0.0
        act_ckpt = _act_per_token(m.model, True)
        if act_now and act_ckpt and tokens:
            saved = (act_now - act_ckpt) * tokens[0]
            text += (f": activations per token {_act_formula(m.model, False)} → {_act_formula(m.model, True)}, "
                     f"× {tokens[1]} frees ≈ {_gb(saved)}")
        items.append((saved, text))
    splits = _splits(m)
    try:
        smaller = next_smaller(Split(m.micro_batch, m.grad_accum), splits) if splits else None
    except ValueError:                          # micro-batch 1, or no smaller split keeps the batch exact
        smaller = None
    if smaller:
        new_mb, new_ga = smaller.micro_batch, smaller.grad_accum
        text = (f"`per_device_train_batch_size: {new_mb}` with `gradient_accumulation_steps: {new_ga}` (effective "
                f"batch {m.micro_batch} × {m.grad_accum} = {new_mb} × {new_ga} = {m.micro_batch * m.grad_accum}, "
                f"unchanged)")
        saved = 0.0
        if act_now and m.seq_len:
            saved = (act_now + _logits_per_token(m.model)) * m.seq_len * (m.micro_batch - new_mb)
            text += (f": frees ≈ {_gb(saved)} = ({_train_formula(m.model, ckpt_on)}) × {m.seq_len} tokens × "
                     f"{m.micro_batch - new_mb} fewer sequences")
        items.append((saved, text))
    target = _completion_target(m)
    if target:
        text = (f"`max_completion_length: {target[0]}` (now {m.max_completion_length}; the {target[2]} is "
                f"{target[1]:.0f})")
        freed = _memory_freed_by_cut(m, m.max_completion_length, target[0])
        if freed:
            text += f": frees ≈ {_gb(freed[0])} at the limit — {freed[1]}"
        items.append((freed[0] if freed else 0.0, text))
    elif m.grpo and (m.clipped_ratio or 0.0) < CLIPPED_LARGE:
        items.append((0.0, "a shorter `max_completion_length` if the task's answers are short (see "
                           "`completions/max_length` in the logs)"))
    lines = [text for _, text in sorted(items, key=lambda item: -item[0])]
    clearer = ("`MPSCacheClearer()` (clears the Metal cache when driver memory runs ahead of live tensors)"
               if m.device_type == "mps" else
               "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (less fragmentation of the reserved memory)"
               if m.device_type == "cuda" else None)
    attach = "attach `MemoryWatchdog()` (clears caches, shrinks the micro-batch, saves and stops before the wall)"
    if clearer:
        attach += f" and {clearer}"
    lines.append(attach + "; `callbacks=default_callbacks()` has them")
    if swapping:
        gain = SWAP_SLOWDOWN
        formula = (f"up to 226 s / 40 s = {SWAP_SLOWDOWN:.2f}x: the step-time ratio measured when a 3B + LoRA GRPO "
                   f"run on a Mac left swap; this run's own ratio is not measured")
        strong = m.swapout_steps >= 3 or (m.swap_growth_gb or 0.0) >= 1.0
        confidence = "medium" if strong else "low"
    else:
        gain = 1.0
        formula = "no swapping observed: no speed-up (1.0x); the gain is headroom, see the GB freed above"
        confidence = "high" if (m.max_pressure or 0) >= 2 or m.watchdog_actions else "medium"
    return Finding("memory_pressure", "Memory pressure" + (": the run is swapping" if swapping else ""), obs, root,
                   _bullets(lines), gain, formula, confidence)


def rule_small_micro_batch_low_mfu(m: Measurements) -> Finding | None:
    mb, ga, c = m.micro_batch, m.grad_accum, _phase(m, "compute")
    if not (mb and ga and mb <= SMALL_MICRO_BATCH and ga >= 2) or _under_pressure(m):
        return None
    if m.mfu is not None:
        if m.mfu >= LOW_MFU:
            return None
    elif c < HIGH_COMPUTE_SHARE:
        return None
    if c <= 0:
        return None
    world = max(1, m.world_size or 1)
    effective = mb * ga * world
    splits = sorted((s for s in _splits(m) if s.micro_batch > mb), key=lambda s: s.micro_batch)
    if not splits:
        return None
    manual = next((s for s in splits if s.micro_batch >= 4 * mb), splits[-1])
    obs = (f"Micro-batch {mb} × accumulation {ga}" + (f" × {world} devices" if world > 1 else "")
           + f" (effective batch {effective})"
           + (f"; MFU {_pct(m.mfu)}" if m.mfu is not None else "") + f"; compute {_pct(c)} of the wall time.")
    root = ("With 1–2 sequences per micro-batch the matmuls are too thin to fill the device: each micro-batch pays "
            "its kernel launches, adapter overhead and a forward/backward at low arithmetic intensity, "
            f"{ga} times per optimizer step.")
    listed = ", ".join(f"{s.micro_batch}×{s.grad_accum}" for s in splits[:6])
    rec = (f"Attach `AdaptiveBatchTuner()` and call `train_with_tuning(trainer)` instead of `trainer.train()`: it "
           f"measures exact splits of the effective batch {effective} ({listed}) and keeps the fastest that fits "
           f"memory. By hand: `per_device_train_batch_size: {manual.micro_batch}`, "
           f"`gradient_accumulation_steps: {manual.grad_accum}`.")
    if m.grpo:
        rec += " The generation batch (micro-batch × accumulation) stays the same, so GRPO's groups are unchanged."
    gain = _amdahl(c, LARGER_BATCH_SPEEDUP)
    formula = (f"Amdahl with the compute part {LARGER_BATCH_SPEEDUP:.0f}x faster (conservative; measured on an H100 "
               f"GRPO+LoRA run: 1×32 → 16×2 made it 17x faster, 1.9x end to end): 1/((1 − {c:.2f}) + {c:.2f}/"
               f"{LARGER_BATCH_SPEEDUP:.0f}) = {gain:.2f}x")
    return Finding("small_micro_batch_low_mfu", "Small micro-batch, low utilisation", obs, root, rec, gain, formula,
                   "medium" if m.mfu is not None else "low")


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
    gain = _amdahl(c, f)
    formula = (f"compute scales with forwards per micro-batch: 1/((1 − {c:.2f}) + {c:.2f}/{f:.2f}) = {gain:.2f}x "
               f"(upper bound: the extra pass may cost less than a full forward and backward)")
    return Finding("duplicate_forward", "Duplicate forward pass", obs, root, rec, gain, formula, "medium")


def rule_padding_waste(m: Measurements) -> Finding | None:
    p = m.pad_fraction
    if p is None or p < PAD_FRACTION:
        return None
    c = _phase(m, "compute")
    obs = f"{_pct(p)} of the positions in training forwards are padding" + \
          (f" (padded length up to {m.seq_len} tokens)." if m.seq_len else ".")
    if m.grpo:
        root = ("Each GRPO batch is padded to its longest completion (and prompts are left-padded to the longest "
                "prompt): unequal lengths make the device compute on pad positions, attention quadratically.")
        target = _completion_target(m)
        cap = (f"`max_completion_length: {target[0]}` caps runaway completions" if target else
               "cap runaway completions with a tighter `max_completion_length` when completions allow it")
        items = [cap, "keep prompts of similar length together (sort or bucket the dataset by prompt length)"]
    else:
        root = ("Batches are padded to the longest (or a fixed `max_length`) sequence: the device computes on pad "
                "positions, and attention does so quadratically.")
        items = ["`train_sampling_strategy: group_by_length` (transformers 5; `group_by_length: true` before) puts "
                 "similar lengths in a batch",
                 "pad per batch, not to a fixed length: tokenize without `padding='max_length'`, collate with "
                 "`DataCollatorWithPadding`",
                 "with TRL SFT: `padding_free: true` or `packing: true`",
                 "split very long documents into `max_length` chunks"]
    if m.device_type == "mps":
        items.append("on MPS keep `pad_to_multiple_of: 64`, so the number of distinct shapes (Metal graphs) stays "
                     "small")
    rec = _bullets(items)
    if c > 0:
        gain = 1.0 / ((1.0 - c) + c * (1.0 - p))
        formula = (f"compute on real tokens only: 1/((1 − {c:.2f}) + {c:.2f} × (1 − {p:.2f})) = {gain:.2f}x; "
                   f"compute part alone 1/(1 − {p:.2f}) = {1 / (1 - p):.2f}x")
    else:
        gain = 1.0 / (1.0 - p)
        formula = f"1/(1 − {p:.2f}) = {gain:.2f}x"
    return Finding("padding_waste", "Padding waste", obs, root, rec, gain, formula, "low" if m.grpo else "medium")


#: The one place to add a rule: each takes Measurements and returns a Finding or None.
RULES: list[Callable[[Measurements], Finding | None]] = [
    rule_memory_pressure, rule_input_bound, rule_duplicate_forward, rule_generation_bound, rule_padding_waste,
    rule_small_micro_batch_low_mfu, rule_completion_budget, rule_warmup,
]


def analyze(m: Measurements) -> list[Finding]:
    """Every rule's finding, ranked by expected gain (ties keep the order of RULES)."""
    findings = [f for f in (rule(m) for rule in RULES) if f is not None]
    return sorted(findings, key=lambda f: -f.expected_gain)


# ------------------------------------------------------------------ reading a run
def _values(rows: list, key: str) -> list[float]:
    """The finite numbers under ``key`` in step lines or ``log_history`` dicts."""
    values = (r.get(key) for r in rows)
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measurements(run_log: RunLog) -> Measurements:
    """Reduce a parsed run log to what the rules look at.

    The latest training session's summaries count (a resumed session that was killed has none, so the figures
    come from the step lines), and a step logged again after an out-of-memory rollback or a resume counts once
    (its latest line). Completion lengths come from ``trainer_state.json``'s ``log_history``, else the latest
    checkpoint's.
    """
    f = figures(run_log)                      # the headline figures, exactly as the report prints them
    run = run_log.header("perf")
    mem_summary = run_log.summary("mem")
    steps = run_log.unique_steps()
    events = run_log.events
    steady = [s for s in steps if s.get(keys.PERF_STEADY) == 1] or steps
    warmup_steps = f["warmup_steps"]

    fpm = _median(_values(steps, keys.PERF_FORWARDS_PER_MICROBATCH))
    if fpm is None:
        fpm = max(_values([e.details for e in events], "forwards_per_microbatch"), default=None)
    pads = _values(steady, keys.PERF_PAD_FRACTION)

    micro = last_value(steps, keys.TUNER_MICRO_BATCH) or run.per_device_train_batch_size
    accum = last_value(steps, keys.TUNER_GRAD_ACCUM) or run.gradient_accumulation_steps
    seq = _values(steps, keys.PERF_SEQ_LEN)

    driver_rows = [s for s in steps if s.number(keys.MEM_DRIVER_GB) is not None]
    driver_max_row = max(driver_rows, key=lambda s: s.number(keys.MEM_DRIVER_GB)) if driver_rows else None
    swaps = _values(steps, keys.MEM_SWAP_USED_GB)
    pressures = _values(steps, keys.MEM_PRESSURE)
    actions = mem_summary.get("actions")
    if not isinstance(actions, list):
        actions = [{"step": e.step, "action": e.details.get("action"), "message": e.message}
                   for e in events if e.source == "mem" and e.kind in ("action", "stop")]

    completion = {"mean": None, "max": None, "p90": None, "clipped": None}
    logs = run_log.latest_log_history()
    if logs:
        means, maxes = _values(logs, "completions/mean_length"), _values(logs, "completions/max_length")
        clipped = _values(logs, "completions/clipped_ratio")
        completion = {"mean": statistics.fmean(means) if means else None, "max": max(maxes, default=None),
                      "p90": _percentile(maxes, 0.9), "clipped": statistics.fmean(clipped) if clipped else None}

    return Measurements(
        device_type=run.device_type or "unknown", world_size=int(run.world_size or 1),
        grpo=bool(run.grpo), micro_batch=int(micro) if micro else None,
        grad_accum=int(accum) if accum else None, max_completion_length=run.max_completion_length,
        num_generations=run.num_generations, activation_checkpointing=run.activation_checkpointing,
        model=run.model or {}, dataloader=run.dataloader or {},
        steps=int(f["steps"] or 0), warmup_steps=int(warmup_steps) if warmup_steps is not None else None,
        warmup_overhead_sec=f["warmup_overhead_sec"], first_step_slowdown=f["first_step_slowdown"],
        steady_step_sec=f["steady_step_sec"], steady_tokens_per_sec=f["steady_tokens_per_sec"], mfu=f["mfu"],
        phases={k: float(v) for k, v in f["phases"].items()},
        pad_fraction=statistics.fmean(pads) if pads else None, forwards_per_microbatch=fpm,
        decode_bandwidth_util=_median(_values(steady, keys.PERF_DECODE_BANDWIDTH_UTIL)),
        completion_mean=completion["mean"], completion_max=completion["max"], completion_p90=completion["p90"],
        clipped_ratio=completion["clipped"], mem_high_water_gb=f["high_water_gb"], mem_budget_gb=f["budget_gb"],
        driver_gb_max=driver_max_row.number(keys.MEM_DRIVER_GB) if driver_max_row else None,
        allocated_gb_at_driver_max=driver_max_row.get(keys.MEM_ALLOCATED_GB) if driver_max_row else None,
        max_pressure=int(max(pressures)) if pressures else None,
        swap_growth_gb=max(0.0, max(swaps) - swaps[0]) if swaps else None,
        swapout_steps=sum(1 for v in _values(steps, keys.MEM_SWAPOUTS) if v > 0),
        min_steps_to_wall=min(_values(steps[MEM_GRACE_STEPS:], keys.MEM_STEPS_TO_WALL), default=None),
        watchdog_actions=actions, seq_len=int(max(seq)) if seq else None)


def measurements_from_run(output_dir: str) -> Measurements:
    """:func:`measurements` of the run in ``output_dir`` (raises :class:`~hf_perf_callbacks.runlog.ReportError`, a
    ``ValueError``, when it holds no readable ``perf_log.jsonl``)."""
    return measurements(read_run(output_dir))


# ------------------------------------------------------------------ output
def _facts_line(m: Measurements) -> str:
    parts = [f"{m.device_type} × {m.world_size}", "GRPO" if m.grpo else "Trainer", f"{m.steps} steps"]
    if m.micro_batch and m.grad_accum:
        parts.append(f"micro-batch {m.micro_batch} × accumulation {m.grad_accum}")
    if m.steady_tokens_per_sec:
        parts.append(f"steady {m.steady_tokens_per_sec:,.0f} tok/s")
    if m.steady_step_sec:
        parts.append(f"{m.steady_step_sec:.3g} s/step")
    if m.mfu is not None:
        parts.append(f"MFU {_pct(m.mfu)}")
    split = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}" for k, v in
                      sorted(m.phases.items(), key=lambda kv: -kv[1]) if v >= 0.005)
    if split:
        parts.append(f"time: {split}")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        parts.append(f"memory {m.mem_high_water_gb:.2f}/{m.mem_budget_gb:.2f} GB")
    return " · ".join(parts)


def render_markdown(findings: list[Finding], m: Measurements) -> str:
    """The content of ``perf_report.md``."""
    lines = ["# Performance report", "", f"**Run:** {_facts_line(m)}", ""]
    if not findings:
        lines += ["## Healthy run", "",
                  "No bottleneck found: warmup is over, the device is not waiting for data, memory is within "
                  "budget and no rule fired. Track `perf/steady_tokens_per_sec` to compare future runs.", ""]
        return "\n".join(lines)
    if max(f.expected_gain for f in findings) < 1.05:
        lines += ["No bottleneck limits speed (a healthy run); notes:", ""]
    for i, f in enumerate(findings, 1):
        lines += [f"## {i}. {f.title} — {f.expected_gain:.2f}x ({f.confidence} confidence)", "",
                  "### Observation", "", f.observation, "",
                  "### Root cause", "", f.root_cause, "",
                  "### Recommendation", "", f.recommendation, "",
                  "### Expected gain", "", f"**{f.expected_gain:.2f}x** — {f.gain_formula}", "",
                  "### Confidence", "", f.confidence, ""]
    return "\n".join(lines)


def write_perf_report(run: RunLog) -> tuple[str, list[Finding]]:
    """Analyse a parsed run and write ``<output_dir>/perf_report.md``; returns (path, findings)."""
    m = measurements(run)
    findings = analyze(m)
    path = os.path.join(run.output_dir, REPORT_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_markdown(findings, m))
    return path, findings


def console_summary(findings: list[Finding], top: int = 3) -> str:
    """The top findings, a few lines each."""
    if not findings:
        return "== Performance analysis ==\nhealthy run: no bottleneck found"
    lines = ["== Performance analysis =="]
    for i, f in enumerate(findings[:top], 1):
        actions = [line.removeprefix("- ") for line in f.recommendation.splitlines() if line.strip()]
        first = actions[0].split(" (")[0] if actions else "-"
        first = first if len(first) <= CONSOLE_WIDTH else first[:CONSOLE_WIDTH - 1] + "…"
        more = f" (+{len(actions) - 1} more)" if len(actions) > 1 else ""
        lines += [f"{i}. {f.title} — {f.expected_gain:.2f}x ({f.confidence} confidence)",
                  f"   seen: {f.observation}",
                  f"   do:   {first}{more}"]
    if len(findings) > top:
        lines.append(f"... {len(findings) - top} more in {REPORT_FILE}")
    return "\n".join(lines)


__all__ = ["Measurements", "Finding", "RULES", "analyze", "measurements", "measurements_from_run", "render_markdown",
           "write_perf_report", "console_summary", "dataloader_advice"]

