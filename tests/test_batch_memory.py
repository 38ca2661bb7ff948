"""DistributedBatchMemory: validation, concat, split properties (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.runtime.batch_memory import BatchSizeMismatch, DistributedBatchMemory


def test_mismatched_keys_raise_a_named_error():
    with pytest.raises(BatchSizeMismatch, match="batch size mismatch: output_ids=6, rewards=8"):
        DistributedBatchMemory({"output_ids": [[1]] * 6, "rewards": torch.zeros(8)})
    short = DistributedBatchMemory({"output_ids": [[1]] * 6, "rewards": [0.0] * 8}, strict=False)
    with pytest.raises(BatchSizeMismatch, match="in train"):
        short.validate("train")


def test_concat_of_variable_length_results():
    a = DistributedBatchMemory({"output_ids": [[1, 2], [3]], "rewards": torch.tensor([1.0, 0.0])}, group_size=2)
    b = DistributedBatchMemory({"output_ids": [[4, 5, 6], []], "rewards": torch.tensor([0.0, 0.0])}, group_size=2)
    m = DistributedBatchMemory.concat([a, b], group_size=2)
    assert m["output_ids"] == [[1, 2], [3], [4, 5, 6], []]
    assert m["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0] and len(m) == 4


@settings(max_examples=150, deadline=None)
@given(
    group_size=st.integers(1, 8),
    group_lengths=st.lists(st.lists(st.integers(0, 50), min_size=8, max_size=8), min_size=1, max_size=40),
    dp_size=st.integers(1, 6),
)
def test_split_keeps_every_sample_once_groups_whole_and_bounds_imbalance(group_size, group_lengths, dp_size):
    if len(group_lengths) < dp_size:
        dp_size = len(group_lengths)
    lengths = [n for g in group_lengths for n in g[:group_size]]
    n = len(lengths)
    memory = DistributedBatchMemory(
        {"sample_id": list(range(n)), "num_tokens": torch.tensor(lengths), "group": [i // group_size for i in range(n)]},
        group_size=group_size,
    )
    shards, stats = memory.split(dp_size, "num_tokens")
    ids = sorted(i for s in shards for i in s["sample_id"])
    assert ids == list(range(n))  # every sample exactly once
    for s in shards:
        groups = s["group"]
        for g in set(groups):
            assert groups.count(g) == group_size  # groups whole
        assert s["num_tokens"].sum().item() == sum(lengths[i] for i in s["sample_id"])
    loads = stats["tokens_per_rank"]
    assert max(loads) - min(loads) <= max(memory.group_tokens("num_tokens"))  # LPT bound
    assert all(count >= 0 for count in stats["groups_per_rank"]) and sum(stats["groups_per_rank"]) == len(group_lengths)


def test_split_refuses_fewer_groups_than_ranks():
    m = DistributedBatchMemory({"num_tokens": [1, 2]}, group_size=2)
    with pytest.raises(ValueError, match="1 groups cannot feed 2"):
        m.split(2, "num_tokens")
