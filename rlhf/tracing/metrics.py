"""A resource sampler thread per process: <run-dir>/metrics/<role>-<rank>.csv at a fixed period.

Columns: wall time, CPU % of this process (and its children, e.g. fault burners are separate
processes and are sampled by their target's own file only if they are children), RSS, threads,
open fds, cumulative IO bytes, the process's current activity (the heartbeat: what it is doing
and since when), and GPU utilisation / memory through nvidia-ml-py when a GPU is present.
Every row is flushed, so the file is current even when the process hangs or is killed.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import threading
import time
from typing import Any

import psutil

from rlhf import clock

log = logging.getLogger("rlhf.metrics")

COLUMNS = ["time", "role", "rank", "pid", "cpu_percent", "children_cpu_percent", "system_cpu_percent", "rss_bytes",
           "threads", "open_fds", "io_read_bytes", "io_write_bytes", "activity", "activity_step", "activity_age_s", "gpu_util_percent", "gpu_mem_used_bytes",
           "gpu_power_w", "gpu_temp_c", "device_mem_process_bytes", "cpu_wait_percent", "disk_wait_threads",
           "io_pressure_percent"]


def _tasks() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return []


_DISK_WAIT: list[float] = [float("-inf"), 0]  # (when read, threads in disk wait): the process's, shared by callers


def disk_wait_threads(max_age_s: float = 0.25) -> int:
    """Threads of this process in uninterruptible (disk) wait, state D in /proc (Linux; 0 elsewhere). A reading at
    most max_age_s old is reused: it is one per process, and a simulated process answers the heartbeats of its 64
    ranks at once (a /proc pass for each made one read of a (1,024, 256) world's heartbeats take seconds)."""
    now = time.monotonic()
    if now - _DISK_WAIT[0] <= max_age_s:
        return int(_DISK_WAIT[1])
    count = 0
    for tid in _tasks():
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                count += fh.read().rsplit(")", 1)[1].split()[0] == "D"
        except (OSError, IndexError):
            continue
    _DISK_WAIT[:] = [now, count]
    return count


def thread_activity(tid: int) -> tuple[str, int]:
    """One thread of this process: its state letter (R running, S sleeping, D disk wait) and the CPU it has used,
    in clock ticks (Linux /proc; ('?', 0) elsewhere or once the thread is gone)."""
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime
    except (OSError, IndexError, ValueError):
        return "?", 0


def runqueue_wait_ns() -> dict[str, int]:
    """Per thread of this process: nanoseconds it spent runnable but waiting for a CPU (/proc schedstat)."""
    out = {}
    for tid in _tasks():
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as fh:
                out[tid] = int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def io_pressure() -> float | str:
    """The share of the last 10 s in which some task waited for IO, % (Linux PSI, system-wide); '' without PSI."""
    try:
        with open("/proc/pressure/io", encoding="ascii") as fh:
            return float(fh.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return ""


class Activity:
    """What this process is doing now (the heartbeat). Set by stage spans and RPC handlers."""

    def __init__(self) -> None:
        self.name, self.step, self.since = "idle", -1, time.time()

    def set(self, name: str, step: int = -1) -> None:
        self.name, self.step, self.since = name, step, time.time()


ACTIVITY = Activity()


class _Gpu:
    """nvidia-ml-py, imported lazily; absent or without a device it reports nothing."""

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("LOCAL_RANK") or "0").split(",")[0])
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except Exception as exc:  # ImportError on CPU installs, NVMLError without a driver
            log.debug("no GPU metrics: %s: %s", type(exc).__name__, exc)
            self.handle = None

    def sample(self) -> dict[str, Any]:
        """Utilisation %, device memory used (all processes), power (W) and temperature (C) of this GPU."""
        if self.handle is None:
            return {}
        nvml = self.nvml
        mine = 0
        try:  # this process's own device memory: who holds a device is evidence when another process OOMs
            mine = sum(p.usedGpuMemory or 0 for p in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                       if p.pid == os.getpid())
        except nvml.NVMLError:
            pass
        return {"device_mem_process_bytes": mine,
                "gpu_util_percent": nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu,
                "gpu_mem_used_bytes": nvml.nvmlDeviceGetMemoryInfo(self.handle).used,
                "gpu_power_w": round(nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0, 1),
                "gpu_temp_c": nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU)}


def _child_pids(pid: int) -> list[int]:
    """The children of `pid`: Linux lists them per thread (/proc/PID/task/TID/children), which costs what the
    process's threads cost; elsewhere (or without that file) psutil's scan of the process table."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                found += [int(x) for x in fh.read().split()]
        return found
    except (OSError, ValueError):
        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.Error:
            return []


def _is_service(proc: psutil.Process) -> bool:
    """One of our own services (scheduler, rollout server, a simulated world's hosts): it samples itself."""
    cmdline = proc.cmdline()
    return any(arg.startswith(("rlhf.services.", "rlhf.sim.")) for arg in cmdline[1:3])


class ResourceSampler:
    def __init__(self, run_dir: str, role: str, rank: int, interval_s: float = 1.0) -> None:
        self.path = os.path.join(run_dir, "metrics", f"{role}-{rank}.csv")
        self.run_dir = run_dir
        self.role, self.rank, self.interval_s = role, rank, interval_s
        self.proc = psutil.Process()
        self._stop = threading.Event()
        self._children: dict[int, psutil.Process] = {}
        self._services: set[int] = set()  # this process's children that are our services (_is_service)
        self._waits: dict[str, int] = {}
        self._waits_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{role}-{rank}", daemon=True)

    def start(self) -> "ResourceSampler":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def sample(self) -> dict[str, Any]:
        with self.proc.oneshot():
            try:
                io = self.proc.io_counters()
                io_read, io_write = io.read_bytes, io.write_bytes
            except (psutil.AccessDenied, AttributeError):
                io_read = io_write = ""
            row = {
                "time": round(clock.now(), 3), "role": self.role, "rank": self.rank, "pid": self.proc.pid,
                "cpu_percent": self.proc.cpu_percent(None), "rss_bytes": self.proc.memory_info().rss,
                "threads": self.proc.num_threads(), "open_fds": self.proc.num_fds(),
                "io_read_bytes": io_read, "io_write_bytes": io_write,
            }
        row["children_cpu_percent"] = round(self._children_cpu(), 1)
        row["system_cpu_percent"] = psutil.cpu_percent(None)
        row["cpu_wait_percent"] = round(self._cpu_wait(), 1)
        row["disk_wait_threads"] = disk_wait_threads()
        row["io_pressure_percent"] = io_pressure()
        row.update({"activity": ACTIVITY.name, "activity_step": ACTIVITY.step,
                    "activity_age_s": round(time.time() - ACTIVITY.since, 3)})
        return row

    def _emulated_device_held(self) -> int:
        """Device memory the emulated device ledger says this process keeps (EMULATED, CPU: device_memory_leak)."""
        total = 0
        for path in glob.glob(os.path.join(self.run_dir, "devices", "*.leak.json")):
            try:
                with open(path, encoding="utf-8") as fh:
                    leak = json.load(fh)
            except (OSError, ValueError):
                continue
            if leak.get("pid") == self.proc.pid:
                total += int(float(leak.get("leaked_mb", 0)) * (1 << 20))
        return total

    def _cpu_wait(self) -> float:
        """Run-queue wait of this process's threads since the last sample, % of wall time (starved of CPU when
        high: its threads were ready to run and no CPU was free); it may exceed 100 with several threads."""
        now, waits = time.monotonic(), runqueue_wait_ns()
        waited = sum(w - self._waits.get(tid, 0) for tid, w in waits.items() if tid in self._waits)
        elapsed = now - self._waits_at
        self._waits, self._waits_at = waits, now
        return max(0.0, waited / 1e9 / elapsed * 100) if elapsed > 0 else 0.0

    def _children_cpu(self) -> float:
        """CPU % of the processes this one started that are not our services (fault burners and writers, worker
        pools, compilers show here; a rollout server under the scheduler has its own row), with their children.
        Each process's children are read from its own /proc entry (_child_pids), not from the whole process table
        on every call as psutil's children() does: a simulated world's controller has 20 children."""
        total, seen = 0.0, set()
        direct = _child_pids(self.proc.pid)
        self._services &= set(direct)  # those that ended go (a pid read again later is a new process)
        for pid in direct:
            if pid in self._services:
                continue
            try:
                if _is_service(psutil.Process(pid)):  # kept: its command line does not change (one read between a
                    self._services.add(pid)         # fork and its exec is the parent's, so only a yes is kept)
                    continue
            except psutil.Error:
                continue
            family, i = [pid], 0
            while i < len(family):
                family += _child_pids(family[i])
                i += 1
            for member in family:
                seen.add(member)
                try:
                    total += self._child_percent(self._children.get(member) or psutil.Process(member))
                except psutil.Error:
                    continue
        for pid in set(self._children) - seen:
            del self._children[pid]
        return total

    def _child_percent(self, proc: psutil.Process) -> float:
        """CPU % of one child since the last sample; for a child seen for the first time, its average since it
        started (psutil's counter says 0.0 on a first call, which hid a short-lived burner that one sample saw)."""
        known = self._children.get(proc.pid)
        if known is not None:
            return known.cpu_percent(None)
        self._children[proc.pid] = proc
        with proc.oneshot():
            times, born = proc.cpu_times(), proc.create_time()
            proc.cpu_percent(None)  # primes the counter for the next sample
        age = time.time() - born
        return (times.user + times.system) / age * 100 if age > 0.05 else 0.0

    def _run(self) -> None:
        gpu = _Gpu()
        self.proc.cpu_percent(None)  # the first call primes the counter
        psutil.cpu_percent(None)
        with open(self.path, "a", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS)
            if fh.tell() == 0:
                writer.writeheader()
            while not self._stop.wait(self.interval_s):
                try:
                    row = self.sample()
                    row.update(gpu.sample())
                    held = self._emulated_device_held()
                    if held:
                        row["device_mem_process_bytes"] = int(row.get("device_mem_process_bytes") or 0) + held
                except psutil.Error as exc:
                    log.warning("metrics sample failed: %s", exc)
                    continue
                writer.writerow(row)
                fh.flush()


_sampler: ResourceSampler | None = None


def start_sampler(run_dir: str, role: str, rank: int, interval_s: float) -> ResourceSampler | None:
    """Start this process's sampler (once); interval 0 disables."""
    global _sampler
    if interval_s <= 0 or _sampler is not None:
        return _sampler
    _sampler = ResourceSampler(run_dir, role, rank, interval_s).start()
    return _sampler


def stop_sampler() -> None:
    global _sampler
    if _sampler is not None:
        _sampler.stop()
        _sampler = None
