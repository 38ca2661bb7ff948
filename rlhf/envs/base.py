"""The environment interface, its registry, and loading the user's environment class."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf.tasks.scoring import load_module

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


def build_env(spec: str, options: dict[str, Any] | None = None, tokenizer: Any = None) -> Callable[[], Env]:
    """A factory of fresh environments from env.path: a built-in name, path/to/file.py:Class or
    package.module:Class (an Env subclass, or any class with reset(row) and step(action)), or another trainer's
    environment run unchanged (rlhf.envs.adapters: a SkyRL-gym BaseTextEnv, skyrl_gym:<id>, a gymnasium-style
    text environment; `tokenizer` renders their chat-message observations)."""
    from rlhf.envs import adapters

    spec = spec.strip()
    if spec.startswith("skyrl_gym:"):
        return _checked(adapters.adapter(adapters.skyrl_class(spec), "skyrl", dict(options or {}), tokenizer))
    if ":" not in spec:
        if spec not in ENVS:
            raise EnvError(f"env.path: {spec!r} is not a built-in environment (built-in: {', '.join(sorted(ENVS))}); "
                           "or give path/to/file.py:Class or package.module:Class")
        cls: Any = ENVS[spec]
    else:
        target, _, attr = spec.rpartition(":")
        try:
            module = load_module(target, "environment")
        except ValueError as exc:
            raise EnvError(f"env.path {spec!r}: {exc}") from exc
        cls = getattr(module, attr, None)
        if cls is None:
            have = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_"))
            raise EnvError(f"env.path {spec!r}: {target} has no {attr!r} (its classes: {', '.join(have) or 'none'})")
        kind = adapters.kind_of(cls)
        if not kind:
            missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
            where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}" if inspect.isclass(cls) else target
            raise EnvError(f"env.path {spec!r} ({where}): an environment is a class with reset(row) and step(action) "
                           "(this project's Env), init(prompt) and step(action) (SkyRL-gym's BaseTextEnv), or "
                           "reset(seed=, options=) and step(action) (gymnasium's)"
                           + (f"; it lacks {', '.join(missing)}" if inspect.isclass(cls) else f"; {attr} is not a class"))
        if kind != "native":
            return _checked(adapters.adapter(cls, kind, dict(options or {}), tokenizer))
    opts = dict(options or {})
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):  # what the class takes
        opts = {k: v for k, v in opts.items() if k in params}

    def make() -> Env:
        return cls(**opts)

    make()  # built once now: a constructor that fails says so before any work starts
    return make


def _checked(make: Callable[[], Env]) -> Callable[[], Env]:
    make()  # built once now: a constructor that fails says so before any work starts
    return make

