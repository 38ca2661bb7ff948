"""Tasks and reward functions, each registered by name.

A task yields `Example(prompt, answer)` for three disjoint splits — train, val (the SFT
warm-start stopping rule) and eval (final accuracy) — deterministically from `task.seed`.

Rewards (rlhf.tasks.scoring): a built-in name, `package.module:function` or `path/to/file.py:function`, several
with weights. Each is called with keyword arguments and returns one float per completion::

    reward(completions: list[str], answers: list[str], prompts: list, **fields) -> list[float]

`completions[i]` is the decoded text the policy produced for `prompts[i]` (special tokens removed, nothing else
stripped); `answers[i]` is the reference answer; `fields` are the rows' other dataset columns. GRPO only uses
differences within a group, so the scale is free.
"""

from rlhf.tasks import arithmetic, dataset, rewards  # noqa: F401  (registers the built-in tasks and rewards)
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
