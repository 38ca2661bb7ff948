"""The model's weights as the decode loop reads them: q/k/v and gate/up fused, rotary pairs side by side,
norms folded; the rotary tables. Cached until a weight changes."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhf.rollout.engine.kernels import _norm


class FusedWeights:
    """The engine's fused weights and rotary tables (a part of RolloutEngine)."""

    def _fused_layers(self) -> list[dict[str, Any]]:
        """Per layer: q/k/v and gate/up weights concatenated, so each is one matmul, and every other
        weight the decode loop reads, as plain tensors (no module call per op).

        Cached, and rebuilt when any parameter changed in place (its `_version` counter), so weight
        updates and a model shared with a trainer (the SFT warm start) are always seen. The last
        entry holds the model-level weights (embedding, final norm, LM head).

        In float32/float64 the RMSNorm weights before the q/k/v and gate/up matmuls are folded into their
        rows (linear(x * r * g, W) = r * linear(x, W * g), r the row's 1/rms): the norm costs a row scale.
        """
        key = tuple(p._version for p in self._params)
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1]
        body = self.model.model
        silu = getattr(self.model.config, "hidden_act", "silu") in ("silu", "swish")
        D = self.head_dim
        # HF rotates dim i with dim i + D/2; reordering each q/k head's rows to (0, D/2, 1, D/2+1, ...) puts
        # every rotary pair side by side, so a rotation is one complex multiply. q and k get the same order:
        # their dot products, hence the attention, are unchanged
        pairs = torch.arange(D, device=self.device).view(2, D // 2).t().reshape(-1)

        def paired(t: torch.Tensor, heads: int) -> torch.Tensor:
            return t.view(heads, D, *t.shape[1:])[:, pairs].reshape(t.shape)

        fold = self.dtype in (torch.float32, torch.float64)

        def root(norm: tuple[Any, ...]) -> torch.Tensor:  # sqrt(C * eps) of an RMSNorm over C features
            return torch.tensor(math.sqrt(norm[1].shape[0] * norm[2]), device=self.device, dtype=self.dtype)

        def folded(norm: tuple[Any, ...], weight: torch.Tensor) -> tuple[tuple[Any, ...], torch.Tensor]:
            if not fold or norm[0] != "rms":
                return norm, weight
            return ("folded", root(norm)), weight * (norm[1] * math.sqrt(weight.shape[1]))

        fused: list[dict[str, Any]] = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            heads = (self.num_heads, self.num_kv_heads)
            has_bias = all(m.bias is not None for m in qkv)
            norm_in, qkv_w = folded(_norm(layer.input_layernorm), torch.cat(
                [paired(m.weight, h) for m, h in zip(qkv[:2], heads)] + [attn.v_proj.weight]))
            norm_post, gate_up_w = folded(_norm(layer.post_attention_layernorm),
                                          torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))  # (2*F, C)
            fused.append({
                "qkv_w": qkv_w,
                "qkv_b": torch.cat([paired(m.bias, h) for m, h in zip(qkv[:2], heads)] + [attn.v_proj.bias])
                if has_bias else None,  # (H*D + 2*Hkv*D, C), (H*D + 2*Hkv*D,)
                "q_dim": attn.q_proj.out_features,
                "kv_dim": attn.k_proj.out_features,
                "o_wt": attn.o_proj.weight.t(), "o_b": attn.o_proj.bias,  # transposed: views, for addmm
                "gate_up_w": gate_up_w,
                "down_wt": mlp.down_proj.weight.t(), "down_b": mlp.down_proj.bias,
                "act": None if silu else mlp.act_fn,  # None: SiLU, applied in place
                "ffn": mlp.gate_proj.out_features,
                "norm_in": norm_in,
                "norm_post": norm_post,
                "scale": float(getattr(attn, "scaling", self.head_dim ** -0.5)),
            })
        head, top_norm = self.model.lm_head, _norm(body.norm)
        if fold and top_norm[0] == "rms":  # not folded into the LM head: that would copy a vocabulary-sized matrix
            top_norm = ("scaled", top_norm[1] * math.sqrt(top_norm[1].shape[0]), root(top_norm))
        fused.append({"embed": body.embed_tokens.weight, "norm": top_norm, "lm_w": head.weight, "lm_b": head.bias})
        self._fused = (key, fused)
        return fused

    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (length, D) for positions 0..length-1, from the model's own rotary module, in float32."""
        positions = torch.arange(length, device=self.device)[None]  # (1, L)
        probe = torch.empty(1, length, 1, device=self.device, dtype=torch.float32)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0], sin[0]  # (L, D) each

    def _rope_tables(self, length: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
        """`_rope_qkv` for positions 0..length-1, kept between calls where the frequencies do not depend on
        the sequence's length (default, linear and llama3 RoPE): a call reads the first `length` rows."""
        if getattr(self.model.model.rotary_emb, "rope_type", None) not in ("default", "linear", "llama3"):
            return self._rope_qkv(self._rope_table(length), dtype, scale)  # e.g. dynamic NTK: per call
        cached = self._rope_cache
        if cached is None or cached[0] != (dtype, scale) or cached[1].shape[0] < length:
            cached = self._rope_cache = ((dtype, scale), self._rope_qkv(self._rope_table(length), dtype, scale))
        return cached[1][:length]

    def _rope_qkv(self, rope: tuple, dtype: torch.dtype, scale: float) -> torch.Tensor:
        """The rotation of every head of a fused q/k/v row, (L, H + 2Hkv, D/2) complex: cos + i sin per rotary
        pair for k, times the attention scale for q (the scores need no multiply), 1 for v (left as it is,
        so q, k and v come out of one multiply and k, v go to the cache in one copy)."""
        cos, sin = rope
        H, Hkv, half = self.num_heads, self.num_kv_heads, self.head_dim // 2
        ctype = torch.complex128 if dtype == torch.float64 else torch.complex64
        turn = torch.complex(cos[:, :half], sin[:, :half]).to(ctype)  # (L, D/2): HF's cos/sin repeat per half
        L = turn.shape[0]
        return torch.cat([(turn * scale)[:, None].expand(L, H, half), turn[:, None].expand(L, Hkv, half),
                          torch.ones(L, Hkv, half, dtype=ctype, device=turn.device)], dim=1).contiguous()
