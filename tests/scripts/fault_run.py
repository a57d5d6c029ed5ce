"""A tiny Trainer run killed at a step, for tests/test_faults.py (run as a subprocess with PYTHONPATH at the repo).

``sigkill DIR``: saves every step and is killed (SIGKILL) while writing checkpoint-2's optimizer.pt.
``sigterm DIR``: with transformers' just-in-time checkpoint on, the watchdog asks for a smaller micro-batch at step 2
(an in-process re-size through train_with_tuning), then the process sends itself SIGTERM at step 4; prints a JSON
line with the step it stopped at and the split.
"""
import json
import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, train_with_tuning
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, make_trainer


class SigtermAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)                 # the handler's timer (kill_wait 0) requests the checkpoint


def main(mode, output_dir):
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    if mode == "sigkill":
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if str(f).endswith(os.path.join("checkpoint-2", "optimizer.pt")):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(obj, f, *args, **kwargs)

        torch.save = save
        trainer = make_trainer(tokenizer, output_dir, [AdaptiveBatchTuner(tune=False)], max_steps=4, bs=4, ga=2,
                               extra={"save_strategy": "steps", "save_steps": 1})
        train_with_tuning(trainer)
        return
    from tests.test_tuner import MemoryByBatch

    watchdog, tuner = MemoryWatchdog(limit_gb=7.0, grace_steps=1), AdaptiveBatchTuner(tune=False)
    trainer = make_trainer(tokenizer, output_dir, [watchdog, tuner, SigtermAt(4)], max_steps=8, bs=4, ga=2,
                           extra={"enable_jit_checkpoint": True})
    watchdog.device = MemoryByBatch(trainer.args)
    for callback in trainer.callback_handler.callbacks:
        if getattr(callback, "jit_manager", None) is not None:
            callback.jit_manager.kill_wait = 0
    train_with_tuning(trainer)
    live = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AdaptiveBatchTuner))
    print(json.dumps({"global_step": trainer.state.global_step, "resizes": len(live.executor.record.decisions),
                      "micro_batch": trainer.args.per_device_train_batch_size}))


if __name__ == "__main__":
    main(*sys.argv[1:])
