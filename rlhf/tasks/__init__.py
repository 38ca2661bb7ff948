"""Tasks and reward functions, each registered by name.

A task yields `Example(prompt, answer)` for three disjoint splits — train, val (the SFT
warm-start stopping rule) and eval (final accuracy) — deterministically from `task.seed`.

Reward-function signature (every entry of REWARDS)::

    reward_fn(completions: list[str], answers: list[str], prompts: list[str]) -> list[float]

`completions[i]` is the decoded text the policy produced for `prompts[i]` (special tokens
removed, nothing else stripped); `answers[i]` is the reference answer. It returns one float
per sample; GRPO only uses differences within a group, so the scale is free.
"""

from rlhf.tasks import arithmetic, jsonl_task, rewards  # noqa: F401  (registers the built-in tasks and rewards)
from rlhf.tasks.base import (
    REWARDS,
    TASKS,
    Example,
    RewardFn,
    Task,
    build_task,
    register_reward,
    register_task,
    reward_fn,
    split_examples,
)

__all__ = ["REWARDS", "TASKS", "Example", "RewardFn", "Task", "build_task", "register_reward", "register_task",
           "reward_fn", "split_examples"]
