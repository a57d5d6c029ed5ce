"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): an OOM on rank 1 *outside* the training step.

Only OOMs inside the guarded step are agreed across ranks; one outside it (here raised after rank 1's first
optimizer step, as ``optimizer.step`` or a save could) must not be "recovered" by re-sizing alone, which would
leave rank 0 in a mismatched collective until the timeout: rank 1 raises it at once, writes what it saw to
``<out>/rank1.json`` and exits non-zero, and the launcher ends the run.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, make_trainer
from tests.test_tuner import CUDA_OOM


class OOMAfterFirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ["RANK"]) == 1 and state.global_step == 1:
            raise torch.OutOfMemoryError(CUDA_OOM)


def main(out):
    tuner = AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(build_tokenizer(CORPUS, vocab_size=300), os.path.join(out, "run"),
                           [OOMAfterFirstStep(), tuner], max_steps=3, bs=4, ga=1)
    try:
        train_with_tuning(trainer)
    except torch.OutOfMemoryError:
        with open(os.path.join(out, "rank1.json"), "w") as f:
            json.dump({"reraised": True, "step": trainer.state.global_step,
                       "decisions": [d.to_json() for d in tuner.executor.record.decisions]}, f)
        sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1])
