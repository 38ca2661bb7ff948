"""ColocationEvents: rollout_start / rollout_end to train rank r and rollout server r (colocated runs only).

With the policy's acked_events every event must be acknowledged: a lost one is retried (the
handlers are idempotent) and then fails the step, naming the peer. Without it (the seeds'
system) events are fire and forget: an undelivered one is a WARNING and the step goes on, so the
pair may disagree about who owns the device. Fault point: events.notify (controller side).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type, stop_after_attempt

from rlhf.config import Policy
from rlhf.control.fleet import RolloutServices
from rlhf.control.workers import WorkerGroup
from rlhf.errors import RpcConnectionError, RpcTimeout
from rlhf.transport.client import Client, LoopThread

log = logging.getLogger("rlhf.controller")

EVENT_ATTEMPTS = 3  # acked_events: deliveries of one colocation event before the step fails
LOST = (RpcTimeout, RpcConnectionError)  # an event that may not have arrived (any other error is the peer's reply)


class EventNotDelivered(RuntimeError):
    """acked_events: a colocation event was not acknowledged by its peer."""


SGLANG_EVENT_ROUTES = {"rollout_start": "/resume_memory_occupation", "rollout_end": "/release_memory_occupation"}


class ColocationEvents:
    columns = ("train_offload_mb", "rollout_release_mb")  # what each step's events freed (steps.csv)
    def __init__(self, colocate: bool, timeout_s: float, backend: str, policy: Policy, loop: LoopThread,
                 workers: WorkerGroup, services: RolloutServices) -> None:
        """colocate: runtime.colocate; timeout_s: timeouts.event_s; backend: rollout.backend; policy: resilience."""
        self.colocate, self.timeout_s, self.backend, self.policy = colocate, timeout_s, backend, policy
        self.loop, self.workers, self.services = loop, workers, services

    def notify(self, event: str, step: int) -> list[tuple[str, Any]]:
        """(peer, reply) for every colocated peer; [] when not colocated."""
        if not self.colocate:
            return []
        timeout, acked, sglang = self.timeout_s, self.policy.acked_events, self.backend == "sglang"
        body = {"event": event, "step": step}

        def to_rollout(client: Client) -> Callable[[], Awaitable[Any]]:
            async def send() -> Any:
                if sglang:  # sglang has no /events: rollout_start/_end are its resume/release routes
                    path = SGLANG_EVENT_ROUTES.get(event)
                    if path is not None:
                        await client.call(path, {}, timeout_s=timeout, stage="events", step=step,
                                          points=("events.notify",))
                    return {"event": event, "ack": True, "step": step, "route": path}, {}
                return await client.call("/events", body, timeout_s=timeout, stage="events", step=step,
                                         points=("events.notify",))
            return send

        def to_train(rank: int) -> Callable[[], Awaitable[Any]]:
            async def send() -> Any:
                (answer,) = await self.workers.acall("events", body, timeout_s=timeout, stage="events", step=step,
                                                    ranks=[rank], points=("events.notify",))
                return answer
            return send

        async def one(peer: str, send: Callable[[], Awaitable[Any]]) -> Any:
            if not acked:
                try:
                    return await send()
                except LOST as exc:
                    log.warning("step %d: event %s to %s not delivered (%s: %s); continuing (events are not "
                                "acknowledged)", step, event, peer, type(exc).__name__, exc)
                    return None

            def retrying(state: RetryCallState) -> None:
                exc = state.outcome.exception() if state.outcome else None
                log.warning("step %d: event %s to %s: attempt %d failed (%s: %s); retrying", step, event, peer,
                            state.attempt_number, type(exc).__name__, exc)

            try:  # the handlers are idempotent: a repeated event is harmless
                return await AsyncRetrying(stop=stop_after_attempt(EVENT_ATTEMPTS), retry=retry_if_exception_type(LOST),
                                           before_sleep=retrying)(send)
            except RetryError as err:
                exc = err.last_attempt.exception()
                raise EventNotDelivered(f"{event} to {peer} at step {step}: not acknowledged after "
                                        f"{EVENT_ATTEMPTS} attempts of {timeout:g} s ({exc})") from exc

        pairs = min(len(self.workers), len(self.services.rollout))
        targets = [t for r in range(pairs) for t in ((self.workers.peer(r), to_train(r)),
                                                     (self.services.rollout[r].peer, to_rollout(self.services.rollout[r])))]

        async def deliver_all() -> list[Any]:
            return list(await asyncio.gather(*[one(peer, send) for peer, send in targets]))

        return [(peer, reply) for (peer, _), reply in zip(targets, self.loop.run(deliver_all()))]


def freed_mb(replies: list[tuple[str, Any]], role: str) -> float | str:
    """Device memory (MB) the event freed on the `role` side, summed over pairs ('' on CPU)."""
    freed = [r[0]["device_mb_before"] - r[0]["device_mb_after"] for peer, r in replies
             if peer.startswith(role) and r and isinstance(r[0], dict) and "device_mb_before" in r[0]]
    return round(sum(freed), 1) if freed else ""
