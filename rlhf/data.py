"""Prompt sampling and batch building (rollout results → right-padded train tensors)."""

from __future__ import annotations

import random
from typing import Any

import torch

from rlhf.models.tokenizer import CharTokenizer, has_chat
from rlhf.tasks import Example


class PromptSampler:
    """Endless shuffled pass over a split, deterministic by seed; its position is checkpointable."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        if not examples:
            raise ValueError("PromptSampler: no examples")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)


def encode_prompts(tokenizer: Any, prompts: list[Any], chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt, as SFT, rollout and eval all feed them to the model.

    Plain: the tokenizer's own special tokens (its BOS). With `chat_template` (task.chat_template):
    the prompt as one user turn through the tokenizer's chat template with the generation prompt
    appended; the template writes its own BOS, so none is added, and a doubled BOS is removed. A prompt given as a
    list of chat messages ({role, content}) is always rendered by the template.
    """
    chats = any(isinstance(p, list) for p in prompts)  # a dataset's prompts as chat messages
    if not chat_template and not chats:
        return [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    if not (has_chat(tokenizer) if chats and not chat_template else getattr(tokenizer, "chat_template", None)):
        raise ValueError(("task.chat_template is on" if chat_template else "the dataset's prompts are chat messages")
                         + " but the tokenizer has no chat template (tokenizer_config.json 'chat_template')"
                         + ("; turn it off for this model" if chat_template else "; give prompts as strings"))
    out = []
    bos = getattr(tokenizer, "bos_token_id", None)
    for p in prompts:
        messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
        if isinstance(tokenizer, CharTokenizer):  # its own rendering: the contents in order, after its BOS
            out.append(tokenizer.apply_chat_template(messages, tokenize=True))
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        out.append(ids)
    return out


def completion_text(tokenizer: Any, result: dict[str, Any]) -> str:
    """The text a reward function scores: the completion without its stop token and special tokens.

    One rule for SFT eval, rollout reward and the controller's eval (an HF tokenizer would otherwise
    leave '</s>' or '<|im_end|>' in the text and exact-match reward would be 0 forever).
    """
    ids = result["output_ids"]
    finish = result.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "stop" and ids and not isinstance(finish.get("matched"), str):
        ids = ids[:-1]  # a stop token (a stop string's tokens are the text's own: an environment reads them)
    return tokenizer.decode(ids, skip_special_tokens=True)


class InvalidTensorShape(ValueError):
    """Rollout data that cannot become the train tensors (a response of length 0, tokens without logprobs)."""


def build_rl_batch(prompt_ids: list[list[int]], results: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the train engine from prompts (one per result) and rollout results."""
    if len(prompt_ids) != len(results):
        raise ValueError(f"build_rl_batch: {len(prompt_ids)} prompts for {len(results)} results")
    from rlhf.rollout.sglang_api import output_logprobs  # at use: the rollout package loads the engine

    return rl_batch(prompt_ids, [r["output_ids"] for r in results], [output_logprobs(r) for r in results], pad_id)


def rl_batch(prompt_ids: list[list[int]], output_ids: list[list[int]], logprobs: list[list[float]], pad_id: int,
             output_masks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """build_rl_batch from the columns: prompt, response and response logprobs per row. Each tensor is made in
    one call from padded rows and the masks by comparing column indices with the row lengths (a 512-row batch
    took tens of ms row by row). output_masks: per response token 1 (trained on) or 0 (an environment's
    observation: out of the loss, the KL and every token count)."""
    for i, (out, lps) in enumerate(zip(output_ids, logprobs)):
        if len(lps) != len(out):
            raise InvalidTensorShape(f"sample {i}: rollout result has {len(out)} tokens but {len(lps)} logprobs")
        if not out:  # an aborted request: a row with nothing to score, train or normalise by
            empty = sum(1 for o in output_ids if not o)
            raise InvalidTensorShape(f"response tensor of sample {i} has shape [0]: {empty} of {len(output_ids)} "
                                     "samples have no response tokens (aborted or lost rollout requests)")
    n_p = [len(p) for p in prompt_ids]
    n_t = [a + len(o) for a, o in zip(n_p, output_ids)]
    width = max(n_t)
    input_ids = torch.tensor([p + o + [pad_id] * (width - t) for p, o, t in zip(prompt_ids, output_ids, n_t)],
                             dtype=torch.long)  # (B, width)
    old_logprobs = torch.tensor([[0.0] * a + lps + [0.0] * (width - t) for a, lps, t in zip(n_p, logprobs, n_t)],
                                dtype=torch.float32)  # (B, width)
    col = torch.arange(width)[None]  # (1, width)
    start, end = torch.tensor(n_p)[:, None], torch.tensor(n_t)[:, None]  # (B, 1)
    response_mask = ((col >= start) & (col < end)).float()
    if output_masks is not None:
        response_mask = response_mask * torch.tensor(
            [[0] * a + m + [0] * (width - t) for a, m, t in zip(n_p, output_masks, n_t)], dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": (col < end).long(),
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
    }


def build_sft_batch(tokenizer: Any, examples: list[Example], chat_template: bool = False,
                    stop_id: int | None = None,
                    demos: list[list[tuple[str, bool]] | None] | None = None) -> dict[str, torch.Tensor]:
    """Prompt (as encode_prompts) + answer + stop token, loss on the answer and the stop token.

    stop_id: the token that ends an answer (default: the tokenizer's EOS; see rlhf.models.stop_token_ids).
    demos: per example, an environment's worked episode (rlhf.envs.Env.demonstration) in place of the answer: its
    texts in order, the model's trained on, the environment's masked out (as the rollout masks observations).
    """
    stop = tokenizer.eos_token_id if stop_id is None else stop_id
    if stop is None:
        raise ValueError("build_sft_batch: the tokenizer has no EOS token and no stop_id was given")
    prompts = encode_prompts(tokenizer, [e.prompt for e in examples], chat_template)
    answers, masks = [], []
    for i, e in enumerate(examples):
        parts = (demos[i] if demos is not None else None) or [(e.answer, True)]
        ids, mask = [], []
        for text, trained in parts:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [float(trained)] * len(piece)
        answers.append(ids + [stop])
        masks.append(mask + [1.0])
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    B = len(examples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop
    input_ids = torch.full((B, width), pad, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    response_mask = torch.zeros((B, width), dtype=torch.float32)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        attention_mask[i, : len(p) + len(a)] = 1
        response_mask[i, len(p) : len(p) + len(a)] = torch.tensor(masks[i])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
