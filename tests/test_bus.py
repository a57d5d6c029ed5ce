"""Metrics reach a real TensorBoard reporter (read back from its event files), log_history, the console and
perf_log.jsonl; a faulty callback is disabled without stopping training."""
import glob
import json
import os

import pytest

from hf_perf_callbacks import ThroughputMeter
from hf_perf_callbacks.base import PerfCallback
from hf_perf_callbacks.bus import RunBus
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
    for key in ("perf/tokens_per_sec", "perf/warmup_done", "perf/step_time", "perf/phase/generation"):
        assert f"train/{key}" in tags, sorted(tags)
    assert all(v > 0 for v in tags["train/perf/tokens_per_sec"])
    assert "train/loss" in tags                                          # the trainer's own keys are intact

    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 6
    assert all("perf/warmup_done" in h for h in history)
    assert all("perf/step_time" in h and "perf/phase/compute" in h for h in history)
    trainer.save_state()
    saved = json.load(open(os.path.join(tmp_path, "trainer_state.json")))
    assert sum("perf/tokens_per_sec" in h for h in saved["log_history"]) == 6

    out = capsys.readouterr().out
    assert "'perf/tokens_per_sec'" in out                                # PrinterCallback shows them
    assert "ThroughputMeter summary" in out and "steady tokens/s" in out

    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "perf_log.jsonl"))]
    steps = [line for line in lines if line["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s["perf/tokens"] > 0 for s in steps)                      # GRPO generates every step here
    run = next(line for line in lines if line["type"] == "run")
    assert run["grpo"] is True and run["token_source"] == "trainer" and run["period"] == 1
    assert any(line["type"] == "event" and "MFU omitted" in line["message"] for line in lines)
    assert lines[-1]["type"] == "summary" and lines[-1]["steps"] == 6


class Exploding(PerfCallback):
    """A callback with a bug: it raises on its third step."""

    def __init__(self):
        super().__init__()
        self.calls = 0

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
    bus.publish({"memory/steps_to_wall": 12.0, "memory/pressure": 1})
    bus.withdraw("memory/steps_to_wall", "never/published")
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
