"""/generate and its queue: calls wait for the engine (503 + Retry-After past the limit), run one at a time on
the engine's thread, stream or answer at once; abort, pause and continue between decode steps."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import time
from typing import Any, Callable

from aiohttp import web

from rlhf import tracing
from rlhf.errors import BadRequest, Overloaded
from rlhf.faults import fault_point
from rlhf.rollout.sglang_api import (
    RETRACTED,
    GenerateCall,
    RequestControl,
    output_id,
    parse_generate,
    resumed,
    retracted,
)
from rlhf.rollout.sglang_api import decode_text as sglang_decode
from rlhf.rollout.sglang_api import reply as sglang_reply
from rlhf.services.colocation import DeviceBusy
from rlhf.transport.http import STAGE_HEADER

log = logging.getLogger("rlhf.rollout_server")


class GenerateRoutes:
    """The rollout server's /generate, abort, pause and continue (a part of RolloutServer)."""

    # ------------------------------------------------------------------ /generate

    async def generate_http(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            args = json.loads(body) if body else None
        except ValueError as exc:
            raise BadRequest(f"the /generate body is not JSON: {exc}") from None
        call = parse_generate(args, self.engine.tokenizer)
        if not self.sglang_only and args.get("rlhf_rows") is not None:  # rollout.data_plane store (rows.py)
            self.check_rows(args["rlhf_rows"], call)
            call.rows = args["rlhf_rows"]
        self._admit(call)
        try:
            return await self._serve_call(request, call)
        finally:
            with self._state:
                self.calls -= 1

    def _admit(self, call: GenerateCall) -> None:
        """The call joins the queue for the engine (the caller takes it out of `calls` when it is answered);
        Overloaded (503 + Retry-After) while draining or past rollout.max_queued_requests."""
        if self.draining:
            raise Overloaded(f"rollout-{self.rank} is draining (SIGTERM): it takes no new calls", 1.0)
        with self._state:
            waiting = len(self.queued)
            if self.policy.shed_load and self.max_queued and waiting >= self.max_queued:
                self.shed += 1
                # the queue ahead drains one engine call at a time: about that many call lengths
                raise Overloaded(f"rollout-{self.rank} has {waiting} calls waiting (rollout.max_queued_requests "
                                 f"{self.max_queued}); retry later", waiting * self.call_seconds)
            self.queued.append(call)
            self.calls += 1

    async def _serve_call(self, request: web.Request, call: GenerateCall) -> web.StreamResponse:
        if not call.stream:
            outputs = await self._outputs(call)
            return web.json_response(outputs if call.batch else outputs[0])
        await self.unpaused.wait()  # /pause_generation: new calls wait for /continue_generation
        return await self._stream(request, call, asyncio.get_running_loop(), contextvars.copy_context())

    async def _outputs(self, call: GenerateCall) -> list[dict]:
        """An admitted call's outputs in sglang's shape, once it ran (after a pause, and retracted: resumed)."""
        await self.unpaused.wait()  # /pause_generation: new calls wait for /continue_generation
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()  # the server span follows the work onto the engine thread
        outputs = await loop.run_in_executor(self.service.executor, ctx.run, self._run_call, call, None)
        while call.retracted:  # /pause_generation retract: back in the queue, on from its tokens after the pause
            await self.unpaused.wait()
            with self._state:
                self.queued.append(call)
            outputs = await loop.run_in_executor(self.service.executor, ctx.run, self._resume_call, call, outputs)
        if call.rows is not None:  # kept here, scored here: the reply carries metadata only
            outputs = await loop.run_in_executor(self.service.executor, ctx.run, self.keep_rows, call, outputs)
        return outputs

    async def _stream(self, request: web.Request, call: GenerateCall, loop: asyncio.AbstractEventLoop,
                      ctx: contextvars.Context) -> web.StreamResponse:
        """Server-sent events as sglang sends them: one `data: {json}` per output every stream_interval tokens
        (text and output_ids so far), the final outputs, then `data: [DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        work = loop.run_in_executor(self.service.executor, ctx.run, self._run_call, call,
                                    lambda chunk: loop.call_soon_threadsafe(queue.put_nowait, chunk))
        work.add_done_callback(lambda _f: queue.put_nowait(None))
        gone = False
        while True:
            chunk = await queue.get()
            if chunk is None:
                break
            if not gone:
                try:
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                except (ConnectionError, RuntimeError):  # the client left: abort its call, as sglang does
                    gone = True
                    self._abort(call.prompts, "the client disconnected")
        try:
            outputs = work.result()
        except Exception as exc:
            status = int(getattr(exc, "http_status", 500))
            outputs = [{"error": {"message": f"{type(exc).__name__}: {exc}", "code": status}}]
            if status == 500:
                self.service._log_error(exc, "POST", "/generate", request.headers.get(STAGE_HEADER, ""), -1)
        if not gone:
            for index, out in enumerate(outputs):
                await response.write(b"data: " + json.dumps({**out, "index": index}).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response

    def _run_call(self, call: GenerateCall, on_chunk: Callable[[dict], None] | None) -> list[dict]:
        """One /generate call on the engine thread: prompts with equal sampling in one engine call each."""
        started = time.monotonic()
        try:
            return self._run_call_now(call, on_chunk)
        finally:
            self.call_seconds = time.monotonic() - started

    def _run_call_now(self, call: GenerateCall, on_chunk: Callable[[dict], None] | None) -> list[dict]:
        with self._state:
            self.queued.remove(call)
        self._check_lease()
        fault_point("rollout.generate")
        engine, tok = self.engine, self.engine.tokenizer
        offsets, total = [], 0
        for p in call.prompts:
            offsets.append(total)
            total += p.sampling.n
        outputs: list[dict | None] = [None] * total
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(call.prompts):
            with self._state:
                aborted = p.rid in self.pending_aborts
                self.pending_aborts.discard(p.rid)
            if aborted or p.prefill_only:
                finish = {"type": "abort", "message": "aborted before it started"} if aborted else None
                extra = None  # max_new_tokens 0 scores the prompt: its logprobs, if asked for
                if not aborted and p.return_logprob and p.logprob_start_len >= 0:
                    extra = engine.prompt_logprobs([p.ids], p.logprob_start_len, p.top_logprobs_num)[0]
                for j in range(p.sampling.n):
                    result = {"output_ids": [], "meta_info": {"finish_reason": finish}} if finish else None
                    outputs[offsets[i] + j] = sglang_reply(p, j, result, engine.weight_version, call.started, tok,
                                                           extra, call.return_text_in_logprobs, call.packed_logprobs)
                continue
            groups.setdefault(p.engine_key(), []).append(i)
        n_samples = sum(call.prompts[i].sampling.n for idx in groups.values() for i in idx)
        with tracing.span("generate", prompts=len(call.prompts), n=call.prompts[0].sampling.n) as sp:
            before = engine.tokens_generated
            for idx in groups.values():
                prompts = [call.prompts[i] for i in idx]
                rows = [(i, j) for i in idx for j in range(call.prompts[i].sampling.n)]
                control = RequestControl(prompts, tok, self._chunker(call, rows, offsets, on_chunk) if on_chunk else None,
                                         self._hold)
                results = self._engine_call(prompts, control)
                extra = {}
                for i in idx:
                    p = call.prompts[i]
                    if p.return_logprob and p.logprob_start_len >= 0:
                        extra[i] = engine.prompt_logprobs([p.ids], p.logprob_start_len, p.top_logprobs_num)[0]
                for (i, j), result in zip(rows, results):
                    if retracted(result) and not call.stream:
                        call.retracted.append((offsets[i] + j, i, j, result))
                        continue
                    outputs[offsets[i] + j] = sglang_reply(call.prompts[i], j, result, result["meta_info"]["weight_version"],
                                                           call.started, tok, extra.get(i), call.return_text_in_logprobs,
                                                           call.packed_logprobs)
            sp.set_attribute("rlhf.tokens", engine.tokens_generated - before)
            sp.set_attribute("rlhf.samples", n_samples)
        return outputs if call.retracted else [o for o in outputs if o is not None]  # retracted: their places kept

    def _chunker(self, call: GenerateCall, rows: list[tuple[int, int]], offsets: list[int],
                 emit: Callable[[dict], None]) -> Callable:
        """The stream's per-step chunks for one engine call: each running output every stream_interval tokens."""
        tok = self.engine.tokenizer

        def on_tokens(control: RequestControl, t: int, computed: list[int], finished: dict[int, dict]) -> None:
            for r in computed:
                i, j = rows[r]
                p = call.prompts[i]
                ids = control.generated[r]
                if r in finished or len(ids) % p.stream_interval:
                    continue  # a finished output's last chunk is its final reply
                emit({"text": sglang_decode(tok, ids, p, None), "output_ids": list(ids), "index": offsets[i] + j,
                              "meta_info": {"id": output_id(p, j), "finish_reason": None,
                                            "prompt_tokens": len(p.ids), "completion_tokens": len(ids),
                                            "weight_version": self.engine.weight_version}})

        return on_tokens

    def _engine_call(self, prompts: list[Any], control: RequestControl) -> list[dict]:
        """One engine call of prompts with equal sampling, running (abort, pause) while it does."""
        with self._state:
            self.active.append(control)
        try:
            return self.engine.generate([p.ids for p in prompts], prompts[0].sampling, prompts[0].return_logprob,
                                        prompts[0].top_logprobs_num, control, detokenize=False)
        finally:
            with self._state:
                self.active.remove(control)

    def _resume_call(self, call: GenerateCall, outputs: list[dict | None]) -> list[dict | None]:
        """A call's retracted outputs go on from their tokens (prompt + tokens in, the rest of max_new_tokens; the
        prefill computes their cache under the weights loaded now), as sglang's retract re-queues them. Rows stopped
        at the same decode step run in one engine call."""
        with self._state:
            self.queued.remove(call)
        self._check_lease()
        engine, tok = self.engine, self.engine.tokenizer
        pending, call.retracted = call.retracted, []
        groups: dict[tuple, list[tuple[int, int, int, dict, Any]]] = {}
        for index, i, j, head in pending:
            p = call.prompts[i]
            done = len(head["output_ids"])
            sampling = dataclasses.replace(p.sampling, n=1, max_new_tokens=p.sampling.max_new_tokens - done,
                                           min_new_tokens=max(0, p.sampling.min_new_tokens - done))
            if sampling.max_new_tokens <= 0:  # stopped after its last token: it is complete
                head["meta_info"]["finish_reason"] = {"type": "length", "length": done}
                outputs[index] = sglang_reply(p, j, head, head["meta_info"]["weight_version"], call.started, tok,
                                              None, call.return_text_in_logprobs, call.packed_logprobs)
                continue
            cont = dataclasses.replace(p, ids=p.ids + list(head["output_ids"]), sampling=sampling)
            groups.setdefault(cont.engine_key(), []).append((index, i, j, head, cont))
        with tracing.span("generate.resume", outputs=len(pending)):
            for members in groups.values():
                conts = [m[4] for m in members]
                control = RequestControl(conts, tok, hold=self._hold)
                for r, member in enumerate(members):  # stop strings are looked for across the pause
                    control.generated[r] = list(member[3]["output_ids"])
                results = self._engine_call(conts, control)
                for (index, i, j, head, _c), tail in zip(members, results):
                    joined = resumed(head, tail)
                    if retracted(tail):  # paused again before it finished
                        call.retracted.append((index, i, j, joined))
                        continue
                    p = call.prompts[i]
                    extra = (engine.prompt_logprobs([p.ids], p.logprob_start_len, p.top_logprobs_num)[0]
                             if p.return_logprob and p.logprob_start_len >= 0 else None)
                    outputs[index] = sglang_reply(p, j, joined, tail["meta_info"]["weight_version"], call.started,
                                                  tok, extra, call.return_text_in_logprobs, call.packed_logprobs)
        return outputs if call.retracted else [o for o in outputs if o is not None]

    def _check_lease(self) -> None:
        if self.lease is not None and not self.lease.held:
            if not self.policy.device_busy_fails_fast:
                self._wait_for_device()
            else:
                raise DeviceBusy(f"rollout server {self.rank}: generate without the device lease (device "
                                 f"{self.lease.device} is held by {self.lease.current_holder() or 'the train side'}; "
                                 "was rollout_start delivered?)")

    def _abort(self, prompts: list[Any] | None, message: str) -> int:
        """Abort the running calls of these prompts (None: every call, running or queued); returns how many."""
        with self._state:
            active, queued = list(self.active), list(self.queued)
            if prompts is None:
                self.pending_aborts.update(p.rid for call in queued for p in call.prompts)
        hits = 0
        for control in active:
            for rid in ([p.rid for p in prompts] if prompts is not None else ["*"]):
                hits += control.abort(rid, message)
        if hits:
            self.service.executor.wake()  # a call held by a pause in place ends now
        return hits

    def abort_request(self, args: dict, tensors: dict) -> Any:
        """sglang's /abort_request: {"rid": ...} finishes that request's outputs with finish_reason abort (a
        queued request is answered at once, without tokens); {"abort_all": true} aborts every request."""
        if args.get("abort_all"):
            self._abort(None, "aborted by /abort_request (abort_all)")
            return web.Response(status=200)
        rid = str(args.get("rid") or "")
        if not rid:
            raise BadRequest("/abort_request needs rid or abort_all")
        with self._state:
            active = list(self.active)
            queued = any(p.rid == rid for call in self.queued for p in call.prompts)
            if queued:
                self.pending_aborts.add(rid)
        if [c for c in active if c.abort(rid)]:
            self.service.executor.wake()
        elif not queued:
            log.info("abort_request: no running or queued request %r", rid)
        return web.Response(status=200)

    async def pause_generation(self, args: dict, tensors: dict) -> dict:
        """sglang's /pause_generation. mode abort (default): running requests end now with finish_reason abort;
        retract: running requests stop at the next decode step and go back to the queue with their tokens; after
        /continue_generation they go on from them (a prefill of prompt + tokens under the weights then loaded) and
        reply once, each token's weights version in meta_info output_token_weight_versions, num_retractions
        counted (a streamed call is not retracted: it finishes); in_place: running requests stop at the next decode
        step and keep their tokens and KV cache; a weights update meanwhile runs on the engine's thread while it
        holds them, and after /continue_generation they go on from the same cache under the new weights (each
        token's version in output_token_weight_versions, no re-prefill). The reply comes once no engine call runs
        or the running one is held. New requests wait for /continue_generation in every mode."""
        mode = args.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"pause_generation: mode {mode!r}; valid: abort, in_place, retract")
        self.unpaused.clear()
        if mode == "abort":
            self._abort(None, "aborted by /pause_generation")
        elif mode == "retract":
            with self._state:
                active = [c for c in self.active if c.on_tokens is None]  # not a stream's
            for control in active:
                control.abort("*", RETRACTED)
            self.service.executor.wake()
        else:
            self.holding = True
        while True:  # the engine thread empties or holds; what is queued stays queued (it waits on the pause)
            with self._state:
                if not self.active or self.service.executor.parked:
                    break
            await asyncio.sleep(0.02)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, args: dict, tensors: dict) -> dict:
        self.holding = False
        self.service.executor.wake()
        self.unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _hold(self, control: RequestControl) -> None:
        """At each decode step of a running call, on the engine thread: while /pause_generation in_place holds
        the server, stay here running what the other routes submit (the weights update), until
        /continue_generation or an abort of this call."""
        if self.holding:
            log.info("rollout-%d: a call held at decode step %d (pause in place), its cache kept", self.rank,
                     control.decode_steps)
            self.service.executor.park(lambda: not self.holding or control.aborting)
