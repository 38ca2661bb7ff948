"""network_loss: a fraction of requests is lost — the connection reset, or the reply cut mid-body."""

from __future__ import annotations

import errno
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class NetworkLoss(FaultKind):
    NAME = "network_loss"
    DOC = ("requests lost (the fraction is when.probability): at rpc.server.handle the server really resets the "
           "TCP connection or sends a cut-short body; at rpc.client.send the client gets ECONNRESET before sending")
    PARAMS = {
        "mode": ((str,), "reset", "reset (connection reset) or truncate (reply cut mid-body, server side)"),
    }

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "mode" and value not in ("reset", "truncate"):
            return f"{value!r} is not a mode; modes: reset, truncate"
        return super().check_param(key, value)

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        if not set(matched) <= {"rpc.client.send", "rpc.server.handle"}:
            return "network_loss acts on rpc.client.send or rpc.server.handle; points: " + ", ".join(matched)
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        if hit.point == "rpc.server.handle":
            return {"lost": True, "server_action": self.params["mode"]}  # the Service resets or truncates
        import aiohttp

        raise aiohttp.ClientOSError(errno.ECONNRESET, f"Connection reset by peer (network_loss to {hit.peer})")
