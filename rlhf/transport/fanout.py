"""One request per host instead of one per rank: a host's agent fans a call out to its ranks and answers for all of
them (the control plane of a big world: DESIGN §17).

    agent = FanoutAgent(host_index, token, {rank: url, ...}, policy)     # on the host, beside its ranks
    POST /fanout {"call_id", "method": "train_step", "ranks": [...], "args": [...], "stage", "step", "timeout_s",
                  "options", "packed"}, tensors "*/<name>" (every rank's of a name in one: for_ranks)
         → {"replies": [{"rank", "reply"} | {"rank", "error"}], "pending": [ranks], "packed"}, tensors the same
    POST /fanout_wait {"call_id", "ranks": [the pending ones]}  → the same, for them
    POST /fanout_untraced                                         → /fanout without a span (the watchdog's heartbeats)

An answer comes once every rank has answered, or as soon as one has failed: a rank's error must not wait for the
ranks that wait for it (the others of a collective it never joined); those are `pending`, and the caller asks for
them again with /fanout_wait.

The agent calls each rank over its own loopback connection with the caller's stage and step, so every rank's span,
fault points and typed errors are what a direct call gives (the agent's own client span of a rank's call is kept
only when it failed: a big world's traces keep every error whole, not every success twice); a rank's failure comes back as that rank's (a remote
error with its ErrorInfo, a timeout, a connection error), never as the agent's. `failure_of` turns it back into the
same exception on the caller's side (rlhf.control.workers.WorkerGroup).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Callable

from rlhf import tracing
from rlhf.config.resilience import HARDENED, Policy
from rlhf.errors import ErrorInfo, HTTPStatusError, RemoteError, RpcConnectionError, RpcTimeout
from rlhf.transport.client import Client
from rlhf.transport.http import Service

PACKED = "*/"  # a packed name's prefix: no rank's tensor name starts with it


def for_ranks(per_rank: dict[int, dict[str, Any] | None]) -> tuple[dict[str, Any], dict[str, list]]:
    """Several ranks' tensors as one body: each name's tensors of every rank (of one dtype) flattened into one
    ("*/<name>"), with the layout that puts them back ({name: [[rank, shape], ...]}: by_rank). A safetensors body of
    a thousand small tensors (64 ranks' advantages and mini-batches) costs far more than their bytes; one of a few
    does not. A name whose ranks' dtypes differ travels as "<rank>/<name>", one tensor each."""
    import torch

    groups: dict[str, list[tuple[int, Any]]] = {}
    for r, tensors in per_rank.items():
        for name, t in (tensors or {}).items():
            groups.setdefault(name, []).append((r, t))
    out: dict[str, Any] = {}
    layout: dict[str, list] = {}
    for name, items in groups.items():
        if len({t.dtype for _, t in items}) > 1:
            out.update({f"{r}/{name}": t for r, t in items})
            continue
        out[PACKED + name] = torch.cat([t.reshape(-1) for _, t in items])
        layout[name] = [[r, list(t.shape)] for r, t in items]
    return out, layout


def by_rank(tensors: dict[str, Any], layout: dict[str, list] | None = None) -> dict[int, dict[str, Any]]:
    """for_ranks' body back as each rank's tensors (views of the packed ones)."""
    import math

    out: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith(PACKED):
            name = key[len(PACKED):]
            placed = (layout or {}).get(name)
            if placed is None:
                raise ValueError(f"fanout body: packed tensor {name!r} has no layout")
            sizes = [math.prod(shape) for _, shape in placed]
            if sum(sizes) != t.numel():
                raise ValueError(f"fanout body: packed tensor {name!r} has {t.numel()} elements, its layout "
                                 f"{sum(sizes)}")
            for (r, shape), piece in zip(placed, t.split(sizes)):
                out.setdefault(int(r), {})[name] = piece.view(shape)
            continue
        rank, _, name = key.partition("/")
        out.setdefault(int(rank), {})[name] = t
    return out


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


async def relay(agent: Client, method: str, futures: dict[int, asyncio.Future], args: list[Any],
                tensors: list[dict | None], stage: str, step: int, timeout_s: float, options: dict[str, Any],
                role: str = "train") -> None:
    """One call on several ranks (or servers) of one host through its agent: each future gets its rank's reply and
    tensors, or its own error (failure_of); the agent's own failure fails every rank still waiting, as a direct call
    would have (a host that cannot be reached is each of its ranks that cannot: `cannot reach train-70 (…/fanout…)`,
    role-R naming the rank, the URL its host's). The agent answers early when a rank fails; the ranks still running
    are asked for again (/fanout_wait)."""

    def deliver(rank: int, outcome: Any) -> None:
        if futures[rank].done():  # cancelled meanwhile
            return
        if isinstance(outcome, BaseException):
            futures[rank].set_exception(outcome)
        else:
            futures[rank].set_result(outcome)

    await _exchange(agent, method, list(futures), args, tensors, stage, step, timeout_s, options, role, deliver)


async def collect(agent: Client, method: str, ranks: list[int], timeout_s: float, options: dict[str, Any],
                  role: str = "train") -> dict[int, Any]:
    """The same call without a future per rank (the watchdog's heartbeats of a thousand ranks, twice a second):
    rank -> its (reply, tensors), or its error as an exception object."""
    out: dict[int, Any] = {}
    await _exchange(agent, method, ranks, [{}] * len(ranks), [None] * len(ranks), "", -1, timeout_s, options, role,
                    out.__setitem__)
    return out


async def _exchange(agent: Client, method: str, mine: list[int], args: list[Any], tensors: list[dict | None],
                    stage: str, step: int, timeout_s: float, options: dict[str, Any], role: str,
                    deliver: Callable[[int, Any], None]) -> None:
    body: dict[str, Any] = {"call_id": secrets.token_hex(8), "method": method, "ranks": mine, "args": args,
                            "stage": stage, "step": step, "timeout_s": timeout_s, "options": options}
    traced = bool(options.get("traced", True))  # an untraced call (a heartbeat) is untraced at every hop
    sent, body["packed"] = for_ranks(dict(zip(mine, tensors)))
    path = f"/fanout{'' if traced else '_untraced'}?to={method}"
    while mine:
        try:
            reply, got = await agent.call(path, body, sent, timeout_s=timeout_s + 5.0, stage=stage, step=step,
                                          traced=traced)
        except Exception as exc:  # noqa: BLE001 — the host's failure is each of its ranks' failure
            for r in mine:
                deliver(r, _as_rank(exc, f"{role}-{r}"))
            return
        got_by_rank = by_rank(got, reply.get("packed")) if got else {}
        for item in reply["replies"]:
            r = int(item["rank"])
            deliver(r, failure_of(item["error"]) if "error" in item else (item["reply"], got_by_rank.get(r, {})))
        mine = [int(r) for r in reply.get("pending", [])]
        path, body, sent = f"/fanout_wait?to={method}", {"call_id": body["call_id"], "ranks": mine}, {}


def _as_rank(exc: Exception, peer: str) -> Exception:
    """The host's connection error or timeout as the rank's own (the peer its name, the URL the host's)."""
    if isinstance(exc, RpcConnectionError):
        return RpcConnectionError(exc.url, exc.cause, peer)
    if isinstance(exc, RpcTimeout):
        return RpcTimeout(exc.url, exc.timeout_s, peer)
    return exc


class FanoutAgent:
    """A host's agent: POST /fanout runs one call on several of this host's ranks at once (module docstring).
    role: what its ranks are (train: train-R; rollout: its rollout servers, rollout-R)."""

    def __init__(self, index: int, token: str, ranks: dict[int, str], policy: Policy = HARDENED,
                 timeout_s: float = 600.0, role: str = "train") -> None:
        self.service = Service("agent", index, token, policy)
        self.clients = {r: Client(url, token, timeout_s, peer=f"{role}-{r}", checksums=policy.stage_checksums,
                                  retries=policy.retry_idempotent) for r, url in ranks.items()}
        self.running: dict[str, dict[int, asyncio.Task]] = {}  # call id -> its ranks' calls not yet answered for
        self.service.route("/fanout", self.fanout)
        self.service.route("/fanout_untraced", self.fanout)  # the same, without a span (heartbeats every 0.5 s)
        self.service.untraced_paths.add("/fanout_untraced")
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
        sent = by_rank(tensors, args.get("packed"))
        options = dict(args.get("options") or {})
        call_id = str(args["call_id"])
        self.running[call_id] = {r: asyncio.ensure_future(self._call(
            r, f"/{args['method']}", a, sent.get(r), args.get("timeout_s"), str(args.get("stage", "")),
            int(args.get("step", -1)), options)) for r, a in zip(ranks, per_args)}
        return await self._answer(call_id, ranks)

    async def _call(self, rank: int, path: str, args: Any, tensors: dict | None, timeout_s: float | None, stage: str,
                    step: int, options: dict[str, Any]) -> tuple[Any, dict]:
        """One rank's call. Its span is the rank's own (the trace context still travels: the rank's server span is
        a child of this agent's /fanout span); only a failure gets a client span here too, with its error, as a
        direct call's would have (a big world's traces keep every error whole, not every success twice)."""
        client = self.clients[rank]
        try:
            return await client.call(path, args, tensors, timeout_s=timeout_s, stage=stage, step=step,
                                     **{**options, "traced": False})
        except Exception:
            if options.get("traced", True):
                with tracing.span(f"{options.get('method', 'POST')} {path.split('?', 1)[0]}", stage=stage or None,
                                  step=step, kind=tracing.SpanKind.CLIENT, peer=client.peer,
                                  **{"server.address": client.base_url}):
                    raise
            raise

    async def wait(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        return await self._answer(str(args["call_id"]), [int(r) for r in args["ranks"]])

    async def _answer(self, call_id: str, ranks: list[int]) -> tuple[dict, dict]:
        calls = self.running.get(call_id, {})
        missing = [r for r in ranks if r not in calls]
        if missing:
            raise ValueError(f"/fanout_wait: call {call_id} has no running call on ranks {missing}")
        await asyncio.wait([calls[r] for r in ranks], return_when=asyncio.FIRST_EXCEPTION)
        replies, got_by_rank, pending = [], {}, []
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
                got_by_rank[r] = got
        if not calls:
            self.running.pop(call_id, None)
        out, packed = for_ranks(got_by_rank)
        return {"replies": replies, "pending": pending, "packed": packed}, out

    async def close(self) -> None:
        for calls in self.running.values():
            for task in calls.values():
                task.cancel()
        for client in self.clients.values():
            await client.close()


class HostRelay:
    """The controller's side of one host's agent for services it calls one by one (rollout servers): the calls to
    the host's servers made in one turn of the event loop with the same route, stage and step go as one /fanout
    request. Nothing changes for the caller: each server's RelayedClient.call returns that server's reply or raises
    its own error (or the agent's, when the host is unreachable)."""

    def __init__(self, agent: Client) -> None:
        self.agent = agent
        self.pending: dict[tuple, list[tuple[int, Any, dict | None, asyncio.Future]]] = {}

    def submit(self, server: int, path: str, args: Any, tensors: dict | None, timeout_s: float, stage: str, step: int,
               options: dict[str, Any]) -> asyncio.Future:
        key = (path, stage, step, timeout_s, tuple(sorted(options.items())))
        loop = asyncio.get_running_loop()
        if key not in self.pending:  # the first of this turn's calls: the others made in this turn join it
            self.pending[key] = []
            loop.call_soon(lambda: asyncio.ensure_future(self._flush(key)))
        future = loop.create_future()
        self.pending[key].append((server, args, tensors, future))
        return future

    async def _flush(self, key: tuple) -> None:
        path, stage, step, timeout_s, options = key
        calls = self.pending.pop(key)
        futures = {server: future for server, _a, _t, future in calls}
        if len(futures) < len(calls):  # the same server twice in one turn: one call each, one request each
            for server, args, tensors, future in calls:
                await relay(self.agent, path.lstrip("/"), {server: future}, [args], [tensors], stage, step,
                            timeout_s, dict(options), role="rollout")
            return
        await relay(self.agent, path.lstrip("/"), futures, [a for _s, a, _t, _f in calls],
                    [t for _s, _a, t, _f in calls], stage, step, timeout_s, dict(options), role="rollout")


class RelayedClient:
    """A Client whose calls go through its host's agent (HostRelay); raw and fault-pointed calls go direct."""

    def __init__(self, client: Client, server: int, host: HostRelay) -> None:
        self.client, self.server, self.host = client, server, host
        self.base_url, self.peer, self.timeout_s = client.base_url, client.peer, client.timeout_s

    async def call(self, path: str, args: Any = None, tensors: dict | None = None, timeout_s: float | None = None,
                   stage: str = "", step: int = -1, method: str = "POST", traced: bool = True,
                   points: tuple[str, ...] = (), raw: bool = False) -> tuple[Any, dict]:
        if raw or points:
            return await self.client.call(path, args, tensors, timeout_s, stage, step, method, traced, points, raw)
        return await self.host.submit(self.server, path, args, tensors,
                                      self.timeout_s if timeout_s is None else timeout_s, stage, step,
                                      {"method": method, "traced": traced})

    async def close(self) -> None:
        await self.client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
