"""The model's forward passes: the prefill over the left-padded prompts (common prefixes once) and one decode
step over the distinct sequences of the rows still computed."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlhf.rollout.engine.kernels import _apply_norm, _norm_linear, _residual_linear, _rotate_, gated


class Forward:
    """Prefill and decode step (a part of RolloutEngine)."""

    def _prefill(self, ids: torch.Tensor, valid: torch.Tensor | None, fused: list, rope: torch.Tensor,
                 store: Any, share: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Causal pass over left-padded prompts ids (Bp, P); valid (Bp, P) marks the real tokens (None: no pads).
        Hands each layer's rotated keys and values, (Bp, P, 2Hkv, D), to store(layer, kv). Returns the
        last position's logits (Bp, V): past its keys and values, the last layer runs that position only.

        share = (first, expand) from `prefix_plan`: the flat rows (of Bp*P) of the u distinct prefixes, and each
        row's prefix among them. Projections and MLP run on the u rows; their q/k/v go to every row for the
        cache and the attention, which runs over the padded layout as without sharing."""
        top = fused[-1]
        Bp, P = ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if valid is None:
            turn, mask = rope[:P], None  # (P, H + 2Hkv, D/2)
            if share is not None:
                turn = turn.index_select(0, share[0] % P)  # (u, H + 2Hkv, D/2)
        else:
            at = (valid.long().cumsum(1) - 1).clamp(min=0)  # (Bp, P) each token's position
            turn = rope[at] if share is None else rope[at.view(-1)[share[0]]]  # (Bp, P or u, H + 2Hkv, D/2)
            # a query sees earlier real tokens and always itself (a pad row must not softmax over nothing)
            causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
            mask = ((causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids.device)[None])
            mask = mask[:, None]  # (Bp, 1, P, P)
        flat = ids.view(-1) if share is None else ids.view(-1).index_select(0, share[0])
        h = F.embedding(flat, top["embed"])  # (Bp*P or u, C): 2-D rows, so the residual matmuls are addmm
        r = h.shape[0]
        lead = (Bp, P) if share is None else (r,)  # the rows' shape, as `turn` broadcasts over them
        last = len(fused) - 2
        for layer, f in enumerate(fused[:-1]):
            qkv = _norm_linear(f["norm_in"], h, f["qkv_w"], f["qkv_b"])  # (r, (H + 2Hkv) D)
            qkv = _rotate_(qkv.view(*lead, H + 2 * Hkv, D // 2, 2), turn)
            if share is not None:
                qkv = qkv.view(r, -1).index_select(0, share[1])  # (Bp*P, (H + 2Hkv) D): each row its prefix's
            qkv = qkv.view(Bp, P, H + 2 * Hkv, D)
            store(layer, qkv.narrow(2, H, 2 * Hkv))
            q, k, v = qkv.transpose(1, 2).split((H, Hkv, Hkv), dim=1)  # (Bp, heads, P, D)
            rows, causal = P, mask is None
            if layer == last:  # the logits need the last position only: its query, attention output and MLP
                q, rows, causal = q.narrow(2, P - 1, 1), 1, False  # the last query sees every key but pads
                mask = None if mask is None else mask.narrow(2, P - 1, 1)
                h = h.view(Bp, P, -1)[:, -1] if share is None else \
                    h.index_select(0, share[1].view(Bp, P)[:, -1])  # (Bp, C)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=1.0,
                                                 enable_gqa=H != Hkv)  # (Bp, H, rows, D); q carries the scale
            out = out.transpose(1, 2).reshape(Bp * rows, H * D)
            if share is not None and layer != last:
                out = out.index_select(0, share[0])  # (u, H*D)
            h = _residual_linear(h, out, f["o_wt"], f["o_b"])
            h = _residual_linear(h, gated(f, h), f["down_wt"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h), top["lm_w"], top["lm_b"]).float()  # (Bp, V)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, t: int | torch.Tensor,
                     idx: torch.Tensor | None,
                     state: dict[str, Any]) -> torch.Tensor:
        """One token for rows idx (all rows when None): tokens, positions (b,). Writes slot t. Returns (b, V).
        With state["share"] = (expand, at), tokens and positions are the u distinct sequences of the rows idx:
        expand gives each row of idx its sequence (u rows, in order), `at` the u rows' places in the layout.
        Their q/k/v are expanded to every row of idx for the cache write and attention, and the step goes on
        with the u rows' attention outputs: it returns (u, V)."""
        fused = state["fused"]
        top = fused[-1]
        H, Hkv, D, b = self.num_heads, self.num_kv_heads, self.head_dim, tokens.shape[0]
        turn = state["rope"].index_select(0, positions)  # (b, H + 2Hkv, D/2)
        attend = self._attend_block if state["block"] else self._attend_grouped
        share = state["share"]
        at = share[1] if share is not None else idx  # layout places of the rows the step goes on with (None: all)
        if isinstance(t, torch.Tensor):  # CUDA graph: the slot is a device scalar, so one graph serves every t
            state["slot"] = t * state["n"] + state["slot_base"] if state["block"] else t
        if state["block"]:  # the columns every layer's attention reads (static: all, the future masked), its mask
            W = state["cache"][0].shape[3] if state["static"] else state["P"] + (int(t) + 1) * state["n"]
            state["width"] = (W, state["bias"].narrow(-1, 0, W))
        h = F.embedding(tokens, top["embed"])  # (b, C)
        for f, cache in zip(fused, state["cache"]):
            qkv = _norm_linear(f["norm_in"], h, f["qkv_w"], f["qkv_b"])  # (b, (H + 2Hkv) D)
            # q (scaled) and k rotated, v as it was
            qkv = _rotate_(qkv.view(b, H + 2 * Hkv, D // 2, 2), turn).view(b, H + 2 * Hkv, D)
            if share is not None:
                qkv = qkv.index_select(0, share[0])  # (rows of idx, H + 2Hkv, D): each its sequence's
            out = attend(qkv.narrow(1, 0, H), qkv.narrow(1, H, 2 * Hkv), t, idx, cache, state)  # (B, H*D)
            if at is not None:
                out = out.index_select(0, at)  # (b or u, H*D): the rows the step goes on with
            h = _residual_linear(h, out, f["o_wt"], f["o_b"])
            h = _residual_linear(h, gated(f, h), f["down_wt"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h), top["lm_w"], top["lm_b"]).float()  # (b, V)
