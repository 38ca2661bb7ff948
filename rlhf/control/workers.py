"""WorkerGroup: the controller's handle on every train rank (SPMD: one call runs on all of them)."""

from __future__ import annotations

import asyncio
from typing import Any

from rlhf.control.watchdog import BLOCKED_CORES, StallWatchdog
from rlhf.errors import NoProgress
from rlhf.train.parallel import Layout
from rlhf.transport import fanout
from rlhf.transport.client import Client, LoopThread

LONG_CALL_S = 30 * 24 * 3600.0  # a call judged by its progress has no fixed timeout of its own (a month)


class WorkerGroup:
    """RPC clients for every train rank; `call` runs a method on all of them concurrently. Every call the control
    layer makes to a train rank goes through here (`call`/`acall`, `start`), also those to one rank."""

    def __init__(self, urls: list[str], token: str, loop: LoopThread, timeout_s: float, checksums: bool = False,
                 retries: bool = False) -> None:
        """checksums: send per-tensor digests with the batches (the policy's stage_checksums); retries: the
        policy's retry_idempotent (only /compute_logprobs and GETs are repeated)."""
        self.clients = [Client(u, token, timeout_s, peer=f"train-{r}", checksums=checksums, retries=retries)
                        for r, u in enumerate(urls)]
        self.loop, self.token, self.timeout_s = loop, token, timeout_s
        self.watchdog: StallWatchdog | None = None  # set by the controller: reads heartbeats while a call runs
        self.layout: Layout | None = None  # set by the controller: the train layout (rlhf.train.parallel)
        self.agents: list[tuple[Client, list[int]]] = []  # use_agents: one request per host (rlhf.transport.fanout)

    def use_agents(self, agents: list[tuple[str, list[int]]]) -> None:
        """Calls on several ranks go as one request to each host's agent (its URL, its ranks), which fans it out to
        its ranks: the controller sends O(hosts) requests a call instead of O(ranks). Each rank's reply or error is
        what a direct call gives (the agent relays it), so callers and the stall watchdog see ranks as before."""
        self.agents = [(Client(url, self.token, self.timeout_s, peer=f"agent-{h}"), list(ranks))
                       for h, (url, ranks) in enumerate(agents)]

    def __len__(self) -> int:
        return len(self.clients)

    def peer(self, rank: int) -> str:
        return self.clients[rank].peer

    async def heartbeat(self, rank: int, timeout_s: float = 2.0) -> tuple[Any, dict]:
        """What `rank` is doing now (GET /heartbeat, untraced): the watchdogs' evidence."""
        return await self.clients[rank].call("/heartbeat", method="GET", timeout_s=timeout_s, traced=False)

    async def heartbeats(self, timeout_s: float = 2.0) -> list[dict[str, Any] | None]:
        """Every rank's heartbeat (None where it did not answer): through the hosts' agents (one request a host)
        when there are agents, else one GET /heartbeat per rank. Untraced, as the watchdog reads them every 0.5 s."""
        if self.agents:
            hosts = await asyncio.gather(*[fanout.collect(client, "heartbeat", served, timeout_s,
                                                          {"method": "GET", "traced": False})
                                           for client, served in self.agents])
            got = {r: reply for host in hosts for r, reply in host.items()}
            replies = [got.get(r) for r in range(len(self.clients))]
        else:
            futures = [asyncio.ensure_future(self.heartbeat(r, timeout_s)) for r in range(len(self.clients))]
            replies = await asyncio.gather(*futures, return_exceptions=True)
        return [None if r is None or isinstance(r, BaseException) else r[0] for r in replies]

    def _start(self, method: str, args: Any, tensors: list[dict] | None, step: int, stage: str,
               timeout_s: float | None, ranks: list[int] | None, **options: Any) -> tuple[list[int], list[asyncio.Future]]:
        ranks = list(range(len(self.clients))) if ranks is None else list(ranks)
        per_rank_args = args if isinstance(args, list) else [args or {}] * len(ranks)
        per_rank_tensors = tensors or [None] * len(ranks)
        if self.agents and len(ranks) > 1:
            return ranks, self._through_agents(method, ranks, per_rank_args, per_rank_tensors, step, stage, timeout_s,
                                               options)
        return ranks, [asyncio.ensure_future(self.clients[r].call(f"/{method}", a, t, timeout_s=timeout_s, stage=stage,
                                                                  step=step, **options))
                       for r, a, t in zip(ranks, per_rank_args, per_rank_tensors)]

    def _through_agents(self, method: str, ranks: list[int], args: list[Any], tensors: list[dict | None], step: int,
                        stage: str, timeout_s: float | None, options: dict[str, Any]) -> list[asyncio.Future]:
        """One /fanout request per host that serves any of `ranks`; a future per rank, resolved from its host's
        reply (the rank's reply and tensors, or its own error); a host that fails fails each of its ranks."""
        loop = asyncio.get_running_loop()
        futures = {r: loop.create_future() for r in ranks}
        index = {r: i for i, r in enumerate(ranks)}
        inner = self.timeout_s if timeout_s is None else timeout_s

        for client, served in self.agents:
            mine = [r for r in served if r in futures]
            if mine:
                task = asyncio.ensure_future(fanout.relay(
                    client, method, {r: futures[r] for r in mine}, [args[index[r]] for r in mine],
                    [tensors[index[r]] for r in mine], stage, step, inner, options))
                for r in mine:  # cancelling a rank's call (the watchdog, a sibling's failure) cancels its host's
                    futures[r].add_done_callback(lambda f, t=task: f.cancelled() and t.cancel())
        for f in futures.values():
            f.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody awaits is not an error
        return [futures[r] for r in ranks]

    async def acall(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1,
                    stage: str = "", timeout_s: float | None = None, ranks: list[int] | None = None,
                    progress_s: float = 0.0, **options: Any) -> list[tuple[Any, dict]]:
        """`method` on every rank (or on `ranks`), concurrently; the replies in rank order. A call on every rank runs
        under the stall watchdog (a rank inside a collective the others wait for is named in seconds); `options`
        go to Client.call (method, points, traced). progress_s: a long call judged by its progress, not a fixed
        timeout: it runs as long as some rank's heartbeat moves (its step, its CPU time), and fails with NoProgress
        once none has for progress_s."""
        if progress_s:
            timeout_s = LONG_CALL_S
        ranks, calls = self._start(method, args, tensors, step, stage, timeout_s, ranks, **options)
        if self.watchdog is None or stage == "cleanup" or len(ranks) != len(self.clients):
            waited = asyncio.gather(*calls)
        else:
            waited = asyncio.ensure_future(self.watchdog.supervise(calls, f"/{method}", step, stage))
        if not progress_s:
            return list(await waited)
        watch = asyncio.ensure_future(self._progress(ranks, method, progress_s))
        try:
            await asyncio.wait([waited, watch], return_when=asyncio.FIRST_COMPLETED)
            if not waited.done():
                waited.cancel()
                for c in calls:
                    c.cancel()
                watch.result()  # raises NoProgress
            return list(waited.result())
        finally:
            watch.cancel()

    async def _progress(self, ranks: list[int], method: str, progress_s: float) -> None:
        """Until no rank has moved for progress_s: then NoProgress naming the first rank and what its heartbeat says.
        A rank moves when its heartbeat's phase or step changes, or when it used a quarter of a core or more since
        the last read (a long step that computes; a blocked rank's background threads use far less)."""
        last: dict[int, tuple[Any, float]] = {}  # rank -> ((phase, step), CPU seconds) at the last read
        loop = asyncio.get_running_loop()
        moved = read_at = loop.time()
        while True:
            await asyncio.sleep(min(5.0, progress_s / 4))  # a heartbeat read's period: the condition is their change
            beats = await self.heartbeats()
            now = loop.time()
            for r in ranks:
                beat = beats[r]
                if beat is None:
                    continue
                seen, cpu = (beat.get("phase"), beat.get("step")), float(beat.get("cpu_s", 0.0))
                before = last.get(r)
                if before is None or seen != before[0] or cpu - before[1] >= BLOCKED_CORES * (now - read_at):
                    moved = now
                last[r] = seen, cpu
            read_at = now
            if now - moved > progress_s:
                r = ranks[0]
                what = f"{last[r][0][0]} at step {last[r][0][1]}, {last[r][1]:.1f} CPU s" if r in last else "none read"
                raise NoProgress(self.clients[r].base_url + f"/{method}", progress_s, f"train-{r}", what)

    def start(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1,
              stage: str = "", timeout_s: float | None = None, ranks: list[int] | None = None,
              **options: Any) -> list[asyncio.Future]:
        """`method` started on every rank (or on `ranks`) and not awaited: for a caller that waits for them beside
        other calls (a weights update's uploads beside the rollout servers' updates). The stall watchdog does not
        watch them: their timeout bounds them, and the broadcast has its own watchdog (control/broadcast.py)."""
        return self._start(method, args, tensors, step, stage, timeout_s, ranks, **options)[1]

    def call(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1, stage: str = "",
             timeout_s: float | None = None, ranks: list[int] | None = None, progress_s: float = 0.0,
             **options: Any) -> list[tuple[Any, dict]]:
        return self.loop.run(self.acall(method, args, tensors, step, stage, timeout_s, ranks, progress_s, **options))


TRAIN_COLUMNS = ("kl", "clip_fraction", "entropy", "response_length", "loss", "grad_norm", "ratio_mean",
                 "rollout_train_logprob_diff", "rollout_train_logprob_diff_max")


def merge_train_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One row from every rank's train_step reply (TRAIN_COLUMNS): token-weighted means; the loss parts add up; the
    rollout-vs-train logprob difference from each rank's sums (absent when the old logprobs were recomputed: the
    controller takes it from that pass)."""
    total = sum(m["tokens"] for m in per_rank) or 1.0
    out = {}
    for key in ("kl", "clip_fraction", "entropy", "response_length", "ratio_mean"):
        out[key] = sum(m[key] * m["tokens"] for m in per_rank) / total
    out["loss"] = sum(m["loss"] for m in per_rank)  # each rank's part is normalised by the global count
    out["grad_norm"] = per_rank[0]["grad_norm"]
    if all("lp_diff_tokens" in m for m in per_rank):
        out["rollout_train_logprob_diff"] = sum(m["lp_diff_sum"] for m in per_rank) / max(
            sum(m["lp_diff_tokens"] for m in per_rank), 1.0)
        out["rollout_train_logprob_diff_max"] = max(m["lp_diff_max"] for m in per_rank)
    return out


def logprob_diff(parts: list[tuple[Any, Any, Any]]) -> dict[str, float]:
    """rollout_train_logprob_diff (mean) and _max: |rollout - train| logprob over the response tokens of
    (rollout logprobs, train logprobs, response mask) tensors."""
    total = count = top = 0.0
    for rollout, train, mask in parts:
        d = (train.float() - rollout.float()).abs() * mask
        total, count, top = total + float(d.sum()), count + float(mask.sum()), max(top, float(d.max()))
    return {"rollout_train_logprob_diff": total / max(count, 1.0), "rollout_train_logprob_diff_max": top}
