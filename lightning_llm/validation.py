"""Argument checks shared by strategies, callbacks, the data module and the CLI.

Every check names the argument and the value it got, the constraint, and what to pass instead, and
runs where the argument arrives (``__init__``, before any process is launched). One spelling for
every caller, rather than a slightly different ``if x < 1: raise`` in each class.

Example::

    from lightning_llm.validation import check_int, check_float

    window = check_int("window", window, minimum=2)
    threshold = check_float("threshold", threshold, minimum=0, inclusive=False)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta
from numbers import Integral, Real
from typing import Any


def check_int(
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
    hint: str = "",
) -> int | None:
    """``value`` as an int within ``[minimum, maximum]``; ``None`` passes when ``optional``.

    Rejects bools, floats and strings ("2" from a hand-written dict is a TypeError here, not a
    crash deep inside a sum): a config loader that reads numbers gives ints.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(
            f"{name}={value!r} must be an integer{_bounds(minimum, maximum)}, got "
            f"{type(value).__name__}{_or_none(optional)}.{_hint(hint)}"
        )
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(
            f"{name}={value!r} must be an integer{_bounds(minimum, maximum)}{_or_none(optional)}.{_hint(hint)}"
        )
    return int(value)


def check_float(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    inclusive: bool = True,
    optional: bool = False,
    allow_inf: bool = False,
    hint: str = "",
) -> float | None:
    """``value`` as a finite float within the bounds (open bounds when not ``inclusive``).

    NaN is always refused (every comparison with it is False, so a NaN threshold silently
    disables whatever it guards); infinity only with ``allow_inf``.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"{name}={value!r} must be a number{_bounds(minimum, maximum, inclusive)}, got "
            f"{type(value).__name__}{_or_none(optional)}.{_hint(hint)}"
        )
    given, value = value, float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(
            f"{name}={given!r} must be a finite number{_bounds(minimum, maximum, inclusive)}.{_hint(hint)}"
        )
    low = minimum is not None and (value < minimum if inclusive else value <= minimum)
    high = maximum is not None and (value > maximum if inclusive else value >= maximum)
    if low or high:
        raise ValueError(
            f"{name}={given!r} must be a number{_bounds(minimum, maximum, inclusive)}{_or_none(optional)}.{_hint(hint)}"
        )
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``choices`` (compared by type too: ``True`` is not ``1``)."""
    choices = tuple(choices)
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}.{_hint(hint)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (``"false"`` is a non-empty string, hence true, so it is refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, got {type(value).__name__}.")
    return value


def check_timeout(name: str, value: Any, optional: bool = False) -> timedelta | None:
    """A positive ``timedelta`` from a ``timedelta`` or a number of seconds."""
    if value is None and optional:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        seconds = check_float(
            name, value, minimum=0, inclusive=False, optional=optional, hint="give a timedelta or a number of seconds"
        )
    if not seconds > 0:
        raise ValueError(
            f"{name}={value!r} must be a positive duration (a timedelta or seconds), e.g. timedelta(minutes=10)."
        )
    return timedelta(seconds=seconds)


def check_memory_size(name: str, value: Any) -> None:
    """``None``, a positive number of bytes, or a device's memory as a string: ``"H100"``, ``"80GB"``, ``"24GiB"``."""
    if value is not None and not isinstance(value, str):
        check_int(name, value, minimum=1, hint="bytes per device, or a size such as '80GB'")
    elif value is not None:
        from lightning_llm.planning.device_memory import device_memory_bytes

        if device_memory_bytes(value) <= 0:
            raise ValueError(f"{name}={value!r} must be a positive size such as '80GB'.")


def _bounds(minimum, maximum, inclusive: bool = True) -> str:
    low, high = (">=", "<=") if inclusive else (">", "<")
    parts = ([f"{low} {minimum}"] if minimum is not None else []) + (
        [f"{high} {maximum}"] if maximum is not None else []
    )
    return f" {' and '.join(parts)}" if parts else ""


def _or_none(optional: bool) -> str:
    return " (or None)" if optional else ""


def _hint(hint: str) -> str:
    return f" {hint[0].upper()}{hint[1:].rstrip('.')}." if hint else ""
