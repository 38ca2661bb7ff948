"""Loading env.path: a built-in name, the user's class (this project's Env shape), or another trainer's environment
run unchanged (rlhf.envs.adapters); checked with the file and the line before any work starts."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from rlhf.envs import adapters
from rlhf.envs.base import ENVS, Env, EnvError
from rlhf.tasks.scoring import load_module


def build_env(spec: str, options: dict[str, Any] | None = None, tokenizer: Any = None) -> Callable[[], Env]:
    """A factory of fresh environments from env.path: a built-in name, path/to/file.py:Class or
    package.module:Class (an Env subclass, or any class with reset(row) and step(action)), or another trainer's
    environment run unchanged (rlhf.envs.adapters: a SkyRL-gym BaseTextEnv, skyrl_gym:<id>, skyrl_gym (each row's
    env_class), a gymnasium-style text environment; `tokenizer` renders their chat-message observations)."""
    spec = spec.strip()
    if spec == "skyrl_gym":  # each row's env_class (SkyRL-format datasets), resolved as the row's episode starts
        adapters.skyrl_registry(spec)  # installed: said now, not at the first episode
        return _checked(adapters.adapter(None, "skyrl", dict(options or {}), tokenizer))
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

