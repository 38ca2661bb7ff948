"""Write a real Hugging Face model directory with no download: a `tokenizers` tokenizer wrapped in
`PreTrainedTokenizerFast` plus a Llama or Qwen2 model from a config, both `save_pretrained`.

Used by the tests and benchmarks to exercise the real-model path (AutoTokenizer, special tokens
`<s>` `</s>` `<pad>`, generation_config, untied heads) on CPU. The tokenizer is character-level
(a BPE model with no merges), so small models learn the synthetic tasks as fast as with ours.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def make_tokenizer(alphabet: str = string.digits + string.ascii_letters + string.punctuation + " ",
                   chat_template: str | None = None) -> Any:
    """A character-level PreTrainedTokenizerFast: `<s>` prepended on encode, `</s>` EOS, `<pad>` pad."""
    from tokenizers import (  # at use: transformers/tokenizers take seconds to import
        Tokenizer,
        decoders,
        models,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", padding_side="left")
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


# a minimal chat template in the ChatML style (writes its own BOS, as Llama-3's does)
CHATML = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_model(tokenizer: Any, architecture: str = "llama", hidden: int = 128, layers: int = 4, heads: int = 4,
               kv_heads: int = 4, ffn: int = 384, tie: bool = True, seed: int = 0,
               extra_eos: list[int] | None = None) -> torch.nn.Module:
    """A random-init causal LM sized for the tokenizer; extra_eos go to generation_config only (as Llama-3)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.02)
    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if architecture not in configs:
        raise ValueError(f"architecture {architecture!r}: choose one of {', '.join(configs)}")
    from rlhf.models import init_weights

    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(configs[architecture](**common), attn_implementation="sdpa")
    init_weights(model, seed)
    eos = [tokenizer.eos_token_id] + list(extra_eos or [])
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=eos if len(eos) > 1 else eos[0])
    return model.eval()


def write_model_dir(directory: str, architecture: str = "llama", chat_template: str | None = None,
                    **model_kwargs: Any) -> str:
    """save_pretrained a fresh tokenizer and model into `directory`; returns it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = make_tokenizer(chat_template=chat_template)
    model = make_model(tokenizer, architecture, **model_kwargs)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def write_addition_jsonl(path: str, max_operand: int = 99) -> str:
    """Every 'a+b=' problem with operands in [0, max_operand] as {"prompt", "answer"} lines."""
    with open(path, "w", encoding="utf-8") as fh:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                fh.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path
