"""Greedy evaluation of a policy on a held-out split."""

from __future__ import annotations

from typing import Any

from rlhf.data import completion_text, encode_prompts
from rlhf.tasks import Example, RewardFn
from rlhf.tasks.scoring import row_fields


def evaluate(
    generate: Any, tokenizer: Any, examples: list[Example], reward: RewardFn, max_new_tokens: int,
    chat_template: bool = False,
) -> dict[str, float]:
    """Accuracy (mean reward) of greedy completions. `generate` has the RolloutEngine signature."""
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in examples], chat_template)
    results = generate(prompt_ids, {"max_new_tokens": max_new_tokens, "temperature": 0.0}, False)
    completions = [completion_text(tokenizer, r) for r in results]
    return {"accuracy": accuracy(completions, examples, reward), "n": len(examples)}


def accuracy(completions: list[str], examples: list[Example], reward: RewardFn) -> float:
    """Mean reward of one completion per example (the reward functions only: no reward model)."""
    rewards = reward(completions, [e.answer for e in examples], [e.prompt for e in examples],
                     row_fields([e.fields for e in examples]))
    return sum(rewards) / len(rewards)
