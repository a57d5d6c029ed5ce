"""MPSCacheClearer: clear the allocator cache when it pays, not every step."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import keys
from .common.base import Clock, Made, PerfCallback, arguments, hook
from .core.memory import ClearSchedule
from .core.runlog import CacheClear, ClearerSummary
from .core.validation import check_flag, check_number
from .platform.device import GB, DeviceLayer

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments


class MPSCacheClearer(PerfCallback):
    """Runs ``gc.collect()`` and the device cache clear (plus ``torch.mps.clear_graph_cache`` where it exists)
    when it pays: on the watchdog's request, every ``interval_steps`` (backing off), after eval and checkpoint
    saves, and after a step whose driver memory far exceeds live tensors (GRPO generation leaves a large cache).

    Every clear is measured: bytes freed (driver/reserved memory before − after) and seconds spent. A periodic or
    bloat clear that frees less than ``min_freed_gb`` doubles the interval (up to ``max_interval``); one that
    frees at least four times that halves it (down to ``min_interval``). Clearing every step is what hurts MPS
    and CUDA performance; this does not.

    On CUDA, XPU and CPU it does nothing unless ``enabled=True`` (a CUDA ``empty_cache`` every step slows
    training); the watchdog then clears on its own when it needs to.

    Args:
        enabled: None = on for MPS only; True/False to force.
        interval_steps: initial steps between periodic clears.
        min_interval / max_interval: bounds of the back-off.
        min_freed_gb: a clear freeing less than this is "not worth it".
        bloat_ratio / bloat_min_gb: clear when driver > ``bloat_ratio`` × live and the gap ≥ ``bloat_min_gb``.
        after_eval / after_save: clear after evaluation and checkpoint saves.
        clock: the clock seam (:class:`~hf_perf_callbacks.common.base.Clock`; tests plant one).

    Logged keys:

    ======================  =====  ==========================================================
    key                     unit   meaning
    ======================  =====  ==========================================================
    ``cache/clears``        count  clears so far in this run
    ``cache/freed_gb``      GiB    memory freed by clears since the last log
    ``cache/seconds``       s      time spent clearing since the last log
    ``cache/interval``      steps  current periodic interval (after back-off)
    ======================  =====  ==========================================================
    """

    source = "cache"

    @arguments
    def __init__(self, enabled: bool | None = None, interval_steps: int = 50, min_interval: int = 10,
                 max_interval: int = 400, min_freed_gb: float = 0.1, bloat_ratio: float = 1.5,
                 bloat_min_gb: float = 0.5, after_eval: bool = True, after_save: bool = True,
                 clock: Clock | None = None) -> None:
        check_flag("enabled", enabled, allow_none=True)
        check_flag("after_eval", after_eval)
        check_flag("after_save", after_save)
        check_number("bloat_ratio", bloat_ratio, low=1)
        check_number("min_freed_gb", min_freed_gb, low=0)
        check_number("bloat_min_gb", bloat_min_gb, low=0)
        super().__init__(clock)
        self.enabled, self.interval_steps, self.min_interval, self.max_interval = (enabled, interval_steps,
                                                                                   min_interval, max_interval)
        self.min_freed_gb, self.bloat_ratio, self.bloat_min_gb = min_freed_gb, bloat_ratio, bloat_min_gb
        self.after_eval, self.after_save = after_eval, after_save
        self.device: DeviceLayer | None = None  # at on_train_begin (a test may plant one before)
        self.active = False                     # whether this train() call clears (decided at on_train_begin)
        self._window = [0.0, 0.0]               # freed bytes and seconds since the last log
        self.start_fresh()

    _device: Made[DeviceLayer] = Made("device")

    @hook
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.device = self.device or DeviceLayer()
        self.active = self.device.type == "mps" if self.enabled is None else bool(self.enabled)
        if self.active:
            self._bus.requests.on_clear_request(self._on_request)     # a bound method: one handler per class
        self.schedule.last_clear_step = state.global_step

    def _on_request(self, reason: str, step: int) -> float:
        return self.clear(step, f"watchdog: {reason}", automatic=False)

    def clear(self, step: int, reason: str, automatic: bool = True) -> float:
        """Clear now; returns bytes freed (never negative)."""
        device = self._device
        before = device.memory().reserved or 0
        start = self.clock.wall()
        device.empty_cache()
        device.synchronize()
        seconds = self.clock.wall() - start
        freed = max(0.0, float(before - (device.memory().reserved or 0)))
        self.schedule.cleared(step, freed, automatic)
        self.clears += 1
        self.total_freed += freed
        self.total_seconds += seconds
        self._window[0] += freed
        self._window[1] += seconds
        self.history.append({"step": step, "reason": reason, "freed_gb": freed / GB, "seconds": seconds,
                             "interval": self.schedule.interval})
        self._bus.log.event(self.source, "info", f"cleared cache ({reason}): freed {freed / GB:.3f} GB in "
                        f"{seconds * 1000:.0f} ms; next periodic clear in {self.schedule.interval} steps",
                        step=step, details=CacheClear(freed_gb=freed / GB, seconds=seconds))
        return freed

    @hook
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self.active:
            return
        step = state.global_step
        if self.schedule.due(step):
            self.clear(step, "periodic")
        elif self.schedule.gap_ok(step) and self._bloated():
            self.clear(step, "driver memory far above live tensors")
        fields = {keys.CACHE_CLEARS: self.clears, keys.CACHE_FREED_GB: self._window[0] / GB,
                  keys.CACHE_SECONDS: self._window[1], keys.CACHE_INTERVAL: self.schedule.interval}
        self._bus.log.record_step(step, fields)
        if control.should_log:
            self._bus.merger.publish(fields)
            self._window = [0.0, 0.0]

    def _bloated(self) -> bool:
        sample = self._device.memory()
        live, held = sample.allocated or 0, sample.reserved or 0
        return held - live >= self.bloat_min_gb * GB and held > self.bloat_ratio * live

    @hook
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.active and self.after_eval:
            self.clear(state.global_step, "after eval", automatic=False)

    @hook
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.active and self.after_save:
            self.clear(state.global_step, "after checkpoint save", automatic=False)

    @hook
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        summary: ClearerSummary = {"clears": self.clears, "freed_gb": self.total_freed / GB,
                                   "seconds": self.total_seconds, "interval": self.schedule.interval}
        self._bus.log.write_summary(self.source, summary)

    def start_fresh(self) -> None:
        self.schedule = ClearSchedule(self.interval_steps, self.min_interval, self.max_interval,
                                      self.min_freed_gb * GB)
        self.clears, self.total_freed, self.total_seconds, self._window = 0, 0.0, 0.0, [0.0, 0.0]
        self.history: list[dict[str, float | str]] = []

    def export(self) -> dict[str, float]:
        return {"clears": self.clears, "freed": self.total_freed, "seconds": self.total_seconds,
                "interval": self.schedule.interval}

    def load(self, saved: dict[str, Any]) -> None:                 # what export() wrote, read back from JSON
        self.clears = saved.get("clears", 0)
        self.total_freed = saved.get("freed", 0.0)
        self.total_seconds = saved.get("seconds", 0.0)
        self.schedule.interval = saved.get("interval", self.schedule.interval)
