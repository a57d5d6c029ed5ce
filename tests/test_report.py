"""``hf-perf report``: summary text and PNG plots from a real demo run, a truncated log, bad inputs and synthetic
watchdog/tuner logs."""
import json
import os
import shutil

import numpy as np
import pytest

from hf_perf_callbacks import keys
from hf_perf_callbacks.core.runlog import PERF_LOG, ReportError, read_run
from hf_perf_callbacks.core.wording import phase_line, throughput_line
from hf_perf_callbacks.report import report_command, summarize
from hf_perf_callbacks.report.figures import figures, run_events
from hf_perf_callbacks.report.plots import write_plots
from hf_perf_callbacks.report.summary import NO_METER, UNFINISHED
from tests.conftest import schema_lines

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"




def read_log(output_dir):
    with open(os.path.join(output_dir, PERF_LOG), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def assert_good_png(path, min_bytes=10_000):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(path) > min_bytes
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.ndim == 3 and float(np.var(pixels[..., :3])) > 1e-4      # not a single colour


def test_demo_run_summary_and_plots(demo_run, capsys):
    assert report_command(demo_run) == 0
    out = capsys.readouterr().out
    perf = next(e for e in reversed(read_log(demo_run)) if e["type"] == "summary" and e["source"] == "perf")
    steady = perf["steady_tokens_per_sec"]          # None when a loaded machine never settled in 6 steps
    assert (f"steady tokens/s: {steady:,.0f}" if steady
            else f"provisional tokens/s: {perf['provisional_tokens_per_sec']:,.0f}") in out
    assert f"steps: {perf['steps']}" in out and "× 1" in out
    run = read_run(demo_run)
    assert summarize(run) in out and run.summaries            # finished (the summary's lines: tests/golden/)
    assert "generation" in out and "%" in out and "budget" in out
    assert figures(run).cache_clears == 0 and figures(run).high_water_gb > 0
    assert "completions" in out                     # from trainer_state.json
    for name in ("throughput", "memory", "phases", "tuner"):       # the demo attaches all four callbacks
        path = os.path.join(demo_run, "plots", f"{name}.png")
        assert path in out
        assert_good_png(path)


def test_missing_directory(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    with pytest.raises(ReportError, match="not a directory") as info:
        read_run(missing)
    assert "default_callbacks()" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert report_command(missing) == 2
    captured = capsys.readouterr()
    assert "not a directory" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_missing_perf_log(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(ReportError, match=f"no {PERF_LOG}") as info:
        read_run(str(tmp_path))
    assert "callbacks=default_callbacks()" in str(info.value)
    assert report_command(str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert PERF_LOG in err and "default_callbacks" in err and "Traceback" not in err


@pytest.mark.parametrize("content", ["", "\n\n", "{not json\n\x00garbage"])
def test_empty_or_unreadable_perf_log(tmp_path, capsys, content):
    (tmp_path / PERF_LOG).write_text(content)
    with pytest.raises(ReportError, match="default_callbacks"):
        read_run(str(tmp_path))
    assert report_command(str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert PERF_LOG in err and "Traceback" not in err


def test_truncated_log_still_reports(demo_run, tmp_path, capsys):
    with open(os.path.join(demo_run, PERF_LOG), encoding="utf-8") as f:
        lines = [line for line in f if '"type": "summary"' not in line]
    lines[-1] = lines[-1][: len(lines[-1]) // 2]                 # killed mid-write
    (tmp_path / PERF_LOG).write_text("".join(lines))
    shutil.copy(os.path.join(demo_run, "trainer_state.json"), tmp_path / "trainer_state.json")

    run = read_run(str(tmp_path))
    assert run.skipped_lines == 1 and run.summaries == {}
    text = summarize(run)
    assert UNFINISHED in text and f"skipped {run.skipped_lines} " in text
    assert "steps: 5" in text                                  # step 6 was the cut line
    f = figures(run)                                           # the meter's and the watchdog's figures, all printed
    assert throughput_line(f.steady_tokens_per_sec, f.steady_step_sec, f.mean_tokens_per_sec) in text
    assert phase_line(f.phases) in text and f.high_water_gb is not None and f"{f.high_water_gb:.2f} GiB" in text

    assert report_command(str(tmp_path)) == 0
    assert UNFINISHED in capsys.readouterr().out
    for name in ("throughput", "memory", "phases"):
        assert_good_png(str(tmp_path / "plots" / f"{name}.png"))


def test_figures_from_step_lines_match_the_meters_and_the_analysis_uses_them(demo_run, tmp_path):
    """A killed run has no summaries: the step-line fallbacks must measure what the meter measures (training
    time, not wall time with eval/save), and perf_report.md must print the same figures as the report."""
    from hf_perf_callbacks.report import measurements_from_run

    finished = figures(read_run(demo_run))
    with open(os.path.join(demo_run, PERF_LOG), encoding="utf-8") as f:
        (tmp_path / PERF_LOG).write_text("".join(line for line in f if '"type": "summary"' not in line))
    killed = figures(read_run(str(tmp_path)))
    assert killed.mean_tokens_per_sec == pytest.approx(finished.mean_tokens_per_sec, rel=0.01)
    if finished.steady_step_sec is None:                   # the shared demo run is too short for a steady phase
        assert killed.steady_step_sec is None
    else:
        assert killed.steady_step_sec == pytest.approx(finished.steady_step_sec, rel=0.2)
    m = measurements_from_run(str(tmp_path))
    assert (m.mfu, m.steady_step_sec, m.mem_high_water_gb, m.phases) == (
        killed.mfu, killed.steady_step_sec, killed.high_water_gb, killed.phases)


def synthetic_log(path, steps=30):
    """A run that hit memory pressure, was acted on by the watchdog and the tuner, then was resumed."""
    entries = [{"type": "run", "source": "perf", "device": "NVIDIA H100", "device_type": "cuda", "world_size": 2,
                "resumed_from_step": 0},
               {"type": "run", "source": "mem", "budget_gb": 70.0}]
    for step in range(1, steps + 1):
        if step == 21:
            entries.append({"type": "run", "source": "perf", "device": "NVIDIA H100", "device_type": "cuda",
                            "world_size": 2, "resumed_from_step": 20})
        used = 40 + step * 1.2 if step <= 20 else 45 + (step - 20) * 0.5
        micro, accum = (8, 1) if step < 12 else (4, 2)
        entries.append({"type": "step", "step": step, "time": 1000.0 + step,
                        keys.PERF_TOKENS_PER_SEC: 5000.0 + 100 * min(step, 5), keys.PERF_TOKENS: 4096.0,
                        keys.PERF_STEP_WALL_SEC: 0.8, keys.PERF_TRAIN_SEC: 0.8, keys.PERF_WARMUP_DONE: int(step >= 5),
                        keys.PERF_STEADY: int(step >= 5),
                        keys.PERF_STEADY_TOKENS_PER_SEC: 5500.0 if step >= 5 else None, keys.PERF_WARMUP_STEPS: 4,
                        keys.PERF_MFU: 0.41, keys.PERF_PHASE_SEC["data_wait"]: 0.05,
                        keys.PERF_PHASE_SEC["generation"]: 0.3,
                        keys.PERF_PHASE_SEC["compute"]: 0.45,
                        keys.MEM_DEVICE_USED_GB: used, keys.MEM_LIMIT_GB: 70.0, keys.MEM_PEAK_GB: used + 0.5,
                        keys.MEM_PRESSURE: 2 if used > 60 else 1 if used > 52 else 0,
                        keys.TUNER_MICRO_BATCH: micro, keys.TUNER_GRAD_ACCUM: accum})
        entries[-1] = {k: v for k, v in entries[-1].items() if v is not None}
        if step == 10:
            entries.append({"type": "event", "source": "mem", "kind": "warning", "step": 10,
                            "message": "memory grows 1.2 GB per step", "level": "warn"})
        if step == 11:
            entries.append({"type": "event", "source": "mem", "kind": "action", "step": 11, "action": "clear_cache",
                            "message": "cleared caches: warn", "level": "warn"})
            entries.append({"type": "event", "source": "cache", "kind": "info", "step": 11,
                            "message": "cleared cache (watchdog): freed 1.500 GB", "freed_gb": 1.5})
        if step == 12:
            entries.append({"type": "event", "source": "tuner", "kind": "decision", "step": 12,
                            "message": "micro-batch 8 -> 4", "old_split": "8x1", "new_split": "4x2"})
        if step == 20:
            entries.append({"type": "event", "source": "mem", "kind": "stop", "step": 20, "action": "stop",
                            "message": "stopped training at step 20", "level": "critical"})
    with open(path, "w", encoding="utf-8") as f:
        f.write(schema_lines(entries))
        f.write('{"type": "step", "step": 31, "perf/tok')            # killed mid-line


def test_synthetic_watchdog_and_tuner(tmp_path):
    synthetic_log(tmp_path / PERF_LOG)
    run = read_run(str(tmp_path))
    assert run.skipped_lines == 1 and len(run.steps) == 30

    f = figures(run)
    assert (f.device, f.device_type, f.world_size, f.steps) == ("NVIDIA H100", "cuda", 2, 30)
    assert f.steady_tokens_per_sec == 5500.0 and f.mfu == pytest.approx(0.41)
    assert {p: v for p, v in f.phases.items() if v} == pytest.approx(
        {"data_wait": 0.05 / 0.8, "generation": 0.3 / 0.8, "compute": 0.45 / 0.8})
    assert (f.budget_gb, f.stopped_at, f.cache_clears, f.cache_freed_gb) == (70.0, 20, 1, 1.5)
    assert [h.resumed_from_step for h in run.headers if "perf" in h.sources] == [0, 20]
    assert [(e.step, e.source, e.kind, e.details.get("action")) for e in run_events(run)] == [
        (10, "mem", "warning", None), (11, "mem", "action", "clear_cache"), (11, "cache", "info", None),
        (12, "tuner", "decision", None), (20, "mem", "stop", "stop")]

    text = summarize(run)                                   # the summary prints exactly these
    assert not run.summaries and UNFINISHED in text
    assert throughput_line(f.steady_tokens_per_sec, f.steady_step_sec, f.mean_tokens_per_sec) in text
    assert phase_line(f.phases) in text and "MFU 41.0%" in text
    assert "step 12: [tuner] decision (8x1 -> 4x2)" in text                 # an event line: the split change

    out_dir = tmp_path / "figs"
    paths = write_plots(run, str(out_dir))
    assert sorted(os.path.basename(p) for p in paths) == ["memory.png", "phases.png", "throughput.png", "tuner.png"]
    for path in paths:
        assert os.path.dirname(path) == str(out_dir)
        assert_good_png(path)


def test_plots_skip_absent_data(tmp_path):
    """A log with only watchdog data: memory.png only, the rest skipped with notes; summary still works."""
    lines = [{"type": "run", "source": "mem", "budget_gb": 8.0}]
    lines += [{"type": "step", "step": s, keys.MEM_DEVICE_USED_GB: 2.0 + s / 10, keys.MEM_LIMIT_GB: 8.0}
              for s in range(1, 6)]
    lines += [{"type": "summary", "source": "mem", "high_water_gb": 2.5, "budget_gb": 8.0,
               "actions": [{"step": 3, "action": "clear_cache", "message": "cleared caches"}], "stopped_at": None}]
    (tmp_path / PERF_LOG).write_text(schema_lines(lines))
    run = read_run(str(tmp_path))
    f = figures(run)
    assert (f.high_water_gb, f.budget_gb, f.steady_tokens_per_sec, f.warmup_done) == (2.5, 8.0, None, None)
    assert [(e.step, e.details.get("action")) for e in run_events(run)] == [(3, "clear_cache")]  # the summary's list
    text = summarize(run)
    memory = next(line for line in text.splitlines() if line.startswith("memory:"))     # high-water of budget
    assert NO_METER in text and [w for w in ("2.50 GiB", "8.00 GiB", "(31%)") if w in memory] == ["2.50 GiB",
                                                                                                "8.00 GiB", "(31%)"]
    paths = write_plots(run)
    assert [os.path.basename(p) for p in paths] == ["memory.png"]
    assert os.path.dirname(paths[0]) == str(tmp_path / "plots")


def test_completion_line_and_the_analysis_cite_the_same_clipped_share(tmp_path):
    # seen: the analysis said 83% clipped while the summary line of the same report said 75% (its last log)
    from hf_perf_callbacks.report import check, measurements_from_run

    lines = [{"type": "run", "source": "perf", "device_type": "cpu", "world_size": 1, "grpo": True,
              "max_completion_length": 16, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
              "num_generations": 4}]
    lines += [{"type": "step", "step": s, keys.PERF_TOKENS: 10.0, keys.PERF_STEP_WALL_SEC: 1.0,
               "log/completions/mean_length": 15.0, "log/completions/max_length": 16.0,
               "log/completions/clipped_ratio": r} for s, r in enumerate((1.0, 1.0, 0.75, 0.75), 1)]
    (tmp_path / PERF_LOG).write_text(schema_lines(lines))
    text = summarize(read_run(str(tmp_path)))
    m = measurements_from_run(str(tmp_path))
    assert m.clipped_ratio == pytest.approx(0.875)                      # the mean of the run's logs, not the last
    share = f"{m.clipped_ratio:.0%}"
    assert share in text.split("completions")[-1] and share in {f.rule: f for f in check(m)[0]}[
        "completion_budget"].observation


def test_a_warning_before_the_first_header_is_kept_and_no_earlier_run_is_claimed(tmp_path):
    # seen: a run whose first line is the meter's MFU warning event reported "1 earlier run started afresh" and the
    # warning was dropped
    warning = "MFU omitted: no peak"
    lines = [{"type": "event", "source": "perf", "kind": "warning", "step": 0, "message": warning},
             {"type": "run", "source": "perf", "session": "s1", "resumed_from_step": 0, "device_type": "cpu"},
             {"type": "step", "step": 1, keys.PERF_TOKENS: 10.0, keys.PERF_STEP_WALL_SEC: 1.0}]
    (tmp_path / PERF_LOG).write_text(schema_lines(lines))
    run = read_run(str(tmp_path))
    text = summarize(run)
    assert run.replaced_runs == 0 and [e.message for e in run.events] == [warning] and warning in text


@pytest.mark.parametrize("warmup, slowdown, says, never", [
    (0, 3.5, "warmup: only the first step was slow (3.5x the steady step)", "0 steps"),
    (2, 0.3, "faster than the steady level (0.30x)", "first step took 0.3x"),
    (3, 2.0, "warmup: warmup took 3 steps; the first step took 2.0x the steady step", "only the first"),
])
def test_summary_warmup_line_never_contradicts_itself(tmp_path, warmup, slowdown, says, never):
    # seen: "warmup: ended after 0 steps … first step 3.5x the steady step"; "first step 0.3x the steady step"
    lines = [{"type": "run", "source": "perf", "session": "s", "device_type": "cpu", "world_size": 1},
             {"type": "step", "step": 1, keys.PERF_TOKENS: 10.0, keys.PERF_STEP_WALL_SEC: 1.0,
              keys.PERF_TOKENS_PER_SEC: 10.0},
             {"type": "summary", "source": "perf", "steps": 1, "warmup_done": True, "warmup_steps": warmup,
              "first_step_slowdown": slowdown, "warmup_overhead_sec": 0.5}]
    (tmp_path / PERF_LOG).write_text(schema_lines(lines))
    text = summarize(read_run(str(tmp_path)))
    assert says in text and never not in text
