"""A JSONL dataset: one {"prompt": str, "answer": str} object per line, exact-match reward."""

from __future__ import annotations

import json
import random
from typing import Any

from rlhf.tasks import Example, Task, register_task


@register_task("jsonl")
class JsonlTask(Task):
    def __init__(self, cfg: Any) -> None:
        examples = []
        with open(cfg.path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{cfg.path}:{lineno}: invalid JSON: {err.msg}") from None
                missing = [k for k in ("prompt", "answer") if not isinstance(row.get(k), str)]
                if missing:
                    raise ValueError(f"{cfg.path}:{lineno}: field(s) {missing} missing or not a string")
                examples.append(Example(row["prompt"], row["answer"]))
        if len(examples) < cfg.eval_size + cfg.val_size + 1:
            raise ValueError(
                f"{cfg.path}: {len(examples)} examples is fewer than eval_size + val_size + 1 "
                f"({cfg.eval_size} + {cfg.val_size} + 1)"
            )
        random.Random(cfg.seed).shuffle(examples)
        e, v = cfg.eval_size, cfg.val_size
        self.splits = {"eval": examples[:e], "val": examples[e : e + v], "train": examples[e + v :]}
