"""Supervised fine-tuning loss: mean negative log-likelihood of the answer tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
    """logprobs, mask: (B, T). Normalised by the batch's token count so micro-batches add up."""
    loss = -(logprobs * mask).sum() / max(num_tokens, 1.0)
    return loss, {"tokens": mask.detach().sum().item()}
