"""Checks of one ``fedpa.*`` config value each, shared by :mod:`fs_fedpa.config` and
:mod:`fs_fedpa.privacy.settings`: a ValueError naming the key and the value; and :func:`finite_number`, the test of a
reported number. No torch here."""

from __future__ import annotations

import math
import operator
from typing import Any


def finite_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number(value: Any, name: str, minimum: float) -> float:
    """``value`` as a finite float >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"fedpa.{name}(={value!r}) must be a finite number >= {minimum:g}")
    return float(value)


def integer(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (any integral type but bool)."""
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if isinstance(value, bool) or as_int is None or as_int < minimum:
        raise ValueError(f"fedpa.{name}(={value!r}) must be an int >= {minimum}")
    return as_int


def int_list(values: Any, name: str) -> list[int]:
    """``values`` as a list of ints >= 1."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"fedpa.{name}(={values!r}) must be a list of positive ints")
    return [integer(v, f"{name}[{i}]", minimum=1) for i, v in enumerate(values)]


def shown(value) -> str:
    """A value as an error message shows it."""
    return f"{value:g}" if isinstance(value, float) else str(value)
