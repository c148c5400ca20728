"""Small validation helpers shared by the spec dataclasses (no I/O)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import TypeVar

from stage_dse.errors import ConfigError

E = TypeVar("E", bound=Enum)


MAX_GPUS = 10**7
"""More GPUs than any cluster holds (the largest are ~10^5): rejected at the edge, so no
product of degrees or counts can overflow 64-bit integers downstream."""
MAX_TOKENS = 10**8
"""Sequence lengths, batch sizes and model dimensions beyond this make no physical sense."""


def positive_int(owner: str, field: str, value: object, maximum: int = MAX_TOKENS) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{field} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{owner}.{field} must be > 0, got {value}")
    if value > maximum:
        raise ConfigError(f"{owner}.{field}={value} is beyond {maximum:,}, past physical sense")


def non_negative_int(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{owner}.{field} must be an integer >= 0, got {value!r}")


def non_negative_number(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{owner}.{field} must be a number >= 0, got {value!r}")
    _finite(owner, field, value)


def positive_number(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{field} must be a number, got {value!r}")
    if not value > 0:
        raise ConfigError(f"{owner}.{field} must be > 0, got {value}")
    _finite(owner, field, value)


def _finite(owner: str, field: str, value: float) -> None:
    """An infinite peak, bandwidth or capacity would make every plan free or fit."""
    if value == float("inf"):
        raise ConfigError(f"{owner}.{field} must be a finite number, got {value}")


def divides(small_name: str, small: int, big_name: str, big: int) -> None:
    if big % small != 0:
        raise ConfigError(f"{small_name}({small}) does not divide {big_name}({big})")


def coerce_enum(enum_type: type[E], owner: str, field: str, value: object) -> E:
    """Accept an enum member or its value (as written in YAML); list valid values otherwise."""
    if isinstance(value, enum_type):
        return value
    for member in enum_type:
        if value == member.value or (isinstance(value, str) and value.lower() == member.value):
            return member
    valid = ", ".join(str(m.value) for m in enum_type)
    raise ConfigError(f"{owner}.{field}={value!r} is not one of: {valid}")


def one_of(owner: str, field: str, value: object, valid: Iterable[object]) -> None:
    valid = list(valid)
    if value not in valid:
        raise ConfigError(f"{owner}.{field}={value!r} is not one of: {', '.join(map(str, valid))}")
