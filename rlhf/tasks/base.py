"""Tasks and rewards as data: Example, Task (three disjoint splits), the task and reward registries."""


from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf.registry import Registry

RewardFn = Callable[..., list[float]]  # fn(completions=, answers=, prompts=, **fields) (rlhf.tasks.scoring)


@dataclass(frozen=True)
class Example:
    prompt: Any  # a string, or a list of chat messages {role, content} (rendered by the tokenizer's chat template)
    answer: str
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # the row's other columns


class Task:
    """Base class: subclasses fill self.splits = {'train': [...], 'val': [...], 'eval': [...]}."""

    splits: dict[str, list[Example]]

    def split(self, name: str) -> list[Example]:
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; choose one of: {', '.join(self.splits)}")
        return self.splits[name]


TASKS: Registry[Callable[[Any], Task]] = Registry("task")
REWARDS: Registry[RewardFn] = Registry("reward")
register_task = TASKS.register
register_reward = REWARDS.register


def split_examples(examples: list[Example], cfg: Any, source: str) -> dict[str, list[Example]]:
    """Shuffle with task.seed and cut into eval, val and train (disjoint by construction)."""
    need = cfg.eval_size + cfg.val_size + 1
    if len(examples) < need:
        raise ValueError(
            f"{source}: {len(examples)} examples is fewer than eval_size + val_size + 1 "
            f"({cfg.eval_size} + {cfg.val_size} + 1)"
        )
    examples = list(examples)
    random.Random(cfg.seed).shuffle(examples)
    e, v = cfg.eval_size, cfg.val_size
    return {"eval": examples[:e], "val": examples[e : e + v], "train": examples[e + v :]}


def build_task(task_cfg: Any) -> Task:
    return TASKS[task_cfg.name](task_cfg)


def reward_fn(name: str) -> RewardFn:
    """A built-in reward by name (a run's rewards: rlhf.tasks.scoring.scorer_of)."""
    return REWARDS[name]
