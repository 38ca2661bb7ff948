"""WorkerGroup: the controller's handle on every train rank (SPMD: one call runs on all of them)."""

from __future__ import annotations

import asyncio
from typing import Any

from rlhf.control.watchdog import StallWatchdog
from rlhf.train.parallel import Layout
from rlhf.transport.client import Client, LoopThread


class WorkerGroup:
    """RPC clients for every train rank; `call` runs a method on all of them concurrently."""

    def __init__(self, urls: list[str], token: str, loop: LoopThread, timeout_s: float, checksums: bool = False,
                 retries: bool = False) -> None:
        """checksums: send per-tensor digests with the batches (the policy's stage_checksums); retries: the
        policy's retry_idempotent (only /compute_logprobs and GETs are repeated)."""
        self.clients = [Client(u, token, timeout_s, peer=f"train-{r}", checksums=checksums, retries=retries)
                        for r, u in enumerate(urls)]
        self.loop = loop
        self.watchdog: StallWatchdog | None = None  # set by the controller: reads heartbeats while a call runs
        self.layout: Layout | None = None  # set by the controller: the train layout (rlhf.train.parallel)

    def __len__(self) -> int:
        return len(self.clients)

    async def acall(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1,
                    stage: str = "", timeout_s: float | None = None) -> list[tuple[Any, dict]]:
        per_rank_args = args if isinstance(args, list) else [args or {}] * len(self.clients)
        per_rank_tensors = tensors or [None] * len(self.clients)
        calls = [asyncio.ensure_future(c.call(f"/{method}", a, t, timeout_s=timeout_s, stage=stage, step=step))
                 for c, a, t in zip(self.clients, per_rank_args, per_rank_tensors)]
        if self.watchdog is None or stage == "cleanup":
            return list(await asyncio.gather(*calls))
        return list(await self.watchdog.supervise(calls, f"/{method}", step, stage))

    def call(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1, stage: str = "",
             timeout_s: float | None = None) -> list[tuple[Any, dict]]:
        return self.loop.run(self.acall(method, args, tensors, step, stage, timeout_s))


def merge_train_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One row from every rank's train_step reply: token-weighted means; the loss parts add up."""
    total = sum(m["tokens"] for m in per_rank) or 1.0
    out = {}
    for key in ("kl", "clip_fraction", "entropy", "response_length", "ratio_mean"):
        out[key] = sum(m[key] * m["tokens"] for m in per_rank) / total
    out["loss"] = sum(m["loss"] for m in per_rank)  # each rank's part is normalised by the global count
    out["grad_norm"] = per_rank[0]["grad_norm"]
    return out
