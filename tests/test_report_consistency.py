"""The report against its evidence: on many noisy runs (planted step-time noise, warmup, contention, evaluations,
tuning trials: ``tests/synthetic_runs.py``) and real tiny runs, every number the summary, ``perf_report.md``, the
console's tuning lines and ``tuner.png`` print about a trial, warmup, a steady figure or a count of logs is
recomputed here from the raw perf log and split file (``json`` only: none of the package's readers) and must agree
to the digits printed; nothing is called fine without its evidence on the run."""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import statistics

import pytest
from matplotlib.figure import Figure

from hf_perf_callbacks import keys
from hf_perf_callbacks.core.runlog import read_run
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.report import console_summary, summarize, write_analysis
from hf_perf_callbacks.report.plots import PlotData, plot_throughput, plot_tuner
from tests.synthetic_runs import Plan, write_run

NUMBER = r"[\d.]+(?:e[+-]?\d+)?"
STEPS = r"\d+(?:(?:–|, )\d+(?![\d%]|\.\d))*"
TRIAL = re.compile(
    rf"(?P<label>\d+×\d+): median (?P<median>{NUMBER}) s per optimizer step(?: outside generation)? over steps? "
    rf"(?P<steps>{STEPS})(?:, (?:(?P<pct>\d+)% (?P<dir>slower|faster) than|as fast as) (?P<ref>\d+×\d+) \(median "
    rf"(?P<refmed>{NUMBER}) s over steps? (?P<refsteps>{STEPS}); one-sided Mann-Whitney p = (?P<p>{NUMBER}) that it "
    rf"is faster\))?")


# ---------------------------------------------------------------- the evidence, recomputed from the raw files
def raw(output_dir: str) -> dict:
    """The latest run's lines of the perf log (one session here), parsed with ``json`` alone."""
    headers, steps, summaries = [], {}, {}
    with open(os.path.join(output_dir, "perf_log.jsonl"), encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("type") == "run":
                headers.append(entry)
                summaries = {}
            elif entry.get("type") == "step":
                steps[entry["step"]] = entry
            elif entry.get("type") == "summary":
                summaries[entry["source"]] = entry
    split = None
    path = os.path.join(output_dir, "tuner_split.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            split = json.load(f)
    return {"headers": headers, "steps": [steps[k] for k in sorted(steps)], "summaries": summaries, "split": split}


def steady_steps(lines: list[dict]) -> list[int]:
    upto: dict[int, int] = {}
    for s in lines:
        first = s.get(keys.PERF_FIRST_STEADY_STEP)
        if first is not None:
            upto[first] = max(upto.get(first, 0), s["step"])
    return [s["step"] for s in lines if s.get(keys.PERF_STEADY) == 1
            or any(first <= s["step"] <= last for first, last in upto.items())]


def train_sec(line: dict) -> float:
    return line[keys.PERF_TRAIN_SEC]


def warmup_overhead(evidence: dict, steady: list[int]) -> float:
    """The warmup note's "s above steady time", recomputed from the step lines: over each ``train()`` call's warmup
    cycles (its steps before its first steady step, in blocks of the header's period), their training seconds above
    the steady step time s × their steps; on a CPU device the part of it their training CPU seconds (CPU × train /
    wall) above the steady steps' mean c explain, at s / c wall seconds each."""
    lines = evidence["steps"]
    headers = [h for h in evidence["headers"] if "perf" in h.get("sources", ["perf"])]
    cpu_device = any(h.get("device_type") == "cpu" for h in headers)
    period = max([h.get("period") or 1 for h in headers] + [1])
    s = sum(train_sec(x) for x in lines if x["step"] in set(steady)) / len(steady)
    def train_cpu(x):
        return x[keys.PERF_CPU_SEC] * x[keys.PERF_TRAIN_SEC] / x[keys.PERF_STEP_WALL_SEC] \
            if cpu_device and keys.PERF_CPU_SEC in x else None
    cpus = [c for x in lines if x["step"] in set(steady) if (c := train_cpu(x)) is not None]
    c = sum(cpus) / len(cpus) if cpus else None
    starts = sorted({h.get("resumed_from_step", 0) for h in headers} | {0})
    total = 0.0
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        call = [x for x in lines if start < x["step"] <= end]
        firsts = [x[keys.PERF_FIRST_STEADY_STEP] for x in call if x.get(keys.PERF_FIRST_STEADY_STEP) is not None]
        if not firsts:
            continue
        warm = [x for x in call if x["step"] < firsts[-1]]
        for k in range(0, len(warm), period):
            cycle = warm[k:k + period]
            excess = max(0.0, sum(train_sec(x) for x in cycle) - s * len(cycle))
            cpu = [train_cpu(x) for x in cycle]
            if c and all(v is not None for v in cpu):
                excess = min(excess, max(0.0, sum(cpu) - c * len(cycle)) * s / c)
            total += excess
    return total


def mann_whitney_less(a: list[float], b: list[float]) -> float:
    """One-sided p of "a tends to be smaller": exact over every split of the pooled values up to 14 of them, else
    the normal approximation with a continuity correction (the test's definition, written again here)."""
    import math

    def u(x, y):
        return sum(1.0 if p < q else 0.5 if p == q else 0.0 for p in x for q in y)

    pooled, n = a + b, len(a)
    observed = u(a, b)
    if len(pooled) > 14:
        m = len(b)
        z = (observed - n * m / 2 - 0.5) / math.sqrt(n * m * (n + m + 1) / 12)
        return 0.5 * math.erfc(z / math.sqrt(2))
    splits = list(itertools.combinations(range(len(pooled)), n))
    hits = sum(u([pooled[i] for i in c], [pooled[i] for i in range(len(pooled)) if i not in c]) >= observed - 1e-12
               for c in splits)
    return hits / len(splits)


def steps_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(", "):
        a, _, b = part.partition("–")
        out += list(range(int(a), int(b or a) + 1))
    return out


# ---------------------------------------------------------------- the checks
def check_trials(texts: list[str], evidence: dict) -> int:
    """Every trial printed in ``texts`` against the split file's samples; returns how many were checked."""
    decisions = [d for d in (evidence["split"] or {}).get("decisions", []) if d["kind"] == "tune"]
    checked = 0
    for text in texts:
        for m in TRIAL.finditer(text):
            decision = decisions[-1]
            trial = next(t for t in decision["trials"] if f"{t['split']['micro_batch']}×{t['split']['grad_accum']}"
                         == m["label"])
            assert format(statistics.median(trial["samples"]), ".3g") == m["median"], (m.group(0), trial)
            assert steps_of(m["steps"]) == sorted(trial["steps"]), m.group(0)
            if m["ref"]:
                old = decision["old"]
                assert m["ref"] == f"{old['micro_batch']}×{old['grad_accum']}", m.group(0)
                ref = next(t for t in decision["trials"] if t["split"] == old)
                base = statistics.median(ref["samples"])
                change = statistics.median(trial["samples"]) / base - 1
                assert format(base, ".3g") == m["refmed"] and steps_of(m["refsteps"]) == sorted(ref["steps"])
                if m["pct"] is None:
                    assert abs(change) < 0.005, m.group(0)
                else:
                    assert format(abs(change), ".0%") == m["pct"] + "%", m.group(0)
                    assert (change > 0) == (m["dir"] == "slower"), m.group(0)        # one sign everywhere
                assert format(mann_whitney_less(trial["samples"], ref["samples"]), ".2g") == m["p"], m.group(0)
            checked += 1
    return checked


def check_steady_and_warmup(summary: str, notes: list[str], evidence: dict) -> None:
    lines, perf = evidence["steps"], evidence["summaries"].get("perf")
    steady = steady_steps(lines)
    by_step = {s["step"]: s for s in lines}
    figure = re.search(r"steady tokens/s: ([\d,]+|n/a)(?: at ([\d.e+-]+) s per steady step)?", summary)
    provisional = re.search(r"provisional tokens/s: ([\d,]+) over steps? ([\d–, ]+) at ([\d.e+-]+) s per step", summary)
    assert figure or (provisional and not steady), summary
    if provisional and not steady:       # a run too short for steady figures: the rate of the steps it has
        counted = steps_of(provisional[2])
        tokens = sum(by_step[s][keys.PERF_TOKENS] for s in counted)
        seconds = sum(train_sec(by_step[s]) for s in counted)
        assert provisional[1] == format(tokens / seconds, ",.0f"), (provisional.group(0), tokens / seconds)
        assert provisional[3] == format(seconds / len(counted), ".3g"), (provisional.group(0), seconds / len(counted))
    elif steady:
        tokens = sum(by_step[s][keys.PERF_TOKENS] for s in steady)
        seconds = sum(train_sec(by_step[s]) for s in steady)
        assert figure[1] == format(tokens / seconds, ",.0f"), (figure.group(0), tokens / seconds)
        assert figure[2] == format(seconds / len(steady), ".3g"), (figure.group(0), seconds / len(steady))
        over = re.search(r"the steady figures are over (\d+) steps? \(([\d–, ]+)\)", summary)
        assert over and int(over[1]) == len(steady) and steps_of(over[2]) == steady, (over, steady)
        left = [s["step"] for s in lines if s["step"] not in set(steady)]
        if left:
            assert re.search(r"not in them: steps? ([\d–, ]+)", summary)[1] and \
                steps_of(re.search(r"not in them: steps? ([\d–, ]+)", summary)[1]) == left
    else:
        assert figure is not None and figure[1] == "n/a", summary
    first_call = max([h["resumed_from_step"] for h in evidence["headers"]] + [0]) + 1
    for text in [summary, *notes]:
        took = re.search(r"(?:warmup took|speed settled after) (\d+) steps?", text)
        if took:
            first_steady = min(s for s in steady if s >= first_call)
            assert int(took[1]) == first_steady - first_call, (took.group(0), first_steady, first_call)
        above = re.search(r"([\d.]+) s above steady time", text)
        if above and steady:
            assert above[1] == format(warmup_overhead(evidence, steady), ".1f"), (above.group(0), text)
        named = re.search(r"step (\d+) \(the first of the latest train\(\) call\)", text)
        if named:
            assert int(named[1]) == first_call and first_call > 1, named.group(0)
        slow = re.search(r"(?:took|was slow \(|steady level \()([\d.]+)x", text)
        if slow and steady and perf and perf.get("first_step_slowdown") is not None:
            ratio = train_sec(by_step[first_call]) / (sum(train_sec(by_step[s]) for s in steady) / len(steady))
            digits = len(slow[1].split(".")[1])
            assert slow[1] == format(ratio, f".{digits}f"), (slow.group(0), ratio)


def check_counts(summary: str, report: str, evidence: dict) -> None:
    logged = [s for s in evidence["steps"] if "log/completions/mean_length" in s]
    rewards = [s for s in evidence["steps"] if "log/reward" in s]
    line = re.search(r"completions \((\d+) logs?\): mean length [\d.]+, max \d+, clipped (\d+)%", summary)
    if logged:
        assert line and int(line[1]) == len(logged), (line, len(logged))
        clipped = statistics.fmean(s["log/completions/clipped_ratio"] for s in logged)
        assert line[2] + "%" == format(clipped, ".0%")
        for share in re.findall(r"clipped ratio (\d+)% \(mean over the run's logs\)", report):
            assert share + "%" == format(clipped, ".0%")
    else:
        assert line is None
    for n in re.findall(r"On all (\d+) logs every completion", report):
        assert int(n) == len(rewards)


def phase_seconds(evidence: dict) -> tuple[dict[str, float], float]:
    """Seconds per phase and the wall seconds of the run: the step lines' and the meter's tail after the last step."""
    tail = (evidence["summaries"].get("perf") or {}).get("tail_phase_sec") or {}
    lines = evidence["steps"]
    sec = {p: sum(s.get(keys.PERF_PHASE_SEC[p], 0.0) for s in lines) + tail.get(p, 0.0) for p in keys.PHASES}
    return sec, sum(s.get(keys.PERF_STEP_WALL_SEC, 0.0) for s in lines) + sum(tail.values())


def check_phases(summary: str, report: str, evidence: dict) -> int:
    """Every phase figure printed (the time split's shares, the seconds the phase rules and the evaluation rule
    print) recomputed from the step lines' ``perf/phase_sec/*`` and the tail; every step line's phases sum to its
    wall time. Returns the figures checked."""
    from hf_perf_callbacks.core.wording import PHASE_WORDS

    checked = 0
    for line in evidence["steps"]:
        if all(keys.PERF_PHASE_SEC[p] in line for p in keys.PHASES):
            total = sum(line[keys.PERF_PHASE_SEC[p]] for p in keys.PHASES)
            assert total == pytest.approx(line[keys.PERF_STEP_WALL_SEC], rel=1e-6, abs=1e-6), line["step"]
    sec, wall = phase_seconds(evidence)
    words = {w: p for p, w in PHASE_WORDS.items()}
    split = re.search(r"time split: (.+)", summary)
    if split and wall > 0 and split[1] != "n/a":
        for part in split[1].split(", "):
            name, share = part.rsplit(" ", 1)
            assert share == format(sec[words[name]] / wall, ".1%"), (part, sec[words[name]] / wall)
            checked += 1
    one = r"([\d.]+)"
    saves = [s for s in evidence["steps"] if s.get(keys.PERF_PHASE_SEC["save"], 0.0) > 0]
    tail = (evidence["summaries"].get("perf") or {}).get("tail_phase_sec") or {}
    for n, save, total in re.findall(rf"(\d+) checkpoint saves \(every \d+ steps?\) took {one} s of the run's "
                                     rf"{one} s wall time", report):
        assert int(n) == len(saves) + (tail.get("save", 0.0) > 0)
        assert (save, total) == (format(sec["save"], ".1f"), format(wall, ".1f"))
        checked += 1
    for user, log, total in re.findall(rf"other than the package's took {one} s and the trainer's logging {one} s "
                                       rf"of the {one} s wall time", report):
        assert (user, log, total) == (format(sec["user_callbacks"], ".1f"), format(sec["log"], ".1f"),
                                      format(wall, ".1f"))
        checked += 1
    for recompute, total in re.findall(rf"forwards for {one} s of the {one} s wall time", report):
        assert (recompute, total) == (format(sec["recompute"], ".1f"), format(wall, ".1f"))
        checked += 1
    evals = [s for s in evidence["steps"] if s.get(keys.PERF_PHASE_SEC["eval"], 0.0) > 0]
    for n, seconds, total in re.findall(rf"(\d+) evaluations \(every \d+ steps?\) took {one} s of the run's "
                                        rf"{one} s wall time", report):
        assert int(n) == len(evals) + (tail.get("eval", 0.0) > 0)
        assert (seconds, total) == (format(sec["eval"], ".1f"), format(wall, ".1f"))
        checked += 1
    return checked


def check_fine(report: str, console: str, evidence: dict) -> None:
    """Each "checked and fine" has its evidence on this run."""
    fine = report.split("## Checked and fine")[1] if "## Checked and fine" in report else ""
    titles = re.findall(r"^- \*\*(.+?)\.\*\*", fine, flags=re.M)
    console_fine = next((line for line in console.splitlines() if line.startswith("checked and fine: ")), "")
    assert sorted(t.lower() for t in titles) == sorted(x for x in console_fine.removeprefix(
        "checked and fine: ").split(", ") if x)
    perf = evidence["summaries"].get("perf") or {}
    for title in titles:
        if title == "Batch split chosen by measurement":
            decision = [d for d in evidence["split"]["decisions"] if d["kind"] == "tune"][-1]
            others = [t for t in decision["trials"] if t["split"] != decision["old"] and t["samples"]]
            train = sum(train_sec(s) for s in evidence["steps"])
            assert others, "fine without another split measured"
            assert (decision["cost_sec"] or 0) - (decision["expected_gain_sec"] or 0) <= 0.01 * train
        elif title == "Warmup":
            steady = steady_steps(evidence["steps"])
            assert steady and (perf.get("warmup_done") or any(s.get(keys.PERF_WARMUP_DONE) for s in evidence["steps"]))
        elif title.startswith("max_completion_length"):
            assert any("log/completions/max_length" in s for s in evidence["steps"])
        elif title == "Padding":
            assert any(keys.PERF_PAD_FRACTION in s for s in evidence["steps"])
        elif title.startswith("Gradient checkpointing kept"):
            assert phase_seconds(evidence)[0]["recompute"] > 0
        else:
            raise AssertionError(f"a fine without a check here: {title}")


def check_report(output_dir: str) -> int:
    """Write the report of ``output_dir`` and check it against its raw files; returns the trials checked."""
    evidence = raw(output_dir)
    run = read_run(output_dir)
    summary = summarize(run)
    with contextlib.redirect_stdout(io.StringIO()):
        _, findings, notes = write_analysis(run)
    report = open(os.path.join(output_dir, "perf_report.md"), encoding="utf-8").read()
    console = console_summary(findings, notes=notes)
    texts = [summary, report]
    record = read_split_file(output_dir)
    tune = record.last("tune") if record is not None else None
    if tune is not None:
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        assert plot_tuner(fig, PlotData.of(read_run(output_dir))) is None
        bars = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
        base = next((t for t in tune.trials if t.split == tune.old and t.samples), None)
        if base is not None and any(t.samples for t in tune.trials if t is not base):   # bars drawn: each says it
            for t in tune.trials:
                if not t.samples:
                    continue
                assert format(statistics.median(t.samples), ".3g") + " s, " in bars
                change = statistics.median(t.samples) / statistics.median(base.samples) - 1
                if t is not base and abs(change) >= 0.005:
                    label = f"{base.split.micro_batch}×{base.split.grad_accum}"
                    assert (f"{abs(change):.0%} {'slower' if change > 0 else 'faster'}\nthan {label}") in bars
        else:
            assert "no other split measured" in bars
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    plotted = plot_throughput(fig, PlotData.of(read_run(output_dir))) is None
    plot_words = (" ".join(t.get_text().replace("\n", " ") for t in fig.axes[0].texts) + " " +
                  " ".join(fig.axes[0].get_legend_handles_labels()[1])) if plotted else ""   # a wrapped subtitle
    check_steady_and_warmup(summary, [n.text for n in notes] + [report, plot_words], evidence)
    steady = steady_steps(evidence["steps"])
    drawn = re.search(r"steady figure ([\d,]+) tokens/s: Σ tokens / Σ training s of the (\d+) steady steps",
                      plot_words)
    if steady and plotted:
        by_step = {x["step"]: x for x in evidence["steps"]}
        rate = sum(by_step[x][keys.PERF_TOKENS] for x in steady) / sum(train_sec(by_step[x]) for x in steady)
        assert drawn and drawn[1] == format(rate, ",.0f") and int(drawn[2]) == len(steady), (drawn, rate)
        over = re.search(r"the steady figures are over (\d+) steps? \(([\d–, ]+)\)", plot_words)
        assert over and steps_of(over[2]) == steady
    check_counts(summary, report, evidence)
    check_fine(report, console, evidence)
    check_phases(summary, report, evidence)
    return check_trials(texts, evidence)


PLANS = [
    dict(steps=40, noise=0.05),
    dict(steps=40, noise=0.3, warmup=(4.0, 2.0, 1.0)),
    dict(steps=60, noise=0.2, contention={3: 3.0, 30: 5.0}),
    dict(steps=30, tune=True, base_sec=0.11, generation_sec=0.15, noise=0.15),          # the quick start's shape
    dict(steps=30, tune=True, base_sec=1.66, noise=0.9),                                  # a loaded machine
    dict(steps=60, tune=True, must_pay=False, split_sec={8: 1.2, 2: 0.9, 1: 1.1}, noise=0.15, warmup=(3.0, 1.0)),
    dict(steps=80, tune=True, split_sec={8: 0.4}, noise=0.05),                            # a faster split, kept
    dict(steps=80, tune=True, must_pay=False, noise=0.25, warmup=(2.0,)),                 # equal splits, noisy
    dict(steps=50, eval_every=5, eval_sec=4.0, noise=0.1),
    dict(steps=40, reward="constant", clipped=0.95, logging_steps=5),
    dict(steps=40, grpo=False, reward="none", noise=0.2, tune=True, must_pay=False, split_sec={8: 0.5}),
    dict(steps=40, noise=0.1, summaries=False, tune=True, must_pay=False),                 # a killed run
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("plan", PLANS, ids=[f"plan{i}" for i in range(len(PLANS))])
def test_every_printed_figure_agrees_with_the_runs_own_files(tmp_path, plan, seed):
    out = write_run(str(tmp_path / "run"), Plan(seed=seed, **plan))
    trials = check_report(out)
    decision = next((d for d in (raw(out)["split"] or {}).get("decisions", []) if d["kind"] == "tune"), None)
    measured = [t for t in (decision or {}).get("trials", []) if t["samples"]]
    assert trials >= 2 * len(measured)              # each measured trial in the summary and the report at least


def test_the_checks_catch_a_wrong_sign_and_an_unmeasured_fine(tmp_path):
    """The checks fail on the report's old faults: a gain of the wrong sign, a "fine" with nothing measured."""
    out = write_run(str(tmp_path / "run"), Plan(steps=60, tune=True, must_pay=False, split_sec={8: 1.3},
                                                noise=0.05, seed=1))
    evidence = raw(out)
    decision = [d for d in evidence["split"]["decisions"] if d["kind"] == "tune"][-1]
    slower = next(t for t in decision["trials"] if t["split"]["micro_batch"] == 8)
    base = next(t for t in decision["trials"] if t["split"] == decision["old"])
    change = statistics.median(slower["samples"]) / statistics.median(base["samples"]) - 1
    ok = (f"8×1: median {statistics.median(slower['samples']):.3g} s per optimizer step outside generation over steps "
          f"{', '.join(map(str, slower['steps']))}, {abs(change):.0%} slower than 4×2 (median "
          f"{statistics.median(base['samples']):.3g} s over steps {', '.join(map(str, base['steps']))}; one-sided "
          f"Mann-Whitney p = {mann_whitney_less(slower['samples'], base['samples']):.2g} that it is faster)")
    assert check_trials([ok], evidence) == 1
    with pytest.raises(AssertionError):
        check_trials([ok.replace("slower", "faster")], evidence)
    report = "## Checked and fine\n\n- **Batch split chosen by measurement.** …\n"
    untried = dict(evidence, split={"decisions": [{**decision, "trials": [base]}]})
    with pytest.raises(AssertionError, match="without another split"):
        check_fine(report, "checked and fine: batch split chosen by measurement", untried)


# ---------------------------------------------------------------- real tiny runs
def test_a_real_demo_run_agrees_with_its_files(demo_run):
    check_report(demo_run)
    assert read_run(demo_run).unique_steps(), "the demo run logged no step to check the report against"


def test_a_real_tuning_run_agrees_with_its_files(tokenizer, tmp_path):
    from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, train_with_tuning
    from tests.conftest import make_trainer

    callbacks = [ThroughputMeter(warmup_window=2, max_warmup_steps=2), MemoryWatchdog(),
                 AdaptiveBatchTuner(must_pay=False, samples=3, max_rounds=1)]
    train_with_tuning(make_trainer(tokenizer, tmp_path, callbacks, max_steps=14, bs=2, ga=2, length=16))
    decision = read_split_file(str(tmp_path)).last("tune")
    assert decision is not None and sum(bool(t.samples) for t in decision.trials) >= 2
    assert check_report(str(tmp_path)) >= 4


def test_a_real_run_with_every_phase_agrees_with_its_files(tokenizer, tmp_path):
    """A real run with a costly callback at every log, a slow checkpoint save on every step and an evaluation after
    the last step: every phase figure the report prints recomputes from its perf log."""
    from transformers import Trainer, TrainerCallback

    from hf_perf_callbacks import ThroughputMeter
    from tests.conftest import PlantedClock, make_trainer

    clock = PlantedClock()

    class CostlyOnLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            clock.spend(30.0)

    class SlowSave(Trainer):
        def save_model(self, *args, **kwargs):
            clock.spend(40.0)
            return super().save_model(*args, **kwargs)

    make_trainer(tokenizer, tmp_path, [ThroughputMeter(clock=clock, warmup_window=2, max_warmup_steps=2),
                                       CostlyOnLog()], max_steps=6, bs=2, ga=1, trainer_cls=SlowSave,
                 with_eval=True, extra={"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1,
                                        "eval_strategy": "steps", "eval_steps": 3}).train()
    check_report(str(tmp_path))
    evidence = raw(str(tmp_path))
    run = read_run(str(tmp_path))
    with contextlib.redirect_stdout(io.StringIO()):
        write_analysis(run)
    report = open(os.path.join(str(tmp_path), "perf_report.md"), encoding="utf-8").read()
    assert check_phases(summarize(run), report, evidence) >= 5       # the split, saving, callbacks, evaluation
