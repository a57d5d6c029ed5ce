"""MemoryWatchdog: see the memory wall coming — where the device really has it — and act before the OS swaps, the
device runs out or the kernel kills the run; lose nothing."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import keys
from .common.base import Clock, Made, PerfCallback, arguments, hook
from .common.bus import MemoryReading
from .common.exchange import Rows
from .core.batching import is_grpo
from .core.memory import (
    BUDGET_FRACTION,
    CLEAR,
    CRITICAL,
    GRACE_STEPS,
    LEVEL_NAMES,
    SMALLER_BATCH,
    STOP,
    STOP_WITHIN_STEPS,
    TREND_WINDOW,
    WALL_BAND,
    WARN_FRACTION,
    WARN_WITHIN_STEPS,
    CompletionTrend,
    MemoryPolicy,
    MovingWall,
    Observation,
    WallFacts,
    budget_bytes,
    gib,
    holders_words,
    mib,
)
from .core.runlog import ActionDetails, StopFigures, WallMove, WarningFigures, WatchdogAction, WatchdogSummary
from .core.validation import check_flag, check_number
from .platform import adapter
from .platform.device import GB, DeviceLayer, MemorySample, gather_floats, world_size

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from .core.stats import WallForecast
    from .platform.macos import MacMemorySample

#: a decision as the number the ranks exchange (the most conservative, the largest, wins)
RANK_OF: dict[str | None, float] = {None: 0.0, SMALLER_BATCH: 1.0, STOP: 2.0}
#: ... and back
ACTION_OF: dict[int, str | None] = {int(rank): action for action, rank in RANK_OF.items()}
WALL_KEYS = (keys.MEM_STEPS_TO_WALL, keys.MEM_STEPS_TO_WALL_LOW, keys.MEM_STEPS_TO_WALL_HIGH)


def wall_fields(forecast: WallForecast | None, remaining: int | None) -> dict[str, float]:
    """The ``mem/steps_to_wall*`` keys of one step: none when memory is not growing or the wall lies beyond the
    run's ``remaining`` steps even at the point estimate; ``_high`` capped at ``remaining`` (past the run's end
    the wall is not met) and absent when growth may be zero within the 95% interval and the run has no end."""
    if forecast is None or (remaining is not None and forecast.steps > remaining):
        return {}
    high = forecast.high
    if remaining is not None:
        high = remaining if high is None else min(high, remaining)
    fields = {keys.MEM_STEPS_TO_WALL: forecast.steps, keys.MEM_STEPS_TO_WALL_LOW: forecast.low}
    if high is not None:
        fields[keys.MEM_STEPS_TO_WALL_HIGH] = float(high)
    return fields


@dataclass
class WatchdogRun:
    """The watchdog's state of one ``train()`` call (a segment of the run: an in-process re-size begins another)."""

    world: int
    on_mac: bool
    previous_mac: MacMemorySample | None = None           # the macOS signals of the previous step
    previous_retries: int | None = None                   # CUDA allocator retries at the previous step
    short: tuple[float, float] | None = None              # (the next step's need, the budget) when it cannot fit
    planned: int | None = None                            # the size of the step's largest micro-batch (fetched)
    most_rows: int = 0                                    # the largest micro-batch of a step of this segment
    reference: tuple[float, float, int] | None = None     # (peak, held between steps, size) of the last step
    shrinking: bool = False                               # a smaller micro-batch was granted, yet to begin


class MemoryWatchdog(PerfCallback):
    """Samples memory once per optimizer step, predicts the steps until the budget, and acts on a ladder.

    **What is measured** (``used``, the figure held against the budget): CUDA — the allocator's peak during the
    step (peak stats are reset every step); MPS — ``driver_allocated_memory`` (what Metal really holds, cache
    included); CPU — the process RSS. On macOS the kernel's pressure level, swap-outs and the compressor are read
    through ctypes (psutil's ``available`` and ``sin/sout`` mislead there).

    **Budget** (re-read every step): ``limit_gb`` if given, else ``budget_fraction`` × what this run can reach now,
    never above that fraction of the device's real limits (:func:`~hf_perf_callbacks.core.memory.budget_bytes`), so
    other processes and memory outside PyTorch's caching allocator count against the wall. A lower wall is believed
    at once, a higher one once it holds (:class:`~hf_perf_callbacks.core.memory.MovingWall`); each move is an event
    (console and perf log) saying why (with ``pynvml`` installed, which processes hold the card).

    **Ladder** (each rung logged as an event with its reason; :class:`~hf_perf_callbacks.core.memory.MemoryPolicy`):
    (1) clear caches — through the :class:`~hf_perf_callbacks.MPSCacheClearer` when attached, else the device cache
    clear; (2) ask for a smaller micro-batch on the bus (the adaptive batch tuner answers) where that helps; (3) at
    critical, or when the wall is ``stop_within_steps`` away with nothing else left: save a checkpoint at this step
    and stop (no optimizer step is lost), the message naming the causes. A steady leak goes down the same ladder.
    **The next step** is held against the budget as it is now, every step, and before it trains once its rows are
    fetched (:meth:`_next_step_need`, :meth:`_before_step`): when it cannot fit, a smaller micro-batch where something
    can re-size, else a checkpoint and a stop. The stop's checkpoint holds the whole training state also under
    ``save_only_model=True``. Under several ranks each rank watches its own device and a stop on any rank stops all.

    Args:
        limit_gb: absolute budget in GiB (overrides the fraction and the reading).
        budget_fraction: fraction of what the run can reach used as the budget, in (0, 1].
        warn_fraction: share of the budget at which the level becomes warn, in (0, 1].
        grace_steps: steps at the start of each ``train()`` without actions (first-step spikes).
        trend_window: steps in the growth fit (≥ 3).
        warn_within_steps / stop_within_steps: act when the wall is this many steps away.
        stop: allow the last rung (save and stop); False only warns.
        clock: the clock seam (:class:`~hf_perf_callbacks.common.base.Clock`; tests plant one).

    Logged keys:

    ================================  ======  ===================================================================
    key                               unit    meaning
    ================================  ======  ===================================================================
    ``mem/device_used_gb``            GiB     ``used`` (see above)
    ``mem/allocated_gb``              GiB     live tensors at the step end (CUDA/MPS/XPU)
    ``mem/driver_gb``                 GiB     MPS driver memory / CUDA reserved: the allocator's holding
    ``mem/peak_gb``                   GiB     high-water mark of ``used`` in this run
    ``mem/limit_gb``                  GiB     the budget of this step (it moves with what the run can reach)
    ``mem/outside_gb``                GiB     memory of the card (CUDA) or the machine (MPS, CPU) outside this run's
                                              reach: other processes; on CUDA also this process's memory outside
                                              PyTorch's caching allocator (context, NCCL, a vLLM pool); on MPS/CPU
                                              also the system's
    ``mem/system_available_gb``       GiB     psutil available RAM (macOS: ``inactive + free``; the pressure signals
                                              below decide there)
    ``mem/swap_used_gb``              GiB     swap in use (macOS: ``vm.swapusage``)
    ``mem/pressure``                  level   0 ok, 1 warn, 2 critical
    ``mem/steps_to_wall``             steps   steps until the budget at the fitted growth; absent when memory is
                                              not growing or the wall lies beyond the run's last step
    ``mem/steps_to_wall_low``         steps   lower end of its 95% range (growth as a random walk with drift:
                                              the slope's uncertainty and the next steps' randomness)
    ``mem/steps_to_wall_high``        steps   upper end, capped at the steps left in the run
    ``mem/growth_mb_per_step``        MiB     slope of the trend fit
    ``mem/completion_wall_tokens``    tokens  GRPO: the completion length at which a step's peak reaches the budget
                                              (the peak fitted as a line in the longest completion of each log);
                                              absent until the completions' lengths differ enough to fit it
    ``mem/os_pressure``               level   macOS kernel pressure: 1 normal, 2 warn, 4 critical
    ``mem/swapouts``                  pages   macOS swap-outs since the previous step
    ``mem/compressor_gb``             GiB     macOS compressor size
    ``mem/footprint_gb``              GiB     macOS process ``phys_footprint``
    ``mem/alloc_retries``             count   CUDA allocator retries since the previous step
    ================================  ======  ===================================================================
    """

    source = "mem"
    exchange_width = 2

    @arguments
    def __init__(self, limit_gb: float | None = None, budget_fraction: float = BUDGET_FRACTION,
                 warn_fraction: float = WARN_FRACTION, grace_steps: int = GRACE_STEPS, trend_window: int = TREND_WINDOW,
                 warn_within_steps: float = WARN_WITHIN_STEPS, stop_within_steps: float = STOP_WITHIN_STEPS,
                 stop: bool = True, clock: Clock | None = None):
        check_number("limit_gb", limit_gb, low=0, low_open=True, allow_none=True)
        check_number("budget_fraction", budget_fraction, low=0, high=1, low_open=True)
        check_flag("stop", stop)
        super().__init__(clock)
        self.limit_gb, self.budget_fraction, self.warn_fraction = limit_gb, budget_fraction, warn_fraction
        self.grace_steps, self.trend_window = grace_steps, trend_window
        self.warn_within_steps, self.stop_within_steps, self.stop = warn_within_steps, stop_within_steps, stop
        self._policy(1.0)                      # validates the policy parameters now, not at train time
        self.device: DeviceLayer | None = None           # at on_train_begin (a test may plant one before)
        self.policy: MemoryPolicy | None = None     # kept over the in-process resumes of one run
        self.wall = MovingWall()
        self.facts: WallFacts | None = None
        self.high_water = 0.0
        self.actions: list[WatchdogAction] = []
        self.stopped_at: int | None = None
        self.summary: WatchdogSummary | None = None
        self._announced_outside: float | None = None
        self._limit_warned = False
        self._sample: MemorySample | None = None        # the step's reading
        self._stop_watching_fetches: Callable[[], None] | None = None
        self._watching: object = None                            # the trainer whose fetches are watched
        self._only_model_set_aside = False               # save_only_model set aside for the stop's checkpoint
        self._sample_used = 0.0                          # the step's peak (before any cache clear)
        self._completions: CompletionTrend | None = None  # GRPO: peaks against the longest completions
        self._completion_limit: int | None = None        # GRPO: max_completion_length
        self._log_peak = 0.0                             # the highest step peak since the last training log
        self._completions_warned = False
        self.run: WatchdogRun | None = None              # this train() call's state (on_train_begin)

    _run: Made[WatchdogRun] = Made("run")
    _device: Made[DeviceLayer] = Made("device")
    _watch: Made[MemoryPolicy] = Made("policy")

    def _policy(self, budget: float) -> MemoryPolicy:
        return MemoryPolicy(budget=budget, warn_fraction=self.warn_fraction, grace_steps=self.grace_steps,
                            trend_window=self.trend_window, warn_within_steps=self.warn_within_steps,
                            stop_within_steps=self.stop_within_steps)

    # ------------------------------------------------------------ setup
    @hook
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.device = self.device or DeviceLayer()
        self.run = WatchdogRun(world=world_size(), on_mac=sys.platform == "darwin")
        self._run.previous_mac = self._mac_sample() if self._run.on_mac else None
        sample = self.device.memory()
        if self.policy is None or state.global_step == 0:        # a run of its own (an in-process resume keeps it)
            self.wall = MovingWall()
            self.budget = self._budget(sample)
            self.wall.update(self.budget)
            self.policy = self._policy(self.budget)
            self._announced_outside = sample.outside
            self._explain_start(sample, state.global_step)
        else:
            self._follow_wall(sample, state.global_step)
        self.policy.start_segment()
        limit = getattr(args, "max_completion_length", None) if is_grpo(args) else None
        if limit and (self._completions is None or state.global_step == 0):
            self._completions, self._completion_limit, self._completions_warned = CompletionTrend(), limit, False
        trainer = adapter.calling_trainer()
        if trainer is not None and self._watching is not trainer:
            self.close()
            self._stop_watching_fetches = adapter.watch_batch_samples(trainer, self._before_step)
            self._watching = trainer
        self._note_facts(self._facts(sample))
        self.device.reset_peak()
        self._bus.log.describe_run(self.source, state.global_step, budget_gb=self.budget / GB,
                               device_limit_gb=(sample.device_limit or 0) / GB,
                               system_total_gb=sample.system_total / GB, warn_within_steps=self.warn_within_steps)

    def _budget(self, sample: MemorySample, static: bool = False) -> float:
        """The budget in bytes now (:func:`~hf_perf_callbacks.core.memory.budget_bytes` of the device's limits and of
        what this run can reach); ``static``: of the limits alone (what it was before it followed the free memory)."""
        return budget_bytes(self._device.type, sample.device_limit, sample.hard_limit, sample.system_total,
                            None if static else self.limit_gb, self.budget_fraction,
                            reachable=None if static else sample.reachable)

    def _explain_start(self, sample: MemorySample, step: int) -> None:
        """Say at the start when the budget of a card is set by what the run can reach (another process holds
        memory), or when ``limit_gb`` lies beyond it. Not on unified memory (MPS, CPU): there other processes and the
        system always hold part of the machine; a move during the run is said either way."""
        if self.limit_gb:
            self._check_limit(sample, step)
            return
        if sample.unified:
            return
        static = self._budget(sample, static=True)
        if self.budget < (1 - WALL_BAND) * static and self._facts(sample).outside_words() is not None:
            self._wall_event(step, f"the memory budget is {gib(self.budget)}, not {gib(static)} "
                                   f"({self.budget_fraction:.0%} of the device's limit)", sample, static, start=True)

    def _check_limit(self, sample: MemorySample, step: int) -> None:
        """``limit_gb`` overrides the reading; one warning when it lies beyond what the run can reach."""
        reach = sample.reachable
        if self._limit_warned or reach is None or self.budget <= reach:
            return
        self._limit_warned = True
        why = self._facts(sample).outside_words()
        self.warn(f"limit_gb={self.limit_gb:g} is above what this run can reach now ({gib(reach)})"
                  + (f": {why}" if why else "") + "; the watchdog keeps the given budget, so the device may run out "
                  "of memory before it", step=step)

    def _follow_wall(self, sample: MemorySample, step: int) -> None:
        """Move the budget with what the run can reach (see :class:`~hf_perf_callbacks.core.memory.MovingWall`)."""
        if self.limit_gb:
            self._check_limit(sample, step)
            return
        before = self.wall.update(self._budget(sample))
        if before is None or self.wall.value is None:
            return
        self.budget = self.wall.value
        self._watch.set_budget(self.budget)
        self._wall_event(step, f"the memory wall moved: the budget is now {gib(self.budget)} (was {gib(before)})",
                         sample, before)

    def _wall_event(self, step: int, headline: str, sample: MemorySample, before: float, start: bool = False) -> None:
        """One event (console and perf log) saying where the wall is and why (``start``: where it is at the start)."""
        outside, reach, total = sample.outside, sample.reachable, sample.total
        facts = self._facts(sample, holders=True)
        why = facts.outside_words()
        if why is None and outside is not None and self._announced_outside is not None and not start:
            why = (f"memory outside this run's reach is {outside / GB:.1f} GiB (was "
                   f"{self._announced_outside / GB:.1f} GiB)")
        elif why is None and sample.allocator_cap is not None and reach == sample.allocator_cap:
            why = f"PyTorch's per-process memory fraction caps this process at {gib(sample.allocator_cap)}"
        self._announced_outside = outside
        reach_words = (f"; the budget is {self.budget_fraction:.0%} of the {gib(reach)} this run can reach"
                       + (f" ({gib(total)} in all)" if total else "") if reach is not None else "")
        self._bus.log.event(self.source, "wall", headline + (f": {why}" if why else "") + reach_words, step=step,
                        details=WallMove(why=why, moved=not start, budget_gb=self.budget / GB, before_gb=before / GB,
                                         outside_gb=outside / GB if outside is not None else None,
                                         reachable_gb=reach / GB if reach is not None else None))

    def _note_facts(self, facts: WallFacts) -> None:
        """The wall's facts now: this watchdog's, and the bus's for the tuner (one write for both)."""
        self.facts = facts
        self._bus.memory_facts = facts

    def _facts(self, sample: MemorySample, holders: bool = False) -> WallFacts:
        """What sets the wall now and what presses on it (``holders``: ask NVML who holds the card's memory)."""
        names = None
        if holders and sample.outside is not None and sample.total and not sample.unified:
            found = self._device.memory_holders()
            names = holders_words(found, os.getpid(), float(sample.reserved or 0)) if found else None
        policy = self.policy
        return WallFacts(budget=self.budget, total=sample.total, outside=sample.outside, unified=sample.unified,
                         holders=names, leak_per_step=policy.leak_rate if policy is not None else None)

    # ------------------------------------------------------------ per step
    @hook
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        policy = self._watch
        self._run.shrinking = False
        sample = self._device.memory()
        self._follow_wall(sample, step)
        micro = getattr(args, "per_device_train_batch_size", None)
        obs, fields = self._observe(step, sample, micro)
        policy.observe(obs)
        need = self._next_step_need(sample, obs.used)
        self._sample_used = obs.used
        self._log_peak = max(self._log_peak, obs.used)
        self._sample = sample
        if self._completions is not None and self._completion_limit:
            policy.follow_completions(self._completions.forecast(self.budget, self._completion_limit, step),
                                      self._completions.explains())
        self._note_facts(self._facts(sample))
        self.high_water = max(self.high_water, obs.used)
        can_shrink = self._bus.requests.can_shrink()
        decision = policy.next_action(can_shrink)
        if decision == CLEAR:              # clear → re-sample → maybe the next rung (never a second clear)
            policy.taken(CLEAR)
            self._clear(step)
            obs, fields = self._observe(step, self._device.memory(), micro, resample=True)
            policy.observe(obs, replace_last=True)
            decision = policy.next_action(can_shrink)
        self._run.short = None
        if need >= self.budget and policy.segment_steps > policy.grace_steps and decision is None:
            # the next step cannot fit in the budget as it is now (not as a residency re-sampled after a clear says)
            self._run.short = (need, self.budget)
            shrinkable = can_shrink and (micro or 1) > 1 and SMALLER_BATCH not in policy.episode
            decision = SMALLER_BATCH if shrinkable else STOP if STOP not in policy.episode else None
        if decision is not None:
            policy.taken(decision)
        critical = policy.level == CRITICAL or self._run.short is not None
        self._bus.memory = MemoryReading(step, obs.used, self.budget)   # the tuner reads it, whenever the exchange ends
        self._exchange(step, [RANK_OF[decision], float(critical)],     # the step's one exchange
                       lambda rows: self._step_ended(args, state, control, decision, fields, rows))

    def _step_ended(self, args: Any, state: Any, control: Any, local: str | None, fields: dict[str, float | None],
                    rows: Rows) -> None:
        """Act on the step once every rank's decision is known (``rows``), and log its figures."""
        step, policy = state.global_step, self._watch
        # ranks act together: the most conservative decision of any rank (stop > smaller batch > none), and whether
        # any rank is critical (``rows``: every rank's ``[RANK_OF[decision], critical]``; one row on one process)
        decision = ACTION_OF[int(max(r[0] for r in rows))]
        any_critical = max(r[1] for r in rows) > 0
        if decision == SMALLER_BATCH:
            why = self._short_words() or policy.reason()
            self._act(step, SMALLER_BATCH, "asked for a smaller micro-batch: " + why)
            accepted = any(self._bus.requests.ask_smaller_batch(why, step, control))
            self._run.shrinking = accepted          # the re-size comes at the next step's begin: its fetch waits for it
            if not accepted and any_critical:   # nobody can shrink (the same answer on every rank)
                decision = STOP
        if decision == STOP:
            self._stop(args, state, control, follower=local != STOP and local != SMALLER_BATCH)
        rate = policy.leak_rate                     # growth a step, within segments (across a tuning's switches)
        if policy.leaking and rate is not None and not policy.leak_reported:
            policy.leak_reported = True
            forecast = policy.steps_to_wall
            plan = (f"the watchdog clears caches when the wall is {self.warn_within_steps:g} steps away and saves "
                    f"a checkpoint and stops {self.stop_within_steps:g} steps before it"
                    + (f" (the wall is {forecast:.0f} steps away now)" if forecast is not None else "")
                    if self.stop else "stop=False: the watchdog will only warn")
            self.warn(f"memory grew by {mib(rate)} a step over the last {policy.trend_window} steps, whatever the "
                      f"split: a steady leak, e.g. tensors kept across steps (a loss appended without .item(), a "
                      f"growing cache); a smaller micro-batch does not stop it: {plan}", step=step,
                      figures=WarningFigures(leak_mib_per_step=rate / 2**20))
        fields[keys.MEM_PRESSURE] = policy.level
        fields.update(wall_fields(policy.forecast(), state.max_steps - step if state.max_steps > 0 else None))
        # a forecast of an earlier step must not reach this step's log
        self._bus.merger.withdraw(*(key for key in WALL_KEYS if key not in fields))
        slope = policy.slope                        # None before the segment holds 3 steps
        if slope is not None:
            fields[keys.MEM_GROWTH_MB_PER_STEP] = slope / 1024**2
        wall_length = self._completions.wall_length(self.budget) if self._completions is not None else None
        if wall_length is not None:
            fields[keys.MEM_COMPLETION_WALL_TOKENS] = wall_length
        self._bus.log.record_step(step, fields)
        self._bus.merger.publish(fields)
        self._device.reset_peak()

    @hook
    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """GRPO: each training log's longest completion (TRL's ``completions/max_length``) against the highest step
        peak since the last log; once the completions' growth brings the wall within the run, one warning says at
        which completion length a step stops fitting."""
        length = (logs or {}).get("completions/max_length")
        if self._completions is None or not isinstance(length, (int, float)) or self._log_peak <= 0:
            return
        self._completions.add(state.global_step, length, self._log_peak)
        self._log_peak = 0.0
        forecast = self._completions.forecast(self.budget, self._completion_limit or 0, state.global_step)
        left = state.max_steps - state.global_step if state.max_steps > 0 else None
        if forecast is None or self._completions_warned or (left is not None and forecast.steps > left):
            return
        self._completions_warned = True
        wall = self._completions.wall_length(self.budget) or 0.0
        per_step = forecast.slope / (self._completions.line() or (0.0, 1.0))[1]
        self.warn(f"completions grow {per_step:.1f} tokens a step (longest {length:.0f}): a step stops fitting the "
                  f"budget at about {wall:.0f} tokens (max_completion_length={self._completion_limit}), "
                  f"{forecast.steps:.0f} steps away", step=state.global_step,
                  figures=WarningFigures(completion_wall_tokens=wall, steps_to_wall=forecast.steps))

    def _completion_words(self) -> str | None:
        """Why the wall is near when the completions' growth brings it (None otherwise)."""
        policy = self._watch
        near, trend = policy.steps_to_wall, policy.completions
        if self._completions is None or trend is None or near is None or trend.steps > near + 1:
            return None
        wall = self._completions.wall_length(self.budget) or 0.0
        return (f"completions grow toward max_completion_length={self._completion_limit}, and a step stops fitting "
                f"at about {wall:.0f} tokens")

    def _short_words(self) -> str | None:
        """Why the next step cannot fit, in words (None when it can)."""
        if self._run.short is None:
            return None
        need, budget = self._run.short
        scaled = ", its activations at the longest rows" if need > self._sample_used else ""
        return (f"the next step needs about {gib(need)} (the last step's peak{scaled}) and the budget is now "
                f"{gib(budget)}")

    def _next_step_need(self, sample: MemorySample, used: float) -> float:
        """What the next step needs: this step's own peak, its part above what stays allocated between steps scaled
        to the largest micro-batch of this segment (padded rows × length, as fetched); the peak alone where the rows
        or the device's peak are unknown. Keeps this step as the reference of the check before the next step."""
        size, self._run.planned = self._run.planned, None
        if sample.peak is None or sample.allocated is None or not size:
            self._run.reference = None
            return used
        live = min(float(sample.allocated), used)
        self._run.reference = (used, live, size)
        self._run.most_rows = max(self._run.most_rows, size)
        return live + (used - live) * self._run.most_rows / size

    # ------------------------------------------------------------ before a step
    def _before_step(self, batches: list[Any], asked: int, num_items: Any = None) -> str | None:
        """The next optimizer step's rows are fetched and it has not trained yet (the training loop's
        ``get_batch_samples``, watched through :func:`~hf_perf_callbacks.platform.adapter.watch_batch_samples`): it
        needs the last step's peak, its part above what stays allocated scaled to these rows when they are longer,
        against the budget as the device reads now (a lower wall believed at once). When that cannot fit: a smaller
        micro-batch where something can re-size (before this step trains), else a checkpoint of the last completed
        step and a stop, this step untrained. Ranks decide together. A fault here is one warning, never the end of
        training."""
        trainer = adapter.calling_trainer()
        short = False
        if not self.disabled and trainer is not None and not self._bus.own_passes:
            try:
                short = self._short_before(batches, trainer.state.global_step)
            except Exception as error:  # noqa: BLE001 - the watchdog's own fault must not end training
                self._run.reference = None
                self.warn(f"the check before each step is off: {type(error).__name__}: {error}")
        if self._run.world > 1:
            short = any(r[0] > 0 for r in gather_floats([1.0 if short else 0.0], self._device.device))
        if not short or trainer is None:
            return None
        return self._act_before(trainer, batches)

    @staticmethod
    def _rows_size(batches: list[Any]) -> int | None:
        """The largest micro-batch's ``input_ids`` (rows × padded length); None where the batches hold none
        (GRPO's prompts, a custom batch)."""
        sizes = [int(b["input_ids"].numel()) for b in batches
                 if isinstance(b, Mapping) and hasattr(b.get("input_ids"), "numel")]
        return max(sizes) if sizes else None

    def _short_before(self, batches: list[Any], step: int) -> bool:
        size = self._rows_size(batches)
        self._run.planned = size
        reference, policy = self._run.reference, self._watch
        if reference is None or policy.segment_steps <= policy.grace_steps or self._run.shrinking:
            return False
        sample = self._device.memory()
        if not self.limit_gb and self._budget(sample) < self.budget:
            self._follow_wall(sample, step)                  # a lower wall is believed at once
        peak, live, seen = reference
        need = live + (peak - live) * max(1.0, (size or seen) / seen)
        if need < self.budget:
            return False
        self._run.short, self._sample = (need, self.budget), sample
        self._note_facts(self._facts(sample))
        return True

    def _act_before(self, trainer: Trainer, batches: list[Any]) -> str | None:
        """Act on a next step that cannot fit, before it trains (see :meth:`_before_step`)."""
        args, state, control, policy = trainer.args, trainer.state, trainer.control, self._watch
        step = state.global_step
        why = self._short_words() or "another rank's next step does not fit in its memory budget"
        micro = getattr(args, "per_device_train_batch_size", 1) or 1
        if (self._bus.requests.can_shrink() and micro > 1
                and SMALLER_BATCH not in policy.episode):
            policy.taken(SMALLER_BATCH)
            self._act(step, SMALLER_BATCH, f"asked for a smaller micro-batch before step {step + 1}: " + why)
            if any(self._bus.requests.ask_smaller_batch(why, step, control, rows=batches)):
                return adapter.SKIP_STEP if control.should_training_stop else None
        if STOP in policy.episode:
            return None
        policy.taken(STOP)
        self._stop(args, state, control, follower=self._run.short is None)
        return adapter.SKIP_STEP if control.should_training_stop else None

    def _observe(self, step: int, sample: MemorySample, micro: int | None = None,
                 resample: bool = False) -> tuple[Observation, dict[str, float | None]]:
        if resample and sample.peak is not None and sample.allocated is not None:
            used = float(sample.allocated)      # after a clear the high-water mark is history: what is allocated counts
        else:
            used = float(sample.used)
        retries = None
        if sample.alloc_retries is not None:
            if self._run.previous_retries is not None and not resample:
                retries = sample.alloc_retries - self._run.previous_retries
            self._run.previous_retries = sample.alloc_retries
        os_level = swapouts = None
        fields: dict[str, float | None] = {keys.MEM_DEVICE_USED_GB: used / GB, keys.MEM_LIMIT_GB: self.budget / GB,
                                           keys.MEM_PEAK_GB: max(self.high_water, used) / GB,
                                           keys.MEM_SYSTEM_AVAILABLE_GB: sample.system_available / GB,
                                           keys.MEM_SWAP_USED_GB: sample.swap_used / GB}
        for key, value in ((keys.MEM_OUTSIDE_GB, sample.outside), (keys.MEM_ALLOCATED_GB, sample.allocated),
                           (keys.MEM_DRIVER_GB, sample.reserved)):
            if value is not None:
                fields[key] = value / GB
        if retries is not None:
            fields[keys.MEM_ALLOC_RETRIES] = retries
        mac = self._mac_sample() if self._run.on_mac else None
        if mac is not None:
            swapouts = mac.swapouts_since(self._run.previous_mac) if self._run.previous_mac else None
            self._run.previous_mac = mac
            os_level = mac.pressure_level
            fields.update({keys.MEM_OS_PRESSURE: os_level, keys.MEM_SWAPOUTS: swapouts,
                           keys.MEM_COMPRESSOR_GB: mac.compressor_bytes / GB if mac.compressor_bytes else None,
                           keys.MEM_FOOTPRINT_GB: mac.phys_footprint_bytes / GB if mac.phys_footprint_bytes else None})
            if mac.swap_used_bytes is not None:
                fields[keys.MEM_SWAP_USED_GB] = mac.swap_used_bytes / GB
        obs = Observation(step, used, micro_batch=micro, os_level=os_level, swapouts=swapouts, alloc_retries=retries)
        return obs, fields

    def _mac_sample(self) -> MacMemorySample | None:
        """macOS signals; a reader that fails is dropped with one warning (the device figures still work)."""
        try:
            return self._device.mac.sample()
        except Exception as error:  # noqa: BLE001
            self._run.on_mac = False
            self.warn(f"macOS pressure signals unavailable ({type(error).__name__}: {error}); watching device "
                      f"memory only")
            return None

    # ------------------------------------------------------------ actions
    def _clear(self, step: int) -> None:
        answers = self._bus.requests.ask_clear(self._watch.reason(), step)
        if not answers:                       # no clearer attached: do the cheap part ourselves
            self._device.empty_cache()
        self._act(step, CLEAR, "cleared caches: " + self._watch.reason())

    def _stop(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
              follower: bool = False) -> None:
        reason = self._stop_reason(follower)
        if not self.stop:
            self._act(state.global_step, "stop_suppressed", "would stop (stop=False): " + reason)
            return
        control.should_save = True
        control.should_training_stop = True
        if getattr(args, "save_only_model", False):
            args.save_only_model = False        # the stop's checkpoint holds the whole training state: the resume
            self._only_model_set_aside = True   # below restores the schedule, the optimizer and the RNG (on_save)
        self.stopped_at = state.global_step
        checkpoint = f"{args.output_dir}/checkpoint-{state.global_step}"
        tuning = self._bus.tuning
        resume = (f"train_with_tuning(trainer, resume_from_checkpoint='{checkpoint}')"
                  if tuning is not None and tuning.managed else f"trainer.train(resume_from_checkpoint='{checkpoint}')")
        outside = self._sample.outside if self._sample is not None else None
        short, after = self._run.short if not follower else None, self._resume_after()
        self._act(state.global_step, STOP,
                  f"stopped training at step {state.global_step} before running out of memory ({reason})."
                  f" A checkpoint is saved to {checkpoint}; no step is lost. Resume with {resume} {after}.",
                  stop=StopFigures(outside_gb=outside / GB if outside is not None else None,
                                   need_gb=short[0] / GB if short is not None else None, budget_gb=self.budget / GB))

    def _stop_reason(self, follower: bool) -> str:
        """Why the run stops: the policy's reason (or the step that falls short, or the leader's stop), what holds
        the memory and why no smaller micro-batch was asked for."""
        policy = self._watch
        reason = ("another rank is about to run out of memory; this rank stops with it, at the same step"
                  if follower else policy.reason())
        if not follower and self._run.short is not None:
            reason = self._short_words() or reason
        elif not follower and (growth := self._completion_words()):
            reason = f"{reason}: {growth}"
        if self._sample is not None:                        # the stop names who holds the memory, where NVML can say
            self._note_facts(self._facts(self._sample, holders=True))
        causes = self.facts.sentence() if self.facts is not None else ""
        futile = policy.shrink_futile() if self._bus.requests.can_shrink() else None
        if causes:
            reason += f"; the causes: {causes}"
        if futile:
            reason += f"; no smaller micro-batch was asked for: {futile}"
        return reason

    def _resume_after(self) -> str:
        """What to change before resuming: the leak fixed, the memory outside the run freed, or less memory used."""
        lower = ("a smaller per_device_train_batch_size with a larger gradient_accumulation_steps, activation "
                 "checkpointing, or a shorter max_completion_length (GRPO)")
        if self.facts is not None and self.facts.leak_per_step:
            return ("after fixing the leak (memory that grows on every step: tensors kept across steps, e.g. a loss "
                    "appended without .item(), a growing cache); a smaller micro-batch does not stop it")
        if self.facts is not None and self.facts.outside_words():
            return f"once the memory held outside this run is freed, or with less memory: {lower}"
        return f"after freeing memory: {lower}"

    def _act(self, step: int, action: str, message: str, stop: StopFigures | None = None) -> None:
        """Record and log an action (``stop``: the stop's figures; its event's kind is ``stop``)."""
        self.actions.append(WatchdogAction(step=step, action=action, message=message))
        details = ActionDetails(action=action, level=LEVEL_NAMES[self._watch.level],
                                steps_to_wall=self._watch.steps_to_wall, stop=stop)
        self._bus.log.event(self.source, "stop" if stop is not None else "action", message, step=step, details=details)

    @hook
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._restore_only_model(args)

    def _restore_only_model(self, args: TrainingArguments) -> None:
        """Give ``save_only_model`` back once the stop's checkpoint is written."""
        if self._only_model_set_aside:
            args.save_only_model, self._only_model_set_aside = True, False

    # ------------------------------------------------------------ end
    @hook
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._restore_only_model(args)
        self.close()
        self.summary = {"high_water_gb": self.high_water / GB, "budget_gb": self.budget / GB,
                        "actions": list(self.actions), "stopped_at": self.stopped_at}
        self._bus.log.write_summary(self.source, self.summary)
        if state.is_world_process_zero and not self._bus.continuing:    # printed once, at the run's end
            self._bus.console.say(self.format_summary())

    def close(self) -> None:
        if self._stop_watching_fetches is not None:
            self._stop_watching_fetches()
        self._stop_watching_fetches = self._watching = None

    def format_summary(self) -> str:
        s = self.summary
        if s is None:
            raise RuntimeError("MemoryWatchdog has no summary yet: it writes one at on_train_end")
        lines = ["== MemoryWatchdog summary ==",
                 f"high-water mark: {s['high_water_gb']:.2f} GiB of a {s['budget_gb']:.2f} GiB budget "
                 f"({s['high_water_gb'] / s['budget_gb']:.0%})"]
        lines += [f"step {a['step']}: {a['action']} — {a['message']}" for a in s["actions"]] or ["no actions needed"]
        return "\n".join(lines)

    def start_fresh(self) -> None:
        self.high_water, self.actions, self.stopped_at, self.summary = 0.0, [], None, None
        self.policy, self._limit_warned = None, False

    def export(self) -> dict[str, Any]:
        return {"high_water": self.high_water, "actions": self.actions}

    def load(self, saved: dict[str, Any]) -> None:
        if not self.actions:            # a new process; in-process resumes keep their own (newer) history
            self.high_water = saved.get("high_water", 0.0)
            self.actions = list(saved.get("actions", []))
