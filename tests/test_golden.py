"""The rendered report of three planted runs (``tests/synthetic_runs.py``), compared exactly with the files under
``tests/golden/``: the console summary and analysis ``hf-perf report --no-plots`` prints, then ``perf_report.md``.

The runs are seeded and carry no clock, path or version into the text (the run directory is written as ``<run>``),
so a difference is a change of wording or of a number. After a deliberate change of the renderer, rewrite the files
with ``UPDATE_GOLDEN=1 pytest tests/test_golden.py`` and review their diff."""
from __future__ import annotations

import difflib
import os

import pytest

from hf_perf_callbacks.report.command import report_command
from hf_perf_callbacks.report.render import REPORT_FILE
from tests.synthetic_runs import Plan, write_run

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

#: name → the run it renders: a healthy short SFT run, a GRPO run with several findings, a run the tuner re-sized
RUNS = {
    "healthy_sft": Plan(steps=30, grpo=False, warmup=(1.5,)),
    "grpo_findings": Plan(steps=40, reward="constant", clipped=0.8, eval_every=5, eval_sec=3.0,
                          contention={20: 4.0, 21: 4.0}, walls=(12,)),
    "tuned": Plan(steps=60, tune=True, split_sec={1: 1.6, 2: 1.2, 8: 0.8}, noise=0.02),
}


def rendered(tmp_path, capsys, plan: Plan) -> str:
    out = write_run(str(tmp_path / "run"), plan)
    assert report_command(out, plots=False) == 0
    console = capsys.readouterr().out
    with open(os.path.join(out, REPORT_FILE)) as f:
        report = f.read()
    return (console + "\n---- perf_report.md ----\n" + report).replace(out, "<run>")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_rendered_report_matches_its_golden_file(name, tmp_path, capsys):
    text = rendered(tmp_path, capsys, RUNS[name])
    path = os.path.join(GOLDEN, f"{name}.md")
    if os.environ.get("UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        golden = f.read()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True), f"golden/{name}.md",
                                        "rendered", n=2))
    assert not diff, f"the rendered report changed (UPDATE_GOLDEN=1 rewrites it after review):\n{diff}"
