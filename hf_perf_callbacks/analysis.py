"""The run explains itself: rule-based analysis of a run's ``perf_log.jsonl`` (+ ``trainer_state.json`` and the
tuner's ``tuner_split.json``). Pure: no torch, no transformers.

:func:`measurements` reduces a parsed run log (:func:`hf_perf_callbacks.runlog.read_run`) to :class:`Measurements`:
headline figures from :func:`hf_perf_callbacks.figures.figures` (the ones ``hf-perf report`` prints, never
recomputed here), the trainer's own logs from the step lines' ``log/<key>`` values (else ``trainer_state.json``),
the tuner's decisions through :func:`hf_perf_callbacks.splitfile.read_split_file`, and what the run header says
about the interface (``launcher``) and the CPU (``cpu_cores``, ``torch_threads``) when its writer records them. Every
logged value is read through a typed accessor: a field of another type is skipped and listed in the report, never a
crash. Every rule in :data:`RULES` is a pure function of the measurements and returns a :class:`Finding`, a
:class:`Note` (checked and fine, or not judged: what the run is too short for) or None. A finding carries the
**complete setting** to apply (``Finding.setting``, e.g. ``{"per_device_train_batch_size": 8,
"gradient_accumulation_steps": 1}``; ``Finding.env`` for what only the environment sets, ``OMP_NUM_THREADS``),
relative to what the run configured and never one already in effect, worded for the interface the run was started
with (recipe keys for ``hf-perf train``), and an expected gain only where it is earned (``Finding.basis``):

- ``measured``: the run itself measured the alternative (its own wait, its own lost time; ``lower_bound``: at least);
- ``calibrated``: a model whose predictions ``benchmarks/bench_advice.py`` checked against runs with the advice
  applied (the confidence says how close they came);
- ``too few steps``: no number: the run is shorter than the evidence needs (:func:`_too_short`);
- ``try``: no number (``expected_gain`` None): the prediction could not be checked.

**Evidence thresholds.** A rule that reads timings (shares of wall time, MFU, slow steps) and every gain need warmup
finished and :data:`MIN_STEADY_STEPS` steps after it; until then the report says "too few steps to judge" and how
many more steps it needs. Counts (forwards per micro-batch, padding, rewards, completion lengths, memory) are judged
from the first step; fixed-length padding needs :data:`MIN_FIXED_LENGTH_STEPS` steps at one length, thread
oversubscription :data:`MIN_MACHINE_STEPS` steps, a run that cannot learn :data:`NO_LEARNING_LOGS` logs. The ranking
is a total order (:func:`_rank`): two runs with the same evidence get the same findings in the same order.

:func:`analyze` ranks the findings (a run that cannot learn, or swaps / nears the memory wall, first; then by
expected gain; then "try" findings); :func:`check` returns the findings and the notes; :func:`write_perf_report`
writes ``<output_dir>/perf_report.md``.

======================  ===========================================================================================
rule                    fires when (finding) / notes when
======================  ===========================================================================================
``no_learning``         GRPO: every completion of ≥ ``NO_LEARNING_LOGS`` logs scored the same → partial credit, a
                        check of the reward, an easier task (no setting: more samples cannot move a constant
                        reward; ``max_completion_length`` when most completions were cut); or every group flat on
                        ≥ ``NO_LEARNING_LOGS`` logs in a row while the mean reward moved → ``num_generations``
                        (and ``temperature`` below 1); try. No reward data → note (not judged)
``memory_pressure``     swapping, pressure level ≥ 1, the wall ≤ ``STEPS_TO_WALL`` steps away, or driver memory far
                        above live tensors → the setting that frees the most memory (names the tuner's OOMs); try
``oversubscription``    CPU, the whole run: torch threads + other processes' busy cores > cores + ``OVERSUBSCRIBED``,
                        ≥ ``THREADS_IDLE`` threads not running, similar work ``STEP_SPREAD``x apart →
                        ``OMP_NUM_THREADS`` = the free cores (``Finding.env``); measured, at least (the run's
                        fastest steps)
``contention``          slow steps whose CPU time stayed flat (the meter's ``early_contention_sec``; each step's own
                        wall/CPU ratio ≥ ``1 + CONTENTION_RATIO`` times the steady steps') → other processes,
                        threads; measured (the time lost in those steps)
``evaluation``          evaluation ≥ ``EVAL_SHARE`` of the wall time (≥ 2 evaluations) → ``eval_steps`` at which it
                        takes ``EVAL_TARGET``; measured (the run's own evaluation seconds)
``input_bound``         data wait ≥ ``DATA_WAIT_FRACTION`` → DataLoader settings; ``1/(1 − wait)``, calibrated
``duplicate_forward``   forwards per micro-batch > ``DUPLICATE_FORWARDS``; Amdahl on the compute share, calibrated
``padding_waste``       pad fraction ≥ ``PAD_FRACTION``: a Trainer padded to one length on every step → per-batch
                        padding (a code change), try; ``pad_to_multiple_of`` off the device that needs it →
                        ``pad_to_multiple_of: null``, calibrated; per-batch padding → length grouping, try; GRPO
                        padding to the longest completion → note
``generation_bound``    GRPO, generation ≥ ``GENERATION_SHARE`` → vLLM (CUDA), a larger generation batch (its
                        off-policy cost stated); try
``tuning_cost``         the tuner's measurement cost more than its expected saving by ≥ ``TUNING_COST_SHARE`` of the
                        training time → ``tune=False`` for runs this short; measured
``small_micro_batch``   micro-batch ≤ ``SMALL_MICRO_BATCH`` with accumulation ≥ 2, low MFU (unknown: compute share ≥
                        ``HIGH_COMPUTE_SHARE``), no tuner measurement → a larger exact split, never above a
                        micro-batch that ran out of memory; try. The tuner measured another split and paid → note
                        with its trials (``splitfile.trial_figures``); it measured none → note (not judged)
``tuner_hint``          the tuner attached to a plain ``trainer.train()`` (its event) → note (not judged)
``completion_budget``   GRPO: most completions cut at ``max_completion_length`` → the limit and
                        ``mask_truncated_completions``; try. Completions far below it with rare runaways → a cap;
                        try. No runaways (memory headroom only) → note
``warmup``              always a note, worded from the meter's figures ("not finished after N steps" while it is)
``evidence``            the run is shorter than the timing rules need → note (not judged)
``log_fields``          fields of another type skipped → note (not judged)
======================  ===========================================================================================

Memory estimates (shown with their formulas) use the run header's model config and the memory model of
:mod:`hf_perf_callbacks.estimate` (the one behind the recipes' memory table), per token:
KV cache = 2 × layers × kv_heads × head_dim × bytes (:func:`~hf_perf_callbacks.estimate.kv_cache_bytes_per_token`);
activations = layers × (6·hidden + 2·kv_heads·head_dim + 4·intermediate) × bytes without activation checkpointing
and (layers × hidden + 6·hidden + 2·kv_heads·head_dim + 4·intermediate) × bytes with it
(:func:`~hf_perf_callbacks.estimate.activation_bytes_per_token`); logits = vocab × 4 bytes (fp32 log-softmax,
:func:`~hf_perf_callbacks.estimate.logits_bytes_per_token`). ``bytes`` is the model's bytes per parameter.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from . import estimate, keys
from .batching import Split, exact_splits, next_smaller
from .dataloader import dataloader_advice, dataloader_changes
from .figures import (
    completion_stats,
    figures,
    finite,
    last_value,
    ranges_text,
    step_ranges,
    train_column,
    trainer_logs,
)
from .runlog import GB, ReadStep, RunHeader, RunLog, conform, number, read_run
from .splitfile import Decision, SplitFile, read_split_file, trial_figures
from .stats import classify_slow_steps, quantile
from .wording import TUNER_NEEDS_TRAIN_WITH_TUNING, warmup_words

REPORT_FILE = "perf_report.md"
CONSOLE_WIDTH = 160

WARMUP_SHARE = 0.1           # warmup overhead / run time at which a note says "compare steady figures only"
DATA_WAIT_FRACTION = 0.1
GENERATION_SHARE = 0.5
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
SMALL_MICRO_BATCH = 2
LOW_MFU = 0.2
HIGH_COMPUTE_SHARE = 0.5
DUPLICATE_FORWARDS = 1.05
PAD_FRACTION = 0.2
NO_LEARNING_LOGS = 3         # consecutive logs with zero reward variance in every group and zero gradient norm
ZERO = 1e-12
CONTENTION_SHARE = 0.05      # time lost to contention / run time worth a finding
CONTENTION_RATIO = 0.2       # a contended step's wall/CPU above the steady steps' by this share (else not contention)
EVAL_SHARE = 0.1             # evaluation's share of the wall time worth a finding
EVAL_TARGET = 0.05           # the share the advised eval_steps brings it to
TUNING_COST_SHARE = 0.01     # a tuning that cost more than it saved, by this share of the training time: a finding
# Evidence thresholds: below them a rule says "too few steps to judge" instead of a finding or a gain.
MIN_STEADY_STEPS = 3         # timing rules (shares of wall time, MFU, slow steps, any gain): warmup over + these steps
MIN_MACHINE_STEPS = 4        # whole-run contention: steps with CPU time and the machine's load ...
MIN_MACHINE_CYCLES = 3       # ... and this many whole steps (GRPO: generation cycles) after the first to compare
MIN_FIXED_LENGTH_STEPS = 3   # fixed-length padding: steps padded to one and the same length
OVERSUBSCRIBED = 0.5         # threads + other processes' busy cores above the cores by this much: oversubscribed
THREADS_IDLE = 0.5           # threads of this process not running (threads − CPU time / wall) worth a finding
STEP_SPREAD = 1.5            # similar work whose wall (or CPU) seconds per token differ this much between steps

#: How close each model came to the measured gain when ``benchmarks/bench_advice.py`` applied its advice
#: (``benchmarks/results/advice_*.json``): (rule, device type) → (checks, worst |predicted / measured − 1|). A rule
#: prints its number only on a device type listed here within 25%: a gain checked on a CPU (process CPU time) says
#: nothing about a GPU's wall time. ``input_bound`` is absent on CPUs: 1/(1 − wait) predicted 2.30x where two workers
#: measured 1.67x on a loaded 2-core CPU (the workers' own collation competed for the cores); on an H100 it predicted
#: 4.99x against 4.13x measured.
CALIBRATION: dict[tuple[str, str], tuple[int, float]] = {
    ("duplicate_forward", "cpu"): (1, 0.06), ("duplicate_forward", "cuda"): (1, 0.13),
    ("input_bound", "cuda"): (1, 0.21), ("padding_waste", "cpu"): (2, 0.13),
    ("evaluation", "cpu"): (1, 0.01)}      # a measured gain, checked too: 3.52x predicted, 3.54x applied


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
    clipped_ratio: float | None              # mean over the run's logs (the report's summary line says the same)
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
    seq_len_mean: float | None = None        # mean padded training length of the steady steps
    steps_per_generation: int | None = None  # as configured (TRL's default: gradient_accumulation_steps)
    pad_to_multiple_of: int | None = None
    temperature: float | None = None
    use_vllm: bool | None = None
    tuner_attached: bool = False             # tuner/* keys in the step lines
    tune: Decision | None = None             # the tuner's latest measurement of splits on this run's own steps
    memory_limits: list[Decision] = field(default_factory=list)   # the tuner's oom / watchdog / memory_check decisions
    logs: int = 0                            # training logs with reward statistics (GRPO)
    no_signal_run: int = 0                   # longest run of logs with frac_reward_zero_std 1 and grad_norm 0
    reward_mean: float | None = None         # mean reward over those logs
    rewards: dict | None = None              # the run's reward statistics (see _rewards); None: no reward data
    trainer_log_source: str | None = None    # where the trainer's logs came from: "perf log", "trainer_state.json"
    contention: dict | None = None           # steps slowed by other processes: see rule_contention
    machine: dict | None = None              # the CPU over the whole run: cores, threads, load (see _machine)
    warmup_done: bool | None = None          # the meter decided warmup (None: no meter data)
    steady_steps: int = 0                    # steps after warmup (0 while warmup is not finished)
    fixed_seq_len: int | None = None         # Trainer: every step padded to this one length (a fixed-length collator)
    seq_len_min: int | None = None           # shortest padded training sequence (differs from seq_len: per-batch)
    launcher: str | None = None              # the command that started the run ("hf-perf train"); None: Python
    logged: frozenset = frozenset()          # the metric keys the step lines hold
    budget_range_gb: tuple[float, float] | None = None   # lowest and highest mem/limit_gb: the budget per step
    wall_moves: list[tuple[int | None, str, bool]] = field(default_factory=list)   # the watchdog's wall events:
    #                                        (step, why, moved: False where the start set it below the device's limit)
    leak_mib_per_step: float | None = None   # the watchdog saw memory grow on every step (its leak warning)
    skipped: list[str] = field(default_factory=list)   # logged fields of another type, skipped (what the report says)
    tuner_hint: str | None = None            # the tuner said it needs train_with_tuning (a plain train())
    trainer_kind: str | None = None          # "sft", "dpo" (their own training logs show it), None: Trainer / GRPO
    evaluation: dict | None = None           # the run's evaluations, measured (see _evaluation)
    first_steady: dict | None = None         # the latest train() call's first step, steady or not (_first_steady)
    train_sec: float | None = None           # Σ training seconds of the run's steps (what the tuning's cost is against)


@dataclass
class Finding:
    """A bottleneck with its fix. ``setting`` is the complete change (config keys → values) relative to the run's
    own configuration; ``expected_gain`` is printed only when ``basis`` is "measured" or "calibrated" (None: "try");
    ``predicted_gain`` is the rule's model prediction (what ``benchmarks/bench_advice.py`` checks), printed or not."""

    rule: str
    title: str
    observation: str
    root_cause: str
    recommendation: str
    expected_gain: float | None
    gain_formula: str
    confidence: str                          # "high" | "medium" | "low"
    setting: dict = field(default_factory=dict)
    basis: str = "try"                       # "measured" | "calibrated" | "try" | "too few steps"
    predicted_gain: float | None = None
    priority: int = 1                        # 0: cannot learn / swapping / near the wall, ranked first
    env: dict = field(default_factory=dict)  # environment variables to set before the process starts
    lower_bound: bool = False                # expected_gain is a floor ("at least"), not a prediction


@dataclass
class Note:
    """Checked and fine (``judged``): what a rule looked at and why there is nothing to gain; or not judged
    (``judged`` False): what the run's evidence is too short for, and how much more it needs."""

    rule: str
    title: str
    text: str
    judged: bool = True

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


def _known_dims(model: dict) -> dict:
    """:func:`_dims` of a model whose per-token bytes were computed: the formulas are written only then."""
    d = _dims(model)
    assert d is not None, "a formula of a model without layers, hidden size or attention heads"
    return d


def _kv_formula(model: dict) -> str:
    d = _known_dims(model)
    return f"2 × {d['layers']} layers × {d['kv_heads']} kv_heads × {d['head_dim']} head_dim × {d['bytes']} B"


def _act_formula(model: dict, checkpointing: bool) -> str:
    """The activation bytes per token as :func:`estimate.activation_bytes_per_token` computes them, written with
    this model's numbers (each number followed by its name: the text evaluates to the bytes)."""
    d = _known_dims(model)
    b = d["bytes"]
    if checkpointing:
        return f"{d['layers']} layers × {d['hidden']} hidden × {b} B"
    lora = estimate.layer_activation_bytes(d, b, 1) - estimate.layer_activation_bytes(d, b, 0)   # Σ LoRA inputs
    return (f"{d['layers']} layers × (2 × {estimate.NORM_BYTES} × {d['hidden']} hidden + {b} × (4 × "
            f"{d['heads'] * d['head_dim']} q_dim + 3 × {d['intermediate']} intermediate) + 4 × {lora} lora_inputs) B")


def _train_formula(model: dict, checkpointing: bool) -> str:
    """Activations plus the LM head's tile per training token (:func:`estimate.logits_bytes_per_token`), as text."""
    d = _known_dims(model)
    if not _logits_per_token(model):
        return _act_formula(model, checkpointing)
    head = (f"({estimate.HEAD_VOCAB_CHUNK} vocab_chunk × 2 + {min(d['vocab'], estimate.HEAD_VOCAB_CHUNK)} "
            f"tile_columns × {estimate.HEAD_TILE_TEMP_BYTES['torch']} + {d['hidden']} hidden × (2 + 4)) B lm_head")
    return f"{_act_formula(model, checkpointing)} + {head}"


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
    batch = _generation_batch(m)                 # completions per generation call, over all devices
    n = batch // max(1, m.world_size or 1) if batch else m.num_generations
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
        return exact_splits(effective, world, _generation_batch(m) if grpo else None,
                            m.num_generations if grpo else None)
    except ValueError:
        return []


def _calibrated(rule: str, m: Measurements, predicted: float, formula: str) -> tuple[float | None, str, str, str]:
    """(expected_gain, basis, confidence, formula) for a model prediction: printed only when CALIBRATION holds the
    rule's check against runs with the advice applied on this device type, and when the run has the steps to
    judge it (:func:`_too_short`)."""
    device_type = m.device_type
    runs, error = CALIBRATION.get((rule, device_type), (0, math.inf))
    if not runs or error > 0.25:
        checked = sorted(d for r, d in CALIBRATION if r == rule)
        where = (f"calibrated on {', '.join(checked)} only, not on {device_type}" if checked and not runs
                 else "not calibrated against runs with the advice applied")
        return None, "try", "low", f"not printed: this model ({formula}) is {where}"
    confidence = "high" if error <= 0.1 and runs >= 3 else "medium"
    return _judged(m, predicted, "calibrated", confidence,
                   f"{formula}; calibrated on {device_type}: on {runs} run(s) with the advice applied the measured "
                   f"gain was within {error:.0%} of this model's")


def _yaml(setting: dict) -> str:
    def value(v):
        return "null" if v is None else "true" if v is True else "false" if v is False else json.dumps(v)
    return ", ".join(f"`{k}: {value(v)}`" for k, v in setting.items())


def _generation_batch(m: Measurements) -> int | None:
    """Completions per generation call over all devices: micro-batch × world × steps_per_generation (as configured;
    a tuner re-size keeps it)."""
    if not (m.micro_batch and m.grad_accum):
        return None
    spg = m.steps_per_generation or m.grad_accum
    return m.micro_batch * max(1, m.world_size or 1) * spg


def _split_setting(m: Measurements, split: Split) -> dict:
    """The complete config change to run ``split``: micro-batch and accumulation, and for GRPO the
    ``steps_per_generation`` that keeps the generation batch when TRL's default (= accumulation) would not."""
    setting = {"per_device_train_batch_size": split.micro_batch, "gradient_accumulation_steps": split.grad_accum}
    gen = _generation_batch(m)
    if m.grpo and gen:
        spg = gen // (split.micro_batch * max(1, m.world_size or 1))
        if spg != split.grad_accum:
            setting["steps_per_generation"] = spg
    return setting


def _too_short(m: Measurements) -> str | None:
    """Why this run's timings cannot be judged (None: they can): the timing rules and every gain need warmup over
    and :data:`MIN_STEADY_STEPS` steps measured after it."""
    if m.warmup_done is None:
        return "the log holds no warmup decision (no ThroughputMeter step lines)"
    if not m.warmup_done:
        return f"warmup was not finished after {m.steps} step{'' if m.steps == 1 else 's'}"
    if m.steady_steps < MIN_STEADY_STEPS:
        return f"only {m.steady_steps} step(s) ran after warmup ({MIN_STEADY_STEPS} needed)"
    return None


def _judged(m: Measurements, gain: float | None, basis: str, confidence: str,
            formula: str) -> tuple[float | None, str, str, str]:
    """A gain as the run's evidence allows it: without warmup over and enough steady steps, "too few steps"."""
    why = _too_short(m)
    if why is None or gain is None:
        return gain, basis, confidence, formula
    return None, "too few steps", "low", f"too few steps to judge the gain ({why}); the model: {formula}"


def _launcher(m: Measurements) -> bool:
    return bool(m.launcher)


def _tuner_how(m: Measurements) -> str:
    """How this run gets the batch tuner to measure its splits, in the interface it was started with."""
    if _launcher(m):
        return ("keep `AdaptiveBatchTuner` in the recipe's `callbacks` (the default) with `tune: true` (the "
                "default; `--tune false` turns it off)")
    if m.tuner_attached:
        return ("call `train_with_tuning(trainer)` instead of `trainer.train()`, with `AdaptiveBatchTuner(tune=True)` "
                "(the default): only then does the tuner measure the splits")
    return "attach `AdaptiveBatchTuner()` (`callbacks=default_callbacks()`) and call `train_with_tuning(trainer)`"


def _split_name(split: Split) -> str:
    return f"{split.micro_batch}×{split.grad_accum}"


def _memory_cap(m: Measurements) -> tuple[int | None, str | None]:
    """The largest micro-batch any advice may name — one below the smallest that ran out of memory or that the
    memory watchdog had to shrink (the tuner's ``oom``, ``watchdog`` and ``memory_check`` decisions, its trials that
    did not fit, the watchdog's stops and smaller-batch requests) — and the sentence that says why; (None, None)
    when nothing hit the memory limit."""
    hits: list[tuple[int, str]] = []
    for d in m.memory_limits:
        what = {"oom": "ran out of memory", "watchdog": "neared the memory budget (the watchdog asked for less)",
                "memory_check": "did not fit at the longest length"}[d.kind]
        hits.append((d.old.micro_batch, f"micro-batch {d.old.micro_batch} {what} at step {d.step}"
                     + (f" ({d.reason})" if d.reason else "")))
    for t in (m.tune.trials if m.tune else []):
        if not t.fits or (t.error and "memory" in t.error.lower()):
            hits.append((t.split.micro_batch, f"the tuner's trial of {_split_name(t.split)} "
                         + ("ran out of memory" if t.error else "went over the memory budget")))
    if not m.memory_limits and m.micro_batch:
        for a in m.watchdog_actions:
            if a.get("action") in ("smaller_batch", "stop"):
                hits.append((m.micro_batch, f"the memory watchdog's {a.get('action')} at step {a.get('step')} at "
                             f"micro-batch {m.micro_batch}"))
    if not hits:
        return None, None
    micro, why = min(hits, key=lambda h: h[0])
    return max(0, micro - 1), why


# ------------------------------------------------------------------ rules
def rule_no_learning(m: Measurements) -> Finding | Note | None:
    if not m.grpo:
        return None
    r = m.rewards
    if r is None:
        return Note("no_learning", "No reward data",
                    "No reward data in this run's logs (no `log/reward` in the step lines, no `trainer_state.json` "
                    "with rewards): whether the run can learn was not checked.", judged=False)
    constant = _constant_reward(r) and r["logs"] >= NO_LEARNING_LOGS
    if not constant and m.no_signal_run < NO_LEARNING_LOGS:
        if _constant_reward(r):
            return Note("no_learning", "Too few logs to judge the rewards",
                        f"Every completion of the {r['logs']} log(s) scored {r['min']:.3g}: too few logs to judge "
                        f"whether the run can learn ({NO_LEARNING_LOGS} needed; `logging_steps` sets how often the "
                        f"trainer logs).", judged=False)
        return None
    clipped, limit = m.clipped_ratio or 0.0, m.max_completion_length
    setting: dict = {}
    if constant:
        funcs = ", ".join(f"`{name}` {lo:.3g}" for name, (lo, _) in r["funcs"].items())
        obs = (f"On all {r['logs']} logs every completion got the same reward, {r['min']:.3g}: no prompt group had "
               f"any spread (`reward_std` 0)" + (f"; per reward function: {funcs}" if funcs else "")
               + (f"; the gradient norm was 0 on {m.no_signal_run} consecutive logs" if m.no_signal_run else "")
               + (f" (from the {m.trainer_log_source})." if m.trainer_log_source else "."))
        root = ("GRPO learns from reward differences between the completions of one prompt (each advantage is a "
                "reward minus its group's mean). Every completion of this run scored the same, so every advantage, "
                "the loss and the gradient were 0: the weights never moved. More samples per prompt or a higher "
                "temperature cannot move a reward that no sample of the whole run has moved: the reward gives no "
                "partial credit the model's completions can reach, or the task is too hard for this model.")
        items = ["make the reward give partial credit a sampled completion can reach (the format, a correct part, "
                 "closeness to the answer), so that completions of a group differ",
                 "check the reward functions on a few completions by hand: a reward that is constant by mistake (a "
                 "parsing error that always returns 0) looks exactly like this",
                 "or start where the model succeeds sometimes: an easier task or curriculum, or a model (or a short "
                 "supervised warm-start) that solves some prompts"]
        if clipped >= CLIPPED_LARGE and limit:         # no setting: a length cannot move a constant reward
            items.append(f"then, if the answers need more room: `max_completion_length: {2 * limit}` (now {limit}; "
                         f"{_pct(clipped)} of completions were cut at the limit) — a longer limit cannot make a "
                         f"reward that no completion moved vary by itself")
        title = "The run cannot learn: every completion got the same reward"
    else:
        obs = (f"On {m.no_signal_run} consecutive logs (of {m.logs}) every prompt group's completions got the same "
               f"reward (`frac_reward_zero_std` 1) and the gradient norm was 0"
               + (f"; mean reward {m.reward_mean:.3g}" if m.reward_mean is not None else "")
               + ("; the mean reward differed between logs, so some prompts score and others do not"
                  if r and r["max"] - r["min"] > ZERO else "") + ".")
        root = ("GRPO's advantage is each completion's reward minus its group's mean: when all completions of a "
                "group score the same, every advantage is 0, so the loss and the gradient are 0 and the weights do "
                "not move.")
        items = ["reward shaping: give partial credit a sampled completion can reach (format, a correct part, "
                 "closeness), so completions of a group differ"]
        n, gen = m.num_generations, _generation_batch(m)
        if n and r and r["max"] - r["min"] > ZERO:       # some prompts score: more samples per prompt can differ
            setting["num_generations"] = 2 * n
            text = (f"`num_generations: {2 * n}` (more samples per prompt: more chances that one scores "
                    f"differently from the others)")
            if gen and gen % (2 * n):
                spg = 2 * (m.steps_per_generation or m.grad_accum or 1)
                setting["steps_per_generation"] = spg
                text += f" with `steps_per_generation: {spg}` (the generation batch must hold whole groups)"
            items.append(text)
            t = m.temperature
            if t is not None and t < 1.0:
                setting["temperature"] = 1.0
                items.append(f"`temperature: 1.0` (now {t:g}): more varied samples within a group")
        items.append("check the reward functions on a few completions by hand: a reward that is constant by mistake "
                     "(a parsing error that always returns 0) looks exactly like this")
        title = "The run cannot learn: no reward variance, zero gradients"
    return Finding("no_learning", title, obs, root, _bullets(items), None, "no speed figure: until rewards differ "
                   "within a group no step changes the weights", "high", setting, "try", None, priority=0)


def _contention_words(m: Measurements) -> str:
    """What the report says about other processes beside warmup: the finding that names them (only one the report
    has), else the meter's measured seconds when there are any, else nothing."""
    names = [name for name, rule in (("oversubscription", rule_oversubscription), ("contention", rule_contention))
             if rule(m) is not None]
    if names:
        return (f" Other processes slowed this run too (the {' and the '.join(names)} finding"
                f"{'s' if len(names) > 1 else ''} above): that time is contention, not warmup, and it recurs.")
    c = m.contention
    if c:
        return (f" Other processes slowed {c['steps']} step(s) ({ranges_text(step_ranges(c['step_list']))}) by "
                f"{c['lost_sec']:.1f} s, {_pct(c['lost_share'])} of the run: contention, not warmup (below the "
                f"{CONTENTION_SHARE:.0%} that makes a finding).")
    return ""


def rule_warmup(m: Measurements) -> Note | None:
    slow, overhead, steady, n = m.first_step_slowdown, m.warmup_overhead_sec, m.steady_step_sec, m.warmup_steps
    other = _contention_words(m)
    contended = bool(other)
    if m.warmup_done is False:
        return Note("warmup", "Warmup not finished",
                    f"Warmup was not finished after {m.steps} step{'' if m.steps == 1 else 's'}: the meter has not "
                    f"seen its steps settle at one level, so the run has no steady figures yet (run longer)."
                    + other, judged=False)
    if slow is None and overhead is None:
        return None
    first = m.first_steady or {}
    parts = [warmup_words(n, slow, overhead, first.get("step"))]
    fresh = ("One-time costs of a fresh process (optimizer state, allocator growth"
             + {"mps": ", Metal shader compilation", "cuda": ", CUDA context and kernel selection",
                "xpu": ", kernel compilation"}.get(m.device_type, "") + ") do not recur")
    if first.get("included"):
        text = _sentence(parts) + (
            f" Step {first['step']} counts among the steady steps (the meter found no warmup beyond it), so its "
            f"{first['sec']:.3g} s are in the steady figures: steady step {first['with']:.3g} s, "
            f"{first['without']:.3g} s without it.")
    else:
        text = _sentence(parts) + " " + fresh + "; the steady figures exclude the warmup steps."
    text += other
    share = overhead / (m.steps * steady + overhead) if (overhead and steady and m.steps) else None
    if overhead and steady and share is not None and share >= WARMUP_SHARE and not contended:
        target = 0.05
        steps_needed = math.ceil(overhead * (1 - target) / (target * steady))
        text += (f" In this short run warmup is {_pct(share)} of the time: compare steady figures only, or run "
                 f"≥ {steps_needed} steps for warmup below 5%.")
    return Note("warmup", "Warmup", text)


def oversubscribed(threads: float, other: float, cores: float) -> bool:
    """Torch's threads plus the other processes' busy cores exceed the cores by :data:`OVERSUBSCRIBED` (the demand
    half of :func:`rule_oversubscription`; ``hf-perf demo`` applies it before its run)."""
    return threads + other >= cores + OVERSUBSCRIBED


def free_cores(cores: float, other: float) -> int:
    """The thread count :func:`rule_oversubscription` advises: the cores the other processes leave free, at least 1."""
    return max(1, int(cores - other + 0.25))


def _oversubscription(m: Measurements) -> dict | None:
    """Whole-run thread oversubscription on a CPU (:func:`_machine`'s figures): over ≥ :data:`MIN_MACHINE_STEPS`
    steps, this process's threads plus the other processes' busy cores exceed the cores by :data:`OVERSUBSCRIBED`,
    at least :data:`THREADS_IDLE` of its threads were not running (CPU time / wall time below the thread count),
    and time was lost: similar work took ≥ :data:`STEP_SPREAD` times longer (wall or CPU seconds per token) on some
    steps than on others.
    With the thread count assumed (the run header does not record it), the CPU time per token must vary as much
    (threads spinning while a partner waits for a core), so that a run already at one thread is not advised one.
    Adds the advised thread count (the cores the others leave free, at least 1); None when it is not below the
    run's."""
    c = m.machine
    if not c or c["steps"] < MIN_MACHINE_STEPS or not c["cores"] or not c["threads"] or c["threads"] < 2:
        return None
    demand, idle = c["threads"] + c["other"], c["threads"] - c["busy"]
    spread, cpu_spread = c["spread"] or 0.0, c["cpu_spread"] or 0.0
    if not oversubscribed(c["threads"], c["other"], c["cores"]) or idle < THREADS_IDLE \
            or max(spread, cpu_spread) < STEP_SPREAD:
        return None
    if c["threads_from"] != "run header" and cpu_spread < STEP_SPREAD:
        return None
    advised = free_cores(c["cores"], c["other"])
    return {**c, "demand": demand, "idle": idle, "advised": advised} if advised < c["threads"] else None


def _threads_item(m: Measurements, n: int) -> str:
    if _launcher(m):
        return (f"`OMP_NUM_THREADS={n}` in the environment that starts the run: `OMP_NUM_THREADS={n} hf-perf train "
                f"--config …` (a recipe's `env:` is applied after torch has started its threads)")
    return (f"`OMP_NUM_THREADS={n}` in the environment that starts the run, or `torch.set_num_threads({n})` "
            f"before training")


def rule_oversubscription(m: Measurements) -> Finding | None:
    o = _oversubscription(m)
    if not o:
        return None
    t, a = o["threads"], o["advised"]
    obs = (f"Over the whole run ({o['steps']} steps) this process kept {o['busy']:.2f} of its {t} threads running "
           f"(process CPU time / wall time) while other processes kept {o['other']:.1f} of the {o['cores']} cores "
           f"busy" + (f" (load {o['load']:.1f} per core)" if o["load"] is not None else "")
           + f": {t} threads and {o['other']:.1f} cores of other work asked for {o['demand']:.1f} cores of "
           f"{o['cores']}; steps of similar work took {o['spread']:.1f}x apart in wall time per token and "
           f"{o['cpu_spread']:.1f}x in CPU time per token.")
    assumed = [o[key] for key in ("cores_from", "threads_from") if o[key] != "run header"]
    if assumed:
        obs += " The run header does not record them: " + "; ".join(assumed) + "."
    root = (f"Thread oversubscription: torch splits each operation over {t} threads and waits at its end for all of "
            "them. While another process holds a core, one thread waits for it and its partner spins at the barrier, "
            "so CPU time rises with the wall time (why the slow-step check, which looks for slow steps with flat CPU "
            "time, cannot see it, and why it is not warmup: it recurs all run). With no more threads than free cores "
            "no thread waits for a core.")
    items = [_threads_item(m, a) + f" ({o['cores']} cores − {o['other']:.1f} busy with other work, at least 1)",
             "or stop or move the other processes using these cores (a second training, a test suite, a build)"]
    gain, formula = None, "not predicted: the run has no step without contention to compare with"
    if o["lower_bound"]:
        gain = o["lower_bound"]
        formula = (f"at least {gain:.2f}x: the run's mean wall seconds per token over its fastest steps' (10th "
                   f"percentile) — those steps were contended too, and fewer threads also stop the spinning")
    return Finding("oversubscription", "Thread oversubscription: more threads than free cores", obs, root,
                   _bullets(items), gain, formula, "medium" if o["threads_from"] == "run header" else "low", {},
                   "measured" if gain else "try", None, env={"OMP_NUM_THREADS": str(a)}, lower_bound=bool(gain))


def rule_contention(m: Measurements) -> Finding | None:
    c = m.contention
    if not c or (c.get("lost_share") or 0.0) < CONTENTION_SHARE or _too_short(m):
        return None
    lost, share = c["lost_sec"], c["lost_share"]
    obs = (f"{c['steps']} step(s) ({ranges_text(step_ranges(c['step_list']))}) ran slower than the steady level "
           f"while their process CPU time did not rise with them (wall/CPU {c['wall_over_cpu']:.2f} against "
           f"{c['steady_wall_over_cpu']:.2f} when steady): {lost:.1f} s ({_pct(share)} of the run"
           + (", the meter's `early_contention_sec`" if c["source"] == "meter" else "")
           + ") went to waiting for a CPU")
    if c.get("other_cores") is not None:
        obs += f"; other processes kept up to {c['other_cores']:.1f} CPU cores busy during those steps"
    obs += "."
    root = ("Other processes (or too many threads of this one) shared the CPU cores: the training process was "
            "runnable but not running. This is not warmup — warmup costs CPU time (allocation, compilation) and "
            "does not recur.")
    items = ["stop or move the other processes using these cores (a second training, a test suite, a build)",
             "or leave them the cores they need: `OMP_NUM_THREADS` / `torch.set_num_threads` at most the cores "
             "the other processes leave free (threads beyond them wait for each other)"]
    gain = 1.0 / (1.0 - share)
    formula = (f"the measured time lost: 1/(1 − {lost:.1f} s / {c['run_sec']:.1f} s) = {gain:.2f}x (those steps at "
               f"the steady level)")
    return Finding("contention", "CPU contention: other processes slowed the run", obs, root, _bullets(items), gain,
                   formula, "medium", {}, "measured", gain)


def rule_evaluation(m: Measurements) -> Finding | None:
    """Evaluation's share of the wall time, measured on this run's own evaluations: ``eval_steps``."""
    e = m.evaluation
    if not e or e["share"] < EVAL_SHARE or e["evals"] < 2:
        return None
    per_eval, train_per_step = e["eval_sec"] / e["evals"], e["train_sec"] / max(1, e["steps"])
    every = e["every"]
    needed = per_eval * (1 - EVAL_TARGET) / (EVAL_TARGET * train_per_step) if train_per_step > 0 else every * 10
    new = max(every + 1, _nice_interval(needed))
    saved = e["eval_sec"] * (1 - every / new)
    gain = e["wall_sec"] / (e["wall_sec"] - saved)
    obs = (f"{e['evals']} evaluations (every {every} step{'s' if every != 1 else ''}) took {e['eval_sec']:.1f} s of "
           f"the run's {e['wall_sec']:.1f} s wall time ({_pct(e['share'])}), {per_eval:.3g} s each, against "
           f"{train_per_step:.3g} s of training per step. The steady figures (s/step, tokens/s) leave evaluation "
           f"out: the run's wall time does not.")
    root = ("Each evaluation runs the whole `eval_dataset` through the model; evaluating every few steps spends more "
            "time judging the model than training it.")
    items = [f"`eval_strategy: steps` with `eval_steps: {new}` (now every {every}): evaluation then takes about "
             f"{_pct(per_eval / new / (per_eval / new + train_per_step))} of the wall time",
             "with `load_best_model_at_end: true`, `save_steps` must be a multiple of `eval_steps`",
             "or evaluate a smaller set (`eval_dataset.select(range(n))`) or with a larger "
             "`per_device_eval_batch_size`"]
    formula = (f"measured: this run's {e['evals']} evaluations took {e['eval_sec']:.1f} s; every {new} steps instead "
               f"of {every} saves {saved:.1f} s of {e['wall_sec']:.1f} s: {e['wall_sec']:.1f} / "
               f"({e['wall_sec']:.1f} − {saved:.1f}) = {gain:.2f}x (each evaluation costing what this run's did)")
    return Finding("evaluation", "Evaluation takes a large share of the wall time", obs, root, _bullets(items), gain,
                   formula, "high", {"eval_strategy": "steps", "eval_steps": new}, "measured", gain)


def _nice_interval(x: float) -> int:
    """The next 1, 2, 5 × 10^k at or above ``x``."""
    if x <= 1:
        return 1
    scale = 10 ** math.floor(math.log10(x))
    return int(next(k * scale for k in (1, 2, 5, 10) if k * scale >= x - 1e-9))


def rule_tuning_cost(m: Measurements) -> Finding | None:
    """The tuner's measurement cost more than it is expected to save: a finding with its cost."""
    d = m.tune
    if d is None or not d.cost_sec or not m.train_sec:
        return None
    saving = d.expected_gain_sec or 0.0
    lost = d.cost_sec - saving
    if lost <= TUNING_COST_SHARE * m.train_sec:
        return None
    trials = "; ".join(t.words() for t in trial_figures(d))
    obs = (f"The tuner's measurement of splits on this run's own steps cost {d.cost_sec:.1f} s "
           f"({_pct(d.cost_sec / m.train_sec)} of the {m.train_sec:.1f} s of training) and is expected to save "
           f"{saving:.1f} s over the rest of the run "
           f"({'kept ' + _split_name(d.new) if d.new == d.old else 'switched to ' + _split_name(d.new)} at step "
           f"{d.step}): {trials}.")
    root = ("A trial costs its switches (a checkpoint, the end of a train() call and the start of the next), the "
            "warm-up steps after each and any slower steps of the candidate; it pays only when the split it keeps "
            "saves more over the steps left. In a short or noisy run the candidate cannot be told apart from the "
            "noise in the steps there are" + (f" (the tuner's reason: {d.reason})" if d.reason else "") + ".")
    how = ("`tune: false` in the recipe (`--tune false`)" if _launcher(m) else
           "`train_with_tuning(trainer, tune=False)` (or `AdaptiveBatchTuner(tune=False)`)")
    items = [f"{how} for runs this short; the split it measured: {_split_name(d.new)}",
             "or let the run be long enough to pay a trial back: the tuner weighs each round against the steps left"]
    gain = m.train_sec / (m.train_sec - lost) if m.train_sec > lost else None
    formula = (f"measured: the tuning's own cost {d.cost_sec:.1f} s less its expected saving {saving:.1f} s, "
               f"against {m.train_sec:.1f} s of training: {m.train_sec:.1f} / ({m.train_sec:.1f} − {lost:.1f})"
               + (f" = {gain:.2f}x" if gain else ""))
    return Finding("tuning_cost", "The batch tuning cost more than it saved", obs, root, _bullets(items), gain,
                   formula, "medium", {"tune": False} if _launcher(m) else {}, "measured" if gain else "try", gain)


def rule_tuner_hint(m: Measurements) -> Note | None:
    """The tuner attached to a plain ``trainer.train()``: it measured nothing, and said so (its event)."""
    if not m.tuner_hint or m.tune is not None:
        return None
    return Note("tuner_hint", "Batch split not measured: the tuner needs train_with_tuning",
                _sentence([TUNER_NEEDS_TRAIN_WITH_TUNING]) + (" Use `hf-perf train`'s recipe key `tune`."
                                                              if _launcher(m) else ""), judged=False)


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
    setting = {k: v for _, keys_set in changes for k, v in keys_set.items()}
    predicted = 1.0 / (1.0 - f)
    gain, basis, confidence, formula = _calibrated(
        "input_bound", m, predicted,
        f"workers hide the measured wait: 1/(1 − {f:.2f}) = {predicted:.2f}x")
    return Finding("input_bound", "Input-bound: the device waits for data", obs, root, _bullets(lines), gain,
                   formula, confidence, setting, basis, predicted)


def rule_generation_bound(m: Measurements) -> Finding | None:
    g = _phase(m, "generation")
    if not m.grpo or g < GENERATION_SHARE or _too_short(m):
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
    root = ("HF `generate` decodes one token per step for the whole batch and runs every layer for each token; a "
            "batch decodes until its longest completion. Generation does not depend on the training split, so it "
            "dominates a GRPO step.")
    target = _completion_target(m)
    clipped = m.clipped_ratio or 0.0
    lines, setting = [], {}
    if m.device_type == "cuda" and not m.use_vllm:
        setting = {"use_vllm": True, "vllm_mode": "colocate"}
        lines += ["`use_vllm: true` with `vllm_mode: colocate` (paged KV cache and CUDA graphs remove the per-token "
                  "launch overhead; `vllm_gpu_memory_utilization: 0.3` leaves room for training)",
                  "or, without vLLM, `cache_implementation: static` (fixed-shape KV cache, no re-allocation per "
                  "token)"]
    spg = m.steps_per_generation or m.grad_accum
    if spg and not _under_pressure(m):
        steps_per_rollout = 2 * spg / (m.grad_accum or spg)
        text = (f"`steps_per_generation: {2 * spg}` (now {spg}): one generate call for twice the sequences, the same "
                f"decode steps. The cost is on-policy-ness: the rollouts then serve {2 * spg} micro-batches"
                + (f" ({steps_per_rollout:g} optimizer steps)" if steps_per_rollout > 1 else "")
                + ", so the updates after the first learn from completions sampled by older weights (off-policy); "
                  "TRL then computes the sampling policy's log-probabilities (one more forward over the generation "
                  "batch) and clips the importance ratio at `epsilon`")
        if not setting:
            setting = {"steps_per_generation": 2 * spg}
        lines.append(text)
    if target:
        lines.append(f"`max_completion_length: {target[0]}` (the {target[2]} is {target[1]:.0f} tokens; decode "
                     f"steps = the longest completion of a batch)")
        setting = setting or {"max_completion_length": target[0]}
    if clipped >= CLIPPED_LARGE:
        lines.append(f"do not shorten `max_completion_length`: {_pct(clipped)} of completions are already cut at "
                     f"the limit")
    if not lines:
        return None
    formula = (f"not predicted: the run does not measure generation at another batch or backend (generation free "
               f"would be the ceiling, 1/(1 − {g:.2f}) = {1 / (1 - g):.1f}x)")
    return Finding("generation_bound", "Generation-bound GRPO step", obs, root, _bullets(lines), None, formula,
                   "low", setting, "try", None)


def _cut_off(m: Measurements, obs: str, limit: int, clipped: float) -> Finding:
    """Most completions end at ``max_completion_length``: a quality finding naming the limit and the masking."""
    root = (f"{_pct(clipped)} of completions reached `max_completion_length` {limit} before the model ended them. A "
            "cut completion is scored on an unfinished answer (a missing closing tag or final answer usually scores "
            "0) and, unless masked, trained on as if it were complete.")
    raise_it = (f"`max_completion_length: {2 * limit}` (now {limit}) if the answers need the room: each step then "
                f"decodes up to twice as many tokens (slower) and holds a longer KV cache")
    mask = ("`mask_truncated_completions: true`: cut completions are left out of the loss, so only finished answers "
            f"teach (with {_pct(clipped)} cut, few remain: raise the limit too)")
    headroom = (m.mem_high_water_gb is not None and m.mem_budget_gb
                and m.mem_high_water_gb < HIGH_WATER_FRACTION * m.mem_budget_gb)
    items = [raise_it, mask] if headroom else [mask, raise_it]
    items.append("or reward finishing within the budget (TRL's `get_soft_overlong_punishment`), or ask for shorter "
                 "answers in the prompt")
    setting = {"max_completion_length": 2 * limit} if headroom else {"mask_truncated_completions": True}
    return Finding("completion_budget", "Most completions are cut off at max_completion_length", obs, root,
                   _bullets(items), None, "no speed figure: a quality finding (a higher limit makes steps slower, "
                   "not faster)", "medium", setting, "try", None)


def rule_completion_budget(m: Measurements) -> Finding | Note | None:
    limit = m.max_completion_length
    if not m.grpo or not limit:
        return None
    clipped = m.clipped_ratio
    stats = ", ".join(f"{name} {value:.0f}" for name, value in (("mean", m.completion_mean),
                                                               ("p90 of per-log max", m.completion_p90),
                                                               ("max", m.completion_max)) if value is not None)
    obs = (f"Completion lengths: {stats or 'n/a'} tokens against `max_completion_length` {limit}"
           + (f"; clipped ratio {_pct(clipped)} (mean over the run's logs)" if clipped is not None else "") + ".")
    if clipped is not None and clipped >= CLIPPED_LARGE:
        return _cut_off(m, obs, limit, clipped)
    target = _completion_target(m)
    if not target:
        return None
    new, basis, name = target
    freed = _memory_freed_by_cut(m, limit, new)
    r = clipped or 0.0
    if r <= 0 or _phase(m, "generation") <= 0:
        return Note("completion_budget", "max_completion_length far above what completions use",
                    f"{obs} No completion reached the limit, so time is unchanged by a cap; "
                    f"`max_completion_length: {new}` (next power of two ≥ {COMPLETION_HEADROOM} × the {name}) would "
                    f"bound runaway rollouts"
                    + (f" and free ≈ {_gb(freed[0])} at the limit, if memory is ever short" if freed else "") + ".")
    root = (f"The limit is {limit / basis:.1f}x what the task uses. A completion that never emits end-of-sequence "
            f"decodes to the limit, holds the whole generation batch for {limit} decode steps and pads every "
            f"training sequence of its batch to {limit} tokens.")
    rec = (f"`max_completion_length: {new}` (next power of two ≥ {COMPLETION_HEADROOM} × {basis:.0f} = "
           f"{COMPLETION_HEADROOM * basis:.0f}, the {name}).")
    if m.completion_max is not None and m.completion_max > new:
        rec += f" The longest observed completion ({m.completion_max:.0f}) would be cut."
    if freed:
        rec += f" At the limit this frees ≈ {_gb(freed[0])}: {freed[1]}."
    return Finding("completion_budget", "Runaway completions reach max_completion_length", obs, root, rec, None,
                   f"not predicted: {_pct(r)} of completions reached the limit; how much decode time a cap saves "
                   f"depends on how often a batch holds one", "low", {"max_completion_length": new}, "try", None)


def _swapping(m: Measurements) -> bool:
    return (m.swap_growth_gb or 0.0) >= SWAP_GROWTH_GB or m.swapout_steps > 0


def _under_pressure(m: Measurements) -> bool:
    return _swapping(m) or (m.max_pressure or 0) >= 1 or (
        m.min_steps_to_wall is not None and m.min_steps_to_wall <= STEPS_TO_WALL)


def rule_memory_pressure(m: Measurements) -> Finding | None:
    swapping = _swapping(m)
    driver, allocated = m.driver_gb_max, m.allocated_gb_at_driver_max
    gap = (driver - allocated) if (driver is not None and allocated is not None) else 0.0
    near = (m.mem_high_water_gb is not None and m.mem_budget_gb
            and m.mem_high_water_gb >= HIGH_WATER_FRACTION * m.mem_budget_gb)
    bloat = (driver is not None and allocated is not None and gap >= DRIVER_BLOAT_MIN_GB
             and driver > DRIVER_BLOAT_RATIO * allocated
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
    if m.budget_range_gb is not None and m.budget_range_gb[1] > 1.01 * m.budget_range_gb[0]:
        facts.append(f"the budget followed what the run could reach, between {m.budget_range_gb[0]:.2f} and "
                     f"{m.budget_range_gb[1]:.2f} GiB")
    facts += [f"at step {step} the wall {'moved' if moved else 'was set'}: {why}"
              for step, why, moved in m.wall_moves[:4] if why]
    if m.leak_mib_per_step:
        facts.append(f"memory grew by {m.leak_mib_per_step:.0f} MiB on every step: a leak")
    if m.watchdog_actions:
        acts = ", ".join(f"{a.get('action')} at step {a.get('step')}" for a in m.watchdog_actions[:5])
        facts.append(f"the watchdog acted {len(m.watchdog_actions)} times ({acts})")
    facts += [f"micro-batch {d.old.micro_batch} ran out of memory at step {d.step} (the tuner went on at "
              f"{_split_name(d.new)})" for d in m.memory_limits if d.kind == "oom"]
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
    items: list[tuple[float, str, dict]] = []        # (bytes freed, recommendation, setting): the largest first
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
        items.append((saved, text, {"activation_checkpointing": True}))
    micro, accum = m.micro_batch, m.grad_accum
    splits = _splits(m)                          # empty unless both are known
    try:
        smaller = next_smaller(Split(micro, accum), splits) if splits and micro and accum else None
    except ValueError:                          # micro-batch 1, or no smaller split keeps the batch exact
        smaller = None
    if smaller and micro and accum:
        new_mb, new_ga = smaller.micro_batch, smaller.grad_accum
        text = (f"`per_device_train_batch_size: {new_mb}` with `gradient_accumulation_steps: {new_ga}` (effective "
                f"batch {micro} × {accum} = {new_mb} × {new_ga} = {micro * accum}, unchanged)")
        saved = 0.0
        if act_now and m.seq_len:
            saved = (act_now + _logits_per_token(m.model)) * m.seq_len * (micro - new_mb)
            text += (f": frees ≈ {_gb(saved)} = ({_train_formula(m.model, ckpt_on)}) × {m.seq_len} tokens × "
                     f"{micro - new_mb} fewer sequences")
        items.append((saved, text, _split_setting(m, smaller)))
    target = _completion_target(m)
    if target:
        text = (f"`max_completion_length: {target[0]}` (now {m.max_completion_length}; the {target[2]} is "
                f"{target[1]:.0f})")
        limit = m.max_completion_length                 # known: a target cuts it
        freed = _memory_freed_by_cut(m, limit, target[0]) if limit else None
        if freed:
            text += f": frees ≈ {_gb(freed[0])} at the limit — {freed[1]}"
        items.append((freed[0] if freed else 0.0, text, {"max_completion_length": target[0]}))
    elif m.grpo and (m.clipped_ratio or 0.0) < CLIPPED_LARGE:
        items.append((0.0, "a shorter `max_completion_length` if the task's answers are short (see "
                           "`completions/max_length` in the logs)", {}))
    items.sort(key=lambda item: -item[0])
    lines = [text for _, text, _ in items]
    setting = next((s for _, _, s in items if s), {})
    if any(why for _, why, _ in m.wall_moves):  # memory outside the run set or moved the wall
        lines.insert(0, "free the memory held outside this run (another process on the device, a pool outside "
                        "PyTorch's allocator), or give the run a device of its own"
                        + ("; with vLLM colocated, a lower `vllm_gpu_memory_utilization`" if m.use_vllm else ""))
    if m.leak_mib_per_step:                     # no setting fixes a leak: first
        lines.insert(0, "fix the leak first: memory that grows on every step comes from tensors kept across steps "
                        "(a loss appended without `.item()`, a growing cache); a smaller micro-batch does not stop "
                        "it")
    if m.device_type == "mps" and keys.CACHE_CLEARS not in m.logged:
        lines.append(("add `MPSCacheClearer` to the recipe's `callbacks`" if _launcher(m) else
                      "attach `MPSCacheClearer()` (`callbacks=default_callbacks()` has it)")
                     + ": it clears the Metal cache when driver memory runs ahead of live tensors")
    elif m.device_type == "cuda":
        lines.append("`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the environment (less fragmentation "
                     "of the reserved memory)")
    if swapping:
        formula = ("not predicted: this run never ran without swapping, so its own step time without it is not "
                   "measured; swapping steps wait for the SSD and can be several times slower")
        strong = m.swapout_steps >= 3 or (m.swap_growth_gb or 0.0) >= 1.0
        confidence = "medium" if strong else "low"
    else:
        formula = "no swapping observed: no speed-up; the gain is headroom (the GB freed above) and no lost run"
        confidence = "high" if (m.max_pressure or 0) >= 2 or m.watchdog_actions else "medium"
    urgent = swapping or (m.max_pressure or 0) >= 2 or (m.min_steps_to_wall is not None
                                                      and m.min_steps_to_wall <= STEPS_TO_WALL)
    return Finding("memory_pressure", "Memory pressure" + (": the run is swapping" if swapping else ""), obs, root,
                   _bullets(lines), None, formula, confidence, setting, "try", None, priority=0 if urgent else 1)


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
    if not measured:
        tried = "; ".join(t.words() for t in figures_ if t.status != "reference")
        base = next((t for t in figures_ if t.status == "reference"), None)
        return Note("small_micro_batch", "Batch split not measured",
                    f"The tuner {kept} at step {d.step} without measuring another split{reason}"
                    + (f"; {base.words()}" if base is not None else "")
                    + (f"; {tried}" if tried else "") + ".", judged=False)
    if rule_tuning_cost(m) is not None:
        return None
    cost = (f" Measuring cost {d.cost_sec:.1f} s" if d.cost_sec is not None else "") + (
        f"; expected saving {d.expected_gain_sec:.1f} s over the rest of the run" if d.expected_gain_sec is not None
        else "") + ("." if d.cost_sec is not None or d.expected_gain_sec is not None else "")
    _, limit = _memory_cap(m)
    return Note("small_micro_batch", "Batch split chosen by measurement",
                f"The tuner measured {len([t for t in figures_ if t.measured])} split(s) on this run's own training "
                f"steps ({'; '.join(t.words() for t in figures_)}) and {kept} at step {d.step}{reason}." + cost
                + (f" No larger micro-batch is advised: {limit}." if limit else ""))


def rule_small_micro_batch(m: Measurements) -> Finding | Note | None:
    mb, ga, c = m.micro_batch, m.grad_accum, _phase(m, "compute")
    if m.tune:
        return _tune_note(m, m.tune)
    if not (mb and ga and mb <= SMALL_MICRO_BATCH and ga >= 2) or _under_pressure(m) or _too_short(m):
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
    cap, why = _memory_cap(m)
    larger = sorted((s for s in _splits(m) if s.micro_batch > mb), key=lambda s: s.micro_batch)
    splits = [s for s in larger if cap is None or s.micro_batch <= cap]
    if not splits:
        if larger and why:
            return Note("small_micro_batch", "Micro-batch kept small by memory",
                        f"Micro-batch {mb} × accumulation {ga}: no larger micro-batch is advised, because {why}.")
        return None
    manual = next((s for s in splits if s.micro_batch >= 4 * mb), splits[-1])
    setting = _split_setting(m, manual)
    obs = (f"Micro-batch {mb} × accumulation {ga}" + (f" × {world} devices" if world > 1 else "")
           + f" (effective batch {effective})"
           + (f"; MFU {_pct(m.mfu)}" if m.mfu is not None else "") + f"; compute {_pct(c)} of the wall time"
           + (f"; {why}, so nothing above micro-batch {cap} is advised" if why else "") + ".")
    if m.device_type == "cpu":
        root = ("Each micro-batch pays fixed costs (Python and autograd set-up, adapter dispatch, the optimizer's "
                f"accumulation) {ga} times per optimizer step; on a CPU the matmuls of a larger micro-batch run at "
                "about the same FLOP rate, so only those fixed costs can shrink — whether they matter is measured, "
                "not known in advance.")
    else:
        root = ("With 1–2 sequences per micro-batch the matmuls are too thin to fill the device: each micro-batch "
                f"pays its kernel launches and a forward/backward at low arithmetic intensity, {ga} times per "
                "optimizer step.")
    listed = ", ".join(f"{s.micro_batch}×{s.grad_accum}" for s in splits[:6])
    rec = (f"Try {_yaml(setting)} (effective batch {effective} unchanged"
           + (", the generation batch and GRPO's groups too" if m.grpo else "") + f"), or measure instead of "
           f"guessing: {_tuner_how(m)}; the tuner times the exact splits ({listed}) on the run's own steps and keeps "
           f"the fastest that fits memory.")
    return Finding("small_micro_batch", "Small micro-batch", obs, root, rec, None,
                   "not predicted: a larger micro-batch helps only where per-micro-batch costs dominate (measured "
                   "on GPUs, not on every CPU); the tuner measures it", "low", setting, "try", None)


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
                   basis, predicted)


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
                   {}, "try", None)


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
                           {"pad_to_multiple_of": None}, "try", None)
        predicted = 1.0 / ((1.0 - c) + c * (1.0 - r))
        gain, basis, confidence, formula = _calibrated(
            "padding_waste", m, predicted,
            f"the rounding adds ≈ {parts} × ({k} − 1)/2 of the mean {length:.0f} padded positions = {_pct(r)}; "
            f"compute on them saved: 1/((1 − {c:.2f}) + {c:.2f} × (1 − {r:.3f})) = {predicted:.2f}x")
        return Finding("padding_waste", "Padding from pad_to_multiple_of", obs, root, rec, gain, formula,
                       confidence, {"pad_to_multiple_of": None}, basis, predicted)
    if m.grpo:
        per_batch = math.ceil((m.micro_batch or 1) / (m.num_generations or 1))
        text = (f"{obs} GRPO pads each micro-batch's completions to its longest one"
                + (" and left-pads its prompts to the longest prompt" if per_batch > 1 else
                   " (each micro-batch holds one prompt, so prompts add none)")
                + ": unequal completion lengths are inherent in sampling and no setting removes that padding"
                + ("; on MPS `pad_to_multiple_of` adds to it on purpose (fewer Metal graphs)" if k > 1 else "")
                + ".")
        return Note("padding_waste", "Padding", text)
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
                       "try", None)
    root = ("Batches are padded to the longest sequence of each batch (the padded length changed from step to step, "
            "so the padding is per batch): long and short sequences share batches, and the device computes on the "
            "pad positions, attention quadratically.")
    return Finding("padding_waste", "Padding waste", obs, root, _bullets([group] + rest), None,
                   "not predicted: how much padding grouping removes depends on the length distribution", "low",
                   {"train_sampling_strategy": "group_by_length"}, "try", None)


def rule_evidence(m: Measurements) -> Note | None:
    """What this run is too short to judge, and how many steps would do."""
    why = _too_short(m)
    if why is None:
        return None
    more = (f"run ≥ {(m.warmup_steps or 0) + MIN_STEADY_STEPS} steps" if m.warmup_done else
            f"run more steps: warmup ends once the step times settle at one level, and {MIN_STEADY_STEPS} steps after "
            f"it are needed")
    timed = "data wait, " + ("generation share, " if m.grpo else "") + "micro-batch, slow early steps"
    counted = "forwards per micro-batch, padding, " + ("rewards, completion lengths, " if m.grpo else "") + "memory"
    return Note("evidence", f"Too few steps to judge ({why})",
                f"Too few steps to judge the timings: {why}. Not judged: {timed}; no gain is estimated. Judged "
                f"anyway (counts, not timings): {counted}; thread oversubscription from {MIN_MACHINE_STEPS} steps "
                f"on. To judge the rest, {more}.", judged=False)


def rule_log_fields(m: Measurements) -> Note | None:
    """Logged fields of another type than this version reads (a newer or older writer), skipped."""
    if not m.skipped:
        return None
    return Note("log_fields", "Fields skipped", "Skipped (another writer's format): " + "; ".join(m.skipped) + ".",
                judged=False)


#: The one place to add a rule: each takes Measurements and returns a Finding, a Note or None.
RULES: list[Callable[[Measurements], Finding | Note | None]] = [
    rule_no_learning, rule_memory_pressure, rule_oversubscription, rule_contention, rule_evaluation,
    rule_input_bound, rule_duplicate_forward, rule_padding_waste, rule_generation_bound, rule_tuning_cost,
    rule_small_micro_batch, rule_tuner_hint, rule_completion_budget, rule_warmup, rule_evidence, rule_log_fields,
]
_ORDER = {rule.__name__.removeprefix("rule_"): i for i, rule in enumerate(RULES)}


def _rank(f: Finding) -> tuple:
    """Priority, then an expected gain before none, the larger first, then the order of RULES: a total order, so
    one run's findings always rank the same."""
    return (f.priority, f.expected_gain is None, -round(f.expected_gain or 0.0, 2), _ORDER.get(f.rule, len(_ORDER)))


def check(m: Measurements) -> tuple[list[Finding], list[Note]]:
    """Every rule's result: the findings, ranked (:func:`_rank`), and the notes (checked and fine, or not judged)."""
    results = [r for r in (rule(m) for rule in RULES) if r is not None]
    findings = sorted((r for r in results if isinstance(r, Finding)), key=_rank)
    return findings, [r for r in results if isinstance(r, Note)]


def analyze(m: Measurements) -> list[Finding]:
    """The ranked findings (see :func:`check`)."""
    return check(m)[0]
# ------------------------------------------------------------------ reading a run
def _values(rows: Sequence, key: str) -> list[float]:
    """The finite numbers under ``key`` in step lines or log dicts (other types skipped)."""
    if rows and all(isinstance(r, ReadStep) for r in rows[:1]):      # the reader's lines: their numbers directly
        return [v for v in (r.number(key) for r in rows) if v is not None]
    values = (r.get(key) for r in rows)
    return [float(v) for v in values if not isinstance(v, bool) and number(v) is not None]


def _mean(values: Iterable[float]) -> float | None:
    """The mean of the values (one pass, no list), None without any."""
    n, total = 0, 0.0
    for v in values:
        n, total = n + 1, total + v
    return total / n if n else None


def _spread(column: Iterable[float]) -> tuple[int, float, float, float]:
    """(count, first, least, largest) of a column's numbers (its NaN left out), in one pass without a list."""
    n, first, low, high = 0, math.nan, math.inf, -math.inf
    for v in column:
        if v == v:
            if not n:
                first = v
            n, low, high = n + 1, min(low, v), max(high, v)
    return n, first, low, high


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _rewards(logs: list[dict]) -> dict | None:
    """GRPO's reward statistics over the training logs: the range of the mean reward, the largest within-group
    spread (``reward_std``), the smallest share of groups without spread (``frac_reward_zero_std``), each reward
    function's range (``rewards/<name>/mean``); None when the logs hold no reward."""
    means = _values(logs, "reward")
    if not means:
        return None
    funcs: dict[str, list[float]] = {}
    for h in logs:
        for k, v in h.items():
            if k.startswith("rewards/") and k.endswith("/mean") and not isinstance(v, bool) and number(v) is not None:
                funcs.setdefault(k[len("rewards/"):-len("/mean")], []).append(float(v))
    stds, zero = _values(logs, "reward_std"), _values(logs, "frac_reward_zero_std")
    return {"logs": len(means), "min": min(means), "max": max(means), "std_max": max(stds, default=None),
            "zero_std_min": min(zero, default=None), "funcs": {n: (min(v), max(v)) for n, v in sorted(funcs.items())}}


def _constant_reward(r: dict | None) -> bool:
    """Every completion of the run scored the same: the mean reward never moved and no group had any spread."""
    return (r is not None and r["max"] - r["min"] <= ZERO and (r["std_max"] or 0.0) <= ZERO
            and (r["zero_std_min"] is None or r["zero_std_min"] >= 1.0 - 1e-9))


def _no_signal(logs: list[dict]) -> tuple[int, int, float | None]:
    """(GRPO logs with reward statistics, the longest run of consecutive logs where every group had zero reward
    variance and the gradient norm was 0, the mean reward over that run)."""
    rows = [(h, zero_std) for h in logs if (zero_std := number(h.get("frac_reward_zero_std"))) is not None]
    best, run = 0, 0
    best_rewards: list[float] = []
    rewards: list[float] = []
    for h, zero_std in rows:
        grad = number(h.get("grad_norm"))
        flat = zero_std >= 1.0 - 1e-9 and (grad is None or abs(grad) <= ZERO)
        if flat:
            run += 1
            reward = number(h.get("reward"))
            if reward is not None:
                rewards.append(reward)
            if run > best:
                best, best_rewards = run, list(rewards)
        else:
            run, rewards = 0, []
    return len(rows), best, (statistics.fmean(best_rewards) if best_rewards else None)


def _contention(run_log: RunLog, f: dict) -> dict | None:
    """Slow steps that other processes caused (CPU device: wall time above the steady level that no extra process
    CPU time explains): the meter's own figure (``contention_sec`` / the summary's ``early_contention_sec``, with
    the steps when it lists them), else, for a log without it, the same classification
    (:func:`~hf_perf_callbacks.stats.classify_slow_steps` at a 20% tolerance) over the step lines. A step counts only
    when its own wall/CPU ratio stands above the steady steps' by :data:`CONTENTION_RATIO` (the meter judges each
    ``train()`` call against its own early steps; a step at the run's steady ratio was not slowed by other
    processes): when some listed steps do not, the time lost is recounted over those that do (their wall seconds
    beyond their CPU time at the steady ratio). None on other devices (CPU time is not the work there), without
    ``perf/cpu_sec``, or when nothing was lost."""
    if run_log.header("perf").device_type != "cpu":
        return None
    col = run_log.column
    numbers, steady_flags, others_col = run_log.step_numbers(), col(keys.PERF_STEADY), col(keys.PERF_OTHER_CPU_CORES)
    wall_col, window_col, cpu_col = col(keys.PERF_STEP_WALL_SEC), col(keys.PERF_STEP_TIME), col(keys.PERF_CPU_SEC)
    rows = []                                                 # the lines with both a wall and a CPU time
    for i, (w, x, c) in enumerate(zip(wall_col, window_col, cpu_col)):
        w = w if w == w and w else x
        if w == w and c == c and w > 0 and c > 0:
            rows.append(i)
    if len(rows) < 4:
        return None

    def wall(i: int) -> float:
        w = wall_col[i]
        return w if w == w and w else window_col[i]

    walls, cpus = [wall(i) for i in rows], [cpu_col[i] for i in rows]
    run_sec = sum(walls)
    steady = [(w, c) for i, w, c in zip(rows, walls, cpus) if steady_flags[i] == 1] or list(zip(walls, cpus))
    wall0, cpu0 = statistics.median(w for w, _ in steady), statistics.median(c for _, c in steady)
    split = classify_slow_steps(walls, cpus, wall0, cpu0, tolerance=0.2)
    slow = [(i, w, c) for i, w, c, label in zip(rows, walls, cpus, split.labels) if label == "contention"]
    lost_sec, source = split.contention_sec, "step lines"
    meter = number(f.get("contention_sec"))
    if meter is None:
        meter = number(run_log.summary("perf").get("early_contention_sec"))
    if meter is not None:                                   # the meter's figure; its steps when it lists them
        listed = f.get("contention_steps")
        if isinstance(listed, list) and listed:
            wanted = {number(v) for v in listed}
            slow = [(i, w, c) for i, w, c in zip(rows, walls, cpus) if numbers[i] in wanted]
        lost_sec, source = meter, "meter"
    ratio = wall0 / cpu0
    corroborated = [(i, w, c) for i, w, c in slow if w / c > ratio * (1 + CONTENTION_RATIO)]
    if len(corroborated) < len(slow):                      # recount over the steps whose own ratio shows it
        lost_sec = sum(max(0.0, w - c * ratio) for _, w, c in corroborated)
        source = "step lines"
    slow = corroborated
    if not slow or lost_sec <= 0:
        return None
    others = [v for v in (others_col[i] for i, _, _ in slow) if v == v]
    return {"lost_sec": lost_sec, "source": source, "steps": len(slow), "step_list": [numbers[i] for i, _, _ in slow],
            "run_sec": run_sec, "lost_share": lost_sec / run_sec,
            "wall_over_cpu": statistics.median(w / c for _, w, c in slow), "steady_wall_over_cpu": ratio,
            "other_cores": max(others) if others else None}


def _evaluation(run_log: RunLog, train_sec: float) -> dict | None:
    """The run's evaluations as measured on its step lines (``perf/phase_sec/eval`` > 0): how many, every how many
    steps (the median gap), their seconds, the run's wall and training seconds and evaluation's share of the wall
    time; None without any."""
    numbers = run_log.step_numbers()
    at = [(numbers[i], v) for i, v in enumerate(run_log.column(keys.PERF_PHASE_SEC["eval"])) if v == v and v > 0]
    if not at:
        return None
    wall = sum(finite(run_log.column(keys.PERF_STEP_WALL_SEC)))
    gaps = [b - a for (a, _), (b, _) in zip(at, at[1:])]
    every = int(statistics.median(gaps)) if gaps else max(1, len(numbers))
    eval_sec = sum(v for _, v in at)
    return {"evals": len(at), "every": max(1, every), "eval_sec": eval_sec, "wall_sec": wall, "train_sec": train_sec,
            "steps": len(numbers), "share": eval_sec / wall if wall > 0 else 0.0}


def _first_steady(run_log: RunLog, f: dict) -> dict | None:
    """The latest ``train()`` call's first step when the meter counted it steady (no warmup beyond it): its training
    seconds and the steady step time with and without it (the figures' definition); None otherwise."""
    first = f.get("call_first_step")
    steady = set(f.get("steady_steps") or [])
    if first not in steady:
        return {"step": first, "included": False} if first else None
    count, total, own = 0, 0.0, None
    for n, t in zip(run_log.step_numbers(), train_column(run_log)):
        if t == t and n in steady:
            count, total = count + 1, total + t
            own = t if n == first else own
    if own is None or count < 2:
        return {"step": first, "included": False}
    return {"step": first, "included": True, "sec": own, "with": total / count,
            "without": (total - own) / (count - 1)}


def _trainer_kind(logs: list[dict]) -> str | None:
    """The TRL trainer whose own training logs these are, where they show it: SFT logs `mean_token_accuracy`
    (and `num_tokens`), DPO `rewards/chosen`."""
    keys_seen = {k for h in logs[:50] for k in h}
    if "mean_token_accuracy" in keys_seen:
        return "sft"
    if "rewards/chosen" in keys_seen:
        return "dpo"
    return None


def _malformed_values(run_log: RunLog) -> list[str]:
    """The step lines' values that are not numbers (every metric is one), counted per key, and the unreadable lines."""
    bad: dict[str, int] = {}
    for s in run_log.unique_steps():
        for k in s.non_numbers():
            bad[k] = bad.get(k, 0) + 1
    out = [f"`{k}` is not a number on {n} step line(s)" for k, n in sorted(bad.items())]
    if run_log.skipped_lines:
        out.append(f"{run_log.skipped_lines} unreadable line(s) in {keys.PERF_LOG}")
    return out


def _fact(header: RunHeader, name: str, kind: str, skipped: list[str]):
    """A run-header fact by name and type: a field of :class:`RunHeader`, or one a newer writer added (kept in
    ``extra`` by this version's reader); None when absent, and noted in ``skipped`` when of another type."""
    value = getattr(header, name, None)
    if value is None:
        value = header.extra.get(name, header.malformed.get(name))
    ok, typed = conform(value, kind)
    if not ok:
        skipped.append(f"run header `{name}` is {value!r}, not {'an' if kind == 'int' else 'a'} {kind}")
    return typed


def _machine(run_log: RunLog, header: RunHeader, skipped: list[str]) -> dict | None:
    """The CPU over the whole run, from the step lines (``perf/cpu_sec``, ``perf/step_wall_sec``,
    ``perf/other_cpu_cores``, ``perf/load_per_core``, ``perf/tokens``) and the run header (``cpu_cores``,
    ``torch_threads``, when the writer records them). Medians over the steps: ``busy`` — this process's CPU time /
    wall time (cores it kept busy), ``other`` — other processes' busy cores, ``load`` — load average per core;
    ``threads`` (torch's intra-op threads; without the header fact, torch's default of one per core), ``cores``
    (without the header fact, the busy cores of a machine whose load per core was ≥ 1: a saturated machine's busy
    cores are its cores). Over whole cycles of the header's ``period`` steps (GRPO: a generation cycle, whose tokens
    the meter counts at its first step), the steady ones (without :data:`MIN_MACHINE_CYCLES` of them, all but the
    first): ``spread`` and ``cpu_spread`` — the 90th over the 10th percentile of wall and CPU seconds per token
    (similar work should take similar time); ``lower_bound`` — the mean wall seconds per token over the 10th
    percentile's (what the run's own fastest cycles say contention cost, at least); None without
    :data:`MIN_MACHINE_CYCLES` cycles to compare. None without CPU time in the step lines."""
    col = run_log.column
    numbers, steady_flags = run_log.step_numbers(), col(keys.PERF_STEADY)
    load_col, token_col = col(keys.PERF_LOAD_PER_CORE), col(keys.PERF_TOKENS)
    walls, cpus, others = col(keys.PERF_STEP_WALL_SEC), col(keys.PERF_CPU_SEC), col(keys.PERF_OTHER_CPU_CORES)
    rows = [i for i, (wall, cpu, other) in enumerate(zip(walls, cpus, others))      # the lines with all three
            if wall == wall and cpu == cpu and other == other and wall > 0 and cpu > 0
            and math.isfinite(cpu / wall + other)]
    if not rows:
        return None
    busy = statistics.median(cpus[i] / walls[i] for i in rows)
    other = statistics.median(max(0.0, others[i]) for i in rows)
    loads = finite(load_col[i] for i in rows)
    load = statistics.median(loads) if loads else None
    cores, cores_from = _fact(header, "cpu_cores", "int", skipped), "run header"
    if cores is None and load is not None and load >= 1.0:
        cores = max(1, round(max(cpus[i] / walls[i] + max(0.0, others[i]) for i in rows)))
        cores_from = "the cores counted as the busy cores of the saturated machine"
    threads, threads_from = _fact(header, "torch_threads", "int", skipped), "run header"
    if threads is None and cores:
        threads, threads_from = cores, "the threads taken as torch's default, one per core"
    period = max(1, header.period or 1)
    # whole generation cycles (GRPO counts a cycle's tokens at its start): (lines, wall, CPU, tokens, all steady)
    cycles: list[tuple[int, float, float, float, bool]] = []
    current, acc = None, [0, 0.0, 0.0, 0.0, True]
    for i in rows + [-1]:
        cycle = (numbers[i] - 1) // period if i >= 0 else None
        if cycle != current:
            if current is not None and acc[0] == period:
                cycles.append((int(acc[0]), float(acc[1]), float(acc[2]), float(acc[3]), bool(acc[4])))
            current, acc = cycle, [0, 0.0, 0.0, 0.0, True]
        if i >= 0:
            t = token_col[i]
            acc = [acc[0] + 1, acc[1] + walls[i], acc[2] + cpus[i], acc[3] + (t if t == t else 0.0),
                   acc[4] and steady_flags[i] == 1]
    steady = [c for c in cycles if c[4]]
    later = steady if len(steady) >= MIN_MACHINE_CYCLES else cycles[1:]
    work = [(w, c, t) for _, w, c, t, _ in later if t > 0]
    spread = cpu_spread = lower_bound = None
    if len(work) >= MIN_MACHINE_CYCLES:
        per_wall, per_cpu = [w / t for w, _, t in work], [c / t for _, c, t in work]
        p10 = quantile(per_wall, 0.1)
        spread, cpu_spread = quantile(per_wall, 0.9) / p10, quantile(per_cpu, 0.9) / quantile(per_cpu, 0.1)
        lower_bound = sum(w for w, _, _ in work) / sum(t for _, _, t in work) / p10
    return {"steps": len(rows), "busy": busy, "other": other, "load": load, "cores": cores, "cores_from": cores_from,
            "threads": threads, "threads_from": threads_from, "spread": spread, "cpu_spread": cpu_spread,
            "lower_bound": lower_bound if lower_bound and lower_bound >= 1.0 + CONTENTION_SHARE else None}


def _steady_count(f: dict, steps: int, warmup_done: bool | None, warmup_steps: float | None) -> int:
    """Steps the meter counts as steady: the figures' list of them when they give one, else the steps after warmup
    (none while warmup is not finished)."""
    listed = f.get("steady_steps")
    if isinstance(listed, list):
        return len(listed) if warmup_done else 0
    return max(0, steps - int(warmup_steps)) if warmup_done and warmup_steps is not None else 0


def _resolve_split_file(run_log: RunLog) -> tuple[SplitFile | None, str | None]:
    """This run's record from the tuner (:func:`~hf_perf_callbacks.splitfile.read_split_file`, the one reader, for
    the perf log's session) and, when a file is there but is not read, a note saying it was skipped."""
    if not run_log.output_dir:
        return None, None
    found = read_split_file(run_log.output_dir, session=run_log.header().session)
    if found is None and os.path.exists(os.path.join(run_log.output_dir, keys.SPLIT_FILE)):
        return None, (f"`{keys.SPLIT_FILE}` is another run's record or does not follow this version's schema: its "
                      f"decisions are skipped")
    return found, None


def measurements(run_log: RunLog) -> Measurements:
    """Reduce a parsed run log to what the rules look at (plus ``tuner_split.json``: the tuner's decisions).

    The latest training session's summaries count (a resumed session that was killed has none, so the figures
    come from the step lines), and a step logged again after an out-of-memory rollback or a resume counts once
    (its latest line). The trainer's own logs (rewards, completion lengths, gradient norm) come from the step lines'
    ``log/<key>`` values, else from ``trainer_state.json``'s ``log_history``, else the latest checkpoint's. Every
    logged value is read through a typed accessor: a field of another type is skipped and listed in ``skipped``.
    """
    f = figures(run_log)                      # the headline figures, exactly as the report prints them
    skipped = [f"run header `{k}` is {v!r}" for h in run_log.headers for k, v in h.malformed.items()]
    skipped += [f"the {source} summary's `{k}` is {v!r}" for source, line in sorted(run_log.summaries.items())
                for k, v in line.malformed.items()]
    skipped += _malformed_values(run_log)
    run = run_log.header("perf")
    mem_summary = run_log.summary("mem")
    steps = run_log.unique_steps()
    events = run_log.events
    steady_flags = run_log.column(keys.PERF_STEADY)
    steady_at = [i for i, v in enumerate(steady_flags) if v == 1] or list(range(len(steps)))

    def values(key: str) -> list[float]:                 # the finite numbers under ``key``, every line
        return finite(run_log.column(key))

    def steady_values(key: str) -> Iterator[float]:      # the same over the steady lines, one at a time
        column = run_log.column(key)
        return (v for v in (column[i] for i in steady_at) if v == v)

    def figure(name: str, kind: str = "float"):
        ok, value = conform(f.get(name), kind)
        if not ok:
            skipped.append(f"the run's `{name}` is {f.get(name)!r}, not a number")
        return value

    fpm = _median(values(keys.PERF_FORWARDS_PER_MICROBATCH))
    if fpm is None:
        fpm = max(_values([e.details for e in events], "forwards_per_microbatch"), default=None)
    pads = _mean(steady_values(keys.PERF_PAD_FRACTION))

    micro = last_value(steps, keys.TUNER_MICRO_BATCH) or run.per_device_train_batch_size
    accum = last_value(steps, keys.TUNER_GRAD_ACCUM) or run.gradient_accumulation_steps
    seq = _spread(run_log.column(keys.PERF_SEQ_LEN))             # (count, first, min, max) without a list
    seq_steady = _mean(steady_values(keys.PERF_SEQ_LEN))

    driver = [(gb, i) for i, gb in enumerate(run_log.column(keys.MEM_DRIVER_GB)) if gb == gb]
    driver_max_row = steps[max(driver, key=lambda row: row[0])[1]] if driver else None
    swaps = _spread(run_log.column(keys.MEM_SWAP_USED_GB))
    pressures = _spread(run_log.column(keys.MEM_PRESSURE))
    limits = _spread(run_log.column(keys.MEM_LIMIT_GB))
    actions = mem_summary.get("actions")
    if isinstance(actions, list):
        actions = [a for a in actions if isinstance(a, dict)]
    else:
        if actions is not None:
            skipped.append(f"the watchdog summary's `actions` is {type(actions).__name__}, not a list")
        actions = [{"step": e.step, "action": e.details.get("action"), "message": e.message}
                   for e in events if e.source == "mem" and e.kind in ("action", "stop")]

    logs, log_source = trainer_logs(run_log)
    completion = completion_stats(logs)
    n_logs, no_signal_run, reward_mean = _no_signal(logs)
    spg = run.steps_per_generation           # a re-size keeps the generation batch: this split's share of it
    if spg and micro and run.per_device_train_batch_size:
        spg = max(1, int(spg) * int(run.per_device_train_batch_size) // int(micro))
    n_steps = int(figure("steps") or 0)
    warmup_steps = figure("warmup_steps")
    warmup_done = f.get("warmup_done") if isinstance(f.get("warmup_done"), bool) else None
    phases = f.get("phases")
    if not isinstance(phases, dict):
        skipped.append(f"the run's phase split is {type(phases).__name__}, not a mapping")
        phases = {}
    phases = {k: number(v) for k, v in phases.items() if number(v) is not None}
    tuner, tuner_note = _resolve_split_file(run_log)
    if tuner_note:
        skipped.append(tuner_note)
    grpo = bool(run.grpo)
    fixed = (int(seq[1]) if not grpo and seq[0] >= MIN_FIXED_LENGTH_STEPS and seq[2] == seq[3] else None)
    train_sec = sum(finite(train_column(run_log)))
    hint = next((e.message for e in events if e.source == "tuner" and e.details.get("needs") == "train_with_tuning"),
                None)

    return Measurements(
        device_type=run.device_type or "unknown", world_size=int(run.world_size or 1),
        grpo=grpo, micro_batch=int(micro) if micro else None,
        grad_accum=int(accum) if accum else None, max_completion_length=run.max_completion_length,
        num_generations=run.num_generations, activation_checkpointing=run.activation_checkpointing,
        model=run.model or {}, dataloader=run.dataloader or {},
        steps=n_steps, warmup_steps=int(warmup_steps) if warmup_steps is not None else None,
        warmup_overhead_sec=figure("warmup_overhead_sec"), first_step_slowdown=figure("first_step_slowdown"),
        steady_step_sec=figure("steady_step_sec"), steady_tokens_per_sec=figure("steady_tokens_per_sec"),
        mfu=figure("mfu"), phases=phases,
        pad_fraction=pads, forwards_per_microbatch=fpm,
        decode_bandwidth_util=_median(list(steady_values(keys.PERF_DECODE_BANDWIDTH_UTIL))),
        completion_mean=completion["mean"], completion_max=completion["max"], completion_p90=completion["p90"],
        clipped_ratio=completion["clipped"], mem_high_water_gb=figure("high_water_gb"),
        mem_budget_gb=figure("budget_gb"),
        driver_gb_max=driver_max_row.number(keys.MEM_DRIVER_GB) if driver_max_row else None,
        allocated_gb_at_driver_max=driver_max_row.number(keys.MEM_ALLOCATED_GB) if driver_max_row else None,
        max_pressure=int(pressures[3]) if pressures[0] else None,
        swap_growth_gb=max(0.0, swaps[3] - swaps[1]) if swaps[0] else None,
        swapout_steps=sum(1 for v in values(keys.MEM_SWAPOUTS) if v > 0),
        min_steps_to_wall=min(finite(run_log.column(keys.MEM_STEPS_TO_WALL)[MEM_GRACE_STEPS:]), default=None),
        watchdog_actions=actions, seq_len=int(seq[3]) if seq[0] else None,
        seq_len_min=int(seq[2]) if seq[0] else None, seq_len_mean=seq_steady,
        budget_range_gb=(limits[2], limits[3]) if limits[0] else None,
        wall_moves=[(e.step, str(e.details.get("why") or ""), e.details.get("moved") is not False) for e in events
                    if e.source == "mem" and e.kind == "wall"],
        leak_mib_per_step=max(_values([e.details for e in events if e.source == "mem"], "leak_mib_per_step"),
                              default=None),
        steps_per_generation=int(spg) if spg else None, pad_to_multiple_of=run.pad_to_multiple_of,
        temperature=run.temperature, use_vllm=run.use_vllm,
        tuner_attached=keys.TUNER_MICRO_BATCH in run_log.keys_logged(),
        tune=tuner.last("tune") if tuner else None,
        memory_limits=[d for d in tuner.decisions if d.kind in ("oom", "watchdog", "memory_check")] if tuner else [],
        logs=n_logs, no_signal_run=no_signal_run, reward_mean=reward_mean, rewards=_rewards(logs) if grpo else None,
        trainer_log_source=log_source, contention=_contention(run_log, f), machine=_machine(run_log, run, skipped),
        warmup_done=warmup_done,
        steady_steps=_steady_count(f, n_steps, warmup_done, warmup_steps),
        fixed_seq_len=fixed, launcher=_fact(run, "launcher", "str", skipped),
        logged=run_log.keys_logged(), skipped=skipped,
        tuner_hint=hint, trainer_kind=_trainer_kind(logs) if not grpo else None,
        evaluation=_evaluation(run_log, train_sec), first_steady=_first_steady(run_log, f),
        train_sec=train_sec or None)


def measurements_from_run(output_dir: str) -> Measurements:
    """:func:`measurements` of the run in ``output_dir`` (raises :class:`~hf_perf_callbacks.runlog.ReportError`, a
    ``ValueError``, when it holds no readable ``perf_log.jsonl``)."""
    return measurements(read_run(output_dir))


# ------------------------------------------------------------------ output
def _facts_line(m: Measurements) -> str:
    parts = [f"{m.device_type} × {m.world_size}", "GRPO" if m.grpo else "Trainer", f"{m.steps} steps"]
    if m.launcher:
        parts.insert(0, f"`{m.launcher}`")
    if m.micro_batch and m.grad_accum:
        parts.append(f"micro-batch {m.micro_batch} × accumulation {m.grad_accum}")
    if m.warmup_done is False:
        parts.append("warmup not finished (no steady figures)")
    if m.steady_tokens_per_sec:
        parts.append(f"steady {m.steady_tokens_per_sec:,.0f} tok/s")
    if m.steady_step_sec:
        parts.append(f"{m.steady_step_sec:.3g} s/step of training (evaluation and saving excluded)")
    e = m.evaluation
    if e and e["share"] >= 0.01 and m.steps:
        parts.append(f"{e['wall_sec'] / m.steps:.3g} s/step of wall time with evaluation")
    if m.mfu is not None:
        parts.append(f"MFU {_pct(m.mfu)}")
    split = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}" for k, v in
                      sorted(m.phases.items(), key=lambda kv: -kv[1]) if v >= 0.005)
    if split:
        parts.append(f"time: {split}")
    if m.mem_high_water_gb is not None and m.mem_budget_gb:
        parts.append(f"memory {m.mem_high_water_gb:.2f}/{m.mem_budget_gb:.2f} GB")
    return " · ".join(parts)


def gain_text(f: Finding) -> str:
    """``1.21x (calibrated, medium confidence)``, ``≥ 1.70x (measured, …)``, ``too few steps to judge the gain``
    or ``try (no predicted gain)``."""
    if f.expected_gain is None:
        if f.basis == "too few steps":
            return "too few steps to judge the gain"
        return "try (no predicted gain)" if f.priority else "fix first"
    return f"{'≥ ' if f.lower_bound else ''}{f.expected_gain:.2f}x ({f.basis}, {f.confidence} confidence)"


def _nothing_found(m: Measurements, notes: list[Note]) -> str:
    """The "no finding" paragraph: only what this run's log shows, and a metric it holds."""
    checked = []
    if not _too_short(m) and m.phases:
        checked.append("the device did not wait for data")
    if m.mem_high_water_gb is not None:
        checked.append("memory stayed within budget")
    if m.grpo:
        r = m.rewards
        checked.append("no reward data in this run's logs" if r is None else
                       "the rewards varied within prompt groups" if (r["std_max"] or 0.0) > ZERO else
                       "the rewards never varied within a prompt group")
    text = "No rule found something to change" + (": " + ", ".join(checked) if checked else "") + "."
    if any(not n.judged and n.rule == "evidence" for n in notes):
        text += " The timings were too short to judge (see Not judged)."
    metric = next((k for k in (keys.PERF_STEADY_TOKENS_PER_SEC, keys.PERF_TOKENS_PER_SEC) if k in m.logged), None)
    if metric:
        text += f" Track `{metric}` to compare future runs."
    return text


def render_markdown(findings: list[Finding], m: Measurements, notes: list[Note] | None = None) -> str:
    """The content of ``perf_report.md``: the findings, what the run was too short to judge, and what was checked
    and is fine."""
    notes = notes or []
    lines = ["# Performance report", "", f"**Run:** {_facts_line(m)}", ""]
    if not findings:
        lines += ["## No bottleneck found", "", _nothing_found(m, notes), ""]
    for i, f in enumerate(findings, 1):
        lines += [f"## {i}. {f.title} — {gain_text(f)}", "",
                  "### Observation", "", f.observation, "",
                  "### Root cause", "", f.root_cause, "",
                  "### Recommendation", "", f.recommendation, ""]
        if f.setting:
            lines += ["### Setting", "", "```yaml"]
            lines += [f"{k}: {'null' if v is None else json.dumps(v)}" for k, v in f.setting.items()]
            lines += ["```", ""]
        if f.env:
            lines += ["### Environment", "", "```bash"] + [f"{k}={v}" for k, v in f.env.items()] + ["```", ""]
        lines += ["### Expected gain", "",
                  (f"**{'≥ ' if f.lower_bound else ''}{f.expected_gain:.2f}x** — " if f.expected_gain is not None
                   else "**too few steps** — " if f.basis == "too few steps" else "**try** — ") + f.gain_formula,
                  "", "### Confidence", "", f.confidence, ""]
    unjudged = [n for n in notes if not n.judged]
    fine = [n for n in notes if n.judged]
    if unjudged:
        lines += ["## Not judged", ""] + [f"- **{n.title}.** {n.text}" for n in unjudged] + [""]
    if fine:
        lines += ["## Checked and fine", ""] + [f"- **{n.title}.** {n.text}" for n in fine] + [""]
    return "\n".join(lines)


def write_analysis(run: RunLog | str) -> tuple[str, list[Finding], list[Note]]:
    """Analyse a parsed run (or the run directory) and write ``<output_dir>/perf_report.md``; returns (path,
    findings, notes)."""
    run = read_run(run) if isinstance(run, (str, os.PathLike)) else run
    m = measurements(run)
    findings, notes = check(m)
    path = os.path.join(run.output_dir, REPORT_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_markdown(findings, m, notes))
    return path, findings, notes


def write_perf_report(run: RunLog | str) -> tuple[str, list[Finding]]:
    """:func:`write_analysis` without the notes: (path, findings)."""
    path, findings, _ = write_analysis(run)
    return path, findings


def console_summary(findings: list[Finding], top: int = 3, notes: list[Note] | None = None) -> str:
    """The top findings, a few lines each, what the run was too short to judge, and the titles of what was checked
    and is fine."""
    lines = ["== Performance analysis =="]
    if not findings:
        lines.append("no bottleneck found")
    for i, f in enumerate(findings[:top], 1):
        actions = [line.removeprefix("- ") for line in f.recommendation.splitlines() if line.strip()]
        first = (_yaml(f.setting) if f.setting else
                 ", ".join(f"`{k}={v}` (environment)" for k, v in f.env.items()) if f.env else
                 actions[0].split(" (")[0] if actions else "-")
        first = first if len(first) <= CONSOLE_WIDTH else first[:CONSOLE_WIDTH - 1] + "…"
        more = f" (+{len(actions) - 1} more)" if len(actions) > 1 else ""
        lines += [f"{i}. {f.title} — {gain_text(f)}",
                  f"   seen: {f.observation}",
                  f"   do:   {first}{more}"]
    if len(findings) > top:
        lines.append(f"... {len(findings) - top} more in {REPORT_FILE}")
    unjudged = [n.title.lower() for n in notes or [] if not n.judged]
    if unjudged:
        lines.append("not judged: " + "; ".join(unjudged))
    fine = [n.title.lower() for n in notes or [] if n.judged]
    if fine:
        lines.append("checked and fine: " + ", ".join(fine))
    return "\n".join(lines)


__all__ = ["Measurements", "Finding", "Note", "RULES", "analyze", "check", "measurements", "measurements_from_run",
           "render_markdown", "write_analysis", "write_perf_report", "console_summary", "gain_text",
           "dataloader_advice"]
