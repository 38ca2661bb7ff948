"""Greedy evaluation of a policy on a held-out split."""

from __future__ import annotations

from typing import Any

from rlhf.data import completion_text, encode_prompts
from rlhf.tasks import Example, RewardFn


def evaluate(
    generate: Any, tokenizer: Any, examples: list[Example], reward: RewardFn, max_new_tokens: int,
    chat_template: bool = False,
) -> dict[str, float]:
    """Accuracy (mean reward) of greedy completions. `generate` has the RolloutEngine signature."""
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in examples], chat_template)
    results = generate(prompt_ids, {"max_new_tokens": max_new_tokens, "temperature": 0.0}, False)
    completions = [completion_text(tokenizer, r) for r in results]
    fields = {k: [e.fields.get(k) for e in examples] for k in sorted({k for e in examples for k in e.fields})}
    rewards = reward(completions, [e.answer for e in examples], [e.prompt for e in examples], fields)
    return {"accuracy": sum(rewards) / len(rewards), "n": len(rewards)}
