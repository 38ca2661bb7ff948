"""Rollout server: the native engine behind the sglang-compatible HTTP API.

    python -m rlhf.runtime.rollout_server --run-dir D --rank R --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

sglang paths and fields: /generate, /update_weights_from_disk, /release_memory_occupation,
/resume_memory_occupation, /health, /health_generate, /abort_request, /model_info; our
extensions: /update_weights_from_meta (pull a version from the MetaServer), /events
(colocation), /weights_checksum. In colocated mode /generate needs the device lease.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextvars
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch
from aiohttp import web

from rlhf import exits, faults, tracing
from rlhf.config import build_config
from rlhf.devices import relocate
from rlhf.faults import afault_point, fault_point
from rlhf.models import build_model_and_tokenizer
from rlhf.procs import own_threads, set_pdeathsig, write_atomic
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sglang_api import SGLANG_VERSION, GenerateCall, RequestControl, output_id, parse_generate
from rlhf.rollout.sglang_api import decode_text as sglang_decode
from rlhf.rollout.sglang_api import reply as sglang_reply
from rlhf.run_dir import setup_logging
from rlhf.runtime.client import Client
from rlhf.runtime.colocation import DeviceBusy, DeviceLease, device_name, fresh_allocation, read_leak
from rlhf.runtime.errors import BadRequest, Overloaded
from rlhf.runtime.http import DEFAULT_HOST, STAGE_HEADER, Service, serve_forever
from rlhf.runtime.metaserver import pull_weights
from rlhf.runtime.resilience import HARDENED, Policy
from rlhf.tracing.setup import start_process_telemetry, stop_process_telemetry

log = logging.getLogger("rlhf.rollout_server")


class DeviceMemoryNotReleased(RuntimeError):
    """verify_release: a release_memory_occupation left device memory allocated."""


class RolloutServer:
    """sglang's native API over the native engine (`sglang_only`: none of our extensions, as a real sglang)."""

    def __init__(self, engine: Any, rank: int, token: str, policy: Policy = HARDENED,
                 lease: DeviceLease | None = None, lease_timeout_s: float = 30.0, run_dir: str = "",
                 verify_checksum: str = "sha256", sglang_only: bool = False, model_path: str = "",
                 max_queued: int = 0, threads: int = 1) -> None:
        """threads: torch's intra-op threads on the engine's thread (rlhf.procs.own_threads)."""
        self.engine, self.rank, self.token, self.run_dir = engine, rank, token, run_dir
        self.verify_checksum = verify_checksum  # algorithm of /weights_checksum (weights.verify)
        self.device = device_name("rollout", rank, lease is not None)
        self.lease, self.lease_timeout_s = lease, lease_timeout_s
        self.service = Service("rollout", rank, token, policy, threads=threads)
        self.service.open_paths = ("/health", "/ready")  # probes without the token, as sglang leaves them
        self.service.untraced_paths.update(("/health", "/ready"))  # the controller probes every step: no span each
        self.policy, self.sglang_only = policy, sglang_only
        self.model_path = model_path or (getattr(engine.model.config, "_name_or_path", "") if engine else "")
        self.host, self.port = DEFAULT_HOST, 0
        self.started = time.time()
        self.active: list[RequestControl] = []  # engine calls running now (abort, pause)
        self.queued: list[GenerateCall] = []  # calls waiting for the engine
        self.pending_aborts: set[str] = set()  # rids aborted before their call started
        self.unpaused = asyncio.Event()  # cleared while /pause_generation holds new calls
        self.unpaused.set()
        self.draining = False  # SIGTERM with graceful_drain: no new calls, the others finish
        self.calls = 0  # /generate calls accepted and not yet answered (queued or running)
        self.drain_left = 0  # calls a drain that timed out left behind
        self.max_queued = max_queued  # calls let wait for the engine (policy shed_load; 0: no limit)
        self.shed = 0  # calls answered 503 (over max_queued)
        self.call_seconds = 1.0  # how long the last engine call took (Retry-After's estimate)
        self._state = threading.Lock()
        r = self.service.route
        self.service.raw_route("POST", "/generate", self.generate_http)
        self.service.raw_route("PUT", "/generate", self.generate_http)
        r("/update_weights_from_disk", self.update_weights_from_disk)
        r("/update_weight_version", self.update_weight_version, inline=True)
        r("/release_memory_occupation", self.release_memory, method=("GET", "POST"))
        r("/resume_memory_occupation", self.resume_memory, method=("GET", "POST"))
        r("/abort_request", self.abort_request, inline=True)
        r("/pause_generation", self.pause_generation)
        r("/continue_generation", self.continue_generation, inline=True)
        r("/flush_cache", lambda a, t: web.Response(text="Cache flushed.\nNo cache outlives a call in the native "
                                                         "engine, so there was nothing to flush.\n"),
          method=("GET", "POST"), inline=True)
        r("/health", lambda a, t: {"ok": True, "weight_version": self.engine.weight_version}, method="GET", inline=True)
        r("/health_generate", self.health_generate, method="GET")
        r("/ready", self.ready, method="GET", inline=True)
        for path in ("/model_info", "/get_model_info"):
            r(path, self.model_info, method="GET", inline=True)
        for path in ("/server_info", "/get_server_info"):
            r(path, self.server_info, method="GET", inline=True)
        if not sglang_only:  # our extensions (a real sglang server has none of them)
            r("/update_weights_from_meta", self.update_weights_from_meta)
            r("/events", self.events)
            r("/weights_checksum", lambda a, t: {"checksum": self.engine.weights_checksum(self.verify_checksum),
                                                 "weight_version": self.engine.weight_version}, method="GET")
            r("/rng_state", self.rng_state, method=("GET", "POST"))

    def rng_state(self, args: dict, tensors: dict) -> dict:
        """The sampling generator's state (GET), or set it (POST {"state": ...}): a checkpoint keeps it, so that a
        resumed run draws the samples the uninterrupted run would have. Base64 of its raw bytes, no pickle."""
        gen = self.engine.generator
        if args.get("state") is not None:
            try:
                raw = base64.b64decode(args["state"], validate=True)
                gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            except (ValueError, RuntimeError) as exc:
                raise BadRequest(f"/rng_state: 'state' is not this server's generator state ({exc})") from None
        return {"state": base64.b64encode(gen.get_state().numpy().tobytes()).decode(), "device": str(gen.device)}

    def ready(self, args: dict, tensors: dict) -> Any:
        """Readiness: 200 when the server takes calls (not draining) and, with ?weight_version=V, its weights are
        version V; else 503 with what it has (a probe after a restart waits for the step's weights)."""
        want, have = args.get("weight_version"), self.engine.weight_version
        if self.draining:
            return web.json_response({"ready": False, "why": "draining", "weight_version": have}, status=503)
        if want is not None and str(want) != have:
            return web.json_response({"ready": False, "why": f"weights are version {have}, not {want}",
                                      "weight_version": have}, status=503)
        return web.json_response({"ready": True, "weight_version": have})

    # ------------------------------------------------------------------ /generate

    async def generate_http(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            args = json.loads(body) if body else None
        except ValueError as exc:
            raise BadRequest(f"the /generate body is not JSON: {exc}") from None
        call = parse_generate(args, self.engine.tokenizer)
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
        try:
            return await self._serve_call(request, call)
        finally:
            with self._state:
                self.calls -= 1

    async def _serve_call(self, request: web.Request, call: GenerateCall) -> web.StreamResponse:
        await self.unpaused.wait()  # /pause_generation: new calls wait for /continue_generation
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()  # the server span follows the work onto the engine thread
        if not call.stream:
            outputs = await loop.run_in_executor(self.service.executor, ctx.run, self._run_call, call, None)
            return web.json_response(outputs if call.batch else outputs[0])
        return await self._stream(request, call, loop, ctx)

    async def drain(self, stop: asyncio.Event, timeout_s: float) -> None:
        """graceful_drain: take no new calls, let the running and queued ones finish (a pause is lifted for
        them), then set `stop`; after timeout_s stop anyway, recording what was left."""
        self.draining = True
        self.unpaused.set()  # what is queued runs
        with self._state:
            log.info("rollout-%d: SIGTERM: draining %d call(s)", self.rank, self.calls)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._state:
                left = self.calls
            if not left or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        self.drain_left = left
        if left:
            log.warning("rollout-%d: drain timed out after %g s (runtime.drain_timeout_s) with %d call(s) left",
                        self.rank, timeout_s, left)
        else:
            log.info("rollout-%d: drained; exiting 0", self.rank)
        stop.set()

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
                control = RequestControl(prompts, tok, self._chunker(call, rows, offsets, on_chunk) if on_chunk else None)
                with self._state:
                    self.active.append(control)
                try:
                    results = engine.generate([p.ids for p in prompts], prompts[0].sampling, prompts[0].return_logprob,
                                              prompts[0].top_logprobs_num, control, detokenize=False)
                finally:
                    with self._state:
                        self.active.remove(control)
                extra = {}
                for i in idx:
                    p = call.prompts[i]
                    if p.return_logprob and p.logprob_start_len >= 0:
                        extra[i] = engine.prompt_logprobs([p.ids], p.logprob_start_len, p.top_logprobs_num)[0]
                for (i, j), result in zip(rows, results):
                    outputs[offsets[i] + j] = sglang_reply(call.prompts[i], j, result, result["meta_info"]["weight_version"],
                                                           call.started, tok, extra.get(i), call.return_text_in_logprobs,
                                                           call.packed_logprobs)
            sp.set_attribute("rlhf.tokens", engine.tokens_generated - before)
            sp.set_attribute("rlhf.samples", n_samples)
        return [o for o in outputs if o is not None]

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
        if not [c for c in active if c.abort(rid)] and not queued:
            log.info("abort_request: no running or queued request %r", rid)
        return web.Response(status=200)

    async def pause_generation(self, args: dict, tensors: dict) -> dict:
        """sglang's /pause_generation. mode abort (default): running requests end now with finish_reason abort;
        in_place and retract: running engine calls finish (the native engine does not preempt a call), and the
        reply comes once they have. New requests wait for /continue_generation in every mode."""
        mode = args.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"pause_generation: mode {mode!r}; valid: abort, in_place, retract")
        self.unpaused.clear()
        if mode == "abort":
            self._abort(None, "aborted by /pause_generation")
        while True:  # the engine thread empties; what is queued stays queued (it waits on the pause)
            with self._state:
                if not self.active:
                    break
            await asyncio.sleep(0.02)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, args: dict, tensors: dict) -> dict:
        self.unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _wait_for_device(self) -> None:
        """device_busy_fails_fast off: a generate that finds the device taken retries its allocation, as a CUDA caching allocator
        retry loop would, each failure an ERROR line, until lease_timeout_s."""
        assert self.lease is not None
        start = time.monotonic()
        deadline, attempt = start + self.lease_timeout_s, 0
        while True:
            attempt += 1
            try:
                self.lease.acquire(0)
                log.info("generate: device %d acquired after %d attempts", self.lease.device, attempt)
                return
            except DeviceBusy as exc:
                log.error("generate: allocating the KV cache failed (attempt %d, %.0f s): %s", attempt,
                          time.monotonic() - start, exc)
                if time.monotonic() >= deadline:
                    raise
            time.sleep(1.0)

    def update_weights_from_disk(self, args: dict, tensors: dict) -> Any:
        """sglang's reply {success, message, num_paused_requests}; a path it cannot load is a 400 with success false."""
        path = args.get("model_path")
        version = str(args.get("weight_version") or self.engine.weight_version)
        if args.get("abort_all_requests"):
            self._abort(None, "aborted by /update_weights_from_disk")
        fault_point("weights_update.update", path=str(path))
        if not isinstance(path, str) or not os.path.isdir(path):
            return web.json_response({"success": False, "num_paused_requests": 0,
                                      "message": f"model_path {path!r} is not a directory with *.safetensors"},
                                     status=400)
        with tracing.span("weights.load", source="disk", weight_version=version):
            try:
                self.engine.update_weights_from_disk(path, version)
            except FileNotFoundError as exc:
                return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
        self.model_path = path
        return {"success": True, "message": f"loaded {path}", "weight_version": version, "num_paused_requests": 0}

    def update_weight_version(self, args: dict, tensors: dict) -> dict:
        new = args.get("new_version")
        if not new:
            raise BadRequest("/update_weight_version needs new_version")
        if args.get("abort_all_requests", True):
            self._abort(None, "aborted by /update_weight_version")
        self.engine.weight_version = str(new)
        return {"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)}

    async def update_weights_from_meta(self, args: dict, tensors: dict) -> dict:
        version = str(args["weight_version"])
        await afault_point("weights_update.update", peer="metaserver-0")
        client = Client(args["metaserver_url"], self.token, peer="metaserver-0", retries=self.policy.retry_idempotent)
        try:
            weights = await pull_weights(client, version, float(args.get("wait_s", 60)), float(args.get("timeout_s", 600)))
        finally:
            await client.close()
        fresh_allocation(self.run_dir, self.device, sum(t.numel() * t.element_size() for t in weights.values()),
                         "the new weights")
        loop = asyncio.get_running_loop()
        with tracing.span("weights.load", source="metaserver", weight_version=version):
            await loop.run_in_executor(self.service.executor, self.engine.update_weights_from_tensors, weights, version)
        return {"success": True, "weight_version": version, "tensors": len(weights)}

    def release_memory(self, args: dict, tensors: dict) -> dict:
        """sglang's release, by `tags` (default: all): "weights" move to pinned host memory on a GPU;
        "kv_cache" gives the device lease to the colocated train rank (the KV cache is per call here, so no
        memory stays); "cuda_graph" (graphs are captured per call) holds nothing between calls."""
        tags = memory_tags(args)
        reply: dict[str, Any] = {"success": True, "tags": sorted(tags)}
        engine = self.engine
        if "weights" in tags and engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cuda":
            with engine.lock:
                engine.drop_caches()  # the fused copies and rotary tables hold device memory too
                reply.update(relocate([engine.model], None, torch.device("cpu"), engine.device))
        if self.lease is not None and "kv_cache" in tags:
            self.lease.release()
        leak = read_leak(self.run_dir, self.device) if self.run_dir else None
        mine = bool(leak) and leak.get("pid") == os.getpid()  # type: ignore[union-attr]
        # what this process still holds after the release, on the request's span (evidence; no behaviour)
        held = float(leak["leaked_mb"]) if mine else float(reply.get("device_mb_after", 0.0))  # type: ignore[index]
        tracing.trace.get_current_span().set_attribute("rlhf.device_mb_held", held)
        if mine and self.policy.verify_release:
            # check that a release really freed the device, here, instead of at the peer's next allocation
            raise DeviceMemoryNotReleased(f"rollout-{self.rank} still holds {leak['leaked_mb']:g} MB of {self.device} "
                                          "after releasing it; its colocated train rank cannot allocate")
        return reply

    def resume_memory(self, args: dict, tensors: dict) -> dict:
        tags = memory_tags(args)
        reply: dict[str, Any] = {"success": True, "tags": sorted(tags)}
        if self.lease is not None and "kv_cache" in tags:
            self.lease.acquire(float(args.get("timeout_s", self.lease_timeout_s)))
            fresh_allocation(self.run_dir, self.device, 1 << 30, "the KV cache")
        engine = self.engine
        if "weights" in tags and engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cpu":
            with engine.lock:
                reply.update(relocate([engine.model], None, engine.device, engine.device))
        return reply

    def events(self, args: dict, tensors: dict) -> dict:
        event = args.get("event")
        fault_point("events.handle", peer=str(event), device=self.device)
        reply: dict[str, Any] = {}
        if event == "rollout_start":
            reply = self.resume_memory(args, tensors)
        elif event == "rollout_end":
            reply = self.release_memory(args, tensors)
        elif event not in ("train_start", "train_end"):
            raise ValueError(f"unknown event {event!r}; valid: rollout_start, rollout_end, train_start, train_end")
        memory = {k: v for k, v in reply.items() if k.startswith("device_mb")}  # what the event freed or took
        return {**memory, "event": event, "ack": True, "step": args.get("step")}

    def health_generate(self, args: dict, tensors: dict) -> dict:
        if self.lease is not None and not self.lease.held:
            return {"ok": True, "skipped": "device lease held by the train side"}
        self.engine.generate([[self.engine.eos_token_id or 1]], {"max_new_tokens": 1})
        return {"ok": True}

    def model_info(self, args: dict, tensors: dict) -> dict:
        """sglang's /model_info (GetModelInfoResponse's fields, plus model_type and architectures as sglang adds)."""
        cfg = self.engine.model.config
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False, "model_type": cfg.model_type,
                "architectures": getattr(cfg, "architectures", None)}

    def server_info(self, args: dict, tensors: dict) -> dict:
        """sglang's /server_info (GetServerInfoResponse's fields); `version` names this server and the sglang API
        version it follows."""
        cfg = self.engine.model.config
        with self._state:
            running, queued = len(self.active), len(self.queued)
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
                "max_context_length": int(getattr(cfg, "max_position_embeddings", 0) or 0),
                "max_total_num_tokens": None, "version": f"rlhf-native (sglang API {SGLANG_VERSION})",
                "internal_states": [{"running_calls": running, "queued_calls": queued, "shed_calls": self.shed,
                                     "max_queued_requests": self.max_queued,
                                     "paused": not self.unpaused.is_set(), "weight_version": self.engine.weight_version}],
                "host": self.host, "port": self.port, "incremental_streaming_output": False,
                "disaggregation_mode": "null", "startup_time": self.started, "frontend": "rlhf",
                "device": str(self.engine.device), "dtype": str(next(self.engine.model.parameters()).dtype)}


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang's release/resume tags


def memory_tags(args: dict) -> set[str]:
    tags = args.get("tags")
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS)) if isinstance(tags, list) else [tags]
    if unknown:
        raise BadRequest(f"tags {unknown} unknown; valid: {list(MEMORY_TAGS)} (or none: all of them)")
    return set(tags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="resolved run config YAML")
    parser.add_argument("--ready-file", required=True, help="written with the URL once listening")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--colocate", action="store_true", help="generate only while holding device <rank>'s lease")
    parser.add_argument("--device", default="", help="torch device of this server (default: from model.device)")
    args = parser.parse_args(argv)
    set_pdeathsig()
    token = os.environ.get("RLHF_TOKEN")
    if not token:
        parser.error("RLHF_TOKEN is not set (the run token is passed in the environment)")
    setup_logging(args.run_dir, "rollout", args.rank, console=False)
    exits.record_start(args.run_dir, f"rollout-{args.rank}")  # its end: the scheduler records its exit status
    own_threads(1)  # the engine computes on its service's thread with RLHF_ROLLOUT_THREADS; the rest stays serial
    cfg = build_config(config_file=args.config)
    start_process_telemetry(args.run_dir, "rollout", args.rank, cfg.tracing)
    if cfg.faults:
        faults.arm(args.run_dir, cfg.faults)
    model, tok = build_model_and_tokenizer(cfg.model, seed=cfg.seed, device=args.device or None)
    log.info("rollout server %d: %s on %s", args.rank, cfg.model.dtype, next(model.parameters()).device)
    seed = (cfg.rollout.seed if cfg.rollout.seed >= 0 else cfg.seed + 17) + 1000 * args.rank
    engine = RolloutEngine(model, tok, seed=seed)
    lease = DeviceLease(args.run_dir, args.rank, f"rollout-{args.rank}") if args.colocate else None
    server = RolloutServer(engine, args.rank, token, cfg.resilience, lease, cfg.runtime.lease_timeout_s,
                           args.run_dir, cfg.weights.verify_checksum, max_queued=cfg.rollout.max_queued_requests,
                           threads=int(os.environ.get("RLHF_ROLLOUT_THREADS", "1")))

    server.host = args.host

    def ready(port: int) -> None:
        server.port = port
        url = f"http://{args.host}:{port}"
        write_atomic(args.ready_file, url)
        log.info("rollout server %d listening on %s (pid %d, colocate=%s)", args.rank, url, os.getpid(), args.colocate)

    return serve(server, args.host, args.port, ready, cfg.resilience.graceful_drain, cfg.runtime.drain_timeout_s,
                 stop_process_telemetry)


def serve(server: RolloutServer, host: str, port: int, ready: Callable[[int], None], drain: bool,
          drain_timeout_s: float, on_exit: Callable[[], None]) -> int:
    """A rollout server process's main loop; returns its exit code.

    drain (the policy's graceful_drain): SIGTERM starts `server.drain`, which ends the loop once the calls it had
    are answered (exit 0) or after drain_timeout_s (exit 1); a second SIGTERM exits at once. Off: SIGTERM exits at
    once (128 + SIGTERM; replies are lost). An exit other than 0 does not wait for a call still on the engine thread.
    SIGTERM goes through the loop's signal handler (a wakeup fd), so an idle loop blocked in select() wakes for it
    even when the kernel hands the signal to another thread (an engine or OpenMP thread).
    """
    async def main() -> None:
        stop, loop = asyncio.Event(), asyncio.get_running_loop()

        def on_term() -> None:
            if not drain or server.draining:
                raise SystemExit(128 + signal.SIGTERM)
            loop.create_task(server.drain(stop, drain_timeout_s))

        loop.add_signal_handler(signal.SIGTERM, on_term)
        await serve_forever(server.service, host, port, ready, stop)

    code = 0
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        on_exit()
    if server.drain_left and not code:
        code = 1
    if code:  # as the default disposition would: a call still on the engine thread is not waited for
        logging.shutdown()
        os._exit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
