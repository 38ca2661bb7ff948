"""sglang's native `/generate` API over the native engine: request parsing, stop strings, abort, replies.

Checked against sglang SGLANG_VERSION (its `sglang/api/v1/api_types.py` contract: GenerateRequest,
SamplingParams, GenerateResponse, GenerateMetaInfo, ErrorBody). The rollout server uses it; the
contract test drives it with sglang's own client and decodes every reply with sglang's types.

- Input: `text` or `input_ids`, one prompt or a batch; `sampling_params`, `rid`, `return_logprob`,
  `logprob_start_len` and `top_logprobs_num` per request or as per-prompt lists.
- Sampling fields: the engine implements SUPPORTED; the fields in OFF are accepted at the value that
  switches them off (and `null` everywhere means sglang's default); anything else is a 400 that names
  the field and lists what is supported. Unknown sampling fields are a 400, as in sglang.
- Replies: sglang's shape, `meta_info` with every key sglang sets (id, finish_reason, prompt_tokens,
  completion_tokens, cached_tokens, reasoning_tokens, num_retractions, weight_version, e2e_latency,
  and with return_logprob the input/output logprobs, their top-k and output_token_logprobs_length).
  Stop strings and stop tokens are trimmed from `text` unless `no_stop_trim`; `output_ids` keep them.
- One extension, off unless asked for: `"return_logprob_packed": true` (with return_logprob) puts each
  output's logprobs in `meta_info.output_token_logprobs_packed`, base64 of little-endian float32, instead of
  the `[logprob, token_id, null]` list (`unpack_logprobs` reads it). Our controller asks for it from our own
  servers: a 512 x 128 reply shrinks from 2.6 MB of JSON to about 0.9 MB.
"""

from __future__ import annotations

import base64
import struct
import threading
import time
import uuid
from dataclasses import astuple, dataclass, field
from typing import Any, Callable

from rlhf.errors import BadRequest
from rlhf.rollout.engine import SamplingParams, StepControl

SGLANG_VERSION = "0.5.23"

# sampling fields the native engine implements, with sglang's defaults (None: no value)
SUPPORTED: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0,
    "n": 1, "stop": None, "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "sampling_seed": None,
}
# sglang sampling fields the engine does not implement: accepted only at the value that switches them off
OFF: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop_regex": None,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "custom_params": None, "beam_width": None, "watermark": None, "choice": None,
}
ALL_TOP_K = 1 << 30  # sglang's "no top-k" (its contract's default)
# request fields sglang has and the native engine does not serve (a 400 when set)
UNSUPPORTED_REQUEST = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "lora_id",
                       "token_ids_logprob", "return_hidden_states", "custom_logit_processor", "session_params",
                       "bootstrap_host", "bootstrap_port", "bootstrap_room", "return_routed_experts", "kv_hints")
PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


@dataclass
class Prompt:
    """One prompt of a /generate call, with everything that shapes its replies."""

    ids: list[int]
    rid: str
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream_interval: int = 1
    prefill_only: bool = False  # max_new_tokens 0: nothing to generate

    def engine_key(self) -> tuple:
        """Prompts with equal keys run in one engine call."""
        return astuple(self.sampling) + (self.return_logprob, self.top_logprobs_num)


@dataclass
class GenerateCall:
    prompts: list[Prompt]
    batch: bool  # the reply is a list (batch input, or n > 1)
    stream: bool = False
    return_text_in_logprobs: bool = False
    packed_logprobs: bool = False  # return_logprob_packed (our extension)
    rows: dict[str, Any] | None = None  # rlhf_rows (our extension, rollout.data_plane store): keep the rows here
    started: float = field(default_factory=time.time)
    # outputs stopped by /pause_generation mode retract, to go on after /continue_generation: (index in the reply,
    # prompt index, sample index, the raw result so far)
    retracted: list[tuple[int, int, int, dict[str, Any]]] = field(default_factory=list)


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value == off or value in ("", [], {}, ())


def parse_sampling(params: Any) -> tuple[SamplingParams, dict[str, Any]]:
    """sglang sampling_params -> (engine SamplingParams, the text-side options). Raises BadRequest."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(SUPPORTED) - set(OFF))
    if unknown:
        raise BadRequest(f"sampling_params: unknown field(s) {unknown}; valid: {sorted(set(SUPPORTED) | set(OFF))}")
    unsupported = sorted(k for k, off in OFF.items() if k in params and not _is_off(params[k], off))
    if unsupported:
        raise BadRequest(f"sampling_params: {unsupported} not supported by the native engine (only at their "
                         f"default, which switches them off); supported: {sorted(SUPPORTED)}")
    p = {k: (v if params.get(k) is None else params[k]) for k, v in SUPPORTED.items()}
    for name, kind in [("max_new_tokens", int), ("top_k", int), ("n", int), ("min_new_tokens", int)]:
        if not isinstance(p[name], int) or isinstance(p[name], bool):
            raise BadRequest(f"sampling_params.{name} must be an integer, got {p[name]!r}")
    for name in ("temperature", "top_p", "min_p"):
        if not isinstance(p[name], (int, float)) or isinstance(p[name], bool):
            raise BadRequest(f"sampling_params.{name} must be a number, got {p[name]!r}")
    stop = p["stop"]
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"sampling_params.stop must be a string or a list of non-empty strings, got {p['stop']!r}")
    top_k = -1 if p["top_k"] >= ALL_TOP_K else p["top_k"]
    try:
        if p["max_new_tokens"] < 0:
            raise ValueError(f"max_new_tokens {p['max_new_tokens']} (at least 0)")
        sampling = SamplingParams.from_dict({  # with the engine's range checks
            "max_new_tokens": max(1, p["max_new_tokens"]), "temperature": float(p["temperature"]),
            "top_p": float(p["top_p"]), "top_k": top_k, "stop_token_ids": [int(i) for i in p["stop_token_ids"] or ()],
            "n": p["n"], "ignore_eos": bool(p["ignore_eos"]), "min_new_tokens": p["min_new_tokens"],
            "min_p": float(p["min_p"]), "sampling_seed": p["sampling_seed"]})
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"sampling_params: {exc}") from None
    text_side = {"stop": stop, "no_stop_trim": bool(p["no_stop_trim"]), "skip_special_tokens": bool(p["skip_special_tokens"]),
                 "spaces_between_special_tokens": bool(p["spaces_between_special_tokens"]),
                 "stream_interval": max(1, int(p["stream_interval"] or 1)), "max_new_tokens": p["max_new_tokens"]}
    return sampling, text_side


def parse_generate(body: Any, tokenizer: Any) -> GenerateCall:
    """A /generate JSON body -> GenerateCall. Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the /generate body must be a JSON object")
    unsupported = [k for k in UNSUPPORTED_REQUEST if not _is_off(body.get(k), False)]
    if unsupported:
        raise BadRequest(f"/generate: {unsupported} not supported by the native engine; supported request fields: "
                         "rid, text, input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, "
                         "return_text_in_logprobs, stream")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("/generate needs exactly one of text and input_ids")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        if tokenizer is None:
            raise BadRequest("text input needs a tokenizer; send input_ids")
        prompts_ids = [list(tokenizer.encode(t)) for t in texts]
    else:
        batch = bool(ids) and isinstance(ids[0], list)
        prompts_ids = ids if batch else [ids]
        if not prompts_ids or not all(isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool)
                                                                        for i in p) for p in prompts_ids):
            raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    if any(not p for p in prompts_ids):
        raise BadRequest("every prompt needs at least one token")
    count = len(prompts_ids)

    def per_prompt(name: str, default: Any) -> list[Any]:
        value = body.get(name)
        if isinstance(value, list):
            if not batch:
                raise BadRequest(f"{name} is a list but the input is one prompt")
            if len(value) != count:
                raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
            return [default if v is None else v for v in value]
        return [default if value is None else value] * count

    params = per_prompt("sampling_params", {})
    given_rids = body.get("rid")
    rids = per_prompt("rid", None)
    if isinstance(given_rids, str) and batch:
        rids = [f"{given_rids}-{i}" for i in range(count)]  # sglang: a string rid is the batch's prefix
    rids = [r if r is not None else uuid.uuid4().hex for r in rids]
    logprob = per_prompt("return_logprob", False)
    start = per_prompt("logprob_start_len", -1)
    top = per_prompt("top_logprobs_num", 0)
    prompts = []
    for i, p in enumerate(prompts_ids):
        sampling, opts = parse_sampling(params[i])
        if not isinstance(top[i], int) or top[i] < 0 or not isinstance(start[i], int):
            raise BadRequest(f"top_logprobs_num and logprob_start_len must be integers (prompt {i})")
        prompt = Prompt(list(p), str(rids[i]), sampling, opts["stop"], opts["no_stop_trim"], opts["skip_special_tokens"],
                        opts["spaces_between_special_tokens"], bool(logprob[i]), start[i], top[i],
                        opts["stream_interval"], opts["max_new_tokens"] == 0)
        prompts.append(prompt)
    n_out = sum(p.sampling.n for p in prompts)
    return GenerateCall(prompts, batch or n_out > 1, bool(body.get("stream", False)),
                        bool(body.get("return_text_in_logprobs", False)), bool(body.get("return_logprob_packed", False)))


def pack_logprobs(values: list[float]) -> str:
    """Logprobs as base64 of little-endian float32 (the engine computes them in float32: nothing is lost)."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def unpack_logprobs(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def output_logprobs(result: dict[str, Any]) -> list[float]:
    """A /generate output's token logprobs, packed (return_logprob_packed) or sglang's [logprob, id, text] list."""
    meta = result.get("meta_info") or {}
    if "output_token_logprobs_packed" in meta:
        return unpack_logprobs(meta["output_token_logprobs_packed"])
    return [lp for lp, _t, _ in meta.get("output_token_logprobs") or []]


class RequestControl(StepControl):
    """One engine call's abort, pause, stop strings and stream, between decode steps.

    rows: the call's output rows -> (prompt, its index within the call). Stop strings are checked on the
    decoded text of each running row; `on_tokens(control, t, rows, finished)` (streaming) sees every step.
    """

    def __init__(self, prompts: list[Prompt], tokenizer: Any, on_tokens: Callable | None = None,
                 hold: Callable[[RequestControl], None] | None = None) -> None:
        """hold: called first at every step; it may block the call there (/pause_generation mode in_place)."""
        self.prompts, self.tokenizer, self.on_tokens, self.hold = prompts, tokenizer, on_tokens, hold
        self.rows = [(p, j) for p in prompts for j in range(p.sampling.n)]
        self.ids = [output_id(p, j) for p, j in self.rows]  # what each row's reply calls itself
        self.rids = {p.rid for p in prompts} | set(self.ids)
        self.wants_tokens = on_tokens is not None or any(p.stop for p in prompts)
        self.generated: list[list[int]] = [[] for _ in self.rows]
        self._abort: dict[str, str] = {}  # rid -> message ("*": all)
        self._lock = threading.Lock()
        self.decode_steps = 0  # decode steps the call has run (the server's /server_info shows its progress)

    @property
    def aborting(self) -> bool:
        return bool(self._abort)

    def abort(self, rid: str = "*", message: str = "aborted by /abort_request") -> bool:
        """Finish a request's rows (its rid: all n samples; an output's id: that sample; "*": every row) after the
        current step; True if this call has the rid."""
        if rid != "*" and rid not in self.rids:
            return False
        with self._lock:
            self._abort[rid] = message
        return True

    def step(self, t: int, rows: list[int] | None, tokens: list[int] | None) -> dict[int, dict[str, Any]]:
        finished: dict[int, dict[str, Any]] = {}
        self.decode_steps = t + 1
        if self.hold is not None:
            self.hold(self)
        with self._lock:
            aborted = dict(self._abort)
        if aborted:
            for r, (p, _j) in enumerate(self.rows):
                message = aborted.get(self.ids[r], aborted.get(p.rid, aborted.get("*")))
                if message is not None:
                    finished[r] = {"type": "abort", "message": message}
        if rows is not None and tokens is not None:
            for r, tok in zip(rows, tokens):
                self.generated[r].append(tok)
                p = self.rows[r][0]
                if p.stop and r not in finished:
                    text = self.tokenizer.decode(self.generated[r], skip_special_tokens=p.skip_special_tokens)
                    matched = next((s for s in p.stop if s in text), None)
                    if matched is not None:
                        finished[r] = {"type": "stop", "matched": matched}
            if self.on_tokens is not None:
                self.on_tokens(self, t, rows, finished)
        return finished


RETRACTED = "retracted by /pause_generation"  # an output's finish_reason message while it waits to go on


def retracted(result: dict[str, Any]) -> bool:
    """Whether an engine result was stopped by /pause_generation mode retract (it goes on after the pause)."""
    finish = result["meta_info"].get("finish_reason") or {}
    return finish.get("type") == "abort" and finish.get("message") == RETRACTED


def resumed(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """One engine result from a retracted output's head and what it generated after the pause (under the weights
    then loaded): tokens, logprobs and each token's weights version joined, the tail's finish and version."""
    hm, tm = head["meta_info"], tail["meta_info"]
    versions = list(hm.get("output_token_weight_versions") or [hm["weight_version"]] * len(head["output_ids"]))
    meta = {**tm, "output_token_weight_versions": versions + [tm["weight_version"]] * len(tail["output_ids"]),
            "num_retractions": hm.get("num_retractions", 0) + 1, "cached_tokens": hm.get("cached_tokens", 0),
            "completion_tokens": len(head["output_ids"]) + len(tail["output_ids"])}
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in hm or key in tm:
            meta[key] = list(hm.get(key, [])) + list(tm.get(key, []))
    return {"text": "", "output_ids": list(head["output_ids"]) + list(tail["output_ids"]), "meta_info": meta}


def output_id(prompt: Prompt, j: int) -> str:
    """An output's id: the request's rid, or with n > 1 the rid and the sample's index."""
    return prompt.rid if prompt.sampling.n == 1 else f"{prompt.rid}-{j}"


def decode_text(tokenizer: Any, ids: list[int], prompt: Prompt, finish: dict[str, Any] | None) -> str:
    """The reply's text: stop token or stop string trimmed unless no_stop_trim."""
    if tokenizer is None:
        return ""
    matched = (finish or {}).get("matched")
    if finish and finish.get("type") == "stop" and isinstance(matched, int) and not prompt.no_stop_trim:
        ids = ids[:-1]
    kwargs: dict[str, Any] = {"skip_special_tokens": prompt.skip_special_tokens}
    if not prompt.spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    try:
        text = tokenizer.decode(ids, **kwargs)
    except TypeError as exc:
        raise BadRequest(f"this model's tokenizer cannot decode with {kwargs}: {exc}") from None
    if finish and finish.get("type") == "stop" and isinstance(matched, str) and not prompt.no_stop_trim:
        cut = text.find(matched)
        text = text[:cut] if cut >= 0 else text
    return text


def reply(prompt: Prompt, j: int, result: dict[str, Any] | None, weight_version: str, started: float,
          tokenizer: Any, extra: dict[str, Any] | None = None, text_in_logprobs: bool = False,
          packed: bool = False) -> dict[str, Any]:
    """One output in sglang's shape (result None: max_new_tokens 0, nothing generated)."""
    ids = list(result["output_ids"]) if result else []
    # the engine's count: a group's later samples read the prompt's prefill, its first sample what an earlier
    # prompt of the same call computed
    cached = len(prompt.ids) if j > 0 else 0
    cached = result["meta_info"].get("cached_tokens", cached) if result else cached
    finish = result["meta_info"]["finish_reason"] if result else {"type": "length", "length": 0}
    meta: dict[str, Any] = {
        "id": output_id(prompt, j), "finish_reason": finish, "prompt_tokens": len(prompt.ids), "completion_tokens": len(ids),
        "cached_tokens": cached, "reasoning_tokens": 0,
        "num_retractions": result["meta_info"].get("num_retractions", 0) if result else 0,
        "weight_version": weight_version, "e2e_latency": time.time() - started,
    }
    if result and "output_token_weight_versions" in result["meta_info"]:  # retracted and resumed: the versions span
        meta["output_token_weight_versions"] = result["meta_info"]["output_token_weight_versions"]
    if prompt.return_logprob:
        entries = result["meta_info"].get("output_token_logprobs", []) if result else []
        if packed:
            meta["output_token_logprobs_packed"] = pack_logprobs([e[0] for e in entries])
        else:
            out = [list(e) for e in entries]
            if text_in_logprobs and tokenizer is not None:
                for e in out:
                    e[2] = tokenizer.decode([e[1]])
            meta["output_token_logprobs"] = out
        meta["output_token_logprobs_length"] = len(entries)
        meta["input_token_logprobs"] = (extra or {}).get("input_token_logprobs", [])
        if prompt.top_logprobs_num > 0:
            meta["output_top_logprobs"] = result["meta_info"].get("output_top_logprobs", []) if result else []
            meta["input_top_logprobs"] = (extra or {}).get("input_top_logprobs", [])
    return {"text": decode_text(tokenizer, ids, prompt, finish), "output_ids": ids, "meta_info": meta}
