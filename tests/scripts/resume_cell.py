"""A new process resuming one cell of the re-size matrix (``tests/test_compat_resize.py``), for its check that a
fresh trainer in the test's process stands for a new process: ``resume_cell.py "<cell id>" DIR OUT`` resumes the
copy ``DIR`` with ``train_with_tuning(resume_from_checkpoint="last")`` and saves what it trained to ``OUT``."""
import sys

import torch

from hf_perf_callbacks import AdaptiveBatchTuner, train_with_tuning
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS
from tests.faults import Trajectory
from tests.test_compat_resize import CELLS, build

cell = next(c for c in CELLS if c.id == sys.argv[1])
resumed = Trajectory()
trainer = build(cell, build_tokenizer(CORPUS, vocab_size=300), sys.argv[2], [resumed, AdaptiveBatchTuner(tune=False)])
train_with_tuning(resumed.attach(trainer), resume_from_checkpoint="last")
torch.save({"by_step": resumed.by_step, "rng": resumed.rng, "rates": resumed.rates, "final": resumed.final,
            "optimizer": resumed.optimizer, "micro_batch": trainer.args.per_device_train_batch_size}, sys.argv[3])
