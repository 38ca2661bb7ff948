"""Surviving a rollout server's loss (the policy's restart_rollout): the servers found dead before a step start again,
and a stage that lost one in its middle runs once more after they did. The environment server (env-0) is part of
the rollout too: found dead before a step, or lost in the middle of the step's episodes, it starts again and the
step's episodes run again from their reset (an episode's state died with it).

    survival = RolloutSurvival(policy, services)
    row["rollout_restarts"] = survival.revive_dead(step)            # before the step
    survival.survive(step, row, "the rollout", generate, resync=update_weights)

`resync`: what the revived servers need before `call` runs again (this step's weights, before a rollout); None when
`call` is itself what they need (the weights update).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from rlhf.config.resilience import Policy
from rlhf.control.async_rollout import PRODUCER
from rlhf.control.fleet import RolloutServices
from rlhf.errors import HTTPStatusError, RpcConnectionError, RpcTimeout

log = logging.getLogger("rlhf.controller")

SERVICES = ("env-0", "reward-0")  # the jobs beside the rollout servers that restart_rollout starts again


class RolloutSurvival:
    columns = ("rollout_restarts", "rollout_migrated")  # what a step survived (steps.csv)

    def __init__(self, policy: Policy, services: RolloutServices) -> None:
        self.policy, self.services = policy, services

    def revive_dead(self, step: int) -> int | None:
        """restart_rollout: the rollout servers (and env-0, reward-0) found dead before the step start again (the
        servers get this step's weights in its weights update); how many, or None with restart_rollout off (steps.csv
        leaves the column empty)."""
        if not self.policy.restart_rollout:
            return None
        return len(self.services.revive(step)) + sum(self._revive_service(step, n) for n in SERVICES)

    def _revive_service(self, step: int, name: str, why: str = "") -> int:
        """env-0 or reward-0 started again when its job has ended or it does not answer GET /health within 2 s (or
        `why` says it was lost); 1 when it was, else 0."""
        services = self.services
        if services.service(name) is None or services.scheduler is None:
            return 0
        with services.revive_lock:
            why = why or self._service_down(step, name)
            if not why:
                return 0
            log.warning("step %d: %s is down (%s); starting it again (resilience.restart_rollout); %s", step, name, why,
                        "the step's episodes start from their reset" if name == "env-0" else "the batch is scored again")
            try:
                services.restart_service(name)
            except (RpcConnectionError, RpcTimeout):
                if not self._scheduler_lost(step):
                    raise
        return 1

    def _scheduler_lost(self, step: int) -> bool:
        """The scheduler did not answer: when it has ended (and what it owned with it), the train side starts it
        again with every job it owned (RolloutServices._restart_scheduler); True then. False on async's producer,
        which leaves that to the step that takes its batch (the new servers need the step's weights), or when the
        scheduler is alive (the caller's error stands)."""
        if threading.current_thread().name.startswith(PRODUCER) or not self.services._scheduler_ended():
            return False
        self.services.revive(step)
        return True

    def _service_down(self, step: int, name: str) -> str:
        services = self.services
        try:
            jobs = services.scheduler.jobs()
        except (RpcConnectionError, RpcTimeout):
            if not self._scheduler_lost(step):  # the service died with its scheduler
                raise
            return ""  # started again with the new scheduler
        state = {j["name"]: j["state"] for j in jobs}.get(name, "gone")
        if state != "running":
            return f"its job is {state}"
        try:
            services.loop.run(services.service(name).call("/health", method="GET", timeout_s=2.0, traced=False))
        except (RpcConnectionError, RpcTimeout, HTTPStatusError) as exc:
            services.loop.run(services.scheduler.stop_job(name, services.cfg.timeouts.cleanup_s, step))
            return f"it does not answer /health ({type(exc).__name__})"
        return ""

    def survive(self, step: int, row: dict[str, Any], during: str, call: Callable[[], Any],
                resync: Callable[[], Any] | None = None, services_only: bool = False,
                again: str = "generating the step's prompts again") -> Any:
        """call(); when a rollout server it needed went down meanwhile (RpcConnectionError naming it) and
        restart_rollout starts it again, `call` runs once more: after `resync` (the revived servers first get this
        step's weights), when no server was left to migrate the work to (their scheduler died, and they with it);
        `again` says in the WARNING what is done then. Any other failure, or with restart_rollout off, is raised."""
        starts, revivals = dict(self.services.starts), self.services.revivals
        try:
            return call()
        except RpcConnectionError as exc:
            if exc.peer in SERVICES and self.policy.restart_rollout:  # the episodes' environments died with env-0
                if not self._service_lost(step, row, exc.peer, starts, f"lost during {during}: {exc}"):
                    raise
                if resync is not None and self.services.revivals != revivals:  # their scheduler too: new servers
                    resync()
                return call()
            if services_only:
                raise
            then = again if resync else "updating again"
            if not self.revived(step, row, exc, during, then):
                raise
            if resync is not None:
                resync()
            return call()

    def survive_service(self, step: int, row: dict[str, Any], during: str, call: Callable[[], Any]) -> Any:
        """call(), needing env-0 or reward-0 (async's producer, the reward model's scores): the one lost in its middle
        starts again and `call` runs once more (episodes from their reset, the batch scored again). A rollout server's
        loss is not handled here: its samples migrate to the others; when none is left, the step that takes the batch
        starts them again (RolloutStage)."""
        return self.survive(step, row, during, call, services_only=True)

    def _service_lost(self, step: int, row: dict[str, Any], name: str, starts: dict[str, int], why: str) -> bool:
        """`name` failed a call made when it had been started as often as `starts` says: started again, unless
        another caller already did (the new one is the one to call again); False when it cannot be."""
        with self.services.revive_lock:
            if self.services.starts.get(name, 0) != starts.get(name, 0):
                return True
            restarted = self._revive_service(step, name, why)
        row["rollout_restarts"] = (row.get("rollout_restarts") or 0) + restarted
        return bool(restarted) or self.services.starts.get(name, 0) != starts.get(name, 0)

    def recover(self, step: int, row: dict[str, Any], exc: RpcConnectionError, during: str) -> bool:
        """restart_rollout after a loss the caller could not survive where it happened (async's producer: no rollout
        server left to migrate to, or their scheduler gone): every service found down starts again (a dead scheduler
        first, then what it owned); what is found up was started again since (the step's revive_dead). False: not a
        loss of a rollout server, env-0, reward-0 or a scheduler, or restart_rollout is off."""
        if not (self.policy.restart_rollout and (exc.peer.startswith("rollout-") or exc.peer in SERVICES
                                                 or exc.peer.startswith("scheduler"))):
            return False
        restarted = self.services.revive(step)
        restarted += [n for n in SERVICES if self._revive_service(step, n)]
        if restarted:
            log.warning("step %d: %s went down during %s (%s); started again", step, ", ".join(restarted), during, exc)
        else:  # the step's own check found it down first (revive_dead): what failed is up again
            log.warning("step %d: %s was lost during %s (%s) and has been started again since", step, exc.peer,
                        during, exc)
        row["rollout_restarts"] = (row.get("rollout_restarts") or 0) + len(restarted)
        return True

    def revived(self, step: int, row: dict[str, Any], exc: RpcConnectionError, during: str, then: str) -> bool:
        """restart_rollout for a rollout server lost in the middle of a stage: start the dead ones again. False: not
        a rollout server's loss, or none was down."""
        if not (self.policy.restart_rollout and exc.peer.startswith("rollout-")):
            return False
        restarted = self.services.revive(step)
        if not restarted:
            return False
        log.warning("step %d: %s went down during %s (%s); started again, %s", step, ", ".join(restarted), during,
                    exc, then)
        row["rollout_restarts"] = (row.get("rollout_restarts") or 0) + len(restarted)
        return True
