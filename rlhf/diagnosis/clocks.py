"""One clock for the evidence: the controller names each process whose wall clock is off (its `clock:` WARNING,
read off that process's replies: rlhf.clock), and what that process stamped (log lines, heartbeat rows, its own
exit records) is read on the controller's clock before anything is ordered by time. A host 60 s ahead otherwise
puts its own root cause a minute after the failure it caused (masked as cleanup), and its dead ranks a minute alive.

Its start records stay as written (a clock that jumps mid-run, as the clock_skew fault's, was right then)."""

from __future__ import annotations

import re
from typing import Any

from rlhf.diagnosis.report import Evidence
from rlhf.diagnosis.rules import CLOCK_LINE


def clock_offsets(logs: list[Evidence]) -> dict[int, float]:
    """pid -> how many seconds its clock is ahead of the controller's (negative: behind), the latest reading."""
    out: dict[int, float] = {}
    for e in logs:
        m = CLOCK_LINE.search(e.message)
        if m and e.reporter == "controller-0":
            out[int(m.group(2))] = float(m.group(3)) * (1 if m.group(4) == "ahead of" else -1)
    return out


def on_one_clock(offsets: dict[int, float], logs: list[Evidence], metrics: dict[str, list[dict[str, Any]]],
                 lives: list[dict[str, Any]], pids: dict[str, int]) -> None:
    """Move every stamp a skewed process wrote onto the controller's clock (in place), and make each clock finding
    about the processes of that pid (the first by rank its subject)."""
    for e in logs:
        off = offsets.get(pids.get(e.reporter, -1)) if e.reporter != "controller-0" else None
        if off:
            e.time, e.onset = e.time - off, e.onset - off
        m = CLOCK_LINE.search(e.message)
        if m and e.category == "clock_skew":
            names = sorted((n for n, p in pids.items() if p == int(m.group(2))), key=_by_rank)
            if names:
                e.subject, e.local = names[0], False
                if len(names) > 1:
                    e.message = e.message.replace(f"(pid {m.group(2)})", f"(pid {m.group(2)}: {names[0]} to "
                                                  f"{names[-1]}, {len(names)} processes)", 1)
    for rows in metrics.values():
        for row in rows:
            off = offsets.get(_int(row.get("pid")))
            if off:
                row["_time"] -= off
    for life in lives:
        off = offsets.get(_int(life.get("pid")))
        if off and life.get("end") is not None and life.get("by") == life.get("process"):
            life["end"] -= off


def _by_rank(name: str) -> tuple[str, int]:
    m = re.match(r"([a-z]+)-(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
