"""The figures each case of a rule rests on (its reason code, :data:`~.model.Reason`): one frozen dataclass per
case, built by the rule and read by the case's renderer in :mod:`.words`, so a renamed figure fails strict mypy at
both ends (``tests/test_words.py`` also checks every figure a renderer reads against its class). Data only: no words.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.dataloader import DataLoaderFacts
from ..core.splitfile import Decision
from .figures import SlowStretch
from .model import Contention, Evaluation, Facts, FirstSteady, Machine, RecipeTarget, Recompile

# ---- parts several cases share -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interval:
    """Saves, logs or evaluations spaced out: the interval now and advised, the other seconds a step, the runs at the
    advised interval over the run's steps (as transformers 5 runs them), the seconds saved, the gain, the share of
    the wall time they then take."""

    every: int
    new_every: int
    other_per_step_sec: float
    steps: int
    events_after: int
    saved_sec: float
    gain: float
    share_after: float


@dataclass(frozen=True)
class Evidence(Facts):
    """What a run's timings are too short for (the ``too_few_steps`` note's facts, and a calibration's): warmup
    decided (None: no meter data), the steps, those after warmup, the steps it would need, whether GRPO."""

    warmup_done: bool | None
    steps: int
    steady_steps: int
    needed_steps: int | None = None
    grpo: bool = False


@dataclass(frozen=True)
class Calibration:
    """How far a model's prediction is checked (:data:`~.rules.basis.CALIBRATION`): the device type, the checks and
    their worst error on it (0 checks: not on it), the device types it was checked on instead; ``too_short``: the run's
    evidence where it is too short to judge the gain."""

    device_type: str
    runs: int
    error: float
    elsewhere: tuple[str, ...] = ()
    too_short: Evidence | None = None


@dataclass(frozen=True)
class MemoryHit:
    """A micro-batch that hit the memory limit: it, what hit it (a tuner decision's kind "oom", "watchdog",
    "memory_check", "trial", or the watchdog's action), at which step, the decision's reason, the trial's split and
    error."""

    micro_batch: int
    kind: str
    step: int | None = None
    reason: str | None = None
    split: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class RaisedLimit:
    """A ``max_completion_length`` raised for cut completions: the new limit; ``ended`` (the share that ended before
    the limit), ``terminated_mean``, ``need`` (the length by which 95% end) — or ``guessed`` when none ended."""

    new: int
    limit: int
    guessed: bool
    ends_by: float = 0.95                     # the share of completions the raised limit lets end
    ended: float = 0.0
    terminated_mean: float = 0.0
    need: float = 0.0
    unseen_default: int = 0


@dataclass(frozen=True)
class CompletionTarget:
    """A lower ``max_completion_length``: the new limit, the observed length it rests on and which one it is
    (``p90``: the 90th percentile of the per-log longest completion; ``max``: the longest)."""

    new: int
    tokens: float
    basis: str


@dataclass(frozen=True)
class MemoryFreed:
    """The memory a completion cap frees at the cap, with its formulas (the KV cache; training activations)."""

    total_bytes: float
    kv_bytes: float
    kv_formula: str
    old: int
    new: int
    sequences: int
    train_bytes: float | None = None
    train_formula: str | None = None
    micro_batch: int | None = None


@dataclass(frozen=True)
class CompletionLengths:
    """The completion limit and the lengths the logs show (None: not logged)."""

    limit: int
    clipped_ratio: float | None
    mean: float | None
    p90: float | None
    max: float | None


@dataclass(frozen=True)
class CallbackTimes:
    """The user's callbacks' and the trainer's logging seconds, each callback class with its events' seconds (the
    costliest first), against the wall time."""

    user_sec: float
    log_sec: float
    wall_sec: float
    classes: tuple[tuple[str, float, tuple[tuple[str, float], ...]], ...]


# ---- phases --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SaveShare(Facts):
    saves: int
    save_sec: float
    wall_sec: float
    interval: Interval
    save_only_model: bool
    save_total_limit: bool


@dataclass(frozen=True)
class LoggingShare(Facts):
    callbacks: CallbackTimes
    logs: int
    on_log_sec: float
    interval: Interval


@dataclass(frozen=True)
class OneCallback(Facts):
    callbacks: CallbackTimes
    callback: str
    event: str
    callback_sec: float


@dataclass(frozen=True)
class Recompute(Facts):
    recompute_sec: float
    wall_sec: float
    extra_bytes: float
    after_gb: float
    budget_gb: float
    high_water_gb: float
    micro_batch: int
    seq_len: int
    gain: float | None = None


# ---- the run -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Warmup(Facts):
    """The warmup note: the run's steps, the findings of this report that name other processes, the meter's
    contention; once decided, its figures, a compile and the child processes' CPU seconds outside the steady steps,
    the first step among the steady ones, a short run's share."""

    steps: int
    contention_findings: tuple[str, ...]
    contention: Contention | None
    warmup_steps: int | None = None
    slowdown: float | None = None
    overhead_sec: float | None = None
    device_type: str = ""
    latest_first_step: int | None = None
    levels: int = 1
    in_band: bool | None = None
    tolerance: float | None = None
    compile: bool = False
    child_cpu_sec: float | None = None
    first: FirstSteady | None = None
    share: float | None = None
    steps_for_target: int | None = None
    target_share: float = 0.05


@dataclass(frozen=True)
class EvalShare(Facts):
    evaluation: Evaluation
    interval: Interval
    metrics_sec: float | None
    compute_metrics: bool
    preprocess_logits: bool
    loss_only: bool


@dataclass(frozen=True)
class TuningCost(Facts):
    decision: Decision
    cost_sec: float
    saving_sec: float
    lost_sec: float
    train_sec: float
    launcher: bool
    gain: float | None


@dataclass(frozen=True)
class TunerHint(Facts):
    launcher: bool


@dataclass(frozen=True)
class Skipped(Facts):
    skipped: tuple[str, ...]


@dataclass(frozen=True)
class KeptForRecipe(Facts):
    finding: str
    rule: str
    target: RecipeTarget
    model: str | None
    device_type: str
    undone: tuple[tuple[str, object, object], ...]    # (key, the recipe's value, the value advised)


# ---- the machine ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Oversubscription(Facts):
    machine: Machine
    demand: float
    advised_threads: int
    launcher: bool


@dataclass(frozen=True)
class OtherProcesses(Facts):
    contention: Contention | None
    contended: tuple[SlowStretch, ...]
    unexplained: tuple[SlowStretch, ...]
    lost_sec: float
    share: float
    run_sec: float
    gain: float


@dataclass(frozen=True)
class SlowStretches(Facts):
    contended: tuple[SlowStretch, ...]
    unexplained: tuple[SlowStretch, ...]
    lost_sec: float
    share: float


@dataclass(frozen=True)
class Recompiles(Facts):
    recompiles: tuple[Recompile, ...]
    lost_sec: float
    share: float


# ---- the step ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputBound(Facts):
    data_wait: float
    device_type: str
    predicted: float
    dataloader: DataLoaderFacts
    calibration: Calibration


@dataclass(frozen=True)
class DuplicateForward(Facts):
    forwards_per_microbatch: float
    compute: float
    predicted: float
    calibration: Calibration


@dataclass(frozen=True)
class FixedLength(Facts):
    length: int
    pad_fraction: float
    compute: float
    trainer_kind: str | None
    steps: int


@dataclass(frozen=True)
class Padding(Facts):
    """Padding of per-batch lengths: its share and ``pad_to_multiple_of``; with the rounding's model (its share, the
    padded blocks a sequence has, the mean length, compute's share, the prediction and its calibration), or a GRPO
    run's prompts per micro-batch."""

    pad_fraction: float
    pad_to_multiple_of: int
    seq_len: int | None
    grpo: bool
    rounding_share: float | None = None
    pad_parts: int = 1
    mean_length: float | None = None
    compute: float = 0.0
    predicted: float | None = None
    calibration: Calibration | None = None
    prompts_per_micro_batch: int = 0


@dataclass(frozen=True)
class TunerMeasured(Facts):
    decision: Decision
    measured: int
    hit: MemoryHit | None


@dataclass(frozen=True)
class MemoryCap(Facts):
    micro_batch: int
    grad_accum: int
    hit: MemoryHit


@dataclass(frozen=True)
class SmallSplit(Facts):
    micro_batch: int
    grad_accum: int
    world_size: int
    mfu: float | None
    compute: float
    splits: tuple[str, ...]
    hit: MemoryHit | None
    device_type: str
    grpo: bool
    launcher: bool
    tuner_attached: bool


# ---- GRPO ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NoRewardData(Facts):
    pass


@dataclass(frozen=True)
class TooFewLogs(Facts):
    logs: int
    reward: float
    logs_needed: int


@dataclass(frozen=True)
class NoLearning(Facts):
    """A run that cannot learn: its logs with reward data, the longest run of flat logs and their mean reward, the
    range of the mean reward over all logs, the clipped share; every completion the same (each reward function's
    value, a raised limit where most were cut) or every group flat (the temperature)."""

    logs: int
    no_signal_run: int
    reward_mean: float | None
    reward_min: float
    reward_max: float
    clipped: float
    reward_funcs: tuple[tuple[str, float], ...] = ()
    raised: RaisedLimit | None = None
    reward_varied: bool = False
    temperature: float | None = None


@dataclass(frozen=True)
class GenerationBound(Facts):
    generation: float
    decode_bandwidth_util: float | None
    backend: str
    steps_per_generation: int | None
    optimizer_steps_per_rollout: float | None
    target: CompletionTarget | None
    clipped: float
    launch_bound: bool
    suggest_vllm: bool
    steady_step_sec: float | None
    weight_sync_share: float | None
    rollout_tokens_per_sec: float | None
    clipped_large: bool


@dataclass(frozen=True)
class WeightSync(Facts):
    share: float
    syncs: int
    sync_sec: float | None
    backend: str
    generation: float
    steps_per_generation: int | None
    sleep_mode: bool
    weight_sync_steps: int | None


@dataclass(frozen=True)
class RolloutWait(Facts):
    share: float
    staleness: float | None


@dataclass(frozen=True)
class RewardShare(Facts):
    reward_sec: float
    wall_sec: float
    calls: int
    completions_per_call: float | None
    funcs: tuple[str, ...]
    steps_per_generation: int | None


@dataclass(frozen=True)
class CutOff(Facts):
    seen: CompletionLengths
    clipped: float
    raised: RaisedLimit
    headroom: bool


@dataclass(frozen=True)
class Runaways(Facts):
    seen: CompletionLengths
    target: CompletionTarget
    clipped: float
    freed: MemoryFreed | None
    headroom_factor: float


# ---- memory --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Remedy:
    """One remedy for memory pressure, the memory it frees first (``code``: ``leak_first``, ``free_outside``,
    ``checkpointing``, ``smaller_split``, ``shorter_completions``, ``shorter_completions_hint``) with its figures."""

    code: str
    saved_bytes: float = 0.0
    use_vllm: bool = False
    formula: str | None = None                 # the activations per token now (checkpointing), per token (a split)
    formula_after: str | None = None           # ... and checkpointed
    tokens: str | None = None                  # the training tokens of a micro-batch, written out
    split: tuple[int, int, int, int] | None = None   # (micro-batch, accumulation) now and advised
    seq_len: int | None = None
    target: CompletionTarget | None = None
    limit: int | None = None
    freed: MemoryFreed | None = None


@dataclass(frozen=True)
class MemoryPressure(Facts):
    swapping: bool
    swap_growth_gb: float | None
    swapout_steps: int
    max_pressure: int | None
    high_water_gb: float | None
    budget_gb: float | None
    steps_to_wall: float | None
    wall_near: bool
    allocator_bloat: bool
    driver_gb: float | None
    allocated_gb: float | None
    leak_mib_per_step: float | None
    budget_range_gb: tuple[float, float] | None
    remedies: tuple[Remedy, ...]
    allocator_advice: str | None
    device_type: str
    grpo: bool
    launcher: bool
    wall_moves: tuple[tuple[int | None, str, bool], ...]
    actions: tuple[tuple[object, object], ...]
    ooms: tuple[tuple[int, int | None, str], ...]


# ---- the report's own paragraph ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NothingFound(Facts):
    """What the "no finding" paragraph says: the device did not wait for data (judged), memory stayed within budget
    (measured), GRPO's rewards ("none", "varied", "flat"; None: not GRPO), the timings too short to judge, the
    throughput key to track (None: none logged)."""

    data_wait: bool
    memory: bool
    rewards: str | None
    timings_unjudged: bool
    metric: str | None
