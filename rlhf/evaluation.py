"""Greedy evaluation of a policy on a held-out split: one completion a prompt, or episodes with an environment."""

from __future__ import annotations

from typing import Any

from rlhf.data import completion_text, encode_prompts
from rlhf.rollout.engine.sampling import SamplingParams
from rlhf.rollout.sglang_api import Prompt, RequestControl
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


def _stop_control(tokenizer: Any, stops: list[str], rows: int) -> RequestControl:
    """sglang's stop strings (the rollout server's RequestControl) for `rows` rows of one greedy engine call: a row
    ends on the step whose token completes one of `stops` (a tool call's end), the turn's end."""
    sampling = SamplingParams.from_dict({"max_new_tokens": 1})
    return RequestControl([Prompt([0], str(r), sampling, tuple(stops)) for r in range(rows)], tokenizer)


def evaluate_episodes(engine: Any, tokenizer: Any, examples: list[Example], reward: RewardFn, max_new_tokens: int,
                      make_env: Any, max_turns: int, max_tool_output_tokens: int,
                      chat_template: bool = False) -> dict[str, float]:
    """Accuracy of greedy episodes in this process (the SFT warm start's val check with an environment): each
    turn greedy until the end or a stop string of the environment's, the environment's answer appended (cut to
    max_tool_output_tokens), up to max_turns; the last turn's text is what the reward scores. The rollout's episodes
    (rlhf.control.episodes) do the same through the rollout and environment servers."""
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in examples], chat_template)
    envs = [make_env() for _ in examples]
    context = []
    for env, e, ids in zip(envs, examples, prompt_ids):
        first = env.reset({"prompt": e.prompt, "answer": e.answer, **e.fields})
        context.append(list(ids) + (tokenizer.encode(first, add_special_tokens=False) if first else []))
    stops = list(getattr(envs[0], "stop", None) or []) if envs else []
    answers, running = [""] * len(examples), list(range(len(examples)))
    for turn in range(max_turns):
        control = _stop_control(tokenizer, stops, len(running)) if stops else None
        results = engine.generate([context[k] for k in running], {"max_new_tokens": max_new_tokens,
                                                                  "temperature": 0.0}, control=control)
        still = []
        for k, result in zip(running, results):
            answers[k] = completion_text(tokenizer, result)
            step = envs[k].step(answers[k])
            if step.done or not step.observation or turn == max_turns - 1:
                continue
            seen = tokenizer.encode(step.observation, add_special_tokens=False)[:max_tool_output_tokens]
            context[k] += list(result["output_ids"]) + seen
            still.append(k)
        running = still
        if not running:
            break
    return {"accuracy": accuracy(answers, examples, reward), "n": len(examples)}
