"""DistributedBatchMemory: per-sample fields between stages, validated, merged and split by group.

Every key holds one entry per sample (a list, or a tensor whose first dimension is the batch),
so one dict carries prompts, completions, logprobs, rewards and advantages between stages:

    memory = DistributedBatchMemory.concat([server0_part, server1_part], group_size=8)
    shards, imbalance = memory.split(dp_size=2, tokens_key="num_tokens")

`validate()` raises BatchSizeMismatch naming each key's size when they differ. `split` keeps
GRPO groups whole and balances token counts across ranks with longest-processing-time-first
(each group, largest first, goes to the rank with fewest tokens); that greedy rule bounds the
spread: max rank tokens - min rank tokens <= the largest group's tokens.
"""

from __future__ import annotations

from typing import Any

import torch


class BatchSizeMismatch(ValueError):
    """Keys of one batch hold different numbers of samples."""

    def __init__(self, sizes: dict[str, int], where: str = "") -> None:
        self.sizes = sizes
        detail = ", ".join(f"{k}={v}" for k, v in sizes.items())
        super().__init__(f"batch size mismatch{' in ' + where if where else ''}: {detail}")


def _size(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)


def _take(value: Any, index: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(index, dtype=torch.long)] if index else value[:0]
    return [value[i] for i in index]


class DistributedBatchMemory:
    def __init__(self, data: dict[str, Any], group_size: int = 1, strict: bool = True) -> None:
        self.data = dict(data)
        self.group_size = group_size
        if strict:
            self.validate()

    def __len__(self) -> int:
        sizes = self.sizes()
        return max(sizes.values()) if sizes else 0

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def keys(self):
        return self.data.keys()

    def sizes(self) -> dict[str, int]:
        return {k: _size(v) for k, v in self.data.items()}

    def validate(self, where: str = "") -> None:
        sizes = self.sizes()
        if len(set(sizes.values())) > 1:
            raise BatchSizeMismatch(sizes, where)
        n = next(iter(sizes.values()), 0)
        if n % self.group_size:
            raise BatchSizeMismatch({**sizes, "group_size": self.group_size}, where or "groups are not whole")

    @classmethod
    def concat(cls, parts: list["DistributedBatchMemory"], group_size: int = 1, strict: bool = True) -> "DistributedBatchMemory":
        """Concatenate the results of several producers (e.g. rollout servers) key by key."""
        if not parts:
            return cls({}, group_size, strict)
        keys = list(parts[0].keys())
        for p in parts[1:]:
            if set(p.keys()) != set(keys):
                raise KeyError(f"concat: parts have different keys: {sorted(keys)} vs {sorted(p.keys())}")
        data: dict[str, Any] = {}
        for k in keys:
            values = [p[k] for p in parts]
            if isinstance(values[0], torch.Tensor):
                data[k] = torch.cat(values, dim=0)
            else:
                data[k] = [x for v in values for x in v]
        return cls(data, group_size, strict)

    def groups(self, index: list[int]) -> "DistributedBatchMemory":
        """The groups at `index` (group numbers, in that order), each group's rows adjacent as here."""
        g = self.group_size
        rows = [i * g + j for i in index for j in range(g)]
        return DistributedBatchMemory({k: _take(v, rows) for k, v in self.data.items()}, g, strict=False)

    def group_tokens(self, tokens_key: str) -> list[int]:
        tokens = self.data[tokens_key]
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        g = self.group_size
        return [int(sum(tokens[i : i + g])) for i in range(0, len(tokens), g)]

    def split(self, dp_size: int, tokens_key: str) -> tuple[list["DistributedBatchMemory"], dict[str, float]]:
        """Whole groups to ranks, balancing tokens. Returns (shards, stats with the imbalance)."""
        self.validate("split")
        per_group = self.group_tokens(tokens_key)
        if len(per_group) < dp_size:
            raise ValueError(f"split: {len(per_group)} groups cannot feed {dp_size} data-parallel ranks")
        loads = [0] * dp_size
        assigned: list[list[int]] = [[] for _ in range(dp_size)]
        for g in sorted(range(len(per_group)), key=lambda i: (-per_group[i], i)):
            rank = min(range(dp_size), key=lambda r: (loads[r], r))
            assigned[rank].append(g)
            loads[rank] += per_group[g]
        shards = []
        for groups in assigned:
            index = [g * self.group_size + j for g in sorted(groups) for j in range(self.group_size)]
            shards.append(DistributedBatchMemory({k: _take(v, index) for k, v in self.data.items()}, self.group_size))
        mean = sum(loads) / dp_size
        stats = {
            "tokens_per_rank": loads,
            "imbalance": (max(loads) / mean - 1.0) if mean else 0.0,
            "groups_per_rank": [len(a) for a in assigned],
        }
        return shards, stats
