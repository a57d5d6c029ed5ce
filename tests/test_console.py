"""The console a person reads: the callbacks' keys reach the reporters and ``log_history`` while the printed log line
keeps the trainer's keys plus a few of ours; one line per event of at most ``CONSOLE_WIDTH`` characters; each
decision printed once; no warning the package provokes shown twice; errors of bad arguments name the valid ones."""
from __future__ import annotations

import ast
import collections
import contextlib
import io
import logging
import os
import re
import warnings

import pytest
from transformers import TrainerCallback

from hf_perf_callbacks import keys
from hf_perf_callbacks.common.console import console_line, console_logs
from hf_perf_callbacks.core.wording import wrapped

from .conftest import make_grpo, make_trainer

PACKAGE_LOGGER = "hf_perf_callbacks"


class Integration(TrainerCallback):
    """Stands for a ``report_to`` integration (TensorBoard, W&B…): keeps every training log it receives."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            self.logs.append(dict(logs))


@contextlib.contextmanager
def console(level=logging.INFO):
    """Everything a run shows a person: stdout, stderr, the package's log records (formatted as ``hf-perf train``
    formats them) and the warnings, each warning recorded every time it is raised."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger(PACKAGE_LOGGER)
    before = package.level
    package.addHandler(handler)
    package.setLevel(level)
    seen: dict = {"out": out, "err": err}
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            seen["warnings"] = caught
            yield seen
    finally:
        package.removeHandler(handler)
        package.setLevel(before)


def printed_logs(text: str) -> list[dict]:
    return [ast.literal_eval(m) for m in re.findall(r"\{'loss'.*?\}", text)]


def ours(shown: dict) -> str:
    """The part of a printed log line that this package added (its keys as the printer renders them)."""
    return ", ".join(f"{k!r}: {v!r}" for k, v in shown.items() if k.startswith(keys.CALLBACK_PREFIXES))


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_printed_log_line_is_short_while_the_reporters_get_every_key(tokenizer, tmp_path, one_thread,
                                                                         disable_tqdm):
    from hf_perf_callbacks import default_callbacks

    integration = Integration()
    trainer = make_trainer(tokenizer, tmp_path, [integration, *default_callbacks()], max_steps=3, bs=2, ga=1,
                           extra={"disable_tqdm": disable_tqdm})
    with console() as seen:
        trainer.train()
    shown = printed_logs(seen["out"].getvalue() + seen["err"].getvalue())
    assert len(shown) == len(integration.logs) == 3
    for line, received in zip(shown, integration.logs):
        callbacks = {k for k in received if k.startswith(keys.CALLBACK_PREFIXES)}
        assert len(callbacks - set(keys.CONSOLE_KEYS)) >= 10             # the reporter got the full set
        assert {k for k in line if k.startswith(keys.CALLBACK_PREFIXES)} == callbacks & set(keys.CONSOLE_KEYS)
        assert {"loss", "grad_norm", "learning_rate"} <= set(line)       # the trainer's own keys stay
        assert len(ours(line)) <= keys.CONSOLE_WIDTH
        assert {type(v) for v in line.values()} == {str}, line           # every number shown alike
    assert _long_lines(seen["out"].getvalue() + "\n" + seen["err"].getvalue()) == []
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all(set(received) <= set(h) for received, h in zip(integration.logs, history))


def test_console_logs_keeps_the_trainers_keys_and_the_headline_keys():
    logs = {"loss": 0.5, "reward": 1.0, keys.PERF_TOKENS_PER_SEC: 900.0, keys.PERF_PHASE_SHARE["generation"]: 0.5,
            keys.MEM_PRESSURE: 0, keys.TUNER_MICRO_BATCH: 2, keys.CACHE_CLEARS: 0}
    shown = console_logs(logs)
    assert shown == {"loss": 0.5, "reward": 1.0, keys.PERF_TOKENS_PER_SEC: 900.0, keys.TUNER_MICRO_BATCH: 2.0}
    assert isinstance(shown[keys.TUNER_MICRO_BATCH], float)       # printed as the printers print floats: '2'
    assert len(logs) == 7 and logs[keys.TUNER_MICRO_BATCH] == 2 and isinstance(logs[keys.TUNER_MICRO_BATCH], int)


@pytest.mark.parametrize("text", ["short", "a: " + "b" * 300, "x" * 400, "first part; " * 40, "one\ntwo",
                                  "clause one: " + "word " * 60])
def test_an_event_is_one_line_within_the_width(text):
    line = console_line(text, 120)
    assert "\n" not in line and len(line) <= 120
    assert line == text or line.endswith(" …")
    assert text.startswith(line.removesuffix(" …")[:10])


@pytest.mark.parametrize("text", ["short", "a; " * 100, "x" * 400, "word " * 90, "clause, " * 50])
def test_a_summary_line_wider_than_the_console_goes_on_over_indented_lines(text):
    lines = wrapped(text, 120).splitlines()
    assert all(len(line) <= 120 for line in lines) and all(line.startswith("    ") for line in lines[1:])
    assert "".join(line.strip() for line in lines).replace(" ", "") == text.replace(" ", "")   # nothing left out


def _long_lines(text: str) -> list[str]:
    lines = [seg for line in text.splitlines() for seg in line.split("\r")]
    return [line for line in lines if len(line) > keys.CONSOLE_WIDTH and not line.lstrip().startswith("{")
            and "it/s" not in line]


def _warning_counts(caught) -> collections.Counter:
    return collections.Counter((w.category.__name__, str(w.message)) for w in caught)


def test_a_ten_step_grpo_run_prints_short_lines_and_no_warning_it_provokes_twice(tokenizer, tmp_path, one_thread):
    """A real 10-step GRPO run with the package's callbacks: no line of this package over ``CONSOLE_WIDTH``, the
    log lines' additions within it, and no warning shown more often than the same run without the callbacks shows
    it, unless once (what the package provokes is shown at most once)."""
    from hf_perf_callbacks import default_callbacks

    with console() as bare:
        make_grpo(tokenizer, tmp_path / "bare", [], max_steps=10, bs=4, ga=1).train()
    with console() as seen:
        trainer = make_grpo(tokenizer, tmp_path / "run", default_callbacks(), max_steps=10, bs=4, ga=1,
                            extra={"disable_tqdm": False})
        trainer.train()
    text = seen["out"].getvalue() + "\n" + seen["err"].getvalue()
    assert _long_lines(text) == []
    shown = printed_logs(text)
    assert len(shown) == 10 and all(len(ours(line)) <= keys.CONSOLE_WIDTH for line in shown)
    assert all(keys.PERF_TOKENS_PER_SEC in line for line in shown)
    with_callbacks, without = _warning_counts(seen["warnings"]), _warning_counts(bare["warnings"])
    provoked = {w: n for w, n in with_callbacks.items() if n > without.get(w, 0)}
    assert all(n == 1 for n in provoked.values()), provoked
    # the summaries start on lines of their own (not glued to the progress bar)
    assert re.search(r"(^|\n)== ThroughputMeter summary ==", seen["out"].getvalue())


def test_a_meter_only_user_of_plain_train_gets_no_tuner_notice_on_the_console(tokenizer, tmp_path, one_thread):
    """``default_callbacks()`` under a plain ``trainer.train()``: the tuner's notes (it needs train_with_tuning; some
    splits are not exact under left padding) go to the perf log, not to the console as warnings."""
    from hf_perf_callbacks import default_callbacks
    from hf_perf_callbacks.core.runlog import read_run

    trainer = make_trainer(tokenizer, tmp_path, default_callbacks(), max_steps=2, bs=2, ga=1, padding_side="left")
    with console(logging.WARNING) as seen:
        trainer.train()
    warned = [line for line in seen["err"].getvalue().splitlines() if "[tuner]" in line]
    assert warned == []
    tuner_events = [e for e in read_run(tmp_path).events if e.source == "tuner"]
    assert [e.kind for e in tuner_events if e.details.get("needs") == "train_with_tuning"] == ["note"]
    assert len(tuner_events) == 2 and all(e.kind == "note" for e in tuner_events)   # and the left padding's


def test_each_tuning_decision_is_printed_once(tokenizer, tmp_path, one_thread):
    """Under ``train_with_tuning`` with the launcher's log level (INFO): the tuning decision is one console line,
    not repeated by the summary."""
    from hf_perf_callbacks import default_callbacks, train_with_tuning
    from hf_perf_callbacks.core.runlog import read_run

    trainer = make_trainer(tokenizer, tmp_path, default_callbacks(), max_steps=20, bs=4, ga=2)
    with console() as seen:
        train_with_tuning(trainer)
    decisions = [e for e in read_run(tmp_path).events if e.source == "tuner" and e.kind == "decision"]
    assert decisions
    text = seen["out"].getvalue() + seen["err"].getvalue()
    for decision in decisions:
        head = console_line(f"[tuner] {decision.message}")[:60]
        assert text.count(head) == 1
    assert _long_lines(text) == []


def test_the_memory_wall_moving_is_said_once_at_info(tmp_path):
    """A move of the memory wall needs no action: INFO, said once on the console (every move in the perf log)."""
    from hf_perf_callbacks.common.bus import RunBus
    from hf_perf_callbacks.core.runlog import read_run

    bus = RunBus()
    bus.log.output_dir = str(tmp_path)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.DEBUG)
    package = logging.getLogger(PACKAGE_LOGGER)
    before = package.level
    package.addHandler(handler)
    package.setLevel(logging.DEBUG)
    try:
        for step in (3, 5, 8):
            bus.log.event("mem", "wall", f"the memory wall moved: the budget is now {10 - step} GiB", step=step)
        bus.log.flush()
    finally:
        package.removeHandler(handler)
        package.setLevel(before)
    levels = [r.levelno for r in records if "[mem]" in r.getMessage()]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG]
    assert [e.step for e in read_run(tmp_path).events if e.kind == "wall"] == [3, 5, 8]


@pytest.mark.parametrize("value", ["calibrated", "Calibrate", "auto", -1.0, float("nan")])
def test_a_bad_peak_flops_names_the_valid_choices(value):
    from hf_perf_callbacks import ThroughputMeter
    from hf_perf_callbacks.core.validation import closest, did_you_mean

    with pytest.raises(ValueError, match="'calibrate'") as refused:
        ThroughputMeter(peak_flops=value)
    assert f"peak_flops={value!r}" in str(refused.value)
    if value in ("calibrated", "Calibrate"):
        assert closest(value, ["calibrate"]) == "calibrate" and did_you_mean(value, ["calibrate"]) in str(refused.value)


@pytest.mark.parametrize("make, typo, meant", [
    ("ThroughputMeter", "peak_flop", "peak_flops"),
    ("MemoryWatchdog", "limit_g", "limit_gb"),
    ("AdaptiveBatchTuner", "tunes", "tune"),
    ("MPSCacheClearer", "interval_step", "interval_steps"),
])
def test_a_typod_callback_keyword_gets_the_closest_one(make, typo, meant):
    import hf_perf_callbacks

    cls = getattr(hf_perf_callbacks, make)
    for caught in (TypeError, ValueError):                   # either way a caller catches it
        with pytest.raises(caught) as refused:
            cls(**{typo: 1})
        said = str(refused.value)
        assert f"did you mean {meant!r}" in said and f"{typo!r}" in said and meant in said.split("allowed")[-1]


def test_train_with_tuning_and_default_callbacks_suggest_the_closest_keyword():
    from hf_perf_callbacks import default_callbacks, train_with_tuning

    with pytest.raises(TypeError, match="did you mean 'tune'"):
        train_with_tuning(None, tunes=False)
    with pytest.raises(ValueError, match="did you mean 'ThroughputMeter'"):
        default_callbacks(ThroughputMetre={})


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_a_short_run_gets_a_provisional_rate_marked_as_such(tokenizer, tmp_path, one_thread, steps):
    """A run too short for steady figures (warmup not decided) reports the rate of the steps it has, flagged
    ``provisional``, in the meter's summary, the perf log and the report's figures, instead of no rate."""
    from hf_perf_callbacks import ThroughputMeter
    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.report.figures import figures

    meter = ThroughputMeter(warmup_window=6)                    # 5 steps cannot decide a warmup of this window
    trainer = make_trainer(tokenizer, tmp_path, [meter], max_steps=steps, bs=2, ga=1)
    trainer.train()
    s = meter.summary
    assert s["steady_tokens_per_sec"] is None and s["provisional"] is True
    assert s["provisional_tokens_per_sec"] > 0 and s["provisional_step_sec"] > 0
    assert s["provisional_steps"] == [min(2, steps), steps]     # the first step left out when there are others
    assert all(len(line) <= keys.CONSOLE_WIDTH for line in meter.format_summary().splitlines())
    f = figures(read_run(tmp_path))
    assert f.provisional_tokens_per_sec == pytest.approx(s["provisional_tokens_per_sec"])
    assert f.provisional_steps == s["provisional_steps"]


def test_a_run_with_steady_figures_has_no_provisional_rate(tokenizer, tmp_path, one_thread):
    from hf_perf_callbacks import ThroughputMeter

    meter = ThroughputMeter(warmup_window=2, max_warmup_steps=2)
    make_trainer(tokenizer, tmp_path, [meter], max_steps=8, bs=2, ga=1).train()
    assert meter.summary["steady_tokens_per_sec"] is not None and "provisional" not in meter.summary


def test_a_resize_in_process_is_not_called_a_resume_and_a_resume_is(tokenizer, tmp_path, one_thread):
    """train_with_tuning re-sizes in process after an out-of-memory error: the later ``train()`` call's header is
    marked ``resize`` and the report says no "resumed"; a user's own resume of the run still is one."""
    from hf_perf_callbacks import AdaptiveBatchTuner, ThroughputMeter, train_with_tuning
    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.report.summary import summarize

    from .faults import Fault

    fault = Fault("forward", at=2)
    trainer = fault.attach(make_trainer(tokenizer, tmp_path, [fault, ThroughputMeter(), AdaptiveBatchTuner(tune=False)],
                                        max_steps=3, bs=4, ga=2))
    train_with_tuning(trainer)
    assert fault.fired == 1
    run = read_run(tmp_path)
    perf_headers = [h for h in run.headers if "perf" in h.sources]
    assert len(perf_headers) == 2 and [bool(h.resize) for h in perf_headers] == [False, True]
    assert not any(line.startswith("resumed:") for line in summarize(run).splitlines())

    checkpoints = sorted((p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")),
                         key=lambda p: int(p.split("-")[1]))
    assert checkpoints                                   # the re-size saved one
    resumed = make_trainer(tokenizer, tmp_path, [ThroughputMeter()], max_steps=4,   # a user's resume, one step more
                           bs=trainer.args.per_device_train_batch_size, ga=trainer.args.gradient_accumulation_steps)
    resumed.train(resume_from_checkpoint=str(tmp_path / checkpoints[-1]))
    headers = [h for h in read_run(tmp_path).headers if "perf" in h.sources]
    assert headers[-1].resumed_from_step > 0 and not headers[-1].resize
    assert any(line.startswith("resumed:") for line in summarize(read_run(tmp_path)).splitlines())


def test_the_tuner_plot_is_not_said_to_lack_a_tuner_when_the_events_hold_its_decisions(tmp_path):
    from hf_perf_callbacks.core.runlog import read_run
    from hf_perf_callbacks.report.figures import figures
    from hf_perf_callbacks.report.plots import PlotData, plot_tuner, tuner_missing

    from .conftest import schema_lines

    lines = schema_lines([{"type": "run", "session": "s", "sources": ["perf"]},
                          {"type": "event", "source": "tuner", "kind": "decision", "step": 5, "time": 1.0,
                           "message": "tuning at step 5: kept 4×2 (no split saves time)"}])
    (tmp_path / "perf_log.jsonl").write_text(lines)
    run = read_run(tmp_path)
    data = PlotData(run, run.unique_steps(), figures(run), None)
    assert tuner_missing(data) == ("record_missing", 1)          # a tuner was attached: its record is missing
    assert plot_tuner(None, data) is not None


def test_the_console_printers_are_looked_up_without_importing_again_at_every_log(tokenizer, tmp_path, one_thread,
                                                                                 monkeypatch):
    """Without IPython, importing transformers' notebook printer fails, and a failed import runs the module again at
    every attempt: the printers' classes are looked up once, not at each training log."""
    import importlib.abc
    import sys

    from hf_perf_callbacks import default_callbacks
    from hf_perf_callbacks.platform import adapter

    attempts = []

    class Counting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "transformers.utils.notebook":
                attempts.append(name)
            return None                                  # the next finders find it

    monkeypatch.setitem(sys.modules, "IPython", None)    # `import IPython.display` raises ImportError
    monkeypatch.delitem(sys.modules, "transformers.utils.notebook", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Counting(), *sys.meta_path])
    adapter._printer_kinds.cache_clear()
    trainer = make_trainer(tokenizer, tmp_path, default_callbacks(), max_steps=4, bs=2, ga=1)
    with console():
        trainer.train()
    adapter._printer_kinds.cache_clear()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 4
    assert len(attempts) == 1


def test_a_plain_trainer_logs_no_generation_phase_and_the_phases_in_percent(tokenizer, tmp_path, one_thread):
    """``perf/phase/<phase>`` is in % as the console's time split says it (shares that add up to 100), and
    ``generation`` only for a trainer that generates (GRPO: tests/test_bus.py)."""
    from hf_perf_callbacks import ThroughputMeter

    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter()], max_steps=3, bs=2, ga=1)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for log in logged:
        shares = {k: v for k, v in log.items() if k.startswith("perf/phase/")}
        assert keys.PERF_PHASE_SHARE["generation"] not in shares and keys.PERF_PHASE_SHARE["compute"] in shares
        assert sum(shares.values()) == pytest.approx(100.0, abs=0.5) and max(shares.values()) <= 100.0


def test_a_line_beside_the_progress_bar_is_out_before_the_bar_is_drawn_again(monkeypatch):
    """Console.say with a progress bar: the bars cleared, the text written and flushed, then the bars drawn again
    (stdout and the bar's stderr apart: a text still in stdout's buffer would come out glued to a later bar)."""
    import sys

    from hf_perf_callbacks.common.console import Console
    from hf_perf_callbacks.platform import adapter

    events = []

    class Bar:
        @classmethod
        @contextlib.contextmanager
        def external_write_mode(cls, file=None, nolock=False):
            events.append("clear")
            yield
            events.append("draw")

    class Stdout(io.StringIO):
        def write(self, text):
            events.append(("write", text))
            return super().write(text)

        def flush(self):
            events.append("flush")

    monkeypatch.setattr(adapter, "progress_bars", lambda handler: [Bar()])
    monkeypatch.setattr(sys, "stdout", Stdout())
    Console().say("summary")
    assert events[0] == "clear" and events[-1] == "draw"
    assert ("write", "summary") in events and events.index("flush") < events.index("draw")


@pytest.mark.parametrize("built", ["default_callbacks", "class"])
def test_the_mfu_hint_is_worded_as_the_callbacks_were_written(built, tokenizer, tmp_path, one_thread, caplog):
    """No peak FLOP/s for this CPU: the hint names the argument in the form the user wrote the callbacks in
    (``default_callbacks(...)`` or the class; the recipe launcher's ``callback_kwargs:``: tests/test_recipes.py)."""
    from hf_perf_callbacks import ThroughputMeter, default_callbacks
    from hf_perf_callbacks.core.wording import argument_hint

    callbacks = default_callbacks()[:1] if built == "default_callbacks" else [ThroughputMeter()]
    with caplog.at_level(logging.WARNING, PACKAGE_LOGGER):
        make_trainer(tokenizer, tmp_path, callbacks, max_steps=1, bs=2, ga=1).train()
    (line,) = [r.getMessage() for r in caplog.records if "MFU omitted" in r.getMessage()]
    expected = ('default_callbacks(ThroughputMeter={"peak_flops": "calibrate"})' if built == "default_callbacks"
                else 'ThroughputMeter(peak_flops="calibrate")')
    assert expected in line
    from hf_perf_callbacks.core.runlog import HF_PERF_TRAIN

    assert argument_hint("ThroughputMeter", "peak_flops", "calibrate", HF_PERF_TRAIN) == \
        "callback_kwargs: {ThroughputMeter: {peak_flops: calibrate}}"
