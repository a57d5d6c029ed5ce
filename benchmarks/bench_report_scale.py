"""``hf-perf report`` on long runs: is it linear in the steps, with plots, in bounded memory?

A run log of N steps is written as the callbacks write it (``tests/synthetic_runs.py``: the meter's and the
tuner's own cores, the run log's writer classes): GRPO, a tuning with trials, warmup, a few contended steps, an
evaluation every 500 steps, a training log every 5 steps. Then ``hf-perf report DIR`` runs in a fresh process per
size (the command as a user runs it: summary, the four plots, ``perf_report.md``), and the process reports its wall
time, CPU time and peak resident memory (``VmHWM``). Targets: 200,000 steps with plots in ≤ 60 s and ≤ 500 MB
peak on the project's 2-core CPU. Results: ``benchmarks/results/report_scale.json`` (each row with the machine's
load average before and after).

    python benchmarks/bench_report_scale.py                         # 20,000, 100,000 and 200,000 steps
    python benchmarks/bench_report_scale.py --steps 200000
    python benchmarks/bench_report_scale.py --smoke                 # 2,000 steps, no result file
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from common import write_result  # noqa: E402 - after the path to the package

#: what one report process prints on its last line (JSON): its own wall and CPU seconds and peak memory
CHILD = """
import contextlib, io, json, sys, time
started, cpu = time.perf_counter(), time.process_time()
from hf_perf_callbacks.report import report_command
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = report_command(sys.argv[1], plots=sys.argv[2] == "plots")
def high_water_mb():
    # VmHWM: this process image's peak resident memory (ru_maxrss would count the parent's image before exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
print(json.dumps({"exit": code, "wall_sec": time.perf_counter() - started, "cpu_sec": time.process_time() - cpu,
                  "peak_rss_mb": high_water_mb(), "plots_written": out.getvalue().count(".png")}))
"""


def plan(steps: int):
    from tests.synthetic_runs import Plan

    return Plan(steps=steps, seed=1, tune=True, must_pay=False, split_sec={8: 1.2, 2: 0.9, 1: 1.1}, noise=0.15,
                warmup=(3.0, 1.0), contention={100: 5.0, 5000: 3.0}, logging_steps=5, eval_every=500, eval_sec=5.0)


def measure(steps: int, plots: bool, keep: str | None = None) -> dict:
    from tests.synthetic_runs import write_run

    out = keep or tempfile.mkdtemp(prefix="report_scale_")
    made = time.perf_counter()
    if not os.path.exists(os.path.join(out, "perf_log.jsonl")):
        write_run(out, plan(steps))
    written = time.perf_counter() - made
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load = os.getloadavg()
    done = subprocess.run([sys.executable, "-c", CHILD, out, "plots" if plots else "none"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the report failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(steps=steps, plots=plots, log_mb=os.path.getsize(os.path.join(out, "perf_log.jsonl")) / 2**20,
               write_sec=written, load_before=load, load_after=os.getloadavg())
    if keep is None:
        shutil.rmtree(out, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="*", default=[20_000, 100_000, 200_000])
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--keep", help="a folder to keep (and reuse) the generated logs in, one per size")
    parser.add_argument("--smoke", action="store_true", help="2,000 steps, no result file")
    a = parser.parse_args(argv)
    sizes = [2_000] if a.smoke else a.steps
    rows = []
    for n in sizes:
        keep = os.path.join(a.keep, str(n)) if a.keep else None
        rows.append(measure(n, a.plots, keep))
        r = rows[-1]
        print(f"{n:>7,} steps ({r['log_mb']:.0f} MB of log): {r['wall_sec']:.1f} s wall, {r['cpu_sec']:.1f} s CPU, "
              f"peak {r['peak_rss_mb']:.0f} MB, {r['plots_written']} plots; load {r['load_before'][0]:.1f}–"
              f"{r['load_after'][0]:.1f}", flush=True)
    if not a.smoke:
        payload = {"benchmark": "report_scale", "rows": rows, "cpu_count": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
                   "targets": {"steps": 200_000, "wall_sec": 60, "peak_rss_mb": 500}}
        path = write_result("report_scale", payload)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
