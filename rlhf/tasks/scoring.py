"""Rewards as the user gives them: a registered name, a function in a package (`package.module:function`) or in a
file (`path/to/rewards.py:function`), or several with weights; and their checked, weighted sum.

Every reward function is called with keyword arguments, as TRL calls its `reward_funcs`:

    fn(completions=[...], answers=[...], prompts=[...], **fields) -> list[float]

`fields` are the rows' other dataset columns, one list per column (None where a row lacks it); a function takes the
ones it names and may swallow the rest with `**kwargs`. An `async def` function (one that calls a judge over the
network, say) is awaited within reward.async_timeout_s; a plain one runs to its end. A function that raises, returns
the wrong length, a non-number, NaN or infinity, or runs out of time is a RewardError naming the function, where it
comes from, the first bad row (index and prompt) and what was wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf.tasks.base import REWARDS


class RewardError(ValueError):
    """A reward function failed or returned something that is not one finite number per completion."""


@dataclass
class Reward:
    spec: str  # as the user wrote it
    fn: Callable[..., Any]
    weight: float
    source: str  # "built-in", the module, or the file
    options: dict[str, Any] = field(default_factory=dict)  # a built-in's settings from the config (format_regex)

    @property
    def label(self) -> str:
        """Its column in steps.csv: reward_<function name>."""
        return "reward_" + getattr(self.fn, "__name__", "fn").strip("_<>")

    def where(self) -> str:
        return f"reward {self.spec!r} ({self.source})"


def load_module_file(path: str, what: str = "reward") -> Any:
    """The user's Python file as a module (imported once a process; `what` names it in the errors)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"{what} file {path!r} does not exist (from {os.getcwd()})")
    name = f"rlhf_user_{what.replace(' ', '_')}_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{what} file {path!r} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def load_module(target: str, what: str = "reward") -> Any:
    """The user's module: a file (path/to/file.py, imported once a process) or a dotted name (package.module)."""
    if target.endswith(".py") or os.sep in target:
        return load_module_file(target, what)
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise ValueError(f"{what} {target!r}: cannot import module {target!r}: {exc}") from exc


def load_reward(spec: str, weight: float = 1.0, options: dict[str, Any] | None = None) -> Reward:
    """One reward from its spec: a registered name, `package.module:function` or `path/file.py:function`."""
    spec = spec.strip()
    if ":" not in spec:
        if spec not in REWARDS:
            raise ValueError(f"reward {spec!r} is not registered (registered: {', '.join(sorted(REWARDS))}); or give "
                             "a function as package.module:function or path/to/file.py:function")
        return Reward(spec, REWARDS[spec], weight, "built-in", dict(options or {}))
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"reward {spec!r}: expected package.module:function or path/to/file.py:function")
    module = load_module(target)
    source = os.path.abspath(target) if target.endswith(".py") or os.sep in target else target
    fn = getattr(module, attr, None)
    if fn is None:
        have = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"reward {spec!r}: {source} has no {attr!r} (its functions: {', '.join(have) or 'none'})")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} in {source} is not a function")
    return Reward(spec, fn, weight, source)


def reward_problem(reward: str, weights: str, pattern: str) -> str:
    """What is wrong with reward.functions / reward.weights / reward.format_regex as written (no file read and no user
    code imported: config.inputs checks the files, and the run imports them before anything starts), or ''."""
    specs = [r.strip() for r in reward.split(",")]
    for spec in specs:
        if not spec:
            return f"reward.functions: {reward!r} has an empty entry"
        if ":" not in spec and spec not in REWARDS:
            return (f"reward.functions: {spec!r} is not a built-in reward; choose one of: {', '.join(sorted(REWARDS))}, "
                    "or give package.module:function or path/to/file.py:function")
    if weights:
        values = [w.strip() for w in weights.split(",")]
        try:
            [float(w) for w in values]
        except ValueError:
            return f"reward.weights: {weights!r} is not a list of numbers"
        if len(values) != len(specs):
            return f"reward.weights: {len(values)} weight(s) for {len(specs)} reward(s) ({reward})"
    if "format_regex" in specs and not pattern:
        return "reward.format_regex: the format_regex reward needs a pattern (e.g. '^<think>.*</think>')"
    return ""


def parse_rewards(specs: str | list[str], weights: str | list[float] | None,
                  options: dict[str, Any] | None = None) -> list[Reward]:
    """reward.functions (comma-separated or a list) and reward.weights (the same count, or none: 1.0 each)."""
    names = [s.strip() for s in (specs.split(",") if isinstance(specs, str) else specs) if str(s).strip()]
    if not names:
        raise ValueError("reward.functions: give at least one reward")
    if weights in (None, "", []):
        values = [1.0] * len(names)
    else:
        raw = weights.split(",") if isinstance(weights, str) else list(weights)
        try:
            values = [float(w) for w in raw]
        except ValueError:
            raise ValueError(f"reward.weights: {weights!r} is not a list of numbers") from None
        if len(values) != len(names):
            raise ValueError(f"reward.weights: {len(values)} weight(s) for {len(names)} reward(s) ({', '.join(names)})")
    return [load_reward(n, w, options) for n, w in zip(names, values)]


def _bad(values: Any, n: int) -> tuple[int, str] | None:
    """(first bad row, what) of a reward function's return value, or None when it is n finite numbers."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        return -1, f"returned {type(values).__name__}, not a list of {n} numbers"
    if hasattr(values, "tolist"):
        values = values.tolist()
    if len(values) != n:
        return -1, f"returned {len(values)} values for {n} completions"
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return i, f"returned {v!r} ({type(v).__name__}), not a number"
        if not math.isfinite(float(v)):
            return i, f"returned {float(v)}, not a finite number"
    return None


async def _call(reward: Reward, kwargs: dict[str, Any], timeout_s: float) -> Any:
    fn, kwargs = reward.fn, {**kwargs, **reward.options}
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(**kwargs), timeout=timeout_s)
    return fn(**kwargs)


def score(rewards: list[Reward], completions: list[str], answers: list[str], prompts: list[str],
          fields: dict[str, list[Any]] | None = None, timeout_s: float = 60.0) -> tuple[list[float], dict[str, float]]:
    """The weighted sum of every reward for each completion, and each reward's mean (by its steps.csv label)."""
    total, parts = score_parts(rewards, completions, answers, prompts, fields, timeout_s)
    return total, {label: sum(values) / max(len(values), 1) for label, values in parts.items()}


def score_parts(rewards: list[Reward], completions: list[str], answers: list[str], prompts: list[str],
                fields: dict[str, list[Any]] | None = None, timeout_s: float = 60.0
                ) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum of every reward for each completion, and each reward's own value of each (by its label):
    what a rollout server that scores its rows (rollout.data_plane store) sends back beside them."""
    n = len(completions)
    kwargs = {"completions": completions, "answers": answers, "prompts": prompts, **(fields or {})}
    total = [0.0] * n
    parts: dict[str, list[float]] = {}
    for reward in rewards:
        where = reward.where()
        try:
            values = asyncio.run(_call(reward, kwargs, timeout_s))
        except asyncio.TimeoutError:
            raise RewardError(f"{where} did not return within reward.async_timeout_s ({timeout_s:g} s) for {n} "
                              f"completions (first prompt: {prompts[0]!r})") from None
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"{where} raised {type(exc).__name__}: {exc} (scoring {n} completions; first prompt: "
                              f"{prompts[0]!r})") from exc
        bad = _bad(values, n)
        if bad is not None:
            row, what = bad
            at = f"row {row} (prompt {prompts[row]!r}, completion {completions[row]!r})" if row >= 0 else \
                f"{n} completions"
            raise RewardError(f"{where} {what}: at {at}")
        values = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
        for i, v in enumerate(values):
            total[i] += reward.weight * v
        parts[reward.label] = values
    return total, parts


class Scorer:
    """The run's rewards as one function: scorer(completions, answers, prompts, fields) -> the weighted sum per
    completion; `means` holds each reward's mean of the last call (steps.csv reward_<name>)."""

    def __init__(self, rewards: list[Reward], timeout_s: float = 60.0) -> None:
        self.rewards, self.timeout_s = rewards, timeout_s
        self.means: dict[str, float] = {}

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.rewards]

    def __call__(self, completions: list[str], answers: list[str], prompts: list[Any],
                 fields: dict[str, list[Any]] | None = None) -> list[float]:
        total, self.means = score(self.rewards, completions, answers, prompts, fields, self.timeout_s)
        return total


def row_fields(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each row's other dataset columns as one list per column (None where a row lacks one)."""
    names = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows] for k in names}


def scorer_of(reward_cfg: Any) -> Scorer:
    """The Scorer of the reward section (reward.functions, reward.weights, reward.format_regex,
    reward.async_timeout_s)."""
    return Scorer(parse_rewards(reward_cfg.functions, reward_cfg.weights, {"pattern": reward_cfg.format_regex}
                                if reward_cfg.format_regex else None), reward_cfg.async_timeout_s)
