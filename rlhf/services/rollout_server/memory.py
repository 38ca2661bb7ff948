"""Weights and device memory: updates from a directory or the MetaServer, the weight version, sglang's memory
release/resume (verified released under the policy), colocation events."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch
from aiohttp import web

from rlhf import tracing
from rlhf.devices import relocate
from rlhf.errors import BadRequest
from rlhf.faults import afault_point, fault_point
from rlhf.services.colocation import DeviceBusy, fresh_allocation, read_leak
from rlhf.services.metaserver import pull_pieces
from rlhf.transport.client import Client

log = logging.getLogger("rlhf.rollout_server")


# a GPU release that leaves more than this allocated in the server's process did not free the device (the weights and
# every cache are gone after it; what stays is a few small tensors)
RELEASE_SLACK_MB = 256.0


class DeviceMemoryNotReleased(RuntimeError):
    """verify_release: a release_memory_occupation left device memory allocated."""


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang's release/resume tags


def memory_tags(args: dict) -> set[str]:
    tags = args.get("tags")
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS)) if isinstance(tags, list) else [tags]
    if unknown:
        raise BadRequest(f"tags {unknown} unknown; valid: {list(MEMORY_TAGS)} (or none: all of them)")
    return set(tags)


class WeightsAndMemory:
    """The rollout server's weight, memory and event routes (a part of RolloutServer)."""

    host_pulls: dict[tuple[str, str], asyncio.Future] | None = None  # pulls shared by a host's servers (_pull)

    def _wait_for_device(self) -> None:
        """device_busy_fails_fast off: a generate that finds the device taken retries its allocation, as a CUDA caching allocator
        retry loop would, each failure an ERROR line, until lease_timeout_s."""
        assert self.lease is not None
        start = time.monotonic()
        deadline, attempt = start + self.lease_timeout_s, 0
        while True:
            attempt += 1
            try:
                self.lease.acquire(0)
                log.info("generate: device %d acquired after %d attempts", self.lease.device, attempt)
                return
            except DeviceBusy as exc:
                log.error("generate: allocating the KV cache failed (attempt %d, %.0f s): %s", attempt,
                          time.monotonic() - start, exc)
                if time.monotonic() >= deadline:
                    raise
            time.sleep(1.0)

    def update_weights_from_disk(self, args: dict, tensors: dict) -> Any:
        """sglang's reply {success, message, num_paused_requests}; a path it cannot load is a 400 with success false."""
        path = args.get("model_path")
        version = str(args.get("weight_version") or self.engine.weight_version)
        if args.get("abort_all_requests"):
            self._abort(None, "aborted by /update_weights_from_disk")
        stale = stale_mode(fault_point("weights_update.update", path=str(path)))
        if not isinstance(path, str) or not os.path.isdir(path):
            return web.json_response({"success": False, "num_paused_requests": 0,
                                      "message": f"model_path {path!r} is not a directory with *.safetensors"},
                                     status=400)
        with tracing.span("weights.load", source="disk", weight_version=version):
            try:
                keeping(self.engine.model, stale, lambda: self.engine.update_weights_from_disk(path, version))
            except FileNotFoundError as exc:
                return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
        self.model_path = path
        return {"success": True, "message": f"loaded {path}", "weight_version": version, "num_paused_requests": 0}

    def update_weight_version(self, args: dict, tensors: dict) -> dict:
        new = args.get("new_version")
        if not new:
            raise BadRequest("/update_weight_version needs new_version")
        if args.get("abort_all_requests", True):
            self._abort(None, "aborted by /update_weight_version")
        self.engine.weight_version = str(new)
        return {"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)}

    async def update_weights_from_meta(self, args: dict, tensors: dict) -> dict:
        version = str(args["weight_version"])
        stale = stale_mode(await afault_point("weights_update.update", peer="metaserver-0"))
        shards = await self._pull(args, version)
        pieces = [t for tensors, _ in shards.values() for t in tensors.values()]
        fresh_allocation(self.run_dir, self.device, sum(t.numel() * t.element_size() for t in pieces),
                         "the new weights")
        loop = asyncio.get_running_loop()
        with tracing.span("weights.load", source="metaserver", weight_version=version, pieces=len(pieces)):
            await loop.run_in_executor(self.service.executor, keeping, self.engine.model, stale,
                                       lambda: self._load_pieces(shards, version))
        return {"success": True, "weight_version": version, "tensors": len(pieces)}

    async def _pull(self, args: dict, version: str) -> dict:
        """The version's pieces from the MetaServer. The servers of one host process (a simulated world's) share a
        pull (`host_pulls`, set where they are made): the host asks for the manifest once a version, as one agent a
        node would, instead of once for each of its servers; a failed pull fails each server that waited for it."""
        shared = self.host_pulls
        key = (str(args["metaserver_url"]), version)
        if shared is not None and key in shared:
            return await asyncio.shield(shared[key])

        async def pull() -> dict:
            client = Client(args["metaserver_url"], self.token, peer="metaserver-0",
                            retries=self.policy.retry_idempotent)
            try:
                return await pull_pieces(client, version, float(args.get("wait_s", 60)),
                                         float(args.get("timeout_s", 600)), device=self.engine.device,
                                         consumer=int(args.get("consumer", 0)), who=f"rollout-{self.rank}")
            finally:
                await client.close()

        if shared is None:
            return await pull()
        task = shared[key] = asyncio.ensure_future(pull())
        for old in [k for k in shared if k[0] == key[0] and k != key]:  # the host keeps only the newest version's
            del shared[old]
        try:
            return await asyncio.shield(task)
        except BaseException:
            if shared.get(key) is task:  # the next update of this version asks again
                del shared[key]
            raise

    def _load_pieces(self, shards: dict, version: str) -> None:
        self.engine.update_weights_from_pieces(shards, version)
        if self.engine.device.type == "cuda":  # copies out of a cuda_ipc buffer are done before its views are freed
            torch.cuda.synchronize(self.engine.device)

    def release_memory(self, args: dict, tensors: dict) -> dict:
        """sglang's release, by `tags` (default: all): "weights" move to pinned host memory on a GPU;
        "kv_cache" gives the device lease to the colocated train rank (the KV cache is per call here, so no
        memory stays); "cuda_graph" (graphs are captured per call) holds nothing between calls."""
        tags = memory_tags(args)
        reply: dict[str, Any] = {"success": True, "tags": sorted(tags)}
        engine = self.engine
        if "weights" in tags and engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cuda":
            with engine.lock:
                engine.drop_caches()  # the fused copies and rotary tables hold device memory too
                reply.update(relocate([engine.model], None, torch.device("cpu"), engine.device))
        if self.lease is not None and "kv_cache" in tags:
            self.lease.release()
        leak = read_leak(self.run_dir, self.device) if self.run_dir else None
        mine = bool(leak) and leak.get("pid") == os.getpid()  # type: ignore[union-attr]
        # what this process still holds after the release, on the request's span (evidence; no behaviour)
        held = float(leak["leaked_mb"]) if mine else float(reply.get("device_mb_after", 0.0))  # type: ignore[index]
        if "weights" in tags and engine.device.type == "cuda":  # a GPU: what the allocator really still holds
            held = max(held, torch.cuda.memory_allocated(engine.device) / (1 << 20))
            mine = mine or held > RELEASE_SLACK_MB
        tracing.trace.get_current_span().set_attribute("rlhf.device_mb_held", held)
        if mine and self.policy.verify_release:
            # check that a release really freed the device, here, instead of at the peer's next allocation
            raise DeviceMemoryNotReleased(f"rollout-{self.rank} still holds {held:g} MB of {self.device} "
                                          "after releasing it; its colocated train rank cannot allocate")
        return reply

    def resume_memory(self, args: dict, tensors: dict) -> dict:
        tags = memory_tags(args)
        reply: dict[str, Any] = {"success": True, "tags": sorted(tags)}
        if self.lease is not None and "kv_cache" in tags:
            self.lease.acquire(float(args.get("timeout_s", self.lease_timeout_s)))
            fresh_allocation(self.run_dir, self.device, 1 << 30, "the KV cache")
        engine = self.engine
        if "weights" in tags and engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cpu":
            with engine.lock:
                reply.update(relocate([engine.model], None, engine.device, engine.device))
        return reply

    def events(self, args: dict, tensors: dict) -> dict:
        event = args.get("event")
        fault_point("events.handle", peer=str(event), device=self.device)
        reply: dict[str, Any] = {}
        if event == "rollout_start":
            reply = self.resume_memory(args, tensors)
        elif event == "rollout_end":
            reply = self.release_memory(args, tensors)
        elif event not in ("train_start", "train_end"):
            raise ValueError(f"unknown event {event!r}; valid: rollout_start, rollout_end, train_start, train_end")
        memory = {k: v for k, v in reply.items() if k.startswith("device_mb")}  # what the event freed or took
        return {**memory, "event": event, "ack": True, "step": args.get("step")}


def stale_mode(directives: Any) -> str | None:
    """The weights_stale fault's mode, if one fired at this update (rlhf.faults.kinds.weights_stale)."""
    return next((d["stale"] for d in directives if isinstance(d, dict) and d.get("stale")), None)


@torch.no_grad()
def keeping(model: torch.nn.Module, stale: str | None, load: Any) -> None:
    """load(); with a weights_stale fault, the parameters it names then get their old values back (keep: all;
    half: the second half in the model's order), so the update is acknowledged with the new version and is not."""
    if stale is None:
        return load()
    params = [p for _, p in model.named_parameters()]
    kept = [(p, p.detach().clone()) for p in (params if stale == "keep" else params[len(params) // 2:])]
    load()
    for p, old in kept:
        p.copy_(old)
