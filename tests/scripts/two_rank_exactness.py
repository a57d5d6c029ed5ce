"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the check of a re-size on two ranks.

Rank 1 runs out of memory on micro-batches of 4 from step 3 (both ranks agree inside the step and re-size 4×1 →
2×2 together). The check runs on both ranks, each on its own rows, and their sketches are summed: every rank gets
the same verdict. The plain loss goes on, and trains what the unfaulted two-rank run trains (weights and optimizer
state written per rank); a loss with a per-micro-batch term that warms up with the step is refused on both ranks,
which end saved with the same reason. Each rank writes ``<out>/rank<R>.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.core.splitfile import read_split_file
from hf_perf_callbacks.resize import InexactResize
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, make_trainer
from tests.faults import weights
from tests.scripts.two_rank_meter import shut_down
from tests.test_exactness import SGD, WarmingAuxLoss
from tests.test_tuner import CUDA_OOM, PlantedOOM


def trained(out, tokenizer, rank, fault, trainer_cls=None):
    plant = PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=2) if fault else None
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, out, [*([plant] if plant else []), tuner], max_steps=5, bs=4, ga=1,
                           extra=SGD, trainer_cls=trainer_cls)
    if plant is not None:
        plant.attach(trainer)
    result = {"raised": None}
    try:
        train_with_tuning(trainer)
    except InexactResize as error:
        result = {"raised": type(error).__name__, "message": str(error).split(";")[0]}
    record = read_split_file(out) if rank == 0 else None
    result.update(step=trainer.state.global_step, planted=plant.raised if plant else 0,
                  split=[trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps],
                  checks=[c.to_json() for c in record.checks] if record else None)
    return trainer, result


def main(out):
    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    plain, _ = trained(os.path.join(out, "plain"), tokenizer, rank, fault=False)
    resized, result = trained(os.path.join(out, "resized"), tokenizer, rank, fault=True)
    result["same_weights"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in
                                 zip(weights(plain.model).values(), weights(resized.model).values()))
    _, refused = trained(os.path.join(out, "warming"), tokenizer, rank, fault=True, trainer_cls=WarmingAuxLoss)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"resized": result, "refused": refused}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
