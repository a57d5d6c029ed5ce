"""ThroughputMeter: warmup-aware training speed, MFU, the phase split and GRPO rollout throughput."""
from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import psutil
import torch

from . import keys
from .common.base import Clock, Made, PerfCallback, arguments, hook
from .common.exchange import Rows
from .core.batching import is_grpo
from .core.dataloader import FACT_TYPES, DataLoaderFacts, dataloader_changes, dataloader_facts
from .core.flops import forward_flops_per_token, full_numel, shape_of, text_config, train_flops_per_token
from .core.runlog import MeterSummary, WarningFigures
from .core.stats import generation_period
from .core.timeline import StepRecord, StepTimeline
from .core.validation import check_flag, check_number, did_you_mean
from .core.wording import argument_hint, mfu_words, phase_line, provisional_line, throughput_line, warmup_line, wrapped
from .keys import PHASES
from .platform import adapter
from .platform.device import DeviceLayer, dtype_key, world_size

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

#: model → the meter whose hook and wrapper are installed on it (a replaced instance is closed by its successor)
_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, ThroughputMeter] = weakref.WeakKeyDictionary()
#: indices of ``ThroughputMeter.counts``
HOOK_TOKENS, GENERATED, REAL_POSITIONS = range(3)


def forward_entry(inner: torch.nn.Module) -> torch.nn.Module:
    """The module every forward of the causal LM ``inner`` enters through ``__call__`` (so hooks run): its decoder
    stack (``get_decoder()``) where it has one, else ``inner``. peft before 0.21 runs the causal LM as
    ``model.forward(...)``, which skips hooks on the causal LM itself; the causal LM calls its decoder as a module."""
    try:
        get_decoder = getattr(inner, "get_decoder", None)      # transformers' models have it, a bare Module not
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # noqa: BLE001 - a model without a separable decoder
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else inner


class MachineLoad:
    """Per-step contention data: the process's CPU time beside the wall time, and what the rest of the machine did.

    ``psutil.cpu_times()`` is read once per step (our own previous reading, so other users of psutil's
    ``cpu_percent`` do not disturb it); ``os.getloadavg()`` where the platform has it. Where ``count_children`` (a
    CPU device: there the CPU time is the work), the CPU clock counts the process's child processes too
    (:meth:`cpu`): inductor's compile workers and DataLoader workers work for the run on other cores.
    """

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.previous: float | None = None
        self.count_children = False
        self.children_seen: float | None = None      # the children's CPU seconds at the previous reading
        self.children_step = 0.0                     # ... and since the one before it

    @staticmethod
    def children_cpu() -> float:
        """CPU seconds of this process's child processes: those it has reaped (``os.times``) and the live ones,
        each with the children it has reaped in turn (psutil); a process gone between the reads is skipped."""
        times = os.times()
        total = times.children_user + times.children_system
        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
            except psutil.Error:  # gone, a zombie, not ours to read
                continue
            total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        return total

    def cpu(self, own: float) -> float:
        """The process's CPU clock reading ``own``, plus its children's where they are counted."""
        if not self.count_children:
            return own
        try:
            children = self.children_cpu()
        except Exception:  # noqa: BLE001 - a platform without the reading: the process's own CPU time
            return own
        self.children_step = max(0.0, children - self.children_seen) if self.children_seen is not None else 0.0
        self.children_seen = children
        return own + children

    @staticmethod
    def busy() -> float:
        """The machine's busy CPU seconds so far (``psutil.cpu_times``: all but idle, I/O wait and guests)."""
        t = psutil.cpu_times()
        busy: float = (sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
                       - getattr(t, "guest_nice", 0.0))
        return busy

    def reset(self, count_children: bool) -> None:
        """A ``train()`` call begins: the machine's reading now, the children counted or not, none seen yet."""
        self.count_children, self.children_seen = count_children, None
        try:
            self.previous = self.busy()
        except Exception:  # noqa: BLE001 - a platform without the reading: no machine figures
            self.previous = None

    def step_fields(self, record: StepRecord) -> dict[str, float]:
        fields: dict[str, float] = {}
        if record.cpu is not None and record.wall > 0:
            fields[keys.PERF_CPU_SEC] = record.cpu
            fields[keys.PERF_CPU_TIME_RATIO] = record.cpu / record.wall
            if self.count_children:
                fields[keys.PERF_CHILD_CPU_SEC] = self.children_step
        if self.previous is not None:
            try:
                busy = self.busy()
            except Exception:  # noqa: BLE001
                busy = None
            if busy is not None and record.wall > 0:
                machine = max(0.0, busy - self.previous) / record.wall
                fields[keys.PERF_OTHER_CPU_CORES] = max(0.0, machine - fields.get(keys.PERF_CPU_TIME_RATIO, 0.0))
            self.previous = busy
        if hasattr(os, "getloadavg"):
            fields[keys.PERF_LOAD_PER_CORE] = os.getloadavg()[0] / self.cores
        return fields


@dataclass
class MeterRun:
    """What the meter decides at one ``train()`` call's begin (the device, the run kind, the model's facts), and the
    device counters it reads once per step."""

    device: DeviceLayer
    world: int
    is_grpo: bool
    token_source: str                    # "trainer" (state.num_input_tokens_seen) or "hook" (the forward pre-hook)
    num_iterations: int
    period: int                          # optimizer steps per GRPO generation cycle (1 otherwise)
    counts: torch.Tensor                 # [HOOK_TOKENS, GENERATED, REAL_POSITIONS] of the step, on the device
    seen: int                            # state.num_input_tokens_seen at the previous step's end
    seq_len: int = 0                     # padded length of the latest training forward
    inner: Any = None                    # the trainer's model's innermost causal LM (_install)
    shape: Any = None                    # flops.ModelShape of the model (_setup_flops)
    dtype_key: str = ""
    recompute: bool = False              # activation checkpointing is on
    weight_bytes: int = 0
    main: bool = True                    # the main process (server mode: the one that calls the server)
    trainer: Any = None                  # the trainer whose train() runs (async GRPO's figures are read from it)


@dataclass(frozen=True)
class EndedStep:
    """An optimizer step measured at its end, waiting for every rank's figures (the step's one exchange): its record,
    the device counters read once, this rank's tokens, completion tokens and engine seconds (the engine calls it made
    or waited for), the user's callbacks' seconds, and the trainer's arguments and control of that event."""

    record: StepRecord
    counts: list[int]                    # [HOOK_TOKENS, GENERATED, REAL_POSITIONS]
    tokens: float
    generated: float
    engine: float
    callbacks: dict[str, float]
    args: Any                            # the data-wait advice reads its DataLoader settings
    control: Any                         # a logging step publishes the phase shares


@dataclass
class MeterStep:
    """The counters of one optimizer step in progress (made afresh after each step)."""

    entry_start: dict[str, float] = field(default_factory=dict)   # TRL's entry kind → when it began
    sync_seconds: float = 0.0
    engine_seconds: float = 0.0          # in the engine calls this rank made (HTTP to the server, LLM/model.generate)
    reward_seconds: float = 0.0
    completions: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    forwards: int = 0
    microbatches: int = 0
    padded_positions: int = 0


class ThroughputMeter(PerfCallback):
    """Measures true training speed between optimizer-step boundaries, with one device synchronize per step.

    Warmup is found statistically (:class:`~hf_perf_callbacks.core.stats.WarmupDetector`): it ends when
    ``warmup_window`` consecutive step times (GRPO: generation cycles) lie within ``warmup_tolerance`` of their
    median, at the latest after ``max_warmup_steps``. Steady throughput counts only steps after warmup and
    excludes eval and checkpoint time; the figures' definitions are in :mod:`hf_perf_callbacks.core.timeline` (steady
    tokens/s × steady step time = the mean tokens of a steady step). Each fresh ``train()`` (``global_step`` 0)
    starts its counters over; a resumed one keeps accumulating.

    **Tokens.** GRPO counts prompt + completion tokens of every generation, gathered over ranks, in
    ``state.num_input_tokens_seen``; a plain ``Trainer`` does so only with ``include_num_input_tokens_seen``.
    Otherwise the meter counts non-padding tokens itself, from a forward pre-hook that reads the
    ``attention_mask`` of grad-enabled forwards (no extra synchronize, no collective per micro-batch, training
    unchanged); ranks exchange their counts once per optimizer step.

    **GRPO's generation** is timed at TRL's own entry (``GRPOTrainer._generate``, through
    :func:`~hf_perf_callbacks.platform.adapter.watch_generation_entry`), so HF ``generate``, vLLM server and vLLM
    colocate give the same figures; ``model.generate`` nested inside is not counted again (a trainer without
    ``_generate`` is timed at ``model.generate`` alone). Weight syncs to vLLM and the reward functions are timed on
    their own. On several ranks a collective of the rollout that waits for another rank is ``rollout_wait``, and the
    rollout rate is over the engine calls' time. TRL's ``AsyncGRPOTrainer`` (backend ``vllm-async``) is read from TRL's
    own figures: its queue wait (``rollout_wait``), trained tokens and weight transfers.

    **MFU** uses :mod:`hf_perf_callbacks.core.flops` (LoRA-aware, attention included) against the device's peak for
    the training dtype (table, ``peak_flops`` override or ``peak_flops="calibrate"``); unknown device → MFU is
    omitted with one warning. GRPO's model FLOPs per token are ``num_iterations`` × training plus one forward
    for generation. Under FSDP and DeepSpeed ZeRO-3 the FLOPs are the unsharded model's
    (:func:`~hf_perf_callbacks.core.flops.full_numel`), divided over the ranks like any data-parallel throughput.

    Args:
        window_steps: optimizer steps in the windowed rate (rounded up to whole GRPO generation cycles).
        warmup_window: consecutive stable steps that end warmup (≥ 2).
        warmup_tolerance: relative deviation from the window median still called stable, in (0, 1].
        max_warmup_steps: warmup is declared over after this many steps at the latest.
        peak_flops: device peak FLOP/s for MFU, ``"calibrate"`` to measure it with a matmul, or None (table).
        peak_bandwidth: device memory bandwidth in bytes/s for decode utilisation, or None (table).
        data_wait_threshold: warn once when data wait exceeds this fraction of step time after warmup.
        progress_bar: show current tok/s beside the progress bar.
        clock: wall and CPU seconds (:class:`~hf_perf_callbacks.common.base.Clock`; tests plant one).

    **Warmup or contention.** On a CPU device warmup is detected on the process's CPU time per step, and slow early
    steps whose CPU time was flat are reported as contention (:mod:`hf_perf_callbacks.core.timeline`); on a GPU on
    wall time. The step lines carry the machine's load either way.

    **Short runs.** A run that ends before warmup is decided gets a provisional rate and MFU from the steps it has
    (:class:`~hf_perf_callbacks.core.runlog.MeterSummary`); the steady keys stay absent.

    The console's log line shows :data:`~hf_perf_callbacks.keys.CONSOLE_KEYS` of these keys; the reporters,
    ``log_history`` and the perf log get every one.

    Logged keys (at each logging step; every step in ``perf_log.jsonl``, which also holds
    ``perf/phase_sec/<phase>``, ``perf/step_wall_sec``, ``perf/tokens``, ``perf/seq_len`` and the keys of the
    table below). Memory keys are in GiB (2³⁰ bytes) throughout the package.

    ====================================  ========  ==============================================================
    step-line key (``perf_log.jsonl``)    unit      meaning
    ====================================  ========  ==============================================================
    ``perf/train_sec``                    s         the step's training time (wall minus eval and save; the
                                                    slowest rank's): what its throughput is computed from
    ``perf/steady``                       0/1       1: the step was known to be steady when its line was written
    ``perf/first_steady_step``            step      from the warmup decision on: this ``train()`` call's first
                                                    steady step; the steps from it to this line are steady too
                                                    (warmup is decided a few steps after it ended)
    ``perf/early_contention_sec``         s         the meter's contention figure so far (summary's
                                                    ``early_contention_sec``)
    ``perf/cpu_sec``                      s         process CPU time (``time.process_time``, all threads; on a CPU
                                                    device its child processes' too) since the previous step ended:
                                                    the same span as ``perf/step_wall_sec``
    ``perf/child_cpu_sec``                s         CPU device: the child processes' part of ``perf/cpu_sec``
                                                    (inductor's compile workers, DataLoader workers)
    ``perf/cpu_time_ratio``               cores     ``perf/cpu_sec`` / ``perf/step_wall_sec``: threads kept busy
    ``perf/other_cpu_cores``              cores     busy cores of the machine during the step minus this process's
                                                    (``psutil.cpu_times``): other processes' load
    ``perf/load_per_core``                ratio     1-minute load average / logical cores (``os.getloadavg``)
    ``perf/generation_batch``             count     GRPO: completions TRL generated in the step on this rank (its
                                                    generation batch; 0 on a step that trains buffered ones)
    ``perf/completion_tokens``            tokens    GRPO: tokens of those completions (with tools: the model's own)
    ``perf/weight_sync_sec``              s         GRPO with vLLM: time in ``VLLMGeneration.sync_weights`` (async
                                                    GRPO: ``_sync_weight``), TRL's own work in it included (part of
                                                    the ``generation`` phase)
    ``perf/reward_sec``                   s         GRPO: time in TRL's reward functions (``_calculate_rewards``:
                                                    the ``reward`` phase)
    ``perf/phase_sec/<phase>``            s         the step's seconds per phase (:data:`~hf_perf_callbacks.keys.
                                                    PHASES`, defined in :mod:`hf_perf_callbacks.core.timeline`), on the
                                                    same interval as ``perf/step_wall_sec``: they sum to it, the
                                                    ``unexplained`` remainder included
    ``perf/callback_sec/<ClassName>``     s         the seconds of one of the user's callback classes' events in
                                                    the step (the ``user_callbacks`` phase by class), present when
                                                    it spent any
    ====================================  ========  ==============================================================

    The summary adds ``phase_sec`` (seconds per phase, the steps and the tail), ``tail_phase_sec`` (the time after
    the last step: its log, evaluation and save), ``callback_sec`` (the user's callback class → event → seconds, the
    tail included), ``tail_callback_sec`` (class → seconds after the last step) and ``recompute_clocked``.

    ====================================  ========  ==============================================================
    key                                   unit      meaning
    ====================================  ========  ==============================================================
    ``perf/tokens_per_sec``               tok/s     windowed, global (all ranks)
    ``perf/tokens_per_sec_per_device``    tok/s     windowed, global / world size
    ``perf/steady_tokens_per_sec``        tok/s     after warmup only, eval and save excluded
    ``perf/steady_step_time``             s         mean training time of the steady steps
    ``perf/step_time``                    s         mean training time per optimizer step in the window
    ``perf/warmup_done``                  0/1       warmup has ended in this ``train()`` call
    ``perf/warmup_steps``                 steps     steps before steady state (once known)
    ``perf/warmup_overhead_sec``          s         time spent above the steady step time during warmup
    ``perf/first_step_slowdown``          ratio     first step (GRPO: generation cycle) / steady step time
    ``perf/phase/<phase>``                %         share of wall time since the last log: ``data_wait``,
                                                    ``generation`` (a generating trainer's), ``compute``, ``eval``,
                                                    ``save``
    ``perf/mfu``                          fraction  model FLOPs utilisation (absent when the peak is unknown)
    ``perf/hfu``                          fraction  hardware FLOPs utilisation, recompute included
                                                    (only with activation checkpointing)
    ``perf/rollout_tokens_per_sec``       tok/s     GRPO: completion tokens of every rank per second of the step's
                                                    engine time (its longest engine call: the ranks' engines run at
                                                    once, one server serving every rank counts once; every backend)
    ``perf/train_tokens_per_sec``         tok/s     GRPO: windowed tokens per second outside generation and the
                                                    wait for rollouts
    ``perf/decode_bandwidth_util``        fraction  GRPO: weight bytes read per decode step × steps / time / peak
                                                    (HF ``generate``: forwards counted; vLLM colocate: the longest
                                                    completion of each engine call, weights / tensor-parallel
                                                    size; vLLM server: absent, the engine runs elsewhere)
    ``perf/forwards_per_microbatch``      count     grad-enabled top-level forwards per micro-batch (expect 1)
    ``perf/pad_fraction``                 fraction  padding share of the positions in this step's training forwards
    ====================================  ========  ==============================================================
    """

    source = "perf"
    exchange_width = 4

    @arguments
    def __init__(self, window_steps: int = 10, warmup_window: int = 4, warmup_tolerance: float = 0.1,
                 max_warmup_steps: int = 50, peak_flops: float | str | None = None,
                 peak_bandwidth: float | None = None, data_wait_threshold: float = 0.1, progress_bar: bool = True,
                 clock: Clock | None = None):
        if not (peak_flops is None or peak_flops == "calibrate"):
            try:
                check_number("peak_flops", peak_flops, low=0, low_open=True)
            except ValueError:                      # the valid choices named, the closest first
                hint = did_you_mean(peak_flops, ["calibrate"]) if isinstance(peak_flops, str) else ""
                raise ValueError(f"peak_flops={peak_flops!r} is not allowed{hint}: expected a number of FLOP/s > 0, "
                                 f"'calibrate' (measure it) or None (the device table)") from None
        check_number("peak_bandwidth", peak_bandwidth, low=0, low_open=True, allow_none=True)
        check_number("data_wait_threshold", data_wait_threshold, low=0, high=1, low_open=True)
        check_flag("progress_bar", progress_bar)
        super().__init__(clock)
        self.timeline = StepTimeline(window_steps, warmup_window, warmup_tolerance, max_warmup_steps)
        self.window_steps, self.warmup_window = window_steps, warmup_window      # settings(): the arguments held
        self.warmup_tolerance, self.max_warmup_steps = warmup_tolerance, max_warmup_steps
        self.peak_flops, self.peak_bandwidth = peak_flops, peak_bandwidth
        self.data_wait_threshold, self.progress_bar = data_wait_threshold, progress_bar
        self.run_peak_flops: float | None = None       # the peaks this run's MFU and decode figures use
        self.mfu_basis: str | None = None              # what MFU is against (runlog.MFU_BASES)
        self.peak_per_cpu_sec: float | None = None     # CPU, calibrated: the calibration's FLOPs per CPU second
        self.metrics_sec = 0.0                         # seconds in the trainer's compute_metrics, the whole run
        self.run_peak_bandwidth: float | None = None
        self.machine = MachineLoad()
        self.warned: set[str] = set()
        self.backend: str | None = None              # how TRL generates (adapter.generation_backend), if it does
        self.engine_parallel = 1                     # vLLM colocate: the devices one engine's weights are split over
        self.generation_depth = 0                    # nested generation calls open now (entry, sync, model.generate)
        self._generate_start = 0.0                   # when the outermost open rollout began
        self._generation_region = False              # it is a clocked region (else carved out of compute)
        self._sync_depth = 0                         # weight syncs open now
        self._engine_entry = 0                       # TRL's VLLMGeneration.generate calls open now
        self._engine_calls: list[float] = []         # the engine calls open now: when each began
        self._collective_waits: list[bool] = []      # the collectives open now: each a wait for another rank?
        self._stop_watching_collectives: Callable[[], None] | None = None
        self._undo: list[Callable[[], None]] = []     # what close() takes back: hooks, wrappers and clocks
        self.clocked = False                       # the trainer's phases and the callbacks are on their own clocks
        self.step_callback_sec: dict[str, float] = {}    # seconds per callback class in the step in progress
        self.callback_sec: dict[str, dict[str, float]] = {}   # class → event → seconds, this train() call
        self.tail_phase_sec: dict[str, float] = {}
        self.tail_callback_sec: dict[str, float] = {}
        self._callback_began: list[float] = []
        self.layer_forwards: dict[int, int] = {}        # a checkpointed layer's part → its forwards this micro-batch
        self.part_started: dict[int, float] = {}
        self.part_seconds: dict[int, float] = {}        # a part → its first forward's seconds this micro-batch
        self.summary: MeterSummary | None = None
        self.run: MeterRun | None = None             # this train() call's facts (on_train_begin)
        self.counters: MeterStep | None = None       # the step in progress (on_train_begin, after each step)

    _run: Made[MeterRun] = Made("run")
    _step: Made[MeterStep] = Made("counters")

    # ------------------------------------------------------------ setup
    @hook
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
                       **kwargs: Any) -> None:
        trainer = adapter.calling_trainer()
        async_grpo = adapter.is_async_grpo(trainer)        # generates in another process: no cycles, TRL's tokens
        is_grpo_run = is_grpo(args) or async_grpo
        iterations = getattr(args, "num_iterations", 1)
        device = DeviceLayer()
        self.run = MeterRun(
            device=device, world=world_size(), is_grpo=is_grpo_run, trainer=trainer, main=state.is_world_process_zero,
            # async GRPO: the tokens TRL counts as trained (a TRL before 1.16 counts none: the forwards' tokens)
            token_source=("trl" if async_grpo and adapter.async_trained_tokens(trainer) is not None
                          else "trainer" if is_grpo(args) or args.include_num_input_tokens_seen not in ("no", False)
                          else "hook"),
            num_iterations=iterations,
            # a GRPO run's arguments are TRL's GRPOConfig, whose __post_init__ sets steps_per_generation (an int)
            period=(generation_period(cast(Any, args).steps_per_generation, iterations,
                                      args.gradient_accumulation_steps)
                    if is_grpo_run and not async_grpo else 1),
            # integer counters on the device, read once per step (no synchronize per micro-batch; MPS has no float64)
            counts=torch.zeros(3, dtype=torch.long, device=device.device),
            seen=state.num_input_tokens_seen)    # resume: the restored count is the baseline (no spike)
        self.close()
        self._install(model)
        self._setup_flops(model, args, state.global_step)
        self._reset_step_counters()
        self._run.device.synchronize()
        self.machine.reset(count_children=self._run.device.type == "cpu")
        self.timeline.start_segment(self.clock.wall(), self._run.period, cpu=self.machine.cpu(self.clock.cpu()),
                                    work="cpu" if self._run.device.type == "cpu" else "wall")
        self._install_clocks()
        self._bus.log.describe_run(self.source, state.global_step, device=self._run.device.name,
                               device_type=self._run.device.type, world_size=self._run.world, grpo=self._run.is_grpo,
                               token_source=self._run.token_source, period=self._run.period,
                               peak_flops=self.run_peak_flops, mfu_basis=self.mfu_basis,
                               peak_flops_per_cpu_sec=self.peak_per_cpu_sec, warmup_tolerance=self.warmup_tolerance,
                               peak_bandwidth=self.run_peak_bandwidth, dtype=self._run.dtype_key,
                               per_device_train_batch_size=args.per_device_train_batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               **{name: getattr(args, name, None) for name in _GENERATION_SETTINGS},
                               generation_backend=self.backend,
                               vllm_enable_sleep_mode=(getattr(args, "vllm_enable_sleep_mode", None)
                                                       if getattr(args, "use_vllm", False) else None),
                               weight_sync_steps=(getattr(args, "weight_sync_steps", None)
                                                  if self.backend == adapter.ASYNC_BACKEND else None),
                               activation_checkpointing=self._run.recompute, model=self._model_facts(),
                               dataloader=_dataloader_settings(args),
                               trainer_settings=_trainer_settings(args, trainer),
                               torch_threads=torch.get_num_threads(),
                               cpu_cores=os.cpu_count())

    def _install(self, model: Any) -> None:
        """A forward pre-hook on the innermost causal LM's decoder stack (training forwards, tokens, decode
        steps; see :func:`forward_entry`) and a timing wrapper around ``generate`` (GRPO rollouts)."""
        previous = _INSTALLED.get(model)
        if previous is not None and previous is not self:
            previous.close()
        _INSTALLED[model] = self
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._run.inner = inner
        self._undo.append(forward_entry(inner).register_forward_pre_hook(self._on_forward, with_kwargs=True).remove)
        if self._run.is_grpo and hasattr(model, "generate"):
            self._undo.append(adapter.watch_generate(model, self))
        trainer = self._run.trainer if self._run.is_grpo else None
        self.backend = adapter.generation_backend(trainer)
        if self.backend is not None:          # TRL's own entry: every backend timed at one place
            self._undo.append(adapter.watch_generation_entry(trainer, self))
            self.engine_parallel = int(getattr(getattr(trainer, "args", None), "vllm_tensor_parallel_size", 1) or 1)

    # A rollout is one ``generation`` region from the outermost of the calls that nest in it: TRL's ``_generate``,
    # a weight sync to vLLM and ``model.generate``; the engine call a rank makes (HTTP to the server,
    # ``LLM.generate``, ``model.generate``) is its engine time.
    def _generation_opened(self) -> None:
        if self.generation_depth == 0:
            self._generate_start = self.clock.wall()
            self._generation_region = self.clocked and "eval" not in self.timeline.regions
            if self._generation_region:
                self.timeline.enter("generation", self._generate_start)
                if self._run.world > 1:
                    self._stop_watching_collectives = adapter.watch_collectives(self._collective_started,
                                                                                self._collective_finished)
        self.generation_depth += 1

    def _generation_closed(self) -> None:
        self.generation_depth = max(0, self.generation_depth - 1)
        if self.generation_depth:
            return
        if self._stop_watching_collectives is not None:
            self._stop_watching_collectives()
            self._stop_watching_collectives = None
        if self.disabled:
            return
        if self._generation_region:
            self.timeline.leave("generation", self.clock.wall())
        else:
            self.timeline.add_generation(self.clock.wall() - self._generate_start)

    def _engine_closed(self) -> None:
        if not self._engine_calls:
            return
        started = self._engine_calls.pop()
        if not self._engine_calls and not self.disabled and self.timeline.step_begin_at is not None \
                and "eval" not in self.timeline.regions:         # an engine call of training, not of evaluation
            self._step.engine_seconds += self.clock.wall() - started

    def _waits_for_other_ranks(self, name: str) -> bool:
        """A collective of the rollout outside the weight sync and the engine call: a wait for another rank; the
        broadcast of the server's completions to a server run's other ranks is the engine call they wait for."""
        if self.disabled or not self._generation_region or self._sync_depth or self._engine_calls:
            return False
        return not (name == "broadcast_object_list" and self._engine_entry and not self._run.main
                    and self.backend == "vllm-server")

    def _collective_started(self, name: str) -> None:
        wait = self._waits_for_other_ranks(name)
        self._collective_waits.append(wait)
        if wait:
            self.timeline.enter("rollout_wait", self.clock.wall())

    def _collective_finished(self, name: str) -> None:
        if self._collective_waits and self._collective_waits.pop() and not self.disabled:
            self.timeline.leave("rollout_wait", self.clock.wall())

    def _install_clocks(self) -> None:
        """The phase clocks (see :mod:`hf_perf_callbacks.core.timeline`): the trainer's batch fetch, log, evaluation and
        checkpoint save, every callback's every event (through the trainer's callback handler), and on a CPU the
        forwards gradient checkpointing runs again (a GPU runs them asynchronously: there they stay in compute)."""
        self.step_callback_sec, self.callback_sec, self.tail_phase_sec, self.tail_callback_sec = {}, {}, {}, {}
        self._callback_began = []
        self.part_seconds = {}                  # the per-micro-batch counters are fresh (_reset_step_counters)
        trainer = adapter.calling_trainer()
        handler = self._bus.console.handler
        if trainer is None or handler is None:
            self.clocked = False
            return
        now = self.clock.wall
        self._undo.append(adapter.clock_trainer(trainer, lambda phase: self.timeline.enter(phase, now()),
                                                       lambda phase: self.timeline.leave(phase, now())))
        self._undo.append(adapter.time_callbacks(handler, self._callback_started, self._callback_finished))
        self._undo.append(self._clock_own_work(now))
        self._clock_compute_metrics(trainer)
        self.clocked = True
        if self._run.recompute and self._run.device.type == "cpu":
            from transformers.modeling_layers import GradientCheckpointingLayer

            # transformers 5.24 checkpoints a layer's ``forward``, not its ``__call__``: the layer's own hooks run once,
            # its children's run again in the recompute. The recompute stops early (torch's checkpoint early stop:
            # a part's forward hook may never run), so each part's recompute is timed as its first forward was
            for layer in self._run.inner.modules():
                if isinstance(layer, GradientCheckpointingLayer):
                    for part in layer.children():
                        self._undo.append(part.register_forward_pre_hook(self._layer_started).remove)
                        self._undo.append(part.register_forward_hook(self._layer_finished).remove)

    def _clock_own_work(self, now: Callable[[], float]) -> Callable[[], None]:
        """The package's own passes inside a step (the check of a change) are its own callbacks' time; returns the
        undo."""
        def clock(began: bool) -> None:
            (self.timeline.enter if began else self.timeline.leave)("own_callbacks", now())

        self._bus.own_work_clocks.append(clock)
        return lambda: self._bus.own_work_clocks.remove(clock) if clock in self._bus.own_work_clocks else None

    def _clock_compute_metrics(self, trainer: Any) -> None:
        """Time the trainer's ``compute_metrics`` (inside the evaluation phase): ``compute_metrics_sec`` in the
        summary, what the evaluation finding weighs against the rest of an evaluation."""
        metrics = getattr(trainer, "compute_metrics", None)
        if not callable(metrics):
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock.wall()
            try:
                return metrics(*args, **kwargs)
            finally:
                self.metrics_sec += self.clock.wall() - start

        trainer.compute_metrics = timed
        self._undo.append(lambda: setattr(trainer, "compute_metrics", metrics))

    def _callback_phase(self, callback: object) -> str:
        """The phase of a callback's events: the package's own, the trainer's logging and flow (transformers', TRL's
        and the reporters' callbacks) or the user's."""
        from .common.bus import RunBus

        if isinstance(callback, (PerfCallback, RunBus)):
            return "own_callbacks"
        module = type(callback).__module__ or ""
        return "log" if module.split(".")[0] in ("transformers", "trl", "accelerate", "peft") else "user_callbacks"

    def _callback_started(self, callback: object, event: str) -> None:
        if not self.disabled:
            self.timeline.enter(self._callback_phase(callback), self.clock.wall())
            self._callback_began.append(self.clock.wall())

    def _callback_finished(self, callback: object, event: str) -> None:
        if self.disabled or not self._callback_began:
            return
        now = self.clock.wall()
        seconds = now - self._callback_began.pop()
        phase = self._callback_phase(callback)
        self.timeline.leave(phase, now)
        if phase != "user_callbacks":         # the package's and the trainer's own: their phases say it
            return
        name = type(callback).__name__
        self.step_callback_sec[name] = self.step_callback_sec.get(name, 0.0) + seconds
        events = self.callback_sec.setdefault(name, {})
        events[event] = events.get(event, 0.0) + seconds

    def _layer_started(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self.disabled or self.generation_depth or not module.training:
            return
        key = id(module)
        n = self.layer_forwards[key] = self.layer_forwards.get(key, 0) + 1
        if n == 1:
            self.part_started[key] = self.clock.wall()
        else:          # a checkpointed layer's part run again in the micro-batch: its first forward's time again
            self.timeline.add_inside("recompute", self.part_seconds.get(key, 0.0))

    def _layer_finished(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        started = self.part_started.pop(id(module), None)
        if started is not None:
            self.part_seconds[id(module)] = self.clock.wall() - started

    def generate_started(self) -> None:
        """A GRPO rollout begins (see :func:`~hf_perf_callbacks.platform.adapter.watch_generate`): HF's engine call."""
        self._generation_opened()
        self._engine_calls.append(self.clock.wall())

    def generate_finished(self, input_ids: Any, output: Any) -> None:
        self._engine_closed()
        self._generation_closed()
        if not self.disabled and output is not None and self.backend is None:   # else counted at TRL's entry
            self._hook_safely(self._count_generated, input_ids, output)

    def entry_started(self, kind: str) -> None:
        """TRL's generation entry ``kind`` begins (see
        :func:`~hf_perf_callbacks.platform.adapter.watch_generation_entry`);
        called from the trainer's own code, so a fault disables the meter instead of failing the step."""
        self._hook_safely(self._entry_started, kind)

    def entry_finished(self, kind: str, result: Any) -> None:
        self._hook_safely(self._entry_finished, kind, result)

    def _entry_started(self, kind: str) -> None:
        self._step.entry_start[kind] = self.clock.wall()
        if kind in (adapter.ROLLOUT, adapter.SYNC):
            self._generation_opened()
        if kind == adapter.SYNC:
            self._sync_depth += 1
        elif kind == adapter.ENGINE:
            self._engine_entry += 1
        elif kind == adapter.CALL:
            self._engine_calls.append(self.clock.wall())

    def _entry_finished(self, kind: str, result: Any) -> None:
        if kind == adapter.CALL:
            self._engine_closed()
        elif kind == adapter.ENGINE:
            self._engine_entry = max(0, self._engine_entry - 1)
        elif kind == adapter.SYNC:
            self._sync_depth = max(0, self._sync_depth - 1)
        if kind in (adapter.ROLLOUT, adapter.SYNC):
            self._generation_closed()
        started = self._step.entry_start.pop(kind, None)
        # evaluation's generation is evaluation's; async GRPO's weight transfer runs after the step's end (TRL's
        # callback): the next step's
        in_step = self.timeline.step_begin_at is not None or self.backend == adapter.ASYNC_BACKEND
        if self.disabled or started is None or not in_step or "eval" in self.timeline.regions:
            return
        seconds = self.clock.wall() - started
        if kind == adapter.SYNC:
            self._step.sync_seconds += seconds
        elif kind == adapter.REWARD:
            self._step.reward_seconds += seconds
            self.timeline.add_inside("reward", seconds)           # the reward phase, out of the step's compute
        completions, tokens, longest = adapter.rollout_counts(kind, result)
        if kind == adapter.ROLLOUT:
            self._step.completions += completions
            self._step.completion_tokens += tokens
        elif kind == adapter.ENGINE and self.backend == "vllm-colocate":
            self._step.decode_steps += longest        # the engine decodes the whole batch until its longest completion

    def _setup_flops(self, model: Any, args: TrainingArguments, step: int) -> None:
        self._run.shape = shape_of(model)
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else self._run.inner.dtype
        try:
            self._run.dtype_key = dtype_key(dtype)
        except ValueError:                       # e.g. float64 or int8 weights: no peak to compare with
            self._run.dtype_key = str(dtype).removeprefix("torch.")
        name = ("is_activation_checkpointing" if hasattr(type(self._run.inner), "is_activation_checkpointing")
                else "is_gradient_checkpointing")
        self._run.recompute = bool(getattr(self._run.inner, name, False))
        self._run.weight_bytes = sum(full_numel(p) * p.element_size() for p in self._run.inner.parameters())
        table = self._run.device.peak()
        self.mfu_basis, self.peak_per_cpu_sec = None, None
        if self.peak_flops == "calibrate":
            self._calibrate(dtype)
        elif self.peak_flops is not None:
            self.run_peak_flops, self.mfu_basis = float(self.peak_flops), "given"
        else:
            self.run_peak_flops = table.flops.get(self._run.dtype_key) if table else None
            self.mfu_basis = "table" if self.run_peak_flops else None
        self.run_peak_bandwidth = self.peak_bandwidth or (table.bandwidth if table else None)
        if self.run_peak_flops is None and "mfu" not in self.warned:
            self.warned.add("mfu")
            written = self._bus.log.standing.get("launcher") or getattr(self, "built_by", None)
            self.warn(f"MFU omitted: {argument_hint('ThroughputMeter', 'peak_flops', 'calibrate', written)} measures "
                      f"the {self._run.dtype_key} peak FLOP/s (or give it), none known for '{self._run.device.name}'",
                      step=step)

    def _calibrate(self, dtype: torch.dtype) -> None:
        """The peak from a matmul on this device; on a CPU also its FLOPs per CPU second (the calibration's CPU
        seconds over its wall seconds are the cores it got): MFU there is per CPU time, which other processes on the
        machine change neither during the calibration nor during training."""
        wall, cpu = self.clock.wall(), self.clock.cpu()
        self.run_peak_flops = self._run.device.calibrate_flops(dtype)
        busy = (self.clock.cpu() - cpu) / max(1e-9, self.clock.wall() - wall)
        if self._run.device.type == "cpu" and busy > 0:
            self.mfu_basis, self.peak_per_cpu_sec = "cpu_time", self.run_peak_flops / busy
        else:
            self.mfu_basis = "calibrated"

    def _model_facts(self) -> dict[str, Any]:
        """What memory and FLOP estimates need from the model config (for the report)."""
        config = text_config(self._run.inner)      # a transformers config (or None), read by duck typing
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings")
        facts = {k: getattr(config, k, None) for k in keys}
        name = getattr(self._run.inner, "name_or_path", None)
        facts.update(name=name if isinstance(name, str) and name else None,
                     params=sum(full_numel(p) for p in self._run.inner.parameters()),
                     trainable_params=sum(full_numel(p) for p in self._run.inner.parameters() if p.requires_grad),
                     bytes_per_param=next(self._run.inner.parameters()).element_size(),
                     matmul_params=self._run.shape.matmul_params,
                     trainable_matmul_params=self._run.shape.trainable_matmul_params)
        return facts

    def _reset_step_counters(self) -> None:
        self.counters = MeterStep()
        self._run.counts.zero_()                   # [HOOK_TOKENS, GENERATED, REAL_POSITIONS]
        self.layer_forwards, self.part_started = {}, {}

    # ------------------------------------------------------------ hooks (no synchronize here)
    def _hook_safely(self, fn: Callable[..., None], *args: Any) -> None:
        """Run hook-side work; a fault disables the meter (one warning) instead of failing the training step."""
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001
            self._disable("a hook", error)               # one warning, and every wrapper and hook of it removed

    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.disabled and not self._bus.own_passes:     # the exactness check's passes are no step's
            self._hook_safely(self._count_forward, module, args, kwargs)

    def _count_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.generation_depth:
            self._step.decode_steps += 1
        elif torch.is_grad_enabled() and module.training:
            self._step.forwards += 1
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if isinstance(ids, torch.Tensor):
                self._run.seq_len = ids.shape[-1]
            positions = mask if isinstance(mask, torch.Tensor) else ids if isinstance(ids, torch.Tensor) else None
            if positions is None:
                return
            real = mask.sum() if positions is mask else positions.numel()
            self._step.padded_positions += positions.numel()
            self._run.counts[REAL_POSITIONS] += real
            if self._run.token_source == "hook":
                self._run.counts[HOOK_TOKENS] += real

    def _count_generated(self, input_ids: Any, out: Any) -> None:
        sequences = getattr(out, "sequences", out)
        if isinstance(sequences, torch.Tensor) and isinstance(input_ids, torch.Tensor):
            new = sequences[:, input_ids.shape[-1]:]
            pad = getattr(getattr(self._run.inner, "generation_config", None), "pad_token_id", None)
            self._run.counts[GENERATED] += (new != pad).sum() if pad is not None else new.numel()

    # ------------------------------------------------------------ events
    @hook
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        overhead = self._bus.take_overhead()                 # the callbacks' own time, clocked here when clocked
        self.timeline.step_begin(self.clock.wall(), overhead=0.0 if self.clocked else overhead)

    @hook
    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._step.microbatches += 1
        self.layer_forwards, self.part_started = {}, {}

    @hook
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self.clocked:
            self.timeline.mark("eval", self.clock.wall())

    @hook
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self.clocked:
            self.timeline.mark("save", self.clock.wall())

    @hook
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._step.microbatches += 1
        e = self._end_step(args, state, control)
        self._exchange(state.global_step, [e.tokens, e.record.train, e.generated, e.engine],    # the step's one
                       lambda rows: self._step_ended(e, rows))                                   # exchange

    def _end_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> EndedStep:
        """The step measured at its end: the one synchronize, its record, the device counters read once."""
        self.timeline.enter("compute", self.clock.wall())          # waiting for the device is the step's compute
        self._run.device.synchronize()                                   # the one synchronize per optimizer step
        end = self.clock.wall()
        trl_tokens = self._async_step() if self._run.token_source == "trl" else None
        record = self.timeline.measure(state.global_step, end, cpu=self.machine.cpu(self.clock.cpu()))
        self.timeline.leave("compute", end)
        callbacks, self.step_callback_sec = self.step_callback_sec, {}
        counts = self._run.counts.tolist()                               # one read of the device counters
        tokens = (trl_tokens if trl_tokens is not None
                  else float(state.num_input_tokens_seen - self._run.seen) if self._run.token_source == "trainer"
                  else float(counts[HOOK_TOKENS]) if self._run.token_source == "hook" else 0.0)
        self._run.seen = state.num_input_tokens_seen
        generated = float(counts[GENERATED]) if self._run.is_grpo else 0.0
        if self.backend is not None:                                # counted at TRL's entry, every backend
            generated = float(self._step.completion_tokens)
        return EndedStep(record, counts, tokens, generated, self._step.engine_seconds, callbacks, args, control)

    def _async_step(self) -> float | None:
        """Async GRPO at the step's end, as TRL measured it (before its own callback resets the figures): the queue
        wait moved out of the batch fetch into ``rollout_wait``, and the tokens the step trained."""
        wait = adapter.async_rollout_wait(self._run.trainer)
        if wait:
            self.timeline.reassign(wait, "data_wait", "rollout_wait")
        return adapter.async_trained_tokens(self._run.trainer)

    def _step_ended(self, e: EndedStep, rows: Rows) -> None:
        """The step ``e``'s figures once every rank's tokens and training seconds are known (``rows``)."""
        record = e.record
        tokens = sum(r[0] for r in rows) if self._run.token_source == "hook" else e.tokens
        self.timeline.commit(record, tokens, max(r[1] for r in rows))
        # the rollout's rate over every rank: all ranks' completion tokens over the step's engine time (the ranks'
        # engines run at once; a server serving every rank made one call, on the main process)
        all_generated, longest = sum(r[2] for r in rows), max(r[3] for r in rows)
        metrics = self._step_metrics(all_generated / longest if longest > 0 else None, e.engine)
        if self._step.padded_positions:
            metrics[keys.PERF_PAD_FRACTION] = 1.0 - e.counts[REAL_POSITIONS] / self._step.padded_positions
        self._check_duplicates(record.step)
        self._check_data_wait(e.args, record.step)
        self._bus.log.record_step(record.step, {**metrics, **{keys.PERF_PHASE_SEC[p]: getattr(record, p)
                                                              for p in PHASES},
                                                keys.PERF_STEP_WALL_SEC: record.wall, keys.PERF_TRAIN_SEC: record.train,
                                                keys.PERF_TOKENS: tokens, keys.PERF_SEQ_LEN: self._run.seq_len,
                                                keys.PERF_STEADY: int(record.steady),
                                                keys.PERF_FIRST_STEADY_STEP: self.timeline.first_steady_step,
                                                keys.PERF_EARLY_CONTENTION_SEC: self.timeline.early_contention,
                                                **{keys.PERF_CALLBACK_SEC + k: v for k, v in e.callbacks.items()},
                                                **self.machine.step_fields(record), **self._rollout_fields()})
        if e.control.should_log:   # phase shares over this logging interval, in % (as the console's time split)
            metrics.update({keys.PERF_PHASE_SHARE[k]: 100.0 * v for k, v in self.timeline.take_window_phases().items()
                            if k != "generation" or self.backend is not None})    # generation: a generating trainer's
        self._bus.merger.publish({k: v for k, v in metrics.items()
                                  if not (self.backend == adapter.ASYNC_BACKEND and k in TRL_ASYNC_KEYS)})
        if self.progress_bar and metrics.get(keys.PERF_TOKENS_PER_SEC):
            self._bus.console.show_progress(f"tok/s={metrics[keys.PERF_TOKENS_PER_SEC]:.0f}")
        self._reset_step_counters()

    @hook
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        _, tail = self.timeline.tail(self.clock.wall())     # the last log, evaluation and save, after the last step
        self.tail_phase_sec = {k: v for k, v in tail.items() if v > 0}
        self.tail_callback_sec, self.step_callback_sec = self.step_callback_sec, {}
        self.summary = self.summarize()
        self._bus.log.write_summary(self.source, self.summary)
        if state.is_world_process_zero and not self._bus.continuing:    # printed once, at the run's end
            self._bus.console.say(self.format_summary())
        self.close()

    # ------------------------------------------------------------ metrics
    def _step_metrics(self, rollout_rate: float | None, engine: float) -> dict[str, Any]:
        tl = self.timeline
        m: dict[str, Any] = dict(tl.rate_metrics(self._run.world))
        m.update(self._utilisation(tl.tokens_per_sec, tl.cpu_rate.rate()))
        m[keys.PERF_FORWARDS_PER_MICROBATCH] = self._step.forwards / max(1, self._step.microbatches)
        if self._run.is_grpo and rollout_rate is not None:
            m[keys.PERF_ROLLOUT_TOKENS_PER_SEC] = rollout_rate
            if self.run_peak_bandwidth and self._step.decode_steps and engine > 0:   # none where vLLM is a server
                m[keys.PERF_DECODE_BANDWIDTH_UTIL] = (self._run.weight_bytes / self.engine_parallel
                                                      * self._step.decode_steps / engine / self.run_peak_bandwidth)
        if self._run.is_grpo and tl.train_rate.rate():          # windowed over whole generation cycles, like tokens/s
            m[keys.PERF_TRAIN_TOKENS_PER_SEC] = tl.train_rate.rate()
        return {k: v for k, v in m.items() if v is not None}

    def _rollout_fields(self) -> dict[str, float]:
        """The step line's figures of TRL's generation entry (none for a trainer that does not generate)."""
        if self.backend is None:
            return {}
        fields = {keys.PERF_GENERATION_BATCH: self._step.completions,
                  keys.PERF_COMPLETION_TOKENS: self._step.completion_tokens,
                  keys.PERF_REWARD_SEC: self._step.reward_seconds}
        if self.backend.startswith("vllm"):
            fields[keys.PERF_WEIGHT_SYNC_SEC] = self._step.sync_seconds
        return fields

    def _flops_per_token(self) -> tuple[float, float]:
        model, hardware = train_flops_per_token(self._run.shape, self._run.seq_len, self._run.recompute)
        if self._run.is_grpo and self.backend != adapter.ASYNC_BACKEND:   # trained num_iterations times, generated once
            forward = forward_flops_per_token(self._run.shape, self._run.seq_len)
            model, hardware = model * self._run.num_iterations + forward, hardware * self._run.num_iterations + forward
        return model, hardware

    def _utilisation(self, rate: float | None, cpu_rate: float | None) -> dict[str, float]:
        """MFU (and HFU) of ``rate``, tokens per second of training time, against the peak; on a CPU calibrated
        (``mfu_basis`` "cpu_time") of ``cpu_rate``, tokens per training CPU second, against the calibration's FLOPs
        per CPU second."""
        per_cpu = self.mfu_basis == "cpu_time"
        peak, rate = (self.peak_per_cpu_sec, cpu_rate) if per_cpu else (self.run_peak_flops, rate)
        if not (peak and rate):
            return {}
        model, hardware = self._flops_per_token()
        per_device = rate / self._run.world
        out = {keys.PERF_MFU: model * per_device / peak}
        if self._run.recompute:
            out[keys.PERF_HFU] = hardware * per_device / peak
        return out

    def _check_duplicates(self, step: int) -> None:
        if self._step.microbatches and self._step.forwards > self._step.microbatches and "duplicate" not in self.warned:
            self.warned.add("duplicate")
            per = self._step.forwards / self._step.microbatches
            self.warn(f"{self._step.forwards} grad-enabled forward passes over {self._step.microbatches} micro-batches "
                      f"at step {step} ({per:.1f} per micro-batch, expected 1): a custom compute_loss or training_step "
                      f"runs the model more than once per batch and pays its cost twice.", step=step,
                      figures=WarningFigures(forwards_per_microbatch=per))

    def _check_data_wait(self, args: TrainingArguments, step: int) -> None:
        tl = self.timeline
        if not tl.warmup_done or "data_wait" in self.warned or tl.phase_totals["data_wait"] == 0:
            return
        share = tl.phase_fractions()["data_wait"]
        if share > self.data_wait_threshold:
            self.warned.add("data_wait")
            advice = [line for line, _ in dataloader_changes(self._run.device.type, _dataloader_settings(args))]
            self.warn(f"the accelerator waits for data {share:.0%} of the time: " + "; ".join(advice) + ".",
                      step=step, figures=WarningFigures(data_wait_fraction=share))

    # ------------------------------------------------------------ summary
    def summarize(self) -> MeterSummary:
        tl = self.timeline
        out: MeterSummary = {"steps": tl.steps, "tokens": tl.total_tokens, "train_seconds": tl.total_train_seconds,
               "warmup_done": tl.warmup_done, "warmup_steps": tl.warmup_steps,
               "warmup_overhead_sec": tl.warmup_overhead, "first_step_slowdown": tl.first_step_slowdown,
               "warmup_in_band": tl.warmup_in_band,
               "steady_step_sec": tl.steady_step_seconds, "steady_tokens_per_sec": tl.steady_tokens_per_sec,
               "mean_tokens_per_sec": tl.total_tokens / tl.total_train_seconds if tl.total_train_seconds else None,
               "phases": tl.phase_fractions(), "device": self._run.device.name, "world_size": self._run.world,
               "peak_flops": self.run_peak_flops, "warmup_measured_on": tl.work,
               "first_steady_step": tl.first_steady_step, "steady_step_count": tl.steady_steps,
               "early_contention_sec": tl.early_contention, "contention_steps": tl.contention_steps,
               "phase_sec": dict(tl.phase_totals), "tail_phase_sec": dict(self.tail_phase_sec),
               "callback_sec": {k: dict(v) for k, v in self.callback_sec.items()},
               "tail_callback_sec": dict(self.tail_callback_sec),
               "recompute_clocked": bool(self._run.recompute and self.clocked and self._run.device.type == "cpu")}
        rate, cpu_rate = tl.steady_tokens_per_sec, tl.steady_tokens_per_cpu_sec
        provisional = tl.provisional() if rate is None else None
        if provisional is not None:                 # a short run: the rate of the steps it has, marked as such
            rate, cpu_rate = provisional[0], provisional[4]
            out["provisional"], out["provisional_tokens_per_sec"] = True, provisional[0]
            out["provisional_step_sec"], out["provisional_steps"] = provisional[1], [provisional[2], provisional[3]]
        if self.metrics_sec:
            out["compute_metrics_sec"] = self.metrics_sec
        utilisation = self._utilisation(rate, cpu_rate)
        if keys.PERF_MFU in utilisation:
            out["mfu"] = utilisation[keys.PERF_MFU]
        if keys.PERF_HFU in utilisation:
            out["hfu"] = utilisation[keys.PERF_HFU]
        return out

    def format_summary(self) -> str:
        s = self.summary or self.summarize()
        mfu = (mfu_words(s["mfu"], self.mfu_basis, bool(s.get("provisional"))) if "mfu" in s
               else "MFU n/a (peak unknown)" if not s["peak_flops"] else "")
        warmup = warmup_line(s["warmup_done"], s["warmup_steps"], s["first_step_slowdown"], s["warmup_overhead_sec"],
                             s["steps"], s.get("early_contention_sec"), in_band=s.get("warmup_in_band"),
                             tolerance=self.warmup_tolerance)
        if s["warmup_done"] and s.get("warmup_measured_on") == "cpu":
            warmup += "   (decided on CPU time)"
        lines = [
            "== ThroughputMeter summary ==",
            f"device: {s['device']} × {s['world_size']}   steps: {s['steps']}   tokens: {s['tokens']:.0f}",
            f"warmup: {warmup}",
            (provisional_line(s["provisional_tokens_per_sec"], s["provisional_step_sec"], s["provisional_steps"],
                              s["mean_tokens_per_sec"]) if s.get("provisional")
             else throughput_line(s["steady_tokens_per_sec"], s["steady_step_sec"], s["mean_tokens_per_sec"])),
            *([wrapped(mfu)] if mfu else []),
            phase_line(s["phases"]),
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------ state
    def start_fresh(self) -> None:
        self.timeline = StepTimeline(self.window_steps, self.warmup_window, self.warmup_tolerance,
                                     self.max_warmup_steps)
        self.warned, self.summary, self.metrics_sec = set(), None, 0.0

    def export(self) -> dict[str, Any]:
        return {"timeline": self.timeline.export(), "warned": sorted(self.warned), "metrics_sec": self.metrics_sec}

    def load(self, saved: dict[str, Any]) -> None:
        self.timeline.load(saved.get("timeline", {}))
        self.warned = set(saved.get("warned", []))
        self.metrics_sec = float(saved.get("metrics_sec", 0.0))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self._stop_watching_collectives is not None:
            self._stop_watching_collectives()
            self._stop_watching_collectives = None
        self.generation_depth = self._sync_depth = self._engine_entry = 0
        self._engine_calls, self._collective_waits = [], []


#: async GRPO: the meter's published keys whose meaning TRL's ``AsyncGRPOTrainer`` logs itself (its key beside):
#: left to TRL's in the reporters, still on the perf log's step lines
TRL_ASYNC_KEYS = {keys.PERF_TOKENS_PER_SEC: "perf/trained_tok_s_wall_clock", keys.PERF_STEP_TIME: "perf/step_s",
                  keys.PERF_MFU: "perf/mfu_wall_clock"}

#: GRPO's training arguments the run header holds as they are (None where the trainer has none)
_GENERATION_SETTINGS = ("max_completion_length", "num_generations", "steps_per_generation", "pad_to_multiple_of",
                        "temperature", "use_vllm")

#: the training arguments of the phases a user controls (the run header's ``trainer_settings``)
TRAINER_SETTINGS = ("save_strategy", "save_steps", "save_only_model", "save_total_limit", "logging_strategy",
                    "logging_steps", "logging_first_step", "eval_strategy", "eval_steps", "eval_delay",
                    "activation_checkpointing", "max_steps", "torch_compile", "prediction_loss_only",
                    "per_device_eval_batch_size", "eval_accumulation_steps", "batch_eval_metrics")


def _trainer_settings(args: object, trainer: object = None) -> dict[str, Any]:
    """The settings of :data:`TRAINER_SETTINGS` as JSON values (an enum as its value), and whether the trainer has a
    ``compute_metrics`` and a ``preprocess_logits_for_metrics``."""
    out: dict[str, Any] = {}
    for name in TRAINER_SETTINGS:
        value = getattr(args, name, None)
        value = getattr(value, "value", value)
        if value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
    if trainer is not None:
        for name in ("compute_metrics", "preprocess_logits_for_metrics"):
            out[name] = getattr(trainer, name, None) is not None
    return out


def _dataloader_settings(args: object) -> DataLoaderFacts:
    """The DataLoader settings of the training arguments (for the run header and the data-wait advice)."""
    return dataloader_facts({k: getattr(args, f"dataloader_{k}", None) for k in FACT_TYPES})
