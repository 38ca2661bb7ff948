"""The few fused ops every layer runs: norms as data (folded into the next matmul in float32), a residual
matmul, the rotary multiply, the gated MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _norm(module: Any) -> tuple[Any, ...]:
    """A layer norm as data: ("rms", weight, eps) for the RMSNorm of the supported models (one fused op; HF's
    module is 7 kernels), else ("module", module) to call as it is."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or getattr(module, "weight", None) is None:
        return ("module", module)
    return ("rms", module.weight, float(eps))


def _residual_linear(h: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """h + x @ weight_t (+ bias), rows 2-D: one addmm. weight_t is the layer's weight transposed (a view)."""
    return torch.addmm(h if bias is None else h + bias, x, weight_t)


def _rotate_(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., heads, D/2, 2), contiguous, with rotary pairs side by side, in place: x's pairs
    as complex numbers times `turn` (..., heads, D/2), broadcast (see `_rope_qkv`). One multiply; bf16/fp16
    rotate in float32. Returns x."""
    if x.dtype in (torch.float32, torch.float64):
        torch.view_as_complex(x).mul_(turn)
        return x
    return x.copy_(torch.view_as_real(torch.view_as_complex(x.float()) * turn))


def _norm_linear(norm: tuple[Any, ...], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """linear(norm(x), weight, bias). A "folded" RMSNorm has its weight times sqrt(C) in `weight`'s columns:
    the matmul reads x as it is, and each row is divided by sqrt(|x|^2 + C*eps) = hypot(|x|, sqrt(C*eps)),
    which makes x * rsqrt(|x|^2 / C + eps), RMSNorm's scale."""
    if norm[0] != "folded":
        return F.linear(_apply_norm(norm, x), weight, bias)
    length = _row_length(x, norm[1])  # (..., 1)
    out = F.linear(x, weight)
    return out.div_(length) if bias is None else torch.addcdiv(bias, out, length)


def _row_length(x: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """sqrt(|x|^2 + C*eps) per row, (..., 1), with root = sqrt(C*eps): what a folded RMSNorm divides by."""
    return torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), root)


def _apply_norm(norm: tuple[Any, ...], x: torch.Tensor) -> torch.Tensor:
    if norm[0] == "rms":
        return F.rms_norm(x, (x.shape[-1],), norm[1], norm[2])
    if norm[0] == "scaled":  # ("scaled", weight * sqrt(C), sqrt(C * eps)): the folded norm's arithmetic, for a
        # norm whose weight stays out of the next matmul (four small kernels; F.rms_norm on CPU is about six)
        return x.mul(norm[1]).div_(_row_length(x, norm[2]))
    return norm[1](x)


def gated(f: dict[str, Any], h: torch.Tensor) -> torch.Tensor:
    """The MLP's act(gate) * up of the normed h, (..., F); the down projection is the caller's residual matmul."""
    both, width = _norm_linear(f["norm_post"], h, f["gate_up_w"], None), f["ffn"]
    gate, up = both.narrow(-1, 0, width), both.narrow(-1, width, width)  # views of one buffer
    if f["act"] is None:  # SiLU, in place on the matmul's own buffer
        return F.silu(gate, inplace=True).mul_(up)
    return f["act"](gate) * up
