"""HTTP services and clients (aiohttp): token auth, typed errors, tensors without pickle.

Server side: `Service(role, rank, token, policy)` collects routes whose handlers are plain
functions `handler(args: dict, tensors: dict) -> result | (result, tensors)`; services that speak
raw aiohttp (the MetaServer, the scheduler) add their routes with `raw_route` and get the same
auth, spans, fault effects and error replies. Plain handlers
run one at a time on one worker thread (torch work and collectives stay off the event loop and
in order); `async def` handlers run on the event loop (for waits that must not block others); a
handler may return an aiohttp response of its own (a status, plain text, a stream). Every request
must carry the run token, in `X-RLHF-Token` or as `Authorization: Bearer <token>` (sglang's
`--api-key` scheme), or gets 401; a service may leave probes open (`open_paths`: the rollout
server's /health, /health_generate and /ready, as sglang does). An error in a handler is logged
with its step and becomes a typed JSON reply {"error": ErrorInfo} with status 500 (400 for a
BadRequest: input the service cannot serve, as sglang answers it) — or, with the policy's
typed_errors off, aiohttp's bare "500 Internal Server Error" text, as in the seeds' system. Faults that act on a request or reply reach this layer only as
TransportEffects (`replace_reply`, `reply_tensors`): it knows no fault name.

The client side (`Client`, `LoopThread`) is in client.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hmac
import logging
import math
import os
import threading
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from rlhf import clock, tracing
from rlhf.config.resilience import HARDENED, Policy
from rlhf.errors import ErrorInfo
from rlhf.faults import afault_effects
from rlhf.procs import freeze_gc, own_threads
from rlhf.tracing.metrics import ACTIVITY
from rlhf.transport import wire
from rlhf.transport.worker import WorkerThread

TOKEN_HEADER = "X-RLHF-Token"
STAGE_HEADER = "X-RLHF-Stage"
STEP_HEADER = "X-RLHF-Step"
# the address every service of this process tree binds and advertises: loopback unless RLHF_HOST names this host's
# address on a network the other hosts of a multi-node run reach (children inherit it)
DEFAULT_HOST = os.environ.get("RLHF_HOST", "127.0.0.1")
BARE_500 = "500 Internal Server Error\n\nServer got itself in trouble"

log = logging.getLogger("rlhf.http")

Handler = Callable[[dict, dict], Any]


_EFFECTS: contextvars.ContextVar[list] = contextvars.ContextVar("rlhf_transport_effects", default=[])


async def _stamp_clock(request: web.Request, response: web.StreamResponse) -> None:
    """Every reply carries this process's wall time and pid: the caller measures how far its clock is off (rlhf.clock)."""
    response.headers[clock.HEADER] = clock.stamp()


class Service:
    """An aiohttp application with auth, typed errors and handlers run on one worker thread."""

    def __init__(self, role: str, rank: int, token: str, policy: Policy = HARDENED, threads: int = 1,
                 parkable: bool = False) -> None:
        """threads: torch's intra-op threads on the worker thread: a process's one computing service gets the
        process's threads, every other thread stays serial (rlhf.procs.own_threads). The worker thread starts here;
        with threads > 1 the constructing thread (a process's main thread) is set serial again afterwards, which
        also makes threads started later start serial. parkable: a handler may park the worker thread and have it
        run the other handlers' calls meanwhile (rlhf.transport.worker: the rollout server's pause in place)."""
        self.role, self.rank, self.token, self.policy = role, rank, token, policy
        self.executor: concurrent.futures.Executor = (
            WorkerThread(f"{role}-{rank}", own_threads, (threads,)) if parkable else
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-{rank}",
                                                  initializer=own_threads, initargs=(threads,)))
        self.executor.submit(int).result()
        if threads != 1:
            own_threads(1)
        self.app = web.Application(middlewares=[self._trace, self._auth], client_max_size=1 << 34)
        self.app.on_response_prepare.append(_stamp_clock)
        self.stage, self.step = "", -1
        self.untraced_paths: set[str] = set()
        # routes that wait on other processes by design (a long poll): never this process's activity in its
        # heartbeat, which other services of the process (a train worker beside the MetaServer) write too
        self.waits: set[str] = set()
        self.open_paths: tuple[str, ...] = ()  # path prefixes served without the token (health probes)
        self.inflight = 0  # handlers running now on the worker thread
        self.running: tuple[str, int, float] | None = None  # (request, step, since) on the worker thread (heartbeat)
        self._inflight_lock = threading.Lock()

    @web.middleware
    async def _trace(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """A server span per request, child of the caller's span (W3C traceparent), in this service's role."""

        stage = request.headers.get(STAGE_HEADER, "")
        step = _int(request.headers.get(STEP_HEADER, "-1"))
        if request.path in self.untraced_paths:  # no span; the step still holds for fault points
            with tracing.use_role(self.role, self.rank, step), tracing.at_stage(stage):
                return await handler(request)
        route = request.match_info.route.resource
        name = f"{request.method} {route.canonical if route is not None else request.path}"
        beat = name not in self.waits
        if beat:
            ACTIVITY.set(name, step)
        with tracing.use_role(self.role, self.rank, step), tracing.at_stage(stage):
            token = tracing.otel_context.attach(tracing.extract_context(request.headers))
            try:
                with tracing.span(name, stage=stage or None, step=step, kind=tracing.SpanKind.SERVER,
                                  role=self.role, rank=self.rank, **{"http.request.method": request.method,
                                                                     "url.path": request.path}) as sp:
                    response = await handler(request)
                    sp.set_attribute("http.response.status_code", response.status)
                    if response.status >= 400 and response.status != 500:
                        sp.set_status(tracing.Status(tracing.StatusCode.ERROR, f"HTTP {response.status}"))
                    return response
            finally:
                tracing.otel_context.detach(token)
                tracing.flush_soon()  # the request's span is exported now: a SIGKILL later cannot lose it
                running = self.running  # an inline request (health) ends while a handler still runs: that shows
                if beat and running is not None and running[0] != name:
                    ACTIVITY.name, ACTIVITY.step, ACTIVITY.since = running
                elif beat:
                    ACTIVITY.set("idle", step)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not request.path.startswith(self.open_paths or ("\0",)) and not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        stage, step = request.headers.get(STAGE_HEADER, ""), _int(request.headers.get(STEP_HEADER, "-1"))
        try:  # faults that act on this request or its reply come back as effects; this layer knows no fault name
            effects = await afault_effects("rpc.server.handle", peer=request.path, stage=stage)
        except Exception as exc:  # an injected error looks like the handler's own
            return self._error_reply(exc, request.method, request.path, stage, step)
        for effect in effects:
            reply = await effect.replace_reply(request)
            if reply is not None:
                return reply
        token = _EFFECTS.set(effects)  # a keep-alive connection serves its next request in this task: reset after
        try:
            return await handler(request)
        except web.HTTPException:
            raise  # a deliberate reply (404 naming what is missing), not a failure
        except Exception as exc:  # a raw route's own error: logged here and answered typed, like every handler's
            return self._error_reply(exc, request.method, request.path, stage, step)
        finally:
            _EFFECTS.reset(token)

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get(TOKEN_HEADER)
        if given is None:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer":
                return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _log_error(self, exc: BaseException, method: str, path: str, stage: str, step: int) -> ErrorInfo:
        """Log and trace a handler's exception once, where it happened."""
        info = ErrorInfo.from_exception(exc, self.role, self.rank, stage, step)
        if not getattr(exc, "_rlhf_logged", False):
            tracing.record_error(tracing.trace.get_current_span(), exc, info)
            log.error("%s-%d: %s %s failed%s: %s: %s", self.role, self.rank, method, path,
                      f" at step {step}" if step >= 0 else "", info.error_class, info.message)
            try:
                exc._rlhf_logged = True  # type: ignore[attr-defined]
            except AttributeError:  # an exception type with __slots__: logging twice is the lesser harm
                pass
        return info

    def _error_reply(self, exc: BaseException, method: str, path: str, stage: str, step: int) -> web.Response:
        status = int(getattr(exc, "http_status", 500))
        if status < 500 or getattr(exc, "expected", False):  # the caller's input, or load: a warning, no traceback
            info = ErrorInfo(type(exc).__name__, str(exc), self.role, self.rank, stage=stage, step=step)
            log.warning("%s-%d: %s %s refused (%d): %s", self.role, self.rank, method, path, status, exc)
            retry_after = getattr(exc, "retry_after_s", None)
            headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
            return web.json_response({"error": {**info.to_dict(), "code": status}}, status=status, headers=headers)
        info = self._log_error(exc, method, path, stage, step)
        if status == 500 and not self.policy.typed_errors:
            return web.Response(status=500, text=BARE_500)
        return web.json_response({"error": {**info.to_dict(), "code": status}}, status=status)

    def raw_route(self, method: str, path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        """An aiohttp handler behind the same middleware: an exception in it is logged and answered typed."""
        self.app.router.add_route(method, path, handler)

    def route(self, path: str, fn: Handler, method: str | tuple[str, ...] = "POST", inline: bool = False) -> None:
        """Expose fn at path (one method or several). Coroutine fns and inline=True run on the event loop
        (never block there)."""
        if not isinstance(method, str):
            for m in method:
                self.route(path, fn, m, inline)
            return

        async def handle(request: web.Request) -> web.StreamResponse:
            stage = request.headers.get(STAGE_HEADER, "")
            step = int(request.headers.get(STEP_HEADER, "-1"))
            body = await request.read()
            try:
                args, tensors = wire.decode(body, request.content_type)
                if request.method == "GET" and request.query:  # GET /ready?weight_version=3: the query is the args
                    args = {**request.query, **(args or {})}
                if asyncio.iscoroutinefunction(fn):
                    result = await fn(args or {}, tensors)
                elif inline:
                    result = fn(args or {}, tensors)
                else:
                    def call() -> Any:
                        with self._inflight_lock:  # counted on the worker thread: a cancelled request still runs
                            self.inflight += 1
                        self.running = (f"{method} {path}", step, time.time())
                        try:
                            return fn(args or {}, tensors)
                        except Exception as exc:
                            # logged here, on the worker thread, the moment it happens: a process that exits
                            # before the reply goes out (a rank stopped by torchrun) still leaves the line
                            self._log_error(exc, method, path, stage, step)
                            raise
                        finally:
                            self.running = None
                            with self._inflight_lock:
                                self.inflight -= 1

                    ctx = contextvars.copy_context()  # the server span and role follow the work onto the thread
                    result = await asyncio.get_running_loop().run_in_executor(self.executor, ctx.run, call)
            except Exception as exc:  # every handler error becomes a reply; nothing is swallowed
                return self._error_reply(exc, method, path, stage, step)
            if isinstance(result, web.StreamResponse):  # the handler's own reply (a status, plain text)
                return result
            out_tensors = None
            if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
                result, out_tensors = result
            sums = None
            effects = _EFFECTS.get()
            if out_tensors:  # what left the handler; the caller's span records what arrived (evidence of corruption)
                tracing.trace.get_current_span().set_attribute("rlhf.reply_shapes", wire.shapes(out_tensors))
            if out_tensors and effects:  # faults in transit act after the sender's checksums were taken
                sums = wire.digests(out_tensors) if self.policy.stage_checksums else None
                for effect in effects:
                    out_tensors = effect.reply_tensors(out_tensors)
            data, content_type = wire.encode(result, out_tensors, sums, checksums=self.policy.stage_checksums)
            return web.Response(body=data, content_type=content_type.split(";")[0])

        self.app.router.add_route(method, path, handle)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


class ServiceThread:
    """Run a Service's app on a background thread's event loop (train workers, MetaServer)."""

    def __init__(self, service: Service, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.service, self.host, self.port = service, host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"http-{service.role}", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> int:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> int:
        self._runner, self.port = await listen(self.service, self.host, self.port)
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self, coro: Any, timeout_s: float) -> Any:
        """Run a coroutine on the server's loop (where its handlers' state lives) and wait for its result."""
        return self.submit(coro).result(timeout=timeout_s)

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Start a coroutine on the server's loop; its future (asyncio.wrap_future awaits it from another loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close the server; requests still running get timeout_s to finish (a rank that is exiting with a
        handler stuck in a collective or a long SFT passes a short one: nothing would come of waiting)."""
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning("%s-%d: %d request(s) still running after %g s; closing anyway", self.service.role,
                            self.service.rank, self.service.inflight, timeout_s)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.service.executor.shutdown(wait=False, cancel_futures=True)


async def listen(service: Service, host: str, port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve a Service's app on host:port (0: any free port) on the running loop: its runner and the port bound."""
    runner = web.AppRunner(service.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def run_process_loop(main: Callable[[], Awaitable[None]], on_exit: Callable[[], None]) -> int:
    """asyncio.run(main()) as a service process's main loop (rollout server, reward server); returns its exit code:
    a SystemExit's (128 + SIGTERM from a signal handler), 0 after Ctrl-C or a normal end. on_exit runs whatever
    happened."""
    code = 0
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        on_exit()
    return code


def exit_now(code: int) -> None:
    """End the process with `code` as the default disposition of a signal would: the logs flushed, a call still on a
    worker thread not waited for."""
    logging.shutdown()
    os._exit(code)


async def serve_forever(service: Service, host: str, port: int, on_ready: Callable[[int], None],
                        stop: asyncio.Event | None = None) -> None:
    """Run a Service as the main loop of a process (rollout server, scheduler) until cancelled, or until `stop`
    is set (a drained rollout server)."""
    runner, bound = await listen(service, host, port)
    freeze_gc()  # the process is up: what it holds now is never garbage
    on_ready(bound)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
