"""The compatibility matrix, metrics column (``tests/compat.py``): for every setting × trainer, with
``default_callbacks()`` attached, the callbacks' keys reach ``log_history``, every reporter and ``perf_log.jsonl`` on
every step, or the trainer refuses the setting before its first step with the message the matrix lists. Each cell
records its outcome (``tests/compat_results.json``); docs/compatibility.md's table is rendered from those records."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re

import pytest

from hf_perf_callbacks import default_callbacks
from hf_perf_callbacks.core.runlog import CALLBACK_PREFIXES, TRAINER_LOG
from tests import compat, compat_table
from tests.compat import CELLS, STEPS

#: the prefixes every step must carry (the cache clearer publishes only when it acts, which it does not on a CPU)
REQUIRED = ("perf/", "mem/", "tuner/")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:240]


@contextlib.contextmanager
def recording(cell, column):
    """Record the cell's outcome for ``column``: what the block set in ``outcome[0]`` (default "yes"), or "no: the
    first line of the error" when it raised (raised on)."""
    outcome = ["yes"]
    try:
        yield outcome
    except Exception as error:
        compat.record(cell, column, f"no: {first_line(error)}")
        raise
    compat.record(cell, column, outcome[0])


def tensorboard_scalars(output_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for path in glob.glob(os.path.join(output_dir, "**", "events.out.tfevents.*"), recursive=True):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag.removeprefix("train/"), {}).update({e.step: e.value for e in events.Scalars(tag)})
    return scalars


def mlflow_scalars(tracking_dir) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file://{tracking_dir}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, f"{len(runs)} MLflow runs"
    run = runs[0].info.run_id
    return {key: {m.step: m.value for m in client.get_metric_history(run, key)} for key in runs[0].data.metrics}


def step_lines(output_dir) -> dict[int, dict]:
    with open(os.path.join(output_dir, "perf_log.jsonl"), encoding="utf-8") as f:
        return {e["step"]: e for e in map(json.loads, f) if e["type"] == "step"}


def assert_metrics_reach_everything(trainer, output_dir, reporters, tracking_dir) -> None:
    steps = list(range(1, STEPS + 1))
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == steps, f"training logs at steps {sorted(logged)}, expected {steps}"
    for prefix in REQUIRED:
        missing = [step for step, h in logged.items() if not any(k.startswith(prefix) for k in h)]
        assert not missing, f"no {prefix} key in log_history at steps {missing}"
    ours = [(step, key) for step, h in logged.items() for key in h if key.startswith(CALLBACK_PREFIXES)]
    for reporter in reporters:
        scalars = tensorboard_scalars(output_dir) if reporter == "tensorboard" else mlflow_scalars(tracking_dir)
        missing = [(step, key) for step, key in ours if step not in scalars.get(key, {})]
        assert not missing, f"{len(missing)} of {len(ours)} callback values missing from {reporter}, e.g. {missing[:3]}"
    lines = step_lines(output_dir)
    assert sorted(lines) == steps, f"perf_log.jsonl step lines {sorted(lines)}, expected {steps}"
    for prefix in REQUIRED:
        missing = [step for step, line in lines.items() if not any(k.startswith(prefix) for k in line)]
        assert not missing, f"no {prefix} key in perf_log.jsonl at steps {missing}"
    assert all(lines[step].get(TRAINER_LOG + "loss") == logged[step]["loss"] for step in steps), \
        f"perf_log.jsonl lacks the trainer's {TRAINER_LOG}loss"


def _fast(cell) -> bool:
    """The fast suite runs each trainer's defaults once; `pytest -m launch` every other cell."""
    return cell.setting.name == "defaults" and not cell.setting.slow


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id, marks=[] if _fast(c) else [pytest.mark.launch])
                                  for c in CELLS])
def test_metrics_reach_every_reporter_on_every_step(cell, tokenizer, tmp_path, monkeypatch, one_thread):
    output_dir, tracking_dir = tmp_path / "out", tmp_path / "mlruns"
    compat.offline_mlflow(monkeypatch, tracking_dir)
    with recording(cell, "metrics") as outcome:
        trainer = None
        try:
            trainer = compat.build(cell, tokenizer, output_dir, default_callbacks())
            trainer.train()
        except Exception as error:
            expected = cell.setting.refused.get(cell.trainer)
            started = trainer is not None and trainer.state.global_step > 0
            if expected is None or started or not re.search(expected, str(error)):
                raise
            outcome[0] = f"refused: {first_line(error)}"
            return
        assert_metrics_reach_everything(trainer, str(output_dir), cell.setting.reporters(), str(tracking_dir))


def test_the_docs_table_is_rendered_from_the_recorded_results():
    """Runs after the cells (the last test of this module): docs/compatibility.md shows what they recorded."""
    with open(compat_table.DOC, encoding="utf-8") as f:
        _, table, _ = compat_table.split_doc(f.read())
    assert table == compat_table.render(compat.load_results()), \
        "docs/compatibility.md's table differs from tests/compat_results.json: run `python -m tests.compat_table`"


def test_the_table_is_for_the_pinned_versions_and_says_which():
    pinned = compat.pinned_versions()
    assert set(pinned) == set(compat.TABLE_VERSIONS), "constraints.txt must pin every library the table is for"
    table = compat_table.render({})
    assert all(f"{name} {version}" in table for name, version in pinned.items())


def test_results_are_recorded_only_in_their_format_and_on_the_pinned_versions(monkeypatch, tmp_path):
    monkeypatch.setattr(compat, "RESULTS", str(tmp_path / "results.json"))
    monkeypatch.setattr(compat, "installed_versions", compat.pinned_versions)
    cell = CELLS[0]
    for bad in ("ok", "no", "refused:", "maybe: later"):
        with pytest.raises(ValueError, match="outcome="):
            compat.record(cell, "metrics", bad)
    with pytest.raises(ValueError, match="column='speed'"):
        compat.record(cell, "speed", "yes")
    compat.record(cell, "metrics", "refused: ValueError: no")
    compat.record(cell, "resume_exact", "yes")
    assert compat.load_results() == {cell.id: {"metrics": "refused: ValueError: no", "resume_exact": "yes"}}
    compat.record(cell, "exact_by", "rule: the check did not run")
    table = compat_table.render(compat.load_results())
    assert "refused (1) · – · ✓ · rule (2)" in table and "1. ValueError: no\n2. the check did not run" in table
    monkeypatch.setattr(compat, "installed_versions", lambda: {**compat.pinned_versions(), "trl": "1.0.0"})
    assert compat.record(cell, "metrics", "yes") is False                       # another version set: not recorded
    assert compat.load_results()[cell.id]["metrics"] == "refused: ValueError: no"
