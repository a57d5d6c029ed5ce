"""The probe's decision rules as pure functions (planted samples), then on a real Trainer whose measured step times
come from a planted clock (the costs stay real seconds, except a planted slow setup), so the conclusion cannot flip
under machine load."""
import random

import pytest

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.resize import probe
from hf_perf_callbacks.resize.probe import MIN_ROUNDS, judge, plan_probe
from tests.conftest import make_grpo, make_trainer


# ---------------------------------------------------------------- judge: noise vs a real difference

def test_a_real_difference_beyond_the_noise_switches():
    v = judge({"2×2": [1.00, 1.10, 0.95, 1.05], "4×1": [0.70, 0.75, 0.72, 0.80]}, "2×2", remaining_steps=100)
    assert v["chosen"] == "4×1"
    assert v["stats"]["4×1"]["p_value"] == pytest.approx(1 / 70)
    assert v["saving_sec_per_step"] == pytest.approx(1.025 - 0.735)
    assert v["expected_gain_sec"] == pytest.approx(100 * (1.025 - 0.735))


def test_overlapping_samples_keep_the_configured_split_even_with_a_lower_median():
    # the shape of the CPU demo's evidence: one sample far off, medians apart, samples interleaved
    v = judge({"4×2": [0.20, 8.90, 0.18, 0.22], "1×8": [0.115, 0.21, 0.19, 0.25]}, "4×2")
    assert v["stats"]["1×8"]["median"] < v["stats"]["4×2"]["median"]
    assert v["chosen"] == "4×2" and v["stats"]["1×8"]["p_value"] > 0.05


def test_a_single_sample_each_never_switches():
    assert judge({"a": [9.0], "b": [0.1]}, "a")["chosen"] == "a"


def test_a_significant_but_tiny_gain_keeps_the_configured_split():
    v = judge({"a": [1.000, 1.001, 1.002, 1.003], "b": [0.990, 0.991, 0.992, 0.993]}, "a")
    assert v["stats"]["b"]["p_value"] < 0.05 and v["stats"]["b"]["gain"] < 0.03 and v["chosen"] == "a"


def test_the_fastest_of_several_significant_splits_wins():
    v = judge({"a": [2.0, 2.1, 2.2, 2.05], "b": [1.0, 1.1, 1.05, 1.02], "c": [1.5, 1.6, 1.55, 1.52]}, "a")
    assert v["chosen"] == "b"


def test_on_equal_splits_noise_alone_rarely_switches():
    """Over 300 planted trials of three equal splits with 30% noise, the rule switches at most as often as its
    significance level allows for two comparisons."""
    rng = random.Random(0)
    switched = 0
    for _ in range(300):
        samples = {k: [rng.uniform(0.7, 1.3) for _ in range(4)] for k in ("a", "b", "c")}
        switched += judge(samples, "a")["chosen"] != "a"
    assert switched / 300 <= 2 * 0.05


def test_judge_needs_samples_of_the_configured_split():
    with pytest.raises(ValueError, match="configured='x'"):
        judge({"a": [1.0]}, "x")


# ---------------------------------------------------------------- plan: cost vs gain

def test_a_short_run_cannot_pay_for_a_probe():
    # 4 steps left, 0.5 s/step of split-dependent time: at most 2 s to gain; one visit costs 1 s
    plan = plan_probe(remaining_steps=4, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4)
    assert plan["others"] == 0 and plan["ceiling_sec"] == 2.0


def test_a_long_run_pays_for_every_split_and_round():
    plan = plan_probe(remaining_steps=10_000, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4)
    assert plan == {"others": 3, "rounds": 4, "ceiling_sec": 5000.0, "estimated_cost_sec": 15.0}


def test_a_middling_run_shortens_the_probe_rounds_first_then_splits():
    plan = plan_probe(remaining_steps=20, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4)   # 10 s
    assert plan["rounds"] == 4 and plan["others"] == 1 and plan["estimated_cost_sec"] <= 10
    plan = plan_probe(remaining_steps=12, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4)   # 6 s
    assert plan["rounds"] == MIN_ROUNDS and plan["others"] == 1 and plan["estimated_cost_sec"] <= 6


def test_what_the_probe_spent_already_counts_against_the_ceiling():
    # 10 s to gain, 1 s a visit: alone it pays for one split at 4 rounds; 4 s already spent (setup, first visit)
    # leave 6 s: 3 rounds; 8 s spent leave nothing
    plan = plan_probe(remaining_steps=20, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4, spent_sec=4.0)
    assert plan["rounds"] == MIN_ROUNDS and plan["others"] == 1 and plan["estimated_cost_sec"] == 4.0 + 5.0
    plan = plan_probe(remaining_steps=20, configured_sec=0.5, visit_sec=1.0, others=3, rounds=4, spent_sec=8.0)
    assert plan["others"] == 0 and plan["estimated_cost_sec"] == 8.0 + (2 * MIN_ROUNDS - 1) * 1.0


def test_unknown_length_or_must_pay_off_probes_everything():
    assert plan_probe(None, 0.5, 1.0, 3, 4)["others"] == 3
    assert plan_probe(4, 0.5, 1.0, 3, 4, must_pay=False) == {"others": 3, "rounds": 4, "ceiling_sec": 2.0,
                                                              "estimated_cost_sec": None}


# ---------------------------------------------------------------- on a real Trainer, with planted step times

class PlantedClock:
    """Step times by micro-batch (seconds, ± ``noise`` relative, seeded): each step advances the clock by the
    planted time of the split the trainer runs now; read at step begin and end by the probe's timer."""

    def __init__(self, args, seconds, noise=0.0, seed=0):
        self.args, self.seconds, self.noise, self.rng = args, seconds, noise, random.Random(seed)
        self.now, self.ending = 0.0, False

    def __call__(self):
        if self.ending:
            base = self.seconds[self.args.per_device_train_batch_size]
            self.now += base * (1 + self.rng.uniform(-self.noise, self.noise))
        self.ending = not self.ending
        return self.now


def probed(tokenizer, path, monkeypatch, seconds, noise=0.0, max_steps=3, **tuner_kw):
    tuner = AdaptiveBatchTuner(**tuner_kw)
    trainer = make_trainer(tokenizer, path, [tuner], max_steps=max_steps, bs=2, ga=2)
    monkeypatch.setattr(probe, "CLOCK", PlantedClock(trainer.args, seconds, noise))
    train_with_tuning(trainer)
    return trainer, tuner.decisions[0]


def test_a_split_planted_much_faster_is_chosen_with_its_evidence(tokenizer, tmp_path, monkeypatch, capsys):
    trainer, d = probed(tokenizer, tmp_path, monkeypatch, {4: 100.0, 2: 200.0, 1: 400.0}, noise=0.2)
    assert d["new"]["micro_batch"] == 4 and trainer.args.per_device_train_batch_size == 4
    trials = {t["split"]["micro_batch"]: t for t in d["trials"]}
    assert d["trials"][0]["split"]["micro_batch"] == 2                  # the configured split is measured first
    assert len(trials[4]["samples"]) == len(trials[2]["samples"]) == 4 and trials[4]["p_value"] <= 0.05
    assert trials[1]["samples"] and len(trials[1]["samples"]) == 1      # clearly slower: dropped after one visit
    assert all(t["cost_sec"] > 0 for t in d["trials"]) and d["ceiling_sec"] == pytest.approx(
        3 * trials[2]["samples"][0])
    assert d["expected_gain_sec"] == pytest.approx(3 * (trials[2]["median"] - trials[4]["median"]))
    out = capsys.readouterr().out
    assert out.count("AdaptiveBatchTuner probe:") == 1 and out.count("p=") >= 1   # the evidence, printed once


def test_equal_splits_with_noise_keep_the_configured_split(tokenizer, tmp_path, monkeypatch):
    _, d = probed(tokenizer, tmp_path, monkeypatch, {4: 100.0, 2: 100.0, 1: 100.0}, noise=0.3)
    assert d["new"] == d["old"] and "no split faster beyond the noise" in d["reason"]


def test_a_probe_that_cannot_pay_stops_after_the_configured_split(tokenizer, tmp_path, monkeypatch, capsys):
    # a planted 1 ms of split-dependent time per step × 3 steps: no split can repay one more visit
    trainer, d = probed(tokenizer, tmp_path, monkeypatch, {4: 0.0005, 2: 0.001, 1: 0.002})
    assert [t["split"]["micro_batch"] for t in d["trials"]] == [2] and d["new"] == d["old"]
    assert "probe skipped" in d["reason"] and "probe skipped" in capsys.readouterr().out
    assert "× 3 steps = " in d["reason"] and "measuring one more split 3 times" in d["reason"]   # the figures
    assert trainer.state.global_step == 3


def test_probe_patience_never_skips_the_configured_split(tokenizer, tmp_path, monkeypatch):
    # every other split planted slower: the configured one is still measured (first) and kept
    _, d = probed(tokenizer, tmp_path, monkeypatch, {4: 300.0, 2: 100.0, 1: 300.0}, probe_patience=1)
    assert d["trials"][0]["split"]["micro_batch"] == 2 and len(d["trials"][0]["samples"]) >= 1
    assert d["new"] == d["old"]


def test_the_probe_setup_is_part_of_its_cost_and_of_the_plan(tokenizer, tmp_path, monkeypatch, capsys):
    # the same planted splits as above (4×1 twice as fast, 600 planted s to gain), but a planted 1000 s setup
    # (the longest-examples scan): the probe reports it and cannot pay for another split
    wall = {"offset": 0.0}
    real_wall, real_longest = probe.WALL, probe._longest

    def slow_longest(dataset, count):
        wall["offset"] += 1000.0
        return real_longest(dataset, count)

    monkeypatch.setattr(probe, "WALL", lambda: real_wall() + wall["offset"])
    monkeypatch.setattr(probe, "_longest", slow_longest)
    trainer, d = probed(tokenizer, tmp_path, monkeypatch, {4: 100.0, 2: 200.0, 1: 400.0})
    assert d["setup_sec"] >= 1000.0 and d["probe_sec"] >= d["setup_sec"] + d["trials"][0]["cost_sec"]
    assert [t["split"]["micro_batch"] for t in d["trials"]] == [2] and d["new"] == d["old"]
    assert "probe skipped" in d["reason"] and "setup and first visit (100" in d["reason"]
    assert trainer.state.global_step == 3
