"""4. Real OOM recovery: a GRPO+LoRA run whose initial split (32×1) does not fit under a CUDA memory fraction must
reach max_steps at a smaller split with the same effective and generation batch, losing no step beyond the
checkpoint; reported: the time from the OOM to the next optimizer step.
"""
import argparse
import json
import os
import tempfile

import torch
from common import GB, grpo_trainer, sweep_limit_gb, table, write_result

from hf_perf_callbacks import AdaptiveBatchTuner, ThroughputMeter, train_with_tuning


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--limit_gb", type=float, default=None, help="default: between the 16×2 and 32×1 peaks of "
                                                                   "results/tuner_sweep.json")
    a = p.parse_args()
    limit = a.limit_gb
    if limit is None:
        limit = sweep_limit_gb()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(limit * GB / total)
    out = tempfile.mkdtemp()
    # no memory check: it reads the per-process cap and would pick a split that fits before training; the OOM path
    # is what this measures
    tuner = AdaptiveBatchTuner(tune=False, memory_check=False)
    trainer = grpo_trainer(out, [ThroughputMeter(), tuner], 32, 1, a.steps, a.completion)
    train_with_tuning(trainer)
    steps = [json.loads(x)["step"] for x in open(os.path.join(out, "perf_log.jsonl"))
             if json.loads(x)["type"] == "step"]
    args = trainer.args
    final = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    decisions = [d.to_json() for d in tuner.executor.record.decisions]
    result = {"memory_limit_gb": limit, "decisions": decisions, "final_split": final,
              "effective_batch": final[0] * final[1], "generation_batch": args.generation_batch_size,
              "reached_step": trainer.state.global_step, "max_steps": a.steps, "logged_steps": steps,
              "no_step_lost_or_repeated": steps == list(range(1, a.steps + 1)),
              "recovery_sec": [d["recovery_sec"] for d in decisions], "settings": vars(a)}
    write_result("oom_recovery", result)
    print(table(["limit GB", "decisions", "final split", "effective", "reached", "steps intact", "OOM→next step s"],
                [[limit, " ; ".join(f"{d['old']['micro_batch']}→{d['new']['micro_batch']}" for d in decisions),
                  f"{final[0]}×{final[1]}", final[0] * final[1], f"{trainer.state.global_step}/{a.steps}",
                  result["no_step_lost_or_repeated"],
                  ", ".join(f"{s:.2f}" for s in result["recovery_sec"] if s is not None)]]))


if __name__ == "__main__":
    main()
