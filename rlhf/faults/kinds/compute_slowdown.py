"""compute_slowdown: the target train rank's compute takes `factor` times as long (a straggler), for duration_s.

On a real train rank every forward/backward is followed by (factor - 1) x its own time of real extra compute
(matmuls on the rank's device), before the gradient all-reduce: the rank really computes longer and the others
really wait for it. On a simulated rank (rlhf.sim) its EMULATED compute's seconds are multiplied by `factor`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register

_FACTORS: dict[tuple[str, int], float] = {}  # (role, rank) -> its slowdown, while a fault holds it
_LOCK = threading.Lock()


def factor(role: str, rank: int) -> float:
    """How many times slower this rank's compute is now (1.0: no fault)."""
    return _FACTORS.get((role, rank), 1.0) if _FACTORS else 1.0


def stretch(role: str, rank: int, seconds: float, device: Any = "cpu") -> float:
    """A real rank after `seconds` of compute: (factor - 1) x seconds more of real compute on `device` (matmuls
    until the deadline); returns the seconds added (0 without the fault)."""
    extra = (factor(role, rank) - 1.0) * seconds
    if extra <= 0:
        return 0.0
    import torch

    a = torch.rand(256, 256, device=device)
    deadline = time.perf_counter() + extra
    while time.perf_counter() < deadline:
        b = a @ a
        if b.device.type == "cuda":
            torch.cuda.synchronize(b.device)
    return extra


@register
class ComputeSlowdown(FaultKind):
    NAME = "compute_slowdown"
    DOC = ("make the target train rank's compute `factor` times as long from the point on, for duration_s (0: the "
           "rest of the run): a straggler. Real ranks add real compute (matmuls on their device) after each "
           "forward/backward; simulated ranks (sim.*) multiply their EMULATED compute")
    PARAMS = {"factor": ((float, int), 3.0, "how many times as long the rank's compute takes (> 1)")}
    BACKGROUND = True

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "factor" and not value > 1.0:
            return f"must be > 1 (a slowdown), got {value}"
        return super().check_param(key, value)

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        if target.role != "train":
            return "slows a train rank's compute: target.role must be train (with its rank)"
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        self.who = (hit.role, hit.rank)
        with _LOCK:
            _FACTORS[self.who] = _FACTORS.get(self.who, 1.0) * float(self.params["factor"])
        self.active = True
        return {"factor": float(self.params["factor"]), "rank": hit.rank}

    def verify(self) -> dict[str, Any]:
        return {"compute_factor": factor(*self.who)}

    def restore(self) -> dict[str, Any]:
        if self.active:
            with _LOCK:
                left = _FACTORS.get(self.who, 1.0) / float(self.params["factor"])
                if abs(left - 1.0) < 1e-9:
                    _FACTORS.pop(self.who, None)
                else:
                    _FACTORS[self.who] = left
        self.active = False
        return {}
