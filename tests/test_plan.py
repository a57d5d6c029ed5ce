"""The tuning session's decisions as pure transitions (``resize/plan.py``), without a trainer; and the session's
interface seen by the loop and the tuner, counted."""
import ast
import dataclasses
import pathlib

import pytest

from hf_perf_callbacks.core.batching import Exactness, exact_splits
from hf_perf_callbacks.resize import plan
from hf_perf_callbacks.resize.plan import InexactResize, SplitState

EVERY = tuple(exact_splits(8, 1))                    # 8x1, 4x2, 2x4, 1x8
S8, S4, S2, S1 = EVERY
ONLY_8_4 = Exactness((S8, S4), "a mean per micro-batch", "Divide by num_items_in_batch.")


def state(split=S4, **fields) -> SplitState:
    return SplitState(configured=S4, split=split, every=EVERY, **fields)


@pytest.mark.parametrize("before, step, in_opt, expected", [
    # the next smaller split, from this step's checkpoint kept as a save, spending one re-size
    (state(resizes_left=2), 5, False, dict(action="resize", new=S2, source="save", spend=True, left=1)),
    # inside optimizer.step: back to the newest checkpoint this run wrote
    (state(), 5, True, dict(action="resize", new=S2, source="newest", spend=True, left=None)),
    # nothing trained yet: from the start
    (state(split=S2), 0, False, dict(action="resize", new=S1, source="start", spend=True, left=None)),
])
def test_on_oom_plans_the_next_smaller_split(before, step, in_opt, expected):
    p = plan.on_oom(before, step, in_opt)
    assert (p.action, p.new, p.source, p.spend, p.state.resizes_left) == (
        expected["action"], expected["new"], expected["source"], expected["spend"], expected["left"])
    assert (p.state.split, p.state.switch) == (p.new, None)


def test_on_oom_gives_up_with_the_error_of_the_missing_split():
    none_left = plan.on_oom(state(split=S1), 3)
    assert none_left.action == "give_up" and type(none_left.error) is ValueError
    inexact = plan.on_oom(state(exactness=ONLY_8_4), 3)
    assert inexact.action == "give_up" and isinstance(inexact.error, InexactResize)
    assert (inexact.error.step, inexact.error.old, inexact.error.anyway) == (3, S4, S2)


def test_a_trial_that_ran_out_of_memory_goes_to_the_tunings_next_split_and_spends_nothing():
    p = plan.on_oom(state(split=S8, resizes_left=0), 4, trial=True, trial_next=S4)
    assert (p.action, p.new, p.source, p.trial, p.spend) == ("resize", S4, "switch", True, False)
    assert (p.state.split, p.state.resizes_left) == (S4, 0)


@pytest.mark.parametrize("before, expected", [
    (state(), ("resize", S2, None, True)),                                 # not in process: stop this train()
    (state(in_process=True), ("resize", S2, None, False)),                 # at the next step's begin
    (state(switch=S1), ("none", S1, None, False)),                         # a switch is pending already
    (state(resizes_left=0), ("refuse", None, "max-resizes", False)),
    (state(exactness=ONLY_8_4), ("refuse", None, "watchdog-inexact", False)),
    (state(split=S1), ("refuse", None, None, False)),                      # nothing smaller: the watchdog stops
])
def test_on_watchdog(before, expected):
    p = plan.on_watchdog(before, 7)
    assert (p.action, p.new, p.warn[0] if p.warn else None, p.stop_now) == expected
    if p.action == "resize":
        assert (p.state.switch, p.state.last_decision) == (S2, "watchdog")


@pytest.mark.parametrize("last, expected", [
    ("watchdog", ("save", True, 0)),          # memory's switch: kept as a save of the run, one re-size spent
    ("memory_check", ("switch", False, 1)),   # the tuning's switch: a checkpoint only for it
    (None, ("switch", False, 1)),
])
def test_on_switch(last, expected):
    p = plan.on_switch(state(switch=S2, resizes_left=1, last_decision=last))
    assert (p.action, p.new, p.state.split, p.state.switch) == ("switch", S2, S2, None)
    assert (p.source, p.spend, p.state.resizes_left) == expected


@pytest.mark.parametrize("before, switching, expected", [
    (state(), False, ("finish", None, None)),
    (state(switch=S2, in_process=True), True, ("switch", S2, None)),
    (state(switch=S2, in_process=True), False, ("finish", None, S2)),      # a stop at the switch's step wins
    (state(switch=S2, in_process=False), False, ("switch", S2, None)),     # the tuner stopped train() for it
])
def test_on_stop(before, switching, expected):
    p = plan.on_stop(before, switching)
    assert (p.action, p.new, p.cancelled) == expected
    assert p.state.switch == (None if p.action == "finish" else S2)


@pytest.mark.parametrize("world, agreed, in_opt, step, saves", [
    (1, False, False, 5, True),
    (2, True, False, 5, True),
    (2, False, False, 5, False),          # other ranks may be inside a collective
    (1, False, True, 5, False),           # the weights may be half-updated
    (1, False, False, 0, False),          # no step completed
])
def test_on_end_says_whether_the_last_step_can_be_saved(world, agreed, in_opt, step, saves):
    p = plan.on_end(state(switch=S2), step, world, agreed, in_opt, gave_up=True)
    assert (p.action, p.why == "", p.state.switch, p.state.gave_up) == ("end", saves, None, True)


def test_on_restart_names_the_next_smaller_exact_split():
    assert plan.on_restart(state()).new == S2
    assert plan.on_restart(state(split=S1)).new is None
    assert plan.on_restart(state(exactness=ONLY_8_4)).new is None


def test_the_state_and_the_plan_are_frozen_values():
    p = plan.on_oom(state(), 5)
    for value in (p, p.state):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.action = "x" if value is p else None       # type: ignore[misc]


RESIZE = pathlib.Path(__file__).resolve().parents[1] / "hf_perf_callbacks" / "resize"


def executor_members(path: pathlib.Path) -> set[str]:
    """Every ``executor.X`` (also ``self.executor.X``, ``self._executor.X``) a module uses."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if ((isinstance(owner, ast.Name) and owner.id == "executor")
                    or (isinstance(owner, ast.Attribute) and owner.attr in ("executor", "_executor"))):
                found.add(node.attr)
    return found


def test_the_loop_and_the_tuner_see_a_small_executor():
    used = executor_members(RESIZE / "loop.py") | executor_members(RESIZE / "callback.py")
    assert len(used) <= 17, sorted(used)
    assert "tuning" not in used and "record" not in used     # no reaching through the executor into its parts


def test_plan_is_pure():
    tree = ast.parse((RESIZE / "plan.py").read_text())
    imported = ({n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
                | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names})
    assert not any(m.split(".")[0] in ("torch", "transformers", "trl", "accelerate") for m in imported)


def test_the_split_file_is_written_once_per_event_and_only_when_it_changed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hf_perf_callbacks.core import splitfile
    from hf_perf_callbacks.resize.executor import Executor

    writes = []
    monkeypatch.setattr(splitfile.SplitFile, "write", lambda record, output_dir: writes.append(record))
    args = SimpleNamespace(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2)
    executor = Executor(args)
    with executor.event():                            # a decision, a pending switch, the plan's state
        executor.decided(executor.decide("oom", "out of memory", S2, 3))
        executor.request_switch(S2, "out of memory")
        assert writes == []
    assert len(writes) == 1 and (writes[0].split, [d.kind for d in writes[0].decisions]) == (S2, ["oom"])
    with executor.event():                            # nothing changed: nothing written
        executor.snapshot()
        executor.commit()
    assert len(writes) == 1
    executor.decided(executor.decide("watchdog", "memory", S1, 4))       # outside an event: its own
    assert len(writes) == 2
