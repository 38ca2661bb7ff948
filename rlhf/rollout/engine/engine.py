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

import os
import threading
from typing import Any

import torch

from rlhf.models import pad_token_id
from rlhf.models import stop_token_ids as model_stop_ids
from rlhf.pieces import import_pieces
from rlhf.rollout.engine.attention import Attention
from rlhf.rollout.engine.cuda_graphs import CudaGraphs
from rlhf.rollout.engine.decode import DecodeLoop
from rlhf.rollout.engine.forward import Forward
from rlhf.rollout.engine.fused import FusedWeights
from rlhf.rollout.engine.layout import LAYOUTS, StepControl
from rlhf.rollout.engine.sampling import SamplingParams
from rlhf.weights import checksum, export_state, import_state, load_model_dir

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class RolloutEngine(DecodeLoop, Forward, Attention, CudaGraphs, FusedWeights):
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
        # one generate or weight load at a time; reentrant: a call held by a pause in place loads weights on its
        # own thread (rlhf.transport.worker)
        self.lock = threading.RLock()
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

    def update_weights_from_pieces(self, shards: dict[str, tuple[dict, dict]], weight_version: str) -> None:
        """Copy the train ranks' pieces (rlhf.services.metaserver.pull_pieces) straight into the parameters' slices;
        every piece is checked to tile its parameter before the first copy (rlhf.weights.import_pieces)."""
        with self.lock:
            try:
                import_pieces(self.model, shards)
            except ValueError as exc:  # refused before any copy: the model keeps its weights and version
                raise type(exc)(f"weights {weight_version}: {exc}") from None
            self.weight_version = str(weight_version)

    @torch.no_grad()
    def update_weights_from_named(self, named: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Copy some named parameters (a bucket of a broadcast update) into the model; the version changes when
        given (the update's last bucket)."""
        with self.lock:
            params = dict(self.model.named_parameters())
            for name, t in named:
                params[name].copy_(t)
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load an HF model directory's *.safetensors (or, in a checkpoint slot, its model.safetensors)."""
        tensors = load_model_dir(model_path)
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
            first_version = self.weight_version
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
            if control is not None and control.switches:  # the weights changed under the call: each token's version
                meta["output_token_weight_versions"] = token_versions(first_version, list(control.switches), len(toks))
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


def token_versions(first: str, switches: list[tuple[int, str]], count: int) -> list[str]:
    """Each of `count` tokens' weights version: `first` until the first switch's step, and so on."""
    out, version, at = [], first, 0
    for step, new in switches + [(count, "")]:
        out += [version] * (min(step, count) - at)
        at, version = min(step, count), new
    return out
