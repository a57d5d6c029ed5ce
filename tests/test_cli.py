"""hf-perf argument handling: demo unchanged, train forwards to the launcher, report prints the summary and
writes the plots and the analysis (on a real demo run), and the analysis without matplotlib. (``hf-perf recipes``:
tests/test_packaging.py.)"""
import os
import subprocess
import sys

import pytest

from hf_perf_callbacks import cli, train
from hf_perf_callbacks.report import console_summary

#: the first line of the analysis' console summary (its wording: tests/golden/)
ANALYSIS = console_summary([]).splitlines()[0]


def test_help_lists_the_three_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "train" in out and "report" in out


def test_demo_arguments_are_unchanged(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--max_steps", "0"])
    assert exit_.value.code == 2
    assert "--max_steps=0 is not allowed" in capsys.readouterr().err


def test_train_forwards_everything_after_the_command(monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    argv = ["--config", "mac-16gb-qwen1.5b", "--max_steps", "3", "--help_me", "x"]
    assert cli.main(["train", *argv]) == 0
    assert seen["argv"] == argv


def test_train_help_points_to_accelerate(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "accelerate launch" in out and "-m hf_perf_callbacks.train" in out and "hf-perf recipes" in out


def test_train_without_arguments_prints_usage(capsys):
    assert cli.main(["train"]) == 2
    assert "--config" in capsys.readouterr().out


def test_train_with_a_typo_fails_with_the_closest_key(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("num_generation: 4\nuse_cpu: true\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    from hf_perf_callbacks.core.validation import closest, did_you_mean
    from hf_perf_callbacks.train.arguments import field_names

    assert closest("num_generation", field_names()) == "num_generations"
    assert did_you_mean("num_generation", field_names()) in capsys.readouterr().err


def test_train_with_a_missing_config_file(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and repr(str(tmp_path / "nope.yaml")) in err        # one line naming the file




def test_report_of_a_missing_directory_fails_clearly(tmp_path, capsys):
    missing = str(tmp_path / "no_such_run")
    assert cli.main(["report", missing]) == 2
    captured = capsys.readouterr()
    assert missing in captured.err and "is not a directory" in captured.err
    assert ANALYSIS not in captured.out           # no analysis after a failed report
    assert not os.path.exists(missing)


def test_report_of_a_directory_without_perf_log_fails_clearly(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no perf_log.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "perf_report.md").exists()


def test_report_prints_the_summary_writes_plots_and_the_analysis(demo_run, capsys):
    assert cli.main(["report", demo_run]) == 0
    out = capsys.readouterr().out
    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.report.summary import summarize

    summary = summarize(read_run(demo_run))
    assert summary in out and "steps: 6" in summary and demo_run in summary.splitlines()[0]
    assert out.index(summary) < out.index(ANALYSIS)             # the analysis' console summary, after the report
    report_path = os.path.join(demo_run, "perf_report.md")
    assert f"analysis: {report_path}" in out
    assert os.path.getsize(report_path) > 0
    for name in ("throughput", "memory", "phases"):
        path = os.path.join(demo_run, "plots", f"{name}.png")
        assert os.path.getsize(path) > 0 and path in out


def test_report_without_plots(demo_run, capsys, tmp_path):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("plots", "perf_report.md"))
    assert cli.main(["report", run, "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "plots:" not in out and ANALYSIS in out
    assert not os.path.exists(os.path.join(run, "plots")) and os.path.exists(os.path.join(run, "perf_report.md"))


def test_report_without_matplotlib_writes_the_analysis_and_says_so_once(demo_run, capsys, tmp_path, monkeypatch):
    """The written analysis needs no plotting: without matplotlib the plots are skipped with one line naming the
    extra and --no-plots, and the report succeeds."""
    import shutil

    from hf_perf_callbacks.report.command import NO_MATPLOTLIB

    run = str(tmp_path / "run")
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("plots", "perf_report.md"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib now raises ImportError
    assert cli.main(["report", run]) == 0
    captured = capsys.readouterr()
    said = [line for line in (captured.out + captured.err).splitlines() if "matplotlib" in line.replace(run, "")]
    assert said == [NO_MATPLOTLIB] and "[plots]" in NO_MATPLOTLIB and "--no-plots" in NO_MATPLOTLIB
    assert "plots=False" not in captured.out + captured.err and ANALYSIS in captured.out
    assert os.path.exists(os.path.join(run, "perf_report.md")) and not os.path.exists(os.path.join(run, "plots"))


def test_report_needs_a_directory(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report"])
    assert exit_.value.code == 2


def test_module_entry_point_runs_train_help():
    proc = subprocess.run([sys.executable, "-m", "hf_perf_callbacks", "train", "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "hf_perf_callbacks.train" in proc.stdout


def test_help_imports_neither_torch_nor_transformers():
    """`hf-perf --help`, `hf-perf report --help` and the recipe listing answer without the training stack."""
    code = ("import runpy, sys\n"
            "for argv in (['--help'], ['report', '--help'], ['recipes']):\n"
            "    sys.argv = ['hf-perf', *argv]\n"
            "    try:\n"
            "        runpy.run_module('hf_perf_callbacks', run_name='__main__')\n"
            "    except SystemExit as exit_:\n"
            "        assert exit_.code == 0, exit_.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'accelerate') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "usage: hf-perf" in proc.stdout and "output_dir" in proc.stdout and "mac-16gb-qwen1.5b" in proc.stdout
    assert "HEAVY []" in proc.stdout


def test_report_reads_the_log_once(demo_run, monkeypatch, capsys):
    from hf_perf_callbacks.core import runlog

    calls = []
    parse = runlog.parse_lines
    monkeypatch.setattr(runlog, "parse_lines", lambda *a, **k: calls.append(1) or parse(*a, **k))
    assert cli.main(["report", demo_run, "--no-plots"]) == 0
    assert len(calls) == 1 and ANALYSIS in capsys.readouterr().out


def test_the_quick_start_time_is_one_figure_in_the_docs_and_help_names_its_page(capsys, monkeypatch):
    """docs/performance.md gives the quick start's measured time with its conditions (between its quick-start-time
    markers); ``hf-perf demo --help`` names that page instead of a number of its own."""
    import re

    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.md"),
                encoding="utf-8").read()
    (marked,) = re.findall(r"<!-- quick-start-time -->(.*?)<!-- /quick-start-time -->", page, re.S)
    assert re.search(r"\d+ s of wall time.*\d+ s of CPU time.*load average of [\d.]+", " ".join(marked.split()))
    monkeypatch.setenv("COLUMNS", "1000")                   # argparse wraps at the terminal's width
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "docs/performance.md" in out and not re.search(r"load average|\d+ s of wall time", out)


def test_report_of_a_checkpoint_folder_reports_its_run(demo_run, capsys):
    """``hf-perf report out/checkpoint-5``: the run is the parent folder (the perf log is beside its checkpoints),
    said in one line, and the report is that run's."""
    checkpoint = os.path.join(demo_run, "checkpoint-5")
    os.makedirs(checkpoint, exist_ok=True)
    assert cli.main(["report", checkpoint, "--no-plots"]) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    assert first.startswith(checkpoint) and first.count(demo_run) == 2 and rest     # names both; then the report
    assert os.path.exists(os.path.join(demo_run, "perf_report.md")) and cli.run_dir(checkpoint) == demo_run
    assert cli.run_dir(demo_run) == demo_run
    assert cli.main(["report", os.path.join(demo_run, "no-such-checkpoint-7"), "--no-plots"]) == 2   # not one
