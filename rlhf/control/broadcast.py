"""weights.mode distributed, a part of WeightSync: train rank 0 and every rollout server as one process group of
their own (rlhf.transport.weights_group), the weights broadcast bucket by bucket, and the broadcast's own watchdog.

    the group     formed at the first update (train-0 opens a store, joins; every server joins through sglang's
                  /init_weights_update_group), again when a rollout server was started again or migrated, or the
                  last update through it failed
    each update   train-0 /broadcast_weights (every bucket) while every server takes one
                  /update_weights_from_distributed call a bucket, the version set with the last
    a failure     a lost server is raised for the controller to start it again; anything else goes through disk with
                  the policy's weights_fallback
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rlhf import tracing
from rlhf.analysis import WATCHDOG_REPORT_ONLY
from rlhf.control.watchdog import POLL_S
from rlhf.errors import RpcConnectionError, SyncStall
from rlhf.transport.client import Client
from rlhf.transport.weights_group import GROUP, plan_buckets

log = logging.getLogger("rlhf.controller")

OUTER_MARGIN_S = 10.0  # a call that wraps a server-side wait gets this much longer than the wait


class BroadcastUpdate:
    """The distributed weights path of WeightSync (which sets cfg, workers, services and _fallback)."""

    group: dict | None = None  # the weights update group's members and buckets

    def _stale(self) -> None:
        """Form the group again at the next update, leaving this one first (its members that are still up)."""
        if self.group is not None:
            self.group["members"] = None

    def _backend(self) -> str:
        """nccl only when every member has a GPU of its own; gloo otherwise (a CPU run, ranks sharing a GPU)."""
        cfg = self.cfg
        if not cfg.model.device.startswith("cuda") or cfg.runtime.colocate:
            return "gloo"
        import torch

        return "nccl" if torch.cuda.device_count() >= len(self.workers) + len(self.services.rollout) else "gloo"

    async def _group(self, step: int) -> list[dict]:
        """The weights update group (train rank 0 and every rollout server), formed on the first update and again
        when its members changed (a rollout server started again or migrated) or the last update through it failed;
        its buckets."""
        members = [c.base_url for c in self.services.rollout]
        if self.group is not None and self.group["members"] == members:
            return self.group["buckets"]
        cfg = self.cfg
        timeout = cfg.weights.update_timeout_s
        if self.group is not None:  # leave the old one (its members that are still up); a failure is no error here
            self.group = None
            await asyncio.gather(self.workers.acall("weights_group", {"action": "destroy"}, stage="weights_update",
                                                    step=step, ranks=[0]),
                                 *[c.call("/destroy_weights_update_group", {"group_name": GROUP},
                                          stage="weights_update", step=step) for c in self.services.rollout],
                                 return_exceptions=True)
        with tracing.span("weights.group_form", stage="weights_update", step=step, servers=len(members)):
            [(opened, _)] = await self.workers.acall("weights_group", {"action": "open", "timeout_s": timeout},
                                                     stage="weights_update", step=step, ranks=[0])
            world, backend = 1 + len(members), self._backend()
            await asyncio.gather(
                self.workers.acall("weights_group", {"action": "join", "world_size": world, "backend": backend,
                                                     "group_name": GROUP, "timeout_s": timeout},
                                   timeout_s=timeout + OUTER_MARGIN_S, stage="weights_update", step=step, ranks=[0]),
                *[c.call("/init_weights_update_group", {
                    "master_address": opened["master_address"], "master_port": opened["master_port"],
                    "rank_offset": 1 + i, "world_size": world, "group_name": GROUP, "backend": backend},
                    timeout_s=timeout + OUTER_MARGIN_S, stage="weights_update", step=step)
                  for i, c in enumerate(self.services.rollout)])
        buckets = plan_buckets(opened["tensors"], int(cfg.weights.bucket_mb * 2**20))
        log.info("step %d: weights update group formed: train-0 and %d rollout servers (%s), %d buckets of at most "
                 "%g MB", step, len(members), backend, len(buckets), cfg.weights.bucket_mb)
        self.group = {"members": members, "buckets": buckets}
        return buckets

    async def _update_distributed(self, version: str, step: int) -> dict[str, float]:
        """Train rank 0 broadcasts every bucket while every rollout server receives them, one
        /update_weights_from_distributed call a bucket (the version set with the last). In a sharded layout every
        train rank takes part (each parameter is gathered for rank 0). A failure leaves the group to be formed again
        next time, and goes to disk with the policy's weights_fallback."""
        cfg = self.cfg
        try:
            buckets = await self._group(step)
        except Exception as exc:  # noqa: BLE001 — re-raised unless the policy falls back to disk
            self._stale()
            if not cfg.resilience.weights_fallback:
                raise
            return await self._fallback(version, step, [], exc)
        sharded = self.workers.layout.sharded
        t0 = time.perf_counter()

        async def timed(coro: Any) -> float:
            await coro
            return time.perf_counter() - t0

        async def receive(client: Client) -> None:
            for i, b in enumerate(buckets):
                last = i == len(buckets) - 1
                await client.call("/update_weights_from_distributed", {
                    "names": b["names"], "dtypes": b["dtypes"], "shapes": b["shapes"], "group_name": GROUP,
                    "load_format": "flattened_bucket", "flush_cache": last, "abort_all_requests": False,
                    "weight_version": version if last else None},
                    timeout_s=cfg.weights.update_timeout_s + OUTER_MARGIN_S, stage="weights_update", step=step)

        sends = [asyncio.ensure_future(timed(call)) for call in self.workers.start(
            "broadcast_weights", {"buckets": [b["names"] for b in buckets]},
            timeout_s=cfg.weights.update_timeout_s + OUTER_MARGIN_S, stage="weights_update", step=step,
            ranks=None if sharded else [0])]
        receives = [asyncio.ensure_future(timed(receive(c))) for c in self.services.rollout]
        watch = asyncio.ensure_future(self._watch_broadcast(sends[0], receives, step))
        await asyncio.wait(sends + receives + [watch], return_when=asyncio.FIRST_EXCEPTION)
        tasks = sends + receives
        if all(t.done() for t in tasks) and not any(t.exception() for t in tasks):
            watch.cancel()
            return {"upload_s_max": max(t.result() for t in sends), "update_s_max": max(t.result() for t in receives)}
        self._stale()  # formed again next time: a member may be gone or mid-receive
        if not watch.done():  # a member that died fails every other member's broadcast within about a second:
            await asyncio.wait(receives, timeout=5.0)  # let them end, so that the lost server is the error we raise
        errors = [t.exception() for t in [watch, *receives, *sends] if t.done() and not t.cancelled() and t.exception()]
        lost = [e for e in errors if isinstance(e, RpcConnectionError) and e.peer.startswith("rollout-")]
        failed = lost[0] if lost else errors[0]
        for t in receives + [watch]:
            t.cancel()
        for t in sends:  # a send still stuck ends at the group's timeout; its error is evidence in its rank's log
            t.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not cfg.resilience.weights_fallback or isinstance(failed, SyncStall) or lost:
            raise failed  # a lost server: the controller starts it again (restart_rollout) and updates again
        return await self._fallback(version, step, sends, failed)

    async def _watch_broadcast(self, sending: asyncio.Future, receives: list[asyncio.Future], step: int) -> None:
        """The stall watchdog of a broadcast: train-0 inside it for runtime.watchdog_stall_s while a rollout server is
        not receiving (or does not answer /health) names that server: SyncStall with the policy's stall_stops_run,
        else an ERROR line (once) and the broadcast waits for the group's timeout. A server whose receive has ended
        (`receives`, one per server) is not missing: it has every bucket (gloo's root sends to each receiver in
        turn, so the one that got its copy first is done while the sender still waits for another)."""
        stall_s = self.cfg.runtime.watchdog_stall_s
        if not stall_s:
            return
        while not sending.done():
            await asyncio.wait([sending], timeout=POLL_S)
            try:
                beat, _ = await self.workers.heartbeat(0)
            except Exception:  # noqa: BLE001 — the send's own error says more
                continue
            if not str(beat.get("collective", "")).startswith("broadcast") or beat["collective_s"] < stall_s:
                continue
            healths = await asyncio.gather(*[c.call("/health", method="GET", timeout_s=2.0, traced=False)
                                             for c in self.services.rollout], return_exceptions=True)
            missing = [(i, h) for i, h in enumerate(healths) if not receives[i].done()
                       and (isinstance(h, BaseException) or "weights_broadcast" not in h[0])]
            if not missing:
                continue
            i, h = missing[0]
            state = "does not answer /health" if isinstance(h, BaseException) else "is not receiving it"
            found = (f"train-0 has been inside {beat['collective']} for {beat['collective_s']:.1f} s at step {step}, "
                     f"while rollout-{i} {state}; rollout-{i} is missing from the weights broadcast")
            if self.cfg.resilience.stall_stops_run:
                raise SyncStall(f"stall watchdog (step {step}, stage weights_update, /broadcast_weights): {found}")
            log.error("stall watchdog (step %d, stage weights_update, /broadcast_weights): %s; %s", step, found,
                      WATCHDOG_REPORT_ONLY)
            return
