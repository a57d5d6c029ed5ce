"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): a GRPO and a plain Trainer run with the meter.

Each rank writes what its meter measured to ``<out>/rank<R>.json``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_perf_callbacks import AdaptiveBatchTuner, MemoryWatchdog, ThroughputMeter, keys, train_with_tuning
from hf_perf_callbacks.common.base import hook
from hf_perf_callbacks.tiny import build_tokenizer
from tests.conftest import CORPUS, PlantedClock, length_reward, make_grpo, make_trainer
from tests.test_tuner import CUDA_OOM, MPS_OOM, PlantedOOM, PlantedStepTime


def rates(meter):
    return [round(r, 6) for r in meter.rates]


class RecordingMeter(ThroughputMeter):
    @hook
    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.rates = getattr(self, "rates", []) + [self.timeline.tokens_per_sec or 0.0]


def main(out):
    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    grpo_meter = RecordingMeter(window_steps=2)
    grpo = make_grpo(tokenizer, os.path.join(out, "grpo"), [grpo_meter], max_steps=4, bs=2, ga=2)
    grpo.train()
    plain_meter = RecordingMeter(window_steps=2)
    plain = make_trainer(tokenizer, os.path.join(out, "plain"), [plain_meter], max_steps=4, bs=2, ga=2)
    plain.train()
    # only rank 1 is over its (tiny) budget: its stop must stop both ranks at the same step, with one checkpoint
    watchdog = MemoryWatchdog(limit_gb=0.001 if rank == 1 else None, grace_steps=1)
    stopped = make_trainer(tokenizer, os.path.join(out, "stop"), [watchdog], max_steps=6, bs=2, ga=2)
    stopped.train()
    # an OOM planted on rank 1 only, at step 2: both ranks must re-size to the same split, without deadlock
    plant = PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=2)
    tuner = AdaptiveBatchTuner(tune=False)
    oom = plant.attach(make_trainer(tokenizer, os.path.join(out, "oom"), [plant, tuner], max_steps=4, bs=4, ga=1))
    train_with_tuning(oom)
    # the memory check with a planted OOM on rank 1 only: both ranks must judge every split alike and pick one
    plant2 = PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM)
    check_tuner = AdaptiveBatchTuner(tune=False, memory_check=True)
    checked = plant2.attach(make_trainer(tokenizer, os.path.join(out, "check"), [plant2, check_tuner], max_steps=2,
                                         bs=4, ga=1))
    train_with_tuning(checked)
    # the tuning on the run's own steps, each rank's step times planted differently: both take the same decisions
    clock = PlantedClock()
    seconds = {4: 50.0, 2: 100.0, 1: 200.0} if rank == 0 else {4: 60.0, 2: 100.0, 1: 150.0}
    tune_tuner = AdaptiveBatchTuner(clock=clock, must_pay=False, first_samples=4)
    tuned = make_trainer(tokenizer, os.path.join(out, "tune"), [PlantedStepTime(clock, seconds), tune_tuner],
                         max_steps=13, bs=2, ga=2)
    train_with_tuning(tuned)
    # an OOM in rank 1's *backward* only: DDP would leave rank 0 waiting in its gradient all-reduce
    plant3 = PlantedOOM(limit=2 if rank == 1 else 99, text=MPS_OOM, armed_at=1, in_backward=True)
    backward = plant3.attach(make_trainer(tokenizer, os.path.join(out, "backward"),
                                          [plant3, AdaptiveBatchTuner(tune=False)], max_steps=3, bs=4, ga=1))
    train_with_tuning(backward)
    # the guarded steps average gradients themselves: the weights must match a plain DDP run
    guarded = make_trainer(tokenizer, os.path.join(out, "guarded"), [AdaptiveBatchTuner(tune=False)], max_steps=2,
                           bs=2, ga=2)
    train_with_tuning(guarded)
    plain = make_trainer(tokenizer, os.path.join(out, "plain_ddp"), [], max_steps=2, bs=2, ga=2)
    plain.train()
    weights = [(a - b).abs().max().item() for a, b in zip(guarded.model.parameters(), plain.model.parameters())]
    initial = make_trainer(tokenizer, os.path.join(out, "initial"), [], max_steps=1).model
    moved = [(a - b).abs().max().item() for a, b in zip(guarded.model.parameters(), initial.parameters())]
    grpo_guarded = make_grpo(tokenizer, os.path.join(out, "grpo_guarded"), [AdaptiveBatchTuner(tune=False)],
                             max_steps=2, bs=2, ga=2)
    train_with_tuning(grpo_guarded)
    result = {**grpo_ooms(tokenizer, out, rank), **one_reading(oom, rank),
              "grpo_guarded_step": grpo_guarded.state.global_step,
              "backward_split": [backward.args.per_device_train_batch_size, backward.args.gradient_accumulation_steps],
              "backward_step": backward.state.global_step, "backward_raised": plant3.raised,
              "guarded_vs_ddp_max_weight_diff": max(weights), "guarded_weight_change": max(moved),
              "check_split": [checked.args.per_device_train_batch_size, checked.args.gradient_accumulation_steps],
              "check_trials": [(t.split.micro_batch, t.fits) for t in check_tuner.executor.record.decisions[0].trials],
              "check_step": checked.state.global_step,
              "tune_decisions": [(d.kind, d.step, d.new.micro_batch,
                                  [(t.split.micro_batch, t.samples) for t in d.trials])
                                 for d in tune_tuner.executor.record.decisions],
              "tune_split": [tuned.args.per_device_train_batch_size, tuned.args.gradient_accumulation_steps],
              "tune_step": tuned.state.global_step,
              "oom_step": oom.state.global_step, "oom_raised": plant.raised,
              "oom_split": [oom.args.per_device_train_batch_size, oom.args.gradient_accumulation_steps],
              "oom_decisions": [(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions],
              "stop_step": stopped.state.global_step, "stop_actions": [a["action"] for a in watchdog.actions],
              "grpo_rates": rates(grpo_meter), "grpo_tokens": grpo_meter.timeline.total_tokens,
              "grpo_rollout_rates": [round(h[keys.PERF_ROLLOUT_TOKENS_PER_SEC], 6) for h in grpo.state.log_history
                                     if keys.PERF_ROLLOUT_TOKENS_PER_SEC in h],
              "grpo_seen": grpo.state.num_input_tokens_seen, "plain_rates": rates(plain_meter),
              "plain_tokens": plain_meter.timeline.total_tokens, "world": grpo_meter.run.world,
              "plain_token_source": plain_meter.run.token_source}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def one_reading(oom, rank):
    """A resume of the re-sized run where rank 1's own reading of the split file finds nothing (as when the main
    process rewrites it at that moment): every rank must take the main process's reading, so they resume at one
    split (two readings let rank 1 train the old split beside rank 0's new one, and FSDP's collectives hung)."""
    from hf_perf_callbacks.platform.device import main_process_value
    from hf_perf_callbacks.resize import executor as executor_module
    from hf_perf_callbacks.resize.executor import Executor

    own = executor_module.read_split_file
    if rank == 1:
        executor_module.read_split_file = lambda *args, **kwargs: None
    try:
        resumed = Executor(oom.args)
        checkpoint = sorted((d for d in os.listdir(oom.args.output_dir) if d.startswith("checkpoint-")),
                            key=lambda d: int(d.rsplit("-", 1)[1]))[-1]
        resumed.resume_from(oom, os.path.join(oom.args.output_dir, checkpoint))
    finally:
        executor_module.read_split_file = own
    recorded = resumed.recorded
    return {"main_process_value": main_process_value(lambda: rank),
            "resumed_split": [recorded.micro_batch, recorded.grad_accum] if recorded else None,
            "resumed_decisions": len(resumed.record.decisions)}


def grpo_ooms(tokenizer, out, rank):
    """GRPO steps hold collectives of their own (TRL gathers rewards after generation and metrics after the loss
    forward): an OOM on rank 1 before them must not leave rank 0 waiting in them."""
    result = {}
    for name, plant in (("grpo_forward_oom", PlantedOOM(limit=2 if rank == 1 else 99, text=CUDA_OOM, armed_at=1)),
                        ("grpo_generation_oom", PlantedOOM(limit=2 if rank == 1 else 99, text=MPS_OOM, armed_at=1,
                                                           in_generation=True, once=True))):
        tuner = AdaptiveBatchTuner(tune=False)
        trainer = plant.attach(make_grpo(tokenizer, os.path.join(out, name), [plant, tuner], max_steps=3, bs=4, ga=1))
        ended = None
        try:
            train_with_tuning(trainer)
        except Exception as error:  # noqa: BLE001 - generation: no micro-batch fixes it, every rank ends alike
            ended = [type(error).__name__, str(error).split(",")[0]]
        args = trainer.args
        result[name] = {"raised": plant.raised, "step": trainer.state.global_step, "ended": ended,
                        "split": [args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                  args.generation_batch_size],
                        "decisions": [(d.kind, d.step, d.new.micro_batch) for d in tuner.executor.record.decisions]}
    # any other error in one rank's step: that rank raises it, the others raise PeerFailed (no wait for a timeout)
    calls = []

    def reward_failing_on_rank1(prompts, completions, completion_ids=None, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise ValueError("reward function failed")
        return length_reward(prompts, completions, completion_ids)

    failing = make_grpo(tokenizer, os.path.join(out, "grpo_failing"), [AdaptiveBatchTuner(tune=False)], max_steps=3,
                        bs=4, ga=1, reward=reward_failing_on_rank1)
    try:
        train_with_tuning(failing)
        result["failure"] = None
    except Exception as error:  # noqa: BLE001
        result["failure"] = [type(error).__name__, failing.state.global_step]
    import torch.distributed as dist

    result["collectives_restored"] = all(getattr(dist, name) is getattr(dist.distributed_c10d, name)
                                         for name in ("all_gather", "all_reduce", "broadcast_object_list"))
    return result


def shut_down():
    """Meet, let gloo's worker threads drain, then destroy the process group explicitly: leaving it to interpreter
    exit can abort a rank ("terminate called without an active exception", pytorch/pytorch#75097)."""
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.5)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
