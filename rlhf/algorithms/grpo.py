"""GRPO — Group Relative Policy Optimization (Shao et al., 2024, "DeepSeekMath") — the math.

Pure functions on tensors; no model, no I/O. Shapes: B samples (prompts × group size),
T token positions. `mask` is 1.0 on response tokens and 0.0 on prompt and padding, and every
per-token tensor is aligned so that position t holds the quantity for token t of the sample.

    A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)            group_advantages
    ratio_t  = exp(logp_t - logp_old_t)
    L_pg,t   = -min(ratio_t * A_i, clip(ratio_t, 1-eps_lo, 1+eps_hi) * A_i)   clipped_surrogate
    KL_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                 k3_kl (Schulman's k3)
    L        = aggregate(L_pg,t + beta * KL_t over response tokens)       grpo_loss

Where this departs from the paper, on purpose:
  * Aggregation defaults to `token_mean` — one mean over every response token of the
    mini-batch (DAPO, Dr. GRPO) — instead of the paper's mean per sequence then over
    sequences (`sequence_mean`, still available). Long and short answers then weigh per token.
  * The std is the unbiased sample std of the group (as TRL computes it); `scale_by_std=False`
    drops the division (Dr. GRPO), which removes the bias towards easy/hard groups.
  * The ratio's denominator is the rollout engine's logprob of the sampled token, i.e. the
    behaviour policy as the inference engine computed it (the paper's pi_old). The test
    suite checks that those equal the train engine's logprobs, or the ratio would be biased.
  * The clip range may be asymmetric (eps_lo, eps_hi), as in DAPO's clip-higher.

Groups whose rewards are all equal get zero advantage and contribute only KL; they are
counted (`equal_reward_groups`) because a run where most groups are equal learns nothing.
Metrics are computed under no_grad and returned beside the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the math uses tensor methods only: config validation reads the registry without torch
    import torch

from rlhf.algorithms.base import AGGREGATIONS, register_aggregation, register_loss

ADVANTAGE_COLUMNS = ("reward_mean", "reward_std", "equal_reward_groups")  # the stats steps.csv keeps a step


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantages. rewards: (B,) with groups contiguous, B = G * group_size."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (G, group_size)
    mean = grouped.mean(dim=1, keepdim=True)  # (G, 1)
    advantages = grouped - mean  # (G, group_size)
    if scale_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else mean.new_zeros(mean.shape)  # (G, 1)
        advantages = advantages / (std + eps)
    equal = _equal(grouped)  # (G,)
    stats = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "equal_reward_groups": int(equal.sum().item()),
        "groups": grouped.shape[0],
    }
    return advantages.reshape(-1), stats  # (B,)


def _equal(grouped: torch.Tensor) -> torch.Tensor:
    return grouped.max(dim=1).values == grouped.min(dim=1).values


def equal_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """The groups (numbers, in order) whose samples all got one reward: zero advantage, nothing to learn from."""
    return [i for i, same in enumerate(_equal(rewards.view(-1, group_size)).tolist()) if same]


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective, negated to a loss. Returns (loss (B, T), clipped (B, T) bool).

    `clipped` marks tokens where the clipped branch won the min, i.e. where the gradient is 0.
    """
    ratio = (logprobs - old_logprobs).exp()  # (B, T)
    # (B, 1): one outcome advantage for every token; (B, T) when each token's is weighted (off-policy correction)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv  # (B, T)
    return -unclipped.minimum(clipped), clipped < unclipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Unbiased, always-positive estimate of KL(pi || pi_ref) per token (B, T)."""
    log_ratio = ref_logprobs - logprobs  # (B, T)
    return log_ratio.exp() - log_ratio - 1.0


@register_aggregation("token_mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_sequences: float) -> torch.Tensor:
    """Sum over response tokens / response tokens of the whole mini-batch (all micro-batches)."""
    return (values * mask).sum() / max(num_tokens, 1.0)


@register_aggregation("sequence_mean")
def sequence_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_sequences: float) -> torch.Tensor:
    """Mean over each sequence's tokens, then sum / sequences of the whole mini-batch (the paper)."""
    per_sequence = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B,)
    return per_sequence.sum() / max(num_sequences, 1.0)


@register_loss("grpo")
def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: Any,
    num_tokens: float,
    num_sequences: float,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss of one micro-batch, normalised by the mini-batch's token/sequence counts.

    Summing this over the micro-batches of a mini-batch gives the mini-batch loss, so gradient
    accumulation is exact. `cfg` needs clip_eps_low, clip_eps_high, kl_coef, aggregation.
    """
    aggregate = AGGREGATIONS[cfg.aggregation]
    per_token, clipped = clipped_surrogate(logprobs, old_logprobs, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
    kl = k3_kl(logprobs, ref_logprobs) if (cfg.kl_coef > 0 and ref_logprobs is not None) else None
    if kl is not None:
        per_token = per_token + cfg.kl_coef * kl  # (B, T)
    loss = aggregate(per_token, mask, num_tokens, num_sequences)

    # metrics from detached tensors: no autograd graph
    mask, logprobs = mask.detach(), logprobs.detach()
    tokens = mask.sum().clamp(min=1.0)
    metrics = {
        "tokens": mask.sum().item(),
        "kl": ((kl.detach() * mask).sum() / tokens).item() if kl is not None else 0.0,
        "clip_fraction": ((clipped.float() * mask).sum() / tokens).item(),
        "ratio_mean": (((logprobs - old_logprobs.detach()).exp() * mask).sum() / tokens).item(),
        "entropy": ((entropy.detach() * mask).sum() / tokens).item() if entropy is not None else 0.0,
        "response_length": (mask.sum(dim=1).float().mean()).item(),
    }
    return loss, metrics
