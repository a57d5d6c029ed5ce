"""Run the GPU benchmarks in turn, each in its own process (cold starts, per-process memory fractions).

    python benchmarks/run_all.py [names...]      # default: all, in an order where later ones use earlier results

The tuning on the run's own steps against plain runs (300-step runs, about 20 minutes on one GPU):
``bash benchmarks/gpu_tuning.sh``.
"""
import subprocess
import sys
import time

ORDER = ["accuracy", "overhead", "tuner", "oom", "watchdog", "shared_gpu"]
SCRIPTS = {"accuracy": ["bench_accuracy.py"], "overhead": ["bench_overhead.py"],
           "tuner": ["bench_tuner.py", "--part", "sweep"], "oom": ["bench_oom.py"], "watchdog": ["bench_watchdog.py"],
           "shared_gpu": ["bench_shared_gpu.py"]}


def main(names):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    failed = []
    for name in names or ORDER:
        start = time.time()
        print(f"\n=== {name} ===", flush=True)
        script, *args = SCRIPTS[name]
        code = subprocess.call([sys.executable, os.path.join(here, script), *args])
        print(f"=== {name}: exit {code}, {time.time() - start:.0f} s ===", flush=True)
        if code:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
