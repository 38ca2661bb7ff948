"""process_kill: the target process is killed at the point (SIGKILL by default: no cleanup runs)."""

from __future__ import annotations

import os
import signal
from typing import Any

from rlhf import tracing
from rlhf.faults.kinds import FaultKind, Hit, register

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


@register
class ProcessKill(FaultKind):
    NAME = "process_kill"
    DOC = "kill the target process at the point with `signal` (KILL, TERM, INT): a real kill"
    PARAMS = {"signal": ((str,), "KILL", "KILL, TERM or INT")}

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "signal" and value not in SIGNALS:
            return f"{value!r} is not a signal; choose one of: {', '.join(SIGNALS)}"
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        tracing.flush()  # what is finished so far reaches the trace files
        os.kill(os.getpid(), SIGNALS[self.params["signal"]])
        return {"signal": self.params["signal"]}
