"""Validation of public parameters: a bad value raises a ``ValueError`` naming the parameter, the value and what is
allowed. Pure: no torch, no transformers."""
from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, integer: bool = False, allow_none: bool = False) -> Any:
    """Validate a public numeric parameter; raise a ``ValueError`` naming it, its value and what is allowed."""
    if value is None and allow_none:
        return value
    if not _within(value, low, high, low_open, integer):
        bounds = ([f"{'>' if low_open else '>='} {low}"] if low is not None else []) + (
            [f"<= {high}"] if high is not None else [])
        allowed = ("an integer" if integer else "a finite number") + (
            f" {' and '.join(bounds)}" if bounds else "") + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")
    return value


def _within(value: Any, low: float | None, high: float | None, low_open: bool, integer: bool) -> bool:
    """Whether ``value`` is a finite number (an integer: ``integer``, never a bool) within its bounds."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)


def check_flag(name: str, value: Any, *, allow_none: bool = False) -> Any:
    """Validate a public boolean parameter; raise a ``ValueError`` naming it, its value and what is allowed."""
    if not (isinstance(value, bool) or (value is None and allow_none)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")
    return value


class UnknownKeyword(ValueError, TypeError):
    """A keyword argument the callable does not take (a ``TypeError`` as Python raises it, and a ``ValueError`` as
    the package's other bad arguments): ``keyword``, the ``closest`` allowed one (None: none close) and ``allowed``."""

    def __init__(self, message: str, keyword: str = "", closest: str | None = None,
                 allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keyword, self.closest, self.allowed = keyword, closest, allowed


def closest(word: str, allowed: Iterable[str]) -> str | None:
    """The closest of ``allowed`` to ``word`` (difflib, cutoff 0.6), or None; of the close ones, one sharing the
    first word wins (lora_rank → lora_r, not local_rank)."""
    word = str(word)
    close = difflib.get_close_matches(word, list(allowed), n=5, cutoff=0.6)
    same_family = [c for c in close if c.split("_")[0] == word.split("_")[0]]
    return next(iter(same_family or close), None)


def did_you_mean(word: str, allowed: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'calibrate'?)`` for the closest of ``allowed`` to ``word`` (:func:`closest`), written after
    ``prefix`` (``--`` for a flag), or ``""``."""
    close = closest(word, allowed)
    return f" (did you mean {prefix + close!r}?)" if close else ""


def check_keywords(owner: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Raise :class:`UnknownKeyword` for the first of ``given`` that is not in ``allowed``, with the closest allowed
    keyword and all of them."""
    allowed = list(allowed)
    for name in given:
        if name not in allowed:
            raise UnknownKeyword(f"{owner} got an unexpected keyword argument {name!r}{did_you_mean(name, allowed)}; "
                                 f"allowed keywords: {', '.join(allowed)}", name, closest(name, allowed),
                                 tuple(allowed))


def suggest_keywords(function: F) -> F:
    """``function`` whose unknown keyword arguments raise :class:`UnknownKeyword` with a did-you-mean (its
    signature's keywords are the allowed ones; ``**kwargs`` in it allows any)."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return function
    allowed = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL and n != "self"]

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_keywords(function.__name__, kwargs, allowed)
        return function(*args, **kwargs)

    return cast(F, checked)
