"""The analysis' typed model: :class:`Measurements` (the one input of every rule), :class:`Finding`, :class:`Note`,
and the evidence thresholds the reading and the rules share. The rules and what they advise: README "The analysis".
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from ..core.dataloader import DataLoaderFacts
from ..core.runlog import WatchdogAction
from ..core.splitfile import Decision
from ..estimate import ModelShape, model_from_config
from .figures import SlowStretch

MEM_GRACE_STEPS = 3          # first steps' trend (allocator ramp) ignored for steps-to-wall
ZERO = 1e-12
CONTENTION_SHARE = 0.05      # time lost to contention / run time worth a finding
CONTENTION_RATIO = 0.2       # a contended step's wall/CPU above the steady steps' by this share (else not contention)
# Evidence thresholds: below them a rule says "too few steps to judge" instead of a finding or a gain.
MIN_STEADY_STEPS = 3         # timing rules (shares of wall time, MFU, slow steps, any gain): warmup over + these steps
MIN_MACHINE_STEPS = 4        # whole-run contention: steps with CPU time and the machine's load ...
MIN_MACHINE_CYCLES = 3       # ... and this many whole steps (GRPO: generation cycles) after the first to compare
MIN_FIXED_LENGTH_STEPS = 3   # fixed-length padding: steps padded to one and the same length
RECOMPILE_SLOWDOWN = 0.5     # torch_compile: a steady step this much above the steady step time, CPU rising with it


@dataclass(frozen=True)
class Facts:
    """The figures a finding or a note rests on: the base of each case's frozen dataclass (:mod:`.facts`)."""


@dataclass(frozen=True)
class Rewards:
    """GRPO's reward statistics over the training logs: the range of the mean reward, the largest within-group
    spread (``reward_std``), the smallest share of groups without spread (``frac_reward_zero_std``), each reward
    function's (lowest, highest) mean."""

    logs: int
    min: float
    max: float
    std_max: float | None
    zero_std_min: float | None
    funcs: dict[str, tuple[float, float]]


@dataclass(frozen=True)
class Contention:
    """Steps slowed by other processes (CPU): the seconds lost, where that figure comes from ("meter", "step
    lines"), the steps, the run's wall seconds, the slow steps' and the steady steps' wall/CPU ratio, the other
    processes' busiest cores during them."""

    lost_sec: float
    source: str
    steps: int
    step_list: list[int]
    run_sec: float
    lost_share: float
    wall_over_cpu: float
    steady_wall_over_cpu: float
    other_cores: float | None = None


@dataclass(frozen=True)
class Machine:
    """The CPU over the whole run (medians over the steps): this process's busy cores (CPU time / wall time), other
    processes' busy cores, the load per core, the cores and torch's threads and where each count comes from ("run
    header", else what it is taken as), and over whole cycles the 90th over the 10th percentile of wall and CPU
    seconds per token (``spread``, ``cpu_spread``) and what the fastest cycles say contention cost, at least
    (``lower_bound``)."""

    steps: int
    busy: float
    other: float
    load: float | None
    cores: int | None
    cores_from: str
    threads: int | None
    threads_from: str
    spread: float | None = None
    cpu_spread: float | None = None
    lower_bound: float | None = None


@dataclass(frozen=True)
class Evaluation:
    """The run's evaluations as measured on its step lines: how many, every how many steps, their seconds, the run's
    wall and training seconds and steps, evaluation's share of the wall time."""

    evals: int
    every: int
    eval_sec: float
    wall_sec: float
    train_sec: float
    steps: int
    share: float


@dataclass(frozen=True)
class FirstSteady:
    """The latest ``train()`` call's first step; when the meter counted it steady, its training seconds and the
    steady step time with and without it."""

    step: int
    included: bool
    sec: float = 0.0
    with_it: float = 0.0
    without_it: float = 0.0


@dataclass(frozen=True)
class RecipeTarget:
    """What the recipe a run of ``hf-perf train`` ran was written for (the run header's ``target``): its name, the
    machine its first line names and that machine's device type, its model and completion length, its own values of
    the settings that size memory (``memory``: recipe key → value)."""

    recipe: str
    machine: str | None = None
    device_type: str | None = None
    model: str | None = None
    max_completion_length: int | None = None
    memory: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Recompile:
    """A steady step slowed by work of the process (its CPU time, child processes included, rose with it) in a run
    with ``torch_compile``: its step, its training seconds above the steady step time, the share of that excess its
    extra CPU time explains."""

    step: int
    excess_sec: float
    cpu_share: float


#: the basis of a finding's gain where the run is too short to judge it (its words: render.gain_text)
TOO_FEW_STEPS = "too few steps"
SettingValue = bool | int | float | str | None    # None: the key removed (its default)
Setting = dict[str, SettingValue]            # config keys → values: a finding's complete change
#: which case of its rule a finding or a note is (``Finding.reason``, ``Note.reason``): the rules' codes, by rule
Reason = Literal[
    "no_reward_data", "too_few_logs", "constant_reward", "no_group_variance",                     # no_learning
    "swapping", "near_the_wall", "pressure",                                                      # memory_pressure
    "threads_over_free_cores",                                                                    # oversubscription
    "other_processes", "contention_below_share", "unexplained_stretches",                         # contention
    "eval_share", "save_share", "logging_share", "one_callback",                   # evaluation, saving, callbacks
    "no_workers", "workers_behind",                                                               # input_bound
    "memory_to_spare", "would_not_fit",                                                           # recompute
    "grad_forwards",                                                                              # duplicate_forward
    "fixed_length", "pad_to_multiple", "grpo_inherent", "one_length_unsure", "per_batch",         # padding_waste
    "launch_bound", "generation_share", "sync_share",                              # generation_bound, weight_sync
    "waits_for_rollouts",                                                                         # rollout_wait
    "cost_over_saving",                                                                           # tuning_cost
    "small_split", "memory_cap", "tuner_measured", "tuner_measured_none",                         # small_micro_batch
    "needs_train_with_tuning",                                                                    # tuner_hint
    "cut_off", "runaways", "no_runaways",                                                         # completion_budget
    "not_finished", "first_step_steady", "excluded",                                              # warmup
    "too_few_steps", "skipped",                                                                   # evidence, log_fields
    "reward_share", "recompiles", "recompiles_small", "stand_in", "kept_for_recipe",   # reward, compile, scope
]


@dataclass(frozen=True)
class ModelFacts:
    """The run header's model: its shape (None: layers, hidden size or attention heads unknown; the memory formulas
    are then not written) and the bytes of one weight (2 unless the header says)."""

    shape: ModelShape | None = None
    bytes_per_param: int = 2

    @classmethod
    def of(cls, config: Mapping[str, Any] | None) -> ModelFacts:
        """The facts of a run header's ``model`` (a Hugging Face config's keys and ``bytes_per_param``)."""
        config = config or {}
        known = all(isinstance(config.get(k), int) and config.get(k)
                    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
        size = config.get("bytes_per_param")
        return cls(model_from_config(config) if known else None,
                   size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 2)


# ---- Measurements: each group of its fields declared once, as the reader that fills it returns it ---------------

@dataclass(kw_only=True)
class FigureReadings:
    """The headline figures the rules read, exactly as the report prints them (:func:`.figures.figures`)."""

    steps: int
    warmup_steps: int | None
    warmup_overhead_sec: float | None
    first_step_slowdown: float | None
    steady_step_sec: float | None
    steady_tokens_per_sec: float | None
    mfu: float | None
    phases: dict[str, float]                 # fractions of wall time
    mem_high_water_gb: float | None
    mem_budget_gb: float | None
    warmup_done: bool | None = None          # the meter decided warmup (None: no meter data)
    steady_steps: int = 0                    # steps after warmup (0 while warmup is not finished)
    warmup_in_band: bool | None = None       # the latest call's warmup steps within the meter's stable band
    warmup_tolerance: float | None = None    # the meter's stable band (warmup_tolerance)


@dataclass(kw_only=True)
class GeometryReadings:
    """The split the run ended with (the tuner's, else the configured one) and its steps per generation."""

    micro_batch: int | None
    grad_accum: int | None
    steps_per_generation: int | None = None  # as configured (TRL's default: gradient_accumulation_steps)


@dataclass(kw_only=True)
class StepCounts:
    """What the step lines count: forwards per micro-batch, padding, sequence lengths, decode bandwidth."""

    pad_fraction: float | None
    forwards_per_microbatch: float | None
    decode_bandwidth_util: float | None
    seq_len: int | None = None               # longest padded training sequence (tokens), for memory estimates
    seq_len_mean: float | None = None        # mean padded training length of the steady steps
    fixed_seq_len: int | None = None         # Trainer: every step padded to this one length (a fixed-length collator)
    seq_len_min: int | None = None           # shortest padded training sequence (differs from seq_len: per-batch)


@dataclass(kw_only=True)
class MemoryReadings:
    """The memory columns and the watchdog's events: driver memory at its peak, swap, pressure, the budget, the
    wall's moves, a leak."""

    driver_gb_max: float | None
    allocated_gb_at_driver_max: float | None
    max_pressure: int | None
    swap_growth_gb: float | None
    swapout_steps: int
    min_steps_to_wall: float | None
    watchdog_actions: list[WatchdogAction]
    budget_range_gb: tuple[float, float] | None = None   # lowest and highest mem/limit_gb: the budget per step
    wall_moves: list[tuple[int | None, str, bool]] = field(default_factory=list)   # the watchdog's wall events:
    #                                        (step, why, moved: False where the start set it below the device's limit)
    leak_mib_per_step: float | None = None   # the watchdog saw memory grow on every step (its leak warning)


@dataclass(kw_only=True)
class TrainerReadings:
    """The trainer's own logs: completion lengths, rewards, the runs of logs without a learning signal."""

    completion_mean: float | None
    completion_max: float | None
    completion_p90: float | None             # 90th percentile of the per-log longest completion
    clipped_ratio: float | None              # mean over the run's logs (the report's summary line says the same)
    completion_terminated_mean: float | None = None   # mean length of the completions that ended before the limit
    logs: int = 0                            # training logs with reward statistics (GRPO)
    no_signal_run: int = 0                   # longest run of logs with frac_reward_zero_std 1 and grad_norm 0
    reward_mean: float | None = None         # mean reward over those logs
    rewards: Rewards | None = None           # the run's reward statistics (see _rewards); None: no reward data
    trainer_kind: str | None = None          # "sft", "dpo" (their own training logs show it), None: Trainer / GRPO


@dataclass(kw_only=True)
class TunerReadings:
    """The tuner's record (its latest measurement, the decisions that hit the memory limit) and its events."""

    tuner_attached: bool = False             # tuner/* keys in the step lines
    tune: Decision | None = None             # the tuner's latest measurement of splits on this run's own steps
    memory_limits: list[Decision] = field(default_factory=list)   # the tuner's oom / watchdog / memory_check decisions
    tuner_hint: str | None = None            # the tuner said it needs train_with_tuning (a plain train())


@dataclass(kw_only=True)
class GenerationReadings:
    """GRPO, timed at TRL's generation entry (the meter's ``perf/weight_sync_sec``, ``perf/reward_sec``, … step
    keys): the backend, the weight syncs' share, the reward functions' calls, the rollout's decode rate."""

    generation_backend: str | None = None    # "transformers", "vllm-server", "vllm-colocate" (None: not recorded)
    vllm_enable_sleep_mode: bool | None = None
    weight_sync_steps: int | None = None     # async GRPO: optimizer steps between two weight transfers
    weight_sync_share: float | None = None   # Σ perf/weight_sync_sec / Σ step wall time (vLLM only)
    weight_sync_sec: float | None = None     # mean seconds of a step that synced weights
    weight_syncs: int = 0                    # steps that synced weights
    staleness_mean: float | None = None      # async GRPO: TRL's sample/staleness_mean over its logs (policy versions)
    rollout_tokens_per_sec: float | None = None   # median of the steady steps' perf/rollout_tokens_per_sec
    reward_calls: int = 0                    # GRPO: steps whose reward functions ran (perf/reward_sec > 0)
    reward_completions: float | None = None  # mean completions scored per such step (perf/generation_batch)


@dataclass(kw_only=True)
class PhaseReadings:
    """The run's seconds per phase (the step lines' and the tail's), its wall seconds, the saves and training logs,
    the seconds of each callback class, the trainer's settings of those phases."""

    phase_sec: dict[str, float] = field(default_factory=dict)   # seconds per phase: the step lines and the tail
    wall_sec: float | None = None            # Σ the step lines' wall seconds and the tail's: what phase_sec sums to
    saves: int = 0                           # checkpoint saves measured (step lines with save seconds, the tail's)
    training_logs: int = 0                   # training logs written (step lines with the trainer's loss)
    callback_sec: dict[str, dict[str, float]] = field(default_factory=dict)   # callback class → event → seconds
    trainer_settings: dict[str, Any] = field(default_factory=dict)   # the run header's trainer_settings
    recompute_clocked: bool = False          # the recompute phase was clocked (else it is inside compute)


@dataclass(kw_only=True)
class ScopeReadings:
    """What the run was measured on and against: the recipe's target, the model that ran, MFU's basis, a compile,
    the trainer's ``compute_metrics`` seconds."""

    target: RecipeTarget | None = None       # hf-perf train: what the recipe was written for (the run header's)
    model_name: str | None = None            # the model that ran (its name_or_path)
    model_params: int | None = None          # ... and its parameters
    mfu_basis: str | None = None             # what MFU is against (runlog.MFU_BASES)
    torch_compile: bool = False              # the trainer compiled the model (TrainingArguments.torch_compile)
    compute_metrics_sec: float | None = None   # seconds in the trainer's compute_metrics (inside evaluation)


@dataclass(kw_only=True)
class CompileReadings:
    """CPU device: the child processes' CPU seconds outside the steady steps, and a compiled run's recompiles."""

    warmup_child_cpu_sec: float | None = None   # CPU device: child processes' CPU seconds over the steps not steady
    recompiles: list[Recompile] = field(default_factory=list)   # torch_compile: steady steps slowed by own work


@dataclass(kw_only=True)
class Measurements(FigureReadings, GeometryReadings, StepCounts, MemoryReadings, TrainerReadings, TunerReadings,
                   GenerationReadings, PhaseReadings, ScopeReadings, CompileReadings):
    """Everything the rules look at (the pure input of every rule; None = not measured): the run header's facts
    below and the groups :mod:`.reading`'s readers return, each field declared once."""

    device_type: str
    world_size: int
    grpo: bool
    max_completion_length: int | None
    num_generations: int | None
    activation_checkpointing: bool | None
    model: ModelFacts
    dataloader: DataLoaderFacts
    pad_to_multiple_of: int | None = None
    temperature: float | None = None
    use_vllm: bool | None = None
    contention: Contention | None = None     # steps slowed by other processes: see rule_contention
    machine: Machine | None = None           # the CPU over the whole run: cores, threads, load (see _machine)
    launcher: str | None = None              # the command that started the run ("hf-perf train"); None: Python
    logged: frozenset[str] = frozenset()          # the metric keys the step lines hold
    skipped: list[str] = field(default_factory=list)   # logged fields of another type, skipped (what the report says)
    evaluation: Evaluation | None = None     # the run's evaluations, measured (see _evaluation)
    first_steady: FirstSteady | None = None  # the latest train() call's first step, steady or not
    train_sec: float | None = None           # Σ training seconds of the run's steps (what the tuning's cost is against)
    slow_stretches: list[SlowStretch] = field(default_factory=list)   # long slow stretches of steady steps
    split_levels: int = 1                    # the splits whose steady level the run measured (several: a tuned run)


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
    setting: Setting = field(default_factory=dict)
    basis: str = "try"                       # "measured" | "calibrated" | "try" | TOO_FEW_STEPS
    predicted_gain: float | None = None
    priority: int = 1                        # 0: cannot learn / swapping / near the wall, ranked first
    env: dict[str, str] = field(default_factory=dict)  # environment variables to set before the process starts
    lower_bound: bool = False                # expected_gain is a floor ("at least"), not a prediction
    steps: list[tuple[int, int]] = field(default_factory=list)   # the steps it is about, as (first, last) ranges
    lost_sec: float | None = None            # the seconds it says were lost on them
    reason: Reason | Literal[""] = ""        # which case of its rule it is (:data:`Reason`)
    facts: Facts = field(default_factory=Facts)   # the figures its words rest on (its case's dataclass)
    #: the seconds of the run it is about: what the change saves where the gain is measured or calibrated, else the
    #: seconds its cause took (the most the change can save); None: no time figure (memory, quality). Findings rank
    #: by it (:func:`~.rules.check`)
    stake_sec: float | None = None
    share: float | None = None               # stake_sec / the run's wall seconds
    scope: Scope | None = None               # what it was measured on (the run's model, device and lengths)


@dataclass(frozen=True)
class Scope(Facts):
    """What a run's findings were measured on: the model that ran (name, parameters), the device, the completion
    limit and the longest padded training sequence; and, for a run of ``hf-perf train``, the recipe's target and
    whether this run stood in for it (another model, device, or shorter completions: the ``stand_in`` note's
    facts)."""

    model: str | None
    params: int | None
    device_type: str
    max_completion_length: int | None
    seq_len: int | None
    target: RecipeTarget | None = None
    stand_in: tuple[str, ...] = ()            # what differs from the target: "model", "device", "completions"


@dataclass
class Note:
    """Checked and fine (``judged``): what a rule looked at and why there is nothing to gain; or not judged
    (``judged`` False): what the run's evidence is too short for, and how much more it needs."""

    rule: str
    title: str
    text: str
    judged: bool = True
    steps: list[tuple[int, int]] = field(default_factory=list)   # the steps it is about, as (first, last) ranges
    lost_sec: float | None = None            # the seconds it says were lost on them
    reason: Reason | Literal[""] = ""        # which case of its rule it is (:data:`Reason`)
    facts: Facts = field(default_factory=Facts)   # the figures its words rest on (its case's dataclass)


@dataclass(frozen=True)
class RuleCard:
    """A rule's row of the README's rule table (section "The analysis"), written next to the rule with its
    thresholds' constants: when it finds something and what it advises, the gain it prints, the note it gives
    instead."""

    finding: str = ""
    gain: str = ""
    note: str = ""


#: each rule's card by rule name (``no_learning``), filled as the rule modules are imported (:func:`card`)
CARDS: dict[str, RuleCard] = {}
RuleT = TypeVar("RuleT", bound=Callable[[Measurements], "Finding | Note | None"])


def card(finding: str = "", gain: str = "", note: str = "") -> Callable[[RuleT], RuleT]:
    """Attach a rule's :class:`RuleCard` (a decorator on ``rule_<name>``)."""
    def attach(rule: RuleT) -> RuleT:
        CARDS[rule.__name__.removeprefix("rule_")] = RuleCard(finding, gain, note)
        return rule
    return attach
