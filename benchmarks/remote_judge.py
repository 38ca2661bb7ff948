"""A reward function that stands for a judge on another machine: exact match, returned after a network round trip.

EMULATED: the round trip is `asyncio.sleep(RLHF_JUDGE_LATENCY_S)` (default 0.3 s) — wall time that uses no CPU
here, as a call to a remote LLM judge or a sandbox farm would. `benchmarks/async.py --judge-latency S` scores every
run with it, to measure what asynchronous GRPO hides of the rollout side's time spent off this machine's CPUs.

    python examples/grpo_trainer.py --reward.functions benchmarks/remote_judge.py:judged
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rlhf.tasks.rewards import exact_match


async def judged(completions: list[str], answers: list[str], **_: Any) -> list[float]:
    await asyncio.sleep(float(os.environ.get("RLHF_JUDGE_LATENCY_S", "0.3")))
    return exact_match(completions, answers)
