"""The environment interface, its registry, and loading the user's environment class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ENVS: dict[str, type["Env"]] = {}


class EnvError(RuntimeError):
    """An environment that cannot be built or answers wrongly (what, and which environment)."""


class InfraError(RuntimeError):
    """The infrastructure failed, not the model: a tool's service unreachable, a sandbox killed or unable to start.
    Raise it from a tool or an environment; tool_calls also counts OSError (ConnectionError, TimeoutError ...) as
    one. With env.on_infra_error retry tool_calls calls the tool again first; with fail it fails the step naming the
    tool; with model the model reads it as the tool's answer (verl's behaviour)."""


@dataclass
class StepResult:
    observation: str = ""
    """Text appended after the model's turn (its tokens are masked out of the loss and the KL); "" with done."""
    reward: float | None = None
    """This step's reward (an episode's reward is the sum of its steps'); None: the reward functions score it."""
    done: bool = False
    """The episode ends after this step."""
    info: dict[str, Any] = field(default_factory=dict)
    """What happened: `tool_calls` and `tool_errors` (counted in steps.csv), anything else the environment keeps."""


class Env:
    """One episode's environment. A new instance per episode; reset once, then step once a model turn.

    Optional attributes the environment server reads: `stop` (strings that end a model turn), `current_tool` (the
    tool running now) and `tool_since` (time.monotonic() when its latest try began): the stall watchdog names the
    tool, and times a retried call from its latest try."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    def reset(self, row: dict[str, Any]) -> str:
        """The episode's row (prompt, answer and the dataset's other columns); returns text to put after the
        prompt before the first turn, or ""."""
        return ""

    def step(self, action: str) -> StepResult:
        """The model's text of this turn; what the environment answers."""
        raise NotImplementedError

    def demonstration(self, row: dict[str, Any]) -> list[tuple[str, bool]] | None:
        """An optional worked episode for the SFT warm start, after reset(row): the texts that follow the prompt
        in order, each with whether it is the model's (trained on) or the environment's (masked out, as in the
        rollout), e.g. [(call, True), (tool's answer, False), (final answer, True)]; None: none (the warm start
        then trains on the row's answer alone)."""
        return None


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    def deco(cls: type[Env]) -> type[Env]:
        ENVS[name] = cls
        return cls

    return deco
