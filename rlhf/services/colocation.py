"""The device lease: who may use device r, train rank r or rollout server r (colocation).

A real cross-process lock (flock on <run_dir>/devices/device-<r>.lock): a lost `rollout_end`
event leaves the train side blocked on a lock the rollout side never releases — a real
deadlock, not a simulated one. The kernel drops the lock when the holder dies.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

import torch

from rlhf.devices import leak_path


class DeviceBusy(RuntimeError):
    """The device is held by the colocated peer: on a GPU this would be an out-of-memory error."""


class DeviceLease:
    def __init__(self, run_dir: str, device: int, holder: str) -> None:
        os.makedirs(os.path.join(run_dir, "devices"), exist_ok=True)
        self.path = os.path.join(run_dir, "devices", f"device-{device}.lock")
        self.device, self.holder = device, holder
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout_s: float) -> None:
        """Take the device, waiting up to timeout_s (0 = try once). Raises DeviceBusy."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise DeviceBusy(
                        f"device {self.device}: out of memory — held by {self.current_holder() or 'the colocated peer'}"
                        f" (lease {self.path}); {self.holder} waited {timeout_s:g} s"
                    ) from None
                time.sleep(0.01)
        os.ftruncate(fd, 0)
        os.write(fd, f"{self.holder} pid {os.getpid()}\n".encode())
        self._fd = fd

    def current_holder(self) -> str:
        """Who holds the lease now, as the holder wrote it ('train-0 pid 123'), or ''."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError:
            return ""

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------- the emulated device ledger
#
# On CPU there is no device memory. The fault kind device_memory_leak records, per device, memory a
# process kept after it said it released it (<run_dir>/devices/<device>.leak.json). Fresh device
# allocations (a weights-upload buffer, a KV cache, a weights load) check the ledger and fail the way
# CUDA's allocator would. Allocations a process reuses from its own cache (train steps) do not.


def device_name(role: str, rank: int, colocate: bool) -> str:
    """The device a process computes on: colocated pair r shares device-r; otherwise each has its own."""
    return f"device-{rank}" if colocate else f"{role}-{rank}"


def read_leak(run_dir: str, device: str) -> dict | None:
    try:
        with open(leak_path(run_dir, device), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def fresh_allocation(run_dir: str, device: str, nbytes: int, what: str) -> None:
    """A new device allocation of nbytes for `what`; raises torch.OutOfMemoryError when the device is full."""
    leak = read_leak(run_dir, device)
    if leak is None:
        return

    mib = nbytes / (1 << 20)
    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {mib:.2f} MiB for {what} ({device}; {leak['capacity_mb'] / 1024:.2f} GiB "
        f"total capacity; {leak['leaked_mb'] / 1024:.2f} GiB reserved by another process; 0 bytes free) "
        "[emulated device ledger]")
