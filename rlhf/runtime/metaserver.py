"""MetaServer: a versioned, memory-bounded weight relay in the controller process.

    POST /versions            {version, shards}     open a version expecting `shards` shards
    PUT  /weights/<v>/<shard> safetensors body      a train rank's shard (manifest entries computed here)
    GET  /weights/<v>/manifest?wait_s=S             names, shapes, dtypes, bytes, sha256 per tensor and
                                                    shard; waits up to S s for all shards to arrive
    GET  /weights/<v>/<shard>                       the shard's safetensors bytes
    DELETE /weights/<v>                             drop a version
    GET  /health

In `meta` mode train ranks PUT while rollout servers already wait on the manifest, so upload
and update overlap (the seeds' behaviour, and why a slow uploader makes every rollout server's
update fail after it). Memory is bounded: at most `max_versions` versions are kept (opening a
new one evicts the oldest) and a PUT that would exceed `max_bytes` is refused with 507.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rlhf import tracing
from rlhf.faults import afault_point
from rlhf.weights import tensor_bytes

from rlhf.runtime import wire
from rlhf.runtime.errors import HTTPStatusError
from rlhf.runtime.http import STAGE_HEADER, STEP_HEADER, TOKEN_HEADER, Service, ServiceThread

log = logging.getLogger("rlhf.metaserver")


@dataclass
class _Version:
    expected_shards: int
    shards: dict[str, bytes] = field(default_factory=dict)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    opened_at: float = field(default_factory=time.time)


class MetaServer:
    def __init__(self, token: str, max_versions: int = 2, max_bytes: int = 4 << 30, resilience: str = "hardened") -> None:
        self.service = Service("metaserver", 0, token, resilience)
        self.max_versions, self.max_bytes = max_versions, max_bytes
        self.versions: dict[str, _Version] = {}
        self.lock = threading.Lock()
        app = self.service.app
        app.router.add_post("/versions", self._open)
        app.router.add_put("/weights/{version}/{shard}", self._put)
        app.router.add_get("/weights/{version}/manifest", self._manifest)
        app.router.add_get("/weights/{version}/{shard}", self._get)
        app.router.add_delete("/weights/{version}", self._delete)
        app.router.add_get("/health", self._health)
        self.thread = ServiceThread(self.service)

    def start(self) -> str:
        self.thread.start()
        return self.thread.url

    def stop(self) -> None:
        self.thread.stop()

    def bytes_held(self) -> int:
        return sum(len(b) for v in self.versions.values() for b in v.shards.values())

    async def _open(self, request: web.Request) -> web.Response:
        body = await request.json()
        version, shards = str(body["version"]), int(body["shards"])
        while len(self.versions) >= self.max_versions:
            oldest = min(self.versions, key=lambda k: self.versions[k].opened_at)
            log.info("evicting weights version %s (keeping at most %d)", oldest, self.max_versions)
            del self.versions[oldest]
        self.versions[version] = _Version(expected_shards=shards)
        return web.json_response({"version": version, "shards": shards})

    def _version(self, request: web.Request) -> _Version:
        version = request.match_info["version"]
        if version not in self.versions:
            raise web.HTTPNotFound(text=f"weights version {version!r} is not open (open: {sorted(self.versions)})")
        return self.versions[version]

    async def _put(self, request: web.Request) -> web.Response:
        v = self._version(request)
        shard = request.match_info["shard"]
        await afault_point("metaserver.put", peer=shard)
        data = await request.read()
        if self.bytes_held() + len(data) > self.max_bytes:
            return web.Response(status=507, text=f"metaserver full: {self.bytes_held()} + {len(data)} > {self.max_bytes} bytes")
        with tracing.span("metaserver.put", shard=shard, bytes=len(data)):
            _, tensors = wire.decode(data, wire.TENSORS_TYPE)
            for name, t in tensors.items():
                raw = tensor_bytes(t)
                v.entries[name] = {"shard": shard, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                   "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        v.shards[shard] = data
        if len(v.shards) >= v.expected_shards:
            v.complete.set()
        return web.json_response({"shard": shard, "tensors": len(tensors), "bytes": len(data)})

    async def _manifest(self, request: web.Request) -> web.Response:
        v = self._version(request)
        await afault_point("metaserver.get", peer="manifest")
        wait_s = float(request.query.get("wait_s", "0"))
        try:
            with tracing.span("metaserver.wait_shards", expected=v.expected_shards, have=len(v.shards)):
                await asyncio.wait_for(v.complete.wait(), timeout=wait_s)
        except asyncio.TimeoutError:
            return web.json_response(
                {"error": "incomplete", "have": sorted(v.shards), "expected": v.expected_shards}, status=504)
        shard_sums = {s: hashlib.sha256(b).hexdigest() for s, b in v.shards.items()}
        return web.json_response({"version": request.match_info["version"], "tensors": v.entries,
                                  "shards": {s: {"bytes": len(v.shards[s]), "sha256": shard_sums[s]} for s in v.shards}})

    async def _get(self, request: web.Request) -> web.Response:
        v = self._version(request)
        shard = request.match_info["shard"]
        await afault_point("metaserver.get", peer=shard)
        if shard not in v.shards:
            raise web.HTTPNotFound(text=f"shard {shard!r} not uploaded (have {sorted(v.shards)})")
        return web.Response(body=v.shards[shard], content_type=wire.TENSORS_TYPE)

    async def _delete(self, request: web.Request) -> web.Response:
        self.versions.pop(request.match_info["version"], None)
        return web.json_response({"deleted": request.match_info["version"]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "versions": sorted(self.versions), "bytes": self.bytes_held()})


async def push_shard(client: Any, version: str, shard: str, body: bytes, timeout_s: float) -> None:
    """Train side of a meta-mode update: PUT one rank's safetensors shard."""
    import aiohttp

    session = await client.session()
    url = f"{client.base_url}/weights/{version}/{shard}"
    with tracing.span("PUT /weights/{version}/{shard}", stage="weights_update", kind=tracing.SpanKind.CLIENT,
                      peer=client.peer, bytes=len(body)):
        headers = tracing.inject_headers({TOKEN_HEADER: client.token, "Content-Type": wire.TENSORS_TYPE,
                                          STAGE_HEADER: "weights_update", STEP_HEADER: str(tracing.current_step())})
        async with session.put(url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, f"metaserver refused shard {shard}: {(await resp.text())[:200]}", url)


async def pull_weights(client: Any, version: str, wait_s: float, timeout_s: float) -> dict:
    """Rollout side of a meta-mode update: wait for the manifest, fetch every shard, verify sha256."""
    import torch  # noqa: F401

    # the MetaServer's wait ends first (504 naming the missing shards), not our timeout
    manifest, _ = await client.call(f"/weights/{version}/manifest?wait_s={wait_s}", method="GET",
                                    timeout_s=max(timeout_s, wait_s + 5.0), stage="weights_update")
    tensors: dict = {}
    for shard in sorted(manifest["shards"]):
        _, part = await client.call(f"/weights/{version}/{shard}", method="GET", timeout_s=timeout_s,
                                    stage="weights_update")
        tensors.update(part)
    for name, entry in manifest["tensors"].items():
        if name not in tensors:
            raise ValueError(f"weights {version}: tensor {name} in manifest but not in any shard")
        if hashlib.sha256(tensor_bytes(tensors[name])).hexdigest() != entry["sha256"]:
            raise ValueError(f"weights {version}: checksum mismatch for {name}")
    return tensors
