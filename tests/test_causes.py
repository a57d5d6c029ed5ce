"""The report names the true cause of the seconds it counts, ranked by what they cost: real tiny runs with a planted
cost (on the meter's clock, so no load on the machine can shrink it) in one place — a reward function, a compile and a
recompile (child processes' CPU time), DataLoader workers, a callback beside a slow save, ``compute_metrics`` — give
the planted seconds in the phase they belong to, the finding that names that cause ranked by its seconds, and, where
a gain is printed, a second run with the printed setting applied pays it within 25%."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from transformers import Trainer, TrainerCallback

from hf_perf_callbacks import ThroughputMeter, keys
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.report.reading import measurements_from_run
from hf_perf_callbacks.report.render import console_summary, render_markdown
from hf_perf_callbacks.report.rules import check
from hf_perf_callbacks.report.words import stake_words
from tests.conftest import PlantedClock, TextDataset, make_grpo, make_trainer, varied_reward
from tests.synthetic_runs import Plan

#: a tuning that keeps the configured split (its words: golden/tuned_kept.md)
KEPT = Plan(steps=80, tune=True, must_pay=False, noise=0.25, warmup=(2.0,))
COST = 100.0                  # planted seconds: far above a tiny step on any machine, so no conclusion can flip


def analysed(output_dir):
    m = measurements_from_run(str(output_dir))
    found, notes = check(m)
    return m, found, {f.rule: f for f in found}, {n.rule: n for n in notes}


def burn_in_child(clock: PlantedClock, cpu_sec: float) -> float:
    """A child process that works ``cpu_sec`` CPU seconds (as inductor's compile workers or a DataLoader worker do),
    its wall seconds planted at exactly its CPU seconds as the OS counted them (a free core's time, whatever else the
    machine runs); returns those CPU seconds."""
    code = ("import time\nend = time.process_time() + float(__import__('sys').argv[1])\n"
            "while time.process_time() < end:\n    pass\n")
    before, times = clock.wall(), os.times()
    subprocess.run([sys.executable, "-c", code, str(cpu_sec)], capture_output=True, check=True)
    after = os.times()
    child = after.children_user + after.children_system - times.children_user - times.children_system
    clock.spend(child - (clock.wall() - before))               # the step's wall time grows by the CPU seconds
    return child


# ---------------------------------------------------------------------------------------------- reward functions

def test_a_slow_reward_is_the_reward_phase_and_its_finding_ranks_by_its_cost(tokenizer, tmp_path):
    """A GRPO reward function costing COST planted seconds a call: its seconds are the reward phase (not compute),
    and the reward finding comes first, with its share of the run."""
    clock = PlantedClock()

    def slow_reward(prompts, completions, completion_ids=None, **kwargs):
        clock.spend(COST)
        return varied_reward(prompts, completions, completion_ids)

    make_grpo(tokenizer, tmp_path, [ThroughputMeter(clock=clock, warmup_window=2, max_warmup_steps=2)], max_steps=6,
              reward=slow_reward).train()
    m, found, by_rule, _ = analysed(tmp_path)
    run = read_run(str(tmp_path))
    reward_sec = [v for v in run.column(keys.PERF_REWARD_SEC) if v == v]
    assert m.reward_calls == 6 and sum(reward_sec) == pytest.approx(6 * COST, rel=0.01)
    assert m.phase_sec["reward"] == pytest.approx(6 * COST, rel=0.01)          # the planted seconds, in their phase
    assert m.phase_sec["compute"] < 0.01 * m.phase_sec["reward"]                # not forward/backward/optimizer
    f = by_rule["reward"]
    assert found[0] is f and f.stake_sec == pytest.approx(6 * COST, rel=0.01)
    assert f.share == pytest.approx(f.stake_sec / m.wall_sec) and f.share > 0.9
    assert f.setting == {"steps_per_generation": 4} and f.expected_gain is None     # 2 × the run's 2
    assert f.facts.calls == 6 and f.facts.reward_sec / 6 == pytest.approx(COST, rel=0.01)


# ---------------------------------------------------------------------------------------------- child processes

class BurningText(TextDataset):
    """Examples whose loading costs ``burn`` CPU seconds in the process that loads them (a DataLoader worker)."""

    def __init__(self, tokenizer, n, burn):
        super().__init__(tokenizer, n=n)
        self.burn = burn

    def __getitem__(self, i):
        end = time.process_time() + self.burn
        while time.process_time() < end:
            pass
        return super().__getitem__(i)


def test_the_cpu_clock_counts_the_dataloader_workers(tokenizer, tmp_path):
    """Two DataLoader workers each burn 0.1 CPU seconds an example: their CPU time is in the meter's CPU clock
    (``perf/child_cpu_sec``, part of ``perf/cpu_sec``), where ``time.process_time`` alone misses it."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from hf_perf_callbacks.tiny import build_model
    from tests.conftest import padded

    burn, steps, per_step = 0.1, 4, 4
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_num_workers=2)
    Trainer(model=build_model(tokenizer), args=args, train_dataset=BurningText(tokenizer, steps * per_step, burn),
            data_collator=DataCollatorForLanguageModeling(padded(tokenizer, "right"), mlm=False),
            callbacks=[ThroughputMeter()]).train()
    lines = read_run(str(tmp_path)).unique_steps()
    child = sum(s.number(keys.PERF_CHILD_CPU_SEC) or 0.0 for s in lines)
    planted = burn * steps * per_step
    assert planted <= child <= planted * 1.25 + 0.5             # the workers' own start-up on top
    assert all(s.number(keys.PERF_CPU_SEC) >= s.number(keys.PERF_CHILD_CPU_SEC) for s in lines)


#: a planted compile's CPU seconds in a child process (real work: the OS counts it)
COMPILE_CPU_SEC = 3.0


class Compiled(Trainer):
    """A Trainer whose every micro-batch costs 0.5 planted seconds of compute (wall and CPU time alike), and whose
    steps in ``compiles`` also wait for a child process working ``cpu_sec`` CPU seconds (a compile's workers)."""

    clock: PlantedClock
    compiles: dict[int, float]         # step → the child's CPU seconds (replaced by what the OS counted)

    def training_step(self, *args, **kwargs):
        self.clock.spend(0.5)
        self.clock.spend_cpu(0.5)
        step = self.state.global_step + 1
        if step in self.compiles and self.compiles[step] == COMPILE_CPU_SEC:
            self.compiles[step] = burn_in_child(self.clock, COMPILE_CPU_SEC)
        return super().training_step(*args, **kwargs)


def test_a_compile_and_a_recompile_are_called_what_they_are_never_contention(tokenizer, tmp_path, one_thread):
    """``torch_compile: true`` (dynamo, eager backend: a real compile without a C++ toolchain's minutes), and at
    steps 1 and 12 a child process working ``COMPILE_CPU_SEC`` CPU seconds while the step waits, as inductor's compile
    workers do: the first is the warmup note's one-time compile, the second a recompile finding for step 12 with its
    seconds; neither is contention."""
    trainer = make_trainer(tokenizer, tmp_path, [], max_steps=16, bs=2, ga=1, length=16, trainer_cls=Compiled,
                           extra={"torch_compile": True, "torch_compile_backend": "eager"})
    clock = PlantedClock(cpu_only_planted=True, wall_only_planted=True)   # the machine's own seconds add nothing
    trainer.clock, trainer.compiles = clock, {1: COMPILE_CPU_SEC, 12: COMPILE_CPU_SEC}
    trainer.add_callback(ThroughputMeter(clock=clock, warmup_window=3, max_warmup_steps=3))
    trainer.train()
    m, found, by_rule, notes = analysed(tmp_path)
    child = trainer.compiles
    assert m.torch_compile and m.warmup_child_cpu_sec == pytest.approx(child[1], rel=0.03)   # step 1's child
    blamed = set(m.contention.step_list) if m.contention else set()        # other processes' steps, if any
    for result in (by_rule.get("contention"), notes.get("contention")):
        blamed |= {s for a, b in (result.steps if result else []) for s in range(a, b + 1)}
    assert not blamed & {1, 12}
    warmup = notes["warmup"].facts                  # its words: golden/rules.md, "warmup_compile"
    assert warmup.compile is True and warmup.child_cpu_sec == pytest.approx(child[1], rel=0.03)
    assert [r.step for r in m.recompiles] == [12]
    assert m.recompiles[0].excess_sec == pytest.approx(child[12], rel=0.03)
    f = by_rule["compile"]                          # 3 s of a ~14 s run: a finding, ranked by its seconds
    assert f.reason == "recompiles" and f.steps == [(12, 12)]
    assert f.stake_sec == pytest.approx(m.recompiles[0].excess_sec) and found[0] is f


# ---------------------------------------------------------------------------------------------- ranking

def test_a_callback_taking_most_of_the_run_ranks_before_a_smaller_measured_saving(tokenizer, tmp_path):
    """seen: a user callback taking 41% of the run came third, after smaller findings with a printed gain: a "try"
    finding ranks by its seconds too."""
    clock = PlantedClock()

    class CostlyStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.spend(COST)

    class SlowSave(Trainer):
        def save_model(self, *args, **kwargs):
            clock.spend(COST / 4)
            return super().save_model(*args, **kwargs)

    make_trainer(tokenizer, tmp_path, [ThroughputMeter(clock=clock), CostlyStepEnd()], max_steps=8, bs=2, ga=1,
                 trainer_cls=SlowSave, extra={"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1}).train()
    m, found, by_rule, _ = analysed(tmp_path)
    callbacks, saving = by_rule["callbacks"], by_rule["saving"]
    assert callbacks.expected_gain is None and saving.expected_gain is not None       # try, and measured
    assert found.index(callbacks) < found.index(saving)
    assert callbacks.stake_sec == pytest.approx(8 * COST, rel=0.01) and callbacks.share > 0.5
    assert saving.stake_sec < callbacks.stake_sec and saving.share == pytest.approx(saving.stake_sec / m.wall_sec)
    text, console = render_markdown(found, m), console_summary(found)     # each with its share (golden: rules.md)
    assert all(stake_words(f) in text and f"{f.share:.0%}" in console for f in (callbacks, saving))


# ---------------------------------------------------------------------------------------------- the printed gains

def eval_trainer(tokenizer, output_dir, clock, eval_steps, max_steps=8):
    """A Trainer evaluating every ``eval_steps`` steps whose ``compute_metrics`` costs COST planted seconds."""
    def slow_metrics(prediction):
        clock.spend(COST)
        return {"size": float(len(prediction.predictions))}

    trainer = make_trainer(tokenizer, output_dir, [ThroughputMeter(clock=clock)], max_steps=max_steps, bs=2, ga=1,
                           with_eval=True, extra={"eval_strategy": "steps", "eval_steps": eval_steps,
                                                  "per_device_eval_batch_size": 8})
    trainer.compute_metrics = slow_metrics
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    return trainer


def test_compute_metrics_is_named_and_the_printed_eval_steps_pays_what_it_says(tokenizer, tmp_path):
    clock = PlantedClock()
    eval_trainer(tokenizer, tmp_path / "a", clock, eval_steps=1).train()
    m, _, by_rule, _ = analysed(tmp_path / "a")
    assert m.compute_metrics_sec == pytest.approx(8 * COST, rel=0.01)       # 8 evaluations: its planted seconds
    assert m.phase_sec["eval"] >= m.compute_metrics_sec                      # inside the evaluation phase
    f = by_rule["evaluation"]
    assert "`compute_metrics` took" in f.recommendation and "preprocess_logits_for_metrics" not in f.recommendation
    new = f.setting["eval_steps"]
    clock = PlantedClock()
    eval_trainer(tokenizer, tmp_path / "b", clock, eval_steps=new).train()
    advised = measurements_from_run(str(tmp_path / "b"))
    assert advised.evaluation.evals == f.facts.interval.events_after     # the last evaluation at the end counted
    measured = m.wall_sec / advised.wall_sec
    assert measured == pytest.approx(f.expected_gain, rel=0.25)


def test_the_printed_save_steps_pays_what_it_says_with_the_last_save_counted(tokenizer, tmp_path):
    clock = PlantedClock()

    class SlowSave(Trainer):
        def save_model(self, *args, **kwargs):
            clock.spend(COST)
            return super().save_model(*args, **kwargs)

    def run(out, save_steps):
        make_trainer(tokenizer, out, [ThroughputMeter(clock=clock)], max_steps=8, bs=2, ga=1, trainer_cls=SlowSave,
                     extra={"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 1}).train()
        return measurements_from_run(str(out))

    m = run(tmp_path / "a", 1)
    f = {x.rule: x for x in check(m)[0]}["saving"]
    advised = run(tmp_path / "b", f.setting["save_steps"])
    assert advised.saves == f.facts.interval.events_after >= 1                      # transformers saves at the end too
    assert m.wall_sec / advised.wall_sec == pytest.approx(f.expected_gain, rel=0.25)


# ---------------------------------------------------------------------------------------------- words from data
# Each sentence the field reports contradicted itself with, on the data that produced it.

def test_groups_flat_while_prompts_score_differently_say_both_means_apart(tokenizer, tmp_path):
    """seen: "mean reward 0; the mean reward differed between logs": each figure is of other logs. A reward that is
    the same for every completion of a prompt and differs between prompts: every group flat, the logs' means apart."""
    def per_prompt(prompts, completions, **kwargs):
        return [float(len(p) % 3) for p in prompts]

    make_grpo(tokenizer, tmp_path, [ThroughputMeter()], max_steps=6, reward=per_prompt).train()
    m, _, by_rule, _ = analysed(tmp_path)
    f = by_rule["no_learning"]
    assert f.reason == "no_group_variance"
    rewards = [v for v in read_run(str(tmp_path)).column(keys.TRAINER_LOG + "reward") if v == v]
    assert len(rewards) == 6 and max(rewards) > min(rewards)
    # the words name each figure with the logs it is of (golden/rules.md, "no_learning"): the mean of the flat logs,
    # here every log, and the range over all of them
    assert f.facts.no_signal_run == f.facts.logs == 6 and f.facts.reward_varied is True
    assert f.facts.reward_mean == pytest.approx(sum(rewards) / 6)
    assert (f.facts.reward_min, f.facts.reward_max) == pytest.approx((min(rewards), max(rewards)))
    assert f"{min(rewards):.3g} to {max(rewards):.3g}" in f.observation


def test_warmup_steps_inside_the_steady_band_are_a_speed_that_settled():
    """seen: "warmup took 3 steps; 5.0 s above steady time" for steps inside the steady band. Decided on CPU time
    (the first two steps did twice the work) while their wall time stayed within 10% of the steady step: the speed
    settled, at no cost worth naming, and the overhead is the few hundredths their CPU time explains."""
    from hf_perf_callbacks.core.wording import warmup_case, warmup_words
    from tests.test_timeline import run_cpu_steps

    tl = run_cpu_steps([1.05, 1.05, 1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert tl.warmup_steps == 2 and tl.warmup_in_band is True
    assert tl.warmup_overhead == pytest.approx(0.1)                 # 2 × (1.05 − 1.0): wall above steady, CPU-explained
    assert warmup_case(tl.warmup_steps, tl.first_step_slowdown, tl.warmup_in_band) == "settled"
    words = warmup_words(tl.warmup_steps, tl.first_step_slowdown, tl.warmup_overhead, in_band=True, tolerance=0.1)
    assert f"{tl.warmup_overhead:.1f} s" not in words                # no cost named (golden/rules.md: "warmup_in_band")
    slow = run_cpu_steps([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert slow.warmup_in_band is False
    assert warmup_case(slow.warmup_steps, slow.first_step_slowdown, slow.warmup_in_band) == "warmup"


def test_a_tuning_that_kept_the_split_expects_no_saving_and_says_so(tmp_path):
    """seen: the console's "could plausibly save 0.169 s/step" beside the report's "expected saving 0.0 s": a tuning
    that kept the configured split saves nothing, and the report says that, not a zero saving."""
    from hf_perf_callbacks.core.splitfile import read_split_file
    from hf_perf_callbacks.report.command import report_command
    from tests.synthetic_runs import write_run

    out = write_run(str(tmp_path / "run"), KEPT)
    decision = read_split_file(out).last("tune")
    assert decision.new == decision.old and decision.expected_gain_sec == 0.0
    assert report_command(out, plots=False) == 0
    f = {x.rule: x for x in check(measurements_from_run(out))[0]}["tuning_cost"]
    assert f.facts.decision.new == f.facts.decision.old and f.facts.saving_sec == 0.0   # words: golden/tuned_kept.md


def test_counts_of_one_are_said_in_the_singular(tmp_path):
    """seen: "1 prompts" (the launcher's description of a recipe whose generation batch is one prompt group) and
    "(1 logs)" (the summary's completion line of a run that logged once)."""
    from hf_perf_callbacks.report.summary import _completion_line
    from hf_perf_callbacks.train import launch

    recipe, args, model_args = launch.parse_recipe(["--config", "mac-16gb-qwen1.5b", "--use_cpu", "true", "--bf16",
                                                    "false", "--output_dir", str(tmp_path)])
    assert args.generation_batch_size == args.num_generations == 8
    assert "= 1 prompt × 8;" in launch._describe(recipe, args, model_args, [])
    assert _completion_line([{"completions/mean_length": 20.0, "completions/max_length": 24.0}]).startswith(
        "completions (1 log): ")


@pytest.mark.launch
def test_a_real_inductor_compile_is_counted_in_the_cpu_clock_and_not_called_contention(tokenizer, tmp_path,
                                                                                         one_thread):
    """``torch_compile: true`` with inductor (a C++ toolchain's compile workers, child processes): seen as 48 s of
    wall for 9 s of the process's CPU on steps 1–2 and called "CPU contention ... 3.08x". Their CPU time is in the
    meter's CPU clock, so the first steps are the compile the warmup note names, not contention. (Slow: a minute of
    compiling on a 2-core CPU.)"""
    make_trainer(tokenizer, tmp_path, [ThroughputMeter(warmup_window=2, max_warmup_steps=3)], max_steps=8, bs=2, ga=1,
                 length=16, extra={"torch_compile": True}).train()
    m, _, by_rule, notes = analysed(tmp_path)
    lines = read_run(str(tmp_path)).unique_steps()
    assert lines[0].number(keys.PERF_CHILD_CPU_SEC) > 1.0                 # inductor's compile of the first step
    assert m.torch_compile and notes["warmup"].facts.compile is True
    assert not (m.contention and 1 in m.contention.step_list) and "contention" not in by_rule
