"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): an OOM on rank 1 where no smaller split is exact.

The collator pads left, so only the configured split keeps the run's loss: an OOM in rank 1's forward at step 3
is agreed by both ranks, and both end with ``InexactResize`` after saving the last completed step (checkpoint-2)
together. Each rank writes what it raised and the checkpoint it named to ``<out>/rank<R>.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.resize import InexactResize
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, make_trainer
from tests.scripts.two_rank_meter import shut_down
from tests.test_tuner import CUDA_OOM, PlantedOOM


def main(out):
    rank = int(os.environ["RANK"])
    plant = PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=2)
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = plant.attach(make_trainer(build_tokenizer(CORPUS, vocab_size=300), os.path.join(out, "run"),
                                        [plant, tuner], max_steps=4, bs=4, ga=1, padding_side="left"))
    result = {"raised": None}
    try:
        train_with_tuning(trainer)
    except InexactResize as error:
        result = {"raised": type(error).__name__, "checkpoint": error.checkpoint, "not_saved": error.not_saved,
                  "notes": getattr(error, "__notes__", []), "message": str(error)}
    result.update(step=trainer.state.global_step, planted=plant.raised,
                  decisions=[d.to_json() for d in tuner.executor.record.decisions])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
