"""Progress lines: in place on a terminal, rate-limited plain log lines elsewhere, with an ETA."""

import io
import logging

from rlhf.progress import Progress


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_at_most_every_interval_with_eta(caplog):
    clock, stream = _Clock(), io.StringIO()
    progress = Progress("sft warm start", 100, logging.getLogger("t.progress"), stream=stream, every_s=10, clock=clock)
    with caplog.at_level("INFO", logger="t.progress"):
        for step in range(1, 101):
            clock.t = step * 0.5  # 0.5 s a step: a line every 20 steps, and the last one
            progress.update(step, loss=1.0 / step, val=None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and stream.getvalue() == ""  # not a terminal: log lines only, every 20 steps
    assert lines[0] == "sft warm start 20/100 (20%) loss 0.050, ETA 0:40"  # 10 s for 20 steps: 40 s for 80 more
    assert lines[-1].startswith("sft warm start 100/100 (100%)") and lines[-1].endswith("ETA 0:00")


def test_a_terminal_gets_one_line_rewritten_in_place(caplog):
    clock, stream = _Clock(), io.StringIO()
    progress = Progress("sft warm start", 10, logging.getLogger("t.progress"), stream=stream, tty=True, clock=clock)
    with caplog.at_level("INFO", logger="t.progress"):
        for step in range(1, 11):
            clock.t = step
            progress.update(step, val=0.25)
        progress.close()
    out = stream.getvalue()
    assert out.count("\r\033[K") == 10 and out.endswith("sft warm start 10/10 (100%) val 0.250, ETA 0:00\n")
    assert not caplog.records
