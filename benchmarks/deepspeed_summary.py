"""The summary of ``benchmarks/deepspeed.sh``: every scenario's checks, the exact commands, exit codes and seconds,
written to ``results/deepspeed_<card>[_<N>gpu].json`` (and ``$OUT``)."""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from common import RESULTS, write_result

#: what this benchmark never covers (said in the result file)
NOT_MEASURED = ["a real model (the tests' tiny Llama, fp32, SGD with momentum)",
                "more than one host (the launches are on the GPUs of one host)"]


#: the scenarios of ``deepspeed.sh``, by their names in the result file
SCENARIOS = ("main", "restart", "accelerate", "one_process_oom", "grpo")


def not_measured(stages: dict) -> list[str]:
    """What the result file does not cover: :data:`NOT_MEASURED`, and each stage's scenarios it did not run."""
    return NOT_MEASURED + [f"{stage}: scenario {s} (benchmarks/deepspeed.sh)" for stage, figures in stages.items()
                           for s in SCENARIOS if s not in figures]


def ranks(folder: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "rank*.json")))]


def main_figures(main_ranks: list[dict]) -> dict:
    r0 = main_ranks[0]
    return {
        "ranks": len(main_ranks), "zero_stage": r0["zero_stage"],
        "meter_tokens": r0["tokens"], "independent_tokens": r0["independent_tokens"],
        "meter_vs_independent": r0["tokens"] / r0["independent_tokens"],
        "rates_equal_on_every_rank": all(r["rates"] == r0["rates"] for r in main_ranks),
        "meter_matmul_params": r0["meter_matmul"], "model_matmul_params": r0["reference_matmul"],
        "stop_steps": [r["stop_step"] for r in main_ranks],
        "stop_actions": [r["stop_actions"] for r in main_ranks],
        "resize_decisions": r0["tuned_decisions"], "resize_split": r0["tuned_split"],
        "resize_sizes_every_rank": [r["tuned_sizes"] for r in main_ranks],
        "resize_engines": r0["engines"], "resize_steps_logged": r0["tuned_steps_logged"],
        "resize_micro_batches": r0["tuned_micro_batches"],
        "resize_vs_unfaulted_differences": [r["exact"]["differences"] for r in main_ranks]}


def main(run: str, gpus: int) -> None:
    commands = []
    for line in open(os.path.join(run, "commands.txt")):
        name, rc, seconds, command = line.rstrip("\n").split("\t", 3)
        commands.append({"name": name, "exit_code": int(rc), "seconds": round(float(seconds), 1),
                         "command": command.replace(run, "$RUN")})
    stages = {}
    for stage in (2, 3):
        found = {}
        for scenario in ("main", "accelerate"):
            main_ranks = ranks(os.path.join(run, f"zero{stage}_{scenario}"))
            if main_ranks:
                found[scenario] = main_figures(main_ranks)
        restart_ranks = ranks(os.path.join(run, f"zero{stage}_restart"))
        if restart_ranks:
            found["restart"] = {"steps": [r["step"] for r in restart_ranks], "split": restart_ranks[0]["split"],
                                "decisions": restart_ranks[0]["decisions"],
                                "sizes_every_rank": [r["sizes"] for r in restart_ranks],
                                "relaunch_vs_unfaulted_differences": [r["differences"] for r in restart_ranks]}
        grpo = ranks(os.path.join(run, f"zero{stage}_grpo"))
        if grpo:
            found["grpo"] = {"differences": [r["differences"] for r in grpo],
                             "splits": [grpo[0]["unfaulted"]["split"], grpo[0]["resized"]["split"]],
                             "decisions": grpo[0]["resized"]["decisions"],
                             "sizes_every_rank": [r["resized"]["sizes"] for r in grpo],
                             "tokens_per_sec_equal_on_every_rank": len({
                                 json.dumps([f["perf/tokens_per_sec"] for f in r["resized"]["figures"]])
                                 for r in grpo}) == 1}
        one = ranks(os.path.join(run, f"zero{stage}_one"))
        if one:
            found["one_process_oom"] = one[0]
        stages[f"zero{stage}"] = found
    card = torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else "cpu"
    name = f"deepspeed_{card}" + ("" if gpus == 2 else f"_{gpus}gpu")
    earlier = os.path.join(RESULTS, f"{name}.json")
    kept = {}
    if os.path.exists(earlier):                  # what this launch did not run keeps the earlier run's figures
        with open(earlier) as f:
            before = json.load(f)
        for stage, figures in before.get("stages", {}).items():
            for scenario, value in figures.items():
                if scenario not in stages.get(stage, {}):
                    stages.setdefault(stage, {})[scenario] = value
                    kept[f"{stage}.{scenario}"] = before.get("earlier_runs", {}).get(
                        f"{stage}.{scenario}", before.get("environment", {}).get("date"))
        if kept:
            commands = {"this_run": commands, "earlier_runs": command_lists(before.get("commands"))}
    path = write_result(name, {"gpus": gpus, "deepspeed": importlib.metadata.version("deepspeed"),
                               "model": "tests' tiny Llama (hf_perf_callbacks.tiny), fp32, SGD with momentum",
                               "commands": commands, "stages": stages,
                               "earlier_runs": kept, "not_measured": not_measured(stages)})
    print(json.dumps(stages, indent=1)[:6000])
    print(f"written: {path}")


def command_lists(commands: object) -> list:
    """The command lists of a result file's runs, newest first, flat (a merged file holds its own and its earlier
    runs' lists)."""
    if isinstance(commands, dict):
        return command_lists(commands.get("this_run")) + command_lists(
            commands.get("earlier_runs", commands.get("earlier_run")))
    if commands and isinstance(commands, list) and isinstance(commands[0], list):
        return list(commands)                        # already a list of lists
    return [commands] if commands else []


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
