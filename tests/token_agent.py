"""A test agent (sync, the openai package's own client) that checks the gateway's contract as it runs and makes
four completions an episode: the second extends the first token for token (its prompt: the first's prompt and
output ids and an observation), the third starts over (a prompt of its own), the fourth is a streamed chat with
tools. Each episode is therefore three samples: the first two calls joined, the third and the fourth alone. Its reward: 1.0 when the third completion has an even length."""

import openai


def agent(client, row):
    try:
        client.completions.create(model="p", prompt=row["prompt"], n=2)
    except openai.BadRequestError as exc:  # a group's episodes are the group: n is 1
        assert exc.body["param"] == "n", exc.body
    else:
        raise AssertionError("the gateway took n=2")
    first = client.completions.create(model="p", prompt=row["prompt"], max_tokens=10_000, seed=7, temperature=1.7)
    assert first.usage.completion_tokens <= 8, first.usage  # capped by the run's sampling.max_new_tokens
    assert first.choices[0].logprobs is None  # not asked for: not given, though the run recorded them
    try:
        client.completions.create(model="p", prompt=row["prompt"], logprobs=3)
    except openai.BadRequestError as exc:  # top logprobs: not during GRPO
        assert exc.body["param"] == "logprobs", exc.body
    else:
        raise AssertionError("the gateway gave top logprobs")
    ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    second = client.completions.create(model="p", prompt=ids + [ord("=")], max_tokens=2, logprobs=0)
    assert len(second.choices[0].logprobs.token_logprobs) == len(second.choices[0].model_extra["token_ids"])
    third = client.completions.create(model="p", prompt="x" + row["prompt"], max_tokens=2)
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}]
    chunks = list(client.chat.completions.create(model="p", messages=[{"role": "user", "content": "y"}], tools=tools,
                                                 max_tokens=3, stream=True))  # a fourth sample: its own prompt
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls"), chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) is not None
    assert 1 <= len(chunks[-1].choices[0].model_extra["token_ids"]) <= 3
    return float(len(third.choices[0].model_extra["token_ids"]) % 2 == 0)
