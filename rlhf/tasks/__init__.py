"""Tasks and reward functions, each registered by name.

A task yields `Example(prompt, answer)` for three disjoint splits — train, val (the SFT
warm-start stopping rule) and eval (final accuracy) — deterministically from `task.seed`.

Reward-function signature (every entry of REWARDS)::

    reward_fn(completions: list[str], answers: list[str], prompts: list[str]) -> list[float]

`completions[i]` is the decoded text the policy produced for `prompts[i]` (special tokens
removed, nothing else stripped); `answers[i]` is the reference answer. It returns one float
per sample; GRPO only uses differences within a group, so the scale is free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class Task:
    """Base class: subclasses fill self.splits = {'train': [...], 'val': [...], 'eval': [...]}."""

    splits: dict[str, list[Example]]

    def split(self, name: str) -> list[Example]:
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; choose one of: {', '.join(self.splits)}")
        return self.splits[name]


TASKS: dict[str, Callable[[Any], Task]] = {}
REWARDS: dict[str, RewardFn] = {}


def register_task(name: str) -> Callable:
    def deco(factory: Callable[[Any], Task]) -> Callable[[Any], Task]:
        TASKS[name] = factory
        return factory

    return deco


def register_reward(name: str) -> Callable:
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def build_task(task_cfg: Any) -> Task:
    return TASKS[task_cfg.name](task_cfg)


def reward_fn(name: str) -> RewardFn:
    return REWARDS[name]


# Register the built-in tasks and rewards.
from rlhf.tasks import arithmetic, jsonl_task, rewards  # noqa: E402,F401
