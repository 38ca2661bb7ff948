"""The device lease: who may use device r, train rank r or rollout server r (colocation).

A real cross-process lock (flock on <run_dir>/devices/device-<r>.lock): a lost `rollout_end`
event leaves the train side blocked on a lock the rollout side never releases — a real
deadlock, not a simulated one. The kernel drops the lock when the holder dies.
"""

from __future__ import annotations

import fcntl
import os
import time


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
                        f"device {self.device}: out of memory — held by the colocated peer, {self.holder} waited "
                        f"{timeout_s:g} s (lease {self.path})"
                    ) from None
                time.sleep(0.01)
        os.ftruncate(fd, 0)
        os.write(fd, f"{self.holder} pid {os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
