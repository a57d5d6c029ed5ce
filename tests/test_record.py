"""The split record (hf_perf_callbacks/resize/record.py): pure, no trainer, no torch — every test here but the last
runs in a process where torch cannot be imported (the last runs them so)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

from hf_perf_callbacks.core.batching import Split
from hf_perf_callbacks.core.splitfile import Decision, ExactnessCheck, WrittenCheckpoint, read_split_file
from hf_perf_callbacks.resize.plan import SplitState, on_oom
from hf_perf_callbacks.resize.record import Change, SplitRecord, merged, rank_file, rank_files

S42, S24, S18 = Split(4, 2), Split(2, 4), Split(1, 8)
EVERY = (Split(8, 1), S42, S24, S18)


def decision(step: int, new: Split, when: float, old: Split = S42) -> Decision:
    return Decision(kind="oom", step=step, reason="out of memory", old=old, new=new, time=when)


def test_a_commit_applies_the_plans_state_and_writes_the_record_once(tmp_path):
    record = SplitRecord.start(str(tmp_path), S42)
    plan = on_oom(record.snapshot(EVERY), 4)
    check = ExactnessCheck(step=4, kind="oom", old=S42, new=S24, verdict="exact", rows=4, passes=2)
    path = record.commit(Change(state=plan.state, decision=decision(4, S24, 1.0), check=check),
                         [WrittenCheckpoint(3, "f")])
    found = read_split_file(str(tmp_path))
    assert path is not None and found.split == S24 and found.checks == [check]
    assert [d.step for d in found.decisions] == [4] and found.written == [WrittenCheckpoint(3, "f")]
    assert record.state.every == () and record.snapshot(EVERY).last_decision == "oom"
    mtime = os.stat(path).st_mtime_ns
    assert record.commit(Change(), [WrittenCheckpoint(3, "f")]) is None           # nothing changed: not written
    assert os.stat(path).st_mtime_ns == mtime


def test_a_change_applied_without_writing_is_written_by_the_next_commit(tmp_path):
    record = SplitRecord.start(str(tmp_path), S42)
    assert record.commit(Change(ended="stopped"), [], write=False) is None
    assert not os.path.exists(tmp_path / "tuner_split.json")
    record.commit(Change(), [])
    assert read_split_file(str(tmp_path)).ended == "stopped"


def test_a_record_that_holds_nothing_writes_no_file_and_replaces_an_earlier_runs(tmp_path):
    """No trace when nothing happens: no split file; where an earlier run left one, this run's replaces it."""
    quiet = SplitRecord.start(str(tmp_path), S42)
    assert quiet.commit(Change(state=replace(quiet.state, resizes_left=3)), []) is None
    assert not os.path.exists(tmp_path / "tuner_split.json")
    earlier = SplitRecord.start(str(tmp_path), S42)
    earlier.commit(Change(ended="stopped"), [])
    again = SplitRecord.start(str(tmp_path), S42)
    assert again.commit(Change(), []) is not None and read_split_file(str(tmp_path)).session == again.id


def test_adopting_a_file_continues_its_run():
    found = SplitRecord.start("x", S42).file([])
    found.session, found.decisions = "abc", [decision(4, S24, 1.0)]
    record = SplitRecord.start("x", Split(8, 1))
    record.adopt(found)
    assert (record.id, record.state.configured, len(record.decisions)) == ("abc", S42, 1)


def test_a_rank_that_leaves_for_the_restart_records_its_decision_and_the_restart_merges_it(tmp_path):
    """Rank 1 ran out of memory where the others wait in a collective: it writes its own file; the relaunch merges
    it into the main record, so every rank resumes at the split rank 1 chose."""
    main = SplitRecord.start(str(tmp_path), S42, world=2)
    main.commit(Change(), [WrittenCheckpoint(3, "f")])
    rank1 = SplitRecord.start(str(tmp_path), S42, world=2, main=False, rank=1)
    rank1.id = main.id
    assert rank1.commit(Change(), []) is None                                   # not a restart: nothing written
    state = SplitState(S42, S42, switch=S24)
    assert rank1.commit(Change(state=state, decision=decision(4, S24, 5.0), restart=True), []) == rank_file(
        str(tmp_path), 1)
    restart = merged(read_split_file(str(tmp_path)), rank_files(str(tmp_path)))
    assert restart.split == S24 and [d.new for d in restart.decisions] == [S24]
    assert restart.written == [WrittenCheckpoint(3, "f")]                          # the main process's checkpoints


def test_a_rank_file_of_another_run_or_an_older_decision_changes_nothing(tmp_path):
    main = SplitRecord.start(str(tmp_path), S42)
    main.commit(Change(state=SplitState(S42, S24), decision=decision(4, S24, 9.0)), [])
    other = SplitRecord.start(str(tmp_path), S42, main=False, rank=1)            # another run's id
    other.commit(Change(state=SplitState(S42, S42, switch=S18), decision=decision(2, S18, 10.0), restart=True), [])
    older = SplitRecord.start(str(tmp_path), S42, main=False, rank=2)
    older.id = main.id
    older.commit(Change(state=SplitState(S42, S42, switch=S18), decision=decision(2, S18, 1.0), restart=True), [])
    restart = merged(read_split_file(str(tmp_path)), rank_files(str(tmp_path)))
    assert restart.split == S24 and [d.time for d in restart.decisions] == [1.0, 9.0]


def test_an_unreadable_rank_file_is_skipped(tmp_path):
    with open(rank_file(str(tmp_path), 3), "w") as f:
        f.write("{not json")
    assert rank_files(str(tmp_path)) == []


def test_the_records_tests_run_without_torch():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'transformers', 'trl', 'accelerate'):\n"
               "            raise ImportError('blocked: ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import pathlib, tempfile, tests.test_record as t\n"
               "for name in dir(t):\n"
               "    if name.startswith('test_') and name != 'test_the_records_tests_run_without_torch':\n"
               "        fn = getattr(t, name)\n"
               "        fn(pathlib.Path(tempfile.mkdtemp())) if fn.__code__.co_argcount else fn()\n"
               "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n").replace(
        "import pathlib", "import json, pathlib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
