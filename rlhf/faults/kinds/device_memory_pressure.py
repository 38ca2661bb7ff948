"""device_memory_pressure: device memory in use grows until the target's next allocation fails.

On CPU there is no device memory, so this is an emulated device budget: usage grows from
`start_mb` at `rate_mb_s` from the first trigger, and every later trigger whose usage has
passed `capacity_mb` raises torch.OutOfMemoryError, as a CUDA allocation would. On a GPU use
memory_pressure with device: cuda for real allocations.
"""

from __future__ import annotations

import time
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DeviceMemoryPressure(FaultKind):
    NAME = "device_memory_pressure"
    DOC = ("EMULATED on CPU: a device memory budget that grows at rate_mb_s from the first trigger; once past "
           "capacity_mb the point raises torch.OutOfMemoryError (real device allocations: memory_pressure device=cuda)")
    PARAMS = {
        "capacity_mb": ((float,), 81920.0, "emulated device capacity, MB"),
        "start_mb": ((float,), 76000.0, "usage at the first trigger, MB"),
        "rate_mb_s": ((float,), 1024.0, "growth, MB per second"),
    }
    EMULATED = True

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.started: float | None = None

    def used_mb(self) -> float:
        if self.started is None:
            return 0.0
        return self.params["start_mb"] + self.params["rate_mb_s"] * (time.monotonic() - self.started)

    def inject(self, hit: Hit) -> dict[str, Any]:
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
        self.started, self.active = None, False
        return {}
