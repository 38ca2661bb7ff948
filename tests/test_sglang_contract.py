"""The contract with sglang, checked by sglang's own code (the version in tests/sglang-contract.txt).

sglang's wheel is installed without its dependencies (CUDA kernels, torch pins), so only the modules
that load without them are imported, each straight from the installed package without running
sglang/__init__.py: its HTTP client (`RuntimeEndpoint`, `http_request`), its sampling parameters, and
its generated API contract (`sglang/api/v1/api_types.py`, the schema both of sglang's servers answer
by). Our server is driven with sglang's client, our requests are checked by sglang's request decoder,
and every reply is decoded with sglang's response types (which raise on a wrong shape or type).
"""

import ast
import importlib
import importlib.util
import json
import sys
import types

import pytest
import requests

from rlhf.rollout.sglang_api import OFF, SGLANG_VERSION, SUPPORTED
from tests.conftest import SGLANG_KEY as KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
PACKAGES = ("sglang", "sglang.lang", "sglang.lang.backend", "sglang.srt", "sglang.srt.sampling", "sglang.api",
            "sglang.api.v1")


@pytest.fixture(scope="module")
def sglang():
    """sglang's client and contract modules, loaded from the installed wheel without its package __init__s."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed: pip install --no-deps -r tests/sglang-contract.txt")
    root = spec.submodule_search_locations[0]
    saved = {name: sys.modules.get(name) for name in list(sys.modules) if name == "sglang" or name.startswith("sglang.")}
    for name in PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [root + name[len("sglang"):].replace(".", "/")]
        sys.modules[name] = module
    try:
        ns = types.SimpleNamespace(
            api=importlib.import_module("sglang.api.v1.api_types"),
            endpoint=importlib.import_module("sglang.lang.backend.runtime_endpoint"),
            ir=importlib.import_module("sglang.lang.ir"),
            sampling=importlib.import_module("sglang.srt.sampling.sampling_params"),
            version=importlib.import_module("sglang.version").__version__,
            root=root,
        )
        yield ns
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


def test_checked_against_the_pinned_sglang(sglang):
    assert sglang.version == SGLANG_VERSION


def test_we_know_every_sglang_sampling_field_and_its_default(sglang):
    contract = sglang.api.SamplingParams()  # sglang's defaults, from its schema
    fields = set(type(contract).__struct_fields__)
    assert fields == set(SUPPORTED) | set(OFF), "sglang's SamplingParams changed: update SUPPORTED / OFF"
    for name, ours in SUPPORTED.items():
        theirs = getattr(contract, name)
        if name == "top_k":
            assert ours == -1 and theirs == 1 << 30  # both mean "no top-k"; we accept either
        else:
            assert ours == theirs, name
    for name, off in OFF.items():  # what we accept for a field we do not implement is sglang's default
        assert getattr(contract, name) in (off, None, {}, []), name


def test_runtime_endpoint_constructs_generates_and_reads_info(sglang, sglang_server):
    url, model_dir = sglang_server
    endpoint = sglang.endpoint.RuntimeEndpoint(url, api_key=KEY)  # its constructor GETs /get_model_info
    assert endpoint.get_model_name() == model_dir
    sglang.api.GetModelInfoResponse.from_json_value(endpoint.model_info)
    info = endpoint.get_server_info()
    assert sglang.api.GetServerInfoResponse.from_json_value(info).max_context_length > 0
    endpoint.flush_cache()

    class Program:  # what RuntimeEndpoint reads of sglang's StreamExecutor
        text_ = "12+3="
        images_ = []

    params = sglang.ir.SglSamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    text, meta = endpoint.generate(Program(), params)
    meta = sglang.api.GenerateMetaInfo.from_json_value(meta)
    assert meta.completion_tokens == 5 and meta.finish_reason == sglang.api.FinishLength(length=5)
    streamed = "".join(chunk for chunk, _meta in endpoint.generate_stream(Program(), params))
    assert streamed == text
    # token ids through sglang's own request helper (what its Engine/router clients send)
    utils = importlib.import_module("sglang.utils")
    ids = utils.http_request(url + "/generate", json={"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3}},
                             api_key=KEY).json()
    assert sglang.api.GenerateResponse.from_json_value(ids).meta_info.prompt_tokens == 3
    params.return_logprob, params.top_logprobs_num = True, 2
    _, meta = endpoint.generate(Program(), params)
    assert len(sglang.api.GenerateMetaInfo.from_json_value(meta).output_token_logprobs) == 5


REQUESTS = [
    {"text": "1+2=", "sampling_params": {"max_new_tokens": 4}},
    {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True},
    {"text": ["1+2=", "3+4="], "sampling_params": {"max_new_tokens": 3, "n": 2, "stop": ["+"]}},
    {"input_ids": [[1, 5], [1, 6, 7]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 0}],
     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "rid": ["x", "y"]},
    {"text": "9+9=", "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [5], "top_k": 5, "min_p": 0.05,
                                         "min_new_tokens": 1, "top_p": 0.9, "temperature": 0.7}},
]


@pytest.mark.parametrize("body", REQUESTS)
def test_replies_decode_as_sglang_generate_responses(sglang, sglang_server, body):
    url, _ = sglang_server
    sglang.api.GenerateRequest.from_json_value(body)  # a request sglang's own server would admit
    reply = requests.post(url + "/generate", json=body, headers=AUTH, timeout=60).json()
    outputs = reply if isinstance(reply, list) else [reply]
    for out in outputs:
        decoded = sglang.api.GenerateResponse.from_json_value(out)
        assert decoded.meta_info is not None and decoded.meta_info.completion_tokens == len(decoded.output_ids)
        assert decoded.meta_info.id and decoded.meta_info.weight_version is not None
        if body.get("return_logprob"):
            assert decoded.meta_info.output_token_logprobs_length == len(decoded.output_ids)


def test_stream_events_decode_as_sglang_responses(sglang, sglang_server):
    url, _ = sglang_server
    body = {"text": ["1+2=", "3+4="], "sampling_params": {"max_new_tokens": 3}, "stream": True}
    resp = requests.post(url + "/generate", json=body, headers=AUTH, stream=True, timeout=60)
    events = [line.decode()[len("data: "):] for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    indexes = {sglang.api.GenerateResponse.from_json_value(json.loads(e)).index for e in events[:-1]}
    assert indexes == {0, 1}


def test_errors_decode_as_sglang_error_bodies(sglang, sglang_server):
    url, _ = sglang_server
    resp = requests.post(url + "/generate", json={"text": "1", "sampling_params": {"repetition_penalty": 1.3}},
                         headers=AUTH)
    assert resp.status_code == 400
    error = sglang.api.ErrorBody.from_json_value(resp.json()["error"])
    assert "repetition_penalty" in error.message and error.code == 400
    # sglang's client surfaces it as it surfaces its own server's: a RuntimeError carrying the body
    params = sglang.ir.SglSamplingParams(max_new_tokens=2, frequency_penalty=0.5)
    with pytest.raises(RuntimeError, match="frequency_penalty"):
        sglang.endpoint.RuntimeEndpoint(url, api_key=KEY).generate(type("P", (), {"text_": "1", "images_": []})(), params)


def _sglang_source(sglang_root: str, relative: str) -> ast.Module:
    with open(f"{sglang_root}/{relative}", encoding="utf-8") as fh:
        return ast.parse(fh.read())


def test_pause_and_continue_take_sglangs_requests_and_answer_its_replies(sglang, sglang_server):
    """/pause_generation and /continue_generation as sglang's server defines them (its request structs in
    srt/managers/io_struct.py and its routes' replies in srt/entrypoints/http_server.py, read from the installed
    source: those modules need sglang's GPU dependencies to import): every mode it accepts, its default, its
    continue fields, the same reply; and the modes rollout.interrupt offers are exactly sglang's."""
    from rlhf.config import RolloutConfig

    root = sglang.root
    structs = {node.name: node for node in ast.walk(_sglang_source(root, "srt/managers/io_struct.py"))
               if isinstance(node, ast.ClassDef) and node.name in ("PauseGenerationReqInput",
                                                                  "ContinueGenerationReqInput")}
    fields = {name: {stmt.target.id: stmt for stmt in node.body if isinstance(stmt, ast.AnnAssign)}
              for name, node in structs.items()}
    mode = fields["PauseGenerationReqInput"]["mode"]
    modes = [elt.value for elt in mode.annotation.slice.elts]  # Literal["abort", "retract", "in_place"]
    assert mode.value.value == "abort" and sorted(modes) == ["abort", "in_place", "retract"]
    continue_fields = {k: v.value.value for k, v in fields["ContinueGenerationReqInput"].items()}
    replies = {}
    for node in ast.walk(_sglang_source(root, "srt/entrypoints/http_server.py")):
        if isinstance(node, ast.AsyncFunctionDef) and node.name in ("pause_generation", "continue_generation"):
            content = next(kw.value for call in ast.walk(node) if isinstance(call, ast.Call)
                           for kw in call.keywords if kw.arg == "content")
            replies["/" + node.name] = ast.literal_eval(content)
    assert set(replies) == {"/pause_generation", "/continue_generation"}

    url, _ = sglang_server
    for m in modes:
        RolloutConfig(mode="async", interrupt=m)  # each is a valid rollout.interrupt
        paused = requests.post(url + "/pause_generation", json={"mode": m}, headers=AUTH, timeout=30)
        assert paused.status_code == 200 and paused.json() == replies["/pause_generation"], (m, paused.text)
        resumed = requests.post(url + "/continue_generation", json=continue_fields, headers=AUTH, timeout=30)
        assert resumed.status_code == 200 and resumed.json() == replies["/continue_generation"]
    default = requests.post(url + "/pause_generation", json={}, headers=AUTH, timeout=30)  # sglang's default: abort
    assert default.status_code == 200
    requests.post(url + "/continue_generation", json={}, headers=AUTH, timeout=30)
    bad = requests.post(url + "/pause_generation", json={"mode": "drain"}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and "abort, in_place, retract" in bad.text
    after = requests.post(url + "/generate", json={"text": "1+2=", "sampling_params": {"max_new_tokens": 2}},
                          headers=AUTH, timeout=30)
    assert after.status_code == 200  # continued: generation runs again
