"""Whether a dataclass's values fit the types its fields declare (a settings object checks itself)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from typing import Any, Union


def mistyped_fields(obj: Any) -> list[tuple[str, str, object]]:
    """(field name, what it must be, value) of each field of dataclass ``obj`` whose value does not fit
    its declared type (a bool is no number; a list is taken for a tuple)."""
    hints = typing.get_type_hints(type(obj))
    return [
        (f.name, _describe(hints[f.name]), getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if not _is_a(getattr(obj, f.name), hints[f.name])
    ]


def _is_a(value: object, want: Any) -> bool:
    """``value`` fits the type hint ``want`` (Optional/Union, int, float, bool, str, tuple, dict, classes)."""
    if typing.get_origin(want) in (Union, types.UnionType):
        return any(_is_a(value, arg) for arg in typing.get_args(want))
    if want is type(None):
        return value is None
    if want is bool:
        return isinstance(value, bool)
    if want in (int, float):
        number = numbers.Integral if want is int else numbers.Real
        return isinstance(value, number) and not isinstance(value, bool)
    if want is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, typing.get_origin(want) or want)


def _describe(want: Any) -> str:
    if typing.get_origin(want) in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(want))
    return {int: "a whole number", float: "a number", bool: "True or False", str: "a string"}.get(
        want, "None" if want is type(None) else getattr(want, "__name__", str(want))
    )


def check_whole(name: str, value: object) -> None:
    """Not a float where a count is meant: ``2.5`` steps fail far later, and ``nan`` passes every comparison."""
    if isinstance(value, float):
        raise ValueError(f"{name} must be a whole number, got {value!r}")


def check_count(name: str, value: object, minimum: int) -> None:
    """A count: a whole number (:func:`check_whole`), at least ``minimum``."""
    check_whole(name, value)
    if isinstance(value, int) and not isinstance(value, bool) and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_seconds(name: str, value: object, zero_allowed: bool = False) -> None:
    """A finite number of seconds above 0 (or at least 0): None would mean waiting forever, and
    ``inf`` passes every ``> 0`` check."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value >= 0 if zero_allowed else value > 0)
    ):
        raise ValueError(f"{name} must be a number of seconds {'>=' if zero_allowed else '>'} 0, got {value!r}")
