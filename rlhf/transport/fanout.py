"""One request per host instead of one per rank: a host's agent fans a call out to its ranks and answers for all of
them (the control plane of a big world: DESIGN §17).

    agent = FanoutAgent(host_index, token, {rank: url, ...}, policy)     # on the host, beside its ranks
    POST /fanout {"call_id", "method": "train_step", "ranks": [...], "args": [...], "stage", "step", "timeout_s",
                  "options"}, tensors "<rank>/<name>"
         → {"replies": [{"rank", "reply"} | {"rank", "error"}], "pending": [ranks]}, tensors "<rank>/<name>"
    POST /fanout_wait {"call_id", "ranks": [the pending ones]}  → the same, for them

An answer comes once every rank has answered, or as soon as one has failed: a rank's error must not wait for the
ranks that wait for it (the others of a collective it never joined); those are `pending`, and the caller asks for
them again with /fanout_wait.

The agent calls each rank over its own loopback connection with the caller's stage and step, so every rank's span,
fault points and typed errors are what a direct call gives; a rank's failure comes back as that rank's (a remote
error with its ErrorInfo, a timeout, a connection error), never as the agent's. `failure_of` turns it back into the
same exception on the caller's side (rlhf.control.workers.WorkerGroup).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlhf.config.resilience import HARDENED, Policy
from rlhf.errors import ErrorInfo, HTTPStatusError, RemoteError, RpcConnectionError, RpcTimeout
from rlhf.transport.client import Client
from rlhf.transport.http import Service


def by_rank(tensors: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Tensors named "<rank>/<name>" grouped by rank."""
    out: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        rank, _, name = key.partition("/")
        out.setdefault(int(rank), {})[name] = t
    return out


def for_ranks(per_rank: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    return {f"{r}/{name}": t for r, tensors in per_rank.items() for name, t in (tensors or {}).items()}


def describe_failure(exc: BaseException) -> dict[str, Any]:
    """A rank's failure as data for the reply (the inverse of failure_of)."""
    if isinstance(exc, RemoteError):
        return {"kind": "remote", "info": exc.info.to_dict(), "url": exc.url}
    if isinstance(exc, RpcTimeout):
        return {"kind": "timeout", "url": exc.url, "timeout_s": exc.timeout_s, "peer": exc.peer}
    if isinstance(exc, RpcConnectionError):
        return {"kind": "connection", "url": exc.url, "peer": exc.peer, "cause": f"{type(exc.cause).__name__}: "
                                                                                  f"{exc.cause}"}
    if isinstance(exc, HTTPStatusError):
        return {"kind": "status", "status": exc.status, "text": exc.text, "url": exc.url, "peer": exc.peer}
    return {"kind": "other", "class": type(exc).__name__, "message": str(exc)}


def failure_of(found: dict[str, Any]) -> BaseException:
    """The exception a direct call to the rank would have raised."""
    kind = found.get("kind")
    if kind == "remote":
        return RemoteError(ErrorInfo.from_reply(found["info"]), found.get("url", ""))
    if kind == "timeout":
        return RpcTimeout(found["url"], float(found["timeout_s"]), found.get("peer", ""))
    if kind == "connection":
        return RpcConnectionError(found["url"], ConnectionError(found.get("cause", "")), found.get("peer", ""))
    if kind == "status":
        return HTTPStatusError(int(found["status"]), found.get("text", ""), found["url"], found.get("peer", ""))
    return RuntimeError(f"{found.get('class', 'Error')}: {found.get('message', '')}")


class FanoutAgent:
    """A host's agent: POST /fanout runs one call on several of this host's ranks at once (module docstring)."""

    def __init__(self, index: int, token: str, ranks: dict[int, str], policy: Policy = HARDENED,
                 timeout_s: float = 600.0) -> None:
        self.service = Service("agent", index, token, policy)
        self.clients = {r: Client(url, token, timeout_s, peer=f"train-{r}", checksums=policy.stage_checksums,
                                  retries=policy.retry_idempotent) for r, url in ranks.items()}
        self.running: dict[str, dict[int, asyncio.Task]] = {}  # call id -> its ranks' calls not yet answered for
        self.service.route("/fanout", self.fanout)
        self.service.route("/fanout_wait", self.wait)
        self.service.route("/health", lambda a, t: {"ok": True, "ranks": sorted(self.clients)}, method="GET",
                           inline=True)

    async def fanout(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        """Start the call on every rank asked for; answer once all have answered, or as soon as one has failed (its
        error must not wait for ranks that wait for it, as in a collective): the others are then `pending`, and
        POST /fanout_wait {call_id, ranks} answers for them in the same way."""
        ranks = [int(r) for r in args["ranks"]]
        unknown = sorted(set(ranks) - set(self.clients))
        if unknown:
            raise ValueError(f"/fanout: ranks {unknown} are not served on this host (it serves {sorted(self.clients)})")
        per_args = args.get("args")
        per_args = per_args if isinstance(per_args, list) else [per_args or {}] * len(ranks)
        sent = by_rank(tensors)
        options = dict(args.get("options") or {})
        call_id = str(args["call_id"])
        self.running[call_id] = {r: asyncio.ensure_future(self.clients[r].call(
            f"/{args['method']}", a, sent.get(r), timeout_s=args.get("timeout_s"), stage=str(args.get("stage", "")),
            step=int(args.get("step", -1)), **options)) for r, a in zip(ranks, per_args)}
        return await self._answer(call_id, ranks)

    async def wait(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        return await self._answer(str(args["call_id"]), [int(r) for r in args["ranks"]])

    async def _answer(self, call_id: str, ranks: list[int]) -> tuple[dict, dict]:
        calls = self.running.get(call_id, {})
        missing = [r for r in ranks if r not in calls]
        if missing:
            raise ValueError(f"/fanout_wait: call {call_id} has no running call on ranks {missing}")
        await asyncio.wait([calls[r] for r in ranks], return_when=asyncio.FIRST_EXCEPTION)
        replies, out, pending = [], {}, []
        for r in ranks:
            task = calls[r]
            if not task.done():
                pending.append(r)
                continue
            del calls[r]
            if task.cancelled():
                replies.append({"rank": r, "error": describe_failure(RuntimeError("the agent's call was cancelled"))})
            elif task.exception() is not None:
                replies.append({"rank": r, "error": describe_failure(task.exception())})
            else:
                reply, got = task.result()
                replies.append({"rank": r, "reply": reply})
                out.update(for_ranks({r: got}))
        if not calls:
            self.running.pop(call_id, None)
        return {"replies": replies, "pending": pending}, out

    async def close(self) -> None:
        for calls in self.running.values():
            for task in calls.values():
                task.cancel()
        for client in self.clients.values():
            await client.close()
