"""Advice check: does applying a finding's advice give the gain the analysis predicts?

For each scenario a baseline run is analysed (:func:`hf_perf_callbacks.report.check`); for every finding with a
setting (or a code fix the scenario knows), the same run is made again with exactly that setting applied and
everything else equal (seed, data, model, callbacks). Baseline and advised runs alternate (A B A B …) so that load
drifts hit both; the measured gain is the median over the pairs of baseline / advised mean time per optimizer step
after warm-up (whole generation cycles for GRPO). On a CPU the training process runs with one thread and the gain
is also measured in process CPU seconds per step, which other processes on a shared machine do not inflate (wall
time is the measure for the input-bound rule, whose waiting costs no CPU). Recorded per finding: the model's prediction
(``predicted_gain``), what the report prints (``expected_gain``, None for "try"), the measured gain and the spread
of the pairs. Results: ``benchmarks/results/advice_<device>.json``.

Scenarios with a cause a setting cannot express plant it and the advised run removes it: a loss that runs the model
twice (``duplicate_forward``), a collator that pads every batch to 128 positions (``pad_to_length``: the advised
run pads per batch), torch at one thread per core beside a process that keeps one core busy (``threads``,
``compete``: the advised run takes the finding's ``OMP_NUM_THREADS``), a reward that is always 0 (``reward``: no
speed advice; the finding's wording is checked: no setting that cannot move a constant reward, the first action one
that can), an evaluation after every step (``eval_steps``: the advised interval, measured in wall time with the
evaluations), an ``SFTTrainer`` padding to a fixed length (the advice's code must run in SFTTrainer: its own
collator), a user's callback generating 24 tokens at every log (``callbacks``: the advised ``logging_steps``), a
checkpoint save after every step (``saving``: the advised ``save_steps``), TRL's ``SFTConfig`` with its default
gradient checkpointing and memory to spare (``recompute``); a GRPO reward function with a round trip of its own per
call (``reward``: the advised ``steps_per_generation``), a user's callback generating at every step beside a save
after every step (the "try" finding ranks first by its seconds; the saving's printed gain applied), ``compute_metrics``
taking most of an evaluation after every step (``evaluation``, with its ``compute_metrics`` bullet), and
``torch_compile`` with inductor (its compile workers' CPU time: the first steps are the warmup note's compile, never
contention). Each row records the finding's rank, its seconds at stake and their share of the run.

    python benchmarks/bench_advice.py --paired --repeats 4 --only trainer_costly_on_log trainer_save_every_step \
        sft_checkpointing_not_needed trainer_eval_every_step --results advice_phases   # the phase rules, two runs
                                                                   #  at a time, one per core, swapped
    python benchmarks/bench_advice.py --paired --repeats 4 --only grpo_slow_reward trainer_callback_beside_saves \
        trainer_eval_metrics trainer_compile --results advice_causes   # issue 51's cases
    python benchmarks/bench_advice.py --smoke                      # CPU, tiny model, a minute or two
    python benchmarks/bench_advice.py --model tiny --repeats 2     # CPU, tiny model
    python benchmarks/bench_advice.py --model smollm2              # SmolLM2-135M-Instruct (CPU: one small scenario;
                                                                   #  CUDA, the default there: every scenario, bf16)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SKIP_RULES = {"no_learning", "memory_pressure"}    # not speed advice (or not reproducible on purpose here)
TEXTS = ["the quick brown fox jumps over the lazy dog", "what is two plus two ? the answer is four",
         "write a short poem about the sea and the sky", "hello world , how are you today ?",
         "count from one to ten : one two three four five six seven eight nine ten"]


# ------------------------------------------------------------------ models
def load_model(kind: str, device: str):
    """(model factory, tokenizer): a fresh model with the same weights for every run."""
    if kind == "tiny":
        from hf_perf_callbacks.tasks import wordle
        from hf_perf_callbacks.tiny import build_model, build_tokenizer

        corpus = list(wordle.make_dataset(128, seed=1)["prompt"]) + TEXTS * 10 + [
            f"<think>try {w}</think><guess>{w}</guess>" for w in wordle.load_words()]
        tok = build_tokenizer(corpus, vocab_size=600)
        return (lambda: build_model(tok, hidden=128, layers=4, heads=4)), tok
    if kind == "smollm2":
        import common

        return common.smollm2(dtype=torch.float32, device=device)   # converted once, then cached
    raise SystemExit(f"--model {kind!r}: expected tiny or smollm2")


class SlowText(torch.utils.data.Dataset):
    """Causal-LM examples of varying length; each item costs ``delay`` seconds to 'load'."""

    def __init__(self, tok, n=256, delay=0.0):
        self.items = [tok(TEXTS[i % 5] + " " + TEXTS[(i * 3) % 5][: 5 + (i * 7) % 30])["input_ids"]
                      for i in range(n)]
        self.delay = delay

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return {"input_ids": self.items[i]}


class FixedLength:
    """A collator that pads every batch to ``length`` positions (``padding="max_length"``), then makes labels."""

    def __init__(self, tok, length: int):
        from transformers import DataCollatorForLanguageModeling

        self.inner = DataCollatorForLanguageModeling(tok, mlm=False)
        self.tok, self.length = tok, length

    def __call__(self, features):
        features = [{"input_ids": f["input_ids"]} for f in features]      # SFT's examples carry more fields
        batch = self.tok.pad(features, padding="max_length", max_length=self.length, return_tensors="pt")
        return self.inner([{k: v[i] for k, v in batch.items()} for i in range(len(features))])


def _burn():                                   # another process's work: one core kept busy
    while True:
        pass


def generate_on_log():
    """A user's callback that runs ``model.generate`` of 24 tokens at every log (the field report's costly
    ``on_log``)."""
    from transformers import TrainerCallback

    class GenerateOnLog(TrainerCallback):
        def on_log(self, args, state, control, model=None, processing_class=None, **kwargs):
            if model is None:
                return
            ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=model.device)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                               min_new_tokens=24, do_sample=False)

    return GenerateOnLog()


def zero_reward(prompts, completions, **kwargs):
    """A reward no completion can move (every completion scores 0)."""
    return [0.0] * len(completions)


def round_trip_reward(prompts, completions, **kwargs):
    """A reward with a cost of its own per call (a request to a judge or a sandbox: 0.5 s however many completions
    it scores), then each completion's length against 8 tokens."""
    time.sleep(0.5)
    return [-abs(len(str(c)) - 40) / 40 for c in completions]


def generate_every_step():
    """A user's callback that runs ``model.generate`` of 24 tokens at every step's end."""
    from transformers import TrainerCallback

    inner = generate_on_log()

    class GenerateEveryStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            inner.on_log(args, state, control, model=model)

    return GenerateEveryStep()


def slow_metrics(prediction):
    """A ``compute_metrics`` that takes 0.3 s whatever it gets (a metric library's set-up, a tokenizer decode)."""
    time.sleep(0.3)
    return {"predictions": float(len(prediction.predictions))}


class StepClock:
    """Wall and process CPU seconds of every optimizer step, from one step's end to the next (so the data loading
    before a step counts), independent of the package's meter."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.wall, self.cpu = [], []

            def on_train_begin(self, args, state, control, **kwargs):
                self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t, c = time.perf_counter(), time.process_time()
                self.wall.append(t - self.t0)
                self.cpu.append(c - self.c0)
                self.t0, self.c0 = t, c

        return _Clock()


def build(scenario: dict, settings: dict, factory, tok, output_dir: str, device: str, clock=None):
    """The scenario's trainer with ``settings`` (config keys, plus the scenario's code switches) applied."""
    from hf_perf_callbacks import default_callbacks

    callbacks = default_callbacks(AdaptiveBatchTuner={"tune": False}) + ([clock] if clock else [])
    cfg = {**scenario["config"], **settings}
    if cfg.pop("costly_on_log", False):
        callbacks.append(generate_on_log())
    if cfg.pop("costly_step_end", False):
        callbacks.append(generate_every_step())
    metrics = cfg.pop("slow_metrics", False)
    duplicate = cfg.pop("duplicate_forward", False)
    delay = cfg.pop("delay", 0.0)
    pad_to = cfg.pop("pad_to_length", None)
    reward = cfg.pop("reward", None)
    cfg.pop("compete", None)
    evaluate = cfg.pop("eval_examples", 0)
    threads = cfg.pop("threads", None)
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    if cfg.get("torch_compile"):               # a compile from scratch: inductor's on-disk cache is the run's own
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(output_dir, "inductor_cache")
    common_args = dict(output_dir=output_dir, logging_steps=1, save_strategy="no", report_to="none",
                       disable_tqdm=True, seed=0, learning_rate=1e-4, use_cpu=device == "cpu",
                       bf16=device == "cuda")
    if scenario["kind"] == "grpo":
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer

        from hf_perf_callbacks.tasks import wordle

        args = GRPOConfig(**{**common_args, "beta": 0.0, "activation_checkpointing": False, **cfg})
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        rewards = (zero_reward if reward == "zero" else [round_trip_reward, *wordle.REWARD_FUNCS]
                   if reward == "round_trip" else wordle.REWARD_FUNCS)
        return GRPOTrainer(model=factory(), reward_funcs=rewards, args=args,
                           train_dataset=wordle.make_dataset(256, seed=0, max_history=0, conversational=True),
                           processing_class=tok, peft_config=lora, callbacks=callbacks)
    if scenario["kind"] == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        texts = [TEXTS[i % 5] + " " + TEXTS[(i * 3) % 5][: 5 + (i * 7) % 30] for i in range(256)]
        args = SFTConfig(**{**common_args, **cfg})      # TRL's default: gradient_checkpointing on
        return SFTTrainer(model=factory(), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                          processing_class=tok, data_collator=FixedLength(tok, pad_to) if pad_to else None,
                          callbacks=callbacks)
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    class DuplicateForward(Trainer):
        """A custom loss that runs the model twice with gradients on (the field report's mistake)."""

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            first = super().compute_loss(model, inputs, return_outputs, **kwargs)
            second = super().compute_loss(model, inputs, return_outputs, **kwargs)
            if return_outputs:
                return (first[0] + second[0]) / 2, first[1]
            return (first + second) / 2

    args = TrainingArguments(**{**common_args, **cfg})
    cls = DuplicateForward if duplicate else Trainer
    collator = FixedLength(tok, pad_to) if pad_to else DataCollatorForLanguageModeling(tok, mlm=False)
    return cls(model=factory(), args=args, train_dataset=SlowText(tok, delay=delay), data_collator=collator,
               eval_dataset=SlowText(tok, n=evaluate) if evaluate else None, callbacks=callbacks,
               compute_metrics=slow_metrics if metrics else None,
               preprocess_logits_for_metrics=(lambda logits, labels: logits.argmax(-1)) if metrics else None)


def run_once(scenario, settings, factory, tok, device, keep: str | None = None):
    """({"wall": s, "cpu": s} mean per optimizer step after the scenario's ``skip`` steps, the run directory)."""
    out = tempfile.mkdtemp(prefix="advice_")
    clock = StepClock()
    threads = torch.get_num_threads()
    others = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(scenario["config"].get("compete", 0))]
    for p in others:
        p.start()
    try:
        trainer = build(scenario, settings, factory, tok, out, device, clock)
        trainer.train()
    finally:
        for p in others:
            p.terminate()
        torch.set_num_threads(threads)
    trainer.save_state()
    k = scenario["skip"]
    seconds = {"wall": statistics.fmean(clock.wall[k:]), "cpu": statistics.fmean(clock.cpu[k:]),
               "load_per_core": os.getloadavg()[0] / os.cpu_count()}
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    if keep:
        return seconds, out
    shutil.rmtree(out, ignore_errors=True)
    return seconds, None


# ------------------------------------------------------------------ scenarios
def scenarios(model: str, smoke: bool, steps: int | None = None) -> dict:
    gpu = torch.cuda.is_available()
    completion = 8 if smoke else (64 if gpu else 16)
    steps = steps or (4 if smoke else 6)
    grpo = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=4,
                max_completion_length=completion, max_steps=steps)
    out = {
        # the 16 GB recipe's 2×4 split, with its MPS-only padding
        "grpo_2x4_pad32": {"kind": "grpo", "skip": 2, "config": {**grpo, "pad_to_multiple_of": 32}},
        # a plain Trainer behind a slow dataset, and one whose loss runs the model twice
        "trainer_slow_data": {"kind": "trainer", "skip": 2, "measure": ["input_bound"], "clock": "wall",
                              "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                             max_steps=steps + 2, dataloader_num_workers=0, delay=0.1)},
        "trainer_duplicate_forward": {"kind": "trainer", "skip": 2,
                                      "measure": ["duplicate_forward"],
                                      "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                                     max_steps=steps + 2, duplicate_forward=True)},
    }
    if not gpu:
        # a collator padding every batch to 128 positions (the field report: ~28 real tokens in 128)
        out["trainer_fixed_length"] = {"kind": "trainer", "skip": 2, "measure": ["padding_waste"],
                                       "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                      max_steps=steps + 2, pad_to_length=128),
                                       "also": {"padding_waste": [("group_by_length instead", {
                                           "train_sampling_strategy": "group_by_length"})]}}
        # torch's default of one thread per core, beside a process that keeps one core busy (on top of whatever
        # else the machine runs): measured in wall time, the time the oversubscription costs
        out["trainer_threads"] = {"kind": "trainer", "skip": 2, "measure": ["oversubscription"], "clock": "wall",
                                  "config": dict(per_device_train_batch_size=16, gradient_accumulation_steps=1,
                                                 max_steps=steps + 6, threads=os.cpu_count(), compete=1)}
        # evaluation after every step (eval_steps 1) on 64 examples: its share of the wall time, measured in wall
        # time with the evaluations (the steady figures leave them out)
        out["trainer_eval_every_step"] = {"kind": "trainer", "skip": 2, "measure": ["evaluation"], "clock": "wall",
                                          "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                         max_steps=steps + 14, eval_strategy="steps", eval_steps=1,
                                                         per_device_eval_batch_size=8, eval_examples=64)}
        # TRL's SFTTrainer with a collator padding every batch to 128 positions: the advice must be code that runs
        # in SFTTrainer (its own collator), not transformers' DataCollatorForLanguageModeling
        out["sft_fixed_length"] = {"kind": "sft", "skip": 2, "measure": ["padding_waste"],
                                   "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                  max_steps=steps + 2, max_length=128, pad_to_length=128)}
        # a reward that is always 0: not speed advice; the finding's wording is what is checked
        out["grpo_constant_reward"] = {"kind": "grpo", "skip": 1, "measure": [], "wording": "no_learning",
                                       "config": {**grpo, "per_device_train_batch_size": 2,
                                                  "gradient_accumulation_steps": 1, "num_generations": 2,
                                                  "reward": "zero"}}
        # the phases a user controls (issue "every second of a run accounted for"), each measured in wall time:
        # a user's callback generating 24 tokens at every log, a checkpoint save after every step, and TRL's
        # SFTConfig with its default gradient checkpointing where memory does not need it
        out["trainer_costly_on_log"] = {"kind": "trainer", "skip": 2, "measure": ["callbacks"], "clock": "wall",
                                        "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                       max_steps=steps + 14, costly_on_log=True)}
        out["trainer_save_every_step"] = {"kind": "trainer", "skip": 2, "measure": ["saving"], "clock": "wall",
                                          "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                         max_steps=steps + 14, save_strategy="steps", save_steps=1,
                                                         save_total_limit=2)}
        out["sft_checkpointing_not_needed"] = {"kind": "sft", "skip": 2, "measure": ["recompute"], "clock": "wall",
                                               "config": dict(per_device_train_batch_size=8,
                                                              gradient_accumulation_steps=1, max_steps=steps + 6,
                                                              max_length=128)}
        # issue 51's cases, each measured in wall time: a reward with a round trip of its own per call; a user's
        # callback generating at every step (a "try" finding) beside a save after every step (a measured one: it
        # must rank second); compute_metrics taking most of an evaluation after every step; torch.compile's first
        # compile (inductor's workers are child processes: no setting, the check is what the report calls it)
        out["grpo_slow_reward"] = {"kind": "grpo", "skip": 2, "measure": ["reward"], "clock": "wall",
                                   "config": {**grpo, "max_steps": steps + 6, "reward": "round_trip"}}
        out["trainer_callback_beside_saves"] = {
            "kind": "trainer", "skip": 2, "measure": ["callbacks", "saving"], "clock": "wall", "ranks": ["callbacks",
                                                                                                       "saving"],
            "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=steps + 14,
                           costly_step_end=True, save_strategy="steps", save_steps=1, save_total_limit=2)}
        out["trainer_eval_metrics"] = {"kind": "trainer", "skip": 2, "measure": ["evaluation"], "clock": "wall",
                                       "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                      max_steps=steps + 14, eval_strategy="steps", eval_steps=1,
                                                      per_device_eval_batch_size=8, eval_examples=16,
                                                      slow_metrics=True)}
        out["trainer_compile"] = {"kind": "trainer", "skip": 2, "measure": [], "compile_check": True,
                                  "config": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                                 max_steps=steps + 6, torch_compile=True)}
    if model == "smollm2" and not gpu:   # the real model on a CPU: one prompt group of 2 per step keeps it to minutes
        small = {**grpo, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "num_generations": 2}
        out = {"grpo_2x1_pad32": {"kind": "grpo", "skip": 1, "config": {**small, "pad_to_multiple_of": 32}},
               # the instruct model's answers need far more than 8 tokens: the raised limit is applied and the
               # advised run's report read again (a quality finding: no speed gain to measure)
               "grpo_clipped_8": {"kind": "grpo", "skip": 1, "measure": [], "followup": "completion_budget",
                                  "config": {**small, "max_completion_length": 8}}}
    if smoke:
        out = {k: out[k] for k in list(out)[:2]}
    return out


#: Code fixes a setting cannot express: the scenario switch that removes the planted cause.
CODE_FIXES = {"duplicate_forward": {"duplicate_forward": False}, "padding_waste": {"pad_to_length": None}}
#: What a constant reward's finding may not advise: settings that cannot move a reward no sample has moved.
NO_HELP_FOR_CONSTANT_REWARD = ("num_generations", "temperature", "max_completion_length")


def wording(f) -> dict:
    """The wording check of a finding that is not speed advice (a constant reward)."""
    useless = sorted(k for k in f.setting if k in NO_HELP_FOR_CONSTANT_REWARD)
    first = f.recommendation.splitlines()[0]
    return {"title": f.title, "setting": f.setting, "first_action": first,
            "settings_that_cannot_help": useless,
            "names_the_cause": "partial credit" in f.recommendation and "too hard" in f.root_cause,
            "ok": not useless and "partial credit" in first and "too hard" in f.root_cause}


def followup(scenario, finding, setting, factory, tok, device) -> dict:
    """A finding that is not speed advice, applied: the advised run's report, read for the same rule. Recorded: the
    clipped share before and after, and whether the rule still asks for a larger ``max_completion_length``."""
    from hf_perf_callbacks.report import check, measurements_from_run
    from hf_perf_callbacks.report.rules.advice import CLIPPED_LARGE

    _, out = run_once(scenario, setting, factory, tok, device, keep="yes")
    after = measurements_from_run(out)
    findings, _ = check(after)
    shutil.rmtree(out, ignore_errors=True)
    again = next((f for f in findings if f.rule == finding.rule), None)
    asks_more = bool(again and (again.setting or {}).get("max_completion_length", 0) > setting.get(
        "max_completion_length", 0))
    return {"applied": setting, "clipped_after": after.clipped_ratio, "completion_mean_after": after.completion_mean,
            "terminated_mean_after": after.completion_terminated_mean, "fires_again": again is not None,
            "asks_for_more": asks_more,
            "ok": after.clipped_ratio is not None and after.clipped_ratio < CLIPPED_LARGE and not asks_more}


def measure(name, scenario, label, setting, base_sec, factory, tok, device, repeats, paired=None) -> dict:
    """Baseline and advised runs, the gain per pair. ``paired`` (a CPU with two cores or more): each pair is two
    child processes started at the same time, one per core (``taskset``), the cores swapped from one pair to the
    next, so the machine's other load hits both alike; otherwise the runs alternate in this process (the first
    baseline is the analysed one)."""
    if paired:
        return measure_paired(name, label, setting, repeats, **paired)
    which = scenario.get("clock") or ("cpu" if device == "cpu" else "wall")
    pairs, bases, advised = [], [base_sec], []
    for i in range(repeats):
        b = bases[-1] if i == 0 else run_once(scenario, {}, factory, tok, device)[0]
        if i:
            bases.append(b)
        a = run_once(scenario, setting, factory, tok, device)[0]
        advised.append(a)
        pairs.append(b[which] / a[which])
        print(f"[{name}] {label} {setting}: baseline {b}, advised {a} → {pairs[-1]:.2f}x ({which})", flush=True)
    return {"measured_gain": statistics.median(pairs), "measured_on": which, "pair_gains": pairs,
            "wall_pair_gains": [b["wall"] / a["wall"] for b, a in zip(bases, advised)],
            "cpu_pair_gains": [b["cpu"] / a["cpu"] for b, a in zip(bases, advised)],
            "baseline_step_sec": bases, "advised_step_sec": advised}


def measure_paired(name, label, setting, repeats, model, steps, smoke) -> dict:
    """Each pair: the baseline and the advised run at the same time, one per core, cores swapped every pair; the
    gain is baseline / advised wall seconds per step (both ran under the same load), the median over the pairs."""
    import subprocess

    def child(core: int, applied: dict):
        cmd = ["taskset", "-c", str(core), sys.executable, os.path.abspath(__file__), "--model", model,
               "--child", name, "--setting", json.dumps(applied)] + (["--steps", str(steps)] if steps else []) + (
                   ["--smoke"] if smoke else [])      # the child builds the same scenario as this process
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    pairs, bases, advised, loads = [], [], [], []
    for i in range(repeats):
        cores = (0, 1) if i % 2 == 0 else (1, 0)
        load = os.getloadavg()[0]
        procs = [child(cores[0], {}), child(cores[1], setting)]
        b, a = (json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs)
        bases.append(b)
        advised.append(a)
        loads.append(round(max(load, os.getloadavg()[0]), 2))
        pairs.append(b["wall"] / a["wall"])
        print(f"[{name}] {label} {setting}: baseline on core {cores[0]} {b}, advised on core {cores[1]} {a} "
              f"→ {pairs[-1]:.2f}x (wall, paired; load {loads[-1]})", flush=True)
    return {"measured_gain": statistics.median(pairs), "measured_on": "wall, paired", "pair_gains": pairs,
            "cpu_pair_gains": [b["cpu"] / a["cpu"] for b, a in zip(bases, advised)],
            "baseline_step_sec": bases, "advised_step_sec": advised, "load_avg_per_pair": loads}


def compile_check(m, findings, notes) -> dict:
    """What the report called a run's first compile: the child processes' CPU seconds outside the steady steps (the
    compile workers), the steps it blamed on other processes (none of the compile's may be among them), whether the
    warmup note names the compile."""
    blamed = sorted(set(m.contention.step_list) if m.contention else set())
    for r in [*findings, *notes]:
        if r.rule == "contention":
            blamed = sorted(set(blamed) | {s for a, b in r.steps for s in range(a, b + 1)})
    warmup = next((n for n in notes if n.rule == "warmup"), None)
    names = bool(warmup and warmup.facts.get("compile"))
    first = m.warmup_steps or 0
    return {"child_cpu_sec_outside_steady": m.warmup_child_cpu_sec, "warmup_steps": first,
            "steps_blamed_on_other_processes": blamed, "warmup_names_the_compile": names,
            "recompiles": [r.step for r in m.recompiles],
            "ok": names and not set(blamed) & set(range(1, first + 2))}


def check_scenario(name, scenario, factory, tok, device, repeats, rules=None, paired=None) -> list[dict]:
    from hf_perf_callbacks.report import check, measurements_from_run

    base_sec, base_dir = run_once(scenario, {}, factory, tok, device, keep="yes")
    before = measurements_from_run(base_dir)
    findings, notes = check(before)
    shutil.rmtree(base_dir, ignore_errors=True)
    print(f"[{name}] baseline {base_sec} s/step; findings: {[f.rule for f in findings]}; "
          f"notes: {[n.rule for n in notes]}", flush=True)
    rows = []
    if scenario.get("compile_check"):
        rows.append({"scenario": name, "rule": "compile", "measured_gain": None, "predicted_gain": None,
                     "expected_gain": None, "why_not_measured": "no setting: what the report calls the compile",
                     "compile": compile_check(before, findings, notes)})
    ranked = [f.rule for f in findings]
    if scenario.get("ranks"):
        wanted = scenario["ranks"]
        rows.append({"scenario": name, "rule": "ranking", "measured_gain": None, "predicted_gain": None,
                     "expected_gain": None, "why_not_measured": "the order of the findings",
                     "ranking": {"findings": ranked, "expected_order": wanted,
                                 "stakes": {f.rule: [f.stake_sec, f.share] for f in findings},
                                 "ok": [r for r in ranked if r in wanted] == wanted}})
    for f in findings:
        setting = (dict(f.setting) if f.setting else
                   {"threads": int(f.env["OMP_NUM_THREADS"])} if f.env.get("OMP_NUM_THREADS") else
                   dict(CODE_FIXES.get(f.rule, {})))
        row = {"scenario": name, "rule": f.rule, "title": f.title, "setting": f.setting, "env": f.env,
               "predicted_gain": f.predicted_gain, "expected_gain": f.expected_gain, "basis": f.basis,
               "lower_bound": f.lower_bound, "formula": f.gain_formula, "baseline_load_per_core":
               base_sec["load_per_core"], "rank": ranked.index(f.rule) + 1, "stake_sec": f.stake_sec,
               "share": f.share}
        if scenario.get("wording") == f.rule:
            row["wording"] = wording(f)
        if scenario.get("followup") == f.rule and setting:
            row["followup"] = {"clipped_before": before.clipped_ratio,
                               "terminated_mean_before": before.completion_terminated_mean,
                               **followup(scenario, f, setting, factory, tok, device)}
        skip = ("not speed advice" if f.rule in SKIP_RULES else "no setting to apply" if not setting else
                "needs vLLM, not installed here" if setting.get("use_vllm") and not importlib.util.find_spec("vllm")
                else
                "not measured in this scenario" if "measure" in scenario and f.rule not in scenario["measure"]
                else "not measured in this invocation (--rules)" if rules and f.rule not in rules else None)
        if skip:
            row["measured_gain"] = None
            row["why_not_measured"] = skip
            rows.append(row)
            continue
        row.update(measure(name, scenario, f.rule, setting, base_sec, factory, tok, device, repeats, paired))
        if f.predicted_gain:
            row["prediction_error"] = f.predicted_gain / row["measured_gain"] - 1
        rows.append(row)
        for label, other in scenario.get("also", {}).get(f.rule, []):   # a later bullet of the same finding
            rows.append({"scenario": name, "rule": f.rule, "title": f"{f.title} ({label})", "setting": other,
                         "predicted_gain": None, "expected_gain": None, "basis": "not advised first",
                         **measure(name, scenario, label, other, base_sec, factory, tok, device, repeats, paired)})
    if scenario.get("wording") and not any(r.get("wording") for r in rows):
        rows.append({"scenario": name, "rule": scenario["wording"], "measured_gain": None,
                     "why_not_measured": "the finding did not fire", "wording": {"ok": False}})
    return rows


def environment(device: str) -> dict:
    import transformers
    import trl

    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU"
    return {"device": name, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, choices=["tiny", "smollm2"],
                   help="tiny (CPU default) or smollm2 (the real SmolLM2-135M-Instruct; CUDA default)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: CPU time measures the work)")
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, one repeat, no result file")
    p.add_argument("--only", nargs="*", default=None, help="scenario names")
    p.add_argument("--rules", nargs="*", default=None, help="measure only these rules' advice")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6; 4 with --smoke)")
    p.add_argument("--paired", action="store_true",
                   help="CPU: measure each pair as two runs at the same time, one per core, cores swapped")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)      # one run of a paired measurement
    p.add_argument("--setting", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--results", default="advice", help="the result file's name: results/<name>_<device>.json "
                   "(advice_phases for the phase scenarios)")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(a.threads)
    model = a.model or ("smollm2" if device == "cuda" else "tiny")
    if a.smoke:
        model, a.repeats = "tiny", 1
    factory, tok = load_model(model, device)
    if a.child:                    # one run of a pair: its seconds per step as the last line of stdout
        seconds, _ = run_once(scenarios(model, a.smoke, a.steps)[a.child], json.loads(a.setting), factory, tok, device)
        print(json.dumps(seconds))
        return 0
    if a.paired and (device != "cpu" or (os.cpu_count() or 1) < 2 or not shutil.which("taskset")):
        raise SystemExit("--paired needs a CPU run on a machine with two cores or more and taskset")
    rows = []
    for name, scenario in scenarios(model, a.smoke, a.steps).items():
        if a.only and name not in a.only:
            continue
        # a scenario that sets torch's threads or starts other processes measures exactly that: not paired
        own_threads = {"threads", "compete"} & set(scenario["config"])
        paired = ({"model": model, "steps": a.steps, "smoke": a.smoke} if a.paired and not own_threads
                  else None)
        rows += check_scenario(name, scenario, factory, tok, device, a.repeats, a.rules, paired)
    print("\nrule | scenario | setting | predicted (model) | printed | measured")
    for r in rows:
        pred = f"{r['predicted_gain']:.2f}x" if r["predicted_gain"] else "-"
        shown = f"{r['expected_gain']:.2f}x" if r["expected_gain"] else "try"
        meas = f"{r['measured_gain']:.2f}x" if r.get("measured_gain") else "-"
        print(f"{r['rule']} | {r['scenario']} | {r.get('setting') or '(code fix)'} | {pred} | {shown} | {meas}")
    if a.smoke:
        return 0
    env = environment(device)
    slug = "cpu" if device == "cpu" else env["device"].lower().replace("nvidia ", "").replace(" ", "_")
    path = os.path.join(RESULTS, f"{a.results}_{slug}.json")
    try:
        with open(path, encoding="utf-8") as fh:
            previous = json.load(fh)
    except (OSError, ValueError):
        previous = {}
    runs = previous.get("runs", [])
    old = next((r for r in runs if r.get("model") == model), None)
    for row in rows:
        row["environment"] = {k: env[k] for k in ("date", "load_avg", "threads")}
    if old and a.only:            # a partial re-run replaces only its scenarios' rows; the others keep their date
        kept = [r for r in old["results"] if r["scenario"] not in a.only]
        for row in kept:
            row.setdefault("environment", {k: old["environment"].get(k) for k in ("date", "load_avg", "threads")})
        rows = kept + rows
    runs = [r for r in runs if r.get("model") != model]
    runs.append({"model": model, "environment": env, "repeats": a.repeats, "results": rows})
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "advice", "runs": runs}, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
