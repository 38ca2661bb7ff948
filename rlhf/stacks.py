"""Hang forensics: the Python stacks of every live process of a run, on demand, with no debugger.

    each process at its start (exits.record_start):  faulthandler on SIGUSR2 → RUN_DIR/stacks/<process>.txt
    the stall watchdog (or anyone):                   stacks.dump(run_dir, why, exits.all_lives(run_dir))
                                                      → SIGUSR2 to every live process

faulthandler writes from its C signal handler, so a process whose threads are stuck in C code (a collective,
a lock, a read) or hold the GIL still dumps every thread. Files that stayed empty are removed at the run's end.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from typing import IO

SIGNAL = signal.SIGUSR2
_FILE: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def path_of(run_dir: str, process: str) -> str:
    return os.path.join(run_dir, "stacks", f"{process}.txt")


def arm(run_dir: str, process: str) -> None:
    """This process dumps the stacks of all its threads to RUN_DIR/stacks/<process>.txt on SIGUSR2."""
    global _FILE
    os.makedirs(os.path.join(run_dir, "stacks"), exist_ok=True)
    _FILE = open(path_of(run_dir, process), "a", encoding="utf-8")  # stays open: faulthandler keeps its fd
    faulthandler.register(SIGNAL, file=_FILE, all_threads=True, chain=False)


def dump(run_dir: str, why: str, lives: list[dict], timeout_s: float = 2.0) -> dict[str, str]:
    """Ask every live process of the run for its stacks; returns {process: file} of those that wrote them.

    lives: the run's process lives (`exits.all_lives(run_dir)`: exits arms this module at every process start,
    so this module does not read them itself)."""
    waiting: dict[str, tuple[str, int]] = {}
    for life in lives:
        name, pid = life["process"], life["pid"]
        path = path_of(run_dir, name)
        if life["end"] is not None or not pid or not os.path.exists(path):
            continue
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"\n=== stacks of {name} (pid {pid}) at {time.strftime('%Y-%m-%dT%H:%M:%S')}: {why}\n")
            size = os.path.getsize(path)  # the dump is what comes after the header
            if pid == os.getpid():
                # this process (the watchdog's: rank 0) writes its own under the GIL: faulthandler's signal-time dump
                # of all threads can crash a process whose threads are being started meanwhile (a GPF in libpython
                # took rank 0 down once, as its stall diagnosis thread started)
                _write_own(path)
            else:
                os.kill(pid, SIGNAL)
        except OSError:  # gone since (ProcessLookupError), or its file went away
            continue
        waiting[name] = (path, size)
    written: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for name, (path, size) in list(waiting.items()):
            if os.path.getsize(path) > size:
                written[name] = path
                del waiting[name]
        time.sleep(0.05)
    return written


def _write_own(path: str) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(path, "a", encoding="utf-8") as fh:
        for ident, frame in sys._current_frames().items():
            fh.write(f"\nThread 0x{ident:016x} ({names.get(ident, '?')}) (most recent call first):\n")
            for line in reversed(traceback.format_stack(frame)):
                fh.write(line)


def tidy(run_dir: str) -> None:
    """Remove the stacks files nobody asked for (and the folder when nothing is left)."""
    folder = os.path.join(run_dir, "stacks")
    try:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.getsize(path) == 0:
                os.remove(path)
        os.rmdir(folder)
    except OSError:
        pass
