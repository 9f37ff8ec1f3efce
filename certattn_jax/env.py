"""Settings read from the environment, checked by name (a typo fails at import, naming the variable)."""

from __future__ import annotations

import os

_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False,
           "auto": None, "": None}


def switch_from_env(name: str) -> bool | None:
    """A three-way switch: 1/true/on -> True, 0/false/off -> False, auto or unset -> None (the code decides)."""
    raw = os.environ.get(name, "auto").strip().lower()
    if raw not in _SWITCH:
        raise ValueError(f"{name}={raw!r}: expected 1 (on, true, yes), 0 (off, false, no) or auto")
    return _SWITCH[raw]


def positive_int_from_env(name: str, default: int, minimum: int = 1) -> int:
    """The environment variable `name` as an integer >= minimum (`default` when unset or empty); anything else is
    an error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={raw!r}: must be {what}")
    return value


def choice_from_env(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable `name` as one of `choices` (case-insensitive, returned as spelled in `choices`;
    `default` when unset or empty); anything else is an error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    match = [c for c in choices if c.lower() == raw.lower()]
    if not match:
        raise ValueError(f"{name}={raw!r}: choose one of {choices}")
    return match[0]
