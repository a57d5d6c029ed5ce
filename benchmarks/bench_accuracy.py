"""2. Meter accuracy: the steady tokens/s ThroughputMeter reports against an independent measurement over the SAME
steps the meter calls steady (its ``perf/first_steady_step`` and ``perf/steady`` lines, read back with
``hf_perf_callbacks.report.figures``):
CUDA events at every optimizer-step end on a GPU (the wall clock on a CPU), tokens
counted from the generate calls. Also the warmup end it reports against the first step within 5% of the steady
median. Run in a fresh process: the first step is a cold one.

GRPO steps are noisy (generation lengths vary), which is what the comparison is for. One line each:

    python benchmarks/bench_accuracy.py          # GPU: the Qwen2.5-0.5B-shaped GRPO+LoRA run -> results/accuracy.json
    python benchmarks/bench_accuracy.py --cpu    # CPU: the tests' tiny random model, fp32 -> results/accuracy_cpu.json

The result also gives the independent figure over the steps flagged ``perf/steady`` when their lines were written
(the definition an earlier version of this benchmark compared against: it leaves out the steps between the end of
warmup and its decision, which the meter counts).
"""
import argparse
import os
import tempfile

from common import StepClock, grpo_trainer, median, table, tokenizer, write_result

from hf_perf_callbacks import default_callbacks
from hf_perf_callbacks.core.runlog import PERF_STEADY, read_run
from hf_perf_callbacks.report.figures import figures


def build(a, out: str, callbacks: list):
    if not a.cpu:
        return grpo_trainer(out, callbacks, a.micro, a.accum, a.steps, a.completion)
    from hf_perf_callbacks.tiny import build_model

    tok = tokenizer()
    return grpo_trainer(out, callbacks, a.micro, a.accum, a.steps, a.completion, num_generations=2,
                        model=build_model(tok), tokenizer_=tok, use_cpu=True, bf16=False)


def rate(tokens: list[float], seconds: list[float], indices: list[int]) -> float:
    return sum(tokens[i] for i in indices) / sum(seconds[i] for i in indices)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="a tiny model on the CPU (wall clock instead of CUDA events)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 30 on a GPU, 16 on a CPU)")
    p.add_argument("--micro", type=int, default=None, help="micro-batch (default 16 on a GPU, 2 on a CPU)")
    p.add_argument("--accum", type=int, default=None, help="gradient accumulation (default 2 on a GPU, 1 on a CPU)")
    p.add_argument("--completion", type=int, default=None, help="max completion tokens (32 GPU, 8 CPU)")
    a = p.parse_args()
    for name, gpu, cpu in (("steps", 30, 16), ("micro", 16, 2), ("accum", 2, 1), ("completion", 32, 8)):
        if getattr(a, name) is None:
            setattr(a, name, cpu if a.cpu else gpu)
    if a.cpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    out = tempfile.mkdtemp()
    clock = StepClock(cuda=not a.cpu)
    # CPU (a shared, noisy machine): warmup is declared over after 4 steps at the latest, so 16 steps always have a
    # steady phase to compare; the comparison is of the same steps either way
    callbacks = [clock] + default_callbacks(**({"ThroughputMeter": {"max_warmup_steps": 4}} if a.cpu else {}))
    trainer = build(a, out, callbacks)
    trainer.train()
    meter = callbacks[1]
    run = read_run(out)
    f = figures(run)
    steps = [s.step for s in run.unique_steps()]
    seconds = clock.event_seconds()
    if len(steps) != len(seconds) or steps != list(range(1, len(seconds) + 1)):
        raise SystemExit(f"the perf log's steps {steps} do not match the {len(seconds)} steps the clock timed")
    if not f.warmup_done:
        raise SystemExit(f"warmup did not end within {a.steps} steps: run with more --steps")
    steady = [step - 1 for step in f.steady_steps]                     # the meter's steady steps, as indices
    flagged = [i for i, s in enumerate(run.unique_steps()) if s.number(PERF_STEADY) == 1]
    independent = rate(clock.tokens, seconds, steady)
    reported = f.steady_tokens_per_sec
    assert reported == meter.summary["steady_tokens_per_sec"]             # the report's figure is the meter's
    reference = median(seconds[len(seconds) // 2:])
    true_end = next(i for i, t in enumerate(seconds) if abs(t - reference) / reference <= 0.05)
    result = {"device": "cpu" if a.cpu else "cuda",
              "reported_steady_tokens_per_sec": reported, "independent_steady_tokens_per_sec": independent,
              "relative_error": reported / independent - 1,
              "independent_over_flagged_steps": rate(clock.tokens, seconds, flagged),
              "reported_steady_step_sec": f.steady_step_sec,
              "independent_steady_step_sec": sum(seconds[i] for i in steady) / len(steady),
              "reported_warmup_steps": f.warmup_steps, "first_steady_step": f.warmup_end_step,
              "true_warmup_steps": true_end, "first_step_slowdown_measured": seconds[0] / reference,
              "first_step_slowdown_reported": f.first_step_slowdown,
              "token_count_meter": sum(s.number("perf/tokens") or 0.0 for s in run.unique_steps()),
              "token_count_independent": sum(clock.tokens), "event_seconds": seconds, "wall_seconds": clock.walls,
              "steady_steps": f.steady_steps, "flagged_steps": [i + 1 for i in flagged],
              "settings": vars(a), "targets": {"relative_error": 0.01, "warmup_steps": 2}}
    write_result("accuracy_cpu" if a.cpu else "accuracy", result)
    print(table(["steady tok/s (meter)", "independent, same steps", "error", "target",
                 "independent, flagged steps only"],
                [[reported, independent, f"{result['relative_error']:+.2%}", "±1%",
                  result["independent_over_flagged_steps"]]]))
    print(table(["warmup steps (meter)", "true", "first-step slowdown (measured)", "(meter)"],
                [[result["reported_warmup_steps"], true_end, result["first_step_slowdown_measured"],
                  result["first_step_slowdown_reported"]]]))


if __name__ == "__main__":
    main()
