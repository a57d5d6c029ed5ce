"""2. Meter accuracy: steady tokens/s reported by ThroughputMeter vs an independent measurement (CUDA events at
every optimizer-step end, tokens counted from the generate calls), and the warmup end it reports vs the true end
(the first step within 5% of the steady median). Run in a fresh process: the first step is a cold one.
"""
import argparse
import json
import os
import tempfile

from common import StepClock, grpo_trainer, median, table, write_result

from hf_perf_callbacks import default_callbacks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--completion", type=int, default=32)
    a = p.parse_args()
    out = tempfile.mkdtemp()
    clock = StepClock()
    callbacks = [clock] + default_callbacks()
    trainer = grpo_trainer(out, callbacks, a.micro, a.accum, a.steps, a.completion)
    trainer.train()
    meter = callbacks[1]
    lines = [json.loads(x) for x in open(os.path.join(out, "perf_log.jsonl"))]
    steps = [x for x in lines if x["type"] == "step"]
    seconds = clock.event_seconds()
    steady = [i for i, s in enumerate(steps) if s.get("perf/steady")]
    if not steady:
        raise SystemExit(f"warmup did not end within {a.steps} steps: run with more --steps")
    independent = sum(clock.tokens[i] for i in steady) / sum(seconds[i] for i in steady)
    reported = meter.summary["steady_tokens_per_sec"]
    reference = median(seconds[len(seconds) // 2:])
    true_end = next(i for i, t in enumerate(seconds) if abs(t - reference) / reference <= 0.05)
    result = {"reported_steady_tokens_per_sec": reported, "independent_steady_tokens_per_sec": independent,
              "relative_error": reported / independent - 1, "reported_warmup_steps": meter.summary["warmup_steps"],
              "true_warmup_steps": true_end, "first_step_slowdown_measured": seconds[0] / reference,
              "first_step_slowdown_reported": meter.summary["first_step_slowdown"],
              "token_count_meter": sum(s["perf/tokens"] for s in steps), "token_count_independent": sum(clock.tokens),
              "event_seconds": seconds, "wall_seconds": clock.walls, "steady_steps": [steps[i]["step"] for i in steady],
              "settings": vars(a), "targets": {"relative_error": 0.01, "warmup_steps": 2}}
    write_result("accuracy", result)
    print(table(["steady tok/s (meter)", "independent", "error", "target"],
                [[reported, independent, f"{result['relative_error']:+.2%}", "±1%"]]))
    print(table(["warmup steps (meter)", "true", "first-step slowdown (measured)", "(meter)"],
                [[result["reported_warmup_steps"], true_end, result["first_step_slowdown_measured"],
                  result["first_step_slowdown_reported"]]]))


if __name__ == "__main__":
    main()
