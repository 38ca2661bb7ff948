"""hang: the point blocks — for `duration_s`, or until the fault is restored (run end)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class Hang(FaultKind):
    NAME = "hang"
    DOC = "block at the point for duration_s (0 = until restored at run end); the caller sees no reply"
    PARAMS: dict = {}

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.release = threading.Event()

    def _limit(self) -> float | None:
        return self.spec.duration_s or None

    def inject(self, hit: Hit) -> dict[str, Any]:
        self.active, t0 = True, time.perf_counter()
        self.release.wait(self._limit())
        self.active = False
        return {"hung_s": round(time.perf_counter() - t0, 3)}

    async def ainject(self, hit: Hit) -> dict[str, Any]:
        self.active, t0 = True, time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, self._limit())
        self.active = False
        return {"hung_s": round(time.perf_counter() - t0, 3)}

    def restore(self) -> dict[str, Any]:
        self.release.set()
        self.active = False
        return {"released": True}
