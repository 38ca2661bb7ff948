"""The native rollout engine: batched sampling with a preallocated KV cache.

It runs a Llama-family causal LM (Llama, Mistral, Qwen2: RMSNorm, RoPE, GQA, SwiGLU) with
its own decode loop over the Hugging Face module weights: the norms, activation and rotary
tables are the HF modules' own; projections are fused (q/k/v, gate/up) into single matmuls,
keys and values go into one preallocated cache, the n samples of a prompt share its prefill
(prefix sharing), and finished sequences leave the batch (compaction). At equal work it is
as fast as HF generate() (both are bound by the same fp32 matmuls on CPU); on the GRPO
workload — n samples per prompt, most stopping early at EOS — it does far less work. Its interface is the
one the rollout server exposes, with sglang's field names (DESIGN.md §3):

    engine.generate(input_ids=[[...], ...],
                    sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                                     "top_k": -1, "stop_token_ids": [...], "n": 8},
                    return_logprob=True)
    -> [{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
         "completion_tokens", "output_token_logprobs", "weight_version"}}, ...]

With `n` > 1 each prompt's n samples are adjacent in the output (a GRPO group).
`output_ids` include the matched stop token (EOS), because the policy must learn to stop.
`output_token_logprobs` are [logprob, token_id, None] triples of the temperature-scaled
distribution before top-p/top-k truncation — the same quantity the train engine computes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        params = dict(params or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; valid: {sorted(known)}")
        if "stop_token_ids" in params:
            params["stop_token_ids"] = tuple(params["stop_token_ids"] or ())
        sp = cls(**params)
        if sp.max_new_tokens < 1 or sp.n < 1 or sp.temperature < 0 or not 0 < sp.top_p <= 1:
            raise ValueError(f"sampling_params out of range: {sp}")
        return sp


def sample_tokens(
    logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits: (B, V) float32. Returns (tokens (B,), logprobs (B,))."""
    if sp.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logits.argmax(dim=-1)  # (B,)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
    scaled = logits / sp.temperature  # (B, V)
    logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
    filtered = scaled
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, sp.top_k, dim=-1).values[:, -1:]  # (B, 1)
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)  # (B, V)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > sp.top_p  # keep the top token always
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)  # (B, V)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RolloutEngine:
    """Generates completions for token-id prompts; holds the policy weights and their version."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, seed: int = 0) -> None:
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
        self.eos_token_id = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else (cfg.eos_token_id or [None])[0]
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.tokens_generated = 0

    # ------------------------------------------------------------------ weights

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        """Copy named parameters (as produced by rlhf.weights.export_state) into the model."""
        from rlhf.weights import import_state

        with self.lock:
            import_state(self.model, tensors)
            self.weight_version = str(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load an HF model directory's *.safetensors (or, in a checkpoint slot, its model.safetensors)."""
        import os

        from safetensors.torch import load_file

        from rlhf.weights import load_state_dir

        single = os.path.join(model_path, "model.safetensors")
        if os.path.exists(os.path.join(model_path, "meta.json")) or os.path.exists(os.path.join(model_path, "optimizer.json")):
            tensors = load_file(single)  # a checkpoint slot: the model file only
        else:
            tensors = load_state_dir(model_path)
        self.update_weights_from_tensors(tensors, weight_version)

    def weights_checksum(self) -> str:
        from rlhf.weights import checksum, export_state

        return checksum(export_state(self.model))

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        return_logprob: bool = False,
    ) -> list[dict[str, Any]]:
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params)
        if not input_ids or any(len(p) == 0 for p in input_ids):
            raise ValueError("generate: every prompt needs at least one token")
        with self.lock, torch.inference_mode():
            out_tokens, out_logprobs, finish = self._decode([list(p) for p in input_ids], sp)
            version = self.weight_version
        prompts = [list(p) for p in input_ids for _ in range(sp.n)]  # groups adjacent
        results = []
        for prompt, toks, lps, fin in zip(prompts, out_tokens, out_logprobs, finish):
            meta: dict[str, Any] = {
                "finish_reason": fin,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(toks),
                "weight_version": version,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, toks)]
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else ""
            results.append({"text": text, "output_ids": toks, "meta_info": meta})
        self.tokens_generated += sum(len(t) for t in out_tokens)
        return results

    def _fused_layers(self) -> list[dict[str, Any]]:
        """Per layer: q/k/v and gate/up weights concatenated, so each is one matmul.

        Rebuilt at every generate() call (a copy of ~all weights, negligible next to decoding),
        so weight updates and a model shared with a trainer are always seen.
        """
        fused = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            has_bias = all(m.bias is not None for m in qkv)
            fused.append({
                "qkv_w": torch.cat([m.weight for m in qkv]),  # (Hq*D + 2*Hkv*D, C)
                "qkv_b": torch.cat([m.bias for m in qkv]) if has_bias else None,
                "q_dim": attn.q_proj.out_features,
                "kv_dim": attn.k_proj.out_features,
                "gate_up_w": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),  # (2*F, C)
                "ffn": mlp.gate_proj.out_features,
            })
        return fused

    def _attention(self, attn: Any, fused: dict[str, Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, key_mask: torch.Tensor) -> torch.Tensor:
        """One attention block writing its keys/values at cache[:, :, start:start+T]. x: (B, T, C)."""
        B, T, _ = x.shape
        qkv = F.linear(x, fused["qkv_w"], fused["qkv_b"])  # (B, T, Hq*D + 2*Hkv*D)
        q_dim, kv_dim = fused["q_dim"], fused["kv_dim"]
        q = qkv[..., :q_dim].view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = qkv[..., q_dim : q_dim + kv_dim].view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = qkv[..., q_dim + kv_dim :].view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        k_cache[:, :, start : start + T] = k
        v_cache[:, :, start : start + T] = v
        keys, values = k_cache[:, :, : start + T], v_cache[:, :, : start + T]  # (B, Hkv, S, D)
        if keys.shape[1] != q.shape[1]:  # grouped-query attention: share each KV head
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)  # (B, H, S, D)
        # softmax(q k^T * scale) v, written out. For one query token per row (decode), a broadcast
        # multiply-and-sum beats both batched tiny matmuls and the fused SDPA kernel on CPU.
        if T == 1:
            scores = (q * keys).sum(-1, keepdim=True).transpose(-1, -2) * attn.scaling  # (B, H, 1, S)
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scaling  # (B, H, T, S)
        scores = scores.masked_fill(~key_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, T, S)
        if T == 1:
            out = (probs.transpose(-1, -2) * values).sum(-2, keepdim=True)  # (B, H, 1, D)
        else:
            out = torch.matmul(probs, values)  # (B, H, T, D)
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)

    def _mlp(self, mlp: Any, fused: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, fused["gate_up_w"]).split(fused["ffn"], dim=-1)  # (B, T, F) each
        return mlp.down_proj(mlp.act_fn(gate) * up)  # (B, T, C)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, caches: list, start: int,
                 key_mask: torch.Tensor, fused: list, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Run the stack on ids (B, T) at `positions` (B, T); return last-position logits (B, V)."""
        body = self.model.model
        h = body.embed_tokens(ids)  # (B, T, C)
        cos, sin = rope[0][positions], rope[1][positions]  # (B, T, D) each
        for layer, f, (k_cache, v_cache) in zip(body.layers, fused, caches):
            h = h + self._attention(layer.self_attn, f, layer.input_layernorm(h), cos, sin, k_cache, v_cache, start,
                                    key_mask)
            h = h + self._mlp(layer.mlp, f, layer.post_attention_layernorm(h))
        h = body.norm(h[:, -1])  # (B, C)
        return self.model.lm_head(h).float()  # (B, V)

    def _decode(self, prompts: list[list[int]], sp: SamplingParams):
        device, dtype = self.device, next(self.model.parameters()).dtype
        B, P = len(prompts), max(len(p) for p in prompts)
        L = P + sp.max_new_tokens
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((B, L), dtype=torch.bool)  # which cache slots hold real tokens
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column P-1
            ids[i, P - len(p) :] = torch.tensor(p)
            valid[i, P - len(p) : P] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid[:, :P].long().cumsum(1) - 1).clamp(min=0)  # (B, P)
        n_layers = len(self.model.model.layers)
        fused = self._fused_layers()
        # cos/sin for every position this call can reach, from the model's own rotary module
        table_positions = torch.arange(L, device=device)[None]  # (1, L)
        probe = torch.empty(1, L, 1, device=device, dtype=dtype)
        cos_table, sin_table = (t[0] for t in self.model.model.rotary_emb(probe, table_positions))  # (L, D) each
        rope = (cos_table, sin_table)
        caches = [
            (torch.empty(B, self.num_kv_heads, L, self.head_dim, device=device, dtype=dtype),
             torch.empty(B, self.num_kv_heads, L, self.head_dim, device=device, dtype=dtype))
            for _ in range(n_layers)
        ]
        # Prefill: causal over the prompt, pads masked as keys; each query may always see itself
        # so a pad row never has an all-masked softmax (NaN would poison the cache).
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        prefill_mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)[None]
        logits = self._forward(ids, positions, caches, 0, prefill_mask[:, None], fused, rope)  # (B, V)
        last_pos = positions[:, -1]  # (B,)
        if sp.n > 1:
            # Prefix sharing: each prompt was prefilled once; its n samples start from copies of
            # its cache (HF generate prefills every copy). Rows i*n .. i*n+n-1 belong to prompt i.
            B = B * sp.n
            caches = [(k.repeat_interleave(sp.n, 0), v.repeat_interleave(sp.n, 0)) for k, v in caches]
            valid = valid.repeat_interleave(sp.n, 0)
            logits, last_pos = logits.repeat_interleave(sp.n, 0), last_pos.repeat_interleave(sp.n, 0)

        stops = set(sp.stop_token_ids)
        if self.eos_token_id is not None and not sp.ignore_eos:
            stops.add(self.eos_token_id)
        stop_tensor = torch.tensor(sorted(stops) or [-1], device=device)
        out_tokens: list[list[int]] = [[] for _ in range(B)]
        out_logprobs: list[list[float]] = [[] for _ in range(B)]
        finish: list[dict[str, Any]] = [{"type": "length", "length": sp.max_new_tokens} for _ in range(B)]
        rows = torch.arange(B, device=device)  # output row of each active batch row
        step_tokens, step_logprobs = [], []  # per step: (active rows, tokens, logprobs), read at the end
        for t in range(sp.max_new_tokens):
            tokens, logprobs = sample_tokens(logits, sp, self.generator)  # (b,), (b,)
            step_tokens.append((rows, tokens))
            step_logprobs.append(logprobs)
            done = torch.isin(tokens, stop_tensor)  # (b,)
            if t == sp.max_new_tokens - 1:
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                rows, tokens, last_pos, valid = rows[keep], tokens[keep], last_pos[keep], valid[keep]
                caches = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in caches]
            slot = P + t
            valid[:, slot] = True
            last_pos = last_pos + 1
            key_mask = valid[:, None, None, : slot + 1]  # (b, 1, 1, S)
            logits = self._forward(tokens[:, None], last_pos[:, None], caches, slot, key_mask, fused, rope)

        # One host transfer at the end instead of one per step.
        stop_set = stops
        for (r, tok), lp in zip(step_tokens, step_logprobs):
            for row, token, logprob in zip(r.tolist(), tok.tolist(), lp.tolist()):
                if finish[row]["type"] == "stop":
                    continue
                out_tokens[row].append(token)
                out_logprobs[row].append(logprob)
                if token in stop_set:
                    finish[row] = {"type": "stop", "matched": token}
        return out_tokens, out_logprobs, finish

