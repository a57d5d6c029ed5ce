"""The report is linear in the run's steps and keeps a long run's log in bounded memory, on planted runs of a few
hundred steps (``tests/synthetic_runs.py``): work counted, not timed — the function calls the package's own code
makes (``sys.setprofile``: a pass over every step for every step shows as a growing increment) — and the bytes a
step line costs to keep. A rebuild inside one C call (a ``dict(...)`` of every step made for every step) is one call
to this count: the 200,000-step benchmark (``benchmarks/bench_report_scale.py``) times the whole."""
import contextlib
import io
import os
import sys
import tracemalloc

import pytest

import hf_perf_callbacks
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.report import report_command
from tests.synthetic_runs import Plan, write_run

pytestmark = pytest.mark.launch   # long planted logs: with the launch suite, to keep `make test` quick


def plan(steps: int) -> Plan:
    # the same run cut at different lengths: a tuning (every split tried, must_pay off), warmup, contention,
    # evaluations, a training log every step
    return Plan(steps=steps, seed=3, tune=True, must_pay=False, split_sec={8: 1.2, 2: 0.9, 1: 1.1}, noise=0.15,
                warmup=(3.0, 1.0), contention={60: 4.0}, eval_every=50, eval_sec=2.0)


PACKAGE = os.path.dirname(hf_perf_callbacks.__file__)


def calls(output_dir: str, plots: bool) -> int:
    """Function calls (Python and C) made by the package's own code during ``hf-perf report`` on ``output_dir``
    (matplotlib's drawing inside them is its own: it depends on the ticks and text laid out, not on the run's steps,
    and the plots draw at most 2,000 points a line)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(PACKAGE):
            count += 1

    with contextlib.redirect_stdout(io.StringIO()):
        sys.setprofile(profile)
        try:
            assert report_command(output_dir, plots=plots) == 0
        finally:
            sys.setprofile(None)
    return count


def test_the_report_does_the_same_work_for_each_further_step(tmp_path):
    # seen: 77 of 110 s of a 20,000-step report in plots.plot_tuner, which rebuilt a dict for every step, and the
    # steady steps found by comparing each step with every later line (quadratic); 200,000 steps did not finish
    sizes = (400, 800, 1200)
    dirs = [write_run(str(tmp_path / str(n)), plan(n)) for n in sizes]
    calls(dirs[0], True)                                        # imports and first-use caches: not the run's work
    work = [calls(d, True) for d in dirs]
    first, second = work[1] - work[0], work[2] - work[1]       # fixed costs (imports, drawing) cancel
    assert first > 0 and second <= 1.15 * first, (work, second / first)


def test_a_long_runs_log_is_kept_in_bounded_memory(tmp_path):
    # seen: 1.4 GB for a 200,000-step log (a dict of every value of every line); the reader keeps each line's numbers
    # as one array under a key index shared by every line with the same keys
    small, large = (write_run(str(tmp_path / str(n)), plan(n)) for n in (500, 1500))
    sizes = []
    for path in (small, large):
        tracemalloc.start()
        run = read_run(path)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        sizes.append(held)
        assert len(run.steps) in (500, 1500)
    per_step = (sizes[1] - sizes[0]) / 1000
    assert per_step < 1024, per_step                             # bytes a step line (~50 values) costs to keep
