"""Sampling: sglang's sampling parameters, and one token per row from the logits by an inverse CDF."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class SamplingParams:
    """sglang's sampling parameters (the subset RL uses), with sglang's defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    min_new_tokens: int = 0  # stop tokens cannot be drawn before this many tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely one's
    sampling_seed: int | None = None  # this call draws from its own generator, seeded so

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; valid: {sorted(known)}")
        if "stop_token_ids" in params:
            params["stop_token_ids"] = tuple(params["stop_token_ids"] or ())
        sp = cls(**params)
        problems = [f"{name} {value!r} ({rule})" for name, value, ok, rule in [
            ("max_new_tokens", sp.max_new_tokens, sp.max_new_tokens >= 1, "at least 1"),
            ("n", sp.n, sp.n >= 1, "at least 1"),
            ("temperature", sp.temperature, sp.temperature >= 0, "at least 0"),
            ("top_p", sp.top_p, 0 < sp.top_p <= 1, "in (0, 1]"),
            ("top_k", sp.top_k, sp.top_k == -1 or sp.top_k >= 1, "-1 (all) or at least 1"),
            ("min_p", sp.min_p, 0 <= sp.min_p <= 1, "in [0, 1]"),
            ("min_new_tokens", sp.min_new_tokens, 0 <= sp.min_new_tokens <= sp.max_new_tokens,
             "between 0 and max_new_tokens"),
            ("stop_token_ids", list(sp.stop_token_ids), all(isinstance(i, int) and i >= 0 for i in sp.stop_token_ids),
             "token ids, integers >= 0")] if not ok]
        if problems:
            raise ValueError("sampling_params out of range: " + "; ".join(problems))
        return sp


def sample_tokens(
    logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None, top: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits: (B, V) float32. Returns (tokens (B,), logprobs (B,)), and with
    top > 0 also the `top` most likely tokens' logprobs and ids, (B, top) each.

    One normalisation over the vocabulary (log_softmax); sampling inverts the CDF of exp(logprobs) at one
    uniform draw per row (a draw per vocabulary entry, as Gumbel-max or torch.multinomial take, costs more
    than the rest of a step on a 32 k vocabulary on CPU).
    """
    if sp.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logits.argmax(dim=-1)  # (B,)
        return _with_top(tokens, logprobs, top)
    logprobs = torch.log_softmax(logits if sp.temperature == 1 else logits / sp.temperature, dim=-1)  # (B, V)
    filtered = logprobs
    if sp.min_p > 0:
        floor = logprobs.max(dim=-1, keepdim=True).values + math.log(sp.min_p)  # (B, 1)
        filtered = filtered.masked_fill(filtered < floor, float("-inf"))
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, sp.top_k, dim=-1).values[:, -1:]  # (B, 1)
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)  # (B, V)
        probs = sorted_lp.exp()
        drop_sorted = probs.cumsum(dim=-1) - probs > sp.top_p  # the top token always stays
        filtered = filtered.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    uniform = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device)  # (B, 1) in [0, 1)
    return _with_top(inverse_cdf(filtered.exp(), uniform), logprobs, top)


CDF_BLOCK = 256  # inverse_cdf's block of the vocabulary, in two levels from 8 blocks (2048 tokens) on


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of weights (B, V) >= 0, the token where the cumulative weight first reaches (1 - u) x the row's
    total, u (B, 1) in [0, 1): a draw from the normalised weights. Returns (B,) token ids.

    point = (1 - u) * total lies in (0, total], so the first cumulative entry >= point always belongs to a
    token with weight (a masked or underflowed token adds 0 and never starts a step of the CDF). A NaN row (a
    diverged policy) finds no entry: the clamp gives it a token whose logprob is NaN, which the train engine
    reports.

    From 2048 tokens on, in two levels: the running totals of blocks of CDF_BLOCK tokens pick the block, and a
    cumulative sum over that block alone the token. A cumulative sum is a sequential scan per row: over a
    32 k vocabulary it was most of a sampling step (64 rows: 1.0 ms against 0.16 ms this way, 512 rows: 25 ms
    against 1.3 ms, on a 2-core CPU). The same token as one scan but for rounding at the edges (0.08 % of
    draws on random rows); a point that rounding puts outside its block is clamped into the block's weighted
    tokens."""
    B, V = weights.shape
    K = CDF_BLOCK
    if V < 8 * K:
        cdf = weights.cumsum(dim=-1)  # (B, V), nondecreasing
        point = torch.rsub(uniform, 1.0).mul_(cdf.narrow(1, V - 1, 1))
        return torch.searchsorted(cdf, point).squeeze(1).clamp_(max=V - 1)
    C = -(-V // K)
    blocks = (weights if C * K == V else F.pad(weights, (0, C * K - V))).view(B, C, K)
    totals = blocks.sum(dim=-1)  # (B, C)
    upto = totals.cumsum(dim=-1)  # (B, C), nondecreasing
    point = torch.rsub(uniform, 1.0).mul_(upto[:, -1:])  # (B, 1)
    c = torch.searchsorted(upto, point).clamp_(max=C - 1)  # (B, 1): upto[c - 1] < point <= upto[c], so totals[c] > 0
    inner = blocks.gather(1, c.unsqueeze(2).expand(B, 1, K)).squeeze(1).cumsum_(dim=-1)  # (B, K)
    rest = point - (upto.gather(1, c) - totals.gather(1, c))  # (B, 1): what is left of the point inside block c
    rest = torch.minimum(rest.clamp_(min=torch.finfo(weights.dtype).tiny), inner[:, -1:])  # in (0, block's total]
    return (c * K + torch.searchsorted(inner, rest)).squeeze(1).clamp_(max=V - 1)


def _with_top(tokens: torch.Tensor, logprobs: torch.Tensor, top: int) -> Any:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if top <= 0:
        return tokens, chosen
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (B, top)
    return tokens, chosen, values, ids
