"""MemoryWatchdog: see the memory wall coming and act before the OS swaps or kills the run; lose nothing."""
from __future__ import annotations

import sys

from . import runlog as keys
from .base import Clock, PerfCallback
from .bus import SIGNAL_CLEAR, SIGNAL_SMALLER_BATCH
from .device import GB, DeviceLayer, gather_floats, world_size
from .memory import (
    BUDGET_FRACTION,
    CLEAR,
    CRITICAL,
    LEVEL_NAMES,
    SMALLER_BATCH,
    STOP,
    MemoryPolicy,
    Observation,
    budget_bytes,
)
from .validation import check_flag, check_number

WALL_KEYS = (keys.MEM_STEPS_TO_WALL, keys.MEM_STEPS_TO_WALL_LOW, keys.MEM_STEPS_TO_WALL_HIGH)


def wall_fields(forecast, remaining: int | None) -> dict:
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


class MemoryWatchdog(PerfCallback):
    """Samples memory once per optimizer step, predicts the steps until the budget, and acts on a ladder.

    **What is measured** (``used``, the figure held against the budget): CUDA — the allocator's peak during the
    step (peak stats are reset every step); MPS — ``driver_allocated_memory`` (what Metal really holds, cache
    included); CPU — the process RSS. On macOS the kernel's pressure level, swap-outs and the compressor are read
    through ctypes (psutil's ``available`` and ``sin/sout`` mislead there).

    **Budget:** ``limit_gb`` if given, else ``budget_fraction`` × the smallest real limit: device memory (CUDA),
    the recommended working set, the watermark hard limit and physical RAM (MPS), physical RAM (CPU).

    **Ladder** (each rung logged as an event with its reason): (1) clear caches — through the
    :class:`~hf_perf_callbacks.MPSCacheClearer` when attached, else ``gc.collect()`` and the device cache clear;
    (2) ask for a smaller micro-batch on the bus (``smaller_batch``; the adaptive batch tuner answers);
    (3) at critical, or when the wall is ``stop_within_steps`` away with nothing else left: set
    ``control.should_save`` and ``control.should_training_stop`` — the checkpoint is written at this step, so no
    optimizer step is lost. Under several ranks each rank watches its own device and a stop on any rank stops all.

    Args:
        limit_gb: absolute budget in GB (overrides the fraction).
        budget_fraction: fraction of the smallest real limit used as the budget, in (0, 1].
        warn_fraction: share of the budget at which the level becomes warn, in (0, 1].
        grace_steps: steps at the start of each ``train()`` without actions (first-step spikes).
        trend_window: steps in the growth fit (≥ 3).
        warn_within_steps / stop_within_steps: act when the wall is this many steps away.
        stop: allow the last rung (save and stop); False only warns.
        clock: the clock seam (:class:`~hf_perf_callbacks.base.Clock`; tests plant one).

    Logged keys:

    ============================  ======  ===================================================================
    key                           unit    meaning
    ============================  ======  ===================================================================
    ``mem/device_used_gb``        GB      ``used`` (see above)
    ``mem/allocated_gb``          GB      live tensors at the step end (CUDA/MPS/XPU)
    ``mem/driver_gb``             GB      MPS driver memory / CUDA reserved: the allocator's holding
    ``mem/peak_gb``               GB      high-water mark of ``used`` in this run
    ``mem/limit_gb``              GB      the budget
    ``mem/system_available_gb``   GB      psutil available RAM (not trusted for decisions on macOS)
    ``mem/swap_used_gb``          GB      swap in use (macOS: ``vm.swapusage``)
    ``mem/pressure``              level   0 ok, 1 warn, 2 critical
    ``mem/steps_to_wall``         steps   steps until the budget at the fitted growth; absent when memory is
                                          not growing or the wall lies beyond the run's last step
    ``mem/steps_to_wall_low``     steps   lower end of its 95% range (growth as a random walk with drift:
                                          the slope's uncertainty and the next steps' randomness)
    ``mem/steps_to_wall_high``    steps   upper end, capped at the steps left in the run
    ``mem/growth_mb_per_step``    MB      slope of the trend fit
    ``mem/os_pressure``           level   macOS kernel pressure: 1 normal, 2 warn, 4 critical
    ``mem/swapouts``              pages   macOS swap-outs since the previous step
    ``mem/compressor_gb``         GB      macOS compressor size
    ``mem/footprint_gb``          GB      macOS process ``phys_footprint``
    ``mem/alloc_retries``         count   CUDA allocator retries since the previous step
    ============================  ======  ===================================================================
    """

    source = "mem"
    exchange_width = 2

    def __init__(self, limit_gb: float | None = None, budget_fraction: float = BUDGET_FRACTION,
                 warn_fraction: float = 0.9, grace_steps: int = 2, trend_window: int = 8, warn_within_steps: float = 20,
                 stop_within_steps: float = 3, stop: bool = True, clock: Clock | None = None):
        check_number("limit_gb", limit_gb, low=0, low_open=True, allow_none=True)
        check_number("budget_fraction", budget_fraction, low=0, high=1, low_open=True)
        check_flag("stop", stop)
        super().__init__(clock)
        self.limit_gb, self.budget_fraction, self.warn_fraction = limit_gb, budget_fraction, warn_fraction
        self.grace_steps, self.trend_window = grace_steps, trend_window
        self.warn_within_steps, self.stop_within_steps, self.stop = warn_within_steps, stop_within_steps, stop
        self._policy(1.0)                      # validates the policy parameters now, not at train time
        self.device: DeviceLayer | None = None
        self.high_water = 0.0
        self.actions: list[dict] = []
        self.stopped_at: int | None = None
        self.summary: dict | None = None

    @property
    def _device(self) -> DeviceLayer:
        """The device watched, set at ``on_train_begin`` (or planted before it by a test)."""
        if self.device is None:
            raise RuntimeError("MemoryWatchdog has no device yet: it takes one at on_train_begin")
        return self.device

    def _policy(self, budget: float) -> MemoryPolicy:
        return MemoryPolicy(budget=budget, warn_fraction=self.warn_fraction, grace_steps=self.grace_steps,
                            trend_window=self.trend_window, warn_within_steps=self.warn_within_steps,
                            stop_within_steps=self.stop_within_steps)

    # ------------------------------------------------------------ setup
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.device = self.device or DeviceLayer()
        self.world = world_size()
        self.on_mac = sys.platform == "darwin"
        self._previous_mac = self._mac_sample() if self.on_mac else None
        self._previous_retries = None
        sample = self.device.memory()
        self.budget = self.budget_bytes(self.device, sample)
        self.policy = self._policy(self.budget)
        self.policy.start_segment()
        self.device.reset_peak()
        self._bus.describe_run(self.source, state.global_step, budget_gb=self.budget / GB,
                               device_limit_gb=(sample.device_limit or 0) / GB,
                               system_total_gb=sample.system_total / GB)

    def budget_bytes(self, device: DeviceLayer, sample=None) -> float:
        """The budget in bytes on ``device`` (:func:`~hf_perf_callbacks.memory.budget_bytes` of its limits)."""
        sample = sample or device.memory()
        return budget_bytes(device.type, sample.device_limit, sample.hard_limit, sample.system_total,
                            self.limit_gb, self.budget_fraction)

    # ------------------------------------------------------------ per step
    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        obs, fields = self._observe(step)
        self.policy.observe(obs)
        self.high_water = max(self.high_water, obs.used)
        can_shrink = self._bus.has_subscribers(SIGNAL_SMALLER_BATCH)
        decision = None
        for _ in range(3):                                          # clear → re-sample → maybe the next rung
            action = self.policy.next_action(can_shrink)
            if action is None:
                break
            self.policy.taken(action)
            if action == CLEAR:
                self._clear(step)
                obs, fields = self._observe(step, resample=True)
                self.policy.observe(obs, replace_last=True)
                continue
            decision = action
            break
        local = decision
        self.collective_step = step
        decision, any_critical = self._agree(decision, self.policy.level == CRITICAL)
        if decision == SMALLER_BATCH:
            self._act(step, SMALLER_BATCH, "asked for a smaller micro-batch: " + self.policy.reason())
            accepted = any(self._bus.signal(SIGNAL_SMALLER_BATCH, reason=self.policy.reason(), step=step,
                                            control=control))
            if not accepted and any_critical:   # nobody can shrink (the same answer on every rank)
                decision = STOP
        if decision == STOP:
            self._stop(args, state, control, follower=local != STOP and local != SMALLER_BATCH)
        slope = self.policy.slope                   # None before the trend window holds 3 steps (a leak needs it full)
        if self.policy.leaking and slope is not None and not self.policy.leak_reported:
            self.policy.leak_reported = True
            self.warn(f"memory grew on each of the last {self.policy.trend_window} steps "
                      f"(+{slope / 1024**2:.1f} MB/step): a steady leak, e.g. tensors kept across "
                      f"steps (a loss appended without .item(), a growing cache)", step=step)
        fields[keys.MEM_PRESSURE] = self.policy.level
        fields.update(wall_fields(self.policy.forecast(), state.max_steps - step if state.max_steps > 0 else None))
        # a forecast of an earlier step must not reach this step's log
        self._bus.withdraw(*(key for key in WALL_KEYS if key not in fields))
        if slope is not None:
            fields[keys.MEM_GROWTH_MB_PER_STEP] = slope / 1024**2
        self._bus.record_step(step, fields)
        self._bus.publish(fields)
        self._device.reset_peak()

    def _observe(self, step: int, resample: bool = False) -> tuple[Observation, dict]:
        sample = self._device.memory()
        if resample and sample.peak is not None and sample.allocated is not None:
            used = float(sample.allocated)      # after a clear the high-water mark is history: what is allocated counts
        else:
            used = float(sample.used)
        retries = None
        if sample.alloc_retries is not None:
            if self._previous_retries is not None and not resample:
                retries = sample.alloc_retries - self._previous_retries
            self._previous_retries = sample.alloc_retries
        os_level = swapouts = None
        fields: dict[str, float | None] = {keys.MEM_DEVICE_USED_GB: used / GB, keys.MEM_LIMIT_GB: self.budget / GB,
                                           keys.MEM_PEAK_GB: max(self.high_water, used) / GB,
                                           keys.MEM_SYSTEM_AVAILABLE_GB: sample.system_available / GB,
                                           keys.MEM_SWAP_USED_GB: sample.swap_used / GB}
        if sample.allocated is not None:
            fields[keys.MEM_ALLOCATED_GB] = sample.allocated / GB
        if sample.reserved is not None:
            fields[keys.MEM_DRIVER_GB] = sample.reserved / GB
        if retries is not None:
            fields[keys.MEM_ALLOC_RETRIES] = retries
        mac = self._mac_sample() if self.on_mac else None
        if mac is not None:
            delta = mac.delta_since(self._previous_mac) if self._previous_mac else None
            self._previous_mac = mac
            os_level = mac.pressure_level
            swapouts = delta.swapouts_delta if delta else None
            fields.update({keys.MEM_OS_PRESSURE: os_level, keys.MEM_SWAPOUTS: swapouts,
                           keys.MEM_COMPRESSOR_GB: mac.compressor_bytes / GB if mac.compressor_bytes else None,
                           keys.MEM_FOOTPRINT_GB: mac.phys_footprint_bytes / GB if mac.phys_footprint_bytes else None})
            if mac.swap_used_bytes is not None:
                fields[keys.MEM_SWAP_USED_GB] = mac.swap_used_bytes / GB
        obs = Observation(step, used, os_level=os_level, swapouts=swapouts, alloc_retries=retries)
        return obs, fields

    def _mac_sample(self):
        """macOS signals; a reader that fails is dropped with one warning (the device figures still work)."""
        try:
            return self._device.mac.sample()
        except Exception as error:  # noqa: BLE001
            self.on_mac = False
            self.warn(f"macOS pressure signals unavailable ({type(error).__name__}: {error}); watching device "
                      f"memory only")
            return None

    # ------------------------------------------------------------ actions
    def _agree(self, decision: str | None, critical: bool) -> tuple[str | None, bool]:
        """Ranks act together: the most conservative decision of any rank (stop > smaller batch > none), and
        whether any rank is critical; one exchange per step."""
        if self.world == 1:
            return decision, critical
        rank_of = {None: 0.0, SMALLER_BATCH: 1.0, STOP: 2.0}
        rows = gather_floats([rank_of[decision], float(critical)], self._device.device)
        return {0: None, 1: SMALLER_BATCH, 2: STOP}[int(max(r[0] for r in rows))], max(r[1] for r in rows) > 0

    def _clear(self, step: int) -> None:
        answers = self._bus.signal(SIGNAL_CLEAR, reason=self.policy.reason(), step=step)
        if not answers:                       # no clearer attached: do the cheap part ourselves
            self._device.empty_cache()
        self._act(step, CLEAR, "cleared caches: " + self.policy.reason())

    def _stop(self, args, state, control, follower: bool = False) -> None:
        reason = ("another rank is about to run out of memory; this rank stops with it, at the same step"
                  if follower else self.policy.reason())
        if not self.stop:
            self._act(state.global_step, "stop_suppressed", "would stop (stop=False): " + reason)
            return
        control.should_save = True
        control.should_training_stop = True
        self.stopped_at = state.global_step
        checkpoint = f"{args.output_dir}/checkpoint-{state.global_step}"
        tuning = self._bus.tuning
        resume = (f"train_with_tuning(trainer, resume_from_checkpoint='{checkpoint}')"
                  if tuning is not None and tuning.managed else f"trainer.train(resume_from_checkpoint='{checkpoint}')")
        self._act(state.global_step, STOP,
                  f"stopped training at step {state.global_step} before running out of memory ({reason})."
                  f" A checkpoint is saved to {checkpoint}; no step is lost. Resume with {resume} after freeing "
                  f"memory: a smaller per_device_train_batch_size with a larger gradient_accumulation_steps, "
                  f"activation checkpointing, or a shorter max_completion_length (GRPO).", kind="stop")

    def _act(self, step: int, action: str, message: str, kind: str = "action") -> None:
        self.actions.append({"step": step, "action": action, "message": message})
        self._bus.event(self.source, kind, message, step=step, action=action,
                        level=LEVEL_NAMES[self.policy.level], steps_to_wall=self.policy.steps_to_wall)

    # ------------------------------------------------------------ end
    def on_train_end(self, args, state, control, **kwargs):
        self.summary = {"high_water_gb": self.high_water / GB, "budget_gb": self.budget / GB,
                        "actions": list(self.actions), "stopped_at": self.stopped_at}
        self._bus.write_summary(self.source, self.summary)
        if state.is_world_process_zero and not self._bus.continuing:    # printed once, at the run's end
            print(self.format_summary())

    def format_summary(self) -> str:
        s = self.summary
        if s is None:
            raise RuntimeError("MemoryWatchdog has no summary yet: it writes one at on_train_end")
        lines = ["== MemoryWatchdog summary ==",
                 f"high-water mark: {s['high_water_gb']:.2f} GB of a {s['budget_gb']:.2f} GB budget "
                 f"({s['high_water_gb'] / s['budget_gb']:.0%})"]
        lines += [f"step {a['step']}: {a['action']} — {a['message']}" for a in s["actions"]] or ["no actions needed"]
        return "\n".join(lines)

    def start_fresh(self) -> None:
        self.high_water, self.actions, self.stopped_at, self.summary = 0.0, [], None, None

    def export(self) -> dict:
        return {"high_water": self.high_water, "actions": self.actions}

    def load(self, saved: dict) -> None:
        if not self.actions:            # a new process; in-process resumes keep their own (newer) history
            self.high_water = saved.get("high_water", 0.0)
            self.actions = list(saved.get("actions", []))
