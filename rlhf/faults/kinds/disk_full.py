"""disk_full: ENOSPC at write points (emulated), or a real fill file in a size-bounded way."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DiskFull(FaultKind):
    NAME = "disk_full"
    DOC = ("mode enospc (EMULATED): the write point raises OSError ENOSPC; mode fill: a real fill file of fill_mb "
           "(never leaving less than keep_free_mb) in `path`, removed on restore or by the survivor's audit")
    PARAMS = {
        "mode": ((str,), "enospc", "enospc or fill"),
        "path": ((str,), "", "directory to fill (default: <run-dir>/checkpoints)"),
        "fill_mb": ((float,), 256.0, "fill file size, MB (fill mode)"),
        "keep_free_mb": ((float,), 2048.0, "never leave less free space than this, MB (fill mode)"),
        "partial": ((float,), 0.0, "enospc mode: the file ends at this fraction of its size (0 = where the point is)"),
    }

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "mode" and value not in ("enospc", "fill"):
            return f"{value!r} is not a mode; choose enospc or fill"
        if key == "partial" and not 0.0 <= value < 1.0:
            return f"{value} is outside [0, 1)"
        return super().check_param(key, value)

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.BACKGROUND = self.params["mode"] == "fill"
        self.EMULATED = self.params["mode"] == "enospc"
        self.fill_path = ""

    def _dir(self) -> str:
        return self.params["path"] or os.path.join(self.run_dir, "checkpoints")

    def inject(self, hit: Hit) -> dict[str, Any]:
        where = hit.context.get("path", self._dir())
        if self.params["mode"] == "enospc":
            if self.params["partial"] > 0:  # the writer writes this much, truncates there and raises ENOSPC
                return {"truncate_at": self.params["partial"], "path": where}
            raise OSError(errno.ENOSPC, "No space left on device [disk_full, emulated]", where)
        directory = self._dir()
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
        size = int(max(0, min(self.params["fill_mb"] * (1 << 20), free - self.params["keep_free_mb"] * (1 << 20))))
        self.fill_path = os.path.join(directory, f".rlhf-fill-{os.getpid()}")
        self.active = True
        block = b"\0" * (1 << 20)
        with open(self.fill_path, "wb") as fh:
            for _ in range(size >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return {"fill_bytes": size, "free_before": free}

    def verify(self) -> dict[str, Any]:
        if not self.fill_path:
            return {}
        return {"fill_file_bytes": os.path.getsize(self.fill_path) if os.path.exists(self.fill_path) else 0}

    def resources(self) -> dict[str, Any]:
        return {"paths": [self.fill_path]} if self.fill_path else {}

    def restore(self) -> dict[str, Any]:
        removed = False
        if self.fill_path and os.path.exists(self.fill_path):
            os.remove(self.fill_path)
            removed = True
        self.active = False
        return {"removed": self.fill_path if removed else ""}
