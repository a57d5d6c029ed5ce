"""The report's plots read at a glance: what each contains (line labels, tick labels, axis units, notes), drawn from
real tiny runs; the tuner's record written by the schema's own serializer (``SplitFile.write``)."""
import psutil
import pytest
from matplotlib.figure import Figure
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys
from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.core.splitfile import RANKED_UNITS, Decision, SplitFile, Trial
from hf_perf_callbacks.report.plots import (
    PHASES_AXIS,
    PlotData,
    _untried_words,
    plot_memory,
    plot_phases,
    plot_throughput,
    plot_tuner,
)
from tests.conftest import make_grpo, make_trainer
from tests.test_throughput import PlantedLoad

CAPPED = {"warmup_window": 2, "max_warmup_steps": 2}       # warmup decided by step 6 on any machine


@pytest.fixture(scope="module")
def run_dir(tokenizer, tmp_path_factory):
    """A real 8-step Trainer run with the meter, the watchdog (default budget: far above a tiny model) and the
    tuner's per-step keys; a warmup planted in steps 1-3 (1000 s of wall time with CPU time behind it), so the
    warmup marker does not depend on how fast this machine's first real step happened to be."""
    out = tmp_path_factory.mktemp("plots_run")
    load = PlantedLoad(slow_steps=3, extra_cpu=1000.0)

    class Inside(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            load.on_step(state.global_step)

    make_trainer(tokenizer, out, [Inside(), ThroughputMeter(**CAPPED, clock=load.clock), MemoryWatchdog(),
                                  AdaptiveBatchTuner(tune=False)], max_steps=8, bs=2, ga=2).train()
    return out


def draw(plot, output_dir):
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    data = PlotData.of(read_run(str(output_dir)))
    assert plot(fig, data) is None
    return fig, data


def labels(ax):
    handles, names = ax.get_legend_handles_labels()
    return names


def integer_ticks(ax):
    return all(float(x).is_integer() for x in ax.get_xticks())


def tuning_record(output_dir, kept=False):
    """A tuning decision at step 6 over the run's steps 1-6, written by the schema's serializer as this run's (its
    perf log's session)."""
    trials = [Trial(Split(2, 2), samples=[2.0, 2.1, 1.9], steps=[1, 2], cost_sec=0.0),
              Trial(Split(4, 1), error="out of memory", fits=False, steps=[3], cost_sec=1.5),
              Trial(Split(1, 4), samples=[1.5, 1.4, 1.6] if not kept else [2.4, 2.5, 2.6], steps=[4, 5, 6],
                    cost_sec=2.0, p_value=0.05, gain=0.25 if not kept else -0.2)]
    new = Split(2, 2) if kept else Split(1, 4)
    SplitFile(session=read_run(str(output_dir)).header().session, world_size=1, configured=Split(2, 2), split=new,
              decisions=[Decision("tune", 6, "measured on the run's steps", Split(2, 2), new, trials=trials,
                                  cost_sec=3.5, expected_gain_sec=40.0)]).write(str(output_dir))


def test_throughput_one_line_on_the_steady_basis_warmup_marked_legend_off_the_data(run_dir):
    # seen: three lines with different definitions, no warmup marker, the legend over the data, fractional ticks
    fig, data = draw(plot_throughput, run_dir)
    ax, f = fig.axes[0], data.f
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label() for line in lines] == ["throughput per step (its tokens / its training s)"]
    expected = [s.number(keys.PERF_TOKENS) / s.number(keys.PERF_TRAIN_SEC) for s in data.steps]
    assert list(lines[0].get_ydata()) == pytest.approx(expected)
    names = labels(ax)
    steady = f.steady_steps
    assert (f"steady figure {f.steady_tokens_per_sec:,.0f} tokens/s: Σ tokens / Σ training s of the {len(steady)} "
            f"steady steps (a slow step weighs by its time)") in names
    assert f.warmup_steps >= 1                    # the planted warmup
    assert f"not in the steady figures: steps 1–{f.warmup_end_step - 1} (warmup; each train() call starts it anew)" \
        in names
    assert ax.get_legend() is None and fig.legends                 # the legend is the figure's, under the plot
    assert integer_ticks(ax) and ax.get_ylabel() == "tokens / s of training time"


def test_throughput_marks_the_steps_the_meter_put_down_to_other_processes(tokenizer, tmp_path):
    load = PlantedLoad(extra_cpu=0.0)                  # steps 1-3: 1000 planted wall seconds each, flat CPU time

    class Inside(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            load.on_step(state.global_step)

    make_trainer(tokenizer, tmp_path, [Inside(), ThroughputMeter(warmup_window=2, clock=load.clock)],
                 max_steps=8).train()
    fig, data = draw(plot_throughput, tmp_path)
    assert data.f.contention_steps == [1, 2, 3]
    marked = [c for c in fig.axes[0].collections if c.get_label().startswith("slowed by other processes")]
    assert len(marked) == 1 and [x for x, _ in marked[0].get_offsets()] == [1, 2, 3]
    assert f"({data.f.contention_sec:.1f} s lost)" in marked[0].get_label()


def test_grpo_throughput_is_per_generation_cycle(tokenizer, tmp_path):
    make_grpo(tokenizer, tmp_path, [ThroughputMeter()], max_steps=4, bs=2, ga=2, num_generations=2,
              completion=6, extra={"steps_per_generation": 4}).train()
    fig, data = draw(plot_throughput, tmp_path)
    line = next(x for x in fig.axes[0].get_lines() if x.get_label().startswith("throughput"))
    assert line.get_label() == "throughput per generation cycle of 2 steps (its tokens / its training s)"
    assert list(line.get_xdata()) == [2, 4]                          # one point per whole cycle, no spikes


def test_memory_scaled_to_its_data_budget_far_away_as_words(run_dir):
    # seen: the budget line flattened a 1.5-3 GB curve into a stripe; "peak" looked like RSS; GB for GiB
    fig, data = draw(plot_memory, run_dir)
    ax = fig.axes[0]
    used = [s.number(keys.MEM_DEVICE_USED_GB) for s in data.steps]
    budget = data.f.budget_gb
    low, high = ax.get_ylim()
    assert budget > 2 * max(used) and high < budget and low > 0.5 * min(used)
    assert "budget" not in " ".join(labels(ax))
    assert f"budget {budget:.2f} GiB (off the scale" in " ".join(t.get_text().replace("\n", " ") for t in ax.texts)
    assert ax.get_ylabel() == "memory (GiB)"
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    assert styles["process memory (RSS)"] != styles["high-water mark (peak so far)"]
    assert integer_ticks(ax)


def test_memory_budget_near_the_data_is_a_labelled_line(tokenizer, tmp_path):
    limit = round(1.25 * psutil.Process().memory_info().rss / 2**30, 2)   # the run's RSS only grows from here
    make_trainer(tokenizer, tmp_path, [MemoryWatchdog(limit_gb=limit)], max_steps=3, bs=2, ga=1).train()
    fig, _ = draw(plot_memory, tmp_path)
    ax = fig.axes[0]
    assert f"budget ({limit:.2f} GiB)" in labels(ax) and ax.get_ylim()[1] >= limit


def test_phases_in_words_without_empty_phases_and_the_tuners_cost(run_dir):
    # seen: raw key names (data_wait), phases that are zero, the tuner's time nowhere
    tuning_record(run_dir)
    fig, data = draw(plot_phases, run_dir)
    ax = fig.axes[0]
    names = labels(ax)
    assert any(n.startswith("forward/backward/optimizer (") for n in names)
    assert not any(n.startswith(("generation", "evaluation", "saving")) for n in names)   # a Trainer run has none
    assert not any("_" in n for n in names)
    assert "steps the tuner measured splits on (1–6)" in names
    notes = " ".join(t.get_text().replace("\n", " ") for t in ax.texts)
    assert "the tuner's own cost: 3.5 s" in notes and "expected saving 40.0 s" in notes
    assert integer_ticks(ax) and ax.get_ylabel() == "seconds per step"


def test_tuner_trials_with_their_times_and_the_split_per_step_in_split_labels(run_dir):
    # seen: the trials drawn as failed (a renamed field), a y-axis mixing samples and micro-batches
    tuning_record(run_dir)
    fig, data = draw(plot_tuner, run_dir)
    trials_ax, split_ax = fig.axes
    ticks = [t.get_text() for t in trials_ax.get_xticklabels()]
    assert ticks == ["2×2\n(before)", "4×1", "1×4\n(chosen)"]
    assert [round(b.get_height(), 3) for b in trials_ax.patches] == [2.0, 0.0, 1.5]
    assert "out of memory" in [t.get_text() for t in trials_ax.texts]
    assert "chose 1×4" in trials_ax.get_title()
    assert [t.get_text() for t in split_ax.get_yticklabels()] == ["2×2"]     # the split this run ran: labels only
    assert split_ax.get_ylabel() == "split" and integer_ticks(split_ax)
    assert "tuned: 2×2 → 1×4" in [t.get_text() for t in split_ax.texts]


def test_a_tuning_that_kept_the_split_draws_no_empty_marker(run_dir):
    # seen: a "4×1 → 4×1" marker that says nothing
    tuning_record(run_dir, kept=True)
    fig, _ = draw(plot_tuner, run_dir)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert not any("→" in t for t in texts)
    assert "kept 2×2" in fig.axes[0].get_title()


# ---------------------------------------------------------------- runs of the tuner (planted: tests/synthetic_runs.py)
def synthetic(tmp_path, name, **plan):
    from tests.synthetic_runs import Plan, write_run

    return write_run(str(tmp_path / name), Plan(**plan))


TUNED = dict(steps=40, tune=True, must_pay=False, split_sec={8: 2.5, 2: 0.3, 1: 1.1}, noise=0.15, warmup=(3.0, 1.0))


def spans(ax):
    """The (first, last) steps of the shaded spans of ``ax``."""
    from matplotlib.patches import Rectangle

    out = []
    for p in ax.patches:
        if isinstance(p, Rectangle) and p.get_alpha() == 0.15:
            out.append((round(p.get_x() + 0.5), round(p.get_x() + p.get_width() - 0.5)))
    return sorted(out)


def test_throughput_draws_the_meters_own_record_and_names_the_switches(tmp_path):
    # seen: steps 1-13 shaded as "warmup (0 steps; steady from step 14)", a subtitle describing step 14 as "the first
    # step", the tuner's restarts drawn but not named
    out = synthetic(tmp_path, "tuned", **TUNED)
    fig, data = draw(plot_throughput, out)
    ax, f = fig.axes[0], data.f
    assert f.call_first_step > 1 and f.not_steady
    assert spans(ax) == f.not_steady                              # exactly the steps the steady figures leave out
    notes = " ".join(t.get_text().replace("\n", " ") for t in ax.texts)           # the subtitle wraps
    assert f"step {f.call_first_step} (the first of the latest train() call)" in notes
    assert f"the steady figures are over {len(f.steady_steps)} steps" in notes
    names = labels(ax)
    assert any(n.startswith(f"{len(data.restarts())} switches between splits by the tuner") for n in names)
    stretches = [t.get_text() for t in ax.texts if "×" in t.get_text() and len(t.get_text()) <= 4]
    assert stretches[0] == "4×2" and len(stretches) == len(data.restarts()) + 1
    steady = next(c for c in ax.collections if c.get_label().startswith("steady figure"))
    (x0, _), (x1, _) = steady.get_segments()[0]
    assert (x0 + 0.5, x1 - 0.5) == (f.steady_steps[0], f.steady_steps[-1])


def test_phases_shade_only_the_steps_the_tuner_measured(tmp_path):
    # seen: steps 4-19 shaded as measured by the tuner where only 4-7, 10-13 and 16-19 were
    from hf_perf_callbacks.core.stats import step_ranges

    out = synthetic(tmp_path, "tuned", **TUNED)
    fig, data = draw(plot_phases, out)
    measured = step_ranges(s for d in data.tune_decisions() for t in d.trials for s in t.steps)
    assert len(measured) > 1 and spans(fig.axes[0]) == measured
    assert fig.axes[0].get_ylabel() == PHASES_AXIS


def test_memory_marks_the_switch_that_explains_its_step(tmp_path):
    # seen: memory.png stepped where the tuner switched splits, with nothing saying so
    out = synthetic(tmp_path, "kept", steps=30, tune=True, must_pay=False, split_sec={8: 0.4}, noise=0.05)
    fig, data = draw(plot_memory, out)
    assert [words for _, words, _ in data.restarts()] == ["tuner: 4×2 → 8×1"]
    assert "tuner: 4×2 → 8×1" in [t.get_text() for t in fig.axes[0].texts]


def test_a_tuning_that_measured_no_other_split_is_a_line_of_text_not_an_empty_panel(tmp_path):
    # seen: an empty panel scaled 1e-9 under "kept 4×1 (green)"
    out = synthetic(tmp_path, "untried", steps=30, tune=True, base_sec=0.11, generation_sec=0.15, noise=0.15)
    fig, data = draw(plot_tuner, out)
    assert len(fig.axes) == 1 and not fig.axes[0].patches                  # the split panel only, no bars
    decision = data.split_file.decisions[-1]       # kept for want of pay-back, and the panel says its reason
    assert (decision.kind, decision.reason_code, decision.ended_by) == ("tune", "kept_configured", "cannot_pay_back")
    assert _untried_words(decision) in [t.get_text() for t in fig.axes[0].texts]


def test_the_tuners_bars_say_what_every_reader_says_and_name_the_quantity(tmp_path):
    # seen: tuner.png labelled a trial −58% where the report said +58%, and its axis "measured s per optimizer step
    # (median)" for time outside generation
    from hf_perf_callbacks.core.splitfile import trial_figures

    out = synthetic(tmp_path, "tuned", **TUNED)
    fig, data = draw(plot_tuner, out)
    trials_ax = fig.axes[0]
    ranked = data.tune_decisions()[-1].ranked                  # what the samples measure, in every reader's unit
    assert ranked == "non_generation" and trials_ax.get_ylabel() == f"median {RANKED_UNITS[ranked]}"
    shown = trial_figures(data.tune_decisions()[-1])
    texts = [t.get_text() for t in trials_ax.texts]
    for t in shown:
        if t.comparison():
            assert any(t.comparison().replace(" than ", "\nthan ") in x for x in texts), t.comparison()
    assert not any("%" in x and ("+" in x or "−" in x or "-" in x) for x in texts)     # a direction in words only


# ---------------------------------------------------------------- labels by their boxes, levels, slow stretches
CLOSE = dict(TUNED, steps=300, walls=(4, 5, 11), contention={s: 1.2 for s in range(60, 180)})   # trials in 1-12
CLOSE_PLANS = {"tuned, long": CLOSE, "tuned": dict(TUNED, walls=(3, 6, 9)),
               "one switch": dict(steps=300, tune=True, must_pay=False, split_sec={8: 0.4}, noise=0.05,
                                  walls=(2, 5, 7))}


def text_boxes(fig):
    """Each axes' visible texts as (words, box on the canvas), the figure drawn with Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    return {ax: [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_visible() and t.get_text()]
            for ax in fig.axes}


@pytest.mark.parametrize("plan", sorted(CLOSE_PLANS))
def test_no_two_labels_overlap_and_every_label_stays_in_the_figure(tmp_path, plan):
    # seen: split labels over steps 1-19 printed on top of each other ("4×8×4×2"), "wall moved" ran into "8×1"
    out = synthetic(tmp_path, "close", **CLOSE_PLANS[plan])
    for plot in (plot_throughput, plot_memory, plot_tuner, plot_phases):
        fig, data = draw(plot, out)
        for boxes in text_boxes(fig).values():
            for i, (words, box) in enumerate(boxes):
                assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 \
                    and box.y1 <= fig.bbox.y1, (plot.__name__, words)
                for other, box2 in boxes[i + 1:]:
                    assert not box.overlaps(box2), (plot.__name__, words, other)
        if plot in (plot_throughput, plot_memory):          # the labels are there, not dropped to avoid overlaps
            words = " ".join(w for w, _ in text_boxes(fig)[fig.axes[0]])
            if len(data.restarts()) > 2:                    # every split named over its stretch, merged or not
                assert set(data.splits.values()) <= set(words.replace("→", " ").split())
            else:
                assert all(restart in words for _, restart, _ in data.restarts())
            if plot is plot_memory:
                assert "wall moved" in words


def test_close_split_stretches_merge_into_one_label_in_step_order(tmp_path):
    out = synthetic(tmp_path, "close", **CLOSE)
    fig, data = draw(plot_throughput, out)
    first, *switches = data.restarts()
    order = [data.splits[1]] + [data.splits[step + 1] for step, _, _ in [first, *switches]][:-1]
    merged = [w for w, _ in text_boxes(fig)[fig.axes[0]] if "→" in w]
    assert merged == [" → ".join(order) + f" (steps 1–{switches[-1][0]})"]


def level_lines(ax):
    """The steady lines of ``ax``: (y, first x, last x) of each horizontal segment of its line collections."""
    from matplotlib.collections import LineCollection

    out = []
    for c in ax.collections:
        if isinstance(c, LineCollection):
            for (x0, y0), (x1, y1) in c.get_segments():
                if y0 == y1:
                    out.append((y0, x0, x1))
    return sorted(out, key=lambda line: line[1])


def test_a_two_split_run_gets_a_steady_line_at_each_splits_level(tmp_path):
    # seen: one steady line drawn between two real levels (≈4,000 and ≈10,500 tok/s) of a tuned run
    out = synthetic(tmp_path, "two", steps=40, grpo=False, resize_at={20: (8, 1)}, split_sec={8: 0.3})
    fig, data = draw(plot_throughput, out)
    steady = set(data.f.steady_steps)
    expected = []
    for split in ("4×2", "8×1"):
        mine = [s for s in data.steps if s.step in steady and data.splits[s.step] == split]
        level = sum(s.number(keys.PERF_TOKENS) for s in mine) / sum(s.number(keys.PERF_TRAIN_SEC) for s in mine)
        expected.append((level, mine[0].step - 0.5, mine[-1].step + 0.5))
    lines = level_lines(fig.axes[0])
    assert len(lines) == 2 and [x for _, *x in lines] == [x for _, *x in expected]
    assert [y for y, *_ in lines] == pytest.approx([y for y, *_ in expected])
    assert lines[1][0] > 2 * lines[0][0]                       # two real levels, none drawn between them
    assert f"steady figure {data.f.steady_tokens_per_sec:,.0f} tokens/s" in " ".join(labels(fig.axes[0]))


def test_a_one_split_run_keeps_its_single_steady_line(run_dir):
    fig, data = draw(plot_throughput, run_dir)
    assert [y for y, *_ in level_lines(fig.axes[0])] == pytest.approx([data.f.steady_tokens_per_sec])


def stretch_spans(ax):
    """The (first, last) steps of ``ax``'s slow-stretch shading (alpha 0.12) and their colours."""
    from matplotlib.patches import Rectangle

    return sorted((round(p.get_x() + 0.5), round(p.get_x() + p.get_width() - 0.5), p.get_facecolor()[:3])
                  for p in ax.patches if isinstance(p, Rectangle) and p.get_alpha() == 0.12)


SLOW = dict(steps=80, grpo=False, noise=0.1)          # 1.0 s a step: a stretch of 20 steps at a third of the speed


@pytest.mark.parametrize("cause", ["contention", "unexplained"])
def test_a_long_slow_stretch_is_shaded_and_named_with_its_seconds(tmp_path, cause):
    # seen: ~120 steps at 40% of the split's speed drowned into "1.1 s lost" and one steady line
    from matplotlib.colors import to_rgb

    from hf_perf_callbacks.report.figures import slow_stretches
    from hf_perf_callbacks.report.model import Finding, Note
    from hf_perf_callbacks.report.reading import measurements_from_run
    from hf_perf_callbacks.report.rules import check, rule_contention

    planted = {s: 2.0 for s in range(40, 60)} if cause == "contention" else {}
    slower = {s: 3.0 for s in range(40, 60)} if cause == "unexplained" else {}
    out = synthetic(tmp_path, cause, **SLOW, contention=planted, slower=slower)
    fig, data = draw(plot_throughput, out)
    (stretch,) = slow_stretches(data.run)
    assert (stretch.first, stretch.last, stretch.cause) == (40, 59, cause)
    color = to_rgb("tab:red" if cause == "contention" else "tab:orange")
    assert stretch_spans(fig.axes[0]) == [(40, 59, pytest.approx(color))]
    m = measurements_from_run(out)
    found = rule_contention(m)
    assert isinstance(found, Finding if cause == "contention" else Note)
    assert found.steps == [(40, 59)] and found.lost_sec == pytest.approx(40.0, rel=0.15)   # 20 steps × 2 s more
    assert ("contention" in [f.rule for f in check(m)[0]]) == (cause == "contention")      # never blamed unexplained
    if cause == "contention":
        assert found.expected_gain == pytest.approx(1 / (1 - found.lost_sec / m.contention.run_sec if m.contention
                                                         else 1 - found.lost_sec / m.wall_sec))
    else:
        assert not found.judged


def test_a_run_without_a_slow_stretch_has_no_shading_and_no_finding(tmp_path):
    from hf_perf_callbacks.report.figures import slow_stretches
    from hf_perf_callbacks.report.reading import measurements_from_run
    from hf_perf_callbacks.report.rules import rule_contention

    out = synthetic(tmp_path, "plain", **SLOW)
    fig, data = draw(plot_throughput, out)
    assert slow_stretches(data.run) == [] and stretch_spans(fig.axes[0]) == []
    assert rule_contention(measurements_from_run(out)) is None


def test_a_first_step_faster_than_a_steady_figure_over_several_splits_is_not_called_a_slowdown():
    """The steady figure of a tuned run mixes splits at different speeds: a first step faster than it says so, and
    never that later steps slowed down (they ran at another split)."""
    from hf_perf_callbacks.core.wording import warmup_words

    one = warmup_words(2, 0.49, 0.0, None)
    mixed = warmup_words(2, 0.49, 0.0, None, levels=2)
    assert "later steps slowed down" in one and "later steps slowed down" not in mixed
    assert "mixes 2 splits" in mixed
