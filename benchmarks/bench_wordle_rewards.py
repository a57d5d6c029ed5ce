"""Do the Wordle rewards teach? GRPO + LoRA on the real SmolLM2-135M-Instruct (offline,
``hf_perf_callbacks.real_model``) with the demo's settings: per step the mean of each reward, the share of prompt
groups whose completions all got the same total reward (TRL's ``frac_reward_zero_std``: GRPO has no gradient from
those), which rewards vary inside a group, completion lengths and the clipped share, and a few completions. Runs on
CPU (the default) or one GPU.

    python benchmarks/bench_wordle_rewards.py --steps 60          # writes results/wordle_rewards.json
    python benchmarks/bench_wordle_rewards.py --smoke             # tiny random model, 3 steps, results/*_smoke.json
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from common import table, write_result
from transformers import TrainerCallback

from hf_perf_callbacks.demo import build_demo_trainer
from hf_perf_callbacks.tasks import wordle


class Recorder:
    """Wraps a reward function (same name and result) and keeps every call's completions and rewards."""

    def __init__(self, func):
        self.func, self.__name__, self.calls = func, func.__name__, []

    def __call__(self, prompts, completions, *args, **kwargs):
        rewards = self.func(prompts, completions, *args, **kwargs)
        self.calls.append({"secret": list(kwargs.get("secret") or []), "rewards": list(rewards),
                           "completions": [wordle._text(c) for c in completions]})
        return rewards


def group_stats(recorders, num_generations):
    """Per reward call: groups whose total reward has zero spread, and per reward function the groups it varies."""
    out = []
    for i in range(len(recorders[0].calls)):
        per_func = [r.calls[i]["rewards"] for r in recorders]
        totals = [sum(values) for values in zip(*per_func)]
        groups = range(0, len(totals), num_generations)
        spread = lambda xs: max(xs) - min(xs) > 1e-9  # noqa: E731
        out.append({"groups": len(groups),
                    "zero_std_groups": sum(not spread(totals[g:g + num_generations]) for g in groups),
                    "varies": {r.__name__: sum(spread(v[g:g + num_generations]) for g in groups)
                               for r, v in zip(recorders, per_func)}})
    return out


def sample_untrained(trainer, prompts, num_generations, max_new_tokens, batch=16, seed=0):
    """Before training: ``num_generations`` completions for each of ``prompts`` Wordle prompts from the untrained
    model (sampling as GRPO does: temperature 1, the model's EOS), the rewards, and the groups with reward variance.
    Cheaper than training steps (no backward), so it measures the start on many more prompt groups."""
    tokenizer, model = trainer.processing_class, trainer.model
    tokenizer.padding_side = "left"                   # batched generation: prompts end where completions start
    data = wordle.make_dataset(prompts, seed=seed + 1, conversational=True)
    rows = [data[i] for i in range(len(data)) for _ in range(num_generations)]
    texts = []
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            enc = tokenizer.apply_chat_template([r["prompt"] for r in chunk], add_generation_prompt=True,
                                                padding=True, return_tensors="pt", return_dict=True).to(model.device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, pad_token_id=tokenizer.pad_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    columns = {"secret": [r["secret"] for r in rows], "history": [r["history"] for r in rows]}
    per_func = {f.__name__: f([r["prompt"] for r in rows], texts, **columns) for f in wordle.REWARD_FUNCS}
    totals = [sum(values) for values in zip(*per_func.values())]
    starts = range(0, len(rows), num_generations)
    spread = lambda xs: max(xs) - min(xs) > 1e-9  # noqa: E731
    return {"prompts": prompts, "num_generations": num_generations, "max_new_tokens": max_new_tokens,
            "groups_with_variance": sum(spread(totals[g:g + num_generations]) for g in starts),
            "groups_varied_by": {n: sum(spread(v[g:g + num_generations]) for g in starts) for n, v in per_func.items()},
            "mean_rewards": {n: statistics.mean(v) for n, v in per_func.items()},
            "mean_total_reward": statistics.mean(totals),
            "completions": [{"secret": r["secret"], "completion": t, "total": tot}
                            for r, t, tot in zip(rows, texts, totals)]}


def collect(trainer, recorders, num_generations, settings, name, seconds, finished=False):
    """Per-step rows from the trainer's log history and the recorded reward calls, a summary, and the JSON file."""
    logs = [x for x in trainer.state.log_history if "reward" in x]
    stats = group_stats(recorders, num_generations)
    names = [f.__name__ for f in wordle.REWARD_FUNCS]
    rows = []
    for log, st in zip(logs, stats):
        rows.append({"step": log["step"], "reward": log["reward"], "reward_std": log.get("reward_std"),
                     "frac_reward_zero_std": log.get("frac_reward_zero_std"),
                     "rewards": {n: log.get(f"rewards/{n}/mean") for n in names},
                     "mean_length": log.get("completions/mean_length"),
                     "mean_terminated_length": log.get("completions/mean_terminated_length"),
                     "clipped_ratio": log.get("completions/clipped_ratio"), **st})
    shown = sorted({0, len(rows) // 2, len(rows) - 1}) if rows else []
    samples = {str(i + 1): [{"secret": s, "completion": c, "rewards": dict(zip(names, r))}
                            for s, c, *r in zip(recorders[0].calls[i]["secret"], recorders[0].calls[i]["completions"],
                                                *(rec.calls[i]["rewards"] for rec in recorders))]
               for i in shown}

    def window(part):
        return {"reward": statistics.mean(r["reward"] for r in part),
                "frac_reward_zero_std": statistics.mean(r["frac_reward_zero_std"] for r in part),
                "rewards": {n: statistics.mean(r["rewards"][n] for r in part) for n in names},
                "clipped_ratio": statistics.mean(r["clipped_ratio"] for r in part),
                "mean_length": statistics.mean(r["mean_length"] for r in part)}

    part = max(1, len(rows) // 6)
    first, last = rows[:part], rows[-part:]
    groups = sum(r["groups"] for r in rows)
    zero = sum(r["zero_std_groups"] for r in rows)
    summary = {"finished": finished, "steps": len(rows), "seconds": seconds, "groups": groups,
               "groups_with_variance": groups - zero,
               "share_groups_with_variance": (groups - zero) / groups if groups else None,
               "groups_varied_by": {n: sum(r["varies"][n] for r in rows) for n in names},
               f"first_{len(first)}_steps": window(first) if rows else None,
               f"last_{len(last)}_steps": window(last) if rows else None}
    untrained = settings.get("untrained_full")
    path = write_result(name, {"settings": {k: v for k, v in settings.items() if k != "untrained_full"},
                               "summary": summary, "steps": rows, "samples": samples, "untrained": untrained})
    return rows, summary, path


def rescore(paths, num_generations):
    """Score the completions recorded in earlier result files with the current rewards (they are deterministic
    functions of the text): prompt groups with reward variance, per reward."""
    import json

    groups = []
    for path in paths:
        data = json.load(open(path))
        if data.get("untrained"):
            groups += [data["untrained"]["completions"][i:i + num_generations]
                       for i in range(0, len(data["untrained"]["completions"]), num_generations)]
        groups += [rows for rows in data.get("samples", {}).values()]
    varied = {f.__name__: 0 for f in wordle.REWARD_FUNCS}
    with_variance = 0
    for group in groups:   # histories are not stored: consistency is scored without them
        texts, secrets = [g["completion"] for g in group], [g["secret"] for g in group]
        per_func = {f.__name__: f(["p"] * len(texts), texts, secret=secrets) for f in wordle.REWARD_FUNCS}
        totals = [sum(v) for v in zip(*per_func.values())]
        with_variance += max(totals) > min(totals)
        for name, values in per_func.items():
            varied[name] += max(values) > min(values)
    print(f"recorded completions, current rewards: {with_variance}/{len(groups)} prompt groups with reward variance; "
          f"varied by {varied}")
    return with_variance, len(groups), varied


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="GRPO steps (0: only sample the untrained model)")
    p.add_argument("--completion", type=int, default=40, help="max_completion_length")
    p.add_argument("--generations", type=int, default=4, help="num_generations (completions per prompt)")
    p.add_argument("--prompts", type=int, default=1, help="prompt groups per optimizer step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--gpu", action="store_true", help="train on the GPU (default: CPU, as the demo)")
    p.add_argument("--sample_prompts", type=int, default=24,
                   help="prompts sampled from the untrained model before training (0: none)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps: proves the script runs")
    p.add_argument("--rescore", nargs="+", metavar="JSON", help="only score the completions in these result files")
    a = p.parse_args()
    if a.rescore:
        rescore(a.rescore, a.generations)
        return
    model, steps = ("tiny", 3) if a.smoke else ("real", a.steps)

    recorders = [Recorder(f) for f in wordle.REWARD_FUNCS]
    batch = a.generations * a.prompts
    trainer = build_demo_trainer(tempfile.mkdtemp(), max_steps=max(steps, 1), callbacks=[], model=model,
                                 reward_funcs=recorders, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=1, num_generations=a.generations,
                                 max_completion_length=a.completion, learning_rate=a.lr, logging_steps=1,
                                 use_cpu=not a.gpu)
    settings = {"model": model, "steps": steps, "max_completion_length": a.completion,
                "num_generations": a.generations, "prompt_groups_per_step": a.prompts, "learning_rate": a.lr,
                "lora": "r16 all-linear" if model == "real" else "r8 q,v", "beta": 0.0,
                "device": "gpu" if a.gpu else "cpu", "torch_threads": torch.get_num_threads()}
    name = "wordle_rewards" + ("_untrained" if not steps else "") + ("_smoke" if a.smoke else "")
    untrained = None
    if a.sample_prompts:
        begin = time.perf_counter()
        untrained = sample_untrained(trainer, 4 if a.smoke else a.sample_prompts, a.generations, a.completion)
        untrained["seconds"] = time.perf_counter() - begin
        settings["untrained_full"] = untrained
        print(f"untrained model: {untrained['groups_with_variance']}/{untrained['prompts']} prompt groups with reward "
              f"variance (varied by {untrained['groups_varied_by']}), mean rewards {untrained['mean_rewards']}",
              flush=True)
        write_result(name, {"settings": {k: v for k, v in settings.items() if k != "untrained_full"},
                            "untrained": untrained})
    if not steps:
        return
    start = time.perf_counter()

    class Save(TrainerCallback):
        """Writes the results after every logged step, so that a run cut short still leaves its numbers."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                collect(trainer, recorders, a.generations, settings, name, time.perf_counter() - start)

    trainer.add_callback(Save())
    trainer.train()
    rows, summary, path = collect(trainer, recorders, a.generations, settings, name, time.perf_counter() - start,
                                  finished=True)
    names = [f.__name__ for f in wordle.REWARD_FUNCS]
    groups, zero = summary["groups"], summary["groups"] - summary["groups_with_variance"]
    first, last = [k for k in summary if k.startswith(("first_", "last_"))]
    seconds = summary["seconds"]
    print(table(["step", "reward", "zero-std", "format", "valid", "letters", "consist", "solved", "len", "clipped"],
                [[r["step"], r["reward"], r["frac_reward_zero_std"], *(r["rewards"][n] for n in names),
                  r["mean_length"], r["clipped_ratio"]] for r in rows]))
    print(f"\n{groups - zero}/{groups} prompt groups had reward variance; varied by: {summary['groups_varied_by']}")
    for key in (first, last):
        w = summary[key]
        print(f"{key}: reward {w['reward']:.3f}, zero-std share {w['frac_reward_zero_std']:.2f}, "
              f"clipped {w['clipped_ratio']:.2f}, " + ", ".join(f"{n} {v:.2f}" for n, v in w["rewards"].items()))
    print(f"{seconds:.0f} s; written to {path}")


if __name__ == "__main__":
    main()
