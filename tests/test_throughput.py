"""ThroughputMeter on real trainers (tiny random Llama, CPU): token sources, GRPO phases, duplicate forwards,
data-wait warning, MFU, resume without a spike."""
import json
import os

import pytest
import torch
from transformers import Trainer

from hf_perf_callbacks import ThroughputMeter, keys
from hf_perf_callbacks.core.dataloader import dataloader_changes
from hf_perf_callbacks.core.flops import forward_flops_per_token, train_flops_per_token
from hf_perf_callbacks.core.runlog import MeterSummary, SummaryLine, read_run
from hf_perf_callbacks.core.wording import throughput_line
from tests.conftest import PlantedClock, make_grpo, make_trainer


def perf_lines(output_dir, kind="step"):
    path = os.path.join(output_dir, "perf_log.jsonl")
    return [line for line in map(json.loads, open(path)) if line["type"] == kind]


def test_plain_trainer_counts_non_padding_tokens_like_the_trainer_does(tokenizer, tmp_path):
    own = ThroughputMeter()
    make_trainer(tokenizer, tmp_path / "own", [own], max_steps=5).train()
    reference = ThroughputMeter()
    trainer = make_trainer(tokenizer, tmp_path / "ref", [reference], max_steps=5,
                           extra={"include_num_input_tokens_seen": "non_padding"})
    trainer.train()
    assert own.run.token_source == "hook" and reference.run.token_source == "trainer"
    assert own.run.counts.dtype == torch.long          # integer device counters: MPS has no float64
    assert own.timeline.total_tokens == trainer.state.num_input_tokens_seen == reference.timeline.total_tokens
    assert own.timeline.total_tokens > 0
    steps = perf_lines(tmp_path / "own")
    assert all(0 < s[keys.PERF_PAD_FRACTION] < 1 for s in steps)     # batches of uneven length are padded
    run = perf_lines(tmp_path / "own", "run")[0]
    assert run["model"]["num_hidden_layers"] == 2 and run["dataloader"]["num_workers"] == 0


def test_grpo_tokens_phases_and_rollout_throughput(tokenizer, tmp_path):
    meter = ThroughputMeter(window_steps=2, warmup_window=2, warmup_tolerance=0.5)
    trainer = make_grpo(tokenizer, tmp_path, [meter], max_steps=6)
    trainer.train()
    assert meter.timeline.total_tokens == trainer.state.num_input_tokens_seen
    steps = perf_lines(tmp_path)
    assert all(s[keys.PERF_PHASE_SEC["generation"]] > 0 for s in steps)
    assert all(s[keys.PERF_ROLLOUT_TOKENS_PER_SEC] > 0 and s[keys.PERF_TRAIN_TOKENS_PER_SEC] > 0 for s in steps)
    assert all(s[keys.PERF_FORWARDS_PER_MICROBATCH] == 1.0 for s in steps)
    summary = meter.summary
    assert summary["phases"]["generation"] > 0.1 and summary["steps"] == 6
    assert sum(summary["phases"].values()) == pytest.approx(1.0)


def test_grpo_generating_every_other_step_gives_no_spikes(tokenizer, tmp_path):
    meter = ThroughputMeter(window_steps=2, warmup_window=2, warmup_tolerance=0.9)
    make_grpo(tokenizer, tmp_path, [meter], max_steps=8, extra={"steps_per_generation": 4}).train()
    assert meter.run.period == 2
    steps = perf_lines(tmp_path)
    tokens = [s[keys.PERF_TOKENS] for s in steps]
    assert all(t > 0 for t in tokens[0::2]) and all(t == 0 for t in tokens[1::2])
    assert keys.PERF_TOKENS_PER_SEC not in steps[0]                  # half a cycle: no number rather than a spike
    for prev, cur in zip(steps, steps[1:]):                       # every rate spans one whole generation cycle
        expected = ((prev[keys.PERF_TOKENS] + cur[keys.PERF_TOKENS])
                    / (prev[keys.PERF_STEP_WALL_SEC] + cur[keys.PERF_STEP_WALL_SEC]))
        assert cur[keys.PERF_TOKENS_PER_SEC] == pytest.approx(expected)


class DoubleForwardTrainer(Trainer):
    """A classic slowdown: a custom compute_loss that runs the model twice per batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model(**inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_duplicate_forward_pass_is_flagged_once(tokenizer, tmp_path, caplog):
    meter = ThroughputMeter()
    with caplog.at_level("WARNING", logger="hf_perf_callbacks"):
        make_trainer(tokenizer, tmp_path, [meter], max_steps=3, trainer_cls=DoubleForwardTrainer).train()
    assert len([r for r in caplog.records if "grad-enabled forward passes" in r.getMessage()]) == 1
    flagged = [e.message for e in read_run(tmp_path).events if "grad-enabled forward passes" in e.message]
    assert len(flagged) == 1 and "2.0 per micro-batch" in flagged[0]      # the whole text is in the perf log
    assert perf_lines(tmp_path)[-1][keys.PERF_FORWARDS_PER_MICROBATCH] == 2.0


def test_no_duplicate_warning_for_a_normal_trainer(tokenizer, tmp_path):
    meter = ThroughputMeter()
    make_trainer(tokenizer, tmp_path, [meter], max_steps=3).train()
    assert "duplicate" not in meter.warned


def test_slow_dataset_warns_about_dataloader_settings(tokenizer, tmp_path, caplog):
    # each example costs 1 planted second, far above any real step time; warmup (decided on CPU time on a CPU
    # device, which a loaded machine makes noisy) is capped at 2 steps: this test is about data wait, not warmup
    clock = PlantedClock()
    meter = ThroughputMeter(warmup_window=2, warmup_tolerance=0.5, max_warmup_steps=2, clock=clock)
    with caplog.at_level("WARNING", logger="hf_perf_callbacks"):
        make_trainer(tokenizer, tmp_path, [meter], max_steps=6, delay=1.0, clock=clock).train()
    assert len([r for r in caplog.records if "waits for data" in r.getMessage()]) == 1
    messages = [e.message for e in read_run(tmp_path).events if "waits for data" in e.message]
    assert len(messages) == 1                                              # the whole text is in the perf log
    assert "`dataloader_num_workers: 2` (now 0" in messages[0] and "dataloader_persistent_workers" in messages[0]
    settings = {"num_workers": 0, "persistent_workers": False, "prefetch_factor": None, "pin_memory": True}
    advice = "; ".join(line for line, _ in dataloader_changes("cpu", settings))
    assert advice in messages[0]                                  # the analysis' advice, the same number
    assert "pin_memory" not in messages[0]                        # CUDA-only advice
    assert meter.summary["phases"]["data_wait"] > 0.3


def test_mfu_follows_the_flops_model_with_a_given_peak(tokenizer, tmp_path):
    meter = ThroughputMeter(peak_flops=1e12)
    make_grpo(tokenizer, tmp_path, [meter], max_steps=4).train()
    last = [s for s in perf_lines(tmp_path) if keys.PERF_MFU in s][-1]
    train, _ = train_flops_per_token(meter.run.shape, meter.run.seq_len)
    per_token = train + forward_flops_per_token(meter.run.shape, meter.run.seq_len)     # GRPO: + one generation forward
    assert last[keys.PERF_MFU] == pytest.approx(per_token * last[keys.PERF_TOKENS_PER_SEC] / 1e12)
    assert keys.PERF_HFU not in last                                 # no activation checkpointing here
    assert MeterSummary.__required_keys__ <= set(meter.summary) <= set(MeterSummary.__annotations__)  # its type
    written = [s for s in perf_lines(tmp_path, "summary") if s["source"] == "perf"][-1]   # read back: its types
    assert SummaryLine.from_json(written).malformed == {} and SummaryLine.from_json(written).values["steps"] == 4


def test_resume_restores_counters_and_first_window_does_not_spike(tokenizer, tmp_path):
    first = ThroughputMeter(window_steps=2, warmup_window=2, warmup_tolerance=0.9)
    trainer = make_grpo(tokenizer, tmp_path, [first], max_steps=4, extra={"save_strategy": "steps", "save_steps": 4})
    trainer.train()
    tokens_before = first.timeline.total_tokens
    second = ThroughputMeter(window_steps=2, warmup_window=2, warmup_tolerance=0.9)
    resumed = make_grpo(tokenizer, tmp_path, [second], max_steps=8, extra={"save_strategy": "no"})
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert second.timeline.steps == 8                             # 4 restored + 4 new
    assert second.timeline.total_tokens == resumed.state.num_input_tokens_seen
    after = [s for s in perf_lines(tmp_path) if s["step"] > 4]
    per_step_before = tokens_before / 4
    assert after[0][keys.PERF_TOKENS] < 2 * per_step_before          # not the restored total (transformers #40560)
    assert second.timeline.segments == 2


def test_the_callbacks_own_time_between_steps_is_not_data_wait(tokenizer, tmp_path):
    """Work a callback does after a step (here 100 planted seconds in ``on_step_end``) is that callback's phase, never
    waiting for data: the package's own callbacks' under ``own_callbacks``, a foreign one's under ``user_callbacks``
    with its class and event named (the user's callbacks alone are named by class); the step lines' phases sum to
    their wall time, and the work after the last step is the run's tail (the summary's)."""
    from transformers import TrainerCallback

    from hf_perf_callbacks.common.base import PerfCallback, hook

    clock = PlantedClock()                             # the callbacks' one clock: it times their own work too

    class SlowOwn(PerfCallback):
        @hook
        def on_step_end(self, args, state, control, **kwargs):
            clock.spend(100.0)

    class SlowForeign(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.spend(100.0)

    for slow, phase in ((SlowOwn(clock=clock), "own_callbacks"), (SlowForeign(), "user_callbacks")):
        meter = ThroughputMeter(clock=clock)
        out = tmp_path / type(slow).__name__
        make_trainer(tokenizer, out, [meter, slow], max_steps=6, bs=2, ga=1).train()
        s = meter.summary
        assert meter.timeline.steps == 6
        assert s["phase_sec"][phase] >= 6 * 100.0 and s["phase_sec"]["data_wait"] < 1.0
        assert s["tail_phase_sec"][phase] >= 100.0                 # the work after step 6 precedes no step
        named = s["callback_sec"].get(type(slow).__name__, {}).get("on_step_end", 0.0)   # the user's, by class
        assert named >= 6 * 100.0 if phase == "user_callbacks" else named == 0.0
        lines = perf_lines(out)
        for line in lines:
            phases = sum(line[keys.PERF_PHASE_SEC[p]] for p in keys.PHASES)
            assert phases == pytest.approx(line[keys.PERF_STEP_WALL_SEC], rel=1e-6, abs=1e-6)
        assert all(line[keys.PERF_PHASE_SEC[phase]] >= 100.0 for line in lines[1:])
        assert all(line.get(keys.PERF_CALLBACK_SEC + type(slow).__name__, 0.0) >= 100.0 for line in lines[1:]) \
            == (phase == "user_callbacks")


class PlantedLoad:
    """Planted clocks for the meter: the wall clock is the real one plus ``cpu`` seconds in every step and
    ``extra_wall`` more inside each of the first ``slow_steps`` steps; the process CPU clock advances ``cpu``
    seconds per step, plus ``extra_cpu`` in the slow steps. The planted 100 s per step dwarf the real step (a loaded
    2-core machine's seconds stay under the 10% tolerance), so the steady CPU/wall ratio is ~1 on any machine.
    Contention: extra wall, flat CPU. Warmup: extra wall with extra CPU behind it."""

    def __init__(self, slow_steps=3, extra_wall=1000.0, cpu=100.0, extra_cpu=0.0):
        self.slow, self.extra_wall, self.cpu, self.extra_cpu = slow_steps, extra_wall, cpu, extra_cpu
        self.clock = PlantedClock(cpu_only_planted=True)     # the meter's clock: ThroughputMeter(clock=load.clock)

    def on_step(self, step):                  # called inside the step, before the meter reads its clocks
        if step <= self.slow:
            self.clock.spend(self.extra_wall)
            self.clock.spend_cpu(self.extra_cpu)
        self.clock.spend(self.cpu)
        self.clock.spend_cpu(self.cpu)


@pytest.mark.parametrize("kind", ["contention", "warmup"])
def test_slow_first_steps_are_warmup_only_when_cpu_time_says_so(tokenizer, tmp_path, kind):
    from transformers import TrainerCallback

    load = PlantedLoad(extra_cpu=0.0 if kind == "contention" else 1000.0)

    class Inside(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            load.on_step(state.global_step)

    meter = ThroughputMeter(warmup_window=2, clock=load.clock)
    make_trainer(tokenizer, tmp_path, [Inside(), meter], max_steps=8).train()
    s = meter.summary
    assert s["warmup_done"] and s["warmup_measured_on"] == "cpu"
    # the analysis reads the same story from the perf log (the meter's own keys, nothing hand-made)
    from hf_perf_callbacks.report import check, measurements_from_run

    contention = [f for f in check(measurements_from_run(str(tmp_path)))[0] if f.rule == "contention"]
    if kind == "contention":
        assert s["warmup_steps"] == 0 and s["early_contention_sec"] > 2500       # 3 × 1000 s planted
        assert len(contention) == 1 and contention[0].basis == "measured"
        assert contention[0].expected_gain > 2 and contention[0].facts.contention.steps == 3
        assert contention[0].facts.contention.other_cores is not None        # perf/other_cpu_cores, on a CPU
    else:
        # the real steps' own wall time (no planted CPU behind it) may count as contention on a loaded machine:
        # bounded against the planted 3000 s, not in absolute seconds
        assert s["warmup_steps"] == 3 and s["warmup_overhead_sec"] > 2500
        assert s["early_contention_sec"] < 0.1 * s["warmup_overhead_sec"] and not contention
    steps = perf_lines(tmp_path)
    assert steps[0][keys.PERF_CPU_SEC] == pytest.approx(100.0 + (1000.0 if kind == "warmup" else 0.0))
    assert steps[0][keys.PERF_CPU_TIME_RATIO] == pytest.approx(
        steps[0][keys.PERF_CPU_SEC] / steps[0][keys.PERF_STEP_WALL_SEC])
    assert all(k in steps[-1] for k in (keys.PERF_OTHER_CPU_CORES, keys.PERF_LOAD_PER_CORE))


def test_calibrating_the_peak_leaves_the_sampled_completions_unchanged(tokenizer, tmp_path):
    """GRPO with the same seed samples the same completions with ``peak_flops="calibrate"`` as without it."""

    def run(name, meter):
        seen = []

        def recording_reward(prompts, completions, completion_ids=None, **kwargs):
            seen.extend(tuple(ids) for ids in completion_ids)
            return [0.0] * len(completion_ids)

        make_grpo(tokenizer, tmp_path / name, [meter], max_steps=2, reward=recording_reward).train()
        return seen

    calibrated = run("calibrated", ThroughputMeter(peak_flops="calibrate"))
    plain = run("plain", ThroughputMeter())
    assert len(plain) == 16 and calibrated == plain


@pytest.mark.parametrize("steps,slowdown,says,never", [
    (0, 0.7, "no warmup; the first step was faster than the steady level (0.70x)", "ran at the steady speed"),
    (0, 1.0, "no warmup: the first step ran at the steady speed", "ended after 0 steps"),
    (3, 0.7, "the speed settled after 3 steps; the first step was faster", "warmup took"),
    (0, 3.5, "only the first step was slow (3.5x the steady step)", "0 steps"),
    (3, 2.0, "warmup took 3 steps; the first step took 2.0x the steady step", "only the first"),
])
def test_console_summary_words_warmup_as_the_report_does(steps, slowdown, says, never):
    # seen on the console: "warmup: ended after 0 steps … first step 0.7x the steady step"
    meter = ThroughputMeter()
    meter.summary = {"steps": 10, "tokens": 1000.0, "warmup_done": True, "warmup_steps": steps,
                     "warmup_overhead_sec": 1.5 if steps else 0.0, "first_step_slowdown": slowdown,
                     "steady_step_sec": 0.2, "steady_tokens_per_sec": 500.0, "mean_tokens_per_sec": 450.0,
                     "phases": {"compute": 0.9}, "device": "cpu", "world_size": 1, "peak_flops": None}
    text = meter.format_summary()
    assert says in text and never not in text and throughput_line(500.0, 0.2, 450.0) in text
