"""The analysis on real CPU runs: short completions (a note, not a finding), a slow dataset (input-bound), and a
GRPO run that cannot learn (every reward 0) with the MPS-only ``pad_to_multiple_of`` on a CPU."""
import torch

from hf_perf_callbacks import ThroughputMeter, default_callbacks, keys
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.core.splitfile import RANKED_UNITS, trial_figures
from hf_perf_callbacks.report import check, measurements_from_run, write_analysis
from hf_perf_callbacks.tiny import build_model
from tests.conftest import PlantedClock, make_grpo, make_trainer


def test_short_completions_are_a_note_with_the_cap(tokenizer, tmp_path):
    model = build_model(tokenizer)
    eos = tokenizer.eos_token_id

    def favour_eos(module, inputs, logits):    # EOS becomes likely: completions end after a few tokens
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[eos] = 6.0
        return logits + bias

    model.lm_head.register_forward_hook(favour_eos)
    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=6,
                        completion=64, model=model)
    trainer.train()
    trainer.save_state()
    m = measurements_from_run(str(tmp_path))
    assert m.max_completion_length == 64 and m.completion_max is not None and m.completion_max < 16
    findings, notes = check(m)
    assert "completion_budget" not in [f.rule for f in findings]         # no completion reached the limit
    note = {n.rule: n for n in notes}["completion_budget"]
    assert note.judged and "`max_completion_length: " in note.text           # checked and fine, with the cap
    path, _, _ = write_analysis(read_run(tmp_path))
    assert note.text in open(path).read()


def test_slow_dataset_yields_the_input_bound_finding(tokenizer, tmp_path):
    # each example costs 1 planted second, far above any real step time; warmup (decided on CPU time on a CPU
    # device, which a loaded machine makes noisy) is capped at 2 steps, which the meter confirms by step 10 at the
    # latest (2 + two windows of 4): this test is about data wait, not warmup, and the timing rules need warmup over
    clock = PlantedClock()
    callbacks = default_callbacks(AdaptiveBatchTuner={"tune": False},
                                  ThroughputMeter={"clock": clock, "max_warmup_steps": 2})
    trainer = make_trainer(tokenizer, tmp_path, callbacks, max_steps=13, delay=1.0, clock=clock)
    trainer.train()
    trainer.save_state()
    findings = {f.rule: f for f in check(measurements_from_run(str(tmp_path)))[0]}
    f = findings["input_bound"]
    assert f.setting["dataloader_num_workers"] == 2 and f.predicted_gain > 1.4


def test_a_run_that_cannot_learn_is_the_first_finding(tokenizer, tmp_path):
    # seen: every reward 0 for 12 steps (frac_reward_zero_std 1, loss and grad norm 0) reported as "Healthy run";
    # the recipe's MPS-only pad_to_multiple_of 32 on a CPU is named as the padding's cause
    def zero_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=4,
                        bs=2, ga=2, num_generations=2, reward=zero_reward, extra={"pad_to_multiple_of": 32})
    trainer.train()
    trainer.save_state()
    m = measurements_from_run(str(tmp_path))
    assert m.pad_to_multiple_of == 32 and m.steps_per_generation == 2 and m.no_signal_run == 4
    findings, _ = check(m)
    assert findings[0].rule == "no_learning" and findings[0].priority == 0
    # a reward no sample of the run has moved: more samples or a higher temperature cannot help it
    assert "num_generations" not in findings[0].setting and "temperature" not in findings[0].setting
    assert findings[0].setting == {} and findings[0].expected_gain is None     # (its wording: test_analysis.py)
    padding = {f.rule: f for f in findings}["padding_waste"]
    assert padding.setting == {"pad_to_multiple_of": None} and "MPS" in padding.root_cause
    path, _, _ = write_analysis(read_run(tmp_path))
    text = open(path).read()
    assert "Healthy" not in text and f"## 1. {findings[0].title}" in text
    m = measurements_from_run(str(tmp_path))         # the trainer's logs from the step lines (`log/<key>`)
    assert m.rewards.logs == 4 and m.no_signal_run == 4 and keys.TRAINER_LOG + "reward" in m.logged


def _report(tmp_path):
    path, findings, notes = write_analysis(read_run(tmp_path))
    return open(path).read(), findings, notes


def test_a_short_trainer_run_is_too_short_to_judge_and_says_so_the_same_way_twice(tokenizer, tmp_path):
    # seen: a "1.05x (calibrated, medium confidence)" finding from 2 steps with warmup unfinished; two identical
    # 2-step runs with different top findings; "No warmup: the first step ran at the steady speed" while the meter
    # said warmup was unfinished; "the run's rewards vary" and "Track perf/steady_tokens_per_sec" on a Trainer run
    results = []
    for name in ("a", "b"):
        trainer = make_trainer(tokenizer, tmp_path / name, default_callbacks(AdaptiveBatchTuner={"tune": False}),
                               max_steps=2)
        trainer.train()
        text, findings, notes = _report(tmp_path / name)
        m = measurements_from_run(str(tmp_path / name))
        assert m.warmup_done is False and m.steps == 2
        assert "Warmup was not finished after 2 steps" in text and "No warmup" not in text
        assert "Too few steps to judge (warmup was not finished after 2 steps)" in text
        assert "reward" not in text.lower()                      # a Trainer run: no GRPO words
        for metric in (keys.PERF_STEADY_TOKENS_PER_SEC, keys.PERF_TOKENS_PER_SEC):
            assert f"`{metric}`" not in text or metric in m.logged
        assert all(f.expected_gain is None for f in findings)   # no gain from a run this short
        results.append(([(f.rule, f.title, f.setting, f.env) for f in findings], [n.title for n in notes]))
    assert results[0] == results[1]


class FixedLength:
    """A collator that pads every batch to ``length`` positions (tokenizer.pad with padding="max_length")."""

    def __init__(self, tokenizer, length):
        from transformers import DataCollatorForLanguageModeling

        self.inner = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        self.tokenizer, self.length = tokenizer, length

    def __call__(self, features):
        batch = self.tokenizer.pad(features, padding="max_length", max_length=self.length, return_tensors="pt")
        return self.inner([{k: v[i] for k, v in batch.items()} for i in range(len(features))])


def test_fixed_length_padding_gets_per_batch_padding_first(tokenizer, tmp_path):
    # seen: a collator padding every batch to 128 positions (~28 real tokens) advised `group_by_length` (0.98x
    # measured: grouping cannot shorten a fixed length) before per-batch padding (2.32x)
    trainer = make_trainer(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=3)
    trainer.data_collator = FixedLength(tokenizer, 128)
    trainer.train()
    m = measurements_from_run(str(tmp_path))
    assert m.fixed_seq_len == 128 and m.pad_fraction > 0.5
    f = {f.rule: f for f in check(m)[0]}["padding_waste"]
    assert f.title == "Padding to a fixed length" and f.setting == {}      # a code change, not a config key
    first = f.recommendation.splitlines()[0]
    assert "pad per batch" in first and "group_by_length" not in first
    assert "group_by_length" not in str(f.setting) and "`perf/seq_len` 128 on all 3 steps" in f.observation


def test_a_grpo_run_without_trainer_state_reads_its_rewards_from_the_perf_log(tokenizer, tmp_path):
    # seen: "No bottleneck found … the run's rewards vary" on a GRPO run whose rewards were all 0, with no
    # trainer_state.json to read them from (save_strategy "no"); the constant reward then got settings that cannot
    # move it (num_generations, temperature)
    def zero_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(AdaptiveBatchTuner={"tune": False}), max_steps=3,
                        bs=2, ga=1, num_generations=2, reward=zero_reward)
    trainer.train()                                    # no save_state(), save_strategy "no": no trainer_state.json
    assert not (tmp_path / "trainer_state.json").exists()
    text, findings, notes = _report(tmp_path)
    m = measurements_from_run(str(tmp_path))
    assert m.rewards.logs == 3 and m.rewards.max == 0.0
    f = findings[0]
    assert f.rule == "no_learning" and f"## 1. {f.title}" in text
    assert "num_generations" not in f.setting and "temperature" not in f.setting


def test_the_tuners_record_of_a_real_tuning_run_is_what_the_analysis_reports(tokenizer, tmp_path):
    # seen: every measured split shown as "failed" (the note read a field the writer had renamed); a micro-batch of
    # 8 advised right after the run ran out of memory at 4. The record here is the real writer's (SplitRecord):
    # 4×2 runs out of memory (planted), the tuner goes back to 2×4 and measures the splits on the run's own steps
    from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
    from tests.test_tuner import CUDA_OOM, PlantedOOM, PlantedStepTime

    clock = PlantedClock()
    plant = PlantedOOM(limit=2, text=CUDA_OOM)
    callbacks = [plant, PlantedStepTime(clock, {8: 50.0, 4: 100.0, 2: 200.0, 1: 400.0}),
                 AdaptiveBatchTuner(clock=clock), ThroughputMeter(clock=clock)]
    train_with_tuning(plant.attach(make_trainer(tokenizer, tmp_path, callbacks, max_steps=30, bs=2, ga=4)))
    m = measurements_from_run(str(tmp_path))
    assert m.tune is not None and {d.kind for d in m.memory_limits} == {"oom"}
    assert min(d.old.micro_batch for d in m.memory_limits) == 4                  # the planted limit: above 2
    findings, notes = check(m)
    # the trial of 1×8 (400 s a step against 200) cost more than the 30-step run can save: a finding with its cost,
    # no "checked and fine"
    f = {f.rule: f for f in findings}["tuning_cost"]
    assert "small_micro_batch" not in [n.rule for n in notes]
    assert f"cost {m.tune.cost_sec:.1f} s" in f.observation and "failed" not in f.observation
    assert (f.facts.decision.new, f.facts.decision.step, f.facts.cost_sec) == (Split(2, 4), m.tune.step,
                                                                               m.tune.cost_sec)
    assert m.tune.new == m.tune.old                 # kept, not switched
    figures = {t.label: t for t in trial_figures(m.tune)}           # every trial as every reader prints it
    assert all(t.words() in f.observation for t in figures.values())
    assert not figures["4×2"].measured and not next(t.fits for t in m.tune.trials if t.split.micro_batch == 4)
    assert [t for t in figures.values() if t.measured]
    assert all(t.unit == RANKED_UNITS["step"] for t in figures.values())   # a Trainer run: the whole step was ranked
    for f in findings:                                     # nothing at or above the micro-batch that ran out
        assert f.setting.get("per_device_train_batch_size", 0) < 4


def test_the_tuner_on_a_plain_train_says_once_that_it_needs_train_with_tuning(tokenizer, tmp_path, caplog, capsys):
    # seen: AdaptiveBatchTuner() passed to a plain trainer.train() did nothing and said nothing (no tuner summary,
    # nothing in the report)
    import logging

    from hf_perf_callbacks import AdaptiveBatchTuner
    from hf_perf_callbacks.core.wording import TUNER_NEEDS_TRAIN_WITH_TUNING
    from hf_perf_callbacks.report import report_command

    tuner = AdaptiveBatchTuner()
    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), tuner], max_steps=2, bs=2, ga=1)
    with caplog.at_level(logging.INFO, logger="hf_perf_callbacks"):
        trainer.train()
        trainer.args.max_steps = 3
        trainer.train(resume_from_checkpoint=None)          # a second plain train() call: said once, not again
    said = [r for r in caplog.records if TUNER_NEEDS_TRAIN_WITH_TUNING.split(":")[0] in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]      # a note, not a warning: nothing was lost
    events = [e for e in read_run(tmp_path).events if e.source == "tuner"]
    assert [e.details.get("needs") for e in events] == ["train_with_tuning"]
    assert [e.message for e in events] == [TUNER_NEEDS_TRAIN_WITH_TUNING]
    assert report_command(str(tmp_path), plots=False) == 0
    out = capsys.readouterr().out
    hint = {n.rule: n for n in check(measurements_from_run(str(tmp_path)))[1]}["tuner_hint"]
    assert not hint.judged and hint.title.lower() in out and "train_with_tuning" in hint.title
    assert hint.title in open(tmp_path / "perf_report.md").read()
    # under train_with_tuning it says nothing of the kind
    from hf_perf_callbacks import train_with_tuning

    caplog.clear()
    managed = make_trainer(tokenizer, tmp_path / "managed", [AdaptiveBatchTuner()], max_steps=2, bs=2, ga=1)
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        train_with_tuning(managed)
    assert not [r for r in caplog.records if "train_with_tuning(trainer)" in r.getMessage()]
