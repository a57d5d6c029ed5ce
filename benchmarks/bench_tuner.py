"""3. Tuner quality and cost: the tuning on the run's own steps against plain ``trainer.train()`` runs.

GRPO + LoRA on a fixed effective batch (GPU default: a Qwen2.5-0.5B-shaped model, 8 generations × 4 prompts = 32
completions of 32 tokens per optimizer step, bf16). Parts (each prints and writes its JSON to ``benchmarks/results``):

``--part sweep``   every exact split (or ``--splits``) trained plainly for ``--steps`` steps: median step time, time
                   outside generation, training and end-to-end tokens/s, peak memory (``tuner_sweep.json``)
``--part run``     ONE run of ``--steps`` steps from ``--split``: ``plain`` (``trainer.train()``) or ``tuned``
                   (``train_with_tuning``): its wall time from ``train()`` call to return, tokens, the split it ended
                   at, and the tuning's decision with every trial, cost and switch (``tuner_run_<label>.json``)
``--part switch``  what one switch costs (checkpoint, resume, the next train() call's start): runs that try every
                   split (``must_pay=False``) with LoRA and as a full fine-tune (``tuner_switch_<device>.json``)
``--part ab``      an interleaved A/B of two splits: fresh runs A B B A ..., per-step times after the first step,
                   Mann-Whitney on the per-run medians (``tuner_ab.json``)
``--part overhead``  what the package costs a step once the tuning has decided: four runs of ``--rival`` at once, one
                   a GPU (plain; plain with a MemoryWatchdog; tuned with it; tuned without it; ``--overhead_runs``:
                   some of them), their median seconds outside ``generate`` after step 20 against the plain run's
                   (``tuner_overhead_<card>_<steps>steps``)
``--part sequential``  the tuning from every ``--starts`` split (default 4×8, 2×16, 32×1), each run beside a plain
                   run of the best split (``--rival``, 32×1) at the same time on one GPU host, one process a GPU:
                   ``--part run`` in each, with ``CUDA_VISIBLE_DEVICES``; 2 × starts GPUs: each tuned run its own
                   plain twin; starts + 1: one plain run beside all; fewer (at least 2): the pairs one after another;
                   ``--swap``: each pair twice, the cards swapped, the cost the geometric mean of the two ratios
                   (with 2 GPUs a start, every pair at once; ``--half 0``, then ``--half 1``: one half a call);
                   ``--one-card``: each pair at once on one card, the pairs in turn (a host of one GPU), with the
                   plain run's excess while the tuned run was at its start and the ratio bounded by it.
                   Each pair's wall-time ratio tuned / plain (also with the plain run's seconds in generate), the steps
                   at the starting split, the decision (``tuner_sequential_<card>[_swapped|_one_card]_<starts>_
                   <steps>steps.json``; the per-run files are folded into it)

``--smoke`` uses the demo's trainer on the CPU (the real SmolLM2-135M-Instruct, chat prompts, 4×1; one prompt group
of four completions up to 40 tokens per step), as ``hf-perf demo`` runs it. ``--model smollm2`` uses the real model
on a GPU (bf16). The targets (issue: a probe that costs nothing) compare runs of one machine only:
``tuned / plain ≤ 1.03`` where the configured split is already the best, ``tuned / plain(best split) ≤ 1.05`` end to
end where a better one exists, and the tuned run's steady training throughput ≥ 0.95 of the sweep's best.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import GB, RESULTS, grpo_trainer, median, release, smollm2, table, write_result
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, train_with_tuning
from hf_perf_callbacks.core.batching import exact_splits
from hf_perf_callbacks.core.stats import iqr, mann_whitney_less
from hf_perf_callbacks.platform.device import DeviceLayer, training_device
from hf_perf_callbacks.resize.tuning import WARMUP_AT_START


class WallSteps(TrainerCallback):
    """Device-agnostic step timer, independent of the package: synchronized wall time per optimizer step, time in
    ``generate``, and tokens (prompt + completion, padding excluded) per step; survives the tuner's switches (every
    train() call of one run)."""

    def __init__(self):
        self.walls, self.generation, self.tokens, self.splits, self.ends = [], [], [], [], []
        self._gen = self._tokens = 0.0
        self._wrapped = None

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.device = DeviceLayer(training_device())
        self.device.synchronize()
        self.start = time.perf_counter()
        self._gen = self._tokens = 0.0
        if self._wrapped is model:
            return
        self._wrapped = model
        original = model.generate
        pad = getattr(processing_class, "pad_token_id", None)

        def timed(*a, **k):
            t = time.perf_counter()
            out = original(*a, **k)
            self._gen += time.perf_counter() - t
            ids = k.get("input_ids", a[0] if a else None)
            mask = k.get("attention_mask")
            new = out[:, ids.shape[1]:]
            self._tokens += float(mask.sum() if mask is not None else ids.numel())
            self._tokens += float((new != pad).sum() if pad is not None else new.numel())
            return out

        model.generate = timed

    def on_step_end(self, args, state, control, **kwargs):
        self.device.synchronize()
        now = time.perf_counter()
        self.walls.append(now - self.start)
        self.ends.append(time.time())                 # the epoch clock: two processes' steps can be lined up
        self.generation.append(self._gen)
        self.tokens.append(self._tokens)
        self.splits.append(f"{args.per_device_train_batch_size}×{args.gradient_accumulation_steps}")
        self.start, self._gen, self._tokens = now, 0.0, 0.0

    def summary(self, skip: int = 1) -> dict:
        walls, gens, tokens = self.walls[skip:], self.generation[skip:], self.tokens[skip:]
        rest = [w - g for w, g in zip(walls, gens)]
        return {"step_s": median(walls), "non_generation_s": median(rest), "tokens_per_step": median(tokens),
                "tokens_per_sec": sum(tokens) / sum(walls), "train_tokens_per_sec": sum(tokens) / sum(rest)}


def make_trainer(a, callbacks, split, steps, **extra):
    micro, accum = split
    if a.tiny:                                     # the tiny demo (2-layer random Llama, plain prompts), CPU
        from hf_perf_callbacks.demo import build_demo_trainer

        return build_demo_trainer(tempfile.mkdtemp(), max_steps=steps, callbacks=callbacks, model="tiny",
                                  per_device_train_batch_size=micro, gradient_accumulation_steps=accum, **extra)
    if a.smoke and not a.full:
        from hf_perf_callbacks.demo import build_demo_trainer

        return build_demo_trainer(tempfile.mkdtemp(), max_steps=steps, callbacks=callbacks,
                                  per_device_train_batch_size=micro, gradient_accumulation_steps=accum, **extra)
    if a.smoke:                                    # the demo's run as a full fine-tune, on the CPU
        import torch

        factory, tok = smollm2(dtype=torch.float32, device="cpu")
        return grpo_trainer(tempfile.mkdtemp(), callbacks, micro, accum, steps, 40, num_generations=4,
                            model=factory(), tokenizer_=tok, conversational=True, peft=False, use_cpu=True,
                            bf16=False, learning_rate=2e-5, **extra)
    kwargs = {}
    if a.model == "smollm2":
        factory, tok = smollm2()
        kwargs = dict(model=factory(), tokenizer_=tok, conversational=True)
    if a.full:
        kwargs["peft"] = False
    return grpo_trainer(tempfile.mkdtemp(), callbacks, micro, accum, steps, a.completion, **kwargs, **extra)


def sweep(a) -> list[dict]:
    import torch

    rows = []
    splits = [tuple(s) for s in a.splits] if a.splits else [(s.micro_batch, s.grad_accum)
                                                             for s in exact_splits(32, 1, 32, 8)]
    for split in splits:
        timer = WallSteps()
        trainer = make_trainer(a, [timer], split, a.steps)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            trainer.train()
        except torch.OutOfMemoryError as error:
            rows.append({"split": f"{split[0]}×{split[1]}", "error": str(error)[:120]})
            continue
        peak = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else None
        rows.append({"split": f"{split[0]}×{split[1]}", "peak_gb": peak, **timer.summary()})
        release(trainer)
    print(table(["split", "step s", "non-gen s", "train tok/s", "end-to-end tok/s", "peak GB"],
                [[r["split"], r.get("step_s"), r.get("non_generation_s"), r.get("train_tokens_per_sec"),
                  r.get("tokens_per_sec"), r.get("peak_gb")] for r in rows]))
    return rows


def one_run(a) -> dict:
    timer = WallSteps()
    tuner = AdaptiveBatchTuner(must_pay=not a.try_all)
    watchdog = a.watchdog if a.watchdog is not None else a.mode == "tuned"
    callbacks = [timer] + ([tuner] if a.mode == "tuned" else []) + ([MemoryWatchdog()] if watchdog else [])
    trainer = make_trainer(a, callbacks, tuple(a.split), a.steps)
    started, cpu, started_unix = time.perf_counter(), time.process_time(), time.time()
    if a.mode == "tuned":
        train_with_tuning(trainer)
    else:
        trainer.train()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    result = {"mode": a.mode, "start": f"{a.split[0]}×{a.split[1]}", "steps": trainer.state.global_step,
              "wall_sec": wall, "cpu_sec": cpu, "end": f"{trainer.args.per_device_train_batch_size}×"
                                      f"{trainer.args.gradient_accumulation_steps}",
              "tokens": sum(timer.tokens), "steps_by_split": _counts(timer.splits),
              "step_walls": timer.walls, "step_generation": timer.generation, "started_unix": started_unix,
              "step_ends_unix": timer.ends, **timer.summary()}
    if a.mode == "tuned":
        session = tuner.executor
        result["decisions"] = [d.to_json() for d in session.decisions]
        result["switch_sec"] = list(session.tuning.switch_seconds) if session.tuning else []
    print(table(["mode", "start", "end", "steps", "wall s", "step s", "non-gen s", "tok/s"],
                [[a.mode, result["start"], result["end"], result["steps"], wall, result["step_s"],
                  result["non_generation_s"], result["tokens_per_sec"]]]))
    for d in result.get("decisions", []):
        print(f"  {d['kind']} at step {d['step']}: {d['reason']} (cost {d['cost_sec']}, gain {d['expected_gain_sec']})")
    release(trainer)
    return result


def switch_cost(a) -> dict:
    """Switch costs with LoRA and as a full fine-tune: a tuned run that tries every split (the switches the tuning
    makes are measured from the stop request to the next train() call's first step)."""
    out = {}
    for full in (False, True):
        a.full = full
        tuner = AdaptiveBatchTuner(must_pay=False, samples=3, max_rounds=1)
        trainer = make_trainer(a, [tuner], tuple(a.split), a.steps)
        train_with_tuning(trainer)
        tuning = tuner.executor.tuning
        state = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        out["full_finetune" if full else "lora"] = {"switch_sec": list(tuning.switch_seconds),
                                                    "trainable_gb": state / GB, "steps": trainer.state.global_step}
        print(f"{'full fine-tune' if full else 'LoRA'}: switches {tuning.switch_seconds} s, trainable "
              f"{state / GB:.3f} GiB")
        release(trainer)
    return out


def ab(a) -> dict:
    """Interleaved A/B of ``--split`` against ``--rival``: per-run medians of the ranked time, Mann-Whitney."""
    first, second = tuple(a.split), tuple(a.rival)
    arms = {first: [], second: []}
    for r in range(a.ab_rounds):
        for split in ((first, second) if r % 2 == 0 else (second, first)):
            timer = WallSteps()
            run = make_trainer(a, [timer], split, a.ab_steps)
            run.train()
            arms[split].append({**timer.summary(), "walls": timer.walls})
            release(run)
    key = "non_generation_s"
    x, y = [r[key] for r in arms[first]], [r[key] for r in arms[second]]
    result = {"a": f"{first[0]}×{first[1]}", "b": f"{second[0]}×{second[1]}", "metric": key,
              "a_runs": arms[first], "b_runs": arms[second], "a_median": median(x), "b_median": median(y),
              "a_iqr": iqr(x), "b_iqr": iqr(y), "b_over_a": median(y) / median(x),
              "p_b_faster": mann_whitney_less(y, x), "p_a_faster": mann_whitney_less(x, y)}
    print(table(["A/B", "A s", "B s", "B/A", "p B faster", "p A faster"],
                [[f"{result['a']} vs {result['b']}", result["a_median"], result["b_median"], result["b_over_a"],
                  result["p_b_faster"], result["p_a_faster"]]]))
    return result


def side_by_side(a) -> dict:
    """``--part sequential``: tuned runs from each start and plain runs of the best split at the same time, one
    process a GPU (see the module docstring); every run ``--steps`` steps of the same trainer."""
    import torch

    gpus = torch.cuda.device_count() if not a.tiny else 2 * len(a.starts)     # --tiny: a CPU check of the plumbing
    if gpus < 2 and not a.one_card:
        raise SystemExit(f"--part sequential runs a tuned and a plain run side by side, one a GPU: it needs 2 GPUs at "
                         f"least, this host has {gpus} (--one-card: both on one card)")
    starts, best = [tuple(s) for s in a.starts], tuple(a.rival)
    twins = gpus >= 2 * len(starts)
    if a.one_card:
        if a.swap:
            raise SystemExit("--one-card runs a pair on one card: there are no cards to swap (drop --swap)")
        layout = "one card"                            # each pair at once on the first card, the pairs in turn
        waves = [[("tuned", start, 0), ("plain", start, 0)] for start in starts]
    elif a.swap and twins:
        layout = "swapped twins"                       # every pair at once on its two cards, then the cards swapped
        waves = [[("tuned", start, 2 * i + g) for i, start in enumerate(starts)]
                 + [("plain", start, 2 * i + 1 - g) for i, start in enumerate(starts)]
                 for g in ((0, 1) if a.half is None else (a.half,))]
    elif a.swap:
        layout = "swapped"                             # each pair twice, the cards swapped: their difference cancels
        waves = [[("tuned", start, g), ("plain", start, 1 - g)] for start in starts for g in (0, 1)]
    elif twins:
        layout = "twins"                               # each tuned run beside its own plain run
        waves = [[("tuned", start, 2 * i) for i, start in enumerate(starts)]
                 + [("plain", start, 2 * i + 1) for i, start in enumerate(starts)]]
    elif gpus >= len(starts) + 1:
        layout = "shared"                              # one plain run beside all of them
        waves = [[("tuned", start, i) for i, start in enumerate(starts)] + [("plain", None, len(starts))]]
    else:
        layout = "pairs in turn"
        waves = [[("tuned", start, 0), ("plain", start, 1)] for start in starts]
    runs: dict = {}
    for wave in waves:
        specs = []
        for mode, start, gpu in wave:
            split = start if mode == "tuned" else best
            label = f"seq_{mode}_{split[0]}x{split[1]}_gpu{gpu}" + (f"_from{start[0]}x{start[1]}" if a.swap else "")
            both = [] if a.watchdog is None else ["--watchdog" if a.watchdog else "--no-watchdog"]
            specs.append(((mode, start, gpu), gpu, label,
                          ["--mode", mode, "--split", str(split[0]), str(split[1]), *both]))
        runs.update(run_at_once(a, specs))
    if a.swap:
        bases = {start: 2 * i if twins else 0 for i, start in enumerate(starts)}
        if a.half is not None:
            runs = {**earlier_half(a, 1 - a.half), **runs}
            if len(runs) < 4 * len(starts):
                print(f"half {a.half} of the swap done; run --half {1 - a.half} with this file in the results folder")
                return {"layout": layout, "gpus": gpus, "half": a.half,
                        "runs": [[m, list(s), g, v] for (m, s, g), v in runs.items()]}
        return {"layout": layout, "gpus": gpus,
                "pairs": [swapped_pair(runs, start, best, bases[start]) for start in starts]}
    pairs = []
    for start in starts:
        tuned = next(v for (m, s, g), v in runs.items() if m == "tuned" and s == start)
        plain = next(v for (m, s, g), v in runs.items()
                     if m == "plain" and (s == start or s is None))
        t, p = tuned.get("run", {}), plain.get("run", {})
        name = f"{start[0]}×{start[1]}"
        tunes = [d for d in t.get("decisions", []) if d["kind"] == "tune"]
        pairs.append({"start": name, "best": f"{best[0]}×{best[1]}", "start_is_best": start == best,
                      **ratios(t, p), **(shared_card(t, p, name) if a.one_card else {}),
                      "tuned_wall_sec": t.get("wall_sec"), "plain_wall_sec": p.get("wall_sec"),
                      "steps_at_start": t.get("steps_by_split", {}).get(name), "end": t.get("end"),
                      "tune_step": tunes[0]["step"] if tunes else None,
                      "tune_reason": tunes[0]["reason"] if tunes else None,
                      "tuned": tuned, "plain": plain})
    print(table(["start", "end", "tuned s", "plain s", "tuned/plain", "same generation", "bound (one card)", "target",
                 "steps at start", "decided at"],
                [[r["start"], r["end"], r["tuned_wall_sec"], r["plain_wall_sec"], r["ratio"],
                  r["ratio_same_generation"], r.get("ratio_bound"), "1.00-1.01" if r["start_is_best"] else "<= 1.03",
                  r["steps_at_start"], r["tune_step"]]
                 for r in pairs]))
    return {"layout": layout, "gpus": gpus, "pairs": pairs}


def run_at_once(a, specs: list) -> dict:
    """``--part run`` processes at the same time, one a GPU (``CUDA_VISIBLE_DEVICES``): ``specs`` holds (key, gpu,
    label, arguments); each run's result file is folded into the answer (key → its gpu, exit code and result, or the
    log's end where it failed) and removed; all are killed at ``--timeout`` seconds."""
    folder = os.path.dirname(os.path.abspath(__file__))
    jobs = []
    for key, gpu, label, arguments in specs:
        command = [sys.executable, os.path.join(folder, "bench_tuner.py"), "--part", "run", *arguments,
                   "--steps", str(a.steps), "--completion", str(a.completion), "--label", label, "--model", a.model]
        command += (["--full"] if a.full else []) + (["--tiny"] if a.tiny else [])
        env = {k: v for k, v in os.environ.items() if k != "OUT"}                  # this part's file alone to $OUT
        env.update({"CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"})
        log = open(os.path.join(tempfile.gettempdir(), f"{label}.log"), "w")
        jobs.append((key, gpu, label, log, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                            cwd=folder)))
    deadline, runs = time.monotonic() + a.timeout, {}
    for key, gpu, label, log, process in jobs:
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timed out"
        log.close()
        path = os.path.join(RESULTS, f"tuner_run_{label}.json")            # where write_result put it
        entry = {"gpu": gpu, "exit": code, "log": open(log.name).read()[-2000:] if code != 0 else None}
        if code == 0 and os.path.exists(path):
            with open(path) as f:
                entry.update(json.load(f))
            os.remove(path)                               # folded into this part's file
        runs[key] = entry
    return runs


#: ``--part overhead``'s four runs: name → arguments of ``--part run`` (all from the rival split)
OVERHEAD_RUNS = {"plain": ["--mode", "plain"], "plain_watchdog": ["--mode", "plain", "--watchdog"],
                 "tuned": ["--mode", "tuned"], "tuned_no_watchdog": ["--mode", "tuned", "--no-watchdog"]}


def overhead(a) -> dict:
    """``--part overhead``: what the package costs a step once the tuning has decided, four runs of the rival split
    at once, one a GPU: plain, plain with a MemoryWatchdog, tuned (with the watchdog, as ``--part sequential``) and
    tuned without it; each run's median seconds outside ``generate`` after step 20, and its ratio to the plain
    run's."""
    import torch

    names = a.overhead_runs or list(OVERHEAD_RUNS)
    if "plain" not in names:
        raise SystemExit(f"--overhead_runs {' '.join(names)}: the plain run is the reference, name it too")
    if not a.tiny and torch.cuda.device_count() < len(names):
        raise SystemExit(f"--part overhead runs {len(names)} runs at once, one a GPU: this host has "
                         f"{torch.cuda.device_count()}")
    split = [str(n) for n in a.rival]
    runs = run_at_once(a, [(name, gpu, f"overhead_{name}", [*OVERHEAD_RUNS[name], "--split", *split])
                           for gpu, name in enumerate(names)])
    return overhead_rows(runs)


def overhead_rows(runs: dict) -> dict:
    """``--part overhead``'s answer from its runs (name → the run's entry)."""
    rows = {}
    for name, entry in runs.items():
        run = entry.get("run", {})
        outside = [w - g for w, g in zip(run.get("step_walls", []), run.get("step_generation", []))][20:]
        rows[name] = {"gpu": entry["gpu"], "wall_sec": run.get("wall_sec"),
                      "median_outside_generation_after_20": median(outside) if outside else None,
                      "median_generation_after_20": median(run["step_generation"][20:]) if outside else None}
    base = rows["plain"]["median_outside_generation_after_20"]
    for row in rows.values():
        mine = row["median_outside_generation_after_20"]
        row["outside_vs_plain"] = mine / base if mine and base else None
    print(table(["run", "GPU", "wall s", "outside generate s (median)", "vs plain"],
                [[k, r["gpu"], r["wall_sec"], r["median_outside_generation_after_20"], r["outside_vs_plain"]]
                 for k, r in rows.items()]))
    return {"gpus": len(runs), "rows": rows, "runs": runs}


def ratios(tuned: dict, plain: dict) -> dict:
    """A pair's wall-time ratio tuned / plain (the headline), and the same with the tuned run's seconds in
    ``generate`` replaced by the plain run's (``ratio_same_generation``): the split never changes what is generated
    (the generation batch is the same for every split; the two runs' token counts agree), yet two runs
    on two cards at one time spend 2-4% apart in ``generate`` either way; this ratio takes that out and leaves what
    the tuning's choices change (the tuner's clock around ``generate`` is taken off once it decided)."""
    if not (tuned.get("wall_sec") and plain.get("wall_sec")):
        return {"ratio": None, "ratio_same_generation": None}
    same = tuned["wall_sec"] - sum(tuned["step_generation"]) + sum(plain["step_generation"])
    return {"ratio": tuned["wall_sec"] / plain["wall_sec"], "ratio_same_generation": same / plain["wall_sec"],
            "generation_sec": {"tuned": sum(tuned["step_generation"]), "plain": sum(plain["step_generation"])}}


def shared_card(tuned: dict, plain: dict, start: str, warm: int = WARMUP_AT_START) -> dict:
    """What a pair on one card says of its own bias (``--one-card``): while the tuned run trains at a slower starting
    split it may load the card more than the plain run beside it, slowing that run and so flattering the ratio. The
    plain run's steps that ended while the tuned run was at its starting split, past its own first ``warm`` steps
    (the tuning's warm-up at the start: one every run has), and their seconds beyond the plain run's median step;
    ``ratio_bound``: the ratio with that excess taken off the plain run. Nothing where the tuned run never left its
    start."""
    steps = tuned.get("steps_by_split", {}).get(start, 0)
    if not (plain.get("step_ends_unix") and tuned.get("wall_sec")) or steps >= len(tuned.get("step_walls", [])):
        return {}
    until = tuned["step_ends_unix"][steps - 1] if steps else tuned["started_unix"]
    inside = [w for w, end in list(zip(plain["step_walls"], plain["step_ends_unix"]))[warm:] if end <= until]
    excess = max(0.0, sum(inside) - len(inside) * median(plain["step_walls"]))
    return {"window_sec": until - tuned["started_unix"], "plain_steps_in_window": len(inside),
            "plain_excess_in_window_sec": excess, "ratio_bound": tuned["wall_sec"] / (plain["wall_sec"] - excess)}


def sequential_name(a) -> str:
    """The result file's name: ``tuner_sequential_<card>[_swapped|_one_card]_<starts>_<steps>steps`` then
    ``_watchdog`` or ``_no_watchdog`` (``--watchdog`` given: every run with or without one), then ``_half<h>`` for one
    half of a swap."""
    both = "" if a.watchdog is None else "_watchdog" if a.watchdog else "_no_watchdog"
    return f"tuner_sequential_{card_name()}" + ("_swapped" if a.swap else "_one_card" if a.one_card else "") + "_" + \
        "_".join(f"{x}x{y}" for x, y in a.starts) + f"_{a.steps}steps{both}"


def earlier_half(a, half: int) -> dict:
    """The runs of the swap's other half (``--half``), from its file in the results folder, if it is there."""
    path = os.path.join(RESULTS, f"{sequential_name(a)}_half{half}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(m, tuple(s), g): v for m, s, g, v in json.load(f)["runs"]}


def swapped_pair(runs: dict, start: tuple, best: tuple, base: int = 0) -> dict:
    """One start's two halves (tuned on GPU ``base`` beside plain on GPU ``base + 1``, then the cards swapped): the
    tuning's cost is the geometric mean of the two wall-time ratios, in which each card's own speed cancels; the
    cards' ratio is what the plain runs of the two halves say about them."""
    halves, name = [], f"{start[0]}×{start[1]}"
    for g in (0, 1):
        t = runs[("tuned", start, base + g)].get("run", {})
        p = runs[("plain", start, base + 1 - g)].get("run", {})
        tunes = [d for d in t.get("decisions", []) if d["kind"] == "tune"]
        halves.append({"tuned_gpu": base + g, "plain_gpu": base + 1 - g, "tuned_wall_sec": t.get("wall_sec"),
                       "plain_wall_sec": p.get("wall_sec"), "end": t.get("end"), **ratios(t, p),
                       "steps_at_start": t.get("steps_by_split", {}).get(name),
                       "tune_step": tunes[0]["step"] if tunes else None,
                       "tune_reason": tunes[0]["reason"] if tunes else None,
                       "tuned": runs[("tuned", start, base + g)], "plain": runs[("plain", start, base + 1 - g)]})
    r = [h["ratio"] for h in halves]
    walls = [h["plain_wall_sec"] for h in halves]
    for h in halves:
        print(table(["start", "tuned GPU", "end", "tuned s", "plain s", "tuned/plain", "steps at start", "decided at"],
                    [[name, h["tuned_gpu"], h["end"], h["tuned_wall_sec"], h["plain_wall_sec"], h["ratio"],
                      h["steps_at_start"], h["tune_step"]]]))
    ratio = (r[0] * r[1]) ** 0.5 if None not in r else None
    print(f"{name}: tuned / plain {ratio} (geometric mean of the two halves; target "
          f"{'1.00-1.01' if start == best else '<= 1.03'})")
    return {"start": name, "best": f"{best[0]}×{best[1]}", "start_is_best": start == best, "ratio": ratio,
            "card_ratio_plain_gpu1_over_gpu0": walls[0] / walls[1] if None not in walls else None,
            "halves": halves}


def card_name() -> str:
    """``h100``, ``h200``, ...: the first GPU's model, for the result file's name."""
    import re

    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    found = re.search(r"\b([A-Z]\d{2,4})\b", name.upper())
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _counts(splits: list[str]) -> dict:
    out: dict[str, int] = {}
    for s in splits:
        out[s] = out.get(s, 0) + 1
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", required=True, choices=["sweep", "run", "switch", "ab", "sequential", "overhead"])
    p.add_argument("--mode", default="tuned", choices=["plain", "tuned"], help="part run")
    p.add_argument("--label", default=None, help="part run: the result file's suffix")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--split", type=int, nargs=2, default=[4, 8], help="micro-batch and accumulation")
    p.add_argument("--splits", type=int, nargs=2, action="append", default=None, help="part sweep: these only")
    p.add_argument("--rival", type=int, nargs=2, default=[32, 1],
                   help="part ab: the other split; part sequential: the best split, run plainly")
    p.add_argument("--starts", type=int, nargs=2, action="append", default=None,
                   help="part sequential: the tuned runs' starting splits (default 4 8, 2 16, 32 1)")
    p.add_argument("--timeout", type=float, default=520.0, help="part sequential: seconds a wave of runs may take")
    p.add_argument("--ab_rounds", type=int, default=4)
    p.add_argument("--ab_steps", type=int, default=8)
    p.add_argument("--watchdog", action=argparse.BooleanOptionalAction, default=None,
                   help="part run: with a MemoryWatchdog (default: the tuned run has one, the plain run none); "
                        "part sequential: the same for every run, tuned and plain")
    p.add_argument("--overhead_runs", nargs="+", choices=list(OVERHEAD_RUNS), default=None,
                   help="part overhead: these runs only, one a GPU (default all four; plain is the reference)")
    p.add_argument("--try_all", action="store_true", help="part run: tune with must_pay=False")
    p.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA")
    p.add_argument("--smoke", action="store_true", help="the CPU demo's trainer (SmolLM2, 4×1)")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU demo's trainer (random 2-layer Llama, 4×2)")
    p.add_argument("--model", default="qwen05", choices=["qwen05", "smollm2"])
    p.add_argument("--swap", action="store_true",
                   help="part sequential: each pair run twice on two GPUs, the cards swapped (one pair at a time; "
                        "every pair at once where the host has 2 GPUs a start)")
    p.add_argument("--one-card", action="store_true",
                   help="part sequential: each pair at once on the host's first card (a host of one GPU), the pairs "
                        "in turn; the result says how much the tuned run's start may have slowed the plain run")
    p.add_argument("--half", type=int, choices=[0, 1], default=None,
                   help="part sequential --swap on 2 GPUs a start: only this half (one call each); the second half "
                        "folds in the first's file from the results folder")
    a = p.parse_args()
    if a.smoke and a.split == [4, 8]:
        a.split = [4, 1]
    if a.tiny and a.split == [4, 8]:
        a.split = [4, 2]
    if (a.smoke or a.tiny) and a.rival == [32, 1]:
        a.rival = [2, 2] if a.smoke else [8, 1]    # the next exact split of the CPU demos' effective batch
    if a.starts is None:
        a.starts = [[4, 8], [2, 16], [32, 1]]
    settings = vars(a).copy()
    if a.part == "sequential":
        result = side_by_side(a)
        half = f"_half{a.half}" if "runs" in result else ""
        write_result(sequential_name(a) + half, {**result, "settings": settings})
    elif a.part == "overhead":
        some = "_" + "_".join(a.overhead_runs) if a.overhead_runs else ""
        write_result(f"tuner_overhead_{card_name()}_{a.steps}steps{some}", {**overhead(a), "settings": settings})
    elif a.part == "sweep":
        write_result("tuner_sweep" + ("_cpu" if a.smoke else ""), {"sweep": sweep(a), "settings": settings})
    elif a.part == "run":
        label = a.label or f"{a.mode}_{a.split[0]}x{a.split[1]}" + ("_cpu" if a.smoke else "_tiny" if a.tiny else "")
        write_result(f"tuner_run_{label}", {"run": one_run(a), "settings": settings})
    elif a.part == "switch":
        write_result("tuner_switch" + ("_cpu" if a.smoke else ""), {"switch": switch_cost(a), "settings": settings})
    else:
        write_result("tuner_ab" + ("_cpu" if a.smoke else ""), {"ab": ab(a), "settings": settings})


if __name__ == "__main__":
    main()
