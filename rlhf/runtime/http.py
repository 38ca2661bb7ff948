"""HTTP services and clients (aiohttp): token auth, typed errors, tensors without pickle.

Server side: `Service(role, rank, token, policy)` collects routes whose handlers are plain
functions `handler(args: dict, tensors: dict) -> result | (result, tensors)`; services that speak
raw aiohttp (the MetaServer, the scheduler) add their routes with `raw_route` and get the same
auth, spans, fault effects and error replies. Plain handlers
run one at a time on one worker thread (torch work and collectives stay off the event loop and
in order); `async def` handlers run on the event loop (for waits that must not block others). Every request must carry the run token in `X-RLHF-Token` (401 otherwise). An error in a
handler is logged with its step and becomes a typed JSON reply {"error": ErrorInfo} with status
500 — or, with the policy's typed_errors off, aiohttp's bare "500 Internal Server Error" text, as
in the seeds' system. Faults that act on a request or reply reach this layer only as
TransportEffects (`replace_reply`, `reply_tensors`): it knows no fault name.

Client side: `Client(base_url, token)` with async `call()`; `LoopThread` runs coroutines from
synchronous code, so a controller fans out with `loop.run(asyncio.gather(...))`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from rlhf import tracing
from rlhf.faults import afault_effects, afault_point
from rlhf.runtime import wire
from rlhf.runtime.errors import ErrorInfo, HTTPStatusError, RemoteError, RpcConnectionError, RpcTimeout
from rlhf.runtime.resilience import HARDENED, Policy
from rlhf.tracing.metrics import ACTIVITY

TOKEN_HEADER = "X-RLHF-Token"
STAGE_HEADER = "X-RLHF-Stage"
STEP_HEADER = "X-RLHF-Step"
DEFAULT_HOST = "127.0.0.1"
BARE_500 = "500 Internal Server Error\n\nServer got itself in trouble"

log = logging.getLogger("rlhf.http")

Handler = Callable[[dict, dict], Any]


_EFFECTS: contextvars.ContextVar[list] = contextvars.ContextVar("rlhf_transport_effects", default=[])


class Service:
    """An aiohttp application with auth, typed errors and handlers run on one worker thread."""

    def __init__(self, role: str, rank: int, token: str, policy: Policy = HARDENED) -> None:
        self.role, self.rank, self.token, self.policy = role, rank, token, policy
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-{rank}")
        self.app = web.Application(middlewares=[self._trace, self._auth], client_max_size=1 << 34)
        self.stage, self.step = "", -1
        self.untraced_paths: set[str] = set()
        self.inflight = 0  # handlers running now on the worker thread
        self._inflight_lock = threading.Lock()

    @web.middleware
    async def _trace(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """A server span per request, child of the caller's span (W3C traceparent), in this service's role."""

        if request.path in self.untraced_paths:
            return await handler(request)
        stage = request.headers.get(STAGE_HEADER, "")
        step = _int(request.headers.get(STEP_HEADER, "-1"))
        route = request.match_info.route.resource
        name = f"{request.method} {route.canonical if route is not None else request.path}"
        ACTIVITY.set(name, step)
        with tracing.use_role(self.role, self.rank, step):
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
                ACTIVITY.set("idle", step)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.headers.get(TOKEN_HEADER) != self.token:
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

    def _error_reply(self, exc: BaseException, method: str, path: str, stage: str, step: int) -> web.Response:
        info = ErrorInfo.from_exception(exc, self.role, self.rank, stage, step)
        tracing.record_error(tracing.trace.get_current_span(), exc, info)
        log.error("%s-%d: %s %s failed%s: %s: %s", self.role, self.rank, method, path,
                  f" at step {step}" if step >= 0 else "", info.error_class, info.message)
        if not self.policy.typed_errors:
            return web.Response(status=500, text=BARE_500)
        return web.json_response({"error": info.to_dict()}, status=500)

    def raw_route(self, method: str, path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        """An aiohttp handler behind the same middleware: an exception in it is logged and answered typed."""
        self.app.router.add_route(method, path, handler)

    def route(self, path: str, fn: Handler, method: str = "POST", inline: bool = False) -> None:
        """Expose fn at path. Coroutine fns and inline=True run on the event loop (never block there)."""

        async def handle(request: web.Request) -> web.Response:
            stage = request.headers.get(STAGE_HEADER, "")
            step = int(request.headers.get(STEP_HEADER, "-1"))
            body = await request.read()
            try:
                args, tensors = wire.decode(body, request.content_type)
                if asyncio.iscoroutinefunction(fn):
                    result = await fn(args or {}, tensors)
                elif inline:
                    result = fn(args or {}, tensors)
                else:
                    def call() -> Any:
                        with self._inflight_lock:  # counted on the worker thread: a cancelled request still runs
                            self.inflight += 1
                        try:
                            return fn(args or {}, tensors)
                        finally:
                            with self._inflight_lock:
                                self.inflight -= 1

                    ctx = contextvars.copy_context()  # the server span and role follow the work onto the thread
                    result = await asyncio.get_running_loop().run_in_executor(self.executor, ctx.run, call)
            except Exception as exc:  # every handler error becomes a reply; nothing is swallowed
                return self._error_reply(exc, method, path, stage, step)
            out_tensors = None
            if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
                result, out_tensors = result
            sums = None
            effects = _EFFECTS.get()
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
        self._runner = web.AppRunner(self.service.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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


async def serve_forever(service: Service, host: str, port: int, on_ready: Callable[[int], None]) -> None:
    """Run a Service as the main loop of a process (rollout server, scheduler) until cancelled."""
    runner = web.AppRunner(service.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    on_ready(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class Client:
    """Calls one service. Timeouts are per call; errors come back typed (RemoteError) when they can."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 60.0, peer: str = "",
                 checksums: bool = False) -> None:
        """checksums: send per-tensor digests with request tensors (the policy's stage_checksums)."""
        self.base_url, self.token, self.timeout_s = base_url.rstrip("/"), token, timeout_s
        self.checksums = checksums
        self.peer = peer or self.base_url.split("//", 1)[-1]
        self._session: aiohttp.ClientSession | None = None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def call(
        self,
        path: str,
        args: Any = None,
        tensors: dict | None = None,
        timeout_s: float | None = None,
        stage: str = "",
        step: int = -1,
        method: str = "POST",
        traced: bool = True,
        points: tuple[str, ...] = (),
        raw: bool = False,
    ) -> tuple[Any, dict]:
        """One request within timeout_s. traced=False skips the client span (lease renewals would flood traces).

        `step` defaults to the step of the code running now (it travels on every hop, as the stage does).

        `points`: fault points of the caller's stage (events.notify, scheduler.stop_job) checked, like
        rpc.client.send, inside the timeout: a delay there counts against it, as on a real network path.

        `raw`: a 200 reply's body comes back as bytes, undecoded (weight shards: the caller verifies them).
        """
        if step < 0:
            step = tracing.current_step()
        if not traced:
            return await self._call(path, args, tensors, timeout_s, stage, step, method, points, raw)
        with tracing.span(f"{method} {path.split('?', 1)[0]}", stage=stage or None, step=step,
                          kind=tracing.SpanKind.CLIENT, peer=self.peer, **{"server.address": self.base_url}):
            return await self._call(path, args, tensors, timeout_s, stage, step, method, points, raw)

    async def _call(self, path: str, args: Any, tensors: dict | None, timeout_s: float | None, stage: str, step: int,
                    method: str, points: tuple[str, ...] = (), raw: bool = False) -> tuple[Any, dict]:
        url = self.base_url + path
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(self._request(url, path, args, tensors, timeout, stage, step, method, points,
                                                        raw), timeout)
        except asyncio.TimeoutError:
            raise RpcTimeout(url, timeout, self.peer) from None

    async def _request(self, url: str, path: str, args: Any, tensors: dict | None, timeout: float, stage: str,
                       step: int, method: str, points: tuple[str, ...], raw: bool = False) -> tuple[Any, dict]:
        body, content_type = wire.encode(args, tensors, checksums=self.checksums)
        headers = {TOKEN_HEADER: self.token, "Content-Type": content_type, STAGE_HEADER: stage, STEP_HEADER: str(step)}
        tracing.inject_headers(headers)
        session = await self.session()
        try:
            for point in points + ("rpc.client.send",):
                await afault_point(point, step=step if step >= 0 else None, peer=self.peer, path=path, stage=stage)
            async with session.request(
                method, url, data=body if method != "GET" else None, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                payload = await resp.read()
                if resp.status == 200 and raw:
                    return payload, {}
                if resp.status == 200:
                    try:
                        return wire.decode(payload, resp.content_type)
                    except wire.CorruptPayload as exc:  # name the sender: the data changed after it left there
                        raise wire.CorruptPayload(f"reply from {self.peer} to {path}: {exc}") from None
                if resp.content_type == wire.JSON_TYPE:
                    try:
                        err = wire.decode(payload, resp.content_type)[0]
                    except ValueError:
                        err = None
                    if isinstance(err, dict) and isinstance(err.get("error"), dict):
                        raise RemoteError(ErrorInfo(**err["error"]), url)
                raise HTTPStatusError(resp.status, payload.decode(errors="replace"), url, self.peer)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:  # reset, refused, cut mid-body
            raise RpcConnectionError(url, exc, self.peer) from exc
        except OSError as exc:  # name resolution (socket.gaierror) and other socket errors
            if isinstance(exc, (RpcConnectionError, TimeoutError)):
                raise
            raise RpcConnectionError(url, exc, self.peer) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class LoopThread:
    """An event loop on a daemon thread; `run(coro)` blocks the caller until the coroutine ends."""

    def __init__(self, name: str = "rpc-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def gather(self, *coros: Awaitable, return_exceptions: bool = False) -> list:
        """Run coroutines concurrently on the loop; the gather itself is made inside the loop."""

        async def _all() -> list:
            return list(await asyncio.gather(*coros, return_exceptions=return_exceptions))

        return self.run(_all())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
