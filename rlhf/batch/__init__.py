"""The step's batch: per-sample columns between stages, and the one path from the global batch to each rank.

Every column holds one entry per sample (a list, or a tensor whose first dimension is the batch),
so one object carries prompts, completions, logprobs, rewards and advantages between stages
(the experiment plan calls it DistributedBatchMemory; that name stays as an alias):

    batch = StepBatch.concat([server0_part, server1_part], group_size=8)
    shares, stats = batch.shares(dp=2, mini_batches=2, tokens_key="num_tokens")

The batch path is the same on every layout, so an optimizer step sees the same samples whatever the
data-parallel degree (verl cuts the same way):

    global batch (B samples, in group order)
      -> mini-batches: contiguous slices, round(j * B / k) .. round((j + 1) * B / k)
        -> each mini-batch over the dp ranks, token-balanced: longest-processing-time-first (each
           sample, longest first, to the rank with fewest tokens so far), so within a mini-batch
           max rank tokens - min rank tokens <= its longest sample

A rank's share is its part of mini-batch 0, then of mini-batch 1, …, with a `mini_batch` column
saying which; the train engine takes one optimizer step per mini-batch, normalising by the
mini-batch's global token count, so one rank holding all of it or four holding a quarter each
compute the same update (up to float summation order). `validate()` raises BatchSizeMismatch
naming each column's size when they differ.
"""

from __future__ import annotations

import heapq
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


def _as_list(value: Any) -> list:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


def _take(value: Any, index: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(index, dtype=torch.long)] if index else value[:0]
    return [value[i] for i in index]


class StepBatch:
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
    def concat(cls, parts: list["StepBatch"], group_size: int = 1, strict: bool = True) -> "StepBatch":
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

    def groups(self, index: list[int]) -> "StepBatch":
        """The groups at `index` (group numbers, in that order), each group's rows adjacent as here."""
        g = self.group_size
        rows = [i * g + j for i in index for j in range(g)]
        return StepBatch({k: _take(v, rows) for k, v in self.data.items()}, g, strict=False)

    def group_tokens(self, tokens_key: str) -> list[int]:
        tokens = _as_list(self.data[tokens_key])
        g = self.group_size
        return [int(sum(tokens[i : i + g])) for i in range(0, len(tokens), g)]

    def rows(self, index: list[int]) -> "StepBatch":
        """The samples at `index`, in that order."""
        return StepBatch({k: _take(v, index) for k, v in self.data.items()}, self.group_size, strict=False)

    def shares(self, dp: int, mini_batches: int, tokens_key: str, speeds: list[float] | None = None
               ) -> tuple[list["StepBatch"], dict[str, Any]]:
        """Each data-parallel rank's share (module docstring), with a `mini_batch` column; stats: tokens_per_rank,
        imbalance (max rank's tokens over the mean, minus 1), mini_batches (how many the batch was cut into).
        speeds: each rank's relative compute speed (plan_shares)."""
        self.validate("shares")
        tokens = [int(t) for t in _as_list(self.data[tokens_key])]
        rows, minis = plan_shares(tokens, mini_batches, dp, speeds)
        out = []
        for index, mini in zip(rows, minis):
            share = self.rows(index)
            share["mini_batch"] = torch.tensor(mini, dtype=torch.long)
            out.append(share)
        loads = [sum(tokens[i] for i in index) for index in rows]
        mean = sum(loads) / dp
        return out, {"tokens_per_rank": loads, "imbalance": (max(loads) / mean - 1.0) if mean else 0.0,
                     "mini_batches": max((m[-1] for m in minis if m), default=-1) + 1}


DistributedBatchMemory = StepBatch  # the experiment plan's name for it


class TokenCount:
    """Rollout token ids and logprobs this process received or sent, counted where it handles them (a simulated
    world's steps.csv column controller_tokens: 0 when the rows stay on the rollout side, rollout.data_plane store)."""

    def __init__(self) -> None:
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += int(n)


TOKENS = TokenCount()


def mini_batch_bounds(samples: int, mini_batches: int) -> list[int]:
    """Where the k mini-batches of a batch of `samples` start and end: k + 1 indices (contiguous, near-equal)."""
    return [round(j * samples / mini_batches) for j in range(mini_batches + 1)]


def plan_shares(tokens: list[int], mini_batches: int, dp: int, speeds: list[float] | None = None
                ) -> tuple[list[list[int]], list[list[int]]]:
    """The batch path as indices: for each of `dp` ranks, the samples it trains on (mini-batch by mini-batch, each
    mini-batch's in batch order) and the mini-batch of each. `tokens`: each sample's token count. Every mini-batch
    gets at least one sample per rank (an optimizer step is a collective every rank joins), so a batch is cut in
    min(mini_batches, samples // dp) mini-batches. `speeds`: each rank's relative compute speed (1: the others'; a
    straggler's 1/3 gets about a third of their tokens), so the ranks finish together; None: all equal."""
    n = len(tokens)
    if dp < 1 or mini_batches < 1:
        raise ValueError(f"plan_shares: dp {dp} and mini_batches {mini_batches} must be at least 1")
    if n < dp:
        raise ValueError(f"plan_shares: {n} samples cannot feed {dp} data-parallel ranks (each needs one or more)")
    bounds = mini_batch_bounds(n, min(mini_batches, n // dp))
    rows: list[list[int]] = [[] for _ in range(dp)]
    minis: list[list[int]] = [[] for _ in range(dp)]
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        mine: list[list[int]] = [[] for _ in range(dp)]
        heap = [(0.0, 0, r, 0) for r in range(dp)]  # (time so far: tokens / speed, samples so far, rank, tokens):
        for i in sorted(range(lo, hi), key=lambda i: (-tokens[i], i)):  # the least loaded on top, an empty one
            _, count, rank, load = heapq.heappop(heap)                   # first; longest sample first, ties in
            mine[rank].append(i)                                          # batch order (O(n log dp))
            load += tokens[i]
            heapq.heappush(heap, (load / speeds[rank] if speeds else load, count + 1, rank, load))
        for rank in range(dp):
            rows[rank] += sorted(mine[rank])
            minis[rank] += [j] * len(mine[rank])
    return rows, minis
