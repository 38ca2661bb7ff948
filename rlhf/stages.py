"""Canonical stage names (the step order of docs/runtime.md) and a timer for them.

Stage names are shared by spans, fault points, logs, metrics and the CLI; use these constants.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from rlhf import tracing
from rlhf.tracing.metrics import ACTIVITY

STAGES = (
    "weights_update",
    "events",
    "rollout",
    "reward",
    "reference",
    "advantage",
    "train",
    "latest_recover_save",
    "periodic_recover_save",
    "cleanup",
)


class StageClock:
    """Wall time per stage for one step, each stage a span: `with clock.stage("rollout"): ...`."""

    def __init__(self, step: int = -1, claim: bool = True) -> None:
        """claim: the stage is the process's current activity (heartbeat, watchdog); off for a clock on a side
        thread (the async rollout producer), whose stages are not what the process is doing."""
        self.step, self.claim = step, claim
        self.seconds: dict[str, float] = {}
        self.current = ""  # the stage running now; left set when a stage raises (where a failure happened)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; canonical stages: {', '.join(STAGES)}")
        if self.claim:
            ACTIVITY.set(name, self.step)
        self.current = name
        start = time.perf_counter()
        try:
            with tracing.span(name, stage=name, step=self.step):
                yield
            self.current = ""
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            tracing.flush_soon()  # a stage boundary: what ended is exported now, not at the next export period
