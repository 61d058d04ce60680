"""Argument checks shared by the public classes: precise TypeError/ValueError messages."""

from __future__ import annotations

import operator

__all__ = ["check_int", "check_str"]


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as an int in `[low, high]`; TypeError for bools and non-integers."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        as_int = operator.index(value)  # pyright: ignore[reportArgumentType]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if as_int < low or (high is not None and as_int > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {as_int}")
    return as_int


def check_str(name: str, value: object) -> str:
    """`value` as a non-empty str."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {value!r}")
    return value
