"""Parameter validation: the messages name the parameter, the value and what is allowed."""
import pytest

from hf_perf_callbacks.validation import check_flag, check_number


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
