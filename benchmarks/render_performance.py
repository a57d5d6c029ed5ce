"""The measured tables of docs/performance.md, rendered from ``benchmarks/results/*.json`` (never written by hand).

``python -m benchmarks.render_performance`` writes them into docs/performance.md between :data:`BEGIN` and
:data:`END`; ``tests/test_docs.py`` fails while the page differs from what the result files render. Every result file
names its machine (``environment``: device, torch, CUDA, Python, date); the tables give each machine a label once
and every row names its label. Standard library only.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOC = os.path.join(ROOT, "docs", "performance.md")
BEGIN = "<!-- performance tables: rendered by `python -m benchmarks.render_performance` from benchmarks/results -->"
END = "<!-- performance tables: end -->"
#: the CPU every CPU result was measured on (the result files say "cpu" and the core count where they record it)
CPU = "this project's 2-core x86-64 CPU, shared with other work"


def load() -> dict[str, dict]:
    """Every result file (``*.json``) by its name without the extension, in name order."""
    return {os.path.basename(path)[:-5]: json.load(open(path, encoding="utf-8"))
            for path in sorted(glob.glob(os.path.join(RESULTS, "*.json")))}


def environment(result: dict) -> dict:
    """The machine and software a result was measured with: its ``environment``, or what an older file kept
    (``advice_*``'s runs, the CPU files' ``cpu_count`` and ``date``)."""
    if isinstance(result.get("environment"), dict):
        return result["environment"]
    runs = result.get("runs")
    if isinstance(runs, list) and runs and isinstance(runs[0].get("environment"), dict):
        env = dict(runs[0]["environment"])
        env["device"] = "cpu" if "CPU" in str(env.get("device", "")) else env.get("device")
        return env
    return {"device": "cpu", "date": result.get("date"), "python": result.get("python")}


def machine(env: dict) -> str:
    """A machine's description: its GPUs by name (how many a run used is in its row), or the CPU."""
    device = env.get("device") or "cpu"
    return CPU if device == "cpu" else f"{device} GPUs"


def _pct(x: float) -> str:
    return f"{100 * x:+.3g}%"


def _accuracy(r: dict) -> str:
    return (f"steady tokens/s {r['reported_steady_tokens_per_sec']:,.1f} (meter) vs "
            f"{r['independent_steady_tokens_per_sec']:,.1f} (independent clock and count): "
            f"{_pct(r['relative_error'])}")


def _overhead(r: dict) -> str:
    return (f"the callbacks' own time {1000 * r['callback_seconds_per_step']:.1f} ms per "
            f"{r['median_step_all_s']:.2f} s step ({1 + r['callback_overhead_fraction']:.3f}×)")


def _oom(r: dict) -> str:
    return (f"OOM → {r['final_split'][0]}×{r['final_split'][1]}, step {r['reached_step']} of {r['max_steps']} "
            f"reached, {r['recovery_sec'][0]:.1f} s from the OOM to the next step")


def _watchdog(r: dict) -> str:
    return (f"checkpointed before OOM in {r['checkpointed_before_oom']} of {r['seeds']} seeds; steps-to-wall error "
            f"median {100 * r['median_steps_to_wall_error']:.1f}%, p90 {100 * r['p90_steps_to_wall_error']:.1f}%; "
            f"95% range held the truth in {100 * r['range_coverage']:.1f}% of forecasts")


def _switch(r: dict) -> str:
    return "; ".join(f"{kind.replace('_', ' ')}: {min(v['switch_sec']):.2f} s a switch "
                     f"({v['trainable_gb']:.2f} GiB trainable)" for kind, v in r["switch"].items())


def _sweep(r: dict) -> str:
    return ", ".join(f"{s['split']} {s['non_generation_s']:.2f} s" for s in r["sweep"]) + \
        " per step outside generation"


def _run(r: dict) -> str:
    run = r["run"]
    return f"{run['mode']} run from {run['start']}: {run['steps']} steps in {run['wall_sec']:.1f} s"


def _tiers(r: dict) -> str:
    return (f"estimate within {100 * r['max_abs_error']:.1f}% of the allocator peak at {len(r['points'])} points "
            f"(target {100 * r['target_abs_error']:.0f}%)")


def _exactness(r: dict) -> str:
    checks = [c for case in r["cases"].values() for c in case]
    ratios = [c["check_over_step"] for c in checks if c["check_over_step"] is not None]
    return (f"{len(checks)} changes checked at their step: {min(c['check_sec'] for c in checks):.2f}-"
            f"{max(c['check_sec'] for c in checks):.2f} s, {min(ratios):.2f}-{max(ratios):.2f} steps of the new split "
            f"({', '.join(sorted({c['verdict'] for c in checks}))})")


def _demo_tuning(r: dict) -> str:
    return (f"{len(r['pairs'])} pairs, demo time tuned/plain {r['demo_ratio_total']:.3f}× "
            f"(median pair {r['demo_ratio_median']:.3f}×)")


def _scale(r: dict) -> str:
    big = max(r["rows"], key=lambda row: row["steps"])
    return (f"`hf-perf report` on a planted log of {big['steps']:,} steps ({big['log_mb']:.0f} MB): "
            f"{big['wall_sec']:.1f} s, {big['peak_rss_mb']:.0f} MB peak")


def _wordle(r: dict) -> str:
    s = r["summary"]
    return (f"{s['groups_with_variance']} of {s['groups']} prompt groups had reward variance over {s['steps']} "
            f"GRPO steps")


def _advice(r: dict) -> str:
    rows = [x for run in r["runs"] for x in run["results"]]
    measured = [x for x in rows if x.get("measured_gain")]
    followed = [x["followup"] for x in rows if x.get("followup")]
    predicted = [x for x in measured if x.get("predicted_gain")]
    within = [x for x in predicted if abs(x["predicted_gain"] / x["measured_gain"] - 1) <= 0.25]
    parts = [f"{len(measured)} findings applied and measured; {len(within)} of the {len(predicted)} with a predicted "
             f"gain within 25% of it"] if measured else []
    parts += [f"{f['applied']} applied: {f['clipped_before']:.0%} → {f['clipped_after']:.0%} of completions cut"
              + (", asked for no more" if f["ok"] else ", STILL CUT") for f in followed]
    return "; ".join(parts) or "no finding applied"


def _shared(r: dict) -> str:
    runs = r["runs"].values()
    passed = sum(bool(x["passed"]) for x in runs)
    stops = ", ".join(f"{x['run'][0]}: " + (f"stop at {x['stop_step']}" if x["stop_step"] else
                                            f"{x['steps_trained']} steps, {x['memory_resizes']} re-sizes")
                      for x in runs)
    return f"{passed} of {len(r['runs'])} runs end as they must, no OOM ({stops})"


def _swapped(p: dict) -> str:
    halves = ", ".join(f"{h['ratio']:.3f}× ending at {h['end']}" for h in p["halves"])
    return f"from {p['start']}, the cards swapped: {p['ratio']:.3f}× the plain {p['best']} run (halves {halves})"


def _sequential(r: dict) -> str:
    settings = r.get("settings", {})
    steps, watchdog = settings.get("steps"), settings.get("watchdog")
    cards = "both runs of a pair on one GPU" if r.get("layout") == "one card" else f"{r['gpus']} GPUs"
    parts = ([f"{steps} steps", cards] if steps else []) + \
        ([] if watchdog is None else ["a watchdog on both sides" if watchdog else "no watchdog on either side"])
    head = ", ".join(parts) + ": " if parts else ""
    if r.get("layout") in ("swapped", "swapped twins"):
        return head + "; ".join(_swapped(p) for p in r["pairs"] if p.get("ratio"))
    return head + "; ".join(
        f"from {p['start']}: {p['ratio']:.3f}× the plain {p['best']} run"
        + (f" ({p['ratio_same_generation']:.3f}× with its generation seconds)" if p.get("ratio_same_generation")
           else "") + f", {p['steps_at_start']} steps at the start"
        + (f"; {p['ratio_bound']:.3f}× with the plain run's {p['plain_excess_in_window_sec']:.1f} s beyond its median "
           f"step while the tuned run was at {p['start']} taken off" if p.get("ratio_bound") else "")
        for p in r["pairs"] if p.get("ratio"))


def _tuner_overhead(r: dict) -> str:
    rows = r["rows"]
    return f"{r['gpus']} runs at once, median seconds a step outside generate after step 20 against the plain run's " \
        f"{rows['plain']['median_outside_generation_after_20']:.4f} s: " + ", ".join(
            f"{name.replace('_', ' ')} {row['outside_vs_plain']:.3f}×" for name, row in rows.items() if name != "plain")


def _watchdog_step_cost(r: dict) -> str:
    if "alternating" in r:
        alt = r["alternating"]
        m = alt["median_outside_generation_ms"]
        return (f"one run, blocks of {alt['block_steps']} steps by turns: median ms outside generate with the watchdog "
                f"disabled {m['A']:.1f}, working {m['B']:.1f}, on its last reading {m['C']:.1f}; per cycle B − A "
                f"{alt['b_minus_a_ms']:.1f} ms (median of {len(alt['cycles_ms'])})")
    runs = [x for x in r["runs"] if x["watchdog"]]
    return (f"{len(r['runs'])} runs one after another, a MemoryWatchdog clocked at "
            + ", ".join(f"{x['watchdog_ms_a_step']:.2f}" for x in runs) + " ms a step (its memory readings "
            + ", ".join(f"{x['ms_a_step'].get('memory readings', 0.0):.2f}" for x in runs) + " ms)")


def _memory_read(r: dict) -> str:
    return "ms a call: " + ", ".join(f"{name} {ms:.3g}" for name, ms in r["ms_per_call"].items())


def _deepspeed(r: dict) -> str:
    done = {name: stage for name, stage in r["stages"].items() if stage}
    parts = []
    for name, stage in done.items():
        main, restart = stage.get("main", {}), stage.get("restart", {})
        exact = not any(any(d) for d in main.get("resize_vs_unfaulted_differences", [[1]])) \
            and not any(any(d) for d in restart.get("relaunch_vs_unfaulted_differences", [[1]]))
        extra = [w for w, key in (("accelerate launch", "accelerate"), ("one-process OOM", "one_process_oom"))
                 if key in stage]
        if "grpo" in stage:
            extra.append("GRPO re-sized " + ("as the unfaulted run" if not any(
                any(d) for d in stage["grpo"]["differences"]) else "DIFFERENTLY"))
        parts.append(f"{name}: meter/independent tokens {main['meter_vs_independent']:.3f}, a stop on one rank at "
                     f"steps {main['stop_steps']}, re-size and relaunch " + ("as the unfaulted run" if exact else
                                                                               "DIFFER")
                     + (f", also {' and '.join(extra)}" if extra else ""))
    return f"{r['gpus']} GPUs, " + "; ".join(parts) + (f" (not measured: {len(r['not_measured'])} items)"
                                                        if r.get("not_measured") else "")


def _checks(r: dict) -> str:
    """Any other result: its top-level checks (true/false), counted."""
    flags = [v for k, v in r.items() if isinstance(v, bool) and k != "hung"]
    if not flags:
        return "raw figures (see the file)"
    return f"{sum(flags)} of {len(flags)} checks true"


#: a result's benchmark name (or its file name's start) → its headline
HEADLINES: list[tuple[str, Callable[[dict], str]]] = [
    ("accuracy", _accuracy), ("overhead", _overhead), ("oom_recovery", _oom),
    ("watchdog_step_cost", _watchdog_step_cost), ("watchdog", _watchdog),
    ("tuner_switch", _switch), ("tuner_sweep", _sweep), ("tuner_run", _run), ("memory_tiers", _tiers),
    ("exactness", _exactness), ("demo_tuning", _demo_tuning), ("report_scale", _scale),
    ("wordle_rewards_untrained", _checks), ("wordle_rewards", _wordle), ("advice", _advice),
    ("shared_gpu", _shared), ("tuner_sequential", _sequential), ("deepspeed", _deepspeed),
    ("tuner_overhead", _tuner_overhead), ("memory_read_cost", _memory_read),
]


def headline(name: str, result: dict) -> str:
    for prefix, render in HEADLINES:
        if name.startswith(prefix):
            try:
                return render(result)
            except (KeyError, TypeError, IndexError, ValueError):
                break
    return _checks(result)


def render(results: dict[str, dict]) -> str:
    """The machines table, then one row per result file: its machine, date and headline figure."""
    labels: dict[str, str] = {}
    for result in results.values():
        labels.setdefault(machine(environment(result)), f"M{len(labels) + 1}")
    software: dict[str, set[str]] = {}
    for result in results.values():
        env = environment(result)
        if env.get("torch"):
            software.setdefault(machine(env), set()).add(f"torch {env['torch']}")
    lines = ["| machine | what it is | software |", "|---|---|---|"]
    lines += [f"| {label} | {name} | {', '.join(sorted(software.get(name, ())))} |" for name, label in labels.items()]
    lines += ["", "| result file | machine | date | headline |", "|---|---|---|---|"]
    for name, result in results.items():
        env = environment(result)
        date = str(env.get("date") or "")[:10] or "—"
        lines.append(f"| `{name}.json` | {labels[machine(env)]} | {date} | {headline(name, result)} |")
    return "\n".join(lines)


def split_doc(text: str) -> tuple[str, str, str]:
    """(before, tables, after) around the markers; a ``ValueError`` naming them when they are missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"docs/performance.md has no performance table markers: expected {BEGIN!r} and {END!r}")
    before, rest = text.split(BEGIN, 1)
    tables, after = rest.split(END, 1)
    return before + BEGIN, tables.strip("\n"), END + after


def main() -> int:
    with open(DOC, encoding="utf-8") as f:
        before, _, after = split_doc(f.read())
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(f"{before}\n{render(load())}\n{after}")
    print(f"wrote the performance tables into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
