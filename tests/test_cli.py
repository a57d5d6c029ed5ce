"""hf-perf argument handling: demo unchanged, train forwards to the launcher, report runs report + analysis."""
import os
import subprocess
import sys

import pytest

from hf_perf_callbacks import cli, train


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
    argv = ["--config", "recipes/mac-16gb-qwen0.5b.yaml", "--max_steps", "3", "--help_me", "x"]
    assert cli.main(["train", *argv]) == 0
    assert seen["argv"] == argv


def test_train_help_points_to_accelerate(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "accelerate launch" in out and "-m hf_perf_callbacks.train" in out


def test_train_without_arguments_prints_usage(capsys):
    assert cli.main(["train"]) == 2
    assert "--config" in capsys.readouterr().out


def test_train_with_a_typo_fails_with_the_closest_key(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("num_generation: 4\nuse_cpu: true\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert "did you mean 'num_generations'?" in capsys.readouterr().err


def test_train_with_a_missing_config_file(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_report_of_a_missing_directory_fails_clearly(capsys):
    pytest.importorskip("hf_perf_callbacks.report")
    code = cli.main(["report", "/nonexistent/run"])
    assert code != 0
    assert "/nonexistent/run" in capsys.readouterr().err


def test_report_runs_report_then_analysis(monkeypatch, capsys):
    report = pytest.importorskip("hf_perf_callbacks.report")
    analysis = pytest.importorskip("hf_perf_callbacks.analysis")
    calls = []
    monkeypatch.setattr(report, "main", lambda out, plots=True: calls.append(("report", out, plots)) or 0)
    monkeypatch.setattr(analysis, "write_perf_report", lambda out: calls.append(("analysis", out)) or ("p", ["f"]))
    monkeypatch.setattr(analysis, "console_summary", lambda findings, top=3: f"summary of {findings}")
    assert cli.main(["report", "runs/x", "--no-plots"]) == 0
    assert calls == [("report", "runs/x", False), ("analysis", "runs/x")]
    assert "summary of ['f']" in capsys.readouterr().out


def test_report_failure_skips_the_analysis(monkeypatch):
    report = pytest.importorskip("hf_perf_callbacks.report")
    analysis = pytest.importorskip("hf_perf_callbacks.analysis")
    monkeypatch.setattr(report, "main", lambda out, plots=True: 2)
    monkeypatch.setattr(analysis, "write_perf_report", lambda out: pytest.fail("analysis ran after a failed report"))
    assert cli.main(["report", "runs/x"]) == 2


def test_report_needs_a_directory(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report"])
    assert exit_.value.code == 2


def test_module_entry_point_runs_train_help():
    proc = subprocess.run([sys.executable, "-m", "hf_perf_callbacks", "train", "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "hf_perf_callbacks.train" in proc.stdout
