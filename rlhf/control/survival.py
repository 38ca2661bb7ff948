"""Surviving a rollout server's loss (the policy's restart_rollout): the servers found dead before a step start again,
and a stage that lost one in its middle runs once more after they did.

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
from rlhf.errors import RpcConnectionError

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
        return len(self.services.revive(step))

    def survive(self, step: int, row: dict[str, Any], during: str, call: Callable[[], Any],
                resync: Callable[[], Any] | None = None) -> Any:
        """call(); when a rollout server it needed went down meanwhile (RpcConnectionError naming it) and
        restart_rollout starts it again, `call` runs once more: after `resync` (the revived servers first get this
        step's weights), when no server was left to migrate the work to (their scheduler died, and they with it).
        Any other failure, or with restart_rollout off, is raised."""
        try:
            return call()
        except RpcConnectionError as exc:
            then = "generating the step's prompts again" if resync else "updating again"
            if not self._revived(step, row, exc, during, then):
                raise
            if resync is not None:
                resync()
            return call()

    def _revived(self, step: int, row: dict[str, Any], exc: RpcConnectionError, during: str, then: str) -> bool:
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
