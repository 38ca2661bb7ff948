"""OpenAI's API over the native engine: /v1/completions and /v1/chat/completions requests translated into the
sglang /generate calls the rollout server already runs (same queue, pause, fault points and spans), and their
outputs into OpenAI's replies, streamed chunks and errors.

- Requests: `model` (any: a server serves one model), `prompt` (a string, a list of strings, token ids or a list of
  them) or `messages` (through the model's chat template; the tiny default model has none, so its template is the
  messages' contents one after the other: a single user message renders exactly as the task's prompt does),
  `n`, `temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `logprobs` (chat: a bool and
  `top_logprobs`; completions: the number of top logprobs), `stream` (+ `stream_options.include_usage`), `tools` (the
  template's tools; `tool_calls` parsed from the text in the Hermes format, `<tool_call>{"name", "arguments"}
  </tool_call>`, and a completion ends after its first call), `tool_choice` `auto`/`none`. Fields the engine cannot honour are accepted at the value that
  switches them off (`frequency_penalty` 0, `logit_bias` null, …); anything else is a 400 in OpenAI's error shape
  naming the `param`.
- Replies: OpenAI's shape with `usage`, plus what training needs (sglang's and vLLM's extra fields): the request's
  `prompt_token_ids` and, per choice, `token_ids`, `weight_version` and each token's version when a sample spans
  versions (`output_token_weight_versions`) — token-in/token-out: nothing needs tokenising again.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from rlhf.errors import BadRequest

# OpenAI request fields the engine does not implement: accepted at the value that switches them off
OFF = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "best_of": 1, "echo": False, "suffix": None,
       "response_format": {"type": "text"}, "parallel_tool_calls": True, "functions": None, "function_call": None,
       "audio": None, "modalities": ["text"], "prediction": None, "reasoning_effort": None, "web_search_options": None}
IGNORED = ("user", "metadata", "store", "service_tier", "stream_options", "model", "safety_identifier",
           "prompt_cache_key")  # read elsewhere or without effect on the tokens
COMMON = ("n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "stream")
COMPLETION_FIELDS = (*COMMON, "prompt")
CHAT_FIELDS = (*COMMON, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice")
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
CALL_END = "</tool_call>"  # with tools, a completion also stops after a call (kept in its text and token ids)
DEFAULT_MAX_TOKENS = 128  # sglang's max_new_tokens default


class OpenAIBadRequest(BadRequest):
    """A 400 in OpenAI's error shape: the message and the request field it is about."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, kind: type | tuple, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise OpenAIBadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise OpenAIBadRequest(f"{name} must be between {low} and {high}, got {value!r}", name)
    return value


def _check_fields(body: Any, valid: tuple[str, ...], route: str) -> dict:
    if not isinstance(body, dict):
        raise OpenAIBadRequest(f"the {route} body must be a JSON object")
    known = set(valid) | set(OFF) | set(IGNORED)
    unknown = sorted(set(body) - known)
    if unknown:
        raise OpenAIBadRequest(f"{route}: unrecognized request argument(s) {unknown}; supported: "
                               f"{sorted(set(valid) | set(IGNORED))}", unknown[0])
    for name, off in OFF.items():
        value = body.get(name)
        if value is not None and value != off and value not in ("", [], {}):
            raise OpenAIBadRequest(f"{name} {value!r} is not supported by the native engine (only {off!r}, which "
                                   "switches it off)", name)
    return body


def _sampling(body: dict, max_tokens: Any, cap: int | None) -> dict[str, Any]:
    """OpenAI's sampling fields as sglang's sampling_params."""
    n = _number(body, "n", int, 1, 128) or 1
    temperature = _number(body, "temperature", (int, float), 0, 2)
    top_p = _number(body, "top_p", (int, float), 0, 1)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise OpenAIBadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    tokens = max_tokens if max_tokens is not None else (cap or DEFAULT_MAX_TOKENS)
    if cap is not None and tokens > cap:
        raise OpenAIBadRequest(f"max_tokens {tokens} is past this server's limit of {cap} tokens a completion",
                               "max_tokens")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise OpenAIBadRequest(f"stop must be a string or a list of up to 4 non-empty strings, got {stop!r}",
                                   "stop")
    seed = _number(body, "seed", int)
    params: dict[str, Any] = {"n": n, "max_new_tokens": tokens, "stop": stop}
    if temperature is not None:
        params["temperature"] = float(temperature)
    if top_p is not None:
        params["top_p"] = float(top_p)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def completion_request(body: Any, tokenizer: Any, cap: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """/v1/completions -> (the /generate body, what the reply needs: kind, model, top logprobs, stream, usage)."""
    body = _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIBadRequest("prompt is required", "prompt")
    if isinstance(prompt, str):
        key, value = "text", prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        key, value = "text", prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        key, value = "input_ids", prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        key, value = "input_ids", prompt
    else:
        raise OpenAIBadRequest(f"prompt must be a string, a list of strings, a list of token ids or a list of such "
                               f"lists, got {type(prompt).__name__}", "prompt")
    top = body.get("logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise OpenAIBadRequest(f"logprobs must be an integer between 0 and 20 (the top logprobs a token), got {top!r}",
                               "logprobs")
    generate = {key: value, "sampling_params": _sampling(body, body.get("max_tokens"), cap),
                "return_logprob": top is not None, "top_logprobs_num": top or 0}
    return generate, _meta(body, "completion", top is not None, top or 0)


def chat_request(body: Any, tokenizer: Any, cap: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """/v1/chat/completions -> (the /generate body on the rendered prompt's token ids, what the reply needs)."""
    body = _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIBadRequest("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise OpenAIBadRequest(f"messages[{i}] needs a role, one of {', '.join(ROLES)}; got "
                                   f"{m.get('role') if isinstance(m, dict) else m!r}", f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise OpenAIBadRequest(f"messages[{i}].content must be a string or a list of text parts",
                                   f"messages[{i}].content")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and t["function"].get("name") for t in tools)):
        raise OpenAIBadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                               "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise OpenAIBadRequest(f"tool_choice {choice!r} is not supported (auto or none)", "tool_choice")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OpenAIBadRequest(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    top = _number(body, "top_logprobs", int, 0, 20)
    if top and not logprobs:
        raise OpenAIBadRequest("top_logprobs needs logprobs true", "top_logprobs")
    ids = render_chat(messages, tools if choice != "none" else None, tokenizer)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    generate = {"input_ids": ids, "sampling_params": _sampling(body, max_tokens, cap),
                "return_logprob": bool(logprobs), "top_logprobs_num": top or 0}
    meta = _meta(body, "chat", bool(logprobs), top or 0)
    meta["tools"] = bool(tools) and choice != "none"
    if meta["tools"]:  # a turn ends with its call: the tool's answer comes before the model goes on
        stop = generate["sampling_params"]["stop"]
        generate["sampling_params"]["stop"] = [*([stop] if isinstance(stop, str) else stop or []), CALL_END]
    return generate, meta


def _meta(body: dict, kind: str, logprobs: bool, top: int) -> dict[str, Any]:
    options = body.get("stream_options") or {}
    return {"kind": kind, "model": str(body.get("model") or ""), "logprobs": logprobs, "top": top,
            "stream": bool(body.get("stream")), "usage_in_stream": bool(options.get("include_usage")),
            "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time())}


def render_chat(messages: list[dict], tools: list[dict] | None, tokenizer: Any) -> list[int]:
    """The messages (and tools) through the model's chat template, as token ids with the assistant turn opened; a
    tokenizer without one (the tiny default model's) gets the messages' contents one after the other
    (rlhf.models.tokenizer.chat_contents)."""
    from rlhf.models.tokenizer import chat_contents, has_chat

    if not has_chat(tokenizer):  # no template (the tiny model's tokenizer as sglang reads it): the contents in order
        return [int(i) for i in tokenizer.encode(chat_contents(messages))]
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 — a template's own complaint is the client's error
        raise OpenAIBadRequest(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                               "messages") from None
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    return [int(i) for i in ids]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The Hermes format's calls out of a completion: (the text before the first call, OpenAI tool_calls). A call
    whose JSON does not parse stays in the text."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments") or {})}})
    if not calls:
        return text, []
    return text[:text.find("<tool_call>")], calls


def _finish(output: dict[str, Any]) -> str:
    reason = (output["meta_info"].get("finish_reason") or {}).get("type")
    return {"length": "length", "abort": "abort"}.get(reason, "stop")


def _logprobs(output: dict[str, Any], meta: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if not meta["logprobs"]:
        return None
    info = output["meta_info"]
    entries = info.get("output_token_logprobs") or []
    tops = info.get("output_top_logprobs") or [[] for _ in entries]
    tokens = [tokenizer.decode([tid]) for _lp, tid, _t in entries]
    if meta["kind"] == "chat":
        content = []
        for (lp, tid, _t), token, top in zip(entries, tokens, tops):
            alternatives = [{"token": tokenizer.decode([t]), "logprob": v, "bytes": list(tokenizer.decode([t]).encode())}
                            for v, t, _x in (top or [])][:meta["top"]]
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alternatives})
        return {"content": content, "refusal": None}
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _tid, _t in entries], "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([t]): v for v, t, _x in (top or [])} for top in tops]
            if meta["top"] else None}


def _extras(output: dict[str, Any]) -> dict[str, Any]:
    """What training reads of a choice: its token ids and the weights version(s) that generated them."""
    info = output["meta_info"]
    extra = {"token_ids": list(output["output_ids"]), "weight_version": info.get("weight_version")}
    if "output_token_weight_versions" in info:
        extra["output_token_weight_versions"] = info["output_token_weight_versions"]
    return extra


def response(outputs: list[dict[str, Any]], meta: dict[str, Any], prompt_ids: list[list[int]],
             tokenizer: Any) -> dict[str, Any]:
    """The sglang outputs of a request as OpenAI's reply (non-streamed)."""
    choices = []
    for index, out in enumerate(outputs):
        finish = _finish(out)
        if meta["kind"] == "chat":
            raw = out["text"]
            if meta.get("tools") and (out["meta_info"].get("finish_reason") or {}).get("matched") == CALL_END:
                raw += CALL_END  # the stop string the call ended with (its token ids have it)
            text, calls = parse_tool_calls(raw) if meta.get("tools") else (raw, [])
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                                       "refusal": None}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": index, "message": message, "finish_reason": finish,
                      "logprobs": _logprobs(out, meta, tokenizer)}
        else:
            choice = {"index": index, "text": out["text"], "finish_reason": finish,
                      "logprobs": _logprobs(out, meta, tokenizer)}
        choices.append({**choice, **_extras(out)})
    completion = sum(len(o["output_ids"]) for o in outputs)
    prompt = sum(len(p) for p in prompt_ids)
    return {"id": meta["id"], "object": "chat.completion" if meta["kind"] == "chat" else "text_completion",
            "created": meta["created"], "model": meta["model"], "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "prompt_token_ids": prompt_ids[0] if len(prompt_ids) == 1 else prompt_ids, "system_fingerprint": None}


def chunk(meta: dict[str, Any], index: int, delta_text: str | None, finish: str | None = None,
          first: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk (chat: a delta; completions: the text's next piece)."""
    if meta["kind"] == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta_text:
            delta["content"] = delta_text
        if extra and extra.get("tool_calls"):
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(extra.pop("tool_calls"))]
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"],
            "choices": [{**choice, **(extra or {})}]}
