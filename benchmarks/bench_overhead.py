"""1. Overhead: GRPO+LoRA (0.5B-shaped, bf16) with all four callbacks vs none, interleaved A/B with the same seed.

Both arms carry the same independent step clock. With the same seed both arms generate the same completions at
the same step, so step times are compared pairwise (same step index): the median paired ratio. HF ``generate`` is
launch-bound, so step times jitter by tens of percent and an A/B ratio cannot resolve 0.5%; the callbacks' own
time is therefore also measured directly: every event of the four callbacks and the meter's forward hook are
timed (the per-step device synchronize included), divided by the median step time. That is an upper bound on the
overhead (a synchronize may only wait for work the step had queued anyway).
"""
import argparse
import functools
import tempfile
import time

from common import StepClock, grpo_trainer, median, release, table, write_result

from hf_perf_callbacks import default_callbacks

SPENT = {"seconds": 0.0, "calls": 0}


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT["seconds"] += time.perf_counter() - start
            SPENT["calls"] += 1
    return wrapper


def instrumented_callbacks() -> list:
    callbacks = default_callbacks()
    for cb in callbacks:
        for name in dir(cb):
            if name.startswith("on_") and callable(getattr(cb, name)):
                setattr(cb, name, timed(getattr(cb, name)))
        if hasattr(cb, "_on_forward"):
            cb._on_forward = timed(cb._on_forward)
    return callbacks


def run(arm: str, steps: int, micro: int, accum: int, completion: int) -> tuple[list[float], float]:
    clock = StepClock()
    callbacks = [clock] + (instrumented_callbacks() if arm == "all" else [])
    SPENT.update(seconds=0.0, calls=0)
    trainer = grpo_trainer(tempfile.mkdtemp(), callbacks, micro, accum, steps, completion)
    trainer.train()
    walls = list(clock.walls)
    release(trainer)
    return walls, SPENT["seconds"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--completion", type=int, default=32)
    a = p.parse_args()
    run("none", 3, a.micro, a.accum, a.completion)                  # warm the process for both arms
    arms = {"none": [], "all": []}
    callback_seconds = []
    for rep in range(a.reps):
        for arm in (("none", "all") if rep % 2 == 0 else ("all", "none")):
            walls, spent = run(arm, a.steps, a.micro, a.accum, a.completion)
            arms[arm].append(walls)
            if arm == "all":
                callback_seconds.append(spent / a.steps)
    paired = [w_all / w_none for walls_none, walls_all in zip(arms["none"], arms["all"])
              for w_none, w_all in list(zip(walls_none, walls_all))[a.skip:]]
    none_med = median([w for ws in arms["none"] for w in ws[a.skip:]])
    all_med = median([w for ws in arms["all"] for w in ws[a.skip:]])
    quartiles = sorted(paired)
    result = {"median_paired_ratio": median(paired), "ratio_of_medians": all_med / none_med,
              "paired_ratio_iqr": [quartiles[len(quartiles) // 4], quartiles[3 * len(quartiles) // 4]],
              "callback_seconds_per_step": median(callback_seconds),
              "callback_overhead_fraction": median(callback_seconds) / all_med,
              "median_step_none_s": none_med, "median_step_all_s": all_med, "target": 1.005,
              "settings": vars(a), "raw_step_seconds": arms, "paired_ratios": paired}
    write_result("overhead", result)
    print(table(["arm", "median step s", "steps"], [["none", none_med, len(paired)], ["all four", all_med,
                                                                                        len(paired)]]))
    print(table(["median paired ratio", "IQR", "ratio of medians", "callback time / step", "as a ratio", "target"],
                [[result["median_paired_ratio"], "–".join(f"{q:.3f}" for q in result["paired_ratio_iqr"]),
                  result["ratio_of_medians"], f"{result['callback_seconds_per_step'] * 1000:.2f} ms",
                  1 + result["callback_overhead_fraction"], "<= 1.005"]]))


if __name__ == "__main__":
    main()
