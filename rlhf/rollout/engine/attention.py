"""Attention over the KV cache in its two layouts (block, grouped), the block layout's mask, and the relayout
that keeps only the running rows' caches."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from rlhf.rollout.engine import decode_kernel

# How a decode step attends (RLHF_DECODE_ATTENTION). The block layout: "sdpa" (default), PyTorch's fused attention
# with the backend it picks for a masked call; "efficient" / "math" / "cudnn", that SDPA backend; "bmm", two batched
# matmuls around one fp32 softmax. "triton": on CUDA-graph steps (static shapes) both layouts run the Triton kernel
# of decode_kernel.py (each row reads its prompt and the slots written so far, not the whole static cache), checked
# on the device first. On an H200 (llama-110m bf16, 512 x 128 tokens) "bmm" ran at 171 k tokens/s and "sdpa" (cuDNN)
# at 187 k; on an H100 the kernel ran at 184 k (32-column tiles) against sdpa's 175-184 k: sdpa stays the default.
DECODE_ATTENTION = os.environ.get("RLHF_DECODE_ATTENTION", "sdpa")
DECODE_CHOICES = ("sdpa", "triton", "bmm", "efficient", "math", "cudnn")
if DECODE_ATTENTION not in DECODE_CHOICES:
    raise ValueError(f"RLHF_DECODE_ATTENTION={DECODE_ATTENTION!r}: valid: {', '.join(DECODE_CHOICES)}")
_KERNEL: dict[tuple, None] = {}  # configurations (layout, heads, kv heads, head dim, dtype, device) whose check passed
log = logging.getLogger("rlhf.rollout")


def use_kernel(device: torch.device, static: bool, block: bool = True, heads: int = 1, kv_heads: int = 1,
               head_dim: int = 16, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this call's decode steps attend through the Triton kernel (RLHF_DECODE_ATTENTION=triton, static
    shapes). Its first use per configuration in a process runs `decode_kernel.check` on the device (never inside a
    graph capture: calls start outside one); an unavailable or failing kernel is an error, not a silent fallback."""
    if DECODE_ATTENTION != "triton" or not static:
        return False
    if not decode_kernel.available(device):
        raise RuntimeError("RLHF_DECODE_ATTENTION=triton: needs the triton package and a CUDA device "
                           "(or TRITON_INTERPRET=1 on the CPU)")
    key = (block, heads, kv_heads, head_dim, dtype, str(device))
    if key not in _KERNEL:
        failed = decode_kernel.check(block, heads, kv_heads, head_dim, dtype, device)
        if failed is not None:
            raise RuntimeError(f"RLHF_DECODE_ATTENTION=triton: the kernel's check failed for the "
                               f"{'block' if block else 'grouped'} layout, {heads}/{kv_heads} heads of {head_dim}, "
                               f"{dtype} on {device}: {failed}")
        _KERNEL[key] = None
        log.info("decode attention: the Triton kernel passed its check on %s (%s layout, %s)", device,
                 "block" if block else "grouped", dtype)
    return True


def _sdpa_backend(name: str) -> Any:
    if name in ("sdpa", "triton"):  # the kernel's steps aside, PyTorch picks
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


class Attention:
    """A decode step's attention and its cache writes (a part of RolloutEngine)."""

    def _attend_block(self, q: torch.Tensor, new_kv: torch.Tensor, t: int | torch.Tensor, idx: torch.Tensor | None,
                      kv: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """Attention in the block layout: kv (2, Bp, Hkv, P + M*n, D) holds a group's prompt keys/values, then
        its samples' generated ones slot-major (slot s of sample j at column P + s*n + j). Each query head of a
        group scores every column in one fused attention call; `bias` (Bp or 1, 1, n, P + M*n) leaves sample j
        its prompt and its own columns. q (b, H, D), new_kv (b, 2Hkv, D): this step's rows. Returns every
        layout row's output, (B, H*D)."""
        Bp, n, B, P = state["Bp"], state["n"], state["B"], state["P"]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if isinstance(t, torch.Tensor):
            kv.index_copy_(3, state["slot"], new_kv.view(Bp, n, 2, Hkv, D).permute(2, 0, 3, 1, 4))
        elif idx is None:
            kv.narrow(3, P + t * n, n).copy_(new_kv.view(Bp, n, 2, Hkv, D).permute(2, 0, 3, 1, 4))
        else:
            kv[:, state["g_idx"], :, P + t * n + state["j_idx"]] = new_kv.view(-1, 2, Hkv, D)
            q = q.new_zeros(B, H, D).index_copy_(0, idx, q)
        if state["kernel"]:
            slot = t if isinstance(t, torch.Tensor) else torch.tensor([t], device=q.device)
            return decode_kernel.block_layout(q, kv, state["start"], slot, P, n)
        return self._fused_block(q, kv, state)

    def _fused_block(self, q: torch.Tensor, kv: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        Bp, n, B = state["Bp"], state["n"], state["B"]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        W, bias = state["width"]
        k, v = kv.narrow(3, 0, W).unbind(0)  # (Bp, Hkv, W, D) each
        if DECODE_ATTENTION == "bmm":  # query head h = kv head h // rep: (Bp, Hkv, rep*n) queries per kv head
            rep = H // Hkv
            qg = q.view(Bp, n, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(Bp, Hkv, rep * n, D)
            scores = torch.matmul(qg, k.transpose(-1, -2)).view(Bp, Hkv, rep, n, W)  # q carries the scale
            probs = torch.softmax(scores.float() + bias.unsqueeze(2), dim=-1).to(q.dtype)
            out = torch.matmul(probs.view(Bp, Hkv, rep * n, W), v)  # (Bp, Hkv, rep*n, D)
            return out.view(Bp, Hkv, rep, n, D).permute(0, 3, 1, 2, 4).reshape(B, H * D)
        with _sdpa_backend(DECODE_ATTENTION):
            out = F.scaled_dot_product_attention(  # q carries the scale; query head h reads KV head h // (H / Hkv)
                q.view(Bp, n, H, D).transpose(1, 2), k, v, attn_mask=bias, scale=1.0,
                enable_gqa=H != Hkv)  # (Bp, H, n, D)
        return out.transpose(1, 2).reshape(B, H * D)

    def _attend_grouped(self, q: torch.Tensor, new_kv: torch.Tensor, t: int | torch.Tensor,
                        idx: torch.Tensor | None, cache: tuple, state: dict[str, Any]) -> torch.Tensor:
        """Attention in the grouped layout, for long generations: a group's prompt keys kp (Bp, Hkv, D, P) and
        values vp (Bp, Hkv, P, D) read once for its n samples; each sample's generated keys/values in kv_g
        (2, Bp, Hkv, n, M, D), so a query reads only its own. Scores over both go through one softmax. Returns
        every layout row's output, (B, H*D)."""
        kv_g = cache[2]
        Bp, n, B = state["Bp"], state["n"], state["B"]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        S = state["M"] if state["static"] else int(t) + 1  # generated slots read (masked beyond t if static)
        if isinstance(t, torch.Tensor):
            kv_g.index_copy_(4, t, new_kv.view(Bp, n, 2, Hkv, 1, D).permute(2, 0, 3, 1, 4, 5))
        elif idx is None:
            kv_g.select(4, t).copy_(new_kv.view(Bp, n, 2, Hkv, D).permute(2, 0, 3, 1, 4))
        else:
            kv_g[:, state["g_idx"], :, state["j_idx"], t] = new_kv.view(-1, 2, Hkv, D)
            q = q.new_zeros(B, H, D).index_copy_(0, idx, q)
        if state["kernel"]:
            slot = t if isinstance(t, torch.Tensor) else torch.tensor([t], device=q.device)
            return decode_kernel.grouped_layout(q, cache, state["start"], slot, n)
        return self._bmm_grouped(q, cache, state, S)

    def _bmm_grouped(self, q: torch.Tensor, cache: tuple, state: dict[str, Any], S: int) -> torch.Tensor:
        kp, vp, kv_g = cache
        Bp, n, B = state["Bp"], state["n"], state["B"]
        H, Hkv, D, rep = self.num_heads, self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        G = Bp * Hkv
        qg = q.view(Bp, n, Hkv, rep, D).transpose(1, 2).contiguous()  # (Bp, Hkv, n, rep, D)
        scores_p = torch.bmm(qg.view(G, n * rep, D), kp.view(G, D, -1))  # (G, n*rep, P)
        if state["pad_bias"] is not None:
            scores_p.view(Bp, Hkv, n * rep, -1).add_(state["pad_bias"])  # pads -inf
        P = scores_p.shape[-1]
        scores_g = torch.bmm(qg.view(G * n, rep, D), kv_g[0].narrow(3, 0, S).view(G * n, S, D).transpose(1, 2))
        if state["static"]:
            scores_g.add_(state["bias"])  # (1, 1, M): slots after t are -inf
        scores = torch.cat([scores_p.view(G * n, rep, P), scores_g], dim=-1)  # (G*n, rep, P+S)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)  # one softmax; q carries the scale
        out = torch.bmm(probs.narrow(-1, 0, P).view(G, n * rep, P), vp.view(G, P, D))  # (G, n*rep, D)
        out = out.view(G * n, rep, D).add_(torch.bmm(probs.narrow(-1, P, S),
                                                     kv_g[1].narrow(3, 0, S).view(G * n, S, D)))  # (G*n, rep, D)
        out = out.view(Bp, Hkv, n, rep, D).transpose(1, 2).reshape(B, H * D)
        return out

    def _relayout(self, state: dict[str, Any], places: torch.Tensor) -> None:
        """Keep only the cache rows at `places` (flat layout rows), each its own group (n = 1)."""
        n, P, M = state["n"], state["P"], state["M"]
        g, j = places // n, places % n
        if state["pad_bias"] is not None:
            state["pad_bias"] = state["pad_bias"][g]  # (b, 1, 1, P)
        if state["block"]:  # slot s of sample j: column P + s*n + j -> P + s
            gen = [kv.narrow(3, P, M * n).unflatten(3, (M, n))[:, g, :, :, j].movedim(0, 1) for kv in state["cache"]]
            state["cache"] = [torch.cat([kv[:, g, :, :P], sel], dim=3) for kv, sel in zip(state["cache"], gen)]
            state["bias"] = self._block_bias(state["pad_bias"], 1, P, M, static=False)
        else:
            state["cache"] = [(kp[g], vp[g], torch.stack([kv_g[0][g, :, j], kv_g[1][g, :, j]]).unsqueeze(3))
                              for kp, vp, kv_g in state["cache"]]  # (2, b, Hkv, 1, M, D)
        state["Bp"], state["n"], state["B"] = places.shape[0], 1, places.shape[0]

    def _block_bias(self, pad_bias: torch.Tensor | None, n: int, P: int, M: int, static: bool) -> torch.Tensor:
        """The block layout's additive mask, (Bp or 1, 1, n, P + M*n): sample j's queries read the prompt's real
        tokens and the columns of its own sample, P + s*n + j (static: none until written)."""
        device, dtype = self.device, self.dtype
        own = (torch.arange(M * n, device=device) % n)[None] == torch.arange(n, device=device)[:, None]
        gen = torch.zeros(n, M * n, device=device, dtype=dtype)
        gen.masked_fill_(~own if not static else torch.ones_like(own), float("-inf"))  # (n, M*n)
        prompt = torch.zeros(1, 1, n, P, device=device, dtype=dtype) if pad_bias is None else \
            pad_bias.expand(-1, -1, n, P)
        return torch.cat([prompt, gen.expand(prompt.shape[0], 1, -1, -1)], dim=-1).contiguous()
