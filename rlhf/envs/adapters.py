"""Environments written for other trainers, run unchanged behind this project's Env interface (--env.path):

    SkyRL-gym   a BaseTextEnv class (or any class with init(prompt) and step(action) and no reset): constructed
                as SkyRL constructs it, cls(env_config, extras) with the dataset row as extras (its reward_spec,
                extra_info, ...); init(prompt) with the row's chat messages; step(action) -> {observations: chat
                messages, reward, done, metadata}; close() when the episode ends. A registered skyrl_gym id
                (env.path skyrl_gym:gsm8k) is made with skyrl_gym.make.
    gymnasium   a text environment in gymnasium's shape: reset(seed=, options=) -> (observation, info) and
                step(action) -> (observation, reward, terminated, truncated, info); the row goes in as
                options={"row": row}; close() when the episode ends.

Observations that are chat messages become the text appended after the model's turn: through the model's chat
template when it has one (the messages rendered after the conversation so far, the assistant's turn opened again),
else their contents one after the other (the tiny default model's tokenizer has no template). A class that fits
none of the shapes is one error naming it and what it lacks.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from rlhf.envs.base import Env, EnvError, StepResult
from rlhf.models.tokenizer import chat_contents, has_chat

SKYRL_KEYS = ("observations", "reward", "done")


class EnvConfig(dict):
    """SkyRL's env_config (an OmegaConf DictConfig there): read as a dict or by attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def kind_of(cls: Any) -> str:
    """'native' (reset(row), step(action) -> StepResult), 'skyrl' or 'gymnasium', or '' when it is none of them."""
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        return ""
    if callable(getattr(cls, "init", None)) and not _own_reset(cls):
        return "skyrl"
    reset = getattr(cls, "reset", None)
    if not callable(reset):
        return ""
    try:
        params = [p for p in inspect.signature(reset).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return "native"
    names = {p.name for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if names & {"seed", "options"} and not positional:
        return "gymnasium"
    return "native"


def _own_reset(cls: type) -> bool:
    """Whether reset comes from the class or a base of its own, not gymnasium's or SkyRL's Env base (which has
    a reset SkyRL text environments never use)."""
    for klass in cls.__mro__:
        if "reset" in vars(klass):
            return not klass.__module__.startswith(("skyrl_gym", "gymnasium"))
    return False


def skyrl_registry(spec: str) -> dict[str, Any]:
    """skyrl_gym's registered environments (EnvError naming `spec` when it is not installed)."""
    try:
        import skyrl_gym  # noqa: F401  (registers its environments)
        from skyrl_gym.envs.registration import registry
    except ImportError as exc:
        raise EnvError(f"env.path {spec!r}: skyrl_gym is not installed ({exc}); pip install skyrl-gym, or give "
                       "path/to/file.py:Class") from None
    return registry


def skyrl_class(spec: str) -> Any:
    """env.path skyrl_gym:<id>: the class registered under that id in skyrl_gym."""
    registry = skyrl_registry(spec)
    env_id = spec.split(":", 1)[1]
    if env_id not in registry:
        raise EnvError(f"env.path {spec!r}: no skyrl_gym environment {env_id!r} (registered: "
                       f"{', '.join(sorted(registry))})")
    entry = registry[env_id].entry_point
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        import importlib

        return getattr(importlib.import_module(module), attr)
    return entry


def _prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = row.get("prompt")
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    return [{"role": "user", "content": str(prompt or "")}]


class Renderer:
    """Chat messages as the text that follows the conversation so far (the model's chat template, if any)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer if has_chat(tokenizer) else None

    def after(self, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
        if not new:
            return ""
        if self.tokenizer is None:
            return chat_contents(new)
        tok = self.tokenizer
        before = tok.apply_chat_template(history, tokenize=False)
        whole = tok.apply_chat_template(history + new, tokenize=False, add_generation_prompt=True)
        if not isinstance(before, str) or not isinstance(whole, str):
            return chat_contents(new)
        if not whole.startswith(before):
            raise EnvError("the chat template renders the conversation differently once the observation is added; "
                           "its text cannot be appended after the model's turn")
        return whole[len(before):]


class SkyRLEnv(Env):
    """A SkyRL-gym BaseTextEnv behind the Env interface (module docstring)."""

    def __init__(self, cls: type | None, env_config: dict[str, Any], renderer: Renderer,
                 classes: dict[str, type] | None = None) -> None:
        """cls None: each row's env_class, a skyrl_gym id (classes: those found so far, shared)."""
        super().__init__()
        self.cls, self.env_config, self.renderer = cls, EnvConfig(env_config), renderer
        self.by_row, self._classes = cls is None, classes if classes is not None else {}
        self.env: Any = None
        self.messages: list[dict[str, Any]] = []

    def reset(self, row: dict[str, Any]) -> str:
        if self.by_row:  # env.path skyrl_gym: each row's env_class, as SkyRL picks a dataset row's environment
            env_class = row.get("env_class")
            if not isinstance(env_class, str) or not env_class:
                raise EnvError(f"env.path skyrl_gym takes each row's environment from its env_class field; this row "
                               f"has {'none' if env_class is None else repr(env_class)} (its fields: "
                               f"{', '.join(map(str, row))}); or give env.path skyrl_gym:<id> for every row")
            self.cls = self._classes.get(env_class) or self._classes.setdefault(
                env_class, skyrl_class(f"skyrl_gym:{env_class}"))
        name = f"{self.cls.__module__}.{self.cls.__qualname__}"
        try:
            self.env = self.cls(self.env_config, dict(row))
        except TypeError as exc:
            raise EnvError(f"{name}: SkyRL constructs an environment as cls(env_config, extras); this one "
                           f"refused: {exc}") from None
        prompt = _prompt_messages(row)
        conversation, _meta = self.env.init(prompt)
        conversation = list(conversation or prompt)
        if conversation[:len(prompt)] != prompt:
            raise EnvError(f"{name}.init changed the prompt's messages; only messages added after them can follow "
                           "the prompt the model is given")
        self.messages = conversation
        for attr in ("stop", "current_tool", "tool_since"):  # what the environment server reads, if it has them
            if hasattr(self.env, attr):
                setattr(self, attr, getattr(self.env, attr))
        return self.renderer.after(prompt, conversation[len(prompt):])

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        name = f"{self.cls.__module__}.{self.cls.__qualname__}"
        if not isinstance(out, dict) or any(k not in out for k in SKYRL_KEYS):
            raise EnvError(f"{name}.step returned {type(out).__name__}"
                           f"{' without ' + ', '.join(k for k in SKYRL_KEYS if k not in out) if isinstance(out, dict) else ''}"
                           "; a SkyRL environment answers {observations, reward, done, metadata}")
        turn = {"role": "assistant", "content": out.get("postprocessed_action") or action}
        observations = [dict(m) for m in out["observations"] or []]
        done = bool(out["done"])
        text = "" if done else self.renderer.after(self.messages + [turn], observations)
        self.messages += [turn, *observations]
        if done:
            self.close()
        info = dict(out.get("metadata") or {})
        return StepResult(text, None if out["reward"] is None else float(out["reward"]), done, info)

    def close(self) -> None:
        if self.env is not None and callable(getattr(self.env, "close", None)):
            self.env.close()
        self.env = None


class GymnasiumEnv(Env):
    """A gymnasium-style text environment behind the Env interface (module docstring)."""

    def __init__(self, cls: type, options: dict[str, Any], seed: int | None = None) -> None:
        super().__init__()
        self.cls, self.options, self.seed = cls, options, seed
        self.env: Any = None

    def reset(self, row: dict[str, Any]) -> str:
        self.env = self.cls(**self.options)
        observation, _info = self.env.reset(seed=self.seed, options={"row": dict(row)})
        return str(observation or "")

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        if not isinstance(out, tuple) or len(out) != 5:
            raise EnvError(f"{self.cls.__module__}.{self.cls.__qualname__}.step returned {type(out).__name__}; a "
                           "gymnasium environment answers (observation, reward, terminated, truncated, info)")
        observation, reward, terminated, truncated, info = out
        done = bool(terminated or truncated)
        if done:
            self.close()
        return StepResult("" if done else str(observation or ""), None if reward is None else float(reward), done,
                          dict(info or {}))

    def close(self) -> None:
        if self.env is not None and callable(getattr(self.env, "close", None)):
            self.env.close()
        self.env = None


def adapter(cls: type | None, kind: str, options: dict[str, Any], tokenizer: Any = None) -> Callable[[], Env]:
    """A factory of Env instances over another trainer's environment class (skyrl, cls None: each row's
    env_class)."""
    if kind == "skyrl":
        renderer, classes = Renderer(tokenizer), {}
        return lambda: SkyRLEnv(cls, options, renderer, classes)
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = {k: v for k, v in options.items() if k in params}
    return lambda: GymnasiumEnv(cls, options)
