"""MemoryWatchdog and MPSCacheClearer on real trainers (CPU): a planted leak is stopped with a checkpoint before
the budget, resume continues; MPS/macOS paths run against fakes of the documented APIs (this machine has no Apple
GPU or macOS): a scripted ``DeviceLayer`` of type "mps" and scripted ``MacMemorySample`` readings."""
import gc
import json
import os
import sys

import psutil
import pytest
import torch
from transformers import TrainerCallback

from hf_perf_callbacks import MemoryWatchdog, MPSCacheClearer, keys
from hf_perf_callbacks.common.base import PerfCallback, hook
from hf_perf_callbacks.platform.device import GB, DeviceLayer, MemorySample
from hf_perf_callbacks.platform.macos import MacMemorySample
from tests.conftest import make_grpo, make_trainer

LEAK = 24 * 1024**2


class Leak(TrainerCallback):
    """Keeps a new resident tensor alive every step (the classic: tensors kept across steps)."""

    def __init__(self):
        self.kept = []

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(LEAK // 4, dtype=torch.float32))


def perf_log(output_dir):
    return [json.loads(line) for line in open(os.path.join(output_dir, "perf_log.jsonl"))]


@pytest.mark.parametrize("kind", ["trainer", "grpo"])
def test_planted_leak_is_stopped_with_a_checkpoint_before_the_budget(tokenizer, tmp_path, kind):
    gc.collect()          # the baseline without earlier tests' garbage: freed later, it would delay the stop
    budget = psutil.Process().memory_info().rss + 16 * LEAK
    watchdog = MemoryWatchdog(limit_gb=budget / GB, grace_steps=2, trend_window=4, warn_within_steps=6,
                              stop_within_steps=3)
    make = make_trainer if kind == "trainer" else make_grpo
    trainer = make(tokenizer, tmp_path, [Leak(), watchdog], max_steps=60)
    trainer.train()

    stop = watchdog.stopped_at
    assert stop is not None and trainer.state.global_step == stop < 60
    assert os.path.isdir(tmp_path / f"checkpoint-{stop}")
    steps = [line for line in perf_log(tmp_path) if line["type"] == "step"]
    used_at_stop = steps[-1][keys.MEM_DEVICE_USED_GB] * GB
    assert used_at_stop < budget                                     # stopped before crossing
    countdown = [s[keys.MEM_STEPS_TO_WALL] for s in steps if keys.MEM_STEPS_TO_WALL in s][-4:]
    assert countdown == sorted(countdown, reverse=True)              # counts down
    events = [line for line in perf_log(tmp_path) if line["type"] == "event"]
    leak = [e for e in events if "steady leak" in e["message"]]
    assert len(leak) == 1 and leak[0]["step"] <= stop
    actions = [e["action"] for e in events if e.get("action")]
    assert actions[-2:] == ["clear_cache", "stop"]
    assert "resume_from_checkpoint" in events[-1]["message"]
    print(f"\n[{kind}] leak detected at step {leak[0]['step']}, stopped at step {stop}, "
          f"used {used_at_stop / GB:.3f} GB of a {budget / GB:.3f} GB budget")

    # resuming (leak fixed) continues at the next step
    resumed_watch = MemoryWatchdog(limit_gb=budget / GB + 1)
    resumed = make(tokenizer, tmp_path, [resumed_watch], max_steps=stop + 3)
    resumed.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{stop}"))
    after = [line["step"] for line in perf_log(tmp_path) if line["type"] == "step" and line["step"] > stop]
    assert after == [stop + 1, stop + 2, stop + 3]
    assert resumed_watch.actions == watchdog.actions                 # history survives the resume


class FakeMPS(DeviceLayer):
    """A DeviceLayer of type "mps" whose readings follow a script indexed by the trainer's step: a 16 GiB Mac whose
    recommended working set is 16 GiB (the watermark hard limit 27.2 GiB); other apps and the system hold
    ``others_gb`` (a number, or a function of the step), so the system can still give 16 GiB minus that minus the
    driver memory (unified memory: what Metal takes, the system no longer has)."""

    def __init__(self, driver_gb, live_gb=1.0, freed_gb=0.0, mac=None, others_gb=0.0):
        super().__init__("cpu")
        self.type = "mps"
        self.driver, self.live, self.freed, self.step = driver_gb, live_gb, freed_gb, 0
        self.others = others_gb
        self.extra_freed = 0.0
        self.clears = []
        if mac is not None:
            self.mac = mac

    def memory(self):
        driver = self.driver[min(self.step, len(self.driver) - 1)] - self.extra_freed
        others = self.others(self.step) if callable(self.others) else self.others
        available = max(0.0, 16 - others - driver)
        return MemorySample(allocated=int(self.live * GB), reserved=int(driver * GB), device_limit=int(16 * GB),
                            hard_limit=int(27.2 * GB), system_total=int(16 * GB), system_available=int(available * GB),
                            unified=True)

    def empty_cache(self):
        self.clears.append(self.step)
        freed = self.freed(self.step, len(self.clears)) if callable(self.freed) else self.freed
        self.extra_freed += freed

    def synchronize(self):
        pass

    def reset_peak(self):
        pass


class FakeMacReader:
    """Scripted macOS readings (pressure level and cumulative swap-outs per step)."""

    def __init__(self, device, levels, swapouts):
        self.device, self.levels, self.swapouts = device, levels, swapouts

    def sample(self):
        i = min(self.device.step, len(self.levels) - 1)
        return MacMemorySample(pressure_level=self.levels[i], swapouts=self.swapouts[i],
                               compressor_bytes=2 * GB, swap_used_bytes=self.swapouts[i] * 16384,
                               phys_footprint_bytes=9 * GB)


class StepClock(TrainerCallback):
    def __init__(self, device):
        self.device = device

    def on_step_begin(self, args, state, control, **kwargs):
        self.device.step = state.global_step + 1


def test_macos_pressure_then_swapping_clears_then_stops(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    device = FakeMPS(driver_gb=[6.0] * 10, freed_gb=0.5)
    device.mac = FakeMacReader(device, levels=[1, 1, 1, 1, 2, 2, 2, 2], swapouts=[0, 0, 0, 0, 0, 0, 40, 90])
    watchdog, clearer = MemoryWatchdog(grace_steps=1), MPSCacheClearer(interval_steps=50)
    watchdog.device = clearer.device = device
    trainer = make_trainer(tokenizer, tmp_path, [StepClock(device), watchdog, clearer], max_steps=20)
    trainer.train()
    assert watchdog.budget == pytest.approx(0.85 * 16 * GB)          # min(recommended, hard limit, RAM)
    actions = [(a["step"], a["action"]) for a in watchdog.actions]
    assert actions == [(4, "clear_cache"), (7, "stop")]               # warn → clear; swapping twice → stop
    assert device.clears == [4, 7]                                   # the clearer did it (and after the save)
    assert clearer.history[0]["reason"].startswith("watchdog: warn") and clearer.history[0]["freed_gb"] == 0.5
    assert trainer.state.global_step == 7 and os.path.isdir(tmp_path / "checkpoint-7")
    steps = {s["step"]: s for s in perf_log(tmp_path) if s["type"] == "step"}
    assert steps[4][keys.MEM_OS_PRESSURE] == 2 and steps[7][keys.MEM_SWAPOUTS] == 50
    assert steps[7][keys.MEM_PRESSURE] == 2 and steps[3][keys.MEM_PRESSURE] == 0
    assert steps[4][keys.MEM_FOOTPRINT_GB] == 9.0


def test_failing_macos_reader_degrades_to_device_memory(tokenizer, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sys, "platform", "darwin")
    device = FakeMPS(driver_gb=[6.0])

    class Broken:
        def sample(self):
            raise OSError("host_statistics64 failed")

    device.mac = Broken()
    watchdog = MemoryWatchdog()
    watchdog.device = device
    with caplog.at_level("WARNING", logger="hf_perf_callbacks"):
        make_trainer(tokenizer, tmp_path, [watchdog], max_steps=3).train()
    assert not watchdog.disabled and watchdog.high_water == 6.0 * GB
    assert sum("macOS pressure signals unavailable" in r.getMessage() for r in caplog.records) == 1
    reading = watchdog.bus.memory                   # handed on to the callbacks after it (the tuner's trials)
    assert (reading.step, reading.used, reading.budget) == (3, 6.0 * GB, watchdog.budget)


class FakeTuner(PerfCallback):
    """Stands in for the batch tuner: answers the watchdog's smaller-micro-batch request."""

    def __init__(self):
        super().__init__()
        self.requests = []

    @hook
    def on_train_begin(self, args, state, control, **kwargs):
        self.bus.requests.on_smaller_batch_request(self.shrink)

    def shrink(self, reason, step, **_):
        self.requests.append((step, reason))
        return True


def test_smaller_batch_request_reaches_a_subscriber_instead_of_stopping(tokenizer, tmp_path):
    device = FakeMPS(driver_gb=[20.0])                               # over budget from the start
    watchdog, tuner = MemoryWatchdog(grace_steps=1), FakeTuner()
    watchdog.device = device
    trainer = make_trainer(tokenizer, tmp_path, [StepClock(device), watchdog, tuner], max_steps=5)
    trainer.train()
    assert [(a["step"], a["action"]) for a in watchdog.actions][:2] == [(2, "clear_cache"), (2, "smaller_batch")]
    assert tuner.requests[0][0] == 2 and "critical" in tuner.requests[0][1]


def test_clearer_backs_off_when_clears_free_little(tokenizer, tmp_path):
    device = FakeMPS(driver_gb=[3.0] * 40, live_gb=2.9)
    device.freed = lambda step, n: 1.0 if n == 3 else 0.0            # useless clears but the third
    clearer = MPSCacheClearer(interval_steps=2, min_interval=1, max_interval=8, min_freed_gb=0.1)
    clearer.device = device
    make_trainer(tokenizer, tmp_path, [StepClock(device), clearer], max_steps=18).train()
    assert [(h["step"], h["interval"]) for h in clearer.history] == [(2, 4), (6, 8), (14, 4), (18, 8)]
    assert clearer.history[2]["freed_gb"] == 1.0 and clearer.clears == 4


def test_clearer_clears_bloated_driver_memory_after_a_gap(tokenizer, tmp_path):
    device = FakeMPS(driver_gb=[2.0, 2.0, 2.0, 6.0, 6.0, 6.0, 6.0], live_gb=2.0, freed_gb=4.0)
    clearer = MPSCacheClearer(interval_steps=50, min_interval=2)
    clearer.device = device
    make_trainer(tokenizer, tmp_path, [StepClock(device), clearer], max_steps=6).train()
    assert [h["reason"] for h in clearer.history] == ["driver memory far above live tensors"]
    assert clearer.history[0]["step"] == 3 and clearer.history[0]["freed_gb"] == 4.0


def test_clearer_is_inert_on_cpu_unless_enabled(tokenizer, tmp_path):
    clearer = MPSCacheClearer(interval_steps=10, min_interval=1)
    make_trainer(tokenizer, tmp_path, [clearer], max_steps=12).train()
    assert clearer.active is False and clearer.clears == 0
    forced = MPSCacheClearer(enabled=True, interval_steps=10, min_interval=1)
    make_trainer(tokenizer, tmp_path / "forced", [forced], max_steps=12).train()
    assert forced.clears == 1 and forced.history[0]["step"] == 10


@pytest.mark.parametrize("cls, bad", [(MemoryWatchdog, {"limit_gb": 0}), (MemoryWatchdog, {"budget_fraction": 2}),
                                      (MemoryWatchdog, {"trend_window": 1}), (MemoryWatchdog, {"stop": "no"}),
                                      (MemoryWatchdog, {"warn_fraction": 0}),
                                      (MemoryWatchdog, {"limit_gb": float("inf")}),
                                      (MemoryWatchdog, {"stop_within_steps": 30}),
                                      (MPSCacheClearer, {"interval_steps": 0}), (MPSCacheClearer, {"enabled": 1}),
                                      (MPSCacheClearer, {"bloat_ratio": 0.5}), (MPSCacheClearer, {"min_freed_gb": -1}),
                                      (MPSCacheClearer, {"max_interval": 5})])
def test_parameters_are_validated(cls, bad):
    with pytest.raises(ValueError, match=next(iter(bad)) if "max_interval" not in bad else "interval"):
        cls(**bad)


def test_steps_to_wall_is_absent_from_logs_once_memory_is_flat(tokenizer, tmp_path):
    """Growth for 5 steps, then flat (fake MPS readings): a log after the trend went flat carries no forecast of an
    earlier step, and the logged range brackets the point estimate."""
    device = FakeMPS(driver_gb=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0] + [7.0] * 20)
    watchdog = MemoryWatchdog(grace_steps=1, trend_window=3)
    watchdog.device = device
    trainer = make_trainer(tokenizer, tmp_path, [StepClock(device), watchdog], max_steps=16,
                           extra={"logging_steps": 4})
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert set(logs) == {4, 8, 12, 16}
    assert (logs[4][keys.MEM_STEPS_TO_WALL_LOW] <= logs[4][keys.MEM_STEPS_TO_WALL]
            <= logs[4][keys.MEM_STEPS_TO_WALL_HIGH])
    for step in (8, 12, 16):                             # flat since step 6: no stale value from step 6
        assert not any(k.startswith(keys.MEM_STEPS_TO_WALL) for k in logs[step]), logs[step]
    steps = {s["step"]: s for s in perf_log(tmp_path) if s["type"] == "step"}
    assert keys.MEM_STEPS_TO_WALL in steps[6] and not any(keys.MEM_STEPS_TO_WALL in steps[s] for s in range(7, 17))


def test_on_a_mac_other_apps_lower_the_budget_and_the_ladder_acts_on_the_new_one(tokenizer, tmp_path):
    """Unified memory (fake MPS readings): 6 GiB of Metal memory, flat; from step 4 other apps take 6 GiB of the
    16 GiB Mac. The budget falls from 85% of the recommended working set (13.6 GiB) to 85% of the 10 GiB the run can
    still reach (8.5 GiB) at the reading that shows it (a lower wall is believed at once), said with the cause;
    6 GiB stays under its warn level (7.65 GiB), so nothing is done. From step 8 they take 10 GiB: the budget is
    5.1 GiB, below what Metal holds: critical, so the watchdog clears and then saves and stops, naming the cause."""
    device = FakeMPS(driver_gb=[6.0], others_gb=lambda step: 0.0 if step < 4 else 6.0 if step < 8 else 10.0)
    watchdog = MemoryWatchdog(grace_steps=1)
    watchdog.device = device
    trainer = make_trainer(tokenizer, tmp_path, [StepClock(device), watchdog], max_steps=14)
    trainer.train()
    limits = {s["step"]: round(s[keys.MEM_LIMIT_GB], 2) for s in perf_log(tmp_path) if s["type"] == "step"}
    assert [limits[s] for s in (3, 4, 5, 7, 8)] == [13.6, 8.5, 8.5, 8.5, 5.1]
    moves = [e for e in perf_log(tmp_path) if e["type"] == "event" and e["kind"] == "wall"]
    assert [e["step"] for e in moves] == [4, 8]
    assert "other processes and the system hold 6.0 GiB of this machine's 16.0 GiB" in moves[0]["message"]
    assert [(a["step"], a["action"]) for a in watchdog.actions] == [(8, "clear_cache"), (8, "stop")]
    assert "other processes and the system hold 10.0 GiB" in watchdog.actions[-1]["message"]
    assert os.path.isdir(tmp_path / "checkpoint-8")
