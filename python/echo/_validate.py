"""Argument checks shared by the public classes: precise TypeError/ValueError messages."""

from __future__ import annotations

import inspect
import operator

__all__ = [
    "ConstructorSignature",
    "check_bool",
    "check_int",
    "check_seconds",
    "check_str",
    "check_token",
]


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


def check_token(name: str, value: object) -> str | None:
    """`value` as a token: None (read `$ECHO_TOKEN` later) or a non-empty str."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string (or None to read $ECHO_TOKEN), got ''")
    return value


def check_seconds(name: str, value: object, *, optional: bool) -> float | None:
    """`value` as a positive number of seconds (or None where `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number of seconds or None" if optional else "a number of seconds"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def check_bool(name: str, value: object) -> bool:
    """`value` as a bool (no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


class ConstructorSignature:
    """A class's `__signature__`: its `__init__`'s arguments without `self`, for the class it
    is read from (subclasses included). A class whose `__new__` only picks the class to build
    sets it, so that `inspect.signature(cls)` (help(), IDEs, code that asks which arguments
    it takes) shows the constructor's arguments, not `__new__`'s."""

    def __get__(self, obj: object, owner: type) -> inspect.Signature:
        if obj is not None:
            raise AttributeError("__signature__")  # an instance is not the constructor
        sig = inspect.signature(owner.__init__)
        return sig.replace(
            parameters=list(sig.parameters.values())[1:],
            return_annotation=inspect.Signature.empty,
        )
