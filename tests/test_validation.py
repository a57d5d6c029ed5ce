"""Parameter validation: the messages name the parameter, the value and what is allowed."""
import pytest

from hf_perf_callbacks.core.validation import check_flag, check_number


def test_check_flag_messages():
    with pytest.raises(ValueError, match=r"stop='yes' is not allowed: expected True or False$"):
        check_flag("stop", "yes")
    with pytest.raises(ValueError, match=r"enabled=1 is not allowed: expected True, False or None$"):
        check_flag("enabled", 1, allow_none=True)
    with pytest.raises(ValueError, match="None is not allowed"):
        check_flag("probe", None)
    assert check_flag("enabled", None, allow_none=True) is None and check_flag("stop", False) is False


def test_check_number_messages():
    with pytest.raises(ValueError, match=r"window_steps=0 is not allowed: expected an integer >= 1"):
        check_number("window_steps", 0, low=1, integer=True)
    with pytest.raises(ValueError, match="True"):
        check_number("x", True, low=0)
    with pytest.raises(ValueError, match="nan"):
        check_number("x", float("nan"))
    assert check_number("x", None, allow_none=True) is None
    assert check_number("x", 0.5, low=0, high=1, low_open=True) == 0.5


@pytest.mark.parametrize("name", ["ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner"])
def test_settings_are_attributes_and_the_saved_state_rebuilds_an_equal_callback(name):
    """transformers rebuilds a callback from ``state()["args"]`` (restore_callback_states_from_checkpoint): the
    settings come from the instance's attributes, every constructor argument but the clock, and round-trip."""
    import inspect

    import hf_perf_callbacks
    from hf_perf_callbacks.common.base import Clock

    cls = getattr(hf_perf_callbacks, name)
    first = next(p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self")
    changed = {"ThroughputMeter": {"window_steps": 3}, "MemoryWatchdog": {"limit_gb": 7.5},
               "MPSCacheClearer": {"interval_steps": 20}, "AdaptiveBatchTuner": {"max_micro_batch": 2}}[name]
    callback = cls(**changed, clock=Clock())
    args = callback.state()["args"]
    assert "clock" not in args and first.name in args
    assert set(args) == {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "clock")}
    assert all(args[k] == v and getattr(callback, k) == v for k, v in changed.items())
    assert cls(**args).settings() == callback.settings()


def test_a_clock_that_is_not_a_clock_is_refused():
    from hf_perf_callbacks import ThroughputMeter

    with pytest.raises(ValueError, match=r"ThroughputMeter: clock=.* is not allowed: expected a hf_perf_callbacks"):
        ThroughputMeter(clock=lambda: 0.0)


def test_the_constructors_shell_is_written_at_the_constructor_and_nowhere_else():
    """``@arguments`` names the class and the key of a bad argument where it is written; base.py rewraps nothing
    out of sight: a subclass's undecorated constructor raises Python's own error."""
    import hf_perf_callbacks
    from hf_perf_callbacks.common.base import ArgumentError, PerfCallback, arguments

    for name in ("ThroughputMeter", "MemoryWatchdog", "MPSCacheClearer", "AdaptiveBatchTuner"):
        assert hasattr(getattr(hf_perf_callbacks, name).__init__, "__wrapped__"), name

    class Plain(PerfCallback):
        def __init__(self, size: int = 1):
            super().__init__()
            self.size = size

    class Shelled(PerfCallback):
        @arguments
        def __init__(self, size: int = 1):
            super().__init__()
            self.size = size

    with pytest.raises(TypeError) as plain:
        Plain(sise=2)
    assert not isinstance(plain.value, ArgumentError)
    with pytest.raises(ArgumentError, match="Shelled got .*'sise' .did you mean 'size'"):
        Shelled(sise=2)
