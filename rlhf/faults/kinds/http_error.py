"""http_error: the service answers with an HTTP error status instead of running the handler."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rlhf.faults.kinds import FaultKind, Hit, TransportEffect, register


class Respond(TransportEffect):
    def __init__(self, status: int, body: str) -> None:
        self.status, self.body = status, body

    async def replace_reply(self, request: Any) -> web.Response:
        return web.Response(status=self.status, text=self.body)


@register
class HttpError(FaultKind):
    NAME = "http_error"
    DOC = "at rpc.server.handle the service replies with `status` and `body` (a real HTTP reply); target.peer filters paths"
    PARAMS = {
        "status": ((int,), 500, "HTTP status code"),
        "body": ((str,), "injected http_error", "reply text"),
    }

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "status" and not 400 <= value <= 599:
            return f"{value} is not an HTTP error status (400..599)"
        return super().check_param(key, value)

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        if set(matched) != {"rpc.server.handle"}:
            return "http_error acts at rpc.server.handle (use target.peer for the route, e.g. /generate)"
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        return {"status": self.params["status"], "body": self.params["body"]}

    def transport_effect(self, hit: Hit) -> TransportEffect:
        return Respond(self.params["status"], self.params["body"])
