"""3. Tuner quality: GRPO+LoRA (0.5B-shaped) at a fixed effective batch (8 generations × 4 prompts = 32
completions per optimizer step). Throughput of (a) the split the tuner's probe chooses, (b) every exact split,
(c) micro-batch 1; (d) the probe's cost and choice against an interleaved A/B of the chosen and the configured split
(``--part ab``: fresh runs A B B A A B ..., per-step times after the first step, Mann-Whitney on the per-run
medians); and the tuner under a small forced memory budget (``set_per_process_memory_fraction``).

``--part ab --model smollm2`` runs part (d) on the real SmolLM2-135M-Instruct (bf16, chat prompts; results in
``tuner_ab_smollm2.json``). ``--smoke`` runs part (d) on the CPU with the demo's trainer
(``hf_perf_callbacks.demo``: the real SmolLM2-135M-Instruct, 4×1, 8 steps), as the demo runs it; its figures are
the CPU's.

Splits are ranked by the split-dependent time (step minus generation: generation does not depend on the split and
varies by ±12% between identical batches), reported as training tokens/s; end-to-end tokens/s beside it.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch
from common import GB, StepClock, grpo_trainer, median, release, smollm2, table, write_result
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, train_with_tuning
from hf_perf_callbacks.batching import exact_splits
from hf_perf_callbacks.device import DeviceLayer, training_device
from hf_perf_callbacks.stats import iqr, mann_whitney_less


def measure(clock: StepClock, skip: int = 1) -> dict:
    walls, gens, tokens = clock.walls[skip:], clock.generation[skip:], clock.tokens[skip:]
    rest = [w - g for w, g in zip(walls, gens)]
    return {"step_s": median(walls), "non_generation_s": median(rest), "tokens_per_step": median(tokens),
            "tokens_per_sec": median(tokens) / median(walls), "train_tokens_per_sec": median(tokens) / median(rest)}


def sweep_one(micro: int, accum: int, a) -> dict:
    clock = StepClock()
    trainer = grpo_trainer(tempfile.mkdtemp(), [clock], micro, accum, a.steps, a.completion)
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        return {"split": f"{micro}×{accum}", "error": str(error)[:120]}
    result = {"split": f"{micro}×{accum}", "micro": micro, "accum": accum,
              "peak_gb": torch.cuda.max_memory_allocated() / GB, **measure(clock)}
    release(trainer)
    return result


def tuned(a, start: tuple[int, int], limit_gb: float | None = None) -> dict:
    clock = StepClock()
    # the choice's quality on a short run: probe every split (a 4-step run could not pay for any probing)
    tuner = AdaptiveBatchTuner(probe_steps=a.probe_steps, rank_by=a.rank_by, probe_must_pay=False)
    watchdog = MemoryWatchdog(limit_gb=limit_gb)      # its budget bounds the probe; its high-water mark is the peak
    trainer = grpo_trainer(tempfile.mkdtemp(), [clock, tuner, watchdog], start[0], start[1], a.steps, a.completion)
    train_with_tuning(trainer)
    probe = tuner.decisions[0]
    result = {"chosen": f"{trainer.args.per_device_train_batch_size}×{trainer.args.gradient_accumulation_steps}",
              "probe_sec": probe["probe_sec"], "trials": probe["trials"], "reason": probe["reason"],
              "peak_gb": watchdog.high_water / GB, **measure(clock)}
    release(trainer)
    return result


class WallSteps(TrainerCallback):
    """Device-agnostic step timer: synchronized wall time per optimizer step, generation excluded alongside."""

    def __init__(self):
        self.walls, self.generation = [], []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.device = DeviceLayer(training_device())
        self.device.synchronize()
        self.start = time.perf_counter()
        self._gen = 0.0
        original = model.generate

        def timed(*a, **k):
            t = time.perf_counter()
            out = original(*a, **k)
            self._gen += time.perf_counter() - t
            return out

        model.generate = timed

    def on_step_end(self, args, state, control, **kwargs):
        self.device.synchronize()
        now = time.perf_counter()
        self.walls.append(now - self.start)
        self.generation.append(self._gen)
        self.start, self._gen = now, 0.0


class StopAfter(TrainerCallback):
    """Ends training after ``steps`` optimizer steps (the probe planned for the whole ``max_steps``)."""

    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_training_stop = True


def make_trainer(a, callbacks, micro, accum, steps):
    if a.smoke:
        from hf_perf_callbacks.demo import build_demo_trainer

        return build_demo_trainer(tempfile.mkdtemp(), max_steps=steps, callbacks=callbacks,
                                  per_device_train_batch_size=micro, gradient_accumulation_steps=accum)
    if a.model == "smollm2":
        factory, tok = smollm2()
        return grpo_trainer(tempfile.mkdtemp(), callbacks, micro, accum, steps, a.completion, model=factory(),
                            tokenizer_=tok, conversational=True)
    return grpo_trainer(tempfile.mkdtemp(), callbacks, micro, accum, steps, a.completion)


def probe_and_ab(a) -> dict:
    """The probe's cost and choice on a run planned for ``--plan_steps`` steps from the configured split (stopped
    after ``--steps``), then an interleaved A/B of the chosen split against the configured one (or, when it kept the
    configured split, against the best other split it measured: was keeping right?)."""
    configured = tuple(a.configured)
    timer = WallSteps()
    tuner = AdaptiveBatchTuner(probe_steps=a.probe_steps, rank_by=a.rank_by)
    trainer = make_trainer(a, [timer, tuner, StopAfter(a.steps)], configured[0], configured[1], a.plan_steps)
    started = time.perf_counter()
    train_with_tuning(trainer)
    total = time.perf_counter() - started
    decision = tuner.decisions[0]
    chosen = (decision["new"]["micro_batch"], decision["new"]["grad_accum"])
    others = [t for t in decision["trials"] if t.get("samples") and (t["split"]["micro_batch"],
                                                                      t["split"]["grad_accum"]) != configured]
    best_other = min(others, key=lambda t: t["ranked_time"])["split"] if others else None
    rival = chosen if chosen != configured else (
        (best_other["micro_batch"], best_other["grad_accum"]) if best_other else tuple(a.rival) if a.rival else None)
    train_sec = sum(timer.walls)
    del trainer
    ab = {}
    if rival is not None:
        arms = {configured: [], rival: []}
        for r in range(a.ab_rounds):
            for split in ((configured, rival) if r % 2 == 0 else (rival, configured)):   # A B, B A, ...
                clock = WallSteps()
                run = make_trainer(a, [clock], split[0], split[1], a.ab_steps)
                run.train()
                rest = [w - g for w, g in zip(clock.walls[1:], clock.generation[1:])]
                arms[split].append({"step_s": median(clock.walls[1:]), "non_generation_s": median(rest),
                                    "walls": clock.walls})
                del run
        key = "step_s" if a.rank_by == "step" else "non_generation_s"
        a_runs, b_runs = [x[key] for x in arms[configured]], [x[key] for x in arms[rival]]
        ab = {"configured": f"{configured[0]}×{configured[1]}", "other": f"{rival[0]}×{rival[1]}",
              "other_is_chosen": rival == chosen, "other_measured_by_probe": best_other is not None,
              "metric": key, "configured_runs": arms[configured],
              "other_runs": arms[rival], "configured_median": median(a_runs), "other_median": median(b_runs),
              "configured_iqr": iqr(a_runs), "other_iqr": iqr(b_runs),
              "other_over_configured": median(b_runs) / median(a_runs),
              "p_other_faster": mann_whitney_less(b_runs, a_runs),
              "p_configured_faster": mann_whitney_less(a_runs, b_runs)}
    return {"configured": f"{configured[0]}×{configured[1]}", "chosen": f"{chosen[0]}×{chosen[1]}",
            "probe_sec": decision["probe_sec"], "probe_reason": decision["reason"], "trials": decision["trials"],
            "expected_gain_sec": decision.get("expected_gain_sec"), "ceiling_sec": decision.get("ceiling_sec"),
            "train_with_tuning_sec": total, "train_sec": train_sec,
            "probe_share_of_run": decision["probe_sec"] / total if total else None, "ab": ab}


def report_ab(result: dict) -> None:
    print(table(["configured", "chosen", "probe s", "train s", "could save ≤ s", "expected gain s"],
                [[result["configured"], result["chosen"], result["probe_sec"], result["train_sec"],
                  result["ceiling_sec"], result["expected_gain_sec"]]]))
    ab = result["ab"]
    if ab:
        print(table(["A/B", f"{ab['metric']} configured", "other", "other/configured", "p other faster",
                     "p configured faster"],
                    [[f"{ab['configured']} vs {ab['other']}" + (" (chosen)" if ab["other_is_chosen"] else
                                                                  " (best other)" if ab["other_measured_by_probe"]
                                                                  else " (--rival)"),
                      ab["configured_median"], ab["other_median"], ab["other_over_configured"],
                      ab["p_other_faster"], ab["p_configured_faster"]]]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--probe_steps", type=int, default=4)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--part", default="all", choices=["all", "sweep", "tuned", "budget", "ab"])
    p.add_argument("--limit_gb", type=float, default=None)
    p.add_argument("--rank_by", default="non_generation", choices=["step", "non_generation"])
    p.add_argument("--configured", type=int, nargs=2, default=[4, 8], help="micro-batch and accumulation")
    p.add_argument("--ab_rounds", type=int, default=6, help="A/B runs per arm, interleaved")
    p.add_argument("--ab_steps", type=int, default=8, help="steps per A/B run (the first is not counted)")
    p.add_argument("--plan_steps", type=int, default=300, help="max_steps the probe plans for (part ab)")
    p.add_argument("--rival", type=int, nargs=2, default=None,
                   help="the A/B's other split when the probe kept the configured one without measuring another")
    p.add_argument("--smoke", action="store_true", help="CPU, the demo's trainer and split: part ab only")
    p.add_argument("--model", default="qwen05", choices=["qwen05", "smollm2"],
                   help="part ab's model: the random 0.5B-shaped one or the real SmolLM2-135M-Instruct (bf16)")
    a = p.parse_args()
    if a.smoke:
        a.part = "ab"
        if a.configured == [4, 8]:                      # the demo's split and length (hf_perf_callbacks.demo)
            a.configured = [4, 1]
            a.plan_steps = 8
            a.rival = a.rival or [2, 2]                 # the next exact split the probe would have measured
    if a.part == "ab":
        result = {"probe_ab": probe_and_ab(a), "settings": vars(a)}
        write_result("tuner_smoke" if a.smoke else "tuner_ab" if a.model == "qwen05" else f"tuner_ab_{a.model}",
                     result)
        report_ab(result["probe_ab"])
        return
    if a.part == "all":                    # each part in its own process (a memory fraction is per process)
        parts = {}
        for part in ("sweep", "tuned", "ab"):
            parts[part] = _child(part, a)
        sweep = [r for r in parts["sweep"] if "error" not in r]
        peaks = {r["split"]: r["peak_gb"] for r in sweep}
        limit = 0.5 * (peaks["8×4"] + peaks["16×2"])           # only splits up to 8 completions fit
        parts["budget"] = _child("budget", a, limit)
        report(parts["sweep"], parts["tuned"], parts["budget"], limit, a, parts["ab"])
        return
    if a.part == "sweep":
        rows = [sweep_one(s.micro_batch, s.grad_accum, a) for s in exact_splits(32, 1, 32, 8)]
        print("RESULT", json.dumps(rows))
    elif a.part == "tuned":
        print("RESULT", json.dumps(tuned(a, (4, 8))))
    elif a.part == "ab":
        print("RESULT", json.dumps(probe_and_ab(a)))
    else:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (a.limit_gb + 0.5) * GB /
                                                       torch.cuda.get_device_properties(0).total_memory))
        print("RESULT", json.dumps(tuned(a, (32, 1), limit_gb=a.limit_gb)))


def _child(part: str, a, limit: float | None = None):
    cmd = [sys.executable, __file__, "--part", part, "--steps", str(a.steps), "--probe_steps", str(a.probe_steps),
           "--completion", str(a.completion), "--rank_by", a.rank_by, "--ab_rounds", str(a.ab_rounds),
           "--ab_steps", str(a.ab_steps), "--plan_steps", str(a.plan_steps),
           "--configured", *map(str, a.configured)] + (["--rival", *map(str, a.rival)] if a.rival else []) + (
        ["--limit_gb", str(limit)] if limit else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def report(sweep, tuned_run, budget_run, limit, a, ab_run=None):
    ok = [r for r in sweep if "error" not in r]
    best = max(ok, key=lambda r: r["train_tokens_per_sec"])
    one = next(r for r in ok if r["micro"] == 1)
    result = {"sweep": sweep, "tuned": tuned_run, "budget": {**budget_run, "limit_gb": limit},
              "best_split": best["split"],
              "tuned_vs_best_train": tuned_run["train_tokens_per_sec"] / best["train_tokens_per_sec"],
              "tuned_vs_best_end_to_end": tuned_run["tokens_per_sec"] / max(r["tokens_per_sec"] for r in ok),
              "tuned_vs_micro1_train": tuned_run["train_tokens_per_sec"] / one["train_tokens_per_sec"],
              "tuned_vs_micro1_end_to_end": tuned_run["tokens_per_sec"] / one["tokens_per_sec"],
              "budget_respected": budget_run["peak_gb"] <= limit, "settings": vars(a), "probe_ab": ab_run,
              "targets": {"tuned_vs_best": 0.95}}
    write_result("tuner", result)
    print(table(["split", "step s", "non-gen s", "train tok/s", "end-to-end tok/s", "peak GB"],
                [[r["split"], r["step_s"], r["non_generation_s"], r["train_tokens_per_sec"], r["tokens_per_sec"],
                  r["peak_gb"]] for r in ok] + [[f"tuner: {tuned_run['chosen']}", tuned_run["step_s"],
                                                 tuned_run["non_generation_s"], tuned_run["train_tokens_per_sec"],
                                                 tuned_run["tokens_per_sec"], tuned_run["peak_gb"]]]))
    print(table(["tuned/best (train)", "tuned/best (e2e)", "tuned/micro-1 (train)", "tuned/micro-1 (e2e)",
                 "probe s", f"budget {limit:.2f} GB: chosen", "peak GB"],
                [[result["tuned_vs_best_train"], result["tuned_vs_best_end_to_end"], result["tuned_vs_micro1_train"],
                  result["tuned_vs_micro1_end_to_end"], tuned_run["probe_sec"], budget_run["chosen"],
                  budget_run["peak_gb"]]]))
    if ab_run:
        report_ab(ab_run)


if __name__ == "__main__":
    main()
