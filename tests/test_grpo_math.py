"""GRPO math against small hand-computed tensors."""

import math

import pytest
import torch

from rlhf.algorithms import AGGREGATIONS
from rlhf.algorithms.grpo import clipped_surrogate, group_advantages, grpo_loss, k3_kl
from rlhf.config import AlgorithmConfig


def test_group_advantages_mean_centred_and_std_scaled():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, stats = group_advantages(rewards, group_size=4, scale_by_std=True, eps=0.0 + 1e-12)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert stats["equal_reward_groups"] == 1 and stats["groups"] == 2
    assert stats["reward_mean"] == pytest.approx(0.75)


def test_group_advantages_without_std_scaling_is_centred_only():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0])
    adv, stats = group_advantages(rewards, group_size=2, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert stats["equal_reward_groups"] == 1


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def _lp(ratio):
    return torch.log(torch.tensor(ratio))


def test_clipping_positive_advantage():
    old = torch.zeros(1, 2)
    logprobs = torch.stack([_lp(1.5), _lp(0.5)]).view(1, 2).requires_grad_()
    loss, clipped = clipped_surrogate(logprobs, old, torch.tensor([1.0]), 0.2, 0.2)
    # ratio 1.5 > 1.2: clipped to 1.2 (no gradient); ratio 0.5: unclipped term 0.5 is the min
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.5]]), atol=1e-6)
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 1] == pytest.approx(-0.5)


def test_clipping_negative_advantage():
    old = torch.zeros(1, 2)
    logprobs = torch.stack([_lp(1.5), _lp(0.5)]).view(1, 2).requires_grad_()
    loss, clipped = clipped_surrogate(logprobs, old, torch.tensor([-1.0]), 0.2, 0.2)
    # A<0: ratio 1.5 keeps -1.5 (pessimistic), ratio 0.5 < 0.8 is clipped to -0.8
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8]]), atol=1e-6)
    assert clipped.tolist() == [[False, True]]
    loss.sum().backward()
    assert logprobs.grad[0, 0] == pytest.approx(1.5) and logprobs.grad[0, 1] == 0.0


def test_asymmetric_clip_range():
    loss, clipped = clipped_surrogate(_lp(1.25).view(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)
    assert not clipped.item() and loss.item() == pytest.approx(-1.25)


def test_k3_kl_values():
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    kl = k3_kl(logp, ref)
    # r = 0.25/0.5: r - log r - 1 = 0.5 + ln 2 - 1
    assert kl[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl[0, 1].item() == pytest.approx(0.0, abs=1e-7)
    assert (k3_kl(torch.randn(4, 5), torch.randn(4, 5)) >= 0).all()


def test_aggregations_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert AGGREGATIONS["token_mean"](values, mask, 4.0, 2.0).item() == pytest.approx(2.5)
    assert AGGREGATIONS["sequence_mean"](values, mask, 4.0, 2.0).item() == pytest.approx(3.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_padding_is_masked_out(aggregation):
    cfg = AlgorithmConfig(aggregation=aggregation, kl_coef=0.1)
    torch.manual_seed(0)
    lp, old, ref = torch.randn(3, 4) - 2, torch.randn(3, 4) - 2, torch.randn(3, 4) - 2
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1.0]])
    n_tok, n_seq = mask.sum().item(), 3.0
    base, m1 = grpo_loss(lp, old, ref, adv, mask, cfg, n_tok, n_seq)
    # garbage in every masked position must not change loss or metrics
    junk = (1 - mask) * 7.0
    loss2, m2 = grpo_loss(lp + junk, old - junk, ref + junk, adv, mask, cfg, n_tok, n_seq)
    assert loss2.item() == pytest.approx(base.item(), rel=1e-6)
    assert m1["kl"] == pytest.approx(m2["kl"]) and m1["clip_fraction"] == pytest.approx(m2["clip_fraction"])
    assert m1["response_length"] == pytest.approx(2.0)


def test_grpo_loss_on_policy_equals_minus_mean_advantage_and_metrics_have_no_grad():
    cfg = AlgorithmConfig(kl_coef=0.0)
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = grpo_loss(lp, lp.detach(), None, torch.tensor([2.0, -1.0]), mask, cfg, 5.0, 2.0)
    # ratio 1 everywhere: loss = -(2*2 + (-1)*3) / 5 tokens
    assert loss.item() == pytest.approx(-(4 - 3) / 5)
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in metrics.values())


def test_micro_batch_losses_add_up_to_the_whole():
    cfg = AlgorithmConfig(kl_coef=0.05)
    torch.manual_seed(1)
    lp, old, ref = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    adv, mask = torch.randn(4), (torch.rand(4, 5) > 0.3).float()
    n_tok, n_seq = mask.sum().item(), 4.0
    whole, _ = grpo_loss(lp, old, ref, adv, mask, cfg, n_tok, n_seq)
    parts = sum(grpo_loss(lp[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, n_tok, n_seq)[0]
                for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-5)
