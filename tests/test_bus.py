"""Metrics reach a real TensorBoard reporter (read back from its event files), log_history, the console and
perf_log.jsonl; a faulty callback is disabled without stopping training."""
import glob
import inspect
import json
import os

import pytest
from transformers import TrainerCallback

from hf_perf_callbacks import ThroughputMeter, default_callbacks, keys
from hf_perf_callbacks.common.base import PerfCallback, hook
from hf_perf_callbacks.common.bus import RunBus
from hf_perf_callbacks.common.merger import is_training_log
from hf_perf_callbacks.core.runlog import CALLBACK_PREFIXES, TRAINER_LOG
from tests.conftest import make_grpo, make_trainer


def read_tensorboard_tags(output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = {}
    for path in glob.glob(os.path.join(output_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[tag] = [e.value for e in acc.Scalars(tag)]
    return tags


def test_grpo_metrics_reach_tensorboard_log_history_console_and_perf_log(tokenizer, tmp_path, capsys):
    meter = ThroughputMeter(window_steps=2, warmup_window=2, warmup_tolerance=0.5)
    trainer = make_grpo(tokenizer, tmp_path, [meter], max_steps=6, extra={"report_to": "tensorboard"})
    trainer.train()

    assert isinstance(trainer.callback_handler.callbacks[0], RunBus)      # put first, before every reporter
    tags = read_tensorboard_tags(str(tmp_path))
    for key in (keys.PERF_TOKENS_PER_SEC, keys.PERF_WARMUP_DONE, keys.PERF_STEP_TIME,
                keys.PERF_PHASE_SHARE["generation"]):
        assert f"train/{key}" in tags, sorted(tags)
    assert all(v > 0 for v in tags["train/perf/tokens_per_sec"])
    assert "train/loss" in tags                                          # the trainer's own keys are intact

    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 6
    assert all(keys.PERF_WARMUP_DONE in h for h in history)
    assert all(keys.PERF_STEP_TIME in h and keys.PERF_PHASE_SHARE["compute"] in h for h in history)
    trainer.save_state()
    saved = json.load(open(os.path.join(tmp_path, "trainer_state.json")))
    assert sum(keys.PERF_TOKENS_PER_SEC in h for h in saved["log_history"]) == 6

    out = capsys.readouterr().out
    assert "'perf/tokens_per_sec'" in out                                # PrinterCallback shows them
    assert "ThroughputMeter summary" in out and "steady tokens/s" in out

    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "perf_log.jsonl"))]
    steps = [line for line in lines if line["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s[keys.PERF_TOKENS] > 0 for s in steps)                      # GRPO generates every step here
    run = next(line for line in lines if line["type"] == "run")
    assert run["grpo"] is True and run["token_source"] == "trainer" and run["period"] == 1
    assert any(line["type"] == "event" and "MFU omitted" in line["message"] for line in lines)
    assert lines[-1]["type"] == "summary" and lines[-1]["steps"] == 6


class Exploding(PerfCallback):
    """A callback with a bug: it raises on its third step."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    @hook
    def on_step_end(self, args, state, control, **kwargs):
        self.calls += 1
        if self.calls == 3:
            raise ZeroDivisionError("planted bug")


def test_a_failing_callback_is_disabled_and_training_goes_on(tokenizer, tmp_path, caplog):
    bad, meter = Exploding(), ThroughputMeter()
    trainer = make_trainer(tokenizer, tmp_path, [bad, meter], max_steps=6)
    with caplog.at_level("WARNING", logger="hf_perf_callbacks"):
        trainer.train()
    assert trainer.state.global_step == 6
    assert bad.disabled and bad.calls == 3                               # no further events after the fault
    assert not meter.disabled and meter.timeline.steps == 6
    warnings = [r for r in caplog.records if "Exploding disabled" in r.getMessage()]
    assert len(warnings) == 1 and "ZeroDivisionError: planted bug" in warnings[0].getMessage()


def test_metrics_only_on_training_logs_not_eval_logs(tokenizer, tmp_path):
    meter = ThroughputMeter()
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=4,
                           extra={"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 4},
                           with_eval=True)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and not any(k.startswith("perf/") for h in evals for k in h)
    assert meter.timeline.phase_totals["eval"] > 0


def test_a_withdrawn_metric_does_not_reach_the_next_log():
    bus = RunBus()
    bus.merger.publish({"memory/steps_to_wall": 12.0, "memory/pressure": 1})
    bus.merger.withdraw("memory/steps_to_wall", "never/published")
    logs = {"loss": 1.0}
    bus.on_log(None, type("State", (), {"log_history": [], "global_step": 1})(), None, logs=logs)
    assert logs == {"loss": 1.0, "memory/pressure": 1}


@pytest.mark.parametrize("bad", [{"window_steps": 0}, {"warmup_window": 1}, {"warmup_tolerance": 0.0},
                                 {"max_warmup_steps": -2}, {"peak_flops": -1.0}, {"peak_flops": "fast"},
                                 {"peak_bandwidth": 0}, {"data_wait_threshold": 1.5}, {"progress_bar": "yes"}])
def test_meter_parameters_are_validated(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        ThroughputMeter(**bad)


def test_the_progress_bar_shows_current_tokens_per_second(tokenizer, tmp_path, monkeypatch):
    from transformers import trainer_callback

    shown = []
    original = trainer_callback.tqdm.set_postfix_str
    monkeypatch.setattr(trainer_callback.tqdm, "set_postfix_str",
                        lambda self, text="", refresh=True: shown.append(text) or original(self, text, refresh))
    make_trainer(tokenizer, tmp_path, [ThroughputMeter(window_steps=1)], max_steps=3,
                 extra={"disable_tqdm": False}).train()
    assert len(shown) == 3 and all(t.startswith("tok/s=") and float(t.split("=")[1]) > 0 for t in shown)


class LogRecorder(TrainerCallback):
    """Every log the trainer hands its callbacks, with the transformers method that logged it (the ground truth of
    its kind): ``evaluate``, ``_finalize_training`` (the end-of-training summary) or a training step's log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        callers = {frame.function for frame in inspect.stack()}
        kind = "eval" if "evaluate" in callers else "summary" if "_finalize_training" in callers else "train"
        self.logs.append((kind, dict(logs)))


def perf_steps(output_dir):
    return [e for e in map(json.loads, open(os.path.join(output_dir, "perf_log.jsonl"))) if e["type"] == "step"]


@pytest.mark.parametrize("counting", ["all", "non_padding"])
def test_token_counting_keeps_every_metric_and_only_training_logs_get_them(tokenizer, tmp_path, counting):
    """With ``include_num_input_tokens_seen`` on, transformers adds ``train_runtime`` and ``train_tokens_per_second``
    to every training log: those logs still get the metrics; evaluation logs and the end-of-training summary don't."""
    recorder = LogRecorder()
    trainer = make_trainer(tokenizer, tmp_path, [*default_callbacks(), recorder], max_steps=4, with_eval=True,
                           extra={"include_num_input_tokens_seen": counting, "eval_strategy": "steps",
                                  "eval_steps": 2, "per_device_eval_batch_size": 4})
    trainer.train()
    kinds = [kind for kind, _ in recorder.logs]
    assert kinds.count("train") == 4 and kinds.count("eval") == 2 and kinds[-1] == "summary", kinds
    assert all("train_runtime" in logs for kind, logs in recorder.logs if kind == "train")   # the trap
    assert [is_training_log(logs) for _, logs in recorder.logs] == [kind == "train" for kind in kinds]
    training = [h for h in trainer.state.log_history if "loss" in h]
    for prefix in ("perf/", "mem/", "tuner/"):
        assert all(any(k.startswith(prefix) for k in h) for h in training), (prefix, training)
    others = [h for h in trainer.state.log_history if "loss" not in h]
    assert len(others) == 3 and not any(k.startswith(CALLBACK_PREFIXES) for h in others for k in h)


def test_logs_of_any_evaluation_prefix_are_not_training_logs():
    assert not is_training_log({"val_loss": 1.0, "val_runtime": 0.1, "epoch": 1.0})    # metric_key_prefix="val"
    assert not is_training_log({"eval_wordle_loss": 1.0, "eval_wordle_runtime": 0.1})  # a dict of eval datasets
    assert is_training_log({"loss": 1.0, "train_runtime": 3.0, "train_tokens_per_second": 9.0})


def test_step_lines_keep_the_trainers_own_log_on_logging_steps(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, default_callbacks(), max_steps=4, extra={"logging_steps": 2})
    trainer.train()
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    lines = {line["step"]: line for line in perf_steps(tmp_path)}
    assert sorted(lines) == [1, 2, 3, 4] and sorted(history) == [2, 4]
    for step, line in lines.items():
        logged = {k.removeprefix(TRAINER_LOG): v for k, v in line.items() if k.startswith(TRAINER_LOG)}
        if step in history:
            own = {k: v for k, v in history[step].items() if k != "step" and not k.startswith(CALLBACK_PREFIXES)}
            assert logged == own and {"loss", "grad_norm", "learning_rate", "epoch"} <= set(logged)
        else:
            assert logged == {}


def test_grpo_step_lines_keep_reward_and_completion_statistics(tokenizer, tmp_path):
    trainer = make_grpo(tokenizer, tmp_path, default_callbacks(), max_steps=2, ga=1,
                        extra={"include_num_input_tokens_seen": "non_padding"})
    trainer.train()
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    lines = perf_steps(tmp_path)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        logged = history[line["step"]]
        for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/length_reward/mean",
                    "completions/mean_length", "completions/clipped_ratio", "num_input_tokens_seen"):
            assert line[TRAINER_LOG + key] == logged[key], key
        assert not any(k.startswith(TRAINER_LOG) and k.removeprefix(TRAINER_LOG).startswith(CALLBACK_PREFIXES)
                       for k in line)
        assert any(k.startswith("perf/") for k in logged)        # and the callbacks' keys reach the log


def test_a_trainer_event_without_the_visible_shell_is_refused_at_its_definition():
    """Every on_* event of a PerfCallback wears @hook, written at the method; a bare one is an error at once."""
    from hf_perf_callbacks.common.base import HOOK_MARK

    with pytest.raises(TypeError, match="Bare.on_step_end"):
        class Bare(PerfCallback):
            def on_step_end(self, args, state, control, **kwargs):
                pass

    for cls in (ThroughputMeter, PerfCallback):
        events = [name for name in dir(cls) if name.startswith("on_") and name in vars(cls)]
        assert events and all(getattr(getattr(cls, name), HOOK_MARK, False) for name in events)


def test_the_meters_run_state_is_made_at_each_train_begin(tokenizer, tmp_path):
    from hf_perf_callbacks.throughput import MeterRun

    meter = ThroughputMeter()
    assert meter.run is None                                  # __init__ holds settings and cores only
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=2)
    trainer.train()
    first = meter.run
    assert isinstance(first, MeterRun) and first.world == 1 and first.token_source == "hook"
    trainer.train()                                           # a second train() call: a run state of its own
    assert meter.run is not first and meter.timeline.steps == 2


def test_a_disabled_callback_joins_a_replayed_step_number_again_in_a_new_train_call(monkeypatch):
    """On several ranks a disabled callback stands in for the step's exchange with zeros, once a step. A re-size that
    rewinds starts a new train() call that can replay a step number this rank already joined: it joins again there,
    or the other ranks would wait for it until the collective timeout (world size and the exchange are planted: no
    process group on this machine's CPU tests)."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_perf_callbacks import MemoryWatchdog
    from hf_perf_callbacks.common import base

    joined = []
    monkeypatch.setattr(base, "world_size", lambda: 2)
    monkeypatch.setattr(MemoryWatchdog, "neutral_exchange", lambda self, step: joined.append(step))
    watchdog = MemoryWatchdog()
    watchdog.disabled = True
    args, control = TrainingArguments(output_dir="unused", report_to=[]), TrainerControl()
    # the first call ends at step 5 (an OOM there: its end seen twice, one stand-in); the second resumes from 4
    for steps in ((5, 5), (5, 6)):
        state = TrainerState(global_step=4)
        watchdog.on_train_begin(args, state, control)
        for step in steps:
            state.global_step = step
            watchdog.on_step_end(args, state, control)
    assert joined == [5, 5, 6]
