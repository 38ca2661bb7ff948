"""Progress of long work: one line that updates in place on a terminal, plain log lines otherwise.

    progress = Progress("sft warm start", total=200, log=log)
    progress.update(step, loss=0.41, val=0.18)   # 'sft warm start 40/200 (20%) loss 0.410 val 0.180, ETA 0:32'
    progress.close()

On a TTY the line is rewritten at most every `tty_every_s`; elsewhere (a log file, CI) a log
line goes out at most every `every_s`, so nothing is silent for long and logs do not flood.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, TextIO


class Progress:
    def __init__(self, what: str, total: int, log: logging.Logger, stream: TextIO | None = None,
                 every_s: float = 10.0, tty_every_s: float = 0.2, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.log, self.clock = what, total, log, clock
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = tty_every_s if self.tty else every_s
        self.start = self.last = clock()
        self.shown = False

    def line(self, done: int, fields: dict[str, Any]) -> str:
        elapsed = self.clock() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        extra = "".join(f" {k} {v:.3f}" if isinstance(v, float) else f" {k} {v}" for k, v in fields.items()
                        if v is not None)
        return (f"{self.what} {done}/{self.total} ({100 * done / max(1, self.total):.0f}%){extra}, "
                f"ETA {int(eta // 60)}:{int(eta % 60):02d}")

    def update(self, done: int, **fields: Any) -> None:
        now = self.clock()
        if now - self.last < self.every_s and done < self.total:
            return
        self.last = now
        text = self.line(done, fields)
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self.shown = True
        else:
            self.log.info("%s", text)

    def close(self) -> None:
        """End the in-place line (the next log line starts on its own line)."""
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
