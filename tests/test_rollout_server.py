"""Rollout server as a real process over HTTP, with the MetaServer relaying weights."""

import os
import sys

import pytest

from rlhf.config import build_config
from rlhf.data import encode_prompts
from rlhf.errors import HTTPStatusError, RemoteError
from rlhf.procs import spawn, stop_group, wait_for_file
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sglang_api import unpack_logprobs
from rlhf.services.colocation import DeviceLease
from rlhf.services.metaserver import MetaServer
from rlhf.transport.client import Client, LoopThread
from rlhf.weights import checksum, encode_shard, export_state
from tests.conftest import ROOT, diverse_model

TOKEN = "t0k3n"


@pytest.fixture()
def rollout_server(tmp_path):
    procs = []

    def start(colocate=False, rank=0, dotted=None):
        cfg = build_config("smoke", dotted=dotted)
        (tmp_path / "config.yaml").write_text(cfg.to_yaml())
        ready = tmp_path / f"ready-{rank}"
        cmd = [sys.executable, "-m", "rlhf.services.rollout_server", "--run-dir", str(tmp_path), "--rank", str(rank),
               "--config", str(tmp_path / "config.yaml"), "--ready-file", str(ready)] + ["--colocate"] * colocate
        proc = spawn(cmd, env={**os.environ, "RLHF_TOKEN": TOKEN, "PYTHONPATH": ROOT}, cwd=ROOT,
                     log_path=str(tmp_path / f"rollout-{rank}.out"))
        procs.append(proc)
        return wait_for_file(str(ready), 120, proc), proc

    loop = LoopThread()
    yield start, loop, tmp_path
    for p in procs:
        stop_group(p)
    loop.close()


def _publish(meta_url, model, version, loop, shards=2):
    """Upload a model's weights to the MetaServer as `shards` shards, the way train ranks do."""
    client = Client(meta_url, TOKEN)
    state = export_state(model)
    names = sorted(state)

    async def go():
        await client.call("/versions", {"version": version, "shards": shards})
        for s in range(shards):
            part = {n: state[n] for n in names[s::shards]}
            async with (await client.session()).put(f"{meta_url}/weights/{version}/rank{s}",
                                                    data=encode_shard(part, "crc32"),
                                                    headers={"X-RLHF-Token": TOKEN}) as resp:
                assert resp.status == 200, await resp.text()
        await client.close()

    loop.run(go())


def test_weights_via_metaserver_then_generate_matches_in_process_engine(rollout_server):
    start, loop, _ = rollout_server
    url, _ = start()
    meta = MetaServer(TOKEN)
    meta_url = meta.start()
    try:
        model, tok = diverse_model("tiny-llama", seed=8)
        client = Client(url, TOKEN)
        for version in ("1", "2"):
            if version == "2":
                model, tok = diverse_model("tiny-llama", seed=9)
            _publish(meta_url, model, version, loop)
            reply, _ = loop.run(client.call("/update_weights_from_meta",
                                            {"metaserver_url": meta_url, "weight_version": version, "wait_s": 10}))
            assert reply["success"] and reply["weight_version"] == version
            got, _ = loop.run(client.call("/weights_checksum", method="GET"))
            assert got == {"checksum": checksum(export_state(model), "crc32"), "weight_version": version}
        prompts = encode_prompts(tok, ["1+2=", "40+41=", "7+7="])
        params = {"max_new_tokens": 5, "temperature": 0.0}
        remote, _ = loop.run(client.call("/generate", {"input_ids": prompts, "sampling_params": params,
                                                       "return_logprob": True}))
        local = RolloutEngine(model, tok).generate(prompts, params, return_logprob=True)
        assert [r["output_ids"] for r in remote] == [r["output_ids"] for r in local]
        assert all(r["meta_info"]["weight_version"] == "2" for r in remote)
        # our extension: the same logprobs as float32 in base64 (the controller asks our servers for it)
        sampled = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "n": 2, "sampling_seed": 3},
                   "return_logprob": True}
        plain, _ = loop.run(client.call("/generate", sampled))
        packed, _ = loop.run(client.call("/generate", {**sampled, "return_logprob_packed": True}))
        assert [r["output_ids"] for r in packed] == [r["output_ids"] for r in plain]
        assert [unpack_logprobs(r["meta_info"]["output_token_logprobs_packed"]) for r in packed] == \
            [[lp for lp, _t, _ in r["meta_info"]["output_token_logprobs"]] for r in plain]
        assert all("output_token_logprobs" not in r["meta_info"] and
                   r["meta_info"]["output_token_logprobs_length"] == len(r["output_ids"]) for r in packed)
        info, _ = loop.run(client.call("/model_info", method="GET"))
        assert info["model_type"] == "llama" and info["weight_version"] == "2"
    finally:
        meta.stop()


def test_rows_stay_on_the_server_scored_and_a_train_rank_fetches_them_by_id(rollout_server):
    """rollout.data_plane store: /generate with rlhf_rows answers with metadata only (no token, no text), the reward
    functions' values beside each row; POST /rows gives the same tokens and logprobs a plain /generate of the same
    seed gives, in the order asked, naming the ids it does not hold; a bad rlhf_rows is a 400 naming its field."""
    from rlhf.batch.client import RowFetcher, RowsMissing
    from rlhf.models import build_model_and_tokenizer

    start, loop, _ = rollout_server
    url, _ = start(dotted=[("rollout.data_plane", "store")])
    client = Client(url, TOKEN)
    _, tok = build_model_and_tokenizer(build_config("smoke").model)
    prompts = encode_prompts(tok, ["1+2=", "40+41="])
    sampled = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "n": 2, "sampling_seed": 5},
               "return_logprob": True}
    plain, _ = loop.run(client.call("/generate", sampled))
    rows = {"step": 3, "ids": [10, 11, 12, 13], "answers": ["3", "81"], "prompts": ["1+2=", "40+41="],
            "fields": [{}, {}]}
    kept, _ = loop.run(client.call("/generate", {**sampled, "rlhf_rows": rows}))
    assert [r["output_ids"] for r in kept] == [[]] * 4 and {r["text"] for r in kept} == {""}
    assert all("output_token_logprobs" not in r["meta_info"] for r in kept)
    meta = [r["rlhf_row"] for r in kept]
    assert [m["id"] for m in meta] == rows["ids"]
    assert [m["completion_tokens"] for m in meta] == [len(r["output_ids"]) for r in plain]
    assert all(set(m["rewards"]) == {"reward_exact_match"} and m["reward"] == m["rewards"]["reward_exact_match"]
               for m in meta)
    fetcher = RowFetcher(TOKEN, loop)
    got = fetcher.fetch({"ids": [12, 10], "at": [0, 0], "urls": [url], "servers": [0]})
    for (p, o, lp), k in zip(got, (2, 0)):
        assert p == prompts[k // 2] and o == plain[k]["output_ids"]
        assert lp == pytest.approx([x for x, _t, _ in plain[k]["meta_info"]["output_token_logprobs"]], abs=1e-6)
    with pytest.raises(RowsMissing, match=r"rollout-0 .* no longer holds rows \[99\]"):
        fetcher.fetch({"ids": [10, 99], "at": [0, 0], "urls": [url], "servers": [0]}, step=3)
    with pytest.raises(RemoteError, match="BadRequest in rollout-0.*rlhf_rows.answers: 2 entries needed"):
        loop.run(client.call("/generate", {**sampled, "rlhf_rows": {**rows, "answers": ["3"]}}))
    fetcher.close()
    loop.run(client.close())


def test_meta_update_fails_when_a_shard_never_arrives(rollout_server):
    start, loop, _ = rollout_server
    url, _ = start()
    meta = MetaServer(TOKEN)
    meta_url = meta.start()
    try:
        loop.run(Client(meta_url, TOKEN).call("/versions", {"version": "5", "shards": 2}))
        with pytest.raises(RemoteError) as err:
            loop.run(Client(url, TOKEN).call("/update_weights_from_meta",
                                              {"metaserver_url": meta_url, "weight_version": "5", "wait_s": 0.5}))
        assert err.value.info.error_class == "HTTPStatusError" and "504" in err.value.info.message
        assert err.value.info.role == "rollout"
    finally:
        meta.stop()


ROLLOUT_ENDPOINTS = [("POST", "/generate"), ("POST", "/update_weights_from_disk"), ("POST", "/update_weights_from_meta"),
                     ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"), ("POST", "/events"),
                     ("POST", "/abort_request"), ("GET", "/model_info"), ("GET", "/get_model_info"),
                     ("GET", "/server_info"), ("POST", "/flush_cache"), ("POST", "/pause_generation"),
                     ("POST", "/continue_generation"), ("POST", "/update_weight_version"), ("GET", "/weights_checksum"),
                     ("POST", "/weights_checksum"), ("POST", "/init_weights_update_group"),
                     ("POST", "/update_weights_from_distributed"), ("POST", "/destroy_weights_update_group")]
META_ENDPOINTS = [("POST", "/versions"), ("PUT", "/weights/1/rank0"), ("GET", "/weights/1/manifest"),
                  ("GET", "/weights/1/rank0"), ("DELETE", "/weights/1"), ("GET", "/health")]


def test_every_endpoint_rejects_a_request_without_the_token(rollout_server):
    start, loop, _ = rollout_server
    url, _ = start()
    meta = MetaServer(TOKEN)
    meta_url = meta.start()

    async def statuses(base, endpoints, token):
        client = Client(base, token)
        out = []
        for method, path in endpoints:
            try:
                await client.call(path, {}, method=method, timeout_s=10)
                out.append(200)
            except HTTPStatusError as e:
                out.append(e.status)
            except RemoteError:
                out.append(500)
        await client.close()
        return out

    try:
        assert loop.run(statuses(url, ROLLOUT_ENDPOINTS, "")) == [401] * len(ROLLOUT_ENDPOINTS)
        assert loop.run(statuses(meta_url, META_ENDPOINTS, "nope")) == [401] * len(META_ENDPOINTS)
        assert loop.run(statuses(url, [("GET", "/health")], TOKEN)) == [200]
        # sglang leaves its probes open, and so does ours (they tell liveness, nothing else)
        assert loop.run(statuses(url, [("GET", "/health"), ("GET", "/health_generate"), ("GET", "/ready")], "")) == \
            [200, 200, 200]
        # readiness at an expected weight version: open too, 503 naming the version it has
        import requests

        assert requests.get(url + "/ready", params={"weight_version": "0"}, timeout=5).json()["ready"] is True
        late = requests.get(url + "/ready", params={"weight_version": "7"}, timeout=5)
        assert late.status_code == 503 and late.json()["why"] == "weights are version 0, not 7"
    finally:
        meta.stop()


def test_colocated_server_cannot_generate_without_the_device_lease(rollout_server):
    start, loop, run_dir = rollout_server
    url, _ = start(colocate=True)
    client = Client(url, TOKEN)
    req = {"input_ids": [[1, 5, 6]], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(RemoteError) as err:
        loop.run(client.call("/generate", req))
    assert err.value.info.error_class == "DeviceBusy" and "lease" in err.value.info.message
    train_side = DeviceLease(str(run_dir), 0, "train-0")
    train_side.acquire(0)  # the colocated train rank holds device 0
    try:
        with pytest.raises(RemoteError) as err:
            loop.run(client.call("/events", {"event": "rollout_start", "timeout_s": 0.3}))
        assert "out of memory" in err.value.info.message
    finally:
        train_side.release()
    ack, _ = loop.run(client.call("/events", {"event": "rollout_start", "step": 1}))
    assert ack == {"event": "rollout_start", "ack": True, "step": 1}
    out, _ = loop.run(client.call("/generate", req))
    assert len(out) == 1 and len(out[0]["output_ids"]) >= 1
    loop.run(client.call("/events", {"event": "rollout_end"}))
    train_side.acquire(0)  # rollout_end gave the device back: the train side gets it at once
    assert train_side.held
    train_side.release()
