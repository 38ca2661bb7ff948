"""Containment: a job and everything it starts live and die together, however they detach (setsid, a double fork,
a daemon), in a cgroup of their own; with limits on its processes and memory where the kernel offers them.

    box = Cgroup.make("rlhf-1a2b-env-0", pids_max=512, memory_mb=0)   # None, with Cgroup.why, where there are none
    proc = spawn(cmd, join=box.join)          # the child joins it before it runs anything
    box.kill()                                # every process in it, SIGKILL (cgroup v2's cgroup.kill); the folders go
    sweep("rlhf-1a2b-")                       # what a killed scheduler left: every box of the run

cgroup v2 (at /sys/fs/cgroup, or the hybrid layout's /sys/fs/cgroup/unified) holds the processes and kills them at
once; the v1 `pids` and `memory` hierarchies, where mounted, carry the limits (pure v2: the same folder, when its
parent enables the controllers). Creating them needs root; without, `Cgroup.make` returns None and `Cgroup.why` says
why, and a process can still keep its orphans (`keep_orphans`: a child subreaper) and stop them as it exits
(`stop_descendants`), which a SIGKILL of it skips.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36
_V2 = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_V1 = {"pids": "/sys/fs/cgroup/pids", "memory": "/sys/fs/cgroup/memory"}


def _v2_root() -> str:
    return next((r for r in _V2 if os.path.exists(os.path.join(r, "cgroup.procs")) and
                 os.path.exists(os.path.join(r, "cgroup.controllers"))), "")


class Cgroup:
    why = ""  # why the last make() returned None

    def __init__(self, folders: list[str], kill_file: str) -> None:
        self.folders, self.kill_file = folders, kill_file

    @classmethod
    def make(cls, name: str, pids_max: int = 0, memory_mb: float = 0) -> Cgroup | None:
        """A fresh cgroup `name` (v2, for the kill) with the limits asked for (0: none); None when there is no
        cgroup v2 with cgroup.kill here or it cannot be written (Cgroup.why)."""
        root = _v2_root()
        if not root:
            cls.why = "no cgroup v2 mounted (/sys/fs/cgroup, /sys/fs/cgroup/unified)"
            return None
        main = os.path.join(root, name)
        try:
            os.makedirs(main, exist_ok=True)
        except OSError as exc:
            cls.why = f"cannot create {main}: {exc.strerror} (cgroups need root)"
            return None
        if not os.path.exists(os.path.join(main, "cgroup.kill")):
            os.rmdir(main)
            cls.why = "this kernel's cgroup v2 has no cgroup.kill (5.14 or later)"
            return None
        folders = [main]
        limits = {"pids": ("pids.max", str(pids_max)) if pids_max else None,
                  "memory": ("memory.max", str(int(memory_mb * 2**20))) if memory_mb else None}
        for controller, limit in limits.items():
            if limit is None:
                continue
            if os.path.exists(os.path.join(main, limit[0])):  # pure v2: the controller is enabled here
                _write(os.path.join(main, limit[0]), limit[1])
            elif os.path.isdir(_V1[controller]):  # the hybrid layout: the v1 hierarchy carries it
                v1 = os.path.join(_V1[controller], name)
                os.makedirs(v1, exist_ok=True)
                _write(os.path.join(v1, "pids.max" if controller == "pids" else "memory.limit_in_bytes"), limit[1])
                folders.append(v1)
        return cls(folders, os.path.join(main, "cgroup.kill"))

    def join(self) -> None:
        """The calling process (a child before exec: preexec_fn) moves into every folder."""
        for folder in self.folders:
            _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.folders[0], "cgroup.procs"), encoding="utf-8") as fh:
                return [int(p) for p in fh.read().split()]
        except OSError:
            return []

    def kill(self, timeout_s: float = 5.0) -> list[str]:
        """SIGKILL everything in it and remove its folders; returns what was still in it ("1234 sleep")."""
        left = [_describe(p) for p in self.pids()]
        try:
            _write(self.kill_file, "1")
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.02)  # a poll of the kernel's list: the kill is asynchronous
        for folder in reversed(self.folders):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        return left


def run_prefix(run_dir: str) -> str:
    """The names of a run's cgroups start with this (one run directory, one prefix)."""
    return f"rlhf-{hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:10]}-"


def sweep(prefix: str) -> list[str]:
    """Kill and remove every cgroup whose name starts with `prefix` (what a killed scheduler left); returns what was
    still in them."""
    root = _v2_root()
    if not root or not prefix:
        return []
    left: list[str] = []
    for name in sorted(os.listdir(root)):
        if name.startswith(prefix) and os.path.isdir(os.path.join(root, name)):
            folders = [os.path.join(root, name)] + [os.path.join(v1, name) for v1 in _V1.values()
                                                    if os.path.isdir(os.path.join(v1, name))]
            left += Cgroup(folders, os.path.join(root, name, "cgroup.kill")).kill()
    return left


def keep_orphans() -> bool:
    """Make this process a child subreaper: a descendant whose parent dies is re-parented here, not to init, so
    stop_descendants finds it. False off Linux or when the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stop_descendants(grace_s: float = 1.0) -> list[str]:
    """SIGTERM every descendant of this process (its own sessions too), SIGKILL what is left after grace_s; returns
    what there was ("1234 sleep")."""
    kids = psutil.Process().children(recursive=True)
    found = [_describe(k.pid) for k in kids]
    for k in kids:
        try:
            k.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(kids, timeout=grace_s)
    for k in alive:
        try:
            k.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return found


def _describe(pid: int) -> str:
    try:
        return f"{pid} {psutil.Process(pid).name()}"
    except psutil.Error:
        return str(pid)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
