"""Models and tokenizers: a named tiny preset built from a config, or a local HF directory.

`build_model_and_tokenizer(cfg.model, seed)` is the one entry point. Presets are random-init
Llama-architecture causal LMs made from a `LlamaConfig` (no download); a local directory is
loaded with `from_pretrained(local_files_only=True)` and brings its own tokenizer (or our char
tokenizer if it was saved by this framework).
"""

from __future__ import annotations

import functools
import glob
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from rlhf.models.tokenizer import TOKENIZER_FILE, CharTokenizer

if TYPE_CHECKING:  # torch loads in the functions that build models: the presets' names are read without it
    import torch


def torch_dtype(name: str) -> torch.dtype:
    """model.dtype's name (float32, bfloat16, float16) as a torch dtype."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, max_pos: int = 128,
           vocab: int | None = None, family: str = "llama") -> Callable[[int], Any]:
    def make(vocab_size: int) -> Any:
        import transformers  # transformers takes seconds to import: only model builders pay it

        config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
        return config_class(
            vocab_size=vocab or vocab_size,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=1e-6,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True,
            initializer_range=0.02,
        )

    return make


# name -> function(vocab_size) -> transformers config. Parameter counts are for the char vocab.
MODEL_PRESETS: dict[str, Callable[[int], Any]] = {
    "tiny-llama": _llama(hidden=128, layers=4, heads=4, kv_heads=4, ffn=384),  # ~0.8 M params
    # the same with 256 positions: episodes with a tool call and its answer (examples/envs/calculator.py:Calculator)
    "tiny-llama-256": _llama(hidden=128, layers=4, heads=4, kv_heads=4, ffn=384, max_pos=256),
    "tiny-llama-gqa": _llama(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256),  # GQA path for tests
    # Qwen2's layout (q/k/v biases) with grouped-query attention: the sharding tests' second architecture
    "tiny-qwen2-gqa": _llama(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, family="qwen2"),
    "llama-25m": _llama(hidden=512, layers=8, heads=8, kv_heads=8, ffn=1536, max_pos=512),  # ~100 MB fp32
    # ~110 M params: a GPT-2-small-sized Llama with a 32 k vocabulary (ids past the char set are never
    # encoded; the model may still sample them, as a real tokenizer's model would) — the GPU benchmark's model
    "llama-110m": _llama(hidden=768, layers=12, heads=12, kv_heads=12, ffn=2048, max_pos=1024, vocab=32000),
    # ~0.54 B params (2048 hidden, 10 layers, GQA 16/8 heads, 32 k vocabulary): the sharding benchmark's model, which
    # replicated data parallel cannot hold at 4 ranks on a 24 GB machine (16 bytes a parameter on each rank: ~34 GB)
    "llama-500m": _llama(hidden=2048, layers=10, heads=16, kv_heads=8, ffn=5632, max_pos=512, vocab=32000),
    # ~1.54 B params, Qwen2-1.5B's shape (1536 hidden, 28 layers, GQA 12/2 heads, 8960 MLP, q/k/v biases, 151,936
    # vocabulary, tied embedding), random init: the sharded-training check on a GPU
    "qwen2-1.5b": _llama(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, max_pos=1024, vocab=151936,
                         family="qwen2"),
}


def model_shape(model_cfg: Any) -> Any:
    """The model's head counts and MLP width (num_attention_heads, num_key_value_heads, intermediate_size), without
    building it: from the preset, or the HF directory's config.json; None when config.json cannot be read."""
    if not model_cfg.path:
        return MODEL_PRESETS[model_cfg.name](256)
    import json
    import types

    try:
        with open(os.path.join(model_cfg.path, "config.json"), encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    try:
        heads = int(raw["num_attention_heads"])
        return types.SimpleNamespace(num_attention_heads=heads,
                                     num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                                     intermediate_size=int(raw["intermediate_size"]))
    except (KeyError, TypeError, ValueError):
        return None


# transformers imports its submodules on first use (a lazy module), and a `from transformers import X` in one thread
# while another thread is importing fails ("cannot import name 'AutoTokenizer'"): the train worker builds its model
# on its own thread while the controller loads the tokenizer. Loading goes through this lock, one thread at a time.
_TRANSFORMERS = threading.RLock()


def _serialised(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _TRANSFORMERS:
            return fn(*args, **kwargs)
    return run


@_serialised
def build_model_and_tokenizer(model_cfg: Any, seed: int = 0, device: str | torch.device | None = None,
                              dtype: str | None = None) -> tuple[torch.nn.Module, Any]:
    """Return (model in eval mode, tokenizer) on `device` / in `dtype` (default: model_cfg's)."""
    import torch

    dtype = torch_dtype(dtype or model_cfg.dtype)
    device = torch.device(device if device is not None else model_cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"model.device={model_cfg.device!r} but this torch build has no CUDA device "
            f"(torch {torch.__version__}); use --model.device cpu"
        )
    if model_cfg.path:
        return load_model_dir(model_cfg.path, dtype, device)
    from transformers import AutoModelForCausalLM

    tokenizer = CharTokenizer()
    hf_config = MODEL_PRESETS[model_cfg.name](tokenizer.vocab_size)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Our own seeded initialisation of a fresh model, the same whatever transformers version builds it.

    transformers' own init has changed between releases (the order and the generator calls), which moved
    the default run's accuracy with every upgrade. Here, in parameter-name order from one generator:
    matrices and embeddings ~ N(0, config.initializer_range), norm weights 1, biases 0, the pad token's
    embedding row 0. Tied weights are one parameter and drawn once. A parameter laid out in pieces (a DTensor: a
    model built straight into its train layout) gets the same values: each whole parameter is drawn, one at a time,
    and the rank keeps its piece of it.
    """
    import torch

    from rlhf.weights import copy_whole_

    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    pad = getattr(model.config, "pad_token_id", None)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                whole = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            else:
                whole = torch.full(param.shape, 1.0 if "norm" in name else 0.0)
            if param is embeddings and isinstance(pad, int) and 0 <= pad < whole.shape[0]:
                whole[pad].zero_()
            copy_whole_(param, whole)


def model_skeleton(model_cfg: Any) -> tuple[torch.nn.Module, Any]:
    """(the model on the meta device, no memory behind it, fp32; its tokenizer): to be laid out, then filled by
    fill_weights. The generation config of a model directory comes along (its stop tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if model_cfg.path:
        tokenizer = load_tokenizer(model_cfg.path)
        config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    else:
        tokenizer = CharTokenizer()
        config = MODEL_PRESETS[model_cfg.name](tokenizer.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if model_cfg.path and os.path.exists(os.path.join(model_cfg.path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(model_cfg.path, local_files_only=True)
    return model, tokenizer


def fill_weights(model: torch.nn.Module, model_cfg: Any, seed: int) -> None:
    """The weights of a skeleton already given memory (to_empty): the seeded init of a built-in model, or a model
    directory's safetensors read one parameter at a time; buffers (the rotary tables) computed afresh. A parameter
    laid out in pieces keeps this rank's piece: no rank holds the whole model."""
    import torch
    from safetensors import safe_open

    from rlhf.weights import copy_whole_

    for module in model.modules():  # to_empty left the buffers unset: a fresh module of the same kind computes them
        if any(True for _ in module.buffers(recurse=False)):
            fresh = type(module)(config=model.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)
    if not model_cfg.path:
        init_weights(model, seed)
        return
    files = sorted(glob.glob(os.path.join(model_cfg.path, "*.safetensors")))
    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            where.update({k: f for k in fh.keys()})
    params = dict(model.named_parameters())
    missing = sorted(n for n in params if n not in where)
    if missing:
        raise ValueError(f"{model_cfg.path}: no weights for {missing[:5]} in {', '.join(map(os.path.basename, files))}")
    with torch.no_grad():
        for name, param in params.items():
            with safe_open(where[name], framework="pt") as fh:
                copy_whole_(param, fh.get_tensor(name).to(torch.float32))


@_serialised
def load_model_dir(path: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """Load a local HF causal LM directory and its tokenizer (never downloads)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval(), tokenizer


@_serialised
def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local model directory (ours or an HF one), without loading the weights.

    HF tokenizers get left padding (the rollout engine and batch building expect it) and, when
    they have no pad token, the EOS token as pad (pad positions are always masked).
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.path: {path!r} is not a directory (expected a local HF model folder)")
    if os.path.exists(os.path.join(path, TOKENIZER_FILE)):
        return CharTokenizer.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{path}: the tokenizer has neither a pad nor an EOS token; add one of them")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(model: torch.nn.Module | None, tokenizer: Any) -> list[int]:
    """The token ids that end a completion, shared by SFT, rollout and eval.

    The union of the model config's `eos_token_id`, its `generation_config.eos_token_id` (Llama-3
    lists `<|eot_id|>` there) and the tokenizer's EOS. Order: the tokenizer's EOS first (the id
    SFT appends to an answer), then the rest ascending.
    """
    ids: list[int] = []
    if tokenizer is not None:
        ids += _ids(getattr(tokenizer, "eos_token_id", None))
    if model is not None:
        ids += _ids(getattr(model.config, "eos_token_id", None))
        gen = getattr(model, "generation_config", None)
        ids += _ids(getattr(gen, "eos_token_id", None)) if gen is not None else []
    first = ids[:1]
    return first + sorted(set(ids) - set(first))


def pad_token_id(model: torch.nn.Module | None, tokenizer: Any) -> int:
    """The id used for padding (always masked): the tokenizer's pad, the config's pad, an EOS, else 0."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(getattr(model, "config", None), "pad_token_id", None)):
        if value is not None:
            return int(value)
    stops = stop_token_ids(model, tokenizer)
    return stops[0] if stops else 0


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
