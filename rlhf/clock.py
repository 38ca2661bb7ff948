"""This process's view of wall time. `clock_skew` faults shift it (a host's wrong clock); code that decides by wall
time (per-rank duration limits) and what a process stamps (log lines, heartbeat rows, exit records) read `now()`
instead of time.time().

Every reply a service sends carries this process's wall time and pid (HEADER); a process that watches (`watch`, the
controller's) compares it with its own on each reply, as NTP does, and names a peer whose clock is off by more than
the tolerance beyond the round trip's uncertainty (`observe`):

    clock.watch(2.0)                              # the controller: runtime.clock_skew_s
    resp.headers[clock.HEADER] = clock.stamp()    # every service's reply
    clock.observe(stamp, sent, received)          # -> (offset_s, error_s, pid) the first time a pid is off, else None
"""

from __future__ import annotations

import os
import threading
import time

HEADER = "X-RLHF-Clock"  # "<the replying process's wall time> <its pid>"

_skew_s = 0.0
_tolerance_s = 0.0  # 0: this process does not watch its peers' clocks
_reported: dict[int, tuple[float, float]] = {}  # pid -> the offset reported for it and its uncertainty
_lock = threading.Lock()


def now() -> float:
    return time.time() + _skew_s


def set_skew(seconds: float) -> None:
    global _skew_s
    _skew_s = float(seconds)


def skew() -> float:
    return _skew_s


def stamp() -> str:
    return f"{now():.6f} {os.getpid()}"


def watch(tolerance_s: float) -> None:
    """Compare every reply's clock with this process's own (0: stop); a peer off by more than tolerance_s is named."""
    global _tolerance_s
    _tolerance_s = float(tolerance_s)


def watching() -> bool:
    return _tolerance_s > 0


def observe(stamped: str, sent: float, received: float) -> tuple[float, float, int] | None:
    """A reply stamped `stamped` (HEADER) to a request sent at `sent` and answered at `received` (this process's
    clock, now()): (the peer's clock minus this one's, its uncertainty: half the round trip, the peer's pid) when
    the peer is off by more than the tolerance beyond the uncertainty and that was not reported yet (or has moved
    by more than the tolerance beyond both readings' uncertainty since); else None."""
    try:
        theirs, pid_text = stamped.split()
        peer_time, pid = float(theirs), int(pid_text)
    except ValueError:
        return None
    offset, error = peer_time - (sent + received) / 2, (received - sent) / 2
    if not _tolerance_s or abs(offset) - error <= _tolerance_s:
        return None
    with _lock:
        before = _reported.get(pid)
        if before is not None and abs(offset - before[0]) - error - before[1] <= _tolerance_s:
            return None
        _reported[pid] = offset, error
    return offset, error, pid
