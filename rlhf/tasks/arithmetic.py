"""Synthetic verifiable arithmetic: prompt '23+45=' → answer '68'.

Every problem a op b with a, b in [0, max_operand] is enumerated, shuffled with `task.seed`
and cut into eval, val and train, so the splits are disjoint by construction and identical
for every run seed.
"""

from __future__ import annotations

import random
from typing import Any

from rlhf.tasks import Example, Task, register_task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@register_task("arithmetic")
class ArithmeticTask(Task):
    def __init__(self, cfg: Any) -> None:
        n = cfg.max_operand + 1
        problems = [
            Example(f"{a}{op}{b}=", str(_OPS[op](a, b))) for op in cfg.operations for a in range(n) for b in range(n)
        ]
        if len(problems) < cfg.eval_size + cfg.val_size + 1:
            raise ValueError(
                f"task arithmetic: only {len(problems)} problems for eval_size={cfg.eval_size} + "
                f"val_size={cfg.val_size}; raise task.max_operand"
            )
        random.Random(cfg.seed).shuffle(problems)
        e, v = cfg.eval_size, cfg.val_size
        self.splits = {"eval": problems[:e], "val": problems[e : e + v], "train": problems[e + v :]}
