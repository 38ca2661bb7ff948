"""The step's batch (rlhf.batch): validation, concat, and the batch path's properties (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.batch import BatchSizeMismatch, DistributedBatchMemory, StepBatch, mini_batch_bounds, plan_shares


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


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 60), min_size=1, max_size=120), dp=st.integers(1, 6),
       mini_batches=st.integers(1, 5))
def test_the_batch_path_keeps_each_sample_once_in_its_mini_batch_and_feeds_every_rank(tokens, dp, mini_batches):
    if len(tokens) < dp:
        with pytest.raises(ValueError, match=f"{len(tokens)} samples cannot feed {dp}"):
            plan_shares(tokens, mini_batches, dp)
        return
    rows, minis = plan_shares(tokens, mini_batches, dp)
    k = min(mini_batches, len(tokens) // dp)
    bounds = mini_batch_bounds(len(tokens), k)
    assert sorted(i for r in rows for i in r) == list(range(len(tokens)))  # every sample exactly once
    for r in range(dp):
        assert minis[r] == sorted(minis[r]) and sorted(set(minis[r])) == list(range(k))  # every rank, every step
        for i, j in zip(rows[r], minis[r]):
            assert bounds[j] <= i < bounds[j + 1]  # a sample trains in the mini-batch it has on one rank
    for j in range(k):  # inside a mini-batch, tokens balanced: the spread is at most its longest sample
        loads = [sum(tokens[i] for i, m in zip(rows[r], minis[r]) if m == j) for r in range(dp)]
        assert max(loads) - min(loads) <= max(tokens[bounds[j]:bounds[j + 1]])


def test_one_rank_trains_on_the_batch_in_its_order_cut_in_contiguous_mini_batches():
    rows, minis = plan_shares([5, 1, 7, 2, 2, 9, 4], 2, 1)
    assert rows == [[0, 1, 2, 3, 4, 5, 6]] and minis == [[0, 0, 0, 0, 1, 1, 1]]


def test_shares_carry_their_columns_and_mini_batch_and_report_the_imbalance():
    batch = StepBatch({"sample_index": list(range(8)), "num_tokens": torch.tensor([8, 1, 1, 1, 4, 4, 4, 4]),
                       "prompts": [f"p{i // 2}" for i in range(8)]}, group_size=2)
    shares, stats = batch.shares(dp=2, mini_batches=2, tokens_key="num_tokens")
    assert [s["sample_index"] for s in shares] == [[0, 4, 6], [1, 2, 3, 5, 7]]
    assert [s["mini_batch"].tolist() for s in shares] == [[0, 1, 1], [0, 0, 0, 1, 1]]
    assert stats["tokens_per_rank"] == [16, 11] and stats["mini_batches"] == 2
    assert stats["imbalance"] == pytest.approx(16 / 13.5 - 1)
    assert shares[1]["prompts"] == ["p0", "p1", "p1", "p2", "p3"]


def test_a_mini_batch_smaller_than_the_dp_degree_is_merged_not_left_empty():
    rows, minis = plan_shares([1] * 6, 4, 2)  # 4 mini-batches of 1-2 samples would leave a rank without one
    assert [sorted(set(m)) for m in minis] == [[0, 1, 2], [0, 1, 2]]


def test_a_row_store_hands_back_its_rows_in_the_order_asked_and_drops_old_steps():
    """rollout.data_plane store's store: rows round-trip through the wire's flat tensors in the order asked (the
    ids it lacks named), and a put of a later step drops the rows more than keep_steps behind it."""
    from rlhf.batch.store import RowStore, decode

    store = RowStore(keep_steps=1)
    store.put(1, 7, [1, 2, 3], [4, 5], [-0.5, -0.25])
    store.put(1, 8, [1], [9, 9, 9], [-1.0, -2.0, -3.0])
    store.put(2, 9, [6], [7], [-0.125])
    header, tensors = store.encode([9, 7, 8, 42])
    assert header == {"rows": 3, "missing": [42]}
    assert decode(tensors) == [([6], [7], [-0.125]), ([1, 2, 3], [4, 5], [-0.5, -0.25]),
                               ([1], [9, 9, 9], [-1.0, -2.0, -3.0])]
    store.put(3, 10, [1], [2], [0.0])  # step 1 is now more than one step behind
    assert store.encode([7, 8, 9, 10])[0]["missing"] == [7, 8] and len(store) == 2


def test_a_slow_rank_gets_a_share_in_proportion_to_its_speed():
    tokens = [10] * 64
    equal, _ = plan_shares(tokens, 2, 4)
    assert [len(r) for r in equal] == [16, 16, 16, 16]
    assert plan_shares(tokens, 2, 4, [1.0] * 4) == plan_shares(tokens, 2, 4)  # speeds of 1: the same plan
    rows, minis = plan_shares(tokens, 2, 4, [1.0, 1.0, 0.25, 1.0])
    sizes = [len(r) for r in rows]
    assert 2 <= sizes[2] <= 0.35 * min(sizes[:2] + sizes[3:])  # about a quarter of the others': all finish together
    assert sorted(i for r in rows for i in r) == list(range(64))  # every sample once
    assert all(set(m) == {0, 1} for m in minis)  # still a sample in every mini-batch
