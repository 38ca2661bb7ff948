"""MetaServer: a versioned, memory-bounded weight relay in the controller process.

    POST /versions            {version, shards}     open a version expecting `shards` shards
    PUT  /weights/<v>/<shard> safetensors body      a train rank's shard, over HTTP
                              or {"path": P} (JSON) the shard as a file in the MetaServer's
                                                    shared-memory directory (same host)
    GET  /weights/<v>/manifest?wait_s=S             per piece (an HF parameter's slice, `name[0:64,0:128]`):
                                                    its shard, parameter name, offset, whole shape, shape,
                                                    dtype, bytes and the uploader's digest; bytes (and path,
                                                    when in shared memory) per shard; waits up to S s for all
    GET  /weights/<v>/<shard>                       the shard's safetensors bytes (any host)
    DELETE /weights/<v>                             drop a version
    GET  /health

In `meta` mode train ranks PUT while rollout servers already wait on the manifest, so upload
and update overlap (the seeds' behaviour, and why a slow uploader makes every rollout server's
update fail after it). Memory is bounded: at most `max_versions` versions are kept (opening a
new one evicts the oldest) and a PUT that would exceed `max_bytes` is refused with 507.

Transport (`weights.transport`). `http`: shard bytes in the PUT and GET bodies (any host; aiohttp
moves about 0.5 GB/s per stream here). `shm` (default; every process of our runtime is on one
host): a train rank writes its shard once into the MetaServer's directory in /dev/shm and PUTs
only its path; a rollout server maps the file and copies each tensor into its model. The control
messages (open, PUT, manifest wait) stay HTTP, so every fault point and span of the relay is
where it was. The MetaServer owns the files: eviction, DELETE and stop() remove them; when the
controller is SIGKILLed the scheduler sweeps the directories of dead MetaServers as it stops its
jobs, and a new MetaServer does the same at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rlhf import tracing
from rlhf.config.resilience import HARDENED, Policy
from rlhf.faults import afault_point
from rlhf.pieces import assemble
from rlhf.services.metaserver_merge import MERGED, MergedVersions  # noqa: F401 (MERGED: this module's API too)
from rlhf.transport import wire
from rlhf.transport.cuda_ipc import header_bytes, open_shared, unpack
from rlhf.transport.http import Service, ServiceThread
from rlhf.transport.shm import SHM_PREFIX, shm_root, sweep_stale_shm  # noqa: F401 (also this module's API)
from rlhf.weights import PIECES, ShardCorrupt, decode_pieces, shard_header

log = logging.getLogger("rlhf.metaserver")

@dataclass
class _Shard:
    size: int
    data: bytes | None = None  # http transport
    path: str = ""  # shm transport: a file the MetaServer owns
    ipc: dict | None = None  # cuda_ipc transport: {"header", "handles"}; the bytes stay in the uploader's GPU memory

    def read(self) -> bytes:
        if self.ipc is not None:
            raise web.HTTPConflict(text="the shard stays in its train rank's GPU memory (weights.transport cuda_ipc): "
                                        "only a process on that GPU maps it, with the manifest's handle")
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as fh:
            return fh.read()

    def drop(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@dataclass
class _Version:
    expected_shards: int
    shards: dict[str, _Shard] = field(default_factory=dict)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    opened_at: float = field(default_factory=time.time)
    dropped: bool = False
    merging: bool = False  # its shards are being merged into one (MetaServer.merge_above)
    error: BaseException | None = None  # the merge failed: every manifest request's answer
    manifest: bytes = b""  # its manifest, encoded once for every rollout server that asks (emptied by a PUT)

    def drop(self) -> None:
        """Free its shards; a manifest request waiting for shards is answered at once (410, or 504 incomplete when the
        MetaServer is stopping). On the server's loop."""
        self.dropped = True
        self.complete.set()
        for shard in self.shards.values():
            shard.drop()


class MetaServer(MergedVersions):
    shard_type = _Shard  # what a merged version's one shard is (services/metaserver_merge.py)

    def __init__(self, token: str, max_versions: int = 2, max_bytes: int = 4 << 30, policy: Policy = HARDENED,
                 transport: str = "shm", merge_above: int = 0, checksum: str = "none") -> None:
        """merge_above: a version of more shards than this is merged into one shard of whole tensors before any
        rollout server gets its manifest (weights.merge_shards; 0: never); checksum: the merged shard's digests."""
        self.merge_above, self.checksum = merge_above, checksum
        self.service = Service("metaserver", 0, token, policy)
        self.max_versions, self.max_bytes = max_versions, max_bytes
        self.versions: dict[str, _Version] = {}
        self.waiting = 0  # manifest requests waiting for shards now
        self.served = 0  # bytes of the manifests and shards it has answered with (benchmarks/scale.py)
        self.stopping = False
        self.lock = threading.Lock()
        self.shm_dir = ""
        if transport == "shm":
            stale = sweep_stale_shm()
            if stale:
                log.info("removed %d shared-memory weight folder(s) of dead runs: %s", len(stale), ", ".join(stale))
            self.shm_dir = tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=shm_root())  # mode 0700
        route = self.service.raw_route  # raw bodies (shards), behind the same auth, spans and typed errors
        route("POST", "/versions", self._open)
        route("PUT", "/weights/{version}/{shard}", self._put)
        route("GET", "/weights/{version}/manifest", self._manifest)
        self.service.waits.add("GET /weights/{version}/manifest")  # a long poll for the uploaders' shards
        route("GET", "/weights/{version}/{shard}", self._get)
        route("DELETE", "/weights/{version}", self._delete)
        route("GET", "/health", self._health)
        self.thread = ServiceThread(self.service)

    def start(self) -> str:
        self.thread.start()
        self.started = True
        return self.thread.url

    def stop(self) -> None:
        if getattr(self, "started", False):
            # first the versions, so that a manifest request waiting for shards that will never come (their uploader
            # died) ends now instead of holding the server's shutdown for its whole wait
            self.started = False
            self.thread.run(self._drop_all(), timeout_s=5.0)
            self.thread.stop(timeout_s=5.0)
        for v in self.versions.values():
            v.drop()
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    def bytes_held(self) -> int:
        """What the MetaServer holds (a cuda_ipc shard's bytes are in its uploader's GPU memory)."""
        return sum(s.size for v in self.versions.values() for s in v.shards.values() if s.ipc is None)

    async def _open(self, request: web.Request) -> web.Response:
        body = await request.json()
        version, shards = str(body["version"]), int(body["shards"])
        self._open_version(version, shards)
        return web.json_response({"version": version, "shards": shards})

    def _open_version(self, version: str, shards: int) -> None:
        """On the server's loop: `version` (again: anew) expecting `shards` shards, the oldest evicted past
        max_versions."""
        while len(self.versions) >= self.max_versions:
            oldest = min(self.versions, key=lambda k: self.versions[k].opened_at)
            log.debug("evicting weights version %s (keeping at most %d)", oldest, self.max_versions)
            self.versions.pop(oldest).drop()
        self.versions[version] = _Version(expected_shards=shards)

    async def open_version(self, version: str, shards: int, step: int = -1) -> None:
        """The controller's POST /versions without HTTP (the MetaServer is in its process): the same effect, run on
        the server's loop; one round trip less in every weights update. Awaited from another loop (the
        controller's)."""
        with tracing.span("metaserver.open", stage="weights_update", step=step, version=version, shards=shards):
            async def here() -> None:
                self._open_version(version, shards)

            await asyncio.wrap_future(self.thread.submit(here()))

    def _version(self, request: web.Request) -> _Version:
        version = request.match_info["version"]
        if version not in self.versions:
            raise web.HTTPNotFound(text=f"weights version {version!r} is not open (open: {sorted(self.versions)})")
        return self.versions[version]

    def _shm_shard(self, path: str) -> tuple[_Shard, bytes]:
        """A shard a train rank wrote into our directory: only files there are accepted."""
        real = os.path.realpath(path)
        if not self.shm_dir or os.path.dirname(real) != os.path.realpath(self.shm_dir):
            raise web.HTTPBadRequest(text=f"shard path {path!r} is not in this MetaServer's directory {self.shm_dir!r}")
        with open(real, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            head += fh.read(min(n, size))
        return _Shard(size=size, path=real), head

    @staticmethod
    def _ipc_shard(ipc: Any) -> tuple[_Shard, bytes]:
        """A shard a train rank keeps in its GPU memory: its safetensors-style header and one handle per consumer."""
        if not (isinstance(ipc, dict) and isinstance(ipc.get("header"), dict) and isinstance(ipc.get("handles"), list)
                and ipc["handles"] and all(isinstance(h, dict) for h in ipc["handles"])):
            raise web.HTTPBadRequest(text="a cuda_ipc shard needs {'header': {...}, 'handles': [{...}, ...]}")
        return _Shard(size=_ipc_bytes(ipc["header"]), ipc=ipc), header_bytes(ipc["header"])

    async def _put(self, request: web.Request) -> web.Response:
        v = self._version(request)
        shard = request.match_info["shard"]
        await afault_point("metaserver.put", peer=shard)
        data = await request.read()
        if request.content_type == wire.JSON_TYPE:
            sent = json.loads(data)
            entry, head = self._ipc_shard(sent["cuda_ipc"]) if "cuda_ipc" in sent else self._shm_shard(sent["path"])
        else:
            entry, head = _Shard(size=len(data), data=data), data
        if self.bytes_held() + entry.size > self.max_bytes:
            entry.drop()
            return web.Response(status=507, text=f"metaserver full: {self.bytes_held()} + {entry.size} > {self.max_bytes} bytes")
        with tracing.span("metaserver.put", shard=shard, bytes=entry.size):
            # the relay reads only the safetensors header: no tensor is decoded or re-hashed here; the
            # uploader's digests travel inside the shard and every consumer checks them end to end
            header, metadata, _ = shard_header(head, size=entry.size + (len(head) if entry.ipc else 0))
            digests = json.loads(metadata.get("digests", "{}"))
            where = json.loads(metadata.get(PIECES, "{}"))
            for key, info in header.items():
                start, end = info["data_offsets"]
                piece = where.get(key, {"name": key, "offset": [0] * len(info["shape"]), "whole": info["shape"]})
                v.entries[key] = {"shard": shard, "shape": info["shape"], "dtype": info["dtype"],
                                  "bytes": end - start, "checksum": metadata.get("checksum", "none"),
                                  "digest": digests.get(key, ""), **piece}
        if shard in v.shards and v.shards[shard].path != entry.path:  # a retried PUT names the same file: keep it
            v.shards[shard].drop()
        v.shards[shard] = entry
        v.manifest = b""
        if len(v.shards) >= v.expected_shards and not v.merging:
            if self.merge_above and v.expected_shards > self.merge_above and not any(e.ipc for e in v.shards.values()):
                v.merging = True  # the manifest waits for the merge (complete is set by it)
                asyncio.get_running_loop().create_task(self._merge(v, request.match_info["version"]))
            else:
                v.complete.set()
        return web.json_response({"shard": shard, "tensors": len(header), "bytes": entry.size})

    async def _manifest(self, request: web.Request) -> web.Response:
        v = self._version(request)
        await afault_point("metaserver.get", peer="manifest")
        wait_s = float(request.query.get("wait_s", "0"))
        self.waiting += 1
        try:
            with tracing.span("metaserver.wait_shards", expected=v.expected_shards, have=len(v.shards)):
                await asyncio.wait_for(v.complete.wait(), timeout=wait_s)
        except asyncio.TimeoutError:
            return web.json_response(
                {"error": "incomplete", "have": sorted(v.shards), "expected": v.expected_shards}, status=504)
        finally:
            self.waiting -= 1
        if v.dropped and self.stopping:  # the missing shards will never come: the same answer as the wait's end
            return web.json_response({"error": "incomplete", "have": sorted(v.shards), "expected": v.expected_shards,
                                      "reason": "the MetaServer is stopping"}, status=504)
        if v.dropped:
            return web.json_response({"error": f"weights version {request.match_info['version']!r} was dropped "
                                               "(deleted or evicted)"}, status=410)
        if v.error is not None:
            raise v.error
        if not v.manifest:  # the same bytes for every server: a big world has hundreds of them
            shards = {s: {"bytes": e.size, **({"path": e.path} if e.path else {}),
                          **({"cuda_ipc": e.ipc} if e.ipc else {})} for s, e in v.shards.items()}
            v.manifest = json.dumps({"version": request.match_info["version"], "tensors": v.entries,
                                     "shards": shards}).encode()
        self.served += len(v.manifest)
        return web.Response(body=v.manifest, content_type=wire.JSON_TYPE)

    async def _get(self, request: web.Request) -> web.Response:
        v = self._version(request)
        shard = request.match_info["shard"]
        await afault_point("metaserver.get", peer=shard)
        if shard not in v.shards:
            raise web.HTTPNotFound(text=f"shard {shard!r} not uploaded (have {sorted(v.shards)})")
        body = v.shards[shard].read()
        self.served += len(body)
        return web.Response(body=body, content_type=wire.TENSORS_TYPE)

    async def _drop_all(self) -> None:
        self.stopping = True
        for v in self.versions.values():
            v.drop()

    async def _delete(self, request: web.Request) -> web.Response:
        dropped = self.versions.pop(request.match_info["version"], None)
        if dropped is not None:
            dropped.drop()
        return web.json_response({"deleted": request.match_info["version"]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "versions": sorted(self.versions), "bytes": self.bytes_held(),
                                  "waiting": self.waiting})


async def push_shard(client: Any, version: str, shard: str, body: bytes | None, timeout_s: float,
                     path: str = "", ipc: dict | None = None) -> None:
    """Train side of a meta-mode update: PUT one rank's shard (its bytes, the path of the file it wrote, or its
    header and CUDA IPC handles: rlhf.transport.cuda_ipc).

    Through the client like every hop: rpc.client.send and the network fault kinds act on it, an idempotent PUT
    (the same shard again replaces it) is retried under the policy, and a refusal comes back typed."""
    if body is not None:
        raw, size = wire.RawBody(body, wire.TENSORS_TYPE), len(body)
    elif ipc is not None:
        raw, size = wire.RawBody(json.dumps({"cuda_ipc": ipc}).encode(), wire.JSON_TYPE), _ipc_bytes(ipc["header"])
    else:
        raw, size = wire.RawBody(json.dumps({"path": path}).encode(), wire.JSON_TYPE), os.path.getsize(path)
    with tracing.span("weights.push_shard", stage="weights_update", shard=shard, bytes=size):
        await client.call(f"/weights/{version}/{shard}", raw, method="PUT", timeout_s=timeout_s,
                          stage="weights_update")


def _ipc_bytes(header: dict) -> int:
    return max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)


async def pull_weights(client: Any, version: str, wait_s: float, timeout_s: float) -> dict:
    """pull_pieces, each parameter put together whole (rlhf.weights.assemble: its pieces must tile it exactly; one
    sent in a single piece is that piece, not a copy)."""
    shards = await pull_pieces(client, version, wait_s, timeout_s)
    with tracing.span("weights.assemble", shards=len(shards)):
        try:
            return assemble(shards)
        except ValueError as exc:
            raise type(exc)(f"weights {version}: {exc}") from None


async def pull_pieces(client: Any, version: str, wait_s: float, timeout_s: float, device: Any = None,
                      consumer: int = 0, who: str = "this process") -> dict:
    """Rollout side of a meta-mode update: wait for the manifest, fetch every shard at once, verify: shard ->
    (its pieces by key, where each lies in its parameter), for rlhf.weights.import_pieces or assemble.

    Shards arrive as raw bytes (or are mapped from shared memory) and become zero-copy tensor views after each
    piece's digest is checked against the one its uploader computed. A cuda_ipc shard is mapped from its train
    rank's GPU memory onto `device` with handle number `consumer` (each rollout server has its own): views of the
    uploader's buffer, to be copied out and released.
    """
    # the MetaServer's wait ends first (504 naming the missing shards), not our timeout
    manifest, _ = await client.call(f"/weights/{version}/manifest?wait_s={wait_s}", method="GET",
                                    timeout_s=max(timeout_s, wait_s + 5.0), stage="weights_update")
    shards = sorted(manifest["shards"])
    ipc = {s: manifest["shards"][s]["cuda_ipc"] for s in shards if "cuda_ipc" in manifest["shards"][s]}
    local = {s for s in shards if os.path.exists(manifest["shards"][s].get("path", "\0"))}  # same host: map the file
    remote = [s for s in shards if s not in local and s not in ipc]
    fetched = await asyncio.gather(*[client.call(f"/weights/{version}/{shard}", method="GET", timeout_s=timeout_s,
                                                 stage="weights_update", raw=True) for shard in remote])
    bodies: dict[str, Any] = {s: body for s, (body, _) in zip(remote, fetched)}
    for s in local:
        with open(manifest["shards"][s]["path"], "rb") as fh:
            bodies[s] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped when its tensors are freed
    decoded: dict = {}
    for shard, sent in ipc.items():
        if consumer >= len(sent["handles"]):
            raise ValueError(f"weights {version}: shard {shard} was shared with {len(sent['handles'])} rollout "
                             f"server(s); {who} is number {consumer}")
        with tracing.span("weights.cuda_ipc_open", shard=shard):
            flat = open_shared(sent["handles"][consumer], device, who)
            tensors, metadata = unpack(flat, sent["header"])
        decoded[shard] = (tensors, json.loads(metadata.get(PIECES, "{}")))
    with tracing.span("weights.verify", shards=len(shards) - len(ipc), mapped=len(local)):
        for shard in shards:
            if shard in ipc:
                continue
            body = bodies[shard]
            if len(body) != manifest["shards"][shard]["bytes"]:
                raise ShardCorrupt(f"weights {version}: shard {shard} arrived with {len(body)} bytes, manifest says "
                                   f"{manifest['shards'][shard]['bytes']}")
            try:
                decoded[shard] = decode_pieces(body)
            except ShardCorrupt as exc:
                raise ShardCorrupt(f"weights {version}, shard {shard} from metaserver: {exc}") from None
    missing = sorted(set(manifest["tensors"]) - {key for tensors, _ in decoded.values() for key in tensors})
    if missing:
        raise ValueError(f"weights {version}: tensor(s) {missing[:3]} in the manifest but not in any shard")
    return decoded
