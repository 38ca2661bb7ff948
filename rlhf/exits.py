"""Process lives: who started, who ended, how (exit code or signal), and who saw it.

Every process of a run appends to `<run-dir>/exits.jsonl` (one JSON object a line, O_APPEND, so
concurrent writers never interleave):

    {"event": "start", "process": "train-1", "pid": 4242, "time": ...}
    {"event": "exit",  "process": "rollout-1", "pid": 4311, "time": ..., "exit_code": -9,
     "signal": "SIGKILL", "by": "scheduler-0", "expected": false}

A process records its own start and, when it can, its own end (`by` is itself). A parent records
its children's ends from their exit status: the scheduler for its jobs, the controller for the
scheduler. A process that started and has no exit record died where nothing could run: SIGKILL,
the kernel's OOM killer, a hard crash. That absence is evidence too (`rlhf diagnose` reads it).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from rlhf import clock, stacks

FILE = "exits.jsonl"


def signal_name(code: int | None) -> str:
    """'SIGKILL' for a Popen return code of -9 (killed by a signal); '' for a normal exit."""
    if code is None or code >= 0:
        return ""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe(code: int | None) -> str:
    """'killed by SIGKILL', 'exit 1', 'still running'."""
    if code is None:
        return "still running"
    return f"killed by {signal_name(code)}" if code < 0 else f"exit {code}"


def _append(run_dir: str, record: dict[str, Any]) -> None:
    if not run_dir:
        return
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(os.path.join(run_dir, FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return  # a full disk or a removed run directory must not turn an exit into a second failure
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def record_start(run_dir: str, process: str, pid: int | None = None) -> None:
    """pid None: this process's own start; it also arms its stacks dump (rlhf.stacks, hang forensics). The host it
    runs on (RLHF_HOST, and RLHF_HOST_NAME on a host of rlhf.hosts) goes with it: a job runs on its scheduler's."""
    if pid is None:
        stacks.arm(run_dir, process)
    host = {k: v for k, v in (("host", os.environ.get("RLHF_HOST", "")), ("host_name", os.environ.get("RLHF_HOST_NAME",
                                                                                                      ""))) if v}
    _append(run_dir, {"event": "start", "process": process, "pid": pid or os.getpid(), "time": clock.now(), **host})


def record_exit(run_dir: str, process: str, pid: int, exit_code: int | None, by: str, expected: bool,
                reason: str = "") -> None:
    """`by` saw `process` end with `exit_code` (negative: killed by that signal); expected: we asked it to."""
    _append(run_dir, {"event": "exit", "process": process, "pid": pid, "time": clock.now(), "exit_code": exit_code,
                      "signal": signal_name(exit_code), "by": by, "expected": expected,
                      **({"reason": reason} if reason else {})})


def read(run_dir: str) -> list[dict[str, Any]]:
    """Every record, oldest first ([] when the run wrote none)."""
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill mid-write
    return sorted(out, key=lambda r: r.get("time", 0.0))


def all_lives(run_dir: str) -> list[dict[str, Any]]:
    """Every life of every process, oldest first (a resumed run starts its processes again):
    {process, pid, start, end, exit_code, signal, by, expected, reason} (+ host, host_name where recorded).

    end is None when nothing recorded its end: it vanished (SIGKILL, OOM killer) or is still running.
    A process's own record and its parent's may both exist; the parent's exit status wins (it has the signal).
    """
    out: list[dict[str, Any]] = []
    current: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in read(run_dir):
        name, pid = r.get("process", "?"), r.get("pid")
        life = current.get((name, pid))
        if life is None or r.get("event") == "start":
            life = {"process": name, "pid": pid, "start": None, "end": None, "exit_code": None, "signal": "",
                    "by": "", "expected": None, "reason": ""}
            current[(name, pid)] = life
            out.append(life)
        if r.get("event") == "start":
            life["start"] = r.get("time")
            life.update({k: r[k] for k in ("host", "host_name") if r.get(k)})  # where it ran (RLHF_HOST)
            continue
        by_parent = r.get("by") != name
        if life["end"] is None or (by_parent and not life["signal"]):
            life.update(end=life["end"] or r.get("time"), exit_code=r.get("exit_code"), signal=r.get("signal", ""),
                        by=r.get("by", ""), expected=r.get("expected"), reason=r.get("reason", "") or life["reason"])
    # one process that serves several (a simulated host's rollout servers or train ranks): its scheduler records the
    # job's exit under the job's name (rollout-4); the others of that pid ended with it
    ended = {life["pid"]: life for life in out if life["end"] is not None and life["pid"] is not None}
    for life in out:
        other = ended.get(life["pid"])
        if life["end"] is None and other is not None and (other["start"] or 0.0) <= (life["start"] or 0.0) \
                <= other["end"]:
            life.update({k: other[k] for k in ("end", "exit_code", "signal", "by", "expected", "reason")})
    return out
