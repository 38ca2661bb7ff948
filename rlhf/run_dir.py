"""The run directory (docs/default-run.md: the run directory): layout, logging, steps.csv, summary.json."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import logging
import math
import os
import sys
from typing import Any

from rlhf import clock


def default_run_dir(started: float | None = None) -> str:
    """runs/<UTC start time>. Under torchrun the start is its agent's, so the workers a restart
    (--max-restarts) brings up find the run they resume in the same folder."""
    when = _dt.datetime.fromtimestamp(started, _dt.timezone.utc) if started else _dt.datetime.now(_dt.timezone.utc)
    return os.path.join("runs", when.strftime("%Y%m%d-%H%M%S"))


def make_run_dir(path: str) -> str:
    for sub in ("logs", "traces", "metrics", "faults", "checkpoints", "report"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)
    return path


class _Context(logging.Filter):
    def __init__(self, role: str, rank: int) -> None:
        super().__init__()
        self.role, self.rank = role, rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.rank = self.role, self.rank
        return True


LOG_FORMAT = "%(asctime)s.%(msecs)03d %(role)s-%(rank)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"


class _HostClock(logging.Formatter):
    """Stamps each line on this process's clock (rlhf.clock.now: a clock_skew fault shifts it, as a host's wrong
    clock would)."""

    def format(self, record: logging.LogRecord) -> str:
        skew = clock.skew()
        if not skew:
            return super().format(record)
        saved = record.created, record.msecs
        record.created += skew
        record.msecs = (record.created - int(record.created)) * 1000
        try:
            return super().format(record)
        finally:
            record.created, record.msecs = saved


class _Route(logging.Filter):
    """Keep (or drop) records whose logger name starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...], keep: bool) -> None:
        super().__init__()
        self.prefixes, self.keep = prefixes, keep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith(self.prefixes) == self.keep


# the loggers of the controller's process (its console and its log file, whatever else the process runs)
CONTROLLER_LOGGERS = ("rlhf.controller", "rlhf.metaserver", "rlhf.launch", "rlhf.diagnosis", "rlhf.client")


def setup_logging(run_dir: str | None, role: str, rank: int = 0, console: bool = True,
                  routes: dict[tuple[str, ...], tuple[str, int]] | None = None,
                  console_prefixes: tuple[str, ...] | None = None) -> logging.Logger:
    """Log lines with timestamp, role and rank to <run_dir>/logs/<role>-<rank>.log (+ stderr).

    `routes` sends loggers by name prefix to another role's file, for a process that plays two
    roles (rank 0 is the controller and train worker 0): {("rlhf.controller",): ("controller", 0)}.
    `console_prefixes` limits what reaches stderr.
    """
    root = logging.getLogger("rlhf")
    root.setLevel(logging.INFO)
    root.propagate = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    fmt = _HostClock(LOG_FORMAT, DATE_FORMAT)
    routes = routes or {}
    routed = tuple(p for prefixes in routes for p in prefixes)

    def file_handler(r: str, k: int, filt: logging.Filter | None) -> None:
        fh = logging.FileHandler(os.path.join(run_dir, "logs", f"{r}-{k}.log"))  # type: ignore[arg-type]
        fh.setFormatter(fmt)
        if filt is not None:
            fh.addFilter(filt)  # route first, so only the accepting handler stamps role and rank
        fh.addFilter(_Context(r, k))
        root.addHandler(fh)

    if run_dir:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        file_handler(role, rank, _Route(routed, keep=False) if routed else None)
        for prefixes, (r, k) in routes.items():
            file_handler(r, k, _Route(prefixes, keep=True))
    if console:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        if console_prefixes:
            sh.addFilter(_Route(console_prefixes, keep=True))
        if not run_dir:
            sh.addFilter(_Context(role, rank))  # otherwise the file handlers stamped the record
        root.addHandler(sh)
    return root


class StepsWriter:
    """Appends one CSV row per step and flushes it, so a hang never loses finished steps."""

    def __init__(self, path: str, columns: list[str]) -> None:
        self.path = path
        self.columns = columns
        exists = os.path.exists(path) and os.path.getsize(path) > 0
        self._fh = open(path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._fh, fieldnames=columns, extrasaction="ignore")
        if not exists:
            self._writer.writeheader()
            self._fh.flush()

    def write(self, row: dict[str, Any]) -> None:
        self._writer.writerow({k: _fmt(row.get(k, "")) for k in self.columns})
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def _finite(value: Any) -> Any:
    """NaN and infinities become null: JSON has no such numbers (json.dump would write a bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(_finite(data), fh, indent=2, sort_keys=False, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)
