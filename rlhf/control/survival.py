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
from typing import Any, Callable

from rlhf.config.resilience import Policy
from rlhf.control.fleet import RolloutServices
from rlhf.errors import HTTPStatusError, RpcConnectionError, RpcTimeout

log = logging.getLogger("rlhf.controller")


class RolloutSurvival:
    columns = ("rollout_restarts", "rollout_migrated")  # what a step survived (steps.csv)

    def __init__(self, policy: Policy, services: RolloutServices) -> None:
        self.policy, self.services = policy, services

    def revive_dead(self, step: int) -> int | None:
        """restart_rollout: the rollout servers found dead before the step start again (they get this step's weights
        in its weights update); how many, or None with restart_rollout off (steps.csv leaves the column empty)."""
        if not self.policy.restart_rollout:
            return None
        return len(self.services.revive(step)) + self._revive_env(step)

    def _revive_env(self, step: int, why: str = "") -> int:
        """env-0 started again when its job has ended or it does not answer GET /health within 2 s (or `why` says
        it was lost); 1 when it was, else 0."""
        services = self.services
        if services.env is None or services.scheduler is None:
            return 0
        why = why or self._env_down(step)
        if not why:
            return 0
        log.warning("step %d: env-0 is down (%s); starting it again (resilience.restart_rollout); the step's episodes "
                    "start from their reset", step, why)
        services.restart_env()
        return 1

    def _env_down(self, step: int) -> str:
        services = self.services
        state = {j["name"]: j["state"] for j in services.scheduler.jobs()}.get("env-0", "gone")
        if state != "running":
            return f"its job is {state}"
        try:
            services.loop.run(services.env.call("/health", method="GET", timeout_s=2.0, traced=False))
        except (RpcConnectionError, RpcTimeout, HTTPStatusError) as exc:
            services.loop.run(services.scheduler.stop_job("env-0", services.cfg.timeouts.cleanup_s, step))
            return f"it does not answer /health ({type(exc).__name__})"
        return ""

    def survive(self, step: int, row: dict[str, Any], during: str, call: Callable[[], Any],
                resync: Callable[[], Any] | None = None) -> Any:
        """call(); when a rollout server it needed went down meanwhile (RpcConnectionError naming it) and
        restart_rollout starts it again, `call` runs once more: after `resync` (the revived servers first get this
        step's weights), when no server was left to migrate the work to (their scheduler died, and they with it).
        Any other failure, or with restart_rollout off, is raised."""
        try:
            return call()
        except RpcConnectionError as exc:
            if exc.peer == "env-0" and self.policy.restart_rollout:  # the episodes' environments died with it
                restarted = self._revive_env(step, f"lost during {during}: {exc}")
                if not restarted:
                    raise
                row["rollout_restarts"] = (row.get("rollout_restarts") or 0) + restarted
                return call()
            then = "generating the step's prompts again" if resync else "updating again"
            if not self.revived(step, row, exc, during, then):
                raise
            if resync is not None:
                resync()
            return call()

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
