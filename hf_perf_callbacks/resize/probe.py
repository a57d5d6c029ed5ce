"""The pre-flight probe: real optimizer steps per exact split at the worst-case length, judged against the noise,
and only as many as the rest of the run can pay back.

GRPO completions are forced to ``max_completion_length``; otherwise the longest examples are used; learning rate 0,
with weights, RNG, data and callbacks restored afterwards. Each split is ranked by its step time minus generation
(``rank_by="non_generation"``, the default: the generation batch is the same for every split, and HF ``generate``
is launch-bound and jitters by tens of percent) or by the whole step time (``"step"``).

**Order.** The configured split is measured first (a warm-up step, then one measured step). When it does not fit
(out of memory on any rank, or a peak over the watchdog's budget) the probe walks down to the largest split that
fits and takes it, whatever that costs. Otherwise the other splits follow, nearest larger micro-batches first (the
walk upwards ends at the first that does not fit), then nearest smaller ones (the walk downwards ends after
``probe_patience`` in a row whose first step was over 5% slower than the configured split's).

**Cost against gain.** No split can save more per step than the configured split's split-dependent time (its
measured step time minus generation), so the probe can never earn more than that times the steps the run has left
(``max_steps``, or epochs × steps per epoch): the *ceiling*. What the probe has spent counts against it: its setup
(reading every row to find the longest examples, a CPU copy of the trainable weights; ``setup_sec`` in the decision)
and the configured split's first visit. Every later visit costs about what that first visit cost. The probe tries
only as many other splits, for as many rounds, as what is left of the ceiling pays for (at least 3 rounds: fewer
samples cannot separate two splits), and none when not even one can pay: it says so in the decision and on the
console. Each later visit is checked against what is left of the ceiling. ``probe_sec`` is the whole cost, setup
and restore included.

**Evidence.** After the first visits, the splits are measured in interleaved rounds (A B C, B C A, ...: load that
drifts hits every split alike), one step per visit; a split whose every sample is slower than every sample of the
configured split is dropped. :func:`judge` keeps the configured split unless another is faster beyond the noise: a
one-sided Mann-Whitney test of its samples against the configured split's at ``ALPHA`` and a median at least
``MIN_GAIN`` shorter; among such splits the lowest median wins. The decision records every split's samples, median
and interquartile range, p-value, cost in seconds and the expected gain over the rest of the run.

**Ranks.** Every visit gathers each rank's figures and keeps the slowest rank's times, the highest peak and any
rank's failure, so every rank holds the same samples and takes the same decisions.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict

import torch
from transformers import TrainerCallback

from .. import adapter
from ..batching import Split
from ..device import (GB, DeviceLayer, gather_floats, is_main_process, rng_state, set_rng_state, training_device,
                      world_size)
from ..stats import iqr, mann_whitney_less, median
from ..watchdog import MemoryWatchdog
from .agreement import recoverable
from .callback import AdaptiveBatchTuner, apply_split, current_split, find_callback, fmt_split

#: one-sided significance level of "faster than the configured split"
ALPHA = 0.05
#: the least relative saving (of the ranked time) worth a switch
MIN_GAIN = 0.03
#: fewer samples per split cannot separate two splits (3 against 3: p ≥ 0.05)
MIN_ROUNDS = 3
#: the clock of the measured steps (tests plant step times through it)
CLOCK = time.perf_counter
#: the clock of the probe's costs: real seconds (tests plant a slow setup through it)
WALL = time.perf_counter
#: a smaller split whose first step is this much slower than the configured split's counts against patience
SLOWER = 1.05


# ---------------------------------------------------------------- pure decision rules

def judge(samples: dict[str, list[float]], configured: str, remaining_steps: int | None = None) -> dict:
    """Which split to keep, from per-split samples of the ranked time (seconds per step).

    The configured split stays unless another is faster beyond the noise: one-sided Mann-Whitney p ≤ ``ALPHA``
    against the configured split's samples and a median at least ``MIN_GAIN`` (relative) shorter. Among those, the
    lowest median wins. Returns the choice, per-split statistics (n, median, quartiles, p-value, relative gain) and
    the expected saving over ``remaining_steps`` (None when the run's length is unknown).
    """
    if not samples.get(configured):
        raise ValueError(f"configured={configured!r} is not allowed: it needs samples (got {sorted(samples)})")
    base = samples[configured]
    base_median = median(base)
    stats: dict[str, dict] = {}
    for key, values in samples.items():
        if not values:
            continue
        q1, q3 = iqr(values)
        entry = {"n": len(values), "median": median(values), "q1": q1, "q3": q3}
        if key != configured:
            entry["p_value"] = mann_whitney_less(values, base)
            entry["gain"] = 1.0 - entry["median"] / base_median if base_median > 0 else 0.0
            entry["faster"] = entry["p_value"] <= ALPHA and entry["gain"] >= MIN_GAIN
        stats[key] = entry
    winners = [k for k, s in stats.items() if s.get("faster")]
    chosen = min(winners, key=lambda k: stats[k]["median"]) if winners else configured
    saving = base_median - stats[chosen]["median"]
    return {"chosen": chosen, "stats": stats, "saving_sec_per_step": saving,
            "expected_gain_sec": saving * remaining_steps if remaining_steps is not None else None}


def plan_probe(remaining_steps: int | None, configured_sec: float, visit_sec: float, others: int, rounds: int,
               must_pay: bool = True, spent_sec: float = 0.0) -> dict:
    """How many other splits, for how many rounds, the rest of the run can pay for.

    ``configured_sec``: the configured split's ranked time per step (no split can save more per step);
    ``visit_sec``: the cost of one visit (the configured split's first); ``spent_sec``: what the probe has cost so
    far (its setup and the configured split's first visit). The ceiling is ``remaining_steps × configured_sec``;
    ``spent_sec`` plus the visits must stay within it. The configured split needs ``rounds - 1`` more visits, each
    other split ``rounds``. Rounds fall to ``MIN_ROUNDS`` before splits are dropped; below that the probe stops.
    Without a known run length (or ``must_pay=False``) everything is probed. ``estimated_cost_sec``: the probe's
    whole cost, ``spent_sec`` included (when it cannot pay: with one more split at ``MIN_ROUNDS`` rounds).
    """
    ceiling = remaining_steps * configured_sec if remaining_steps is not None else None
    if ceiling is None or not must_pay or others == 0:
        return {"others": others, "rounds": rounds, "ceiling_sec": ceiling, "estimated_cost_sec": None}
    left = ceiling - spent_sec
    for r in range(rounds, min(rounds, MIN_ROUNDS) - 1, -1):
        if visit_sec > 0:
            affordable = math.floor((left - (r - 1) * visit_sec) / (r * visit_sec))
        else:
            affordable = others if left >= 0 else 0
        if affordable >= 1:
            n = min(others, affordable)
            return {"others": n, "rounds": r, "ceiling_sec": ceiling,
                    "estimated_cost_sec": spent_sec + ((r - 1) + n * r) * visit_sec}
    return {"others": 0, "rounds": 0, "ceiling_sec": ceiling,
            "estimated_cost_sec": spent_sec + (MIN_ROUNDS * 2 - 1) * visit_sec}


# ---------------------------------------------------------------- measuring

class _ProbeTimer(TrainerCallback):
    """Times optimizer steps (minus generation) and tracks peak memory during a probe run."""

    def __init__(self, device: DeviceLayer):
        self.device = device
        self.steps: list[tuple[float, float]] = []   # (step seconds, generation seconds)
        self.peak = 0.0
        self.generation = adapter.GenerationClock()

    def on_step_begin(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.start = CLOCK()
        self.generation.reset()

    def on_step_end(self, args, state, control, **kwargs):
        self.device.synchronize()
        self.steps.append((CLOCK() - self.start, self.generation.seconds))
        self.peak = max(self.peak, float(self.device.memory().used))


class _Trial:
    """Everything measured for one split (the same on every rank)."""

    def __init__(self, split: Split):
        self.split = split
        self.samples: list[float] = []        # ranked time per measured step (the slowest rank's)
        self.step_samples: list[float] = []   # whole step time per measured step
        self.peak = 0.0
        self.error: str | None = None
        self.cost = 0.0                       # seconds of every visit (warm-up steps and restarts included)
        self.visits = 0
        self.fits = False

    def record(self) -> dict:
        out = {"split": asdict(self.split), "samples": self.samples, "step_samples": self.step_samples,
               "peak": self.peak, "cost_sec": self.cost, "visits": self.visits, "fits": self.fits}
        if self.error:
            out["error"] = self.error
        if self.samples:
            out["ranked_time"] = median(self.samples)
            out["step_time"] = median(self.step_samples)
        return out


def _visit(trainer, trial: _Trial, device: DeviceLayer, budget: float, key: str, warm: bool) -> float:
    """One train() of 1 step (2 with a warm-up step) at ``trial.split``; returns its cost in seconds (all ranks)."""
    started = WALL()
    apply_split(trainer, trial.split)
    trainer.args.max_steps = 2 if warm else 1
    timer = _ProbeTimer(device)
    trainer.callback_handler.callbacks = [cb for cb in trainer.callback_handler.callbacks
                                          if type(cb).__name__ == "DefaultFlowCallback"] + [timer]
    stop_watching = adapter.watch_generate(trainer.model, timer.generation)
    device.reset_peak()
    error = None
    try:
        trainer.train()
    except Exception as raised:  # noqa: BLE001
        if not recoverable(raised):
            raise
        error = f"out of memory: {str(raised).splitlines()[0][:120]}"
    finally:
        stop_watching()
        adapter.forget_last_train(trainer)
        device.empty_cache()
    measured = timer.steps[1:] if warm else timer.steps
    failed = error is not None or not measured
    step = measured[0][0] if not failed else 0.0
    ranked = step if key == "step" else (step - measured[0][1] if not failed else 0.0)
    cost = WALL() - started
    # every rank must judge the visit alike: the slowest rank's times, the highest peak, any rank's failure
    rows = gather_floats([ranked, step, timer.peak, float(failed), cost], device.device)
    trial.visits += 1
    trial.cost += max(r[4] for r in rows)
    trial.peak = max(trial.peak, max(r[2] for r in rows))
    if max(r[3] for r in rows) > 0:
        trial.error = error or "out of memory on another rank"
    else:
        trial.samples.append(max(r[0] for r in rows))
        trial.step_samples.append(max(r[1] for r in rows))
    trial.fits = trial.error is None and trial.peak <= budget
    return max(r[4] for r in rows)


def planned_steps(trainer) -> int | None:
    """Optimizer steps the run will take: ``max_steps``, else epochs × steps per epoch (as the Trainer counts
    them); None when the dataloader has no length."""
    args = trainer.args
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    try:
        batches = len(trainer.get_train_dataloader())
    except (TypeError, ValueError, NotImplementedError):
        return None
    accum = args.gradient_accumulation_steps
    per_epoch = max(batches // accum + int(batches % accum > 0), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


# ---------------------------------------------------------------- the probe

def run_probe(trainer, tuner: AdaptiveBatchTuner) -> Split:
    args = trainer.args
    config = tuner.settings()
    device = DeviceLayer(training_device())
    watchdog = find_callback(trainer, MemoryWatchdog) or MemoryWatchdog()
    budget = min(r[0] for r in gather_floats([watchdog.budget_bytes(device)], device.device))   # the tightest rank
    limit = config["max_micro_batch"]
    original = current_split(args)
    others = [s for s in tuner.candidates(args) if s != original and (limit is None or s.micro_batch <= limit)]
    larger = sorted((s for s in others if s.micro_batch > original.micro_batch), key=lambda s: s.micro_batch)
    smaller = sorted((s for s in others if s.micro_batch < original.micro_batch), key=lambda s: -s.micro_batch)
    key = "step" if config["rank_by"] == "step" else "split"
    started = WALL()                                    # the setup is part of the probe's cost
    state = rng_state()
    planned = planned_steps(trainer)                    # building the dataloader may draw from the RNG: put it back
    set_rng_state(state)
    saved = _snapshot(trainer)                          # reads every row for the longest, copies the trained weights
    base = _Trial(original)
    trials = [base]
    plan: dict = {}
    note = ""
    outcome: dict | None = None
    setup = 0.0
    try:
        setup = max(r[0] for r in gather_floats([WALL() - started], device.device))    # the slowest rank's
        _visit(trainer, base, device, budget, key, warm=True)
        if not base.fits:                               # it cannot run as configured: the largest split that fits
            for split in smaller:
                trial = _Trial(split)
                trials.append(trial)
                _visit(trainer, trial, device, budget, key, warm=True)
                if trial.fits:
                    break
        else:
            plan = plan_probe(planned, base.samples[0], base.cost, len(larger) + len(smaller),
                              max(1, config["probe_steps"]), must_pay=config.get("probe_must_pay", True),
                              spent_sec=setup + base.cost)
            outcome = _search(trainer, base, larger, smaller, trials, plan, device, budget, key, config,
                              spent=setup + base.cost)
            note = outcome.pop("note", "")
    finally:
        _restore(trainer, saved)
    seconds = WALL() - started
    records = [t.record() for t in trials]
    fitting = [t for t in trials if t.fits]
    verdict = None
    if base.fits:
        samples = {str(t.split): t.samples for t in fitting}
        verdict = judge(samples, str(original), planned)
        chosen = next(t.split for t in fitting if str(t.split) == verdict["chosen"])
        for record in records:
            record.update({k: v for k, v in verdict["stats"].get(fmt_split(record["split"]), {}).items()
                           if k in ("median", "q1", "q3", "p_value", "gain", "faster")})
        why = _explain(verdict, original, chosen, note, planned, plan.get("estimated_cost_sec"), setup + base.cost)
    elif fitting:
        chosen = fitting[-1].split
        why = f"the configured split does not fit ({base.error or 'peak over the budget'}): the largest that does"
    else:
        chosen = original
        why = "no candidate fitted: keeping the configured split"
    apply_split(trainer, chosen)
    tuner.split = chosen
    decision = {"kind": "probe", "step": 0, "reason": why, "old": asdict(original), "new": asdict(chosen),
                "trials": records, "probe_sec": seconds, "setup_sec": setup, "planned_steps": planned, "budget_gb": budget / GB,
                "ceiling_sec": plan.get("ceiling_sec"), "rounds": plan.get("rounds"),
                "expected_gain_sec": verdict["expected_gain_sec"] if verdict else None,
                "rule": f"keep the configured split unless another is faster by Mann-Whitney p <= {ALPHA} and a "
                        f"median at least {MIN_GAIN:.0%} shorter ({'step time' if key == 'step' else 'step time minus generation'})"}
    tuner.decisions.append(decision)
    tuner.persist()
    if is_main_process():
        print(format_probe(decision))
    return chosen


def _search(trainer, base: _Trial, larger: list[Split], smaller: list[Split], trials: list[_Trial], plan: dict,
            device: DeviceLayer, budget: float, key: str, config: dict, spent: float) -> dict:
    """First visits of the other splits (as many as the plan affords), then interleaved rounds; ``spent``: the
    probe's cost so far (its setup and the configured split's first visit)."""
    ceiling = plan["ceiling_sec"] if config.get("probe_must_pay", True) else None

    def affordable(next_cost: float) -> bool:
        return ceiling is None or spent + next_cost <= ceiling

    if not larger and not smaller:
        return {"note": "no other split"}
    if plan["others"] == 0:
        return {"note": "cannot pay"}
    tried, stopped = 0, ""
    walks = [(larger, "larger"), (smaller, "smaller")]
    for walk, direction in walks:
        slower = 0
        for split in walk:
            if tried >= plan["others"]:
                stopped = stopped or "budget"
                break
            if not affordable(base.cost):
                stopped = "budget"
                break
            trial = _Trial(split)
            trials.append(trial)
            spent += _visit(trainer, trial, device, budget, key, warm=True)
            tried += 1
            if not trial.fits:
                if direction == "larger":          # a larger micro-batch will not fit either
                    break
                continue
            if direction == "smaller":
                slower = slower + 1 if trial.samples[0] > SLOWER * base.samples[0] else 0
                if slower >= config["probe_patience"]:
                    break
    contenders = [t for t in trials[1:] if t.fits]
    for round_index in range(1, plan["rounds"]):
        floor = max(base.samples)
        contenders = [t for t in contenders if min(t.samples) <= floor]   # every sample slower: it cannot win
        if not contenders:
            break
        live = [base] + contenders
        shift = round_index % len(live)
        order = live[shift:] + live[:shift]                              # A B C, B C A, ...
        cost = sum(t.cost / t.visits for t in order)
        if not affordable(cost):
            stopped = "budget"
            break
        for trial in order:
            spent += _visit(trainer, trial, device, budget, key, warm=False)
    return {"note": stopped}


def _explain(verdict: dict, original: Split, chosen: Split, note: str, planned: int | None,
             cost: float | None = None, spent: float = 0.0) -> str:
    stats = verdict["stats"]
    if note == "cannot pay":
        median = stats[str(original)]["median"]
        costs = (f"the ~{cost:.0f} s that the probe's setup and first visit ({spent:.1f} s) and measuring one more "
                 f"split {MIN_ROUNDS} times (and the configured one {MIN_ROUNDS - 1} more) would cost" if cost
                 else "what probing one more split costs")
        return (f"probe skipped after measuring the configured split: even a split with no split-dependent time "
                f"could save at most {median:.3f} s/step × {planned} steps = {median * (planned or 0):.0f} s, less "
                f"than {costs}")
    if note == "no other split":
        return "kept the configured split: it is the only exact split"
    if chosen == original:
        others = [(k, s) for k, s in stats.items() if k != str(original)]
        if not others:
            return "kept the configured split: no other split fits" + (
                ", probe cut short by its cost" if note == "budget" else "")
        best = min(others, key=lambda kv: kv[1]["median"])
        return (f"kept the configured split: no split faster beyond the noise (best other {best[0]}: median "
                f"{best[1]['median']:.3f} vs {stats[str(original)]['median']:.3f} s, p={best[1]['p_value']:.2f})"
                + (", probe cut short by its cost" if note == "budget" else ""))
    s = stats[str(chosen)]
    gain = verdict["expected_gain_sec"]
    return (f"{chosen} faster beyond the noise: median {s['median']:.3f} vs {stats[str(original)]['median']:.3f} s "
            f"(p={s['p_value']:.3f}, {s['gain']:.0%} shorter)"
            + (f", expected to save {gain:.1f} s over {planned} steps" if gain is not None else ""))


def format_probe(decision: dict) -> str:
    """The probe's decision for the console (printed once, by the main process)."""
    lines = [f"AdaptiveBatchTuner probe: {fmt_split(decision['old'])} → {fmt_split(decision['new'])} "
             f"({decision['reason']}); {decision['probe_sec']:.1f} s probing"
             + (f", the most it could save {decision['ceiling_sec']:.1f} s" if decision.get("ceiling_sec") else "")]
    lines += [f"  {_fmt_trial(t)}" for t in decision["trials"]]
    return "\n".join(lines)


def _snapshot(trainer) -> dict:
    args = trainer.args
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "max_steps", "learning_rate", "output_dir", "save_strategy", "logging_strategy",
            "report_to", "eval_strategy")
    saved = {"args": {k: getattr(args, k) for k in keys if hasattr(args, k)},
             "callbacks": list(trainer.callback_handler.callbacks),
             "dataset": trainer.train_dataset,
             "params": {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()
                        if p.requires_grad},
             "rng": rng_state(),
             "generation_config": getattr(trainer, "generation_config", None)}
    probe_dir = tempfile.mkdtemp(prefix="hf_perf_probe_")
    saved["probe_dir"] = probe_dir
    args.output_dir, args.learning_rate = probe_dir, 0.0
    for key, value in (("save_strategy", "no"), ("logging_strategy", "no"), ("eval_strategy", "no")):
        if hasattr(args, key):
            setattr(args, key, value)
    args.report_to = []
    if saved["generation_config"] is not None:          # GRPO: generate the longest completions
        config = saved["generation_config"]
        saved["min_new_tokens"] = config.min_new_tokens
        config.min_new_tokens = getattr(args, "max_completion_length", None)
    split = current_split(args)
    if hasattr(args, "num_generations"):              # prompts for every probe step of the largest candidate
        needed = split.generation_batch(world_size()) // args.num_generations
    else:
        needed = split.effective_batch(world_size())
    trainer.train_dataset = _longest(trainer.train_dataset, needed * 2)    # a warm-up step and a measured one
    return saved


def _restore(trainer, saved: dict) -> None:
    args = trainer.args
    for key, value in saved["args"].items():
        setattr(args, key, value)
    trainer.callback_handler.callbacks = saved["callbacks"]
    trainer.train_dataset = saved["dataset"]
    if saved["generation_config"] is not None:
        saved["generation_config"].min_new_tokens = saved["min_new_tokens"]
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name in saved["params"]:
                param.copy_(saved["params"][name])
    set_rng_state(saved["rng"])
    trainer.state = type(trainer.state)()
    shutil.rmtree(saved["probe_dir"], ignore_errors=True)
    adapter.forget_last_train(trainer)
    DeviceLayer(training_device()).empty_cache()


def _longest(dataset, count: int):
    """The ``count`` longest examples (worst-case memory), when lengths can be read; else the dataset itself."""
    try:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError):
        return dataset
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:max(1, count)]
    if hasattr(dataset, "select"):
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)


def _length(example) -> int:
    if "input_ids" in example:
        return len(example["input_ids"])
    prompt = example["prompt"]
    return len(prompt) if isinstance(prompt, str) else sum(len(m.get("content", "")) for m in prompt)


def _fmt_trial(t: dict) -> str:
    split = fmt_split(t["split"])
    if t.get("error"):
        return f"{split}: {t['error']} ({t['cost_sec']:.1f} s)"
    spread = f" (IQR {t['q1']:.3f}-{t['q3']:.3f})" if "q1" in t and len(t["samples"]) > 1 else ""
    p = f", p={t['p_value']:.3f}" if "p_value" in t else ""
    return (f"{split}: median {t['ranked_time']:.3f} s{spread} over {len(t['samples'])} step(s){p}, "
            f"{t['step_time']:.3f} s/step with generation, peak {t['peak'] / GB:.2f} GB"
            + ("" if t["fits"] else " (over budget)") + f", cost {t['cost_sec']:.1f} s")
