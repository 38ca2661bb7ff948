"""device_memory_leak: a process says it released its device memory, but keeps it.

The colocation failure behind scenario 6: the rollout side of a colocated pair "releases" its
memory at rollout_end and keeps it; its own work goes on, and the next fresh allocation on that
device — the train side's weights-upload buffer at the next weights update — fails with a CUDA
out-of-memory error, in another process and another stage.

On a GPU (the target process has a CUDA context: its model is on the GPU) the leak is real: the
target allocates what its card has free, all but `capacity_mb - leak_mb` (the card the scenario
describes: 79 of 80 GB kept leaves 2,920 MB), and holds it until the fault is restored or the
process exits; the next allocation that does not fit, in any process on that card, fails with the
allocator's own torch.OutOfMemoryError. A tiny model fits in what is left: `leak_mb` equal to
`capacity_mb` keeps the whole card. On CPU it is EMULATED through the device ledger
(rlhf.services.colocation): the leak is a record, and fresh allocations check it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DeviceMemoryLeak(FaultKind):
    NAME = "device_memory_leak"
    DOC = ("REAL on a GPU (the target allocates all but capacity_mb - leak_mb of its card's free memory and keeps "
           "it; the next allocation that does not fit fails with the allocator's own OutOfMemoryError), EMULATED "
           "on CPU: the target keeps leak_mb of its device after it releases it (a release that does not free); "
           "later fresh allocations on that device by any process sharing it raise torch.OutOfMemoryError until "
           "the leaking process exits or the fault is restored")
    PARAMS = {
        "leak_mb": ((float,), 79000.0, "device memory kept, MB (GPU: leaves capacity_mb - leak_mb of the card free)"),
        "capacity_mb": ((float,), 81920.0, "emulated device capacity, MB (GPU: the real card's)"),
    }
    BACKGROUND = True

    @property
    def EMULATED(self) -> bool:  # type: ignore[override]  # read at every marker: real once the model is on a GPU
        from rlhf.faults.kinds.device_memory_pressure import DeviceMemoryPressure

        return not DeviceMemoryPressure._gpu()

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.path = ""
        self.blocks: list[Any] = []

    def _inject_gpu(self) -> dict[str, Any]:
        """Take what the card has free, all but capacity_mb - leak_mb, in 64 MB blocks and then 2 MB ones (what is
        free is not all one piece)."""
        import torch

        self.active = True
        leave = max(0.0, self.params["capacity_mb"] - self.params["leak_mb"]) * (1 << 20)
        for chunk in (64 << 20, 2 << 20):
            while torch.cuda.mem_get_info()[0] - chunk >= leave:
                try:
                    self.blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
        held = sum(b.numel() for b in self.blocks)
        return {"held_mb": round(held / (1 << 20), 1), "free_mb": round(torch.cuda.mem_get_info()[0] / (1 << 20), 1)}

    def inject(self, hit: Hit) -> dict[str, Any]:
        if not self.EMULATED:
            return self._inject_gpu()
        device = str(hit.context.get("device") or f"{hit.role}-{hit.rank}")
        from rlhf.devices import leak_path  # at use: rlhf.devices loads torch, and the fault helpers must start fast

        self.path = leak_path(self.run_dir, device)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        record = {"device": device, "by": f"{hit.role}-{hit.rank}", "pid": os.getpid(),
                  "leaked_mb": self.params["leak_mb"], "capacity_mb": self.params["capacity_mb"]}
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(tmp, self.path)
        self.active = True
        return {"device": device, "leaked_mb": self.params["leak_mb"]}

    def verify(self) -> dict[str, Any]:
        if self.blocks:
            return {"held_mb": round(sum(b.numel() for b in self.blocks) / (1 << 20), 1)}
        return {"ledger_entry": os.path.exists(self.path)}

    def resources(self) -> dict[str, Any]:
        return {"paths": [self.path]} if self.path else {}

    def restore(self) -> dict[str, Any]:
        if self.blocks:
            import torch

            freed = sum(b.numel() for b in self.blocks)
            self.blocks.clear()
            torch.cuda.empty_cache()
            self.active = False
            return {"freed_mb": round(freed / (1 << 20), 1)}
        removed = bool(self.path) and os.path.exists(self.path)
        if removed:
            os.remove(self.path)
        self.active = False
        return {"removed": self.path if removed else ""}
