"""Noisy runs made without a trainer, for the report's checks: a run log and a tuner record as the callbacks write
them, from planted step times.

The figures come from the callbacks' own pure cores — the meter's :class:`~hf_perf_callbacks.core.timeline.StepTimeline`
(warmup, steady figures, contention on CPU time), the tuner's :class:`~hf_perf_callbacks.resize.tuning.OnRunTuning`
(trials, switches, the pay-back rule) — and every line is written through the run log's writer classes
(:class:`~hf_perf_callbacks.core.runlog.RunHeader`, ``StepLine``, ``EventLine``, ``SummaryLine`` through ``LogWriter``)
and the split file's (:class:`~hf_perf_callbacks.core.splitfile.SplitFile`). What is planted: each split's seconds per
step outside generation, generation seconds, relative noise, a warmup (slow first steps with CPU time behind them),
contention (slow steps whose CPU time stayed flat), slower steps (their CPU time with them), the watchdog's wall
moves, evaluations, what a switch costs, the rewards and completions the trainer logs. A plan's step count can be
large (the report's scaling benchmark writes 200,000 steps).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from hf_perf_callbacks import keys
from hf_perf_callbacks.core.batching import Split, exact_splits
from hf_perf_callbacks.core.runlog import EventLine, LogWriter, RunHeader, StepLine, SummaryLine
from hf_perf_callbacks.core.splitfile import Decision, SplitFile
from hf_perf_callbacks.core.timeline import StepTimeline
from hf_perf_callbacks.resize.tuning import Finished, OnRunTuning, Switch

MODEL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 400, "max_position_embeddings": 1024,
         "params": 137536, "trainable_params": 4096, "bytes_per_param": 4, "matmul_params": 111616,
         "trainable_matmul_params": 4096}


@dataclass
class Plan:
    """What a synthetic run plants (seconds unless named otherwise)."""

    steps: int = 40
    seed: int = 0
    grpo: bool = True
    configured: tuple[int, int] = (4, 2)
    split_sec: dict[int, float] = field(default_factory=dict)   # micro-batch → seconds outside generation a step
    base_sec: float = 1.0                  # outside generation, the configured split (and any split not listed)
    generation_sec: float = 0.5            # GRPO: generation seconds a step
    data_wait_sec: float = 0.01
    noise: float = 0.1                     # each step's seconds × (1 ± noise), uniform
    warmup: tuple[float, ...] = ()         # extra seconds of the run's first steps, with CPU time behind them
    contention: dict[int, float] = field(default_factory=dict)   # step → extra wall seconds, CPU time flat
    slower: dict[int, float] = field(default_factory=dict)       # step → its seconds × this, CPU time with them
    walls: tuple[int, ...] = ()            # steps where the watchdog's memory wall moved (its event)
    resize_at: dict[int, tuple[int, int]] = field(default_factory=dict)   # step → the split a new train() call
    #                                        takes after it (micro-batch, accumulation), no tuner involved
    tune: bool = False
    must_pay: bool = True
    switch_sec: float = 2.0
    eval_every: int | None = None
    eval_sec: float = 0.0
    logging_steps: int = 1
    reward: str = "varied"                 # "varied", "constant" (always 0) or "none"
    clipped: float = 0.3                   # completions/clipped_ratio of every log
    max_completion_length: int = 24
    tokens: float = 1200.0
    summaries: bool = True                 # False: a killed run (no summary lines)


def write_run(output_dir: str, plan: Plan) -> str:
    """Write ``plan``'s run into ``output_dir`` (``perf_log.jsonl``, ``tuner_split.json`` when it tuned); returns
    ``output_dir``."""
    os.makedirs(output_dir, exist_ok=True)
    for name in (keys.PERF_LOG, keys.SPLIT_FILE):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    return _Run(output_dir, plan).run()


class _Run:
    def __init__(self, output_dir: str, plan: Plan):
        self.out, self.plan = output_dir, plan
        self.rng = random.Random(plan.seed)
        self.writer = LogWriter()
        self.session = f"synthetic{plan.seed:04d}"
        self.configured = Split(*plan.configured, plan.configured[1] if plan.grpo else None)
        self.timeline = StepTimeline()
        self.t, self.cpu = 1000.0, 100.0
        self.lines: list[str] = []
        self.decisions: list[Decision] = []
        self.tuning: OnRunTuning | None = None

    def _append(self, record) -> None:
        self.writer.append(self.out, record)

    def header(self, split: Split, start: int, resize: bool = False) -> None:
        p = self.plan
        header = RunHeader(session=self.session, resumed_from_step=start, time=self.t)
        if resize:                                  # a later train() call of train_with_tuning, as the bus marks it
            header.describe("bus", resize=True)
        header.describe("perf", device="x86_64", device_type="cpu", world_size=1, grpo=p.grpo,
                        token_source="trainer" if p.grpo else "hook", period=1, peak_flops=7e10, dtype="fp32",
                        per_device_train_batch_size=split.micro_batch, gradient_accumulation_steps=split.grad_accum,
                        max_completion_length=p.max_completion_length if p.grpo else None,
                        num_generations=4 if p.grpo else None,
                        steps_per_generation=split.steps_per_generation, temperature=1.0 if p.grpo else None,
                        use_vllm=False if p.grpo else None, activation_checkpointing=False, model=dict(MODEL),
                        dataloader={"num_workers": 0, "persistent_workers": False, "prefetch_factor": None,
                                    "pin_memory": False}, torch_threads=1, cpu_cores=2)
        header.describe("mem", budget_gb=20.0, device_limit_gb=23.5, system_total_gb=23.5)
        self._append(header)
        self.timeline.start_segment(self.t, 1, cpu=self.cpu, work="cpu")

    def summaries(self, split: Split) -> None:
        tl = self.timeline
        perf = {"steps": tl.steps, "tokens": tl.total_tokens, "train_seconds": tl.total_train_seconds,
                "warmup_done": tl.warmup_done, "warmup_steps": tl.warmup_steps,
                "warmup_overhead_sec": tl.warmup_overhead, "first_step_slowdown": tl.first_step_slowdown,
                "steady_step_sec": tl.steady_step_seconds, "steady_tokens_per_sec": tl.steady_tokens_per_sec,
                "mean_tokens_per_sec": tl.total_tokens / tl.total_train_seconds if tl.total_train_seconds else None,
                "phases": tl.phase_fractions(), "device": "x86_64", "world_size": 1, "peak_flops": 7e10,
                "warmup_measured_on": tl.work, "first_steady_step": tl.first_steady_step,
                "steady_step_count": tl.steady_steps, "early_contention_sec": tl.early_contention,
                "contention_steps": tl.contention_steps}
        self._append(SummaryLine("perf", perf))
        self._append(SummaryLine("mem", {"high_water_gb": 0.55, "budget_gb": 20.0, "actions": [],
                                         "stopped_at": None}))
        self._append(SummaryLine("tuner", {"split": split.as_args(), "session": self.session,
                                           "decisions": len(self.decisions)}))

    def seconds(self, split: Split, step: int) -> tuple[float, float, float]:
        """(outside generation, generation, extra warmup) seconds of ``step`` at ``split``, noise included."""
        p = self.plan
        noise = 1 + self.rng.uniform(-p.noise, p.noise)
        ranked = p.split_sec.get(split.micro_batch, p.base_sec) * noise * p.slower.get(step, 1.0)
        generation = p.generation_sec * (1 + self.rng.uniform(-p.noise, p.noise)) if p.grpo else 0.0
        warm = p.warmup[step - 1] if step - 1 < len(p.warmup) else 0.0
        return ranked, generation, warm

    def step(self, step: int, split: Split) -> tuple[float, float]:
        """Train ``step`` at ``split``: its line; returns (seconds outside generation, whole seconds)."""
        p, tl = self.plan, self.timeline
        ranked, generation, warm = self.seconds(split, step)
        stall = p.contention.get(step, 0.0)
        begin = self.t + p.data_wait_sec
        tl.enter("data_wait", self.t)
        tl.leave("data_wait", begin)
        tl.step_begin(begin)
        tl.add_generation(generation)
        end = begin + generation + ranked + warm + stall
        self.cpu += 0.9 * (generation + ranked + warm)            # contention adds wall time, not CPU time
        self.t = end
        record = tl.measure(step, end, cpu=self.cpu)
        tokens = p.tokens * (1 + self.rng.uniform(-0.05, 0.05))
        tl.commit(record, tokens)
        values: dict = dict(tl.rate_metrics())
        values[keys.PERF_FORWARDS_PER_MICROBATCH] = 1.0
        values[keys.PERF_PAD_FRACTION] = 0.05 + 0.05 * self.rng.random()
        values.update({keys.PERF_PHASE_SEC[ph]: getattr(record, ph) for ph in keys.PHASES})
        values.update({keys.PERF_STEP_WALL_SEC: record.wall, keys.PERF_TRAIN_SEC: record.train,
                       keys.PERF_TOKENS: tokens, keys.PERF_SEQ_LEN: 150 + self.rng.randrange(30),
                       keys.PERF_STEADY: int(record.steady), keys.PERF_FIRST_STEADY_STEP: tl.first_steady_step,
                       keys.PERF_EARLY_CONTENTION_SEC: tl.early_contention})
        if record.cpu is not None and record.wall > 0:
            values.update({keys.PERF_CPU_SEC: record.cpu, keys.PERF_CPU_TIME_RATIO: record.cpu / record.wall,
                           keys.PERF_OTHER_CPU_CORES: 1.0 if stall else 0.2, keys.PERF_LOAD_PER_CORE: 0.8})
        values.update({keys.MEM_DEVICE_USED_GB: 0.54 + 0.001 * split.micro_batch, keys.MEM_LIMIT_GB: 20.0,
                       keys.MEM_PEAK_GB: 0.55, keys.MEM_SYSTEM_AVAILABLE_GB: 20.0, keys.MEM_SWAP_USED_GB: 0.0,
                       keys.MEM_PRESSURE: 0})
        values.update({keys.TUNER_MICRO_BATCH: split.micro_batch, keys.TUNER_GRAD_ACCUM: split.grad_accum,
                       keys.TUNER_EFFECTIVE_BATCH: split.micro_batch * split.grad_accum, keys.TUNER_RESIZES: 0})
        if p.grpo and p.reward != "none" and step % p.logging_steps == 0:
            reward = 0.0 if p.reward == "constant" else 0.2 + 0.1 * self.rng.random()
            values.update({keys.TRAINER_LOG + "loss": 0.0 if p.reward == "constant" else 0.1,
                           keys.TRAINER_LOG + "grad_norm": 0.0 if p.reward == "constant" else 0.5,
                           keys.TRAINER_LOG + "reward": reward,
                           keys.TRAINER_LOG + "reward_std": 0.0 if p.reward == "constant" else 0.1,
                           keys.TRAINER_LOG + "frac_reward_zero_std": 1.0 if p.reward == "constant" else 0.4,
                           keys.TRAINER_LOG + "completions/mean_length": p.max_completion_length * 0.9,
                           keys.TRAINER_LOG + "completions/max_length": float(p.max_completion_length),
                           keys.TRAINER_LOG + "completions/clipped_ratio": p.clipped})
        self._append(StepLine(step, round(self.t, 3), values))
        if step in p.walls:
            self._append(EventLine("mem", "wall", "the memory wall moved: the budget is now 19.00 GiB (was 20.00 GiB)",
                                   step, round(self.t, 3), {"budget_gb": 19.0, "was_gb": 20.0}))
        if p.eval_every and step % p.eval_every == 0:       # evaluation after the step: the next step's wall has it
            self.t += p.eval_sec * (1 + self.rng.uniform(-p.noise, p.noise))
            tl.mark("eval", self.t)
        return ranked, record.train

    def run(self) -> str:
        p = self.plan
        split = self.configured
        self.header(split, 0)
        if p.tune:
            world_candidates = exact_splits(split.effective_batch(1), 1, split.generation_batch(1) if p.grpo else None,
                                            4 if p.grpo else None)
            self.tuning = OnRunTuning(split, [c for c in world_candidates if c != split], p.steps, period=1,
                                      must_pay=p.must_pay)
            self.tuning.segment_started(split, 0)
        step = 0
        while step < p.steps:
            step += 1
            ranked, whole = self.step(step, split)
            if step in p.resize_at and step < p.steps:        # a re-size: a new train() call at another split
                if p.summaries:
                    self.summaries(split)
                self.t += p.switch_sec
                micro, accum = p.resize_at[step]
                split = Split(micro, accum, accum if p.grpo else None)
                self.header(split, step, resize=True)
                continue
            tuning = self.tuning
            if tuning is None or tuning.done is not None and tuning.recorded:
                continue
            action = tuning.observe(step, ranked, whole)
            self.record_tuning(step)
            if isinstance(action, Switch) and step < p.steps:
                if p.summaries:
                    self.summaries(split)
                self.t += p.switch_sec
                split = action.split
                self.header(split, step, resize=True)
                if tuning.done is None:
                    tuning.segment_started(split, step, switch_sec=p.switch_sec)
        if self.tuning is not None and self.tuning.done is None:
            self.tuning.done = Finished(self.tuning.baseline, "the run ended before the tuning did")
            self.record_tuning(step)
        if p.summaries:
            self.summaries(split)
        if self.decisions:
            SplitFile(session=self.session, world_size=1, configured=self.configured, split=split,
                      decisions=self.decisions).write(self.out)
        return self.out

    def record_tuning(self, step: int) -> None:
        """The tune decision once the tuning finished, as ``Executor.record_tuning`` records it."""
        d = self.tuning.decision(step, self.t) if self.tuning is not None else None
        if d is None:
            return
        self.decisions.append(d)
        self._append(EventLine("tuner", "decision", d.headline(), step, round(self.t, 3),
                               d.event_details().to_details()))
