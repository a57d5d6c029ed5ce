"""One figure, one definition: the meter's console summary, its last step line (what TensorBoard/W&B got),
``figures()`` (``hf-perf report``, the plots, ``perf_report.md``) agree on real tiny runs, finished or killed; a run
whose warmup did not finish says so everywhere."""
import json
import os

import pytest

from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter, keys
from hf_perf_callbacks.core.runlog import PERF_LOG, read_run
from hf_perf_callbacks.core.wording import throughput_line, warmup_line
from hf_perf_callbacks.report import summarize
from hf_perf_callbacks.report.figures import figures, steady_steps
from tests.conftest import make_grpo, make_trainer

# warmup always ends within 8 steps, however loaded the machine: decided at the latest at step 6, capped at 2
CAPPED = {"warmup_window": 2, "max_warmup_steps": 2}


def log_lines(output_dir, kind):
    with open(os.path.join(output_dir, PERF_LOG), encoding="utf-8") as f:
        return [x for x in map(json.loads, f) if x["type"] == kind]


def killed_copy(output_dir, tmp_path):
    """The same log without its summaries: what a run killed after its last step leaves."""
    with open(os.path.join(output_dir, PERF_LOG), encoding="utf-8") as f:
        (tmp_path / PERF_LOG).write_text("".join(line for line in f if '"type": "summary"' not in line))
    return read_run(str(tmp_path))


@pytest.fixture(scope="module")
def trainer_run(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_run")
    meter = ThroughputMeter(**CAPPED)
    trainer = make_trainer(tokenizer, out, [meter, MemoryWatchdog()], max_steps=8, bs=2, ga=1)
    trainer.train()
    return str(out), meter, trainer


@pytest.fixture(scope="module")
def grpo_run(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_run")
    meter = ThroughputMeter(**CAPPED)
    trainer = make_grpo(tokenizer, out, [meter], max_steps=8, bs=2, ga=1, num_generations=2, completion=8)
    trainer.train()
    return str(out), meter, trainer


@pytest.mark.parametrize("which", ["trainer_run", "grpo_run"])
def test_console_summary_step_line_reporters_and_figures_agree(which, request, tmp_path):
    output_dir, meter, trainer = request.getfixturevalue(which)
    s, f = meter.summary, figures(read_run(output_dir))
    assert s["warmup_done"] and f.warmup_done
    for key in ("steady_tokens_per_sec", "steady_step_sec", "warmup_steps", "first_step_slowdown",
                "warmup_overhead_sec", "mean_tokens_per_sec", "steps"):
        assert getattr(f, key) == s[key], key
    assert f.warmup_end_step == s["first_steady_step"] and f.contention_sec == s["early_contention_sec"]
    # one definition: steady tokens/s × steady step time = the mean tokens of a steady step
    steps = {x["step"]: x for x in log_lines(output_dir, "step")}
    steady = f.steady_steps
    assert len(steady) == s["steady_step_count"] and steady[0] == f.warmup_end_step and steady[-1] == 8
    mean_tokens = sum(steps[k][keys.PERF_TOKENS] for k in steady) / len(steady)
    assert f.steady_tokens_per_sec * f.steady_step_sec == pytest.approx(mean_tokens)
    assert f.steady_step_sec == pytest.approx(sum(steps[k][keys.PERF_TRAIN_SEC] for k in steady) / len(steady))
    # the last step line and the reporters (log_history) carry the same values
    last = steps[8]
    published = [h for h in trainer.state.log_history if keys.PERF_STEADY_TOKENS_PER_SEC in h][-1]
    for key, name in ((keys.PERF_STEADY_TOKENS_PER_SEC, "steady_tokens_per_sec"),
                      (keys.PERF_STEADY_STEP_TIME, "steady_step_sec"), (keys.PERF_WARMUP_STEPS, "warmup_steps"),
                      (keys.PERF_FIRST_STEP_SLOWDOWN, "first_step_slowdown")):
        assert last[key] == published[key] == getattr(f, name), key
    # the console and hf-perf report print the same lines
    console = meter.format_summary()
    report = summarize(read_run(output_dir))
    expected = [throughput_line(f.steady_tokens_per_sec, f.steady_step_sec, f.mean_tokens_per_sec),
                warmup_line(True, f.warmup_steps, f.first_step_slowdown, f.warmup_overhead_sec, f.steps,
                            f.contention_sec, in_band=f.warmup_in_band, tolerance=f.warmup_tolerance)]
    for line in expected:
        assert line in console and line in report
    # a killed run (no summary) gives the same figures from its step lines
    killed = figures(killed_copy(output_dir, tmp_path))
    for key in ("steady_tokens_per_sec", "steady_step_sec", "warmup_steps", "warmup_end_step", "steady_steps",
                "first_step_slowdown", "warmup_overhead_sec", "contention_sec", "warmup_done"):
        assert getattr(killed, key) == getattr(f, key), key
    assert killed.mean_tokens_per_sec == pytest.approx(f.mean_tokens_per_sec)


def test_the_steady_range_includes_the_steps_before_the_decision(trainer_run):
    # seen: the steps between warmup's end and its decision were counted steady by the summary, flagged 0 in the log
    output_dir, meter, _ = trainer_run
    lines = log_lines(output_dir, "step")
    first = meter.summary["first_steady_step"]
    decided = next(x["step"] for x in lines if x.get(keys.PERF_WARMUP_DONE) == 1)
    assert decided > first                                           # decided a few steps late
    assert all(x[keys.PERF_STEADY] == 0 for x in lines if first <= x["step"] < decided)   # flagged 0 when written
    assert all(x[keys.PERF_FIRST_STEADY_STEP] == first for x in lines if x["step"] >= decided)
    assert keys.PERF_FIRST_STEADY_STEP not in lines[0]
    assert steady_steps(read_run(output_dir).unique_steps()) == list(range(first, 9))
    header = log_lines(output_dir, "run")[0]
    assert header["torch_threads"] >= 1 and header["cpu_cores"] == os.cpu_count()


def test_unfinished_warmup_says_so_everywhere_and_never_no_warmup(tokenizer, tmp_path, capsys):
    from hf_perf_callbacks.report import report_command
    from hf_perf_callbacks.report.plots import PlotData, plot_throughput

    meter = ThroughputMeter(warmup_window=4)           # 3 steps cannot fill two windows of 4
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=3, bs=2, ga=1)
    trainer.train()
    console = capsys.readouterr().out
    assert "warmup: not finished after 3 steps" in console
    run = read_run(str(tmp_path))
    f = figures(run)
    assert f.warmup_done is False and f.warmup_steps is None and f.steady_tokens_per_sec is None
    assert f.steady_steps == [] and f.warmup_end_step is None
    assert all(keys.PERF_WARMUP_STEPS not in h for h in trainer.state.log_history)
    assert report_command(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "warmup: not finished after 3 steps" in out
    with open(tmp_path / "perf_report.md", encoding="utf-8") as fh:
        written = fh.read()
    assert "not finished" in written
    for text in (console, out, written):
        assert "no warmup" not in text.lower()
    from matplotlib.figure import Figure

    fig = Figure()
    assert plot_throughput(fig, PlotData.of(run)) is None
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert "warmup not finished after 3 steps: no steady figure yet" in notes


def test_a_second_fresh_train_starts_its_counters_over_and_a_resume_keeps_them(tokenizer, tmp_path):
    # seen: a second fresh trainer.train() of one trainer reported "steps: 8" for two 4-step runs
    meter = ThroughputMeter(**CAPPED)
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=4, bs=2, ga=1,
                           extra={"save_strategy": "steps", "save_steps": 4})
    trainer.train()
    first_tokens = meter.summary["tokens"]
    trainer.train()
    assert meter.summary["steps"] == 4 and meter.summary["tokens"] == pytest.approx(first_tokens)
    trainer.args.max_steps = 6
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert meter.summary["steps"] == 6 and meter.timeline.segments == 2      # 4 restored + 2 new
