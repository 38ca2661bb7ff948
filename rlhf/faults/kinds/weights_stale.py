"""weights_stale: a rollout server acknowledges a weights update and keeps the old weights, silently (or applies it
to half of its parameters)."""

from __future__ import annotations

from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register

MODES = ("keep", "half")


@register
class WeightsStale(FaultKind):
    NAME = "weights_stale"
    DOC = ("at weights_update.update, the rollout server answers the update as done and reports the new version, "
           "but its parameters keep the old values (mode keep) or the second half of them do (mode half): real, "
           "nothing fails; weights.verify's checksums or the steps' rollout_train_logprob_diff show it")
    PARAMS = {"mode": ((str,), "keep", "keep: no parameter takes the new values; half: the second half of the "
                                        "parameters (in the model's order) keep theirs")}

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "mode" and value not in MODES:
            return f"{value!r} is not a mode; choose one of: {', '.join(MODES)}"
        return super().check_param(key, value)

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        if point != "weights_update.update":
            return "acts where a rollout server loads a weights version: point weights_update.update"
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        return {"stale": self.params["mode"]}  # the rollout server's load keeps what this says (memory.py)
