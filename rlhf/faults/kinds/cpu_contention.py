"""cpu_contention: real burner processes at a target load, pinned to the target's CPUs."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psutil

from rlhf.faults.kinds import FaultKind, Hit, register
from rlhf.procs import spawn, stop_group


@register
class CpuContention(FaultKind):
    NAME = "cpu_contention"
    DOC = "burner processes (load 0..1 each) pinned to the target process's CPUs, for duration_s: real CPU burnt"
    PARAMS = {
        "load": ((float,), 0.95, "duty cycle of each burner, 0..1"),
        "burners": ((int,), 0, "burner processes (0 = one per CPU the target may run on)"),
    }
    BACKGROUND = True

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "load" and not 0.0 < value <= 1.0:
            return f"{value} is outside (0, 1]"
        return super().check_param(key, value)

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.procs: list[Any] = []

    def inject(self, hit: Hit) -> dict[str, Any]:
        cpus = sorted(os.sched_getaffinity(0))
        n = self.params["burners"] or len(cpus)
        self.active = True
        for i in range(n):
            self.procs.append(spawn([sys.executable, "-m", "rlhf.faults.helpers", "burn", "--load",
                                     str(self.params["load"]), "--cpu", str(cpus[i % len(cpus)])]))
        return {"burners": n, "cpus": ",".join(map(str, cpus)), "load": self.params["load"]}

    def verify(self) -> dict[str, Any]:
        """Burners measured burning: total CPU % over 0.3 s."""
        ps = [psutil.Process(p.pid) for p in self.procs if p.poll() is None]
        for p in ps:
            p.cpu_percent(None)
        time.sleep(0.3)
        total = 0.0
        for p in ps:
            try:
                total += p.cpu_percent(None)
            except psutil.NoSuchProcess:
                pass
        return {"burner_cpu_percent": round(total, 1)}

    def resources(self) -> dict[str, Any]:
        return {"pids": [p.pid for p in self.procs]}

    def restore(self) -> dict[str, Any]:
        codes = [stop_group(p, grace_s=0.5) for p in self.procs]
        self.procs, self.active = [], False
        return {"stopped_burners": len(codes)}
