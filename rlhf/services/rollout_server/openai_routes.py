"""OpenAI's routes on the rollout server (the native engine; a real sglang server has its own): /v1/models,
/v1/completions, /v1/chat/completions. Each request becomes a /generate call in the same queue (pause and continue,
shed load, the fault point rollout.generate, the server's span, the run token as `Authorization: Bearer`), and its
outputs OpenAI's reply (rlhf/rollout/openai_api.py). A part of RolloutServer."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from typing import Any

from aiohttp import web

from rlhf.errors import BadRequest, Overloaded
from rlhf.rollout.openai_api import OpenAIBadRequest, chat_request, chunk, completion_request, error_body, response
from rlhf.rollout.sglang_api import GenerateCall, parse_generate
from rlhf.transport.http import STAGE_HEADER

log = logging.getLogger("rlhf.rollout_server")


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, param, kind), status=status, headers=headers)


class OpenAIRoutes:
    """The /v1 routes (needs RolloutServer's service, engine, model_path, started, _admit, _outputs, _run_call,
    _abort, unpaused, calls)."""

    openai_max_tokens: int | None = None  # the longest completion a request may ask for (None: no limit)

    def openai_routes(self) -> None:
        self.service.raw_route("GET", "/v1/models", self.v1_models)
        self.service.raw_route("POST", "/v1/completions", lambda r: self.v1(r, "completion"))
        self.service.raw_route("POST", "/v1/chat/completions", lambda r: self.v1(r, "chat"))

    async def v1_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_path or "rlhf-native", "object": "model", "created": int(self.started),
             "owned_by": "rlhf", "max_model_len": getattr(self.engine.model.config, "max_position_embeddings", None)}]})

    async def v1(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = json.loads(await request.read() or b"null")
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        tokenizer = self.engine.tokenizer
        try:
            parse = chat_request if kind == "chat" else completion_request
            generate, meta = parse(body, tokenizer, self.openai_max_tokens)
            call = parse_generate(generate, tokenizer)
            self._admit(call)
        except OpenAIBadRequest as exc:
            return _error(400, str(exc), exc.param)
        except BadRequest as exc:
            return _error(400, str(exc))
        except Overloaded as exc:
            return _error(503, str(exc), kind="server_error",
                          headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
        prompt_ids = [list(p.ids) for p in call.prompts]
        try:
            if meta["stream"]:
                return await self._v1_stream(request, call, meta, prompt_ids)
            outputs = await self._outputs(call)
            return web.json_response(response(outputs, meta, prompt_ids, tokenizer))
        except Exception as exc:  # noqa: BLE001 — every failure is a reply in OpenAI's shape, logged with its stage
            status = int(getattr(exc, "http_status", 500))
            if status >= 500:
                self.service._log_error(exc, "POST", request.path, request.headers.get(STAGE_HEADER, ""), -1)
            return _error(status, f"rollout-{self.rank}: {type(exc).__name__}: {exc}",
                          kind="server_error" if status >= 500 else "invalid_request_error")
        finally:
            with self._state:
                self.calls -= 1

    async def _v1_stream(self, request: web.Request, call: GenerateCall, meta: dict[str, Any],
                         prompt_ids: list[list[int]]) -> web.StreamResponse:
        """Server-sent events as OpenAI sends them: a first chunk per choice (chat: its role), the text's new
        piece every token, a last chunk with finish_reason and the choice's token ids and version (tool calls, if
        any, in it), the usage chunk when stream_options.include_usage, then `data: [DONE]`."""
        await self.unpaused.wait()
        response_ = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response_.prepare(request)
        loop, ctx = asyncio.get_running_loop(), contextvars.copy_context()
        queue: asyncio.Queue = asyncio.Queue()
        work = loop.run_in_executor(self.service.executor, ctx.run, self._run_call, call,
                                    lambda c: loop.call_soon_threadsafe(queue.put_nowait, c))
        work.add_done_callback(lambda _f: queue.put_nowait(None))
        sent: dict[int, str] = {}
        gone = False

        async def send(payload: dict[str, Any]) -> None:
            nonlocal gone
            if gone:
                return
            try:
                await response_.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            except (ConnectionError, RuntimeError):  # the client left: abort its call
                gone = True
                self._abort(call.prompts, "the client disconnected")

        total = sum(p.sampling.n for p in call.prompts)
        for index in range(total):
            sent[index] = ""
            await send(chunk(meta, index, None, first=True))
        while (item := await queue.get()) is not None:
            index, text = item["index"], item["text"]
            if text.startswith(sent[index]) and len(text) > len(sent[index]):
                await send(chunk(meta, index, text[len(sent[index]):]))
                sent[index] = text
        try:
            outputs = work.result()
        except Exception as exc:  # noqa: BLE001 — the stream's last event says what failed
            status = int(getattr(exc, "http_status", 500))
            if status >= 500:
                self.service._log_error(exc, "POST", request.path, request.headers.get(STAGE_HEADER, ""), -1)
            await send(error_body(f"rollout-{self.rank}: {type(exc).__name__}: {exc}", None, "server_error"))
            outputs = []
        if outputs:
            final = response(outputs, meta, prompt_ids, self.engine.tokenizer)
            for index, (out, choice) in enumerate(zip(outputs, final["choices"])):
                text = out["text"]
                rest = text[len(sent[index]):] if text.startswith(sent[index]) else ""
                extra = {k: choice[k] for k in ("token_ids", "weight_version", "output_token_weight_versions")
                         if k in choice}
                if choice.get("message", {}).get("tool_calls"):
                    extra["tool_calls"] = choice["message"]["tool_calls"]
                await send(chunk(meta, index, rest or None, choice["finish_reason"], extra=extra))
            if meta["usage_in_stream"]:
                await send({"id": meta["id"], "object": final["object"] + (".chunk" if meta["kind"] == "chat" else ""),
                            "created": meta["created"], "model": meta["model"], "choices": [],
                            "usage": final["usage"]})
        if not gone:
            await response_.write(b"data: [DONE]\n\n")
            await response_.write_eof()
        return response_
