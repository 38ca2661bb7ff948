"""Where a step's rows live when the controller moves metadata only (rollout.data_plane store): the rollout side
keeps the rows it generated, by row id, until the train ranks have fetched them.

    store = RowStore(keep_steps=3)                       # one per rollout host (a simulated host: its 64 servers)
    store.put(step, row_id, prompt_ids, output_ids, logprobs)
    header, tensors = store.encode([row ids])            # POST /rows on a rollout server: raw tensors + JSON header
    rows = decode(tensors)                               # a train rank's: [(prompt_ids, output_ids, logprobs)], in order

The controller assigns the row ids (unique in the run) and keeps, for each, the server that holds it, its token
count, reward and version: the metadata the batch path (rlhf.batch.plan_shares) needs. A put drops the rows of steps
more than `keep_steps` behind it: a synchronous step's rows are trained within the step, an async one's within
rollout.max_staleness steps.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

Row = tuple[list[int], list[int], list[float]]  # prompt ids, output ids, the output's logprobs


class RowStore:
    def __init__(self, keep_steps: int = 3) -> None:
        self.keep_steps = keep_steps
        self.rows: dict[int, tuple[int, Row]] = {}  # row id -> (step, row)
        self.newest = -1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.rows)

    def put(self, step: int, row_id: int, prompt_ids: list[int], output_ids: list[int], logprobs: list[float]) -> None:
        with self._lock:
            if step > self.newest:
                self.newest = step
                old = [r for r, (s, _) in self.rows.items() if s < step - self.keep_steps]
                for r in old:
                    del self.rows[r]
            self.rows[int(row_id)] = (step, (list(prompt_ids), list(output_ids), list(logprobs)))

    def encode(self, ids: list[int]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The rows asked for, in that order, as five flat tensors; `missing`: the ids this store does not hold."""
        with self._lock:
            found = [(i, self.rows[i][1]) for i in (int(x) for x in ids) if i in self.rows]
            missing = [int(i) for i in ids if int(i) not in self.rows]
        rows = [row for _, row in found]
        tensors = {
            "prompt_lens": torch.tensor([len(p) for p, _, _ in rows], dtype=torch.int64),
            "output_lens": torch.tensor([len(o) for _, o, _ in rows], dtype=torch.int64),
            "prompt_ids": torch.tensor([t for p, _, _ in rows for t in p], dtype=torch.int64),
            "output_ids": torch.tensor([t for _, o, _ in rows for t in o], dtype=torch.int64),
            "logprobs": torch.tensor([x for _, _, lp in rows for x in lp], dtype=torch.float32),
        }
        return {"rows": len(rows), "missing": missing}, tensors


def decode(tensors: dict[str, torch.Tensor]) -> list[Row]:
    """encode's tensors back to rows, in order."""
    plens, olens = tensors["prompt_lens"].tolist(), tensors["output_lens"].tolist()
    prompts = tensors["prompt_ids"].split(plens) if plens else []
    outputs = tensors["output_ids"].split(olens) if olens else []
    logprobs = tensors["logprobs"].split(olens) if olens else []
    return [(p.tolist(), o.tolist(), lp.tolist()) for p, o, lp in zip(prompts, outputs, logprobs)]
