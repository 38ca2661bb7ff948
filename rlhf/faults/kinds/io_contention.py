"""io_contention: real background writers doing write + fsync on the target path."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register
from rlhf.procs import spawn, stop_group


@register
class IoContention(FaultKind):
    NAME = "io_contention"
    DOC = "writer processes doing write+fsync loops (block_kb, files up to max_mb) in `path` for duration_s: real IO"
    PARAMS = {
        "writers": ((int,), 2, "writer processes"),
        "block_kb": ((int,), 1024, "write size, KB"),
        "max_mb": ((int,), 256, "each writer's file wraps at this size, MB"),
        "path": ((str,), "", "directory (default: <run-dir>/checkpoints)"),
    }
    BACKGROUND = True

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.procs: list[Any] = []
        self.paths: list[str] = []

    def inject(self, hit: Hit) -> dict[str, Any]:
        directory = self.params["path"] or os.path.join(self.run_dir, "checkpoints")
        os.makedirs(directory, exist_ok=True)
        self.active = True
        for i in range(self.params["writers"]):
            path = os.path.join(directory, f".rlhf-io-{os.getpid()}-{i}")
            self.paths.append(path)
            self.procs.append(spawn([sys.executable, "-m", "rlhf.faults.helpers", "write", "--path", path,
                                     "--block-kb", str(self.params["block_kb"]), "--max-mb", str(self.params["max_mb"])]))
        return {"writers": len(self.procs), "dir": directory}

    def verify(self) -> dict[str, Any]:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            sizes = [os.path.getsize(p) if os.path.exists(p) else 0 for p in self.paths]
            if all(sizes):
                return {"bytes_written": sum(sizes)}
            time.sleep(0.05)
        return {"bytes_written": 0}

    def resources(self) -> dict[str, Any]:
        return {"pids": [p.pid for p in self.procs], "paths": list(self.paths)}

    def restore(self) -> dict[str, Any]:
        for p in self.procs:
            stop_group(p, grace_s=0.5)
        removed = 0
        for path in self.paths:
            if os.path.exists(path):
                os.remove(path)
                removed += 1
        self.procs, self.paths, self.active = [], [], False
        return {"removed_files": removed}
