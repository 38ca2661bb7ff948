"""Synthetic verifiable arithmetic: prompt '23+45=' → answer '68'.

Every problem a op b with a, b in [0, max_operand] is enumerated, shuffled with `task.seed`
and cut into eval, val and train, so the splits are disjoint by construction and identical
for every run seed.
"""

from __future__ import annotations

from typing import Any

from rlhf.tasks.base import Example, Task, register_task, split_examples

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@register_task("arithmetic")
class ArithmeticTask(Task):
    def __init__(self, cfg: Any) -> None:
        n = cfg.max_operand + 1
        problems = [
            Example(f"{a}{op}{b}=", str(_OPS[op](a, b))) for op in cfg.operations for a in range(n) for b in range(n)
        ]
        self.splits = split_examples(problems, cfg, f"task arithmetic (max_operand={cfg.max_operand})")
