"""AdaptiveBatchTuner and train_with_tuning on real trainers (CPU, tiny random Llama + LoRA).

Out-of-memory errors are planted with a forward pre-hook that raises the exact CUDA or MPS error text once the
micro-batch exceeds a size (the way Composer tests its OOM handling); the MPS device is a fake of the documented
``torch.mps`` readings (no Apple GPU here).
"""
import json
import os

import pytest
import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys, train_with_tuning
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.platform.device import GB, MemorySample
from hf_perf_callbacks.throughput import forward_entry
from tests.conftest import PlantedClock, make_grpo, make_trainer
from tests.faults import Fault, SampleRecorder, Trajectory, differences
from tests.test_watchdog import FakeMPS

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"
MPS_OOM = "MPS backend out of memory (MPS allocated: 17.80 GB, other allocations: 1.20 GB, max allowed: 18.13 GB)"


class PlantedOOM(TrainerCallback):
    """Raises an OOM from the forward pass of micro-batches larger than ``limit`` once ``armed_at`` steps ran
    (hooked on the model when :meth:`attach` is called, so the memory check meets it too): the training forward, its
    backward (``in_backward``) or the no-grad forwards of generation (``in_generation``); ``once``: one OOM only. A
    wall: the exactness check's own passes meet it too (``raised`` counts the training's, ``in_check`` theirs)."""

    def __init__(self, limit, text, armed_at=0, in_backward=False, in_generation=False, once=False):
        self.limit, self.text, self.armed_at, self.raised, self.step = limit, text, armed_at, 0, 0
        self.in_backward, self.in_generation, self.once = in_backward, in_generation, once
        self.in_check, self.bus = 0, None

    def attach(self, trainer):
        from hf_perf_callbacks.common.bus import bus_for

        self.bus = bus_for(trainer.callback_handler)
        model = trainer.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        if self.in_backward:                           # raise while gradients flow back through the first layer
            inner.model.layers[0].register_full_backward_hook(
                lambda module, grad_in, grad_out: self.fire(grad_out[0].shape[0]))
        else:
            # the decoder stack: peft before 0.21 calls the causal LM's forward() directly, skipping its hooks
            forward_entry(inner).register_forward_pre_hook(self.check, with_kwargs=True)
        return trainer

    def fire(self, batch):
        if self.step >= self.armed_at and batch > self.limit and not (self.once and self.raised):
            if self.bus is not None and self.bus.own_passes:
                self.in_check += 1
            else:
                self.raised += 1
            raise torch.OutOfMemoryError(self.text) if self.text == CUDA_OOM else RuntimeError(self.text)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def check(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() is not self.in_generation:
            self.fire(ids.shape[0])


def step_lines(output_dir):
    return [json.loads(line) for line in open(os.path.join(output_dir, "perf_log.jsonl"))
            if json.loads(line)["type"] == "step"]


@pytest.mark.parametrize("text", [CUDA_OOM, MPS_OOM], ids=["cuda-text", "mps-text"])
def test_grpo_oom_mid_run_resizes_and_reaches_max_steps(tokenizer, tmp_path, text):
    plant = PlantedOOM(limit=2, text=text, armed_at=3)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = plant.attach(make_grpo(tokenizer, tmp_path, [plant, ThroughputMeter(), tuner], max_steps=7, bs=4,
                                     ga=2))
    train_with_tuning(trainer)
    assert trainer.state.global_step == 7 and plant.raised == 1
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8       # effective batch kept
    assert args.generation_batch_size == 8 and args.steps_per_generation == 4              # generation batch kept
    decision = tuner.executor.record.decisions[-1]
    assert decision.kind == "oom" and decision.step == 4 and decision.checkpoint.endswith("checkpoint-3")
    assert (decision.old.micro_batch, decision.new.micro_batch) == (4, 2)
    assert decision.recovery_sec is not None                          # the next step completed after it
    steps = [s["step"] for s in step_lines(tmp_path)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]                           # no optimizer step lost or repeated
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path)] == [4, 4, 4, 2, 2, 2, 2]
    assert read_split_file(str(tmp_path)).decisions == tuner.executor.record.decisions    # the file holds what happened


@pytest.mark.parametrize("accept", [False, True])
def test_an_oom_at_the_first_step_where_only_one_row_fits_is_unmeasured(tokenizer, tmp_path, accept):
    """Only one-row micro-batches fit (the wall at the first step): 2×4 does not fit in its check, 1×8 fits but no
    grouping of the step's rows at a size that fits can be compared with it. The run ends before training anything,
    naming accept_unmeasured; with it, it goes on at 1×8 (one decision: 4×2 → 1×8)."""
    from hf_perf_callbacks.resize import InexactResize

    plant = PlantedOOM(limit=1, text=MPS_OOM)
    tuner = AdaptiveBatchTuner(tune=False, accept_unmeasured=accept)
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, [plant, tuner], max_steps=4, bs=4, ga=2))
    if not accept:
        with pytest.raises(InexactResize, match="accept_unmeasured=True"):
            train_with_tuning(trainer)
        assert trainer.state.global_step == 0 and tuner.executor.record.decisions == []
        assert [(c.new.micro_batch, c.fits, c.verdict) for c in read_split_file(str(tmp_path)).checks] == [
            (2, False, "unmeasured"), (1, True, "unmeasured")]
        return
    train_with_tuning(trainer)
    assert trainer.state.global_step == 4
    assert [(d.old.micro_batch, d.new.micro_batch) for d in tuner.executor.record.decisions] == [(4, 1)]
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (1, 8)


def test_no_smaller_split_raises_a_clear_error(tokenizer, tmp_path):
    plant = PlantedOOM(limit=0, text=CUDA_OOM)
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, [plant, AdaptiveBatchTuner(tune=False)], max_steps=2,
                                        bs=2, ga=1))
    with pytest.raises(ValueError, match="no exact split smaller than 1×2"):
        train_with_tuning(trainer)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def rates(trainer):
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def test_the_memory_check_picks_a_fitting_split_and_leaves_the_trajectory_unchanged(tokenizer, tmp_path):
    plant = PlantedOOM(limit=2, text=CUDA_OOM)
    tuner = AdaptiveBatchTuner(tune=False, memory_check=True)       # on CPU it runs only when asked
    checked = plant.attach(make_trainer(tokenizer, tmp_path / "checked", [plant, tuner], max_steps=3, bs=8, ga=1))
    train_with_tuning(checked)
    check = tuner.executor.record.decisions[0]
    assert check.kind == "memory_check" and check.cost_sec > 0
    tried = {t.split.micro_batch: t for t in check.trials}
    assert "out of memory" in tried[8].error and "out of memory" in tried[4].error and tried[2].fits
    assert check.new == Split(2, 4) == Split(checked.args.per_device_train_batch_size,
                                             checked.args.gradient_accumulation_steps)
    # the same split from the start, without a check: identical losses (weights, RNG, data untouched)
    plain = make_trainer(tokenizer, tmp_path / "plain", [], max_steps=3, bs=2, ga=4)
    plain.train()
    assert losses(checked) == pytest.approx(losses(plain), rel=1e-6)


def test_no_memory_check_on_a_cpu_unless_asked(tokenizer, tmp_path):
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, tmp_path, [tuner], max_steps=2, bs=4, ga=2)
    train_with_tuning(trainer)
    assert tuner.executor.record.decisions == [] and trainer.state.global_step == 2


def recorder(seen):
    def reward(prompts, completions, completion_ids=None, **kwargs):
        seen.append((tuple(map(str, prompts)), tuple(tuple(ids) for ids in completion_ids)))
        return [-abs(len(ids) - 8) / 8.0 for ids in completion_ids]
    return reward


def test_grpo_memory_check_keeps_the_generation_batch_and_the_sampling(tokenizer, tmp_path):
    """The check (forced long completions, learning rate 0) leaves the run sampling the same completions from the
    same prompts as a run that never checked: RNG, data order and weights restored."""
    checked_seen, plain_seen = [], []
    tuner = AdaptiveBatchTuner(tune=False, memory_check=True)
    checked = make_grpo(tokenizer, tmp_path / "checked", [tuner], max_steps=2, bs=4, ga=2, completion=10,
                        reward=recorder(checked_seen))
    config = checked.generation_config
    train_with_tuning(checked)
    assert config.min_new_tokens is None                              # restored after the check
    assert checked.args.generation_batch_size == 8 and tuner.executor.record.decisions[0].kind == "memory_check"
    plain = make_grpo(tokenizer, tmp_path / "plain", [], max_steps=2, bs=4, ga=2, completion=10,
                      reward=recorder(plain_seen))
    plain.train()
    assert plain_seen and checked_seen[-len(plain_seen):] == plain_seen     # the check's own rollout comes first
    assert losses(checked) == pytest.approx(losses(plain), rel=1e-6)


class PlantedStepTime(TrainerCallback):
    """Plants each optimizer step's time on a :class:`PlantedClock` by the micro-batch it ran with (``seconds``,
    ± ``noise``): far above the real step, so the tuner's measurements cannot flip on a loaded machine. Put it
    before the tuner in the callback list (it spends inside the step the tuner measures)."""

    def __init__(self, clock, seconds, noise=0.0, seed=0):
        import random

        self.clock, self.seconds, self.noise, self.rng = clock, seconds, noise, random.Random(seed)

    def on_step_end(self, args, state, control, **kwargs):
        base = self.seconds[args.per_device_train_batch_size]
        self.clock.spend(base * (1 + self.rng.uniform(-self.noise, self.noise)))


def tuned_run(tokenizer, path, seconds, max_steps=25, bs=2, ga=4, noise=0.0, padding_side="right", extra=(),
              **tuner_kw):
    clock = PlantedClock()
    tuner = AdaptiveBatchTuner(clock=clock, **tuner_kw)
    samples = SampleRecorder()
    trainer = samples.attach(make_trainer(tokenizer, path, [samples, PlantedStepTime(clock, seconds, noise), *extra,
                                                            tuner],
                                          max_steps=max_steps, bs=bs, ga=ga, length=16, padding_side=padding_side))
    train_with_tuning(trainer)
    return trainer, tuner, samples


def test_a_faster_split_is_found_on_the_runs_own_steps_and_nothing_is_trained_twice(tokenizer, tmp_path, capsys):
    trainer, tuner, samples = tuned_run(tokenizer, tmp_path / "tuned", {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0})
    assert trainer.state.global_step == 25 and trainer.args.per_device_train_batch_size == 8
    [decision] = tuner.executor.record.decisions
    assert decision.kind == "tune" and (decision.old, decision.new) == (Split(2, 4), Split(8, 1))
    trials = {t.split.micro_batch: t for t in decision.trials}
    # 2 samples of the configured split, then 8×1 (4× faster) kept on its first measured step: the sequential test
    assert trials[2].steps == [4, 5] and trials[8].steps == [8] and set(trials) == {2, 8}
    assert decision.expected_gain_sec > 0 and decision.cost_sec >= 0
    lines = step_lines(tmp_path / "tuned")
    assert [s["step"] for s in lines] == list(range(1, 26))                  # every step once: none retrained
    assert [s[keys.TUNER_MICRO_BATCH] for s in lines] == [2] * 5 + [8] * 20
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == list(range(1, 26))
    # the same samples in every optimizer step as a run that never switched
    plain_samples = SampleRecorder()
    plain = plain_samples.attach(make_trainer(tokenizer, tmp_path / "plain", [plain_samples], max_steps=25, bs=2,
                                              ga=4, length=16))
    plain.train()
    assert samples.trained() == plain_samples.trained()
    # no padding: every split computes the same step (up to float summation order), with the same schedule
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-5)
    assert rates(trainer) == rates(plain)
    assert not [n for n in os.listdir(tmp_path / "tuned") if n.startswith("checkpoint-")]   # switch checkpoints go
    record = read_split_file(str(tmp_path / "tuned"))
    assert record.split == Split(8, 1) and record.decisions == [decision]
    assert decision.step == 8 and decision.headline().split(" (")[0] in capsys.readouterr().out     # printed
    # the report's tuner plot reads this real file: the measured trials with their times, the chosen split
    from matplotlib.figure import Figure

    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.report.plots import PlotData, plot_tuner

    fig = Figure()
    plot_tuner(fig, PlotData.of(read_run(str(tmp_path / "tuned"))))
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["2×4\n(before)", "8×1\n(chosen)"]
    assert [round(b.get_height(), 1) for b in fig.axes[0].patches] == [round(trials[2].median, 1),
                                                                      round(trials[8].median, 1)]


def test_a_split_8x_faster_is_kept_on_its_first_measured_step_and_the_split_file_says_why(tokenizer, tmp_path):
    """Planted: the configured 2×4 8× slower than 8×1. The tuner measures 2×4 on 2 steps after its warm-up (4-5),
    switches, and keeps 8×1 on its first measured step (8, after 2 warm-up steps) by the sequential test: the
    decision in the split file names it, with the samples it rests on; 5 steps ran at the slow split, not 7 + 6."""
    trainer, tuner, _ = tuned_run(tokenizer, tmp_path, {8: 25.0, 4: 100.0, 2: 200.0, 1: 400.0}, max_steps=18)
    record = read_split_file(str(tmp_path))
    [decision] = record.decisions
    assert (decision.kind, decision.step, decision.old, decision.new) == ("tune", 8, Split(2, 4), Split(8, 1))
    trials = {t.split.micro_batch: t for t in decision.trials}
    assert trials[2].steps == [4, 5] and trials[8].steps == [8] and trials[8].gain == pytest.approx(7 / 8, abs=0.02)
    # the split file holds why as data: kept by the sequential test (its evidence's figures, no p-value)
    assert decision.reason_code == "faster_beyond_noise" and decision.rank_by == decision.ranked == "non_generation"
    assert "p" not in decision.figures and decision.figures["seq_ratio"] > decision.figures["seq_bound"]
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path)] == [2] * 5 + [8] * 13
    assert record.split == Split(8, 1) and trainer.state.global_step == 18


class StepNow(TrainerCallback):
    """The optimizer step under way (1-based), for what a test counts per step (placed before the tuner, so that the
    tuner's work at a step's begin counts for that step)."""

    def __init__(self):
        self.now = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = state.global_step + 1


def test_once_the_tuning_decided_the_tuner_no_longer_synchronizes_or_times_a_step(tokenizer, tmp_path, monkeypatch):
    """The tuner synchronizes the device at each measured step's begin and end (its timing): from the decision on
    (step 8 here, in the same train() call) no step of the run is synchronized or timed for the tuning any more,
    and its generation clock is taken off the model (seen on 4 H200s: runs that kept measuring after their decision
    ran their steps outside generation 3-5% slower than a plain run of the same split)."""
    from hf_perf_callbacks.platform.device import DeviceLayer

    synced, step = [], StepNow()
    original = DeviceLayer.synchronize

    def counted(self):
        synced.append(step.now)
        original(self)

    monkeypatch.setattr(DeviceLayer, "synchronize", counted)
    trainer, tuner, _ = tuned_run(tokenizer, tmp_path, {8: 25.0, 4: 100.0, 2: 200.0, 1: 400.0}, max_steps=18,
                                  extra=[step])
    [decision] = tuner.executor.record.decisions
    assert decision.step == 8 and trainer.state.global_step == 18
    assert max(synced) == 8 and {4, 5, 8} <= set(synced)          # measured steps synchronized, none after step 8
    assert not tuner.measuring and tuner._stop_watching is None


def test_a_run_too_short_to_pay_back_tries_no_split_and_writes_no_checkpoint(tokenizer, tmp_path):
    trainer, tuner, _ = tuned_run(tokenizer, tmp_path, {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0}, max_steps=6)
    [decision] = tuner.executor.record.decisions
    assert decision.kind == "tune" and decision.new == Split(2, 4) and decision.ended_by == "too_short"
    assert decision.figures["left"] < decision.figures["needed"]
    assert [t.split for t in decision.trials] == [Split(2, 4)] and decision.cost_sec == 0
    assert {s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path)} == {2}
    assert not [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")]


def test_a_slower_split_is_left_and_the_run_goes_back_to_the_configured_one(tokenizer, tmp_path):
    trainer, tuner, _ = tuned_run(tokenizer, tmp_path, {8: 800.0, 4: 400.0, 2: 200.0, 1: 400.0}, max_steps=30)
    decision = tuner.executor.record.decisions[-1]
    assert decision.kind == "tune" and decision.new == Split(2, 4) and trainer.args.per_device_train_batch_size == 2
    left = {t.split.micro_batch: t for t in decision.trials}
    assert len(left[8].samples) == 1 and len(left[1].samples) == 1 and decision.cost_sec > 0
    assert [s["step"] for s in step_lines(tmp_path)] == list(range(1, 31))


@pytest.mark.parametrize("max_resizes", [pytest.param(0, marks=pytest.mark.launch), 1])
def test_a_larger_split_that_runs_out_of_memory_is_left_and_nothing_is_lost(tokenizer, tmp_path, max_resizes):
    """The tuning's own trials that run out of memory (8×1, then 4×2) are left and the run goes on: they spend none
    of ``max_resizes`` (with 0 the configured split, which fits, trains to the end; with 1 a real OOM later still
    gets its re-size). The fast suite runs the case of 1 (two trial OOMs, then the real one re-sizes); 0 runs with
    the launch suite, as do the matrix's tuning cells of it for every trainer."""
    clock = PlantedClock()
    plant = PlantedOOM(limit=2, text=CUDA_OOM)
    real = Fault("forward", at=12) if max_resizes else None      # at the kept split, after the tuning
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False)
    callbacks = [plant, PlantedStepTime(clock, {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0}), tuner]
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, callbacks + ([real] if real else []), max_steps=13,
                                        bs=2, ga=4))
    if real:
        real.attach(trainer)
    train_with_tuning(trainer, max_resizes=max_resizes)
    kinds = [(d.kind, d.old.micro_batch, d.new.micro_batch, d.trial) for d in tuner.executor.record.decisions]
    # the largest first; out of memory: straight on to the next largest; then the walk down (1×8, slower): back
    assert kinds[:3] == [("oom", 8, 4, True), ("oom", 4, 1, True), ("tune", 2, 2, False)]
    tried = {t.split.micro_batch: t for t in tuner.executor.record.decisions[2].trials}
    from hf_perf_callbacks.resize.tuning import OVER_BUDGET

    assert not tried[8].fits and not tried[4].fits and len(tried[1].samples) == 1      # out of memory, as the kinds
    assert tried[8].error == tried[4].error != OVER_BUDGET                              # say, not over the budget
    assert [s["step"] for s in step_lines(tmp_path)] == list(range(1, 14)) and trainer.state.global_step == 13
    if max_resizes:
        assert kinds[3:] == [("oom", 2, 1, False)] and tuner.executor.resizes == 1 and real.fired == 1
    else:
        assert kinds[3:] == [] and tuner.executor.resizes == 0
    assert {s[keys.TUNER_RESIZES] for s in step_lines(tmp_path)} <= {0, 1}                 # the trials count none
    assert os.listdir(tmp_path / "tuner_switch") == []                      # the trials' checkpoints are gone
    assert [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")] == (["checkpoint-11"] if max_resizes
                                                                                 else [])


def test_grpo_tuning_switches_at_generation_boundaries_and_samples_what_an_untuned_run_samples(tokenizer, tmp_path):
    tuned_seen, plain_seen = [], []
    clock = PlantedClock()
    tuner = AdaptiveBatchTuner(clock=clock, samples=3, must_pay=False, max_micro_batch=4)
    extra = {"steps_per_generation": 4}                                 # a generation every 2 optimizer steps
    tuned = make_grpo(tokenizer, tmp_path / "tuned", [PlantedStepTime(clock, {4: 50.0, 2: 200.0, 1: 400.0}),
                      tuner], max_steps=18, bs=2, ga=2, completion=6, extra=extra, reward=recorder(tuned_seen))
    train_with_tuning(tuned)
    lines = step_lines(tmp_path / "tuned")
    micro = [s[keys.TUNER_MICRO_BATCH] for s in lines]
    changes = [s["step"] for prev, s in zip(lines, lines[1:])
               if s[keys.TUNER_MICRO_BATCH] != prev[keys.TUNER_MICRO_BATCH]]
    assert changes and all((step - 1) % 2 == 0 for step in changes)     # a new split begins a generation cycle
    assert tuned.args.generation_batch_size == 8 and 4 in micro
    plain = make_grpo(tokenizer, tmp_path / "plain", [], max_steps=18, bs=2, ga=2, completion=6, extra=extra,
                      reward=recorder(plain_seen))
    plain.train()
    assert tuned_seen == plain_seen                                     # the same prompts and completions


class MemoryByBatch(FakeMPS):
    """Driver memory grows with the micro-batch: 2 GB per sample (a fake MPS reading)."""

    def __init__(self, trainer_args):
        super().__init__(driver_gb=[0.0])
        self.args = trainer_args

    def memory(self):
        driver = 2.0 * self.args.per_device_train_batch_size
        return MemorySample(allocated=int(driver * GB), reserved=int(driver * GB), device_limit=int(64 * GB),
                            system_total=int(64 * GB), system_available=int(32 * GB))


def test_watchdog_request_resizes_through_train_with_tuning(tokenizer, tmp_path):
    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2)
    watchdog.device = MemoryByBatch(trainer.args)
    train_with_tuning(trainer)
    assert trainer.state.global_step == 5
    assert [(d.kind, d.step) for d in tuner.executor.record.decisions] == [("watchdog", 2)]
    assert [a["action"] for a in watchdog.actions] == ["clear_cache", "smaller_batch"]
    assert trainer.args.per_device_train_batch_size == 2 and trainer.args.gradient_accumulation_steps == 4
    assert [s["step"] for s in step_lines(tmp_path)] == [1, 2, 3, 4, 5]


def test_without_train_with_tuning_it_saves_stops_and_records_the_split(tokenizer, tmp_path, capsys):
    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2)
    watchdog.device = MemoryByBatch(trainer.args)
    trainer.train()
    assert trainer.state.global_step == 2 and os.path.isdir(tmp_path / "checkpoint-2")
    out = capsys.readouterr().out
    assert "per_device_train_batch_size=2, gradient_accumulation_steps=4" in out
    assert "resume_from_checkpoint=" in out
    assert read_split_file(str(tmp_path)).split == Split(2, 4)

    # a later process resumes at the tuned split, with the decision history
    tuner2 = AdaptiveBatchTuner(tune=False)
    resumed = make_trainer(tokenizer, tmp_path, [MemoryWatchdog(limit_gb=7.0), tuner2], max_steps=4, bs=4, ga=2)
    train_with_tuning(resumed, resume_from_checkpoint="last")
    assert resumed.args.per_device_train_batch_size == 2 and resumed.state.global_step == 4
    assert [d.kind for d in tuner2.executor.record.decisions] == ["watchdog"]
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path) if s["step"] > 2] == [2, 2]


@pytest.mark.parametrize("bad", [{"tune": "yes"}, {"samples": 2}, {"max_micro_batch": 0}, {"max_rounds": 0},
                                 {"patience": 0}, {"rank_by": "speed"}, {"must_pay": "yes"}, {"memory_check": 1}])
def test_tuner_parameters_are_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AdaptiveBatchTuner(**bad)


def test_train_with_tuning_and_default_callbacks_validate(tokenizer, tmp_path):
    from hf_perf_callbacks import default_callbacks

    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=1)
    with pytest.raises(ValueError, match="max_resizes=-1"):
        train_with_tuning(trainer, max_resizes=-1)
    with pytest.raises(ValueError, match="tune='yes'"):
        train_with_tuning(trainer, tune="yes")
    with pytest.raises(ValueError, match="ThroughputMeter=5"):
        default_callbacks(ThroughputMeter=5)
    with pytest.raises(ValueError, match="Unknown"):
        default_callbacks(Unknown={})


def test_the_memory_check_runs_only_where_memory_is_tight(tokenizer, tmp_path):
    """GRPO's worst-case peak is estimated from the model's config (times the allocator's overhead); the check's step
    is spent only when that reaches half the budget, or when nothing can be estimated (a plain Trainer)."""
    from hf_perf_callbacks.estimate import estimate_grpo_memory, model_from_config
    from hf_perf_callbacks.resize import memcheck

    grpo = make_grpo(tokenizer, tmp_path / "grpo", [], bs=4, ga=2, completion=12)
    peak = memcheck.estimated_peak(grpo, "cuda")
    inner = grpo.model.get_base_model()
    facts = model_from_config({**inner.config.to_dict(), "params": sum(p.numel() for n, p in inner.named_parameters()
                                                                        if "lora_" not in n)})
    longest = max(len(tokenizer(p)["input_ids"]) for p in grpo.train_dataset["prompt"])
    assert peak == estimate_grpo_memory(facts, micro_batch=4, num_generations=4, generation_batch=8,
                                        prompt_tokens=longest, max_completion_length=12, dtype_bytes=4,
                                        lora_params=sum(p.numel() for p in grpo.model.parameters()
                                                        if p.requires_grad),
                                        activation_checkpointing=False, lm_head="triton")["peak"]
    assert memcheck.tight(grpo, budget=1000 * peak, device_type="cuda")[0] is False
    assert memcheck.tight(grpo, budget=2 * peak, device_type="cuda")[0] is True          # 1.25 × peak ≥ half of it
    assert memcheck.tight(grpo, budget=3 * peak, device_type="mps")[0] is True           # 2 × peak ≥ half of it
    plain = make_trainer(tokenizer, tmp_path / "plain", [], max_steps=1)
    assert memcheck.estimated_peak(plain, "cuda") is None
    assert memcheck.tight(plain, budget=GB, device_type="cuda")[0] is True        # no estimate: the check runs


# ---------------------------------------------------------------- the splits exact under the run's loss
def test_the_rule_keeps_only_the_splits_under_which_the_loss_is_what_the_configured_split_trains():
    """The pure rule over a run's facts (``batching.exact_under``): settings under which the loss depends on each
    micro-batch's own content keep the configured split alone, with why and what makes every split exact; the
    examples of an epoch's last micro-batch decide the rest."""
    from hf_perf_callbacks.core.batching import Grouping, exact_splits, exact_under

    every = exact_splits(8)                                      # 8×1, 4×2, 2×4, 1×8
    configured = Split(4, 2)
    assert exact_under(Grouping(rows=64), configured, every).splits == tuple(every)          # right padding
    alone = {"left padding": (Grouping(left_padding=True, rows=64), "pads left", "padding_side = 'right'"),
             "dropout": (Grouping(dropout=True, rows=64), "dropout", "lora_dropout=0.0"),
             "batch norm": (Grouping(batch_norm=True, rows=64), "batch normalisation", "BatchNorm"),
             "override": (Grouping(loss_override="Mine.compute_loss", rows=64), "never reads num_items_in_batch",
                          "num_items_in_batch=num_items_in_batch"),
             "mean per micro-batch": (Grouping(counts_items=False, rows=64), "mean over each micro-batch",
                                      "takes num_items_in_batch"),
             "bnpo": (Grouping(trainer="GRPOTrainer", loss_types=("bnpo",)), "'bnpo'", "loss_type='dapo'"),
             "entropy quantile": (Grouping(trainer="GRPOTrainer", loss_types=("dapo",), top_entropy_quantile=0.2),
                                  "top_entropy_quantile=0.2", "top_entropy_quantile=1.0"),
             "DPO sft": (Grouping(trainer="DPOTrainer", loss_types=("sigmoid", "sft"), rows=64), "'sft'",
                         "without 'sft'"),
             "an unknown trainer": (Grouping(trainer="KTOTrainer"), "KTOTrainer computes its own loss", "SFTTrainer"),
             "tokens per rank": (Grouping(world=2, tokens_across_devices=False, rows=64),
                                 "average_tokens_across_devices=False", "average_tokens_across_devices=True")}
    for name, (grouping, why, fix) in alone.items():
        judged = exact_under(grouping, configured, every)
        assert judged.splits == (configured,) and why in judged.reason and fix in judged.fix, name
        assert "4×2" in judged.message(every) and "8×1, 2×4, 1×8" in judged.message(every), name
    for loss in ("dapo", "dr_grpo", "grpo"):                     # normalised over the step: every split
        assert exact_under(Grouping(trainer="GRPOTrainer", loss_types=(loss,), dropout=False), configured,
                           every).reason is None
    # DPO: a mean over each micro-batch's pairs; 10 pairs at 3×2 leave a last micro-batch of one pair
    dpo = exact_splits(6)
    judged = exact_under(Grouping(trainer="DPOTrainer", loss_types=("sigmoid",), rows=10), Split(3, 2), dpo)
    assert judged.splits == (Split(3, 2),) and "last micro-batch of 1" in judged.reason and "(6)" in judged.fix
    # 10 pairs at 2×3: every micro-batch full, and so at 1×6: those two are exact; 12 pairs: all
    assert exact_under(Grouping(trainer="DPOTrainer", loss_types=("sigmoid",), rows=10), Split(2, 3),
                       dpo).splits == (Split(2, 3), Split(1, 6))
    assert exact_under(Grouping(trainer="DPOTrainer", loss_types=("sigmoid",), rows=12), Split(3, 2),
                       dpo).reason is None
    assert exact_under(Grouping(trainer="DPOTrainer", loss_types=("sigmoid",), rows=None), Split(3, 2),
                       dpo).splits == (Split(3, 2),)                                    # unknown: not checkable
    # drop_last: 4×2 drops 2 of 66 examples an epoch, 2×4 none; 1×8 none either; 8×1 drops 2 too
    dropping = exact_under(Grouping(drop_last=True, rows=66), configured, every)
    assert dropping.splits == (Split(8, 1), configured) and "dataloader_drop_last=True" in dropping.reason
    # a run that ends before the first epoch's last step never meets the difference
    assert exact_under(Grouping(drop_last=True, rows=66, planned_steps=8), configured, every).reason is None
    # GRPO draws whole generation batches: the epoch's examples are the same for every split
    assert exact_under(Grouping(trainer="GRPOTrainer", loss_types=("dapo",), drop_last=True, rows=7), configured,
                       every).reason is None


class IgnoresItems:
    """A compute_loss override that never reads num_items_in_batch (a mean over each micro-batch's tokens)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class PassesItems:
    """An override that passes num_items_in_batch on (the trainer's own normalisation)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch=num_items_in_batch)


class PassesKwargs:
    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_the_facts_of_the_runs_loss_are_read_from_the_trainer(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import Trainer

    from hf_perf_callbacks.resize.grouping import examples, loss_owner, read_grouping, reads

    assert loss_owner(Trainer) == ("Trainer", None)
    assert loss_owner(type("Mine", (IgnoresItems, Trainer), {})) == ("Trainer", "IgnoresItems.compute_loss")
    assert loss_owner(type("Mine", (PassesItems, Trainer), {})) == ("Trainer", None)
    assert loss_owner(type("Mine", (PassesKwargs, Trainer), {})) == ("Trainer", None)
    assert reads(lambda outputs, labels, num_items_in_batch=None: num_items_in_batch, "num_items_in_batch")
    assert not reads(lambda outputs, labels, num_items_in_batch=None: outputs.loss, "num_items_in_batch")
    left = read_grouping(make_trainer(tokenizer, tmp_path / "l", [], padding_side="left"), 6, 1)
    assert left.left_padding and left.trainer == "Trainer" and left.counts_items and left.rows == 64
    right = read_grouping(make_trainer(tokenizer, tmp_path / "r", [], extra={"dataloader_drop_last": True}), 6, 1)
    assert not right.left_padding and right.drop_last and not right.dropout and right.loss_override is None
    func = make_trainer(tokenizer, tmp_path / "f", [])
    func.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    assert read_grouping(func, 6, 1).loss_override.startswith("compute_loss_func")
    dropped = make_trainer(tokenizer, tmp_path / "d", [])
    dropped.model.model.layers[0].self_attn.attention_dropout = 0.1
    assert read_grouping(dropped, 6, 1).dropout
    assert examples(Dataset.from_dict({"x": [1, 2, 3]}).to_iterable_dataset()) is None
    assert examples(Dataset.from_dict({"x": [1, 2, 3]})) == 3
    grpo = make_grpo(tokenizer, tmp_path / "g", [])
    grpo.compute_loss_func = "non-None"          # TRL 1.0's GRPOTrainer sets it so; its own loss never calls it
    judged = read_grouping(grpo, 6, 1)
    assert judged.trainer == "GRPOTrainer" and judged.loss_override is None and judged.loss_types == (
        grpo.args.loss_type,)


def test_left_padding_keeps_the_configured_split_and_an_oom_saves_and_ends_saying_why(tokenizer, tmp_path):
    """The collator pads left: the first token of a row shorter than its micro-batch's longest is a target only in
    that grouping, so no other split trains the configured run. Said once at the start (perf log, split file); the
    tuning tries nothing; an OOM saves and ends with why and the setting that makes every split exact."""
    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.resize.checkpoints import is_complete

    clock = PlantedClock()
    plant = PlantedOOM(limit=2, text=CUDA_OOM, armed_at=2)
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False)
    trainer = plant.attach(make_trainer(tokenizer, tmp_path, [plant, PlantedStepTime(clock, {4: 100.0}), tuner],
                                        max_steps=6, bs=4, ga=2, padding_side="left"))
    with pytest.raises(ValueError, match="no smaller split keeps this run exact") as raised:
        train_with_tuning(trainer)
    assert "pads left" in str(raised.value) and "padding_side = 'right'" in str(raised.value)
    assert "per_device_train_batch_size=2 and gradient_accumulation_steps=4" in str(raised.value)
    assert not tuner.executor.tuning.larger and not tuner.executor.tuning.smaller      # nothing to try
    assert is_complete(str(tmp_path / "checkpoint-2"), 2) and trainer.state.global_step == 2
    record = read_split_file(str(tmp_path))
    assert record.restricted.splits == [Split(4, 2)] and "pads left" in record.restricted.reason
    assert "no smaller split keeps this run exact" in record.ended and record.split == Split(4, 2)
    said = [e for e in read_run(str(tmp_path)).events if "use only 4×2" in e.message]
    assert len(said) == 1 and "padding_side = 'right'" in said[0].message
    assert [d.kind for d in tuner.executor.record.decisions if d.kind != "tune"] == []      # no re-size recorded
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)


class StopAt(TrainerCallback):
    """The user's callback: stop training at step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


#: planted step times under which the tuner measures 2×4 on steps 4-5 and asks for 8×1 at the end of step 5 (with
#: ``first_samples=4``: on steps 4-7 and at the end of step 7), and keeps it on its first measured step (2 later)
FASTER_LARGER = {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0}


@pytest.mark.parametrize("stop", ["callback", "early_stopping"])
def test_a_users_stop_on_the_step_where_the_tuner_switches_ends_the_run_there(tokenizer, tmp_path, stop):
    """The tuner asks for 8×1 at the end of step 7, where the user's callback (or early stopping, in the evaluation
    of step 7) stops the run: it ends at step 7, as the untuned run does, with the same weights and optimizer state;
    the tuning is recorded as ended, and args and the split file keep the configured split."""
    from transformers import EarlyStoppingCallback

    def run(path, tuned):
        clock = PlantedClock()
        if stop == "callback":
            stopper, extra = StopAt(7), {}
        else:                                # no improvement counts: the 7th evaluation ends patience 6
            stopper = EarlyStoppingCallback(early_stopping_patience=6, early_stopping_threshold=1e9)
            extra = {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "loss"}
        trajectory = Trajectory()
        callbacks = [trajectory, PlantedStepTime(clock, FASTER_LARGER)]
        callbacks += [AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)] if tuned else []
        trainer = trajectory.attach(make_trainer(tokenizer, path, callbacks + [stopper], max_steps=25, bs=2, ga=4,
                                                 length=16, with_eval=stop != "callback",
                                                 extra={"optim": "sgd", "optim_args": "momentum=0.9",
                                                        "max_grad_norm": 0.0, **extra}))
        train_with_tuning(trainer) if tuned else trainer.train()
        return trainer, trajectory

    tuned, tuned_path = run(tmp_path / "tuned", True)
    plain, plain_path = run(tmp_path / "plain", False)
    assert tuned.state.global_step == plain.state.global_step == 7
    assert differences(plain_path, tuned_path) == []
    tuner = find_tuner(tuned)
    assert [(d.kind, d.new) for d in tuner.executor.record.decisions] == [("tune", Split(2, 4))]
    assert tuner.executor.record.decisions[0].ended_by == "run_ended"
    assert tuner.executor.state.switch is None and read_split_file(str(tmp_path / "tuned")).split == Split(2, 4)
    assert (tuned.args.per_device_train_batch_size, tuned.args.gradient_accumulation_steps) == (2, 4)


def find_tuner(trainer):
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AdaptiveBatchTuner))


def test_switch_checkpoints_never_push_the_users_out_and_a_run_ending_mid_trial_says_one_split(tokenizer, tmp_path):
    """save_total_limit=1, the user's checkpoint-5; the tuner switches to 8×1 at step 7 and the user stops the run at
    step 9, mid-trial. The switch checkpoint is no checkpoint-N of the rotation: checkpoint-5 stays, as in the
    untuned run; args, the split file and the tuning's decision all say 2×4."""
    from hf_perf_callbacks.resize import current_split

    saves = {"save_strategy": "steps", "save_steps": 5, "save_total_limit": 1}

    def checkpoints(path):
        return sorted(n for n in os.listdir(path) if n.startswith("checkpoint-"))

    clock = PlantedClock()
    tuner = AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)
    tuned = make_trainer(tokenizer, tmp_path / "tuned", [PlantedStepTime(clock, FASTER_LARGER), tuner, StopAt(9)],
                         max_steps=25, bs=2, ga=4, length=16, extra=saves)
    train_with_tuning(tuned)
    assert [s[keys.TUNER_MICRO_BATCH] for s in step_lines(tmp_path / "tuned")] == [2] * 7 + [8] * 2   # a trial ran
    plain = make_trainer(tokenizer, tmp_path / "plain", [StopAt(9)], max_steps=25, bs=2, ga=4, length=16,
                         extra=saves)
    plain.train()
    assert checkpoints(tmp_path / "tuned") == checkpoints(tmp_path / "plain") == ["checkpoint-5"]
    assert not os.listdir(tmp_path / "tuned" / "tuner_switch")              # the switch checkpoint is gone
    [decision] = tuner.executor.record.decisions
    assert decision.kind == "tune" and decision.new == Split(2, 4)
    assert current_split(tuned.args) == Split(2, 4) == read_split_file(str(tmp_path / "tuned")).split
    assert losses(tuned) == pytest.approx(losses(plain), rel=1e-5)          # no padding: the same steps


def test_the_watchdogs_request_uses_only_the_splits_exact_for_the_run(tokenizer, tmp_path):
    """Left padding leaves no smaller split exact: the watchdog's request for one is declined with why (no re-size
    recorded), and the watchdog stops the run at the wall itself, saved."""
    from hf_perf_callbacks.core.runlog import read_run

    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, tmp_path, [watchdog, tuner], max_steps=5, bs=4, ga=2, padding_side="left")
    watchdog.device = MemoryByBatch(trainer.args)
    train_with_tuning(trainer)
    assert tuner.executor.record.decisions == [] and trainer.args.per_device_train_batch_size == 4
    assert [a["action"] for a in watchdog.actions][-1] == "stop" and os.path.isdir(tmp_path / "checkpoint-2")
    said = [e.message for e in read_run(str(tmp_path)).events]
    assert any("no smaller split keeps this run exact" in m and "pads left" in m for m in said)
