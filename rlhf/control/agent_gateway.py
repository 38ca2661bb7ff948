"""The agents' OpenAI endpoint (agent.path): the gateway in the controller's process that every episode's client
calls, and what it records of each call (rlhf/control/agents.py runs the episodes and makes their samples).

The gateway is an HTTP server (127.0.0.1, a port of its own, the run token as the API key). Each episode's client has
the base URL `http://127.0.0.1:PORT/e/<episode>/v1`: /v1/models, /v1/chat/completions and /v1/completions, parsed as
a rollout server parses them (rlhf.rollout.openai_api: the model's chat template, OpenAI's checks and 400 errors)
with the run's sampling (its temperature, top_p and top_k, every call's max_tokens capped at sampling.max_new_tokens
as an environment's turn; n must be 1, a seed is dropped: the group's episodes must differ; at most agent.max_calls
calls an episode). The calls that reach one server within BATCH_WAIT_S go as one /generate call (a native engine
runs one call at a time), to the least busy server when the episode starts and the same one after; the reply is built
as the server's OpenAI route builds it, with the prompt's and the completion's token ids and versions (and the chosen
tokens' logprobs when the agent asked). A stream is answered as server-sent events made from the whole reply. A
server that fails a call is left for the episode's next server (resilience.migrate_requests; steps.csv
rollout_migrated); with none left, the step fails with the server's error (not the agent's). Each call is a span
`agent.call` (episode, row, call, server, tokens) in the step's trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry import context as otel_context

from rlhf import tracing
from rlhf.config import Policy
from rlhf.control.rollout_fanout import migratable, token_versions
from rlhf.errors import BadRequest
from rlhf.rollout.openai_api import OpenAIBadRequest, chat_request, chunk, completion_request, error_body, response
from rlhf.rollout.sglang_api import parse_generate

log = logging.getLogger("rlhf.controller")

ROUTES = {"chat/completions": "chat", "completions": "completion"}
BATCH_WAIT_S = 0.05  # the calls that reach a server within this long go as one /generate call


@dataclass
class Call:
    """One completion an episode asked for, as the rollout server made it."""

    prompt_ids: list[int]
    ids: list[int]
    lps: list[float]
    versions: list[str]
    text: str
    server: int


@dataclass
class Episode:
    id: str
    k: int  # its place in the step's episodes (group k // group_size)
    row: dict[str, Any]
    step: int
    greedy: bool
    calls: list[Call] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)  # its last call's end (or its start)
    in_flight: str = ""  # the call under way now: "call 3 on rollout-1"
    server: int | None = None
    infra: BaseException | None = None  # a rollout server's failure the agent was answered with
    warned: bool = False
    trace: Any = None  # the step's tracing context: its calls' spans are the rollout stage's children

    def last_call(self) -> str:
        if self.in_flight:
            return f"{self.in_flight}, under way for {time.monotonic() - self.last:.1f} s"
        if not self.calls:
            return "no call yet"
        c = self.calls[-1]
        return (f"call {len(self.calls)} on rollout-{c.server} ({len(c.ids)} tokens: {c.text[-60:]!r}), ended "
                f"{time.monotonic() - self.last:.1f} s ago")


class Gateway:
    """The agents' OpenAI endpoint (module docstring); runs on the fanout's event loop."""

    def __init__(self, fanout: Any, token: str, max_calls: int, policy: Policy | None) -> None:
        self.fanout, self.token, self.max_calls, self.policy = fanout, token, max_calls, policy
        self.episodes: dict[str, Episode] = {}
        self.lock = threading.Lock()
        self.busy: dict[int, int] = {}  # calls under way per rollout server
        self.pending: dict[int, list[tuple[list[int], dict[str, Any], asyncio.Future]]] = {}  # to batch, per server
        self.dead: set[int] = set()  # servers that failed a call this step (left for the others)
        self.migrated = 0
        self.told: set[str] = set()  # the run's sampling settings an agent asked to change: said once each
        self.runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> str:
        async def up() -> str:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("GET", "/e/{episode}/v1/models", self.models)
            app.router.add_route("POST", "/e/{episode}/v1/{route:.+}", self.complete)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return f"http://127.0.0.1:{port}"

        self.url = self.fanout.loop.run(up())
        return self.url

    def stop(self) -> None:
        if self.runner is not None:
            self.fanout.loop.run(self.runner.cleanup())
            self.runner = None

    def _episode(self, request: web.Request) -> Episode | web.Response:
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return web.json_response(error_body("the API key is not this run's token", None, "authentication_error",
                                                "invalid_api_key"), status=401)
        with self.lock:
            ep = self.episodes.get(request.match_info["episode"])
        if ep is None:
            return web.json_response(error_body(f"episode {request.match_info['episode']!r} is not running (it "
                                                "ended, or its step failed)", None, "not_found_error"), status=404)
        return ep

    async def models(self, request: web.Request) -> web.Response:
        ep = self._episode(request)
        if isinstance(ep, web.Response):
            return ep
        reply, _ = await self.fanout.services.rollout[0].call("/v1/models", method="GET", stage="rollout",
                                                               step=ep.step, traced=False)
        return web.json_response(reply)

    def _tell(self, key: str, message: str) -> None:
        if key not in self.told:
            self.told.add(key)
            log.warning("agent: %s", message)

    def _request(self, ep: Episode, kind: str, body: dict[str, Any]) -> tuple[list[int], dict[str, Any], dict]:
        """The agent's request with the run's sampling, parsed as the rollout server parses it (its template, its
        checks): (the prompt's token ids, its sampling_params, what the reply needs). OpenAIBadRequest is the agent's
        400 (the field in its param)."""
        sp = self.fanout.sampling
        if len(ep.calls) >= self.max_calls:
            raise OpenAIBadRequest(f"episode {ep.id} has made its agent.max_calls {self.max_calls} calls")
        if body.get("n") not in (None, 1):
            raise OpenAIBadRequest(f"n must be 1 in a GRPO episode (the group is the run's rollout.group_size "
                                   f"episodes), got {body['n']!r}", "n")
        if body.get("top_logprobs") or (kind == "completion" and body.get("logprobs")):
            raise OpenAIBadRequest("top logprobs are not given during GRPO (the chosen tokens' logprobs are: "
                                   "logprobs true, or 0 for /v1/completions)", "top_logprobs" if kind == "chat"
                                   else "logprobs")
        cap = sp.max_new_tokens  # a call's, as an environment's turn's
        asked = body.pop("max_completion_tokens", None) or body.get("max_tokens")
        body["max_tokens"] = min(int(asked), cap) if isinstance(asked, int) and asked > 0 else cap
        if body.pop("seed", None) is not None:
            self._tell("seed", "a seed in the agent's requests is dropped (a group's episodes must differ)")
        run = {"temperature": 0.0} if ep.greedy else {"temperature": sp.temperature, "top_p": sp.top_p}
        for key, value in run.items():
            if body.get(key) is not None and body[key] != value and not ep.greedy:
                self._tell(key, f"the agent asked {key} {body[key]!r}; the run samples at {value!r} "
                                f"(sampling.{key}: what GRPO trains on)")
            body[key] = value
        if ep.greedy:
            body.pop("top_p", None)
        tokenizer = self.fanout.tokenizer
        generate, meta = (chat_request if kind == "chat" else completion_request)(body, tokenizer, cap)
        try:
            prompts = parse_generate(generate, tokenizer).prompts
        except BadRequest as exc:
            raise OpenAIBadRequest(str(exc), "prompt" if kind == "completion" else "messages") from None
        if len(prompts) != 1:
            raise OpenAIBadRequest(f"one prompt a call in a GRPO episode, got {len(prompts)}", "prompt")
        params = {**generate["sampling_params"], "n": 1}
        if not ep.greedy and sp.top_k > 0:
            params["top_k"] = sp.top_k
        return list(prompts[0].ids), params, meta

    def _server(self, ep: Episode) -> int:
        servers = range(len(self.fanout.services.rollout))
        alive = [r for r in servers if r not in self.dead]
        if not alive:
            raise RuntimeError("no rollout server left")
        if ep.server is None or ep.server not in alive:
            ep.server = min(alive, key=lambda r: (self.busy.get(r, 0), r))
        return ep.server

    async def complete(self, request: web.Request) -> web.StreamResponse:
        ep = self._episode(request)
        if isinstance(ep, web.Response):
            return ep
        kind = ROUTES.get(request.match_info["route"])
        if kind is None:
            return web.json_response(error_body(f"no route /v1/{request.match_info['route']} (the gateway has "
                                                "/v1/models, /v1/chat/completions, /v1/completions)"), status=404)
        try:
            body = json.loads(await request.read() or b"null")
            if not isinstance(body, dict):
                raise OpenAIBadRequest("the request body must be a JSON object")
            ids, params, meta = self._request(ep, kind, body)
        except ValueError as exc:  # OpenAIBadRequest, or the body is not JSON
            return web.json_response(error_body(str(exc), getattr(exc, "param", None)), status=400)
        attached = otel_context.attach(ep.trace) if ep.trace is not None else None
        try:
            with tracing.span("agent.call", stage="rollout", step=ep.step,
                              **{"rlhf.episode": ep.id, "rlhf.row": ep.k, "rlhf.call": len(ep.calls) + 1}) as sp:
                out, r = await self._generate(ep, ids, params)
                sp.set_attribute("rlhf.server", f"rollout-{r}")
                sp.set_attribute("rlhf.tokens", len(out["output_ids"]))
        except _Failed as failed:
            return web.json_response(error_body(str(failed), None, "server_error"), status=502)
        finally:
            if attached is not None:
                otel_context.detach(attached)
        ep.calls.append(Call(ids, [int(i) for i in out["output_ids"]], [float(x) for x in out["logprobs"]],
                             [str(v or "") for v in token_versions(out)], out.get("text") or "", r))
        asked_lp = bool(body.get("logprobs")) if kind == "chat" else body.get("logprobs") is not None
        if asked_lp:  # OpenAI's logprobs from the chosen tokens' (the reply is built as the server builds it)
            out["meta_info"]["output_token_logprobs"] = [(lp, tid, None) for lp, tid in
                                                         zip(out["logprobs"], out["output_ids"])]
        meta["logprobs"] = asked_lp
        reply = response([out], meta, [ids], self.fanout.tokenizer)
        if kind == "chat" and reply["choices"][0]["message"].get("tool_calls") is None:
            reply["choices"][0]["message"].pop("tool_calls", None)
        if not meta["stream"]:
            return web.json_response(reply)
        return await _as_events(request, reply, meta)

    async def _generate(self, ep: Episode, ids: list[int], params: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The completion of one call, generated with the other episodes' calls that reach the same server within
        BATCH_WAIT_S (one /generate call: a native engine runs one call at a time); a server that fails leaves the
        episode's call for another (resilience.migrate_requests), or _Failed with its error."""
        n = len(ep.calls) + 1
        while True:
            try:
                r = self._server(ep)
            except RuntimeError:
                raise _Failed(f"the rollout servers failed: {ep.infra}") from None
            ep.in_flight = f"call {n} on rollout-{r}"
            self.busy[r] = self.busy.get(r, 0) + 1
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            try:
                self._enqueue(r, ep.step, ids, params, future)
                return await future, r
            except Exception as exc:  # noqa: BLE001 — a server lost: the episode goes on elsewhere, or the step fails
                ep.infra = exc
                with self.lock:
                    first = r not in self.dead
                    self.dead.add(r)
                migrate = self.policy is not None and self.policy.migrate_requests and migratable(exc)
                if not migrate or len(self.dead) >= len(self.fanout.services.rollout):
                    raise _Failed(f"rollout-{r}: {type(exc).__name__}: {exc}") from None
                self.migrated += 1
                if first:  # once a server: its episodes' calls all go on elsewhere (steps.csv rollout_migrated)
                    log.warning("step %d: rollout-%d failed agent episode %s's call %d (%s: %s); its episodes' calls "
                                "go on on the other servers", ep.step, r, ep.id, n, type(exc).__name__, exc)
            finally:
                self.busy[r] -= 1
                ep.in_flight = ""
                ep.last = time.monotonic()

    def _enqueue(self, r: int, step: int, ids: list[int], params: dict[str, Any], future: asyncio.Future) -> None:
        queue = self.pending.setdefault(r, [])
        queue.append((ids, params, future))
        if len(queue) == 1:
            asyncio.get_running_loop().call_later(BATCH_WAIT_S, lambda: asyncio.ensure_future(self._flush(r, step)))

    async def _flush(self, r: int, step: int) -> None:
        batch, self.pending[r] = self.pending.get(r, []), []
        if not batch:
            return
        try:
            outs = await self.fanout.generate_on(self.fanout.services.rollout[r], step, [b[0] for b in batch],
                                                 [b[1] for b in batch], True)
        except Exception as exc:  # noqa: BLE001 — each call's own failure: each episode decides what to do
            for _ids, _params, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_ids, _params, future), out in zip(batch, outs):
            if not future.done():
                future.set_result(out)


class _Failed(Exception):
    """The rollout servers failed a call (the agent is answered 502; the step fails with the server's error)."""


async def _as_events(request: web.Request, reply: dict[str, Any], meta: dict[str, Any]) -> web.StreamResponse:
    """A whole reply as the rollout server streams one (openai_api.chunk): the first chunk, the text in one, the last
    with the finish, the token ids, versions and tool calls, the usage when stream_options.include_usage, [DONE]."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    choice = reply["choices"][0]
    text = choice["message"].get("content") if meta["kind"] == "chat" else choice["text"]
    extra = {k: choice[k] for k in ("token_ids", "weight_version", "output_token_weight_versions") if k in choice}
    if meta["kind"] == "chat" and choice["message"].get("tool_calls"):
        extra["tool_calls"] = choice["message"]["tool_calls"]
    events = [chunk(meta, 0, None, first=True), chunk(meta, 0, text or None),
              chunk(meta, 0, None, choice["finish_reason"], extra=extra)]
    if meta["usage_in_stream"]:
        events.append({k: reply[k] for k in ("id", "created", "model")} | {
            "object": reply["object"] + (".chunk" if meta["kind"] == "chat" else ""), "choices": [],
            "usage": reply["usage"]})
    for event in events:
        await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
