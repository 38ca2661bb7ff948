"""device_memory_leak: a process says it released its device memory, but keeps it.

The colocation failure behind scenario 6: the rollout side of a colocated pair "releases" its
memory at rollout_end and keeps it; its own work goes on, and the next fresh allocation on that
device — the train side's weights-upload buffer at the next weights update — fails with a CUDA
out-of-memory error, in another process and another stage. On CPU this is EMULATED through the
device ledger (rlhf.runtime.colocation): the leak is a record, and fresh allocations check it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DeviceMemoryLeak(FaultKind):
    NAME = "device_memory_leak"
    DOC = ("EMULATED on CPU: the target keeps leak_mb of its device after it releases it (a release that does not "
           "free); later fresh allocations on that device by any process sharing it raise torch.OutOfMemoryError "
           "until the leaking process exits or the fault is restored")
    PARAMS = {
        "leak_mb": ((float,), 79000.0, "device memory kept, MB"),
        "capacity_mb": ((float,), 81920.0, "emulated device capacity, MB"),
    }
    EMULATED = True
    BACKGROUND = True

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.path = ""

    def inject(self, hit: Hit) -> dict[str, Any]:
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
        return {"ledger_entry": os.path.exists(self.path)}

    def resources(self) -> dict[str, Any]:
        return {"paths": [self.path]} if self.path else {}

    def restore(self) -> dict[str, Any]:
        removed = bool(self.path) and os.path.exists(self.path)
        if removed:
            os.remove(self.path)
        self.active = False
        return {"removed": self.path if removed else ""}
