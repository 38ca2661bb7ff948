"""ConfigError and the checks every section's __post_init__ runs (each names the key and the valid choices)."""

from __future__ import annotations

import difflib
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message says which and what is allowed."""


def _choice(key: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"{key}: {value!r} is not valid{extra}; choose one of: {', '.join(map(str, choices))}"
        )


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _in_range(key: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{key}: must be in [{lo}, {hi}], got {value!r}")
