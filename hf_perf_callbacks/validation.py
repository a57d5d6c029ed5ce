"""Validation of public parameters: a bad value raises a ``ValueError`` naming the parameter, the value and what is
allowed. Pure: no torch, no transformers."""
from __future__ import annotations

import math
from typing import Any


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, integer: bool = False, allow_none: bool = False) -> Any:
    """Validate a public numeric parameter; raise a ``ValueError`` naming it, its value and what is allowed."""
    if value is None and allow_none:
        return value
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    ok = ok_type and not isinstance(value, bool) and not (isinstance(value, float) and not math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            bounds.append(f"<= {high}")
        allowed = (f"a finite {kind.removeprefix('a ')}" if not integer else kind) + (
            f" {' and '.join(bounds)}" if bounds else "") + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")
    return value


def check_flag(name: str, value: Any, *, allow_none: bool = False) -> Any:
    """Validate a public boolean parameter; raise a ``ValueError`` naming it, its value and what is allowed."""
    if not (isinstance(value, bool) or (value is None and allow_none)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")
    return value
