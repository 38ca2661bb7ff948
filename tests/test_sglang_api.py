"""Our rollout server speaks sglang's native API: a real server process (the sglang-style launcher, which
serves only sglang's routes) on an HF model directory, driven over real HTTP as an sglang client would."""

import json
import threading

import pytest
import requests

from rlhf.errors import HTTPStatusError, RemoteError
from rlhf.models import load_tokenizer
from rlhf.transport.client import Client, LoopThread
from tests.conftest import SGLANG_KEY as KEY
from tests.conftest import SGLANG_MAX_QUEUED, wait_until

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(sglang_server):
    return sglang_server


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, headers=AUTH, timeout=60, **kw)


def test_bearer_key_guards_every_route_but_the_probes(server):
    url, _ = server
    assert requests.get(url + "/health").status_code == 200  # open, as in sglang
    assert requests.get(url + "/health_generate").status_code == 200
    assert requests.get(url + "/ready").status_code == 200
    for path in ("/model_info", "/server_info", "/get_model_info"):
        assert requests.get(url + path).status_code == 401
        assert requests.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert requests.get(url + path, headers=AUTH).status_code == 200
    assert requests.post(url + "/generate", json={"text": "1+2="}).status_code == 401
    # strict mode: none of our extensions exist, as on a real sglang server
    for method, path in (("POST", "/events"), ("GET", "/weights_checksum"), ("POST", "/update_weights_from_meta")):
        assert requests.request(method, url + path, json={}, headers=AUTH).status_code == 404


def test_generate_from_text_and_ids_single_and_batch(server):
    url, _ = server
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    one = post(url, "/generate", {"text": "12+3=", "sampling_params": greedy}).json()
    assert isinstance(one, dict) and len(one["output_ids"]) == 5
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5} and meta["completion_tokens"] == 5
    assert {"id", "prompt_tokens", "cached_tokens", "reasoning_tokens", "num_retractions", "weight_version",
            "e2e_latency"} <= set(meta)
    # the same prompt as ids gives the same greedy tokens (text is tokenized as sglang does: with the BOS)
    prompt = load_tokenizer(server[1]).encode("12+3=")
    ids = post(url, "/generate", {"input_ids": prompt, "sampling_params": greedy}).json()
    assert ids["output_ids"] == one["output_ids"] and ids["meta_info"]["prompt_tokens"] == len(prompt)
    batch = post(url, "/generate", {"text": ["12+3=", "7+8="], "rid": ["a", "b"],
                                    "sampling_params": [greedy, {**greedy, "max_new_tokens": 2}]}).json()
    assert [len(r["output_ids"]) for r in batch] == [5, 2]
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b"]
    assert batch[0]["output_ids"] == one["output_ids"]  # per-prompt params; results independent of batching
    # n samples of a prompt come back adjacent; all but the first read the prompt from the cache, and the second
    # prompt's first sample the prefix it has in common with the first prompt (BOS "11+")
    group = post(url, "/generate", {"text": ["11+1=", "11+2="], "sampling_params": {"max_new_tokens": 3, "n": 3}}).json()
    assert len(group) == 6 and [r["meta_info"]["cached_tokens"] for r in group] == [0, 6, 6, 4, 6, 6]
    # null means sglang's default, and max_new_tokens 0 only reads the prompt
    empty = post(url, "/generate", {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 0, "top_p": None},
                                    "return_logprob": True, "logprob_start_len": 0}).json()
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = empty["meta_info"]["input_token_logprobs"]  # max_new_tokens 0 scores the prompt (RL's logprob use)
    assert [e[1] for e in scored] == [1, 5] and scored[0][0] is None and scored[1][0] < 0


def test_bad_input_is_a_400_naming_the_field(server):
    url, _ = server
    cases = [({"text": "1+2=", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
             ({"text": "1+2=", "sampling_params": {"tempreature": 1}}, "tempreature"),
             ({"text": "1+2=", "sampling_params": {"top_p": 0}}, "top_p"),
             ({"text": "1+2=", "input_ids": [1]}, "exactly one of text and input_ids"),
             ({"text": ["a", "b"], "sampling_params": [{}]}, "1 entries for 2 prompts"),
             ({"text": "1+2=", "image_data": "x.png"}, "image_data")]
    for body, needle in cases:
        resp = post(url, "/generate", body)
        assert resp.status_code == 400, (body, resp.text)
        assert needle in resp.json()["error"]["message"]
    # the switched-off value of an unsupported field is accepted (sglang's own client sends them)
    ok = post(url, "/generate", {"text": "1+2=", "sampling_params": {"frequency_penalty": 0.0, "regex": None,
                                                                     "stop": [], "max_new_tokens": 1}})
    assert ok.status_code == 200


def test_stop_strings_tokens_and_logprob_options(server):
    url, _ = server
    def sample(seed, **extra):
        params = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": seed, **extra}
        return post(url, "/generate", {"text": "1+2=", "sampling_params": params}).json()

    seed, free = next((s, r) for s, r in ((s, sample(s)) for s in range(20)) if len(set(r["text"])) >= 6)
    stop = free["text"][3:5]  # a stop string this seeded draw reaches
    cut = sample(seed, stop=stop)
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == free["text"][:free["text"].find(stop)]  # trimmed, as sglang trims
    assert len(cut["output_ids"]) < 12 and free["output_ids"][:len(cut["output_ids"])] == cut["output_ids"]
    kept = sample(seed, stop=[stop, "never-there"], no_stop_trim=True)
    assert kept["text"].endswith(stop)
    # logprobs: output ones always, prompt ones from logprob_start_len, the top-k beside each
    lp = post(url, "/generate", {"text": "1+2=", "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3,
                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()
    meta = lp["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] == 4
    assert [e[1] for e in meta["output_token_logprobs"]] == lp["output_ids"]
    prompt_tokens = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == prompt_tokens - 1 and meta["input_token_logprobs"][0][0] is not None
    assert all(len(row) == 3 for row in meta["output_top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert [row[0][1] for row in meta["output_top_logprobs"]] == lp["output_ids"]


def test_sampling_seed_repeats_a_draw(server):
    url, _ = server
    body = {"text": ["1+1=", "2+3="], "sampling_params": {"max_new_tokens": 8, "n": 4, "sampling_seed": 5}}
    first, second = post(url, "/generate", body).json(), post(url, "/generate", body).json()
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in second]
    assert len({tuple(r["output_ids"]) for r in first}) > 1  # still samples (T = 1), not greedy


def test_stream_sends_events_that_end_in_the_full_reply(server):
    url, _ = server
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = post(url, "/generate", {"text": "3+4=", "sampling_params": params}).json()
    resp = post(url, "/generate", {"text": "3+4=", "sampling_params": params, "stream": True}, stream=True)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    lines = [line.decode() for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert len(chunks) == 7 and texts[-1] == whole["text"]  # one per token, then the final reply
    assert all(whole["text"].startswith(t) for t in texts)  # cumulative, as sglang streams by default
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    thread.start()
    return thread, box


def _internal(url):
    return requests.get(url + "/server_info", headers=AUTH).json()["internal_states"][0]


def test_abort_by_rid_while_running_and_while_paused(server):
    url, _ = server
    long = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
    thread, box = _in_thread(lambda: post(url, "/generate", {"text": "1+1=", "rid": "long",
                                                             "sampling_params": long}).json())
    wait_until(lambda: _internal(url)["running_calls"] == 1, 30, "the long request to run")
    assert post(url, "/abort_request", {"rid": "long"}).status_code == 200
    thread.join(60)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 4000
    # one output of an n > 1 request, by its id: that sample ends, its sibling runs on
    thread, box = _in_thread(lambda: post(url, "/generate", {"text": "1+1=", "rid": "pair",
                                                             "sampling_params": {**long, "n": 2,
                                                                                 "max_new_tokens": 1500}}).json())
    wait_until(lambda: _internal(url)["running_calls"] == 1, 30, "the pair to run")
    post(url, "/abort_request", {"rid": "pair-1"})
    thread.join(60)
    assert [r["meta_info"]["id"] for r in box["out"]] == ["pair-0", "pair-1"]
    assert [r["meta_info"]["finish_reason"]["type"] for r in box["out"]] == ["length", "abort"]
    # paused: new requests wait; one aborted while it waits comes back aborted, with no tokens
    assert post(url, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    thread, box = _in_thread(lambda: post(url, "/generate", {"text": "1+1=", "rid": "queued",
                                                             "sampling_params": {"max_new_tokens": 3}}).json())
    wait_until(lambda: _internal(url)["queued_calls"] == 1, 30, "the request to queue behind the pause")
    assert _internal(url)["paused"] is True
    post(url, "/abort_request", {"rid": "queued"})
    assert post(url, "/continue_generation", {}).status_code == 200
    thread.join(60)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort" and box["out"]["output_ids"] == []
    assert post(url, "/pause_generation", {"mode": "sideways"}).status_code == 400


def test_info_cache_weights_and_memory_routes(server):
    url, model_dir = server
    info = requests.get(url + "/model_info", headers=AUTH).json()
    assert info["model_path"] == model_dir and info["is_generation"] is True and info["model_type"] == "llama"
    server_info = requests.get(url + "/server_info", headers=AUTH).json()
    assert server_info["max_context_length"] > 0 and "sglang API" in server_info["version"]
    flushed = requests.post(url + "/flush_cache", headers=AUTH)
    assert flushed.status_code == 200 and flushed.headers["Content-Type"].startswith("text/plain")
    assert post(url, "/update_weight_version", {"new_version": "v7"}).json()["new_version"] == "v7"
    assert requests.get(url + "/model_info", headers=AUTH).json()["weight_version"] == "v7"
    bad = post(url, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    good = post(url, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "v8"}).json()
    assert good["success"] is True and good["num_paused_requests"] == 0
    assert post(url, "/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 1}}).json()[
        "meta_info"]["weight_version"] == "v8"
    assert post(url, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post(url, "/resume_memory_occupation", {}).status_code == 200
    assert post(url, "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400


def test_our_client_reads_sglang_errors_and_plain_text_replies(server):
    url, _ = server
    loop = LoopThread()
    client = Client(url, KEY, peer="sglang-0")
    try:
        text, _ = loop.run(client.call("/flush_cache"))
        assert text.startswith("Cache flushed")
        with pytest.raises(RemoteError) as typed:  # our server's 400 body is sglang's with our fields added
            loop.run(client.call("/generate", {"text": "1", "sampling_params": {"bogus": 1}}))
        assert typed.value.info.error_class == "BadRequest" and "bogus" in typed.value.info.message
        with pytest.raises(HTTPStatusError) as plain:  # sglang's own {"success": false, "message"} 400
            loop.run(client.call("/update_weights_from_disk", {"model_path": "/nowhere"}))
        assert plain.value.status == 400 and "/nowhere" in str(plain.value) and "sglang-0" in str(plain.value)
    finally:
        loop.run(client.close())
        loop.close()


def test_over_its_queue_limit_the_server_sheds_with_retry_after_and_our_client_retries(server, caplog):
    """shed_load: past --max-queued-requests a call is answered 503 with Retry-After; our client waits and sends
    it again (nothing of it ran), so no request is lost; without retries the 503 is the call's."""
    url, _ = server
    body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}
    loop = LoopThread()
    patient, plain = Client(url, KEY, timeout_s=60, peer="rollout-0", retries=True), Client(url, KEY, peer="rollout-0")
    assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        waiting = [_in_thread(lambda: post(url, "/generate", body).json()) for _ in range(SGLANG_MAX_QUEUED)]
        wait_until(lambda: _internal(url)["queued_calls"] == SGLANG_MAX_QUEUED, 30, "the queue to fill")
        shed = post(url, "/generate", body)
        assert shed.status_code == 503 and int(shed.headers["Retry-After"]) >= 1
        assert "max_queued_requests" in shed.json()["error"]["message"]
        with pytest.raises(HTTPStatusError) as refused:
            loop.run(plain.call("/generate", body))
        assert refused.value.status == 503
        before = _internal(url)["shed_calls"]
        thread, box = _in_thread(lambda: loop.run(patient.call("/generate", body))[0])
        wait_until(lambda: _internal(url)["shed_calls"] > before, 30, "the client's first attempt to be shed")
    finally:
        post(url, "/continue_generation", {})
    thread.join(60)
    assert box["out"]["meta_info"]["completion_tokens"] >= 1  # served on a later attempt
    for t, b in waiting:
        t.join(60)
        assert b["out"]["meta_info"]["completion_tokens"] >= 1
    assert any("over its queue limit" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    loop.run(patient.close())
    loop.run(plain.close())
    loop.close()


@pytest.mark.parametrize("preset", ["hardened", "faithful"])
def test_sigterm_drains_running_calls_then_exits_0_or_drops_them_when_off(tmp_path, preset):
    """graceful_drain: SIGTERM stops new calls (503), the running call is answered in full, the server exits 0;
    off (faithful): it exits at once and the running call gets no reply."""
    import os
    import signal

    from rlhf.config import build_config
    from rlhf.models.hf_dir import write_model_dir
    from rlhf.procs import stop_group
    from tests.conftest import start_sglang_launch

    cfg = build_config("smoke", dotted=[("timeouts.drain_s", 60.0), ("resilience.preset", preset)])
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    proc, url = start_sglang_launch(tmp_path, write_model_dir(str(tmp_path / "m")),
                                    env={"RLHF_RUN_DIR": str(tmp_path), "RLHF_RANK": "0"})
    try:
        tokens = 800  # long enough to be running while the test probes the drain (about 2 s here)
        thread, box = _in_thread(lambda: _post_or_error(url, {"text": "1+1=", "sampling_params": {
            "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}))
        wait_until(lambda: _internal(url)["running_calls"] == 1, 30, "the long call to run")
        os.kill(proc.pid, signal.SIGTERM)
        if preset == "hardened":
            wait_until(lambda: requests.get(url + "/ready").status_code == 503, 30, "/ready to say draining")
            refused = post(url, "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 1}})
            assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
            assert refused.headers["Retry-After"] == "1"
        thread.join(120)
        assert proc.wait(timeout=120) == (0 if preset == "hardened" else 128 + signal.SIGTERM)
        if preset == "hardened":
            assert box["out"]["meta_info"]["completion_tokens"] == tokens  # answered in full
            assert "drained; exiting 0" in (tmp_path / "logs" / "rollout-0.log").read_text()
        else:
            assert isinstance(box["out"], requests.ConnectionError)  # the reply was lost
    finally:
        stop_group(proc)


def _post_or_error(url, body):
    try:
        return post(url, "/generate", body).json()
    except requests.ConnectionError as exc:
        return exc
