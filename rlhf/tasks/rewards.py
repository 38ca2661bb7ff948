"""Built-in reward functions (signature in rlhf.tasks)."""

from __future__ import annotations

from rlhf.tasks.base import register_reward


@register_reward("exact_match")
def exact_match(completions: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""
    if not len(completions) == len(answers) == len(prompts):
        raise ValueError(
            f"exact_match: got {len(completions)} completions, {len(answers)} answers, {len(prompts)} prompts"
        )
    return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answers)]
