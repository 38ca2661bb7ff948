"""Client side of the HTTP layer: `Client(base_url, token)` with async `call()`, and `LoopThread`,
which runs coroutines from synchronous code, so a controller fans out with `loop.run(asyncio.gather(...))`.

Errors come back typed: RemoteError (the server's ErrorInfo), HTTPStatusError (a non-2xx reply
without one), RpcTimeout, RpcConnectionError (reset, refused, cut mid-body) — each naming the peer.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from typing import Any, Awaitable

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

from rlhf import clock, tracing
from rlhf.errors import ErrorInfo, HTTPStatusError, Overloaded, RemoteError, RpcConnectionError, RpcTimeout
from rlhf.faults import afault_point
from rlhf.faults.points import idempotent
from rlhf.transport import wire
from rlhf.transport.http import STAGE_HEADER, STEP_HEADER, TOKEN_HEADER

log = logging.getLogger("rlhf.client")
ATTEMPTS = 3  # of an idempotent request, all within its one timeout


def transient(exc: BaseException) -> bool:
    """A failure in transit, which the same request may not meet again (not the handler's own error)."""
    if isinstance(exc, (RpcConnectionError, wire.CorruptPayload)):
        return True
    return isinstance(exc, HTTPStatusError) and exc.status in (502, 503, 504)


class Traffic:
    """What this process's clients sent and received, by route: requests, request bytes, reply bytes (the control
    plane's own cost at scale: benchmarks/scale.py and a simulated world's steps.csv read it)."""

    def __init__(self) -> None:
        self.by_path: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, path: str, sent: int, received: int) -> None:
        key = path if path.startswith("/fanout") else path.split("?", 1)[0]  # a host agent's call: by method
        with self._lock:
            row = self.by_path.setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] += sent
            row[2] += received

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        with self._lock:
            return {k: (v[0], v[1], v[2]) for k, v in self.by_path.items()}


TRAFFIC = Traffic()


class Client:
    """Calls one service. Timeouts are per call; errors come back typed (RemoteError) when they can."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 60.0, peer: str = "",
                 checksums: bool = False, retries: bool = False) -> None:
        """checksums: send per-tensor digests with request tensors (the policy's stage_checksums); retries: send
        an idempotent request again after a transient failure (the policy's retry_idempotent)."""
        self.base_url, self.token, self.timeout_s = base_url.rstrip("/"), token, timeout_s
        self.checksums, self.retries = checksums, retries
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
            return await self._attempts(path, args, tensors, timeout_s, stage, step, method, points, raw)
        with tracing.span(f"{method} {path.split('?', 1)[0]}", stage=stage or None, step=step,
                          kind=tracing.SpanKind.CLIENT, peer=self.peer, **{"server.address": self.base_url}):
            return await self._attempts(path, args, tensors, timeout_s, stage, step, method, points, raw)

    async def _attempts(self, path: str, args: Any, tensors: dict | None, timeout_s: float | None, stage: str,
                        step: int, method: str, points: tuple[str, ...], raw: bool) -> tuple[Any, dict]:
        """One request; with retries on, an idempotent one up to ATTEMPTS times after a transient failure, and any
        one again after a 503 with Retry-After (a service over its queue limit ran none of it), all inside its one
        timeout (nested timeouts stay nested: each attempt gets what is left)."""
        if not self.retries:
            return await self._call(path, args, tensors, timeout_s, stage, step, method, points, raw)
        safe = idempotent(method, path)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        backoff = wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05)

        def again(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            what = f"{type(exc).__name__}: {exc}"[:300]
            why = "; the service is over its queue limit" if isinstance(exc, Overloaded) else \
                f" of {ATTEMPTS}; idempotent"
            log.warning("retrying %s %s to %s (attempt %d%s) after %s", method, path, self.peer,
                        state.attempt_number + 1, why, what)
            tracing.trace.get_current_span().add_event("retry", {"rlhf.attempt": state.attempt_number + 1,
                                                                 "rlhf.error": what})

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            pause = exc.retry_after_s if isinstance(exc, Overloaded) else backoff(state)
            return max(0.0, min(pause, deadline - time.monotonic() - 0.05))

        def stop(state: RetryCallState) -> bool:
            exc = state.outcome.exception() if state.outcome else None
            return not isinstance(exc, Overloaded) and state.attempt_number >= ATTEMPTS

        def retryable(exc: BaseException) -> bool:
            return (isinstance(exc, Overloaded) or (safe and transient(exc))) and deadline - time.monotonic() > 0.05

        async for attempt in AsyncRetrying(stop=stop, wait=wait, retry=retry_if_exception(retryable),
                                           before_sleep=again, reraise=True):
            with attempt:
                return await self._call(path, args, tensors, max(0.05, deadline - time.monotonic()), stage, step,
                                        method, points, raw)
        raise AssertionError("unreachable: tenacity reraises the last failure")

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
        headers = {TOKEN_HEADER: self.token, "Authorization": f"Bearer {self.token}",  # ours, and sglang's --api-key
                   "Content-Type": content_type, STAGE_HEADER: stage, STEP_HEADER: str(step)}
        tracing.inject_headers(headers)
        session = await self.session()
        try:
            for point in points + ("rpc.client.send",):
                await afault_point(point, step=step if step >= 0 else None, peer=self.peer, path=path, stage=stage)
            sent = clock.now()
            async with session.request(
                method, url, data=body if method != "GET" else None, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if clock.watching() and clock.HEADER in resp.headers:
                    self._clock(resp.headers[clock.HEADER], sent, path, stage, step)
                payload = await resp.read()
                TRAFFIC.add(path, len(body) if method != "GET" else 0, len(payload))
                if resp.status == 200 and raw:
                    return payload, {}
                if resp.status == 200 and resp.content_type not in (wire.JSON_TYPE, wire.TENSORS_TYPE):
                    return (payload.decode(errors="replace") or None), {}  # sglang's plain-text and empty replies
                if resp.status == 200:
                    try:
                        reply = wire.decode(payload, resp.content_type)
                        if reply[1]:
                            tracing.trace.get_current_span().set_attribute("rlhf.reply_shapes", wire.shapes(reply[1]))
                        return reply
                    except wire.CorruptPayload as exc:  # name the sender: the data changed after it left there
                        raise wire.CorruptPayload(f"reply from {self.peer} to {path}: {exc}") from None
                if resp.status == 503 and "Retry-After" in resp.headers:  # shed, not failed: nothing of it ran
                    try:
                        after = float(resp.headers["Retry-After"])
                    except ValueError:
                        after = 1.0
                    raise Overloaded(f"over its queue limit, Retry-After {after:g} s: "
                                     f"{payload.decode(errors='replace')[:300]}", after, url, self.peer)
                if resp.content_type == wire.JSON_TYPE:
                    try:
                        err = wire.decode(payload, resp.content_type)[0]
                    except ValueError:
                        err = None
                    body = err.get("error") if isinstance(err, dict) else None
                    info = ErrorInfo.from_reply(body)
                    if info is not None:
                        raise RemoteError(info, url)
                    if isinstance(body, dict) and "message" in body:  # sglang's {"error": {"message": ...}}
                        raise HTTPStatusError(resp.status, str(body["message"]), url, self.peer)
                raise HTTPStatusError(resp.status, payload.decode(errors="replace"), url, self.peer)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:  # reset, refused, cut mid-body
            raise RpcConnectionError(url, exc, self.peer) from exc
        except OSError as exc:  # name resolution (socket.gaierror) and other socket errors
            if isinstance(exc, (RpcConnectionError, TimeoutError)):
                raise
            raise RpcConnectionError(url, exc, self.peer) from exc

    def _clock(self, stamped: str, sent: float, path: str, stage: str, step: int) -> None:
        """The peer's clock, read off its reply: named (a WARNING) the first time it is off beyond the tolerance."""
        off = clock.observe(stamped, sent, clock.now())
        if off is None:
            return
        offset, error, pid = off
        role, rank = tracing.whoami()
        where = ", ".join(x for x in (f"step {step}" if step >= 0 else "", f"stage {stage}" if stage else "") if x)
        log.warning("clock: %s (pid %d) is %.1f s %s %s-%d's clock (its reply to %s%s, +/- %.3f s): its log lines, "
                    "heartbeat rows and exit records are stamped as much off (rlhf diagnose reads them on this clock)",
                    self.peer, pid, abs(offset), "ahead of" if offset > 0 else "behind", role or "controller",
                    max(rank, 0), path, f" at {where}" if where else "", error)

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

    def run_as_caller(self, coro: Awaitable, timeout: float | None = None) -> Any:
        """run(coro) under the caller's context variables (its span, role and step: what asyncio.run(coro) keeps),
        on this loop and its open connections instead of a new loop's."""
        ctx = contextvars.copy_context()

        async def inside() -> Any:
            return await asyncio.get_running_loop().create_task(coro, context=ctx)  # type: ignore[arg-type]

        return self.run(inside(), timeout)

    def gather(self, *coros: Awaitable, return_exceptions: bool = False) -> list:
        """Run coroutines concurrently on the loop; the gather itself is made inside the loop."""

        async def _all() -> list:
            return list(await asyncio.gather(*coros, return_exceptions=return_exceptions))

        return self.run(_all())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
