"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the meter and the watchdog agree across ranks with one
collective per optimizer step between them; once with both working, once with rank 1's meter disabled by a planted
fault at step 2 (its stand-in keeps the ranks in step: no hang).

Each rank writes the collectives its callbacks' step ends took, per step, to ``<out>/exchange<R>.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist
from transformers import TrainerCallback

from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, make_trainer

#: the collectives of torch.distributed counted (what the package's helpers call)
COUNTED = ("all_gather", "all_reduce", "all_gather_object", "broadcast", "broadcast_object_list", "gather")
calls = [0]


def counting(name):
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


class Mark(TrainerCallback):
    """Placed before and after the package's callbacks: the collectives between its two marks of a step."""

    def __init__(self, marks, where):
        self.marks, self.where = marks, where

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.setdefault(state.global_step, {})[self.where] = calls[0]


def run(tokenizer, out, fault_rank=None):
    rank = int(os.environ["RANK"])
    marks = {}
    meter = ThroughputMeter()
    if rank == fault_rank:
        measure = meter.timeline.measure

        def faulty(step, *args, **kwargs):
            if step == 2:
                raise RuntimeError("planted fault")
            return measure(step, *args, **kwargs)

        meter.timeline.measure = faulty
    callbacks = [Mark(marks, "before"), meter, MemoryWatchdog(), Mark(marks, "after")]
    make_trainer(tokenizer, out, callbacks, max_steps=4, bs=2, ga=1).train()
    per_step = {step: m["after"] - m["before"] for step, m in sorted(marks.items())}
    return {"per_step": per_step, "meter_disabled": meter.disabled}


def main(out):
    rank = int(os.environ["RANK"])
    for name in COUNTED:
        counting(name)
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    result = {"both": run(tokenizer, os.path.join(out, "both")),
              "faulted": run(tokenizer, os.path.join(out, "faulted"), fault_rank=1)}
    with open(os.path.join(out, f"exchange{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
