"""sglang's distributed weight-update routes (request and reply bodies as sglang 0.5.23's):

    POST /init_weights_update_group     {master_address, master_port, rank_offset, world_size, group_name,
                                         backend}: join the trainer's weights update group as rank rank_offset
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
                                         weight_version, load_format}: receive the tensors by broadcast from group
                                         rank 0 (one per tensor, or one flat buffer with load_format
                                         "flattened_bucket") and copy them into the model
    POST /destroy_weights_update_group  {group_name}: leave it

Each replies {success, message} (400 when success is false). The fault point weights_update.broadcast sits before a
receive; the receive runs on the server's worker thread, so /health and the other inline routes still answer while
it waits for the trainer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from aiohttp import web

from rlhf import tracing
from rlhf.faults import fault_point
from rlhf.transport import weights_group as wg
from rlhf.transport.http import DEFAULT_HOST

log = logging.getLogger("rlhf.rollout_server")

JOIN_TIMEOUT_S = 300.0  # how long a join waits for the other members, and a receive for the trainer's broadcast


def _refused(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


class DistributedWeights:
    """A part of RolloutServer: the weights update groups it belongs to, by name."""

    groups: dict[str, Any]
    receiving: tuple[str, float] | None = None  # (group, since) while a broadcast is being received
    receive_buffers = None  # wg.Buffers, made at the first receive

    def broadcast_health(self) -> dict:
        """What /health adds while a broadcast is received: {"weights_broadcast": {"group", "seconds"}}."""
        if self.receiving is None:
            return {}
        name, since = self.receiving
        return {"weights_broadcast": {"group": name, "seconds": round(time.monotonic() - since, 3)}}

    def init_weights_update_group(self, args: dict, tensors: dict) -> Any:
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in args]
        if missing:
            return _refused(f"/init_weights_update_group needs {', '.join(missing)}")
        name = str(args.get("group_name") or wg.GROUP)
        backend = str(args.get("backend", "nccl"))
        rank, world = int(args["rank_offset"]), int(args["world_size"])
        if backend == "nccl" and self.engine.device.type != "cuda":
            backend = "gloo"  # sglang's default asks for nccl; a CPU server has only gloo
            log.info("weights update group %s: nccl asked, this server runs on %s: gloo", name, self.engine.device)
        with tracing.span("weights.group_join", group=name, rank=rank, world_size=world, backend=backend):
            try:
                group = wg.join(str(args["master_address"]), int(args["master_port"]), rank, world, backend,
                                JOIN_TIMEOUT_S, name, host=DEFAULT_HOST)
            except Exception as exc:  # noqa: BLE001 — sglang answers a failed join with success false
                log.error("rollout-%d: joining weights update group %s at %s:%s failed: %s: %s", self.rank, name,
                          args["master_address"], args["master_port"], type(exc).__name__, exc)
                return _refused(f"Failed to initialize custom process group: {type(exc).__name__}: {exc}.")
        self.groups[name] = (group, backend)
        log.info("rollout-%d: joined weights update group %s as rank %d of %d (%s)", self.rank, name, rank, world,
                 backend)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, args: dict, tensors: dict) -> Any:
        name = str(args.get("group_name") or wg.GROUP)
        if name not in self.groups:
            return _refused(f"Group {name} not in {sorted(self.groups)}. Please call `init_weights_update_group` "
                            "first.")
        names, dtypes, shapes = list(args.get("names", [])), list(args.get("dtypes", [])), list(args.get("shapes", []))
        if not names or not len(names) == len(dtypes) == len(shapes):
            return _refused(f"names, dtypes and shapes must be non-empty lists of one length (got {len(names)}, "
                            f"{len(dtypes)}, {len(shapes)})")
        params = dict(self.engine.model.named_parameters())
        wrong = [f"{n}: {list(s)} (model {list(params[n].shape) if n in params else 'none'})"
                 for n, s in zip(names, shapes) if n not in params or list(params[n].shape) != list(s)]
        if wrong:  # refused before the receive: the trainer's broadcast then fails at its timeout, naming the group
            return _refused(f"weights this model does not have: {wrong[:3]}")
        if args.get("abort_all_requests"):
            self._abort(None, "aborted by /update_weights_from_distributed")
        group, backend = self.groups[name]
        if self.receive_buffers is None:
            self.receive_buffers = wg.Buffers()
        device = self.engine.device if backend == "nccl" else torch.device("cpu")
        fault_point("weights_update.broadcast", peer=name)
        size = wg.bucket_bytes(dtypes, shapes)
        self.receiving = (name, time.monotonic())  # /health says so: the controller's broadcast watchdog reads it
        try:
            with tracing.span("weights.broadcast_receive", group=name, tensors=len(names), bytes=size):
                if args.get("load_format") == "flattened_bucket":
                    buffer = self.receive_buffers.get(size, device)  # the engine copies out before the next bucket
                    wg.broadcast(group, buffer)
                    received = wg.unpack(buffer, names, dtypes, shapes)
                else:
                    received = []
                    for n, d, s in zip(names, dtypes, shapes):
                        t = torch.empty(s, dtype=wg.to_dtype(d), device=device)
                        wg.broadcast(group, t)
                        received.append((n, t))
        finally:
            self.receiving = None
        version = args.get("weight_version")
        self.engine.update_weights_from_named(received, None if version is None else str(version))
        return {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_weights_update_group(self, args: dict, tensors: dict) -> Any:
        name = str(args.get("group_name") or wg.GROUP)
        if self.groups.pop(name, None) is None:
            return _refused("The group to be destroyed does not exist.")
        return {"success": True, "message": "Succeeded to destroy custom process group."}
