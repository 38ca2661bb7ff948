"""network_delay: the request waits delay ± jitter before it leaves (or is handled); per peer."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from rlhf.faults.kinds import REQUIRED, FaultKind, Hit, register


@register
class NetworkDelay(FaultKind):
    NAME = "network_delay"
    DOC = "delay ± jitter on a transport point, per peer (target.peer); a real wall-clock wait of that request"
    PARAMS = {
        "delay_ms": ((float,), REQUIRED, "delay in milliseconds"),
        "jitter_ms": ((float,), 0.0, "uniform jitter ± milliseconds"),
        "seed": ((int,), 0, "jitter random seed"),
    }

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.rng = random.Random(self.params["seed"])

    def _delay_s(self) -> float:
        jitter = self.params["jitter_ms"]
        return max(0.0, self.params["delay_ms"] + self.rng.uniform(-jitter, jitter)) / 1000.0

    def inject(self, hit: Hit) -> dict[str, Any]:
        delay, t0 = self._delay_s(), time.perf_counter()
        time.sleep(delay)
        return {"delay_ms": round(delay * 1000, 1), "measured_ms": round((time.perf_counter() - t0) * 1000, 1)}

    async def ainject(self, hit: Hit) -> dict[str, Any]:
        delay, t0 = self._delay_s(), time.perf_counter()
        await asyncio.sleep(delay)
        return {"delay_ms": round(delay * 1000, 1), "measured_ms": round((time.perf_counter() - t0) * 1000, 1)}
