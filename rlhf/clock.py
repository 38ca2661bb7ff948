"""This process's view of wall time. `clock_skew` faults shift it; code that decides by wall time
(per-rank duration limits, leases compared across processes) reads `now()` instead of time.time()."""

from __future__ import annotations

import time

_skew_s = 0.0


def now() -> float:
    return time.time() + _skew_s


def set_skew(seconds: float) -> None:
    global _skew_s
    _skew_s = float(seconds)


def skew() -> float:
    return _skew_s
