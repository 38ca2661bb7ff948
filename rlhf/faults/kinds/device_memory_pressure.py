"""device_memory_pressure: device memory in use grows until the target's next allocation fails.

On a GPU (the target process has a CUDA context: its model is on the GPU) the effect is real:
at the first trigger it allocates all but (capacity_mb - start_mb) of what
`torch.cuda.mem_get_info` reports free, then keeps allocating at `rate_mb_s` on a thread until
the card is full; every trigger asks the allocator for `probe_mb`, so once the card is full the
point raises the allocator's own torch.OutOfMemoryError. Restore frees everything.

On CPU there is no device memory, so it is an emulated device budget (EMULATED in its marker):
usage grows from `start_mb` at `rate_mb_s` from the first trigger, and every later trigger whose
usage has passed `capacity_mb` raises torch.OutOfMemoryError, as a CUDA allocation would.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DeviceMemoryPressure(FaultKind):
    NAME = "device_memory_pressure"
    DOC = ("REAL on a GPU (allocations capped by torch.cuda.mem_get_info's free memory; the allocator's own "
           "OutOfMemoryError), EMULATED on CPU: a device memory budget that grows at rate_mb_s from the first "
           "trigger; once past capacity_mb the point raises torch.OutOfMemoryError")
    PARAMS = {
        "capacity_mb": ((float,), 81920.0, "emulated device capacity, MB (GPU: the real card's)"),
        "start_mb": ((float,), 76000.0, "usage at the first trigger, MB (GPU: leave capacity_mb - start_mb free)"),
        "rate_mb_s": ((float,), 1024.0, "growth, MB per second"),
        "probe_mb": ((float,), 1536.0, "GPU: the allocation each trigger makes, MB (the step's next allocation)"),
    }
    @property
    def EMULATED(self) -> bool:  # type: ignore[override]  # read at every marker: real once the model is on a GPU
        return not self._gpu()

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.started: float | None = None
        self.blocks: list[Any] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    @staticmethod
    def _gpu() -> bool:
        """Real effect when this process already uses a GPU (its model is there)."""
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _grow(self, rate_mb_s: float) -> None:
        import torch

        chunk = 64 << 20
        while not self.stop.wait(chunk / (rate_mb_s * (1 << 20))):
            if torch.cuda.mem_get_info()[0] < chunk:
                return  # full: the next allocation anywhere in the process fails for real
            self.blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))

    def _inject_gpu(self) -> dict[str, Any]:
        import torch

        if self.started is None:
            self.started, self.active = time.monotonic(), True
            free = torch.cuda.mem_get_info()[0]
            leave = int((self.params["capacity_mb"] - self.params["start_mb"]) * (1 << 20))
            if free > leave:
                self.blocks.append(torch.empty(free - leave, dtype=torch.uint8, device="cuda"))
            self.stop.clear()
            self.thread = threading.Thread(target=self._grow, args=(self.params["rate_mb_s"],),
                                           name="fault-device-memory", daemon=True)
            self.thread.start()
        probe = torch.empty(int(self.params["probe_mb"] * (1 << 20)), dtype=torch.uint8, device="cuda")  # may OOM
        del probe
        held = sum(b.numel() for b in self.blocks)
        return {"held_mb": round(held / (1 << 20), 1), "free_mb": round(torch.cuda.mem_get_info()[0] / (1 << 20), 1)}

    def used_mb(self) -> float:
        if self.started is None:
            return 0.0
        return self.params["start_mb"] + self.params["rate_mb_s"] * (time.monotonic() - self.started)

    def inject(self, hit: Hit) -> dict[str, Any]:
        if not self.EMULATED:
            return self._inject_gpu()
        if self.started is None:
            self.started, self.active = time.monotonic(), True
        used, cap = self.used_mb(), self.params["capacity_mb"]
        if used >= cap:
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 1.50 GiB (GPU {max(hit.rank, 0)}; {cap / 1024:.2f} GiB total "
                f"capacity; {min(used, cap) / 1024:.2f} GiB already allocated) [emulated device budget]")
        return {"used_mb": round(used, 1), "capacity_mb": cap}

    def restore(self) -> dict[str, Any]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None
        freed = sum(b.numel() for b in self.blocks)
        self.blocks.clear()
        if freed:
            import torch

            torch.cuda.empty_cache()
        self.started, self.active = None, False
        return {"freed_mb": round(freed / (1 << 20), 1)} if freed else {}
