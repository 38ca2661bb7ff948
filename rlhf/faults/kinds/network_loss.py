"""network_loss: a fraction of requests is lost — the connection reset, or the reply cut mid-body."""

from __future__ import annotations

import errno
from typing import Any

import aiohttp
from aiohttp import web

from rlhf.faults.kinds import FaultKind, Hit, TransportEffect, register


class ResetConnection(TransportEffect):
    """The server aborts the TCP connection: the client sees a reset."""

    async def replace_reply(self, request: Any) -> web.StreamResponse:
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=500, text="connection reset")


class CutBody(TransportEffect):
    """The headers promise more than is sent, then the connection ends: the client sees a cut body."""

    async def replace_reply(self, request: Any) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = 1 << 20
        await resp.prepare(request)
        await resp.write(b'{"partial": "')
        if request.transport is not None:
            request.transport.abort()
        return resp


class TruncateTensors(TransportEffect):
    """Each reply tensor loses its last `cut` entries along the last dimension (emulated re-framing)."""

    def __init__(self, cut: int) -> None:
        self.cut = cut

    def reply_tensors(self, tensors: dict[str, Any]) -> dict[str, Any]:
        return {k: v[..., : max(0, v.shape[-1] - self.cut)].contiguous() if v.dim() else v for k, v in tensors.items()}


@register
class NetworkLoss(FaultKind):
    NAME = "network_loss"
    DOC = ("requests lost (the fraction is when.probability): at rpc.server.handle the server really resets the "
           "TCP connection or sends a cut-short body; at rpc.client.send the client gets ECONNRESET before sending; "
           "mode truncate_tensor (EMULATED, rpc.server.handle): the reply arrives well-formed but each of its tensors "
           "lost its last `cut` entries along the last dimension, as through a relay that re-frames a partial payload")
    PARAMS = {
        "mode": ((str,), "reset", "reset (connection reset), truncate (reply cut mid-body, server side) or "
                                   "truncate_tensor (reply tensors cut short, emulated)"),
        "cut": ((int,), 2, "truncate_tensor: entries dropped from the end of each reply tensor's last dimension"),
    }

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.EMULATED = self.params["mode"] == "truncate_tensor"

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "mode" and value not in ("reset", "truncate", "truncate_tensor"):
            return f"{value!r} is not a mode; modes: reset, truncate, truncate_tensor"
        return super().check_param(key, value)

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        if not set(matched) <= {"rpc.client.send", "rpc.server.handle"}:
            return "network_loss acts on rpc.client.send or rpc.server.handle; points: " + ", ".join(matched)
        if params.get("mode") == "truncate_tensor" and set(matched) != {"rpc.server.handle"}:
            return "network_loss mode truncate_tensor acts on rpc.server.handle (the reply); points: " + ", ".join(matched)
        return None

    def transport_effect(self, hit: Hit) -> TransportEffect | None:
        if hit.point != "rpc.server.handle":
            return None
        mode = self.params["mode"]
        return ResetConnection() if mode == "reset" else CutBody() if mode == "truncate" else TruncateTensors(self.params["cut"])

    def inject(self, hit: Hit) -> dict[str, Any]:
        if hit.point == "rpc.server.handle":
            return {"lost": True, "mode": self.params["mode"], "cut": self.params["cut"]}  # the server acts
        raise aiohttp.ClientOSError(errno.ECONNRESET, f"Connection reset by peer (network_loss to {hit.peer})")
