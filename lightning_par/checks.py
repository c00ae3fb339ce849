"""The small checks every option goes through: one home, one wording.

Each returns the checked value (so ``self.x = check_bool("x", x)`` reads as one step) and raises a ``TypeError`` or
``ValueError`` naming the parameter, the value seen and what to pass instead. None of them communicates: options are
checked on every rank before the first collective.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")
    return value


CHECKPOINTING_MODES = {False: "none", True: "full", "none": "none", "full": "full", "selective": "selective"}


def check_checkpointing(name: str, value: Any) -> str:
    """An activation checkpointing option: ``False``, ``True`` (= ``"full"``) or ``"selective"``; returns the mode
    ("none", "full" or "selective")."""
    if isinstance(value, (bool, str)) and value in CHECKPOINTING_MODES:
        return CHECKPOINTING_MODES[value]
    raise ValueError(f"{name}={value!r} is not an activation checkpointing mode. Use True (or 'full': recompute "
                     f"every block in backward), 'selective' (keep matmul and attention outputs, recompute the rest) "
                     f"or False.")


def check_positive_int(name: str, value: Any, *, allow_none: bool = False, hint: str = "") -> int | None:
    """A positive int (``None`` too where ``allow_none``, meaning "the default")."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        default = " (or None for the default)" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be a positive int{default}.{' ' + hint if hint else ''}")
    return value


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {sorted(choices)}.")
    return value


def check_str_list(name: str, value: Any, what: str, example: Sequence[str]) -> list[str] | None:
    """A list of strings (``what`` they are, for the message), or None. A bare string is refused: it would be read
    as a list of characters."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name}={value!r} must be a list of {what}, e.g. {list(example)!r}.")
    return list(value)


def check_optional_str(name: str, value: Any, example: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a string, e.g. {example!r}, or None.")
    return value


def check_identifier(name: str, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{name}={value!r} must be the name of {what}.")
    return value
