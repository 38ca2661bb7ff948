"""A JSONL dataset: one {"prompt": str, "answer": str} object per line, exact-match reward."""

from __future__ import annotations

import json
from typing import Any

from rlhf.tasks.base import Example, Task, register_task, split_examples


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
        self.splits = split_examples(examples, cfg, cfg.path)
