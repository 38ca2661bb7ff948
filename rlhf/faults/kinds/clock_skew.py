"""clock_skew: the target's view of wall time (rlhf.clock.now) is shifted by offset_s."""

from __future__ import annotations

import time
from typing import Any

from rlhf import clock
from rlhf.faults.kinds import FaultKind, Hit, register


@register
class ClockSkew(FaultKind):
    NAME = "clock_skew"
    DOC = ("shift the target process's wall clock (rlhf.clock.now: per-rank duration limits, leases) by offset_s "
           "for duration_s; the OS clock is untouched")
    PARAMS = {"offset_s": ((float,), 60.0, "seconds added to the target's wall time (may be negative)")}
    BACKGROUND = True

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        return None  # negative offsets are fine

    def inject(self, hit: Hit) -> dict[str, Any]:
        clock.set_skew(clock.skew() + self.params["offset_s"])
        self.active = True
        return {"offset_s": self.params["offset_s"]}

    def verify(self) -> dict[str, Any]:
        return {"observed_skew_s": round(clock.now() - time.time(), 3)}

    def restore(self) -> dict[str, Any]:
        clock.set_skew(clock.skew() - self.params["offset_s"])
        self.active = False
        return {}
