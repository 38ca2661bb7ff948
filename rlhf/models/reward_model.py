"""A reward model: a Hugging Face sequence-classification model (Llama, Mistral or Qwen2
`...ForSequenceClassification`, one label) that gives each (prompt, completion) one score.

The score is the model's `score` head at the last real token of the prompt followed by the completion (computed
from the attention mask, not from a pad token id, so a completion that ends in the pad token scores right and a
config without `pad_token_id` works). With `chat_template`, the pair is rendered as a user turn and an assistant
turn through the reward model's own tokenizer's chat template, as reward models trained on conversations expect.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


class RewardModelError(ValueError):
    """A reward model directory that cannot serve (what is wrong, and what would do)."""


def check_reward_model_dir(path: str) -> str | None:
    """Why `path` is no reward model directory we can serve (one line), or None. Reads config.json only."""
    if not os.path.isdir(path):
        return f"reward_model.path: {path!r} is not a directory (a local Hugging Face model folder)"
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        return f"reward_model.path: {path} has no config.json (a Hugging Face model folder: config.json, " \
               "*.safetensors and the tokenizer)"
    with open(config_file, encoding="utf-8") as fh:
        try:
            config = json.load(fh)
        except json.JSONDecodeError as exc:
            return f"reward_model.path: {config_file} is not JSON ({exc})"
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return (f"reward_model.path: {path} is a {', '.join(archs) or 'model of no architecture'}; a reward model is "
                "a sequence-classification model (LlamaForSequenceClassification, MistralForSequenceClassification, "
                "Qwen2ForSequenceClassification) with one label")
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if labels != 1:
        return f"reward_model.path: {path} has {labels} labels; a reward model gives one score (num_labels 1)"
    return None


class RewardModel:
    """score(prompts, completions) -> one float per pair."""

    def __init__(self, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 chat_template: bool = False, batch_size: int = 16, max_length: int = 1024) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = check_reward_model_dir(path)
        if problem:
            raise RewardModelError(problem)
        self.path, self.device, self.chat_template = path, torch.device(device), chat_template
        self.batch_size, self.max_length = batch_size, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise RewardModelError(f"reward_model.chat_template: the tokenizer in {path} has no chat template; set "
                                   "reward_model.chat_template false to score prompt + completion as plain text")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation="sdpa").to(self.device).eval()
        if not hasattr(self.model, "score") or not hasattr(self.model, "base_model"):
            raise RewardModelError(f"reward_model.path: {type(self.model).__name__} has no `score` head over a base "
                                   "model; use a Llama, Mistral or Qwen2 ForSequenceClassification")
        self.model.requires_grad_(False)

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        if not self.chat_template:
            return [p + c for p, c in zip(prompts, completions)]
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                                   tokenize=False) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        texts, out = self.texts(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            out += self._score(texts[start:start + self.batch_size])
        return out

    def _score(self, texts: list[str]) -> list[float]:
        ids = [self.tokenizer(t, add_special_tokens=not self.chat_template)["input_ids"][-self.max_length:]
               for t in texts]
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):  # right-padded: the last real token is at length - 1
            input_ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(ids), device=self.device), mask.sum(1) - 1]
        return [float(v) for v in self.model.score(last).float()[:, 0].cpu()]


def write_reward_model_dir(directory: str, architecture: str = "llama", seed: int = 0, **model_kwargs: Any) -> str:
    """A tiny random-init reward model (the character tokenizer of rlhf.models.hf_dir) saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

    from rlhf.models import init_weights
    from rlhf.models.hf_dir import make_tokenizer

    tokenizer = make_tokenizer()
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, **model_kwargs}
    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if architecture not in configs:
        raise ValueError(f"architecture {architecture!r}: choose one of {', '.join(configs)}")
    config = configs[architecture](vocab_size=len(tokenizer), max_position_embeddings=512, num_labels=1,
                                   pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id, **sizes)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    init_weights(model, seed)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
