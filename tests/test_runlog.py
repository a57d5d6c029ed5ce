"""The run log: typed records, the one reader (fresh runs, resumes, older logs, stray lines) and the writer (one
header per train() call written by the bus, a failed write warned once) — on synthetic lines and real trainers."""
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from hf_perf_callbacks import keys
from hf_perf_callbacks.core import runlog
from hf_perf_callbacks.core.runlog import (
    PERF_LOG,
    EventLine,
    LogWriter,
    RunHeader,
    StepLine,
    SummaryLine,
    parse_lines,
    parse_record,
    read_run,
)
from hf_perf_callbacks.report import summarize


def lines(*entries):
    return [json.dumps(e) for e in entries]


def header(session, resumed=0, **facts):
    return {"type": "run", "session": session, "resumed_from_step": resumed, "sources": ["perf"], **facts}


def step(n, **values):
    return {"type": "step", "step": n, "time": 1000.0 + n, **values}


def event(n, message="note", source="perf"):
    return {"type": "event", "source": source, "kind": "warning", "step": n, "message": message, "time": 1.0}


def test_records_round_trip_through_their_json():
    records = [RunHeader(session="s1", resumed_from_step=4, sources=["perf", "mem"], device="cpu", budget_gb=8.0,
                         model={"hidden_size": 64}, extra={"new_fact": 1}),
               EventLine("mem", "action", "cleared", 5, 1.0, {"action": "clear_cache"}),
               SummaryLine("cache", {"clears": 2})]
    for record in records:
        assert parse_record(json.loads(json.dumps(record.to_json()))) == record
    read = parse_lines([json.dumps(StepLine(5, 1000.5, {keys.PERF_TOKENS: 10.0, keys.MEM_PRESSURE: 0}).to_json())])
    assert (read.steps[0].step, read.steps[0].time, dict(read.steps[0].values)) == (
        5, 1000.5, {keys.PERF_TOKENS: 10.0, keys.MEM_PRESSURE: 0})
    assert parse_record({"type": "step", "step": 1}) is None and parse_record({"type": "other"}) is None
    assert parse_record([1, 2]) is None


def test_a_header_rejects_an_unknown_fact_by_name():
    with pytest.raises(ValueError, match=r"\['devcie'\].*'perf'.*device"):
        RunHeader().describe("perf", devcie="cpu")


def test_a_fresh_session_at_step_0_replaces_earlier_lines_and_a_resume_keeps_them():
    text = lines(header("a"), step(1), step(2), event(2),
                 header("a", resumed=2), step(3),                 # the same process re-sized: a resume
                 header("b", resumed=3), step(4),                 # a new process resumed from a checkpoint
                 header("c"), step(1, **{keys.PERF_TOKENS: 5.0}))    # a new process started afresh
    run = parse_lines(text)
    assert run.replaced_runs == 1
    assert [s.step for s in run.steps] == [1] and run.steps[0].number(keys.PERF_TOKENS) == 5.0
    assert [h.session for h in run.headers] == ["c"] and run.events == []
    kept = parse_lines(text[:8])
    assert kept.replaced_runs == 0 and [s.step for s in kept.steps] == [1, 2, 3, 4]
    assert [h.resumed_from_step for h in kept.headers] == [0, 2, 3] and len(kept.events) == 1


def test_an_event_before_the_first_header_is_kept_and_is_no_earlier_run():
    """Logs written before the bus held events until the header began with the meter's "MFU omitted" warning."""
    warning = "MFU omitted"
    run = parse_lines(lines(event(None, warning), header("a"), step(1), step(2)))
    assert run.replaced_runs == 0                                   # what the summary's "earlier run(s)" counts
    assert [e.message for e in run.events] == [warning] and [s.step for s in run.steps] == [1, 2]
    assert warning in summarize(run)


def test_summaries_count_after_the_last_header_only_and_garbled_lines_are_counted():
    text = lines(header("a"), step(1), {"type": "summary", "source": "perf", "steps": 1}, header("a", resumed=1),
                 step(2)) + ["{not json", '{"type": "step", "step": "x"}', "[]"]
    run = parse_lines(text)
    assert run.summaries == {} and run.summary("perf") == {} and run.skipped_lines == 3


def test_the_writer_warns_once_and_training_goes_on(tmp_path, caplog):
    writer = LogWriter()
    (tmp_path / PERF_LOG).mkdir()                        # the log path cannot be opened for appending
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        assert not writer.append(str(tmp_path), StepLine(1))
        assert not writer.append(str(tmp_path), StepLine(2))
    assert sum(PERF_LOG in r.getMessage() for r in caplog.records) == 1            # warned once
    assert not writer.append(None, StepLine(3))


def test_an_unwritable_log_warns_once_over_a_whole_run(tokenizer, tmp_path, caplog):
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter
    from tests.conftest import make_trainer

    os.makedirs(tmp_path / PERF_LOG)
    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), MemoryWatchdog()], max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_perf_callbacks"):
        trainer.train()
    assert trainer.state.global_step == 4
    assert sum(PERF_LOG in r.getMessage() for r in caplog.records) == 1            # warned once


def test_the_bus_writes_one_header_per_train_call_before_any_other_line(tokenizer, tmp_path):
    """The meter and the watchdog hand their facts to the bus; the meter's "MFU omitted" warning (raised while it
    begins, before any step) follows the header instead of preceding it."""
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter
    from tests.conftest import make_trainer

    trainer = make_trainer(tokenizer, tmp_path, [ThroughputMeter(), MemoryWatchdog(warn_within_steps=12)], max_steps=3)
    trainer.train()
    entries = [json.loads(line) for line in open(tmp_path / PERF_LOG)]
    headers = [e for e in entries if e["type"] == "run"]
    assert len(headers) == 1 and entries[0] is headers[0]
    bus = trainer.callback_handler.callbacks[0]
    assert headers[0]["session"] == bus.log.session and headers[0]["resumed_from_step"] == 0
    assert headers[0]["sources"] == ["perf", "mem"]
    assert headers[0]["device_type"] == "cpu" and headers[0]["budget_gb"] > 0
    assert headers[0]["warn_within_steps"] == 12                      # the run's own warn distance, for the report
    assert entries[1]["type"] == "event" and "MFU omitted" in entries[1]["message"]
    run = read_run(tmp_path)
    assert run.replaced_runs == 0 and [s.step for s in run.steps] == [1, 2, 3]
    assert len([e for e in run.events if e.kind != "wall"]) == 1     # a wall move follows other processes' memory


def test_read_run_parses_a_real_log(demo_run):
    run = read_run(demo_run)
    assert run.skipped_lines == 0
    assert [s.step for s in run.steps] == list(range(1, 7))
    assert {"perf", "mem", "cache"} <= set(run.summaries)
    assert {"perf", "mem"} <= {source for h in run.headers for source in h.sources}
    assert any(s.get(keys.TRAINER_LOG + "completions/mean_length") is not None for s in run.steps)


def test_a_fresh_run_in_a_reused_output_dir_replaces_the_earlier_one_but_a_resume_does_not(tokenizer, tmp_path):
    """HF's default output_dir is shared by every run: a fresh run must not inherit the previous run's step lines
    (a shorter run would show the longer one's tail), while a resume in a new trainer keeps the history."""
    from hf_perf_callbacks import MemoryWatchdog, ThroughputMeter
    from tests.conftest import make_trainer

    def train(max_steps, resume=None):
        trainer = make_trainer(tokenizer, tmp_path, [MemoryWatchdog(), ThroughputMeter()], max_steps=max_steps,
                               extra={"save_strategy": "steps", "save_steps": 2})
        trainer.train(resume_from_checkpoint=resume)

    train(6)
    train(3)                                                   # a new trainer, a fresh run, the same output_dir
    run = read_run(tmp_path)
    assert [s.step for s in run.steps] == [1, 2, 3] and run.replaced_runs == 1
    assert len(run.headers) == 1 and run.headers[0].sources == ["mem", "perf"]
    assert [e.message for e in run.events if "MFU omitted" in e.message]     # the fresh run's own warning is kept
    assert "also holds 1 earlier run(s)" in summarize(run)
    train(5, resume=str(tmp_path / "checkpoint-2"))            # a resume: history kept, step 3 re-run
    run = read_run(tmp_path)
    assert [s.step for s in run.steps] == [1, 2, 3, 3, 4, 5] and run.replaced_runs == 1
    assert [h.resumed_from_step for h in run.headers] == [0, 2]


def test_every_documented_key_is_a_constant_of_the_run_log():
    """The callbacks' docstring key tables name only keys the run log defines."""
    from hf_perf_callbacks import cache, throughput, watchdog

    constants = {v for k, v in vars(runlog).items() if k.isupper() and isinstance(v, str) and "/" in v}
    constants |= set(runlog.PERF_PHASE_SHARE.values()) | set(runlog.PERF_PHASE_SEC.values())
    for cls in (throughput.ThroughputMeter, watchdog.MemoryWatchdog, cache.MPSCacheClearer):
        documented = set(re.findall(r"``((?:perf|mem|cache)/[a-z_/]+[a-z])``", cls.__doc__))
        assert len(documented) >= 4 and documented <= constants, documented - constants


def test_report_and_analysis_are_siblings_over_pure_modules():
    """Neither imports the other; the run log and the figures they share import neither torch nor transformers."""
    import ast

    import hf_perf_callbacks

    def imports(name):
        path = os.path.join(os.path.dirname(hf_perf_callbacks.__file__), f"{name}.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found |= {node.module or ""} | {f"{node.module or ''}.{a.name}".lstrip(".") for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        return found

    rules = [f"report/rules/{os.path.splitext(n)[0]}" for n in os.listdir(
        os.path.join(os.path.dirname(hf_perf_callbacks.__file__), "report", "rules")) if n.endswith(".py")]
    analysis = ["report/model", "report/reading", "report/render", *rules]
    assert not any(m.split(".")[-1] in ("reading", "render", "rules", "model") for m in imports("report/summary"))
    assert not any(m.split(".")[-1] in ("summary", "plots") for a in analysis for m in imports(a))
    for pure in ("core/runlog", "report/figures", "report/summary", "report/plots", "core/wording", "core/validation",
                 *analysis):
        assert not any(m.split(".")[0] in ("torch", "transformers") for m in imports(pure)), pure
    # the live meter shares words with the report through the pure wording module, not by importing the report's
    assert not any(m.rsplit(".", 1)[-1] in ("figures", "report", "plots") for m in imports("throughput"))
    assert "core.wording" in imports("throughput")


def test_hf_perf_report_never_imports_torch(demo_run):
    """`hf-perf report DIR` (summary, plots, the analysis) on a real run, in a fresh process: torch and
    transformers are never imported."""
    code = ("import sys; from hf_perf_callbacks.cli import main; rc = main(['report', sys.argv[1]]); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
            "print('rc', rc, 'heavy', heavy[:5])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, demo_run], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root, "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "analysis: " in proc.stdout and os.path.exists(os.path.join(demo_run, "perf_report.md"))
    assert proc.stdout.rstrip().endswith("rc 0 heavy []"), proc.stdout[-2000:]


def test_every_event_gets_a_step():
    """An event logged without a step (before the first step, or by a writer that left it out) reads with the step
    of the step line before it (the session's start step before any): no reader prints "step ?"."""
    text = lines(header("a"), {"type": "event", "source": "perf", "kind": "warning", "message": "MFU omitted"},
                 step(1), step(2), {"type": "event", "source": "mem", "kind": "action", "step": "3?", "message": "x"},
                 header("a", resumed=2), {"type": "event", "source": "tuner", "kind": "decision", "message": "y"})
    run = parse_lines(text)
    assert [e.step for e in run.events] == [0, 2, 2] and all(e.step_inferred for e in run.events)
    assert "step ?" not in summarize(run)


@pytest.mark.parametrize("field, value", [("world_size", "2"), ("per_device_train_batch_size", 4.5),
                                          ("grpo", "yes"), ("model", [1, 2]), ("dataloader", "none"),
                                          ("temperature", True), ("device_type", 3), ("budget_gb", "8 GB")])
def test_a_header_field_of_another_type_reads_as_unset_and_is_kept_aside(field, value):
    h = RunHeader.from_json(header("s", **{field: value}))
    assert getattr(h, field) in (None, {}) and h.malformed == {field: value}
    assert RunHeader.from_json(header("s", world_size=2.0, grpo=1)).world_size == 2    # 2.0 is an integer


def test_the_writer_ends_a_line_a_killed_process_cut_short_before_appending(tmp_path):
    """A process killed while writing a line leaves it without its end: the next record (a resume's run header)
    starts a line of its own, and the reader reads it (the cut line counted as unreadable)."""
    from hf_perf_callbacks.core.runlog import PERF_LOG, LogWriter, RunHeader, StepLine

    writer = LogWriter()
    writer.append(str(tmp_path), RunHeader(session="s1", resumed_from_step=0))
    writer.append(str(tmp_path), StepLine(1, 1.0, {keys.PERF_STEP_TIME: 1.0}))
    with open(tmp_path / PERF_LOG, "a", encoding="utf-8") as f:
        f.write('{"type": "step", "step": 2, "time": 2.0, "perf/st')          # killed mid-line
    LogWriter().append(str(tmp_path), RunHeader(session="s1", resumed_from_step=1))
    LogWriter().append(str(tmp_path), StepLine(2, 3.0, {keys.PERF_STEP_TIME: 1.5}))
    run = read_run(str(tmp_path))
    assert [h.resumed_from_step for h in run.headers] == [0, 1] and run.skipped_lines == 1
    assert [s.step for s in run.unique_steps()] == [1, 2] and run.unique_steps()[1].values[keys.PERF_STEP_TIME] == 1.5


def test_event_details_write_the_fields_the_perf_log_holds_and_read_them_back():
    """Each detail type gives its event's JSON fields in the order and form the log has always held them (a stop's
    figures and a wall's unknowns as null, a warning only its own figures), and reads them back as written."""
    stop = runlog.ActionDetails(action="stop", level="critical", steps_to_wall=1.5,
                                stop=runlog.StopFigures(outside_gb=None, need_gb=0.5, budget_gb=8.0))
    written = [
        (stop, {"action": "stop", "level": "critical", "steps_to_wall": 1.5, "outside_gb": None, "need_gb": 0.5,
                "budget_gb": 8.0}),
        (runlog.ActionDetails(action="clear_cache", level="warn", steps_to_wall=None),
         {"action": "clear_cache", "level": "warn", "steps_to_wall": None}),
        (runlog.WallMove(why=None, moved=False, budget_gb=7.0, before_gb=8.0, outside_gb=None, reachable_gb=9.0),
         {"why": None, "moved": False, "budget_gb": 7.0, "before_gb": 8.0, "outside_gb": None, "reachable_gb": 9.0}),
        (runlog.DecisionDetails(old_split={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
                                new_split={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
                                cost_sec=1.5, expected_gain_sec=None),
         {"old_split": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
          "new_split": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, "cost_sec": 1.5,
          "expected_gain_sec": None}),
        (runlog.CacheClear(freed_gb=0.25, seconds=0.01), {"freed_gb": 0.25, "seconds": 0.01}),
        (runlog.NoteDetails(needs="train_with_tuning"), {"needs": "train_with_tuning"}),
        (runlog.WarningFigures(completion_wall_tokens=300.0, steps_to_wall=12.0),
         {"completion_wall_tokens": 300.0, "steps_to_wall": 12.0}),
    ]
    for details, fields in written:
        assert list(details.to_details().items()) == list(fields.items())
        line = EventLine("mem", "action", "m", 3, 1.0, details.to_details())
        assert type(details).from_details(parse_record(json.loads(json.dumps(line.to_json()))).details) == details
    assert list(EventLine("mem", "stop", "m", 3, 1.0, stop.to_details()).to_json()) == [
        "type", "source", "kind", "step", "message", "action", "level", "steps_to_wall", "outside_gb", "need_gb",
        "budget_gb", "time"]


def test_event_details_read_an_older_or_stranger_log_field_by_field():
    """A missing field reads as None (a wall's ``moved`` as True: the older logs wrote only moves), one of another
    type as None; an event without a new split has no decision details; an unknown kind reads as ``info``."""
    assert runlog.WallMove.from_details({}) == runlog.WallMove(why=None, moved=True)
    assert runlog.WallMove.from_details({"why": "", "budget_gb": "8", "moved": 0}).why is None
    assert runlog.ActionDetails.from_details({"level": 2}) == runlog.ActionDetails(action=None)
    assert runlog.ActionDetails.from_details({"action": "stop", "need_gb": True}).stop == runlog.StopFigures(
        None, None, None)
    assert runlog.DecisionDetails.from_details({"cost_sec": 1.0}) is None
    assert runlog.DecisionDetails.from_details({"new_split": "2×2"}) == runlog.DecisionDetails(None, "2×2")
    assert runlog.WarningFigures.from_details({"leak_mib_per_step": 3, "data_wait_fraction": False}) == \
        runlog.WarningFigures(leak_mib_per_step=3.0)
    assert runlog.NoteDetails.from_details({"needs": 1}).needs is None
    entry = {"type": "event", "source": "x", "kind": "shout", "step": 2, "message": "m", "time": 1.0}
    assert parse_record(entry).kind == "info" and set(runlog.EVENT_KINDS) >= {"wall", "note", "stop", "decision"}


def test_a_misspelled_event_field_or_kind_fails_type_checking(tmp_path, monkeypatch):
    """The detail types and the kinds make a renamed key a mypy error at the writer and at the reader (mypy on one
    snippet; the libraries behind the package's ``__init__`` skipped, so it takes about two seconds)."""
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "from hf_perf_callbacks.core.runlog import DecisionDetails, EventLine, WallMove, WarningFigures\n"
        "WallMove(why=None, moved=True, budgt_gb=1.0)\n"                      # 2: a writer's misspelled field
        "WarningFigures.from_details({}).leak_mib_per_stepp\n"               # 3: a reader's misspelled field
        "EventLine('mem', 'walls', 'the memory wall moved')\n"              # 4: a kind that is none
        "DecisionDetails(old_split=None, new_split=None, cost_secs=1.0)\n"  # 5
        "WallMove(why=None, moved=True, budget_gb=1.0).why\n"               # 6: right: no error
        "EventLine('mem', 'wall', 'm', details=WallMove(why='x').to_details())\n")   # 7: right
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\npython_version = 3.10\nfollow_imports = skip\nignore_missing_imports = true\n"
                      "[mypy-hf_perf_callbacks.core.runlog,hf_perf_callbacks.keys]\nfollow_imports = silent\n")
    monkeypatch.setenv("MYPYPATH", os.path.dirname(os.path.dirname(runlog.__file__)))
    out, err, status = api.run([str(snippet), "--config-file", str(config), "--cache-dir", str(tmp_path / "cache")])
    lines_with_errors = {int(m) for m in re.findall(r"snippet\.py:(\d+): error", out)}
    assert status == 1 and lines_with_errors == {2, 3, 4, 5}, out + err
