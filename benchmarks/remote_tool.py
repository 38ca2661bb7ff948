"""An environment whose every turn calls a tool on another machine: for measuring how episodes share a step.

EMULATED: each call's round trip is `time.sleep` (wall time that uses no CPU here, as a search API, a sandbox farm or
a remote judge would take) of RLHF_TOOL_LATENCY_S (default 0.05 s), and one call in RLHF_TOOL_TAIL_EVERY (default 32)
takes RLHF_TOOL_TAIL_S (default 2 s) instead: a long tail. Which calls are slow is drawn from the episode's prompt and
turn, so every run of the same prompts has the same slow calls. `benchmarks/episodes.py` runs it.

    python examples/grpo_trainer.py --env.path benchmarks/remote_tool.py:Chain --env.max_turns 4

Chain makes the call for the model at each of its first RLHF_TOOL_CALLS turns (default 3; whatever the model wrote: an
untrained model does not call tools) and ends the episode at the next; the answer is `<tool_response>ok</tool_response>`.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from rlhf.envs import Env, StepResult


class Chain(Env):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.latency = float(os.environ.get("RLHF_TOOL_LATENCY_S", "0.05"))
        self.tail_every = int(os.environ.get("RLHF_TOOL_TAIL_EVERY", "32"))
        self.tail_s = float(os.environ.get("RLHF_TOOL_TAIL_S", "2"))
        self.calls = int(os.environ.get("RLHF_TOOL_CALLS", "3"))
        self.current_tool: str | None = None
        self.prompt, self.turn = "", 0

    def reset(self, row: dict[str, Any]) -> str:
        self.prompt, self.turn = str(row.get("prompt", "")), 0
        return ""

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn > self.calls:
            return StepResult(done=True, info={"tool_calls": 0})
        slow = random.Random(f"{self.prompt}|{self.turn}").randrange(self.tail_every) == 0
        self.current_tool = "remote"
        try:
            time.sleep(self.tail_s if slow else self.latency)
        finally:
            self.current_tool = None
        return StepResult(observation="<tool_response>ok</tool_response>", info={"tool_calls": 1})
