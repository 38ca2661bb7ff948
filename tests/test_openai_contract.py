"""OpenAI's API on the rollout server, checked with the `openai` package's own client (its request building, its
response models, its streaming and its error classes) against the session's server: completions, chat, streaming,
logprobs, tool calls, the token ids and weights versions training reads, and errors in OpenAI's shape."""

import json

import pytest

from rlhf.rollout.openai_api import parse_tool_calls, render_chat
from tests.conftest import SGLANG_KEY as KEY

openai = pytest.importorskip("openai", reason="pip install -e '.[test]' (the openai package)")


@pytest.fixture(scope="module")
def client(sglang_server):
    url, _ = sglang_server
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_completions_with_token_ids_usage_and_a_seed(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id
    model = models.data[0].id
    one = client.completions.create(model=model, prompt="12+34=", max_tokens=6, n=2, temperature=1.0, seed=7)
    again = client.completions.create(model=model, prompt="12+34=", max_tokens=6, n=2, temperature=1.0, seed=7)
    assert [c.text for c in one.choices] == [c.text for c in again.choices]  # the seed decides the samples
    assert len(one.choices) == 2 and {c.index for c in one.choices} == {0, 1}
    extra = one.model_extra
    prompt_ids = extra["prompt_token_ids"]
    assert isinstance(prompt_ids, list) and len(prompt_ids) == one.usage.prompt_tokens
    token_ids = [c.model_extra["token_ids"] for c in one.choices]
    assert one.usage.completion_tokens == sum(len(t) for t in token_ids) and all(1 <= len(t) <= 6 for t in token_ids)
    assert all(c.model_extra["weight_version"] is not None for c in one.choices)
    assert all(c.finish_reason in ("stop", "length") for c in one.choices)
    stopped = client.completions.create(model=model, prompt="12+34=", max_tokens=6, seed=7, stop=["1", "2", "3"])
    assert not any(ch in stopped.choices[0].text for ch in "123")


def test_chat_with_logprobs_of_each_token(client):
    reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "What is 2+3? "}],
                                           max_tokens=5, logprobs=True, top_logprobs=2, seed=1)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    tokens = choice.logprobs.content
    assert len(tokens) == len(choice.model_extra["token_ids"]) == reply.usage.completion_tokens
    assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in tokens)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in tokens)


def test_a_stream_is_the_same_completion_in_pieces(client):
    messages = [{"role": "user", "content": "7*8="}]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=8, seed=3)
    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=8, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_tool_calls_are_parsed_from_the_hermes_format_and_rendered_back():
    text, calls = parse_tool_calls('Let me compute. <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}'
                                   '</tool_call>')
    assert text == "Let me compute. " and calls[0]["function"]["name"] == "multiply"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4} and calls[0]["type"] == "function"
    assert parse_tool_calls("no call <tool_call>not json</tool_call>") == ("no call <tool_call>not json</tool_call>", [])

    from rlhf.models.tokenizer import CharTokenizer

    tok = CharTokenizer()  # the tiny default model's: its template is the contents one after the other
    history = [{"role": "user", "content": "3*4? "},
               {"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12"}]
    rendered = tok.decode(render_chat(history, None, tok))
    assert rendered == '3*4? <tool_call>{"name":"multiply","arguments":{"a":3,"b":4}}</tool_call>' \
                       '<tool_response>12</tool_response>'
    assert tok.decode(render_chat([{"role": "user", "content": "12+34="}], None, tok)) == "12+34="


def test_a_chat_with_tools_answers_in_openais_shape(client):
    tools = [{"type": "function", "function": {"name": "multiply", "description": "a times b",
                                               "parameters": {"type": "object", "properties": {}}}}]
    reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "3*4? "}], tools=tools,
                                           max_tokens=4, seed=2)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.message.tool_calls is None) == (choice.finish_reason != "tool_calls")


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 3.0}, "temperature"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"best_of": 4}}, "best_of"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_are_openais_400_naming_the_param(client, kwargs, param):
    args = {"model": "any", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"], body


def test_the_run_token_is_the_api_key(sglang_server):
    url, _ = sglang_server
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="any", prompt="1", max_tokens=1)
