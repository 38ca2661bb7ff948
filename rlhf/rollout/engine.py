"""The native rollout engine: batched sampling over a static KV cache, groups sharing their prompt.

It runs a Llama-family causal LM (Llama, Mistral, Qwen2: RMSNorm, RoPE, GQA, SwiGLU, optional
q/k/v bias, tied or untied LM head) with its own decode loop over the Hugging Face module
weights: the norms, activation and rotary tables are the HF modules' own; q/k/v and gate/up are
fused into single matmuls (cached until a weight changes). Its interface is the one the rollout
server exposes, with sglang's field names:

    engine.generate(input_ids=[[...], ...],
                    sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                                     "top_k": -1, "stop_token_ids": [...], "n": 8},
                    return_logprob=True)
    -> [{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
         "completion_tokens", "output_token_logprobs", "weight_version"}}, ...]

How one call runs, for Bp prompts x n samples (B = Bp*n rows, a GRPO group's rows adjacent):

1. **Prefill once per prompt** (not per sample): one batched causal pass over the Bp left-padded
   prompts. Their keys/values stay in `prompt_kv`, (Bp, Hkv, D, P) / (Bp, Hkv, P, D) per layer, never
   copied: the n samples of a prompt read the same tensor.
2. **Decode** into a preallocated cache of the generated tokens only, (Bp, Hkv, n, M, D) per
   layer. Queries are laid out (Bp, Hkv, n*rep, D) — the rep = H/Hkv query heads of a KV head
   side by side — so one matmul scores every sample of a group against its shared prompt keys,
   and grouped-query attention needs no head repetition. Scores over prompt and generated keys
   go through one softmax.
3. **Finished rows** stop costing matmuls without any cache copy: when the rows still running
   fall to half of those computed, the hidden-state path (projections, MLP, LM head, sampling)
   is cut to the running rows by an index, while the caches keep their layout. On CUDA graphs
   (`static=True`) every row runs every step, so shapes never change.
4. **Sampling** normalises once (log-softmax of the temperature-scaled logits: the logprob we
   return, the same quantity the train engine computes) and draws with the Gumbel-max trick
   (argmax of logprobs + Gumbel noise from the engine's generator: one uniform draw per entry), top-k/top-p applied as
   masks. Tokens and logprobs go to (B, M) device buffers; one host transfer at the end.

With `n` > 1 each prompt's n samples are adjacent in the output (a GRPO group). `output_ids`
include the matched stop token, because the policy must learn to stop; `text` does not (sglang
trims the stop token from text too). Stop tokens are the request's `stop_token_ids` plus the
engine's (the model config's and generation config's EOS ids and the tokenizer's EOS: see
`rlhf.models.stop_token_ids`) unless `ignore_eos`.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlhf.models import pad_token_id
from rlhf.models import stop_token_ids as model_stop_ids
from rlhf.weights import checksum, export_state, import_state, load_state_dir

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
RELAYOUT = 4  # copy the running rows' caches into a dense layout once they are at most 1/RELAYOUT of the layout


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
             "between 0 and max_new_tokens")] if not ok]
        if problems:
            raise ValueError("sampling_params out of range: " + "; ".join(problems))
        return sp


def sample_tokens(
    logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None, top: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits: (B, V) float32. Returns (tokens (B,), logprobs (B,)), and with
    top > 0 also the `top` most likely tokens' logprobs and ids, (B, top) each.

    One normalisation over the vocabulary (log_softmax); sampling is argmax(logprobs + Gumbel),
    which draws from softmax(logprobs) without a second softmax or a multinomial.
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
    uniform = torch.rand(filtered.shape, generator=generator, device=filtered.device)  # (B, V) in [0, 1)
    tokens = (filtered - uniform.log_().neg_().log_()).argmax(dim=-1)  # Gumbel-max: -log(-log u) ~ Gumbel(0, 1)
    return _with_top(tokens, logprobs, top)


def _with_top(tokens: torch.Tensor, logprobs: torch.Tensor, top: int) -> Any:
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if top <= 0:
        return tokens, chosen
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (B, top)
    return tokens, chosen, values, ids


class StepControl:
    """What a caller may do between decode steps: the rollout server's abort, pause, stop strings and streaming.

    `step` runs after every decode step on the engine's thread (it may block: a pause in place). It returns the
    rows that finish with this step's token, each with its finish reason (sglang's: {"type": "abort", ...} or
    {"type": "stop", "matched": "<stop string>"}). Rows are a call's output rows, prompt-major (prompt i's n
    samples are rows i*n .. i*n+n-1).
    """

    wants_tokens = False  # pass each step's new tokens to `step` (one host transfer a step)

    def step(self, t: int, rows: list[int] | None, tokens: list[int] | None) -> dict[int, dict[str, Any]]:
        return {}


def _norm(module: Any) -> tuple[Any, ...]:
    """A layer norm as data: ("rms", weight, eps) for the RMSNorm of the supported models (one fused op; HF's
    module is 7 kernels), else ("module", module) to call as it is."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or getattr(module, "weight", None) is None:
        return ("module", module)
    return ("rms", module.weight, float(eps))


def _residual_linear(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """h + x @ weight.T (+ bias): one addmm for the decode step's 2-D rows."""
    if bias is None and h.dim() == 2:
        return torch.addmm(h, x, weight.t())
    return h + F.linear(x, weight, bias)


def _apply_norm(norm: tuple[Any, ...], x: torch.Tensor) -> torch.Tensor:
    if norm[0] == "rms":
        return F.rms_norm(x, (x.shape[-1],), norm[1], norm[2])
    return norm[1](x)


class RolloutEngine:
    """Generates completions for token-id prompts; holds the policy weights and their version."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, seed: int = 0,
                 stop_token_ids: list[int] | None = None) -> None:
        model_type = getattr(model.config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"native rollout engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, got {model_type!r}; "
                "use an sglang rollout server for other architectures"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = "0"
        self.lock = threading.Lock()  # one generate or weight load at a time
        cfg = model.config
        ids = stop_token_ids if stop_token_ids is not None else model_stop_ids(model, tokenizer)
        self.stop_ids = list(dict.fromkeys(int(i) for i in ids))  # ordered: the first is what SFT teaches
        self.eos_token_id = self.stop_ids[0] if self.stop_ids else None
        self.pad_token_id = pad_token_id(model, tokenizer)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.tokens_generated = 0
        self.compact = os.environ.get("RLHF_ROLLOUT_COMPACT", "1") != "0"
        self._fused: tuple[tuple[int, ...], list[dict[str, Any]]] | None = None
        self._rope_cache: tuple[tuple[torch.dtype, float], tuple[torch.Tensor, torch.Tensor]] | None = None

    def drop_caches(self) -> None:
        """Free what the engine keeps between calls on its device (fused weights, rotary tables); rebuilt on use."""
        self._fused = None
        self._rope_cache = None

    # ------------------------------------------------------------------ weights

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy named parameters (as produced by rlhf.weights.export_state) into the model."""

        with self.lock:
            import_state(self.model, tensors)
            self.weight_version = str(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load an HF model directory's *.safetensors (or, in a checkpoint slot, its model.safetensors)."""


        single = os.path.join(model_path, "model.safetensors")
        if os.path.exists(os.path.join(model_path, "meta.json")) or os.path.exists(os.path.join(model_path, "optimizer.json")):
            tensors = load_file(single)  # a checkpoint slot: the model file only
        else:
            tensors = load_state_dir(model_path)
        self.update_weights_from_tensors(tensors, weight_version)

    def weights_checksum(self, algorithm: str = "sha256") -> str:
        return checksum(export_state(self.model), algorithm)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        control: StepControl | None = None,
        detokenize: bool = True,
    ) -> list[dict[str, Any]]:
        """top_logprobs_num: also return each step's most likely tokens (meta_info output_top_logprobs);
        control: abort, pause, stop strings, streaming between steps; detokenize=False leaves `text` empty."""
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params)
        if not input_ids or any(len(p) == 0 for p in input_ids):
            raise ValueError("generate: every prompt needs at least one token")
        with self.lock, torch.inference_mode():
            out_tokens, out_logprobs, finish, tops = self._decode([list(p) for p in input_ids], sp,
                                                                  top=top_logprobs_num if return_logprob else 0,
                                                                  control=control)
            version = self.weight_version
        prompts = [p for p in input_ids for _ in range(sp.n)]  # groups adjacent
        results = []
        for row, (prompt, toks, lps, fin) in enumerate(zip(prompts, out_tokens, out_logprobs, finish)):
            meta: dict[str, Any] = {
                "finish_reason": fin,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(toks),
                "weight_version": version,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, toks)]
                if tops is not None:
                    meta["output_top_logprobs"] = [[[v, i, None] for v, i in zip(vals, ids)] for vals, ids in tops[row]]
            text = ""
            if self.tokenizer is not None and detokenize:
                trim = fin["type"] == "stop" and isinstance(fin.get("matched"), int)  # a stop token, not a stop string
                text = self.tokenizer.decode(toks[:-1] if trim else toks, skip_special_tokens=True)
            results.append({"text": text, "output_ids": toks, "meta_info": meta})
        self.tokens_generated += sum(len(t) for t in out_tokens)
        return results

    def _fused_layers(self) -> list[dict[str, Any]]:
        """Per layer: q/k/v and gate/up weights concatenated, so each is one matmul, and every other
        weight the decode loop reads, as plain tensors (no module call per op).

        Cached, and rebuilt when any parameter changed in place (its `_version` counter), so weight
        updates and a model shared with a trainer (the SFT warm start) are always seen. The last
        entry holds the model-level weights (embedding, final norm, LM head).
        """
        key = tuple(p._version for p in self.model.parameters())
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1]
        body = self.model.model
        silu = getattr(self.model.config, "hidden_act", "silu") in ("silu", "swish")
        fused: list[dict[str, Any]] = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            has_bias = all(m.bias is not None for m in qkv)
            fused.append({
                "qkv_w": torch.cat([m.weight for m in qkv]),  # (Hq*D + 2*Hkv*D, C)
                "qkv_b": torch.cat([m.bias for m in qkv]) if has_bias else None,
                "q_dim": attn.q_proj.out_features,
                "kv_dim": attn.k_proj.out_features,
                "o_w": attn.o_proj.weight, "o_b": attn.o_proj.bias,
                "gate_up_w": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),  # (2*F, C)
                "down_w": mlp.down_proj.weight, "down_b": mlp.down_proj.bias,
                "act": None if silu else mlp.act_fn,  # None: SiLU, applied in place
                "ffn": mlp.gate_proj.out_features,
                "norm_in": _norm(layer.input_layernorm),
                "norm_post": _norm(layer.post_attention_layernorm),
                "scale": float(getattr(attn, "scaling", self.head_dim ** -0.5)),
            })
        head = self.model.lm_head
        fused.append({"embed": body.embed_tokens.weight, "norm": _norm(body.norm), "lm_w": head.weight,
                      "lm_b": head.bias})
        self._fused = (key, fused)
        return fused

    def _rope_table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (length, D) for positions 0..length-1, from the model's own rotary module."""
        positions = torch.arange(length, device=self.device)[None]  # (1, L)
        probe = torch.empty(1, length, 1, device=self.device, dtype=dtype)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0], sin[0]  # (L, D) each

    def _rope_tables(self, length: int, dtype: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rope_qk` for positions 0..length-1, kept between calls where the frequencies do not depend on
        the sequence's length (default, linear and llama3 RoPE): a call reads the first `length` rows."""
        if getattr(self.model.model.rotary_emb, "rope_type", None) not in ("default", "linear", "llama3"):
            return self._rope_qk(self._rope_table(length, dtype), scale)  # e.g. dynamic NTK: per call
        cached = self._rope_cache
        if cached is None or cached[0] != (dtype, scale) or cached[1][0].shape[0] < length:
            cached = self._rope_cache = ((dtype, scale), self._rope_qk(self._rope_table(length, dtype), scale))
        cos, sin = cached[1]
        return cos[:length], sin[:length]

    def _rope_qk(self, rope: tuple, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for q and k heads side by side, (L, H + Hkv, D) each: a layer rotates its q and k
        in one pass as x*cos + roll(x, D/2)*sin (rotate_half folded into the sign of sin); q's rows carry
        the attention scale, so the scores need no multiply."""
        cos, sin = rope
        D, H, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        sign = torch.ones(D, device=cos.device, dtype=cos.dtype)
        sign[: D // 2] = -1
        sin = sin * sign
        L = cos.shape[0]
        cos_qk = torch.cat([(cos * scale)[:, None].expand(L, H, D), cos[:, None].expand(L, Hkv, D)], dim=1)
        sin_qk = torch.cat([(sin * scale)[:, None].expand(L, H, D), sin[:, None].expand(L, Hkv, D)], dim=1)
        return cos_qk.contiguous(), sin_qk.contiguous()

    def _prefill(self, ids: torch.Tensor, valid: torch.Tensor, fused: list, rope_qk: tuple
                 ) -> tuple[torch.Tensor, list]:
        """Causal pass over left-padded prompts ids (Bp, P). Returns last-position logits (Bp, V), per-layer (k, v)."""
        top = fused[-1]
        Bp, P = ids.shape
        H, Hkv, D, half = self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim // 2
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (Bp, P)
        cos, sin = rope_qk[0][positions], rope_qk[1][positions]  # (Bp, P, H + Hkv, D), q rows scaled
        # a query sees earlier real tokens and always itself (a pad row must not softmax over nothing)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids.device)[None]
        gqa = H != Hkv
        h = F.embedding(ids, top["embed"])  # (Bp, P, C)
        prompt_kv = []
        for f in fused[:-1]:
            qkv = F.linear(_apply_norm(f["norm_in"], h), f["qkv_w"], f["qkv_b"])  # (Bp, P, (H + 2Hkv) D)
            qk = qkv[..., :f["q_dim"] + f["kv_dim"]].view(Bp, P, H + Hkv, D)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # (Bp, P, H + Hkv, D)
            q, k = qk.transpose(1, 2).split((H, Hkv), dim=1)  # (Bp, H, P, D), (Bp, Hkv, P, D)
            v = qkv[..., f["q_dim"] + f["kv_dim"]:].view(Bp, P, Hkv, D).transpose(1, 2).contiguous()
            prompt_kv.append((k.transpose(-1, -2).contiguous(), v))  # keys as (Bp, Hkv, D, P): the scores' matmul
            # reads them contiguous
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=1.0,
                                                 enable_gqa=gqa)  # (Bp, H, P, D); q carries the scale
            h = _residual_linear(h, out.transpose(1, 2).reshape(Bp, P, -1), f["o_w"], f["o_b"])
            h = _residual_linear(h, self._gated(f, _apply_norm(f["norm_post"], h)), f["down_w"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h[:, -1]), top["lm_w"], top["lm_b"]).float(), prompt_kv  # (Bp, V)

    @staticmethod
    def _gated(f: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        """The MLP's act(gate) * up, (..., F); the down projection is the caller's residual matmul."""
        gate, up = F.linear(x, f["gate_up_w"]).split(f["ffn"], dim=-1)  # (..., F) each: views of one buffer
        if f["act"] is None:  # SiLU, in place on the matmul's own buffer
            return F.silu(gate, inplace=True).mul_(up)
        return f["act"](gate) * up

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, t: int | torch.Tensor,
                     idx: torch.Tensor | None,
                     state: dict[str, Any]) -> torch.Tensor:
        """One token for rows idx (all rows when None): tokens, positions (b,). Writes slot t. Returns (b, V)."""
        fused = state["fused"]
        top = fused[-1]
        Bp, n, B, rep = state["Bp"], state["n"], state["B"], self.num_heads // self.num_kv_heads
        H, Hkv, D, b = self.num_heads, self.num_kv_heads, self.head_dim, tokens.shape[0]
        cos, sin = state["rope_qk"][0][positions], state["rope_qk"][1][positions]  # (b, H + Hkv, D)
        half = D // 2
        S = state["M"] if state["static"] else int(t) + 1  # generated slots attended to (masked beyond t if static)
        pbias, gbias = state["pbias"], state["gbias"]  # (Bp*Hkv, 1, P); static only: (1, 1, M)
        graph = isinstance(t, torch.Tensor)  # CUDA graph: the slot is a device scalar, so one graph serves every t
        G = Bp * Hkv  # attention runs as batched matmuls over (group, KV head) and (group, KV head, sample)
        h = F.embedding(tokens, top["embed"])  # (b, C)
        for f, (kp, vp), (kg, vg) in zip(fused, state["prompt_kv"], state["gen_kv"]):
            qkv = F.linear(_apply_norm(f["norm_in"], h), f["qkv_w"], f["qkv_b"])  # (b, (H + 2Hkv) D)
            qk_dim = f["q_dim"] + f["kv_dim"]
            qk = qkv.narrow(1, 0, qk_dim).view(b, H + Hkv, D)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # (b, H + Hkv, D), q scaled
            q, k = qk.split((H, Hkv), dim=1)
            v = qkv.narrow(1, qk_dim, f["kv_dim"]).view(b, Hkv, D)
            if graph:
                kg.index_copy_(3, t, k.view(Bp, n, Hkv, 1, D).transpose(1, 2))
                vg.index_copy_(3, t, v.view(Bp, n, Hkv, 1, D).transpose(1, 2))
                q_all = q
            elif idx is None:  # cache layout (Bp, Hkv, n, M, D): row r = g*n + j is [g, :, j]
                kg.select(3, t).copy_(k.view(Bp, n, Hkv, D).transpose(1, 2))
                vg.select(3, t).copy_(v.view(Bp, n, Hkv, D).transpose(1, 2))
                q_all = q
            else:
                g_idx, j_idx = state["g_idx"], state["j_idx"]
                kg[g_idx, :, j_idx, t] = k
                vg[g_idx, :, j_idx, t] = v
                q_all = q.new_zeros(B, H, D).index_copy_(0, idx, q)
            qg = q_all.view(Bp, n, Hkv, rep, D).transpose(1, 2).contiguous()  # (Bp, Hkv, n, rep, D)
            scores_p = torch.bmm(qg.view(G, n * rep, D), kp.view(G, D, -1)).add_(pbias)  # (G, n*rep, P), pads -inf
            P = scores_p.shape[-1]
            q_s = qg.view(G * n, rep, D)
            k_s = kg.narrow(3, 0, S).view(G * n, S, D).transpose(1, 2)  # (G*n, D, S)
            scores_g = torch.bmm(q_s, k_s)  # (G*n, rep, S)
            if gbias is not None:
                scores_g.add_(gbias)  # static shapes: slots after t are -inf
            scores = torch.cat([scores_p.view(G * n, rep, P), scores_g], dim=-1)  # q carries the scale
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # (G*n, rep, P+S): one softmax
            if probs.dtype != qg.dtype:
                probs = probs.to(qg.dtype)
            out = torch.bmm(probs.narrow(-1, 0, P).view(G, n * rep, P), vp.view(G, P, D))  # (G, n*rep, D)
            out = out.view(G * n, rep, D).add_(torch.bmm(probs.narrow(-1, P, S),
                                                         vg.narrow(3, 0, S).view(G * n, S, D)))  # (G*n, rep, D)
            out = out.view(Bp, Hkv, n, rep, D).transpose(1, 2).reshape(B, H * D)  # (B, H*D)
            if idx is not None:
                out = out.index_select(0, idx)  # (b, H*D)
            h = _residual_linear(h, out, f["o_w"], f["o_b"])
            h = _residual_linear(h, self._gated(f, _apply_norm(f["norm_post"], h)), f["down_w"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h), top["lm_w"], top["lm_b"]).float()  # (b, V)

    @staticmethod
    def _relayout(state: dict[str, Any], places: torch.Tensor) -> None:
        """Keep only the cache rows at `places` (flat layout rows), each its own group (n = 1)."""
        n = state["n"]
        g, j = places // n, places % n
        state["prompt_kv"] = [(k[g], v[g]) for k, v in state["prompt_kv"]]  # (b, Hkv, D, P), (b, Hkv, P, D)
        state["gen_kv"] = [(k[g, :, j].unsqueeze(2), v[g, :, j].unsqueeze(2)) for k, v in state["gen_kv"]]
        Hkv, P = state["prompt_kv"][0][1].shape[1], state["pbias"].shape[-1]
        state["pbias"] = state["pbias"].view(-1, Hkv, 1, P)[g].view(-1, 1, P)
        state["Bp"], state["n"], state["B"] = places.shape[0], 1, places.shape[0]

    def _capture(self, state: dict[str, Any]) -> Any:
        """Capture one decode step of this call's shapes as a CUDA graph; returns a replay function.

        Inputs live in static buffers (tokens, positions, the slot index); the cache write uses the slot
        as a device tensor and the attention covers every slot with future ones masked by `bias`, so one
        graph serves every step. Sampling stays outside (the engine's generator).
        """
        B = state["B"]
        buf_tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        buf_pos = torch.zeros(B, dtype=torch.long, device=self.device)
        buf_t = torch.zeros(1, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy init); slot 0 is rewritten at t=0
            for _ in range(2):
                self._decode_step(buf_tokens, buf_pos, buf_t, None, state)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._decode_step(buf_tokens, buf_pos, buf_t, None, state)

        def replay(tokens: torch.Tensor, positions: torch.Tensor, t: int) -> torch.Tensor:
            buf_tokens.copy_(tokens)
            buf_pos.copy_(positions)
            buf_t.fill_(t)
            graph.replay()
            return out

        return replay

    def prompt_logprobs(self, prompts: list[list[int]], start: int = 0, top: int = 0) -> list[dict[str, list]]:
        """Each prompt's token logprobs under the model from position `start` (sglang's logprob_start_len):
        {"input_token_logprobs": [[lp, id, None], ...]} (the first token of a prompt has lp None), and with
        top > 0 "input_top_logprobs" (None at the first token)."""
        out = []
        with self.lock, torch.inference_mode():
            for p in prompts:  # one at a time: prompt logprobs are a side path (no padding to get right)
                ids = torch.tensor([p], device=self.device)
                logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)  # (P, V)
                chosen = [None] + logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1).tolist()
                entry: dict[str, list] = {"input_token_logprobs": [[lp, t, None] for lp, t in
                                                                   list(zip(chosen, p))[start:]]}
                if top > 0:
                    values, idx = logp[:-1].topk(min(top, logp.shape[-1]), dim=-1)
                    rows = [None] + [[[v, i, None] for v, i in zip(vs, js)] for vs, js in zip(values.tolist(),
                                                                                               idx.tolist())]
                    entry["input_top_logprobs"] = rows[start:]
                out.append(entry)
        return out

    def _decode(self, prompts: list[list[int]], sp: SamplingParams, static: bool | None = None, top: int = 0,
                control: StepControl | None = None):
        device, dtype = self.device, next(self.model.parameters()).dtype
        if static is None:  # CUDA: static shapes and a captured decode step (RLHF_CUDA_GRAPHS=0 turns it off)
            static = device.type == "cuda" and os.environ.get("RLHF_CUDA_GRAPHS", "1") != "0"
        Bp, n, M = len(prompts), sp.n, sp.max_new_tokens
        B, P = Bp * n, max(len(p) for p in prompts)
        ids = torch.full((Bp, P), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((Bp, P), dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column P-1
            ids[i, P - len(p):] = torch.tensor(p)
            valid[i, P - len(p):] = True
        ids, valid = ids.to(device), valid.to(device)
        fused = self._fused_layers()
        scales = {f["scale"] for f in fused[:-1]}
        if len(scales) != 1:
            raise NotImplementedError(f"native rollout engine: attention scale differs between layers ({sorted(scales)})")
        rope_qk = self._rope_tables(P + M, dtype, scales.pop())
        logits, prompt_kv = self._prefill(ids, valid, fused, rope_qk)  # (Bp, V)
        Hkv, D = self.num_kv_heads, self.head_dim
        # eager decode writes slot t of every row it reads before reading it (a row cut from the hidden path
        # reads its unwritten slot, but its output is dropped): no zero fill; static mode masks unwritten slots
        # with -inf, which needs finite memory behind them
        alloc = torch.zeros if static else torch.empty
        gen_kv = [(alloc(Bp, Hkv, n, M, D, device=device, dtype=dtype),
                   alloc(Bp, Hkv, n, M, D, device=device, dtype=dtype)) for _ in prompt_kv]
        # additive biases: pads of the prompt keys masked, per (group, KV head); in static mode also the
        # generated slots, -inf until their step (eager decode reads only the written ones)
        pbias = torch.zeros(Bp, Hkv, 1, P, device=device, dtype=dtype)
        pbias.masked_fill_(~valid[:, None, None, :], float("-inf"))
        gbias = torch.full((1, 1, M), float("-inf"), device=device, dtype=dtype) if static else None
        state = {"fused": fused, "rope_qk": rope_qk, "prompt_kv": prompt_kv, "gen_kv": gen_kv,
                 "Bp": Bp, "n": n, "B": B, "M": M, "static": static,
                 "pbias": pbias.view(Bp * Hkv, 1, P), "gbias": gbias}
        replay = self._capture(state) if static and device.type == "cuda" and M > 1 else None
        positions = valid.sum(1).repeat_interleave(n)  # (B,) position of each row's first generated token
        logits = logits.repeat_interleave(n, 0)  # (B, V): the n samples of a prompt start from its logits
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.stop_ids))
        stop_tensor = torch.tensor(sorted(stops), device=device) if stops else None
        out_tokens = torch.zeros(B, M, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(B, M, dtype=torch.float32, device=device)
        stop_at = torch.full((B,), M + 1, dtype=torch.long, device=device)  # length incl. the stop token; M+1: running
        rows: torch.Tensor | None = None  # original rows being computed (None: all)
        idx: torch.Tensor | None = None  # their places in the cache layout (None: all of it)
        layout_pos = torch.arange(B, device=device)  # place of each original row in the cache layout
        generator = self.generator if sp.sampling_seed is None else \
            torch.Generator(device=device).manual_seed(int(sp.sampling_seed))
        out_top = (torch.zeros(B, M, top, dtype=torch.float32, device=device),
                   torch.zeros(B, M, top, dtype=torch.long, device=device)) if top > 0 else None
        reasons: dict[int, dict[str, Any]] = {}  # rows the control finished, with its finish reason
        for t in range(M):
            if stop_tensor is not None and t < sp.min_new_tokens:
                logits = logits.index_fill(1, stop_tensor, float("-inf"))  # no stop before min_new_tokens
            drawn = sample_tokens(logits, sp, generator, top)
            tokens, logprobs = drawn[0], drawn[1]  # (b,), (b,)
            if rows is None:
                out_tokens[:, t], out_logprobs[:, t] = tokens, logprobs
            else:
                out_tokens[rows, t], out_logprobs[rows, t] = tokens, logprobs
            if out_top is not None:
                where = slice(None) if rows is None else rows
                out_top[0][where, t], out_top[1][where, t] = drawn[2], drawn[3]
            if stop_tensor is not None:
                sub = stop_at if rows is None else stop_at[rows]
                sub = torch.where(torch.isin(tokens, stop_tensor) & (sub > M), t + 1, sub)
                if rows is None:
                    stop_at = sub
                else:
                    stop_at[rows] = sub
            if control is not None:
                listed = (list(range(B)) if rows is None else rows.tolist()) if control.wants_tokens else None
                finished = control.step(t, listed, tokens.tolist() if control.wants_tokens else None)
                running_host = (stop_at > M).tolist() if finished else []
                ended = [r for r in finished if running_host[r]]
                if ended:
                    reasons.update((r, finished[r]) for r in ended)
                    stop_at[torch.tensor(ended, device=device)] = t + 1
                    if stop_tensor is None:
                        stop_tensor = torch.tensor([-1], device=device)  # rows can end now: track them (no id is -1)
            if t == M - 1:
                break
            if stop_tensor is not None and static and t % 16 == 15 and not bool((stop_at > M).any()):
                break  # static shapes: every row computes every step; look for the end only now and then
            if stop_tensor is not None and not static:
                running = stop_at > M  # (B,)
                alive = int(running.sum())
                if alive == 0:
                    break
                computed = B if rows is None else rows.shape[0]
                if self.compact and alive <= computed // 2:
                    rows = running.nonzero().squeeze(1)  # (b,)
                    idx = layout_pos[rows]
                    if alive * RELAYOUT <= state["B"]:  # few left: copy just their caches into a dense layout
                        self._relayout(state, idx)
                        positions = positions[idx]
                        layout_pos = torch.full((B,), -1, dtype=torch.long, device=device)
                        layout_pos[rows] = torch.arange(alive, device=device)
                        idx = None
                    else:  # cut only the hidden-state path; the caches keep their layout
                        state["g_idx"], state["j_idx"] = idx // state["n"], idx % state["n"]
                    tokens = out_tokens[rows, t]
            if static:
                gbias[..., t] = 0  # slot t holds a key from this step on
            pos = (positions if idx is None else positions[idx]) + t
            if replay is not None:
                logits = replay(tokens, pos, t)
            else:
                logits = self._decode_step(tokens, pos, t, idx, state)
        lengths = torch.minimum(stop_at, torch.full_like(stop_at, M))
        tokens_host, logprobs_host = out_tokens.tolist(), out_logprobs.tolist()  # one transfer at the end
        lengths_host, stopped = lengths.tolist(), (stop_at <= M).tolist()
        out_t, out_l, finish = [], [], []
        for r in range(B):
            L = lengths_host[r]
            out_t.append(tokens_host[r][:L])
            out_l.append(logprobs_host[r][:L])
            finish.append(reasons[r] if r in reasons else {"type": "stop", "matched": tokens_host[r][L - 1]}
                          if stopped[r] else {"type": "length", "length": M})
        tops = None
        if out_top is not None:
            values, ids = out_top[0].tolist(), out_top[1].tolist()
            tops = [list(zip(values[r][:lengths_host[r]], ids[r][:lengths_host[r]])) for r in range(B)]
        return out_t, out_l, finish, tops
