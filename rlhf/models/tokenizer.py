"""A character tokenizer that behaves like a Hugging Face tokenizer for the synthetic tasks.

One token per printable ASCII character plus four specials (pad, bos, eos, unk). It offers the
subset of the HF tokenizer interface the framework uses — `encode`, `decode`, `batch_decode`,
`__call__` with padding, `pad_token_id` / `bos_token_id` / `eos_token_id`, `vocab_size`,
`save_pretrained` / `from_pretrained` — so the rest of the code treats both kinds alike.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

TOKENIZER_FILE = "rlhf_char_tokenizer.json"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
DEFAULT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "


class CharTokenizer:
    """Maps each character of `alphabet` to one id; ids 0..3 are pad, bos, eos, unk."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET, padding_side: str = "left") -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer: alphabet has repeated characters")
        self.alphabet = alphabet
        self.padding_side = padding_side
        self._id = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}
        self._tok = SPECIALS + list(alphabet)
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = SPECIALS

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return [0, 1, 2, 3]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id.get(ch, self.unk_token_id) for ch in text]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        out = []
        for i in ids:
            if i < len(SPECIALS):
                if not skip_special_tokens:
                    out.append(SPECIALS[i])
            elif i < len(self._tok):
                out.append(self._tok[i])
        return "".join(out)

    def batch_decode(self, batch: Any, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    chat_template = None  # no template of HF's kind (a reward model's chat mode refuses it); has_chat() below

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: Any = None, tokenize: bool = True,
                            add_generation_prompt: bool = False, **_: Any) -> Any:
        """The tiny model's chat rendering (it has no role tokens): chat_contents(conversation)."""
        text = chat_contents(conversation)
        return self.encode(text) if tokenize else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok[i] for i in ids]

    def __call__(
        self,
        texts: str | list[str],
        padding: bool = True,
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
    ) -> dict[str, Any]:
        single = isinstance(texts, str)
        batch = [self.encode(t, add_special_tokens) for t in ([texts] if single else texts)]
        if not padding and return_tensors is None:
            ids = batch[0] if single else batch
            return {"input_ids": ids, "attention_mask": [[1] * len(b) for b in batch][0] if single else [[1] * len(b) for b in batch]}
        width = max(len(b) for b in batch)
        ids, mask = [], []
        for b in batch:
            pad = [self.pad_token_id] * (width - len(b))
            ids.append(pad + b if self.padding_side == "left" else b + pad)
            ones, zeros = [1] * len(b), [0] * len(pad)
            mask.append(zeros + ones if self.padding_side == "left" else ones + zeros)
        if return_tensors == "pt":
            import torch

            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
        return {"input_ids": ids, "attention_mask": mask}

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as fh:
            json.dump({"type": "char", "alphabet": self.alphabet, "specials": SPECIALS}, fh)

    @classmethod
    def from_pretrained(cls, directory: str) -> "CharTokenizer":
        with open(os.path.join(directory, TOKENIZER_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("specials") != SPECIALS:
            raise ValueError(f"{directory}: char tokenizer file has unexpected specials {data.get('specials')}")
        return cls(alphabet=data["alphabet"])


def has_chat(tokenizer: Any) -> bool:
    """Whether chat messages can be rendered for this tokenizer: an HF chat template, or the character
    tokenizer's own rendering (CharTokenizer.apply_chat_template)."""
    return bool(getattr(tokenizer, "chat_template", None)) or isinstance(tokenizer, CharTokenizer)


def chat_contents(conversation: list[dict[str, Any]]) -> str:
    """Chat messages for a model without role tokens: their contents one after the other, an assistant's tool calls
    written back in the Hermes format as the tool_calls environment teaches it (<tool_call>{"name":..,"arguments":..}
    </tool_call>, compact JSON) and a tool's answer as that environment gives it (<tool_response>..</tool_response>),
    so an agent's history renders as the tokens its model made and read; a single user message is its plain text, as
    a task's prompt."""
    parts = []
    for m in conversation:
        content = m.get("content")
        text = ("".join(p.get("text", "") for p in content if isinstance(p, dict))
                if isinstance(content, list) else str(content or ""))
        parts.append(f"<tool_response>{text}</tool_response>" if m.get("role") == "tool" else text)
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            parts.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": json.loads(args) if
                                                     isinstance(args, str) and args else args or {}},
                                                    separators=(",", ":")) + "</tool_call>")
    return "".join(parts)

