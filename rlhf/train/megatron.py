"""`--train.engine megatron`: the policy as megatron-core's GPTModel, speaking Hugging Face names outside.

The model is megatron-core's `GPTModel` with the local layer spec (plain PyTorch layers, no TransformerEngine), built
from the HF Llama/Qwen2 config (RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP, Qwen2's q/k/v biases,
a tied or separate LM head). `MegatronCausalLM` wraps it behind the interface the train engine uses of an HF causal
LM (`model(input_ids=, attention_mask=, position_ids=, logits_to_keep=).logits`), so the GRPO loss, the logprob path
and the optimizer are the native engine's. Weights cross the boundary as HF tensors: `hf_to_megatron` and
`megatron_to_hf` convert both ways (megatron's fused QKV holds, per query group, that group's query heads, then its
key head, then its value head; its fc1 holds the gate projection, then the up projection), so weight sync,
checkpoints and `rlhf export` see HF names.

Megatron-core's GPTModel needs CUDA (its rotary embedding and causal mask live on `torch.cuda.current_device()`):
on a CPU `check_megatron` is one clear error. `parallel.tp_size` / `train.pp_size` go to megatron's parallel_state;
only 1 x 1 has been checked (one GPU).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

QKV = "decoder.layers.{i}.self_attention.linear_qkv.{kind}"
# HF name (per layer i) <-> megatron name, one to one (the fused ones are converted below)
PLAIN = {
    "model.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "decoder.layers.{i}.self_attention.linear_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "model.layers.{i}.mlp.down_proj.weight": "decoder.layers.{i}.mlp.linear_fc2.weight",
}
TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "model.norm.weight": "decoder.final_layernorm.weight",
       "lm_head.weight": "output_layer.weight"}


class MegatronUnavailable(ValueError):
    """--train.engine megatron where it cannot run (no CUDA, megatron-core not installed, a model it cannot hold)."""


def check_megatron(device: Any, hf_config: Any = None) -> None:
    """One clear error when the megatron engine cannot run here; None when it can."""
    if torch.device(device).type != "cuda":
        raise MegatronUnavailable(
            "train.engine megatron needs CUDA: megatron-core's GPTModel puts its rotary embedding and causal mask on "
            f"torch.cuda.current_device(), and model.device is {device!r} (valid here: train.engine native, or "
            "model.device cuda on a GPU machine)")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise MegatronUnavailable(f"train.engine megatron needs megatron-core (pip install -e '.[gpu]' or pip install "
                                  f"megatron-core): {exc}") from None
    if hf_config is not None and getattr(hf_config, "model_type", "") not in ("llama", "qwen2"):
        raise MegatronUnavailable(f"train.engine megatron converts Llama and Qwen2 models; this one is "
                                  f"{getattr(hf_config, 'model_type', '?')!r} (valid: llama, qwen2)")


def _rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _shape(hf_config: Any) -> tuple[int, int, int, int]:
    """(heads H, kv heads G, head dim D, hidden C)."""
    H = hf_config.num_attention_heads
    G = getattr(hf_config, "num_key_value_heads", None) or H
    C = hf_config.hidden_size
    D = getattr(hf_config, "head_dim", None) or C // H
    return H, G, D, C


def transformer_config(hf_config: Any, tp: int = 1, pp: int = 1, cpu_init: bool = False) -> Any:
    from megatron.core.transformer import TransformerConfig

    H, G, D, _ = _shape(hf_config)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=H,
        num_query_groups=G, kv_channels=D, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=getattr(hf_config, "model_type", "") == "qwen2",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=torch.float32, use_cpu_initialization=cpu_init, attention_softmax_in_fp32=True)


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0) -> None:
    """megatron's parallel_state over the running torch.distributed world (tp x pp model parallel, the rest data
    parallel), once per process; and its CUDA RNG tracker (attention dropout forks it, even at 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        raise MegatronUnavailable("train.engine megatron: torch.distributed is not initialised (run under torchrun, or "
                                  "init_process_group first)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if torch.cuda.is_available():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(hf_config: Any, tp: int = 1, pp: int = 1, cpu_init: bool = False) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(transformer_config(hf_config, tp, pp, cpu_init), get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=_rope_theta(hf_config),
                    share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)))


def _one_to_one(hf_config: Any) -> list[tuple[str, str]]:
    """(HF name, megatron name) of the tensors that convert as they are (a tied LM head has no megatron name)."""
    pairs = [(hf.format(i=i), mc.format(i=i)) for i in range(hf_config.num_hidden_layers) for hf, mc in PLAIN.items()]
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return pairs + [(hf, mc) for hf, mc in TOP.items() if not (tied and hf == "lm_head.weight")]


def hf_to_megatron(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2 tensors by name -> GPTModel's (fused QKV per query group, fc1 = [gate; up])."""
    H, G, D, C = _shape(hf_config)
    rep = H // G
    out = {mc: state[hf] for hf, mc in _one_to_one(hf_config) if hf in state}
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{p}self_attn.q_proj.{kind}" not in state:
                continue
            q, k, v = (state[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            rest = q.shape[1:]  # (C,) for weights, () for biases
            out[QKV.format(i=i, kind=kind)] = torch.cat(
                [q.reshape(G, rep * D, *rest), k.reshape(G, D, *rest), v.reshape(G, D, *rest)], dim=1
            ).reshape((H + 2 * G) * D, *rest)
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat([state[f"{p}mlp.gate_proj.weight"],
                                                                      state[f"{p}mlp.up_proj.weight"]], dim=0)
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """GPTModel's tensors by name -> HF Llama/Qwen2 names (the inverse of hf_to_megatron; a tied LM head is the
    embedding, named once, as HF's named_parameters give it)."""
    H, G, D, C = _shape(hf_config)
    rep = H // G
    out = {hf: state[mc] for hf, mc in _one_to_one(hf_config) if mc in state}
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = state.get(QKV.format(i=i, kind=kind))
            if fused is None:
                continue
            rest = fused.shape[1:]
            q, k, v = fused.reshape(G, (rep + 2) * D, *rest).split([rep * D, D, D], dim=1)
            out[f"{p}self_attn.q_proj.{kind}"] = q.reshape(H * D, *rest)
            out[f"{p}self_attn.k_proj.{kind}"] = k.reshape(G * D, *rest)
            out[f"{p}self_attn.v_proj.{kind}"] = v.reshape(G * D, *rest)
        gate, up = state[f"decoder.layers.{i}.mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
    return out


class MegatronCausalLM(torch.nn.Module):
    """GPTModel behind the HF causal-LM interface the train engine calls; `hf_state_dict` / `load_hf_state_dict`
    speak HF names."""

    def __init__(self, hf_config: Any, tp: int = 1, pp: int = 1, cpu_init: bool = False) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = (tp, pp, cpu_init)
        self.gpt = build_gpt(hf_config, tp, pp, cpu_init)

    @classmethod
    def from_hf(cls, model: torch.nn.Module, tp: int = 1, pp: int = 1, cpu_init: bool = False) -> MegatronCausalLM:
        """The same weights as an HF model, on the HF model's device."""
        out = cls(model.config, tp, pp, cpu_init).to(next(model.parameters()).device)
        out.load_hf_state_dict({n: p.detach() for n, p in model.named_parameters()})
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, **_: Any) -> Any:
        """Right-padded rows: a query sees the real keys up to itself (a pad query itself only, not to softmax over
        nothing). Rotary positions are the column index, which is each real token's position under right padding."""
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        causal = torch.ones(L, L, dtype=torch.bool, device=input_ids.device).tril()
        eye = torch.eye(L, dtype=torch.bool, device=input_ids.device)
        masked = ~((causal[None] & valid[:, None, :]) | eye[None])  # (B, L, L): True = not attended
        logits = self.gpt(input_ids, position_ids, masked[:, None])  # (B, L, V)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return types.SimpleNamespace(logits=logits)

    def get_output_embeddings(self) -> None:
        return None  # the engine runs the whole forward (and keeps only the loss columns' logits)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        own = {n: p.detach() for n, p in self.gpt.named_parameters()}
        return megatron_to_hf(own, self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        converted = hf_to_megatron(state, self.config)
        params = dict(self.gpt.named_parameters())
        missing = sorted(set(params) - set(converted))
        if missing:
            raise KeyError(f"megatron engine: no HF tensor for {missing[:4]} ({len(missing)} in all)")
        for name, p in params.items():
            p.copy_(converted[name].to(p.dtype))

    def __deepcopy__(self, memo: dict) -> MegatronCausalLM:
        """A twin (the frozen reference) built anew and given these weights: megatron's modules hold process-group
        handles that copy.deepcopy cannot copy."""
        twin = MegatronCausalLM(self.config, *self.parallel).to(next(self.parameters()).device)
        twin.gpt.load_state_dict(copy.copy(self.gpt.state_dict()))
        twin.train(self.training)
        return twin
