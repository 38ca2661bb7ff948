"""The native rollout engine: batched sampling over a static KV cache, groups sharing their prompt.

It runs a Llama-family causal LM (Llama, Mistral, Qwen2: RMSNorm, RoPE, GQA, SwiGLU, optional
q/k/v bias, tied or untied LM head) with its own decode loop over the Hugging Face module
weights, kept as plain tensors (cached until a weight changes): q/k/v and gate/up fused into
single matmuls, each q/k head's rows reordered so rotary pairs sit side by side (RoPE is one
complex multiply over q, k and v, v's factor 1), and in float32 the RMSNorm weights folded into
the matmul after them. The rotary tables are the HF module's own. Its interface is the one the
rollout server exposes, with sglang's field names:

    engine.generate(input_ids=[[...], ...],
                    sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                                     "top_k": -1, "stop_token_ids": [...], "n": 8},
                    return_logprob=True)
    -> [{"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
         "completion_tokens", "cached_tokens", "output_token_logprobs", "weight_version"}}, ...]

How one call runs, for Bp prompts x n samples (B = Bp*n rows, a GRPO group's rows adjacent):

1. **Prefill once per prompt** (not per sample): one batched causal pass over the Bp left-padded
   prompts. Their keys/values are stored once per prompt, never copied per sample. Prompts that begin
   alike (a chat template, the same prompt passed twice) have their common prefix computed once
   (`prefix_plan`; its q/k/v go to every prompt's rows), and past its keys/values the last layer runs
   the last position only, the one whose logits start the samples.
2. **Decode** into a cache preallocated for the call, in one of two layouts (RLHF_ROLLOUT_LAYOUT=
   auto|block|grouped; auto: block while n x max_new_tokens <= BLOCK_COLUMNS, or n = 1):
   - *block*: (2, Bp, Hkv, P + M*n, D) per layer, a group's prompt keys/values then its samples'
     generated ones, slot-major. The n*rep queries of a (group, KV head) score all its columns
     in one matmul, an additive mask keeps each query to the prompt and its own sample, one
     softmax, one matmul for the values: few, larger kernels, right for GRPO's short answers.
   - *grouped*: the prompt's keys (Bp, Hkv, D, P) and values (Bp, Hkv, P, D), and the generated
     ones per sample, (2, Bp, Hkv, n, M, D); a query reads only its own sample's slots (long
     generations), the prompt part scored for all n samples in one matmul, one softmax over both.
   Queries are laid out (group, KV head, n*rep) — the rep = H/Hkv query heads of a KV head side
   by side — so grouped-query attention needs no head repetition.
3. **Samples that drew the same tokens** share their computation: rows of one prompt (a group's samples, or
   the same prompt passed twice) that have generated the same tokens so far hold the same state, so a decode
   step runs the projections, MLP and LM head once per distinct sequence; its q/k/v go to each of its rows
   for the cache write and the attention (which runs over the layout as before), its logits to each row for
   sampling. With a confident policy most of a group draws the same first tokens
   (a warmed GRPO policy on the default task: 64 rows are 15 distinct sequences at the first step, 29 at the
   second). Rows that share get their sequence's numbers bit for bit; computed apart, such rows differ in the
   last bits (the block layout's attention adds each sample's own column at a different place), so sharing
   moves a run's rounding, not its distribution. Rows that have finished all go with one sequence (their
   tokens are never read). RLHF_ROLLOUT_SHARE=0 computes every row, in the prefill too. Not on CUDA graphs
   (static shapes).
4. **Finished rows** stop costing matmuls without any cache copy: when the rows still running
   fall to half of those computed, the hidden-state path (projections, MLP, LM head, sampling)
   is cut to the running rows by an index, while the caches keep their layout. On CUDA graphs
   (`static=True`) every row runs every step, so shapes never change.
5. **Sampling** normalises once (log-softmax of the temperature-scaled logits: the logprob we
   return, the same quantity the train engine computes) and inverts the CDF at one uniform draw
   per row from the engine's generator; top-k/top-p/min-p applied as masks. Tokens and logprobs
   go to (B, M) device buffers; one host transfer at the end.

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
BLOCK_COLUMNS = 128  # the block cache layout while a group's n samples x max_new_tokens generated slots fit this
LAYOUTS = ("auto", "block", "grouped")  # RLHF_ROLLOUT_LAYOUT: auto picks by BLOCK_COLUMNS
RELAYOUT = 4  # copy the running rows' caches into a dense layout once they are at most 1/RELAYOUT of the layout
# A decode step runs each distinct sequence of a group once (RLHF_ROLLOUT_SHARE=0: every row) when the distinct ones
# are at most SHARE_AT of the rows it computes (below that the gathers and scatters cost more than the rows saved)
SHARE_AT = 0.75
# the prefill runs each distinct prefix of the prompts once (a common template, the same prompt twice) when they are at
# most PREFILL_SHARE_AT of its rows
PREFILL_SHARE_AT = 0.9


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


def prefix_plan(prompts: list[list[int]], P: int) -> tuple[list[int], list[int], list[int]]:
    """Which rows of a prefill hold the same state. The prompts are left-padded to P columns, flat row i*P + c.
    A row's state is set by its prompt's tokens from the first one up to its column (positions count from a
    prompt's first token, so a common prefix is common at any padding); every pad row holds the same state (it
    sees only itself). Returns (the first row of each distinct state, in row order; each row's state, an index
    into them; per prompt, how many of its tokens an earlier prompt holds: the length of its longest common
    prefix with one). Equal prompts have equal states throughout."""
    firsts: list[int] = []
    state_of: dict[Any, int] = {}  # (previous state, token), or -1 for a pad -> state
    expand: list[int] = []
    shared: list[int] = []
    for i, p in enumerate(prompts):
        pad, prev = P - len(p), -1
        shared.append(0)
        for c in range(P):
            key = -1 if c < pad else (prev, p[c - pad])
            k = state_of.get(key)
            if k is None:
                k = state_of[key] = len(firsts)
                firsts.append(i * P + c)
            elif c >= pad:  # a token's state seen before: an earlier prompt's (a prompt's own states all differ)
                shared[i] += 1
            expand.append(k)
            if c >= pad:
                prev = k
    return firsts, expand, shared


def _with_top(tokens: torch.Tensor, logprobs: torch.Tensor, top: int) -> Any:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
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
        self._params = list(model.parameters())  # listing them walks every module: once, not per call
        self.device, self.dtype = self._params[0].device, self._params[0].dtype
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
        self.share = os.environ.get("RLHF_ROLLOUT_SHARE", "1") != "0"  # see SHARE_AT
        self.layout = os.environ.get("RLHF_ROLLOUT_LAYOUT", "auto")  # the generated cache's: see `_decode`
        if self.layout not in LAYOUTS:
            raise ValueError(f"RLHF_ROLLOUT_LAYOUT={self.layout!r}; choose one of: {', '.join(LAYOUTS)}")
        self._bias: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last no-pads block mask
        self._fused: tuple[tuple[int, ...], list[dict[str, Any]]] | None = None
        self._rope_cache: tuple[tuple[torch.dtype, float], tuple[torch.Tensor, torch.Tensor]] | None = None

    def drop_caches(self) -> None:
        """Free what the engine keeps between calls on its device (fused weights, rotary tables); rebuilt on use.
        Also call it after replacing the model's parameter objects (in-place updates are seen without it)."""
        self._fused = None
        self._rope_cache = None
        self._bias = None
        self._params = list(self.model.parameters())

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
            out_tokens, out_logprobs, finish, tops, cached = self._decode(
                [list(p) for p in input_ids], sp, top=top_logprobs_num if return_logprob else 0, control=control)
            version = self.weight_version
        prompts = [p for p in input_ids for _ in range(sp.n)]  # groups adjacent
        results = []
        for row, (prompt, toks, lps, fin) in enumerate(zip(prompts, out_tokens, out_logprobs, finish)):
            meta: dict[str, Any] = {
                "finish_reason": fin,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(toks),
                # prompt tokens whose prefill this row did not pay for: a group's later samples read all of
                # it, a prompt's first sample the prefix an earlier prompt of the call computed (as sglang's
                # radix cache would count it)
                "cached_tokens": len(prompt) if row % sp.n else cached[row // sp.n],
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
            h = _residual_linear(h, self._gated(f, h), f["down_wt"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h), top["lm_w"], top["lm_b"]).float()  # (Bp, V)

    @staticmethod
    def _gated(f: dict[str, Any], h: torch.Tensor) -> torch.Tensor:
        """The MLP's act(gate) * up of the normed h, (..., F); the down projection is the caller's residual matmul."""
        both, width = _norm_linear(f["norm_post"], h, f["gate_up_w"], None), f["ffn"]
        gate, up = both.narrow(-1, 0, width), both.narrow(-1, width, width)  # views of one buffer
        if f["act"] is None:  # SiLU, in place on the matmul's own buffer
            return F.silu(gate, inplace=True).mul_(up)
        return f["act"](gate) * up

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
            h = _residual_linear(h, self._gated(f, h), f["down_wt"], f["down_b"])
        return F.linear(_apply_norm(top["norm"], h), top["lm_w"], top["lm_b"]).float()  # (b, V)

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
        W, bias = state["width"]
        k, v = kv.narrow(3, 0, W).unbind(0)  # (Bp, Hkv, W, D) each
        out = F.scaled_dot_product_attention(  # q carries the scale; query head h reads KV head h // (H / Hkv)
            q.view(Bp, n, H, D).transpose(1, 2), k, v, attn_mask=bias, scale=1.0, enable_gqa=H != Hkv)  # (Bp, H, n, D)
        return out.transpose(1, 2).reshape(B, H * D)

    def _attend_grouped(self, q: torch.Tensor, new_kv: torch.Tensor, t: int | torch.Tensor,
                        idx: torch.Tensor | None, cache: tuple, state: dict[str, Any]) -> torch.Tensor:
        """Attention in the grouped layout, for long generations: a group's prompt keys kp (Bp, Hkv, D, P) and
        values vp (Bp, Hkv, P, D) read once for its n samples; each sample's generated keys/values in kv_g
        (2, Bp, Hkv, n, M, D), so a query reads only its own. Scores over both go through one softmax. Returns
        every layout row's output, (B, H*D)."""
        kp, vp, kv_g = cache
        Bp, n, B = state["Bp"], state["n"], state["B"]
        H, Hkv, D, rep = self.num_heads, self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        G = Bp * Hkv
        S = state["M"] if state["static"] else int(t) + 1  # generated slots read (masked beyond t if static)
        if isinstance(t, torch.Tensor):
            kv_g.index_copy_(4, t, new_kv.view(Bp, n, 2, Hkv, 1, D).permute(2, 0, 3, 1, 4, 5))
        elif idx is None:
            kv_g.select(4, t).copy_(new_kv.view(Bp, n, 2, Hkv, D).permute(2, 0, 3, 1, 4))
        else:
            kv_g[:, state["g_idx"], :, state["j_idx"], t] = new_kv.view(-1, 2, Hkv, D)
            q = q.new_zeros(B, H, D).index_copy_(0, idx, q)
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
        side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside capture (allocator, lazy init); slot 0 is rewritten at t=0
                self._decode_step(buf_tokens, buf_pos, buf_t, None, state)
            torch.cuda.synchronize(self.device)
            # capture_begin/end rather than torch.cuda.graph, which also empties the allocator's and the pinned
            # host cache at every capture (and in some torch versions runs gc.collect): on an H200 with the 110 M
            # model at 512 x 128 a call's capture took 17-22 ms this way against 20-26 ms
            graph.capture_begin()
            try:
                out = self._decode_step(buf_tokens, buf_pos, buf_t, None, state)
            finally:
                graph.capture_end()
        main.wait_stream(side)

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
        device, dtype = self.device, self.dtype
        if static is None:  # CUDA: static shapes and a captured decode step (RLHF_CUDA_GRAPHS=0 turns it off)
            static = device.type == "cuda" and os.environ.get("RLHF_CUDA_GRAPHS", "1") != "0"
        Bp, n, M = len(prompts), sp.n, sp.max_new_tokens
        lengths = [len(p) for p in prompts]
        B, P = Bp * n, max(lengths)
        if min(lengths) == P:  # no pads: no masks anywhere
            ids, valid = torch.tensor(prompts, device=device), None
        else:
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
        rope = self._rope_tables(P + M, dtype, scales.pop())  # (P + M, H + 2Hkv, D/2)
        Hkv, D = self.num_kv_heads, self.head_dim
        # the block layout while a group's generated columns are few (every query scores all of them: one
        # matmul, one softmax); the grouped layout for long generations (a query reads only its own sample's)
        block = self.layout == "block" or self.layout == "auto" and (n == 1 or n * M <= BLOCK_COLUMNS)
        # eager decode writes slot t of every row it reads before reading it (a row cut from the hidden path
        # reads its unwritten slot, but its output is dropped): no zero fill; static mode masks unwritten slots
        # with -inf, which needs finite memory behind them
        alloc = torch.zeros if static else torch.empty
        pad_bias = None  # (Bp, 1, 1, P): the prompt's pads -inf
        if valid is not None:
            pad_bias = torch.zeros(Bp, 1, 1, P, device=device, dtype=dtype)
            pad_bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
        cache: list[Any] = []
        if block:
            cache = [alloc(2, Bp, Hkv, P + M * n, D, device=device, dtype=dtype) for _ in fused[:-1]]

            def store(layer: int, kv: torch.Tensor) -> None:  # kv (Bp, P, 2Hkv, D)
                cache[layer].narrow(3, 0, P).copy_(kv.view(Bp, P, 2, Hkv, D).permute(2, 0, 3, 1, 4))

            if pad_bias is None and not static:  # read-only: kept for the next call of the same shape
                if self._bias is None or self._bias[0] != (n, P, M):
                    self._bias = ((n, P, M), self._block_bias(None, n, P, M, static=False))
                bias = self._bias[1]
            else:
                bias = self._block_bias(pad_bias, n, P, M, static)
        else:
            def store(layer: int, kv: torch.Tensor) -> None:  # keys as (Bp, Hkv, D, P): the scores' matmul reads
                # them contiguous
                cache.append((kv[:, :, :Hkv].permute(0, 2, 3, 1).contiguous(), kv[:, :, Hkv:].transpose(1, 2).contiguous(),
                              alloc(2, Bp, Hkv, n, M, D, device=device, dtype=dtype)))

            bias = torch.full((1, 1, M), float("-inf"), device=device, dtype=dtype) if static else None
        # per original row, a label of its sequence so far: rows with one label (the same prompt, the same tokens)
        # hold the same state. Labels compare only among the rows computed together at a step
        seq, plan = None, None
        cached = [0] * Bp  # each prompt's tokens whose prefill an earlier prompt of the call computed
        if self.share and not static:
            firsts, expand, shared = prefix_plan(prompts, P)
            if len(firsts) <= PREFILL_SHARE_AT * Bp * P:  # the prefill runs each distinct prefix once
                plan = (torch.tensor(firsts, device=device), torch.tensor(expand, device=device))
                cached = shared
            same = expand[P - 1::P]  # each prompt's state at its last token: equal for equal prompts
            if n > 1 or len(set(same)) < Bp:  # else no two rows can share
                seq = torch.tensor(same, device=device).repeat_interleave(n)
        logits = self._prefill(ids, valid, fused, rope, store, plan)  # (Bp, V)
        state = {"fused": fused, "rope": rope, "cache": cache, "block": block, "Bp": Bp, "n": n, "B": B, "P": P,
                 "M": M, "static": static, "pad_bias": pad_bias, "bias": bias, "share": None,
                 "slot_base": P + torch.arange(n, device=device)}
        replay = self._capture(state) if static and device.type == "cuda" and M > 1 else None
        if static and block:  # what slot t's n columns get once written: each query row its own sample's
            own = self._block_bias(None, n, 0, 1, static=False)  # (1, 1, n, n)
        positions = (torch.full((B,), P, device=device) if valid is None else
                     valid.sum(1).repeat_interleave(n))  # (B,) position of each row's first generated token
        logits = logits.repeat_interleave(n, 0)  # (B, V): the n samples of a prompt start from its logits
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.stop_ids))
        # is_stop[token]: one gather a step (torch.isin sorts and searches); an id past the vocabulary is never drawn
        is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        is_stop[[i for i in stops if i < logits.shape[-1]]] = True
        tracking = bool(stops)  # rows can end before max_new_tokens: look for the end
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
            if stops and t < sp.min_new_tokens:
                logits = logits.masked_fill(is_stop, float("-inf"))  # no stop before min_new_tokens
            drawn = sample_tokens(logits, sp, generator, top)
            tokens, logprobs = drawn[0], drawn[1]  # (b,), (b,)
            if rows is None:
                out_tokens[:, t], out_logprobs[:, t] = tokens, logprobs
            else:
                out_tokens[rows, t], out_logprobs[rows, t] = tokens, logprobs
            if out_top is not None:
                where = slice(None) if rows is None else rows
                out_top[0][where, t], out_top[1][where, t] = drawn[2], drawn[3]
            if stops:
                sub = stop_at if rows is None else stop_at[rows]  # rows: a copy
                sub.masked_fill_(is_stop.index_select(0, tokens) & (sub > M), t + 1)
                if rows is not None:
                    stop_at[rows] = sub
            if control is not None:
                listed = (list(range(B)) if rows is None else rows.tolist()) if control.wants_tokens else None
                finished = control.step(t, listed, tokens.tolist() if control.wants_tokens else None)
                running_host = (stop_at > M).tolist() if finished else []
                ended = [r for r in finished if running_host[r]]
                if ended:
                    reasons.update((r, finished[r]) for r in ended)
                    stop_at[torch.tensor(ended, device=device)] = t + 1
                    tracking = True
            if t == M - 1:
                break
            if tracking and static and t % 16 == 15 and not bool((stop_at > M).any()):
                break  # static shapes: every row computes every step; look for the end only now and then
            if tracking and not static:
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
                        if state["block"]:  # the rows left out no longer write their columns, which their
                            # group's other queries read (masked): from slot t on they must hold finite values
                            n_ = state["n"]
                            for kv in state["cache"]:
                                kv.narrow(3, P + t * n_, (M - t) * n_).zero_()
                    tokens = out_tokens[rows, t]
            if static:  # slot t holds a key from this step on
                if block:
                    state["bias"].narrow(-1, P + t * n, n).copy_(own)
                else:
                    state["bias"][..., t] = 0
            pos = (positions if idx is None else positions[idx]) + t
            expand = None
            if seq is not None:  # the distinct sequences among the rows computed: each once
                labels = seq if rows is None else seq[rows]  # (b,)
                key = tokens.add(labels, alpha=logits.shape[-1])  # label * V + token, >= 0
                if tracking:  # finished rows are never read again: all of them go with one sequence, -1
                    key = key.masked_fill_(~(running if rows is None else running[rows]), -1)
                distinct, label = torch.unique(key, return_inverse=True)
                if rows is None:
                    seq = label
                else:
                    seq[rows] = label
                b, u = label.shape[0], distinct.shape[0]
                state["share"] = None
                if u <= SHARE_AT * b:
                    first = torch.full((u,), b, device=device).scatter_reduce_(
                        0, label, torch.arange(b, device=device), "amin")  # (u,) a row of each sequence
                    expand = label
                    state["share"] = (label, first if idx is None else idx[first])
                    tokens, pos = tokens.index_select(0, first), pos.index_select(0, first)
            if replay is not None:
                logits = replay(tokens, pos, t)
            else:
                logits = self._decode_step(tokens, pos, t, idx, state)
            if expand is not None:
                logits = logits.index_select(0, expand)  # (b, V): each row its sequence's
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
        return out_t, out_l, finish, tops, cached
