"""migrate_requests: the rollout stage keeps its full batch when a server fails or aborts mid-rollout.

Real HTTP to a real rollout server process (`rlhf.services.sglang_launch`, the session's `sglang_server`)
and a real dead port beside it; the end-to-end runs (a SIGKILLed server, a server that times out) are
scenarios 2 and 7 hardened in tests/test_scenarios.py.
"""

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import requests

from rlhf.config import RolloutConfig, SamplingConfig, TaskConfig
from rlhf.config.resilience import Policy
from rlhf.control.fleet import free_port
from rlhf.control.rollout_fanout import RolloutFanout
from rlhf.errors import RpcConnectionError
from rlhf.models import load_tokenizer
from rlhf.tasks import build_task
from rlhf.transport.client import Client, LoopThread
from tests.conftest import SGLANG_KEY, wait_until

GROUP = 4


@pytest.fixture
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


def fanout(url, loop, model_dir, dead=0, max_new_tokens=6, **policy):
    servers = [Client(url, SGLANG_KEY, 30, peer="rollout-0")]
    servers += [Client(f"http://127.0.0.1:{free_port()}", SGLANG_KEY, 30, peer=f"rollout-{r + 1}") for r in range(dead)]
    return RolloutFanout(RolloutConfig(group_size=GROUP), SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0),
                         False, dataclasses.replace(Policy(), **policy), loop, SimpleNamespace(rollout=servers),
                         load_tokenizer(model_dir))


def examples(k):
    return build_task(TaskConfig()).split("train")[:k]


def test_the_groups_of_a_dead_server_are_generated_on_the_one_that_answers(sglang_server, loop):
    url, model_dir = sglang_server
    batch = fanout(url, loop, model_dir, dead=2)
    problems = examples(6)
    memory = batch.generate(1, problems)
    assert batch.migrated == 4 * GROUP  # rollout-1 and rollout-2 had 2 prompts each
    assert len(memory) == 6 * GROUP
    # whole groups, in prompt order: each prompt's group_size samples are adjacent
    assert memory["prompts"] == [p.prompt for p in problems for _ in range(GROUP)]
    assert all(len(lps) == len(ids) > 0 for lps, ids in zip(memory["logprobs"], memory["output_ids"]))
    # off: strict_rollout names the dead server; and without it the seeds' controller drops its samples
    with pytest.raises(RpcConnectionError, match="rollout-1"):
        fanout(url, loop, model_dir, dead=2, migrate_requests=False).generate(1, problems)
    short = fanout(url, loop, model_dir, dead=2, migrate_requests=False, strict_rollout=False).generate(1, problems)
    assert len(short) == 2 * GROUP
    # evaluation migrates too
    assert len(batch.greedy(problems)) == 6


def test_samples_aborted_mid_rollout_continue_from_their_tokens(sglang_server, loop):
    """/abort_request while the step's call runs: every sample comes back aborted with the tokens it has; each
    continues from them (prompt + tokens in, the rest of max_new_tokens) and ends at full length."""
    url, model_dir = sglang_server
    long = 600
    batch = fanout(url, loop, model_dir, max_new_tokens=long)
    batch.sampling.ignore_eos = True
    auth = {"Authorization": f"Bearer {SGLANG_KEY}"}

    def running():
        return requests.get(url + "/server_info", headers=auth).json()["internal_states"][0]["running_calls"] == 1

    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("memory", batch.generate(2, examples(2))), daemon=True)
    thread.start()
    wait_until(running, 30, "the step's call to run")
    assert requests.post(url + "/abort_request", json={"abort_all": True}, headers=auth).status_code == 200
    thread.join(120)
    memory = box["memory"]
    assert batch.migrated == 2 * GROUP  # every sample was aborted with tokens and continued
    assert [len(ids) for ids in memory["output_ids"]] == [long] * (2 * GROUP)
    assert [len(lps) for lps in memory["logprobs"]] == [long] * (2 * GROUP)
    assert memory["num_tokens"] == [len(p) + long for p in memory["prompt_ids"]]


def generate_in_background(url, body):
    """A /generate call on a thread (not started): the thread and the box its reply lands in ("reply")."""
    box = {}
    auth = {"Authorization": f"Bearer {SGLANG_KEY}"}
    thread = threading.Thread(target=lambda: box.setdefault("reply", requests.post(
        url + "/generate", json=body, headers=auth, timeout=120).json()), daemon=True)
    return thread, box


def server_state(url):
    auth = {"Authorization": f"Bearer {SGLANG_KEY}"}
    return requests.get(url + "/server_info", headers=auth).json()["internal_states"][0]


def new_version_while_paused(url, mode, thread, check=None):
    """Start `thread` (a /generate under way), wait until its call decodes, pause the server in `mode`, run
    `check`, set the weights version to "next", continue; the thread's reply then comes. Returns the version before
    (restored after)."""
    auth = {"Authorization": f"Bearer {SGLANG_KEY}"}
    before = requests.get(url + "/health", headers=auth).json()["weight_version"]

    def decoding():  # some tokens generated: the head that the old version writes
        return requests.get(url + "/server_info", headers=auth).json()["internal_states"][0]["running_decode_steps"] > 2

    thread.start()
    wait_until(decoding, 30, "the call to decode")
    try:
        assert requests.post(url + "/pause_generation", json={"mode": mode}, headers=auth).status_code == 200
        if check is not None:
            check()
        assert requests.post(url + "/update_weight_version", json={"new_version": "next", "abort_all_requests": False},
                             headers=auth).json()["success"]
    finally:
        requests.post(url + "/continue_generation", json={}, headers=auth)
    thread.join(120)
    requests.post(url + "/update_weight_version", json={"new_version": before}, headers=auth)
    return before


def test_a_sample_paused_by_abort_and_continued_carries_each_tokens_weights_version(sglang_server, loop):
    """rollout.interrupt abort: /pause_generation (mode abort) ends the step's call with the tokens each sample
    has; the weights version changes while paused; after /continue_generation every sample goes on from its tokens
    under the new version. Each token carries the version that generated it, and the sample's weight_version (what
    the staleness bound counts) is its oldest token's."""
    url, model_dir = sglang_server
    long = 600
    batch = fanout(url, loop, model_dir, max_new_tokens=long)
    batch.sampling.ignore_eos = True
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("memory", batch.generate(2, examples(1))), daemon=True)
    before = new_version_while_paused(url, "abort", thread)
    memory = box["memory"]
    assert batch.migrated == GROUP and [len(ids) for ids in memory["output_ids"]] == [long] * GROUP
    for versions in memory["token_versions"]:
        assert len(versions) == long and versions[0] == before and versions[-1] == "next"
        cut = versions.index("next")  # the head under the old version, the rest under the new
        assert 0 < cut and set(versions[:cut]) == {before} and set(versions[cut:]) == {"next"}
    assert memory["weight_version"] == [before] * GROUP


def test_retract_stops_a_call_at_a_decode_step_and_it_goes_on_under_the_new_version(sglang_server):
    """/pause_generation mode retract (rollout.interrupt's default): the running call stops at the next decode step
    and waits, tokens kept; the version changes; after /continue_generation it goes on from its tokens and replies
    once, at full length, each token's version recorded and the retraction counted (sglang's num_retractions)."""
    url, _model_dir = sglang_server
    long = 400
    body = {"input_ids": [[1, 5, 6], [1, 7]], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": long, "ignore_eos": True, "n": 2}}
    thread, box = generate_in_background(url, body)

    def stopped_not_answered():
        state = server_state(url)
        assert state["running_calls"] == 0 and state["paused"] and "reply" not in box

    before = new_version_while_paused(url, "retract", thread, stopped_not_answered)
    outputs = box["reply"]
    assert len(outputs) == 4
    for out in outputs:
        meta = out["meta_info"]
        assert len(out["output_ids"]) == long and meta["finish_reason"]["type"] == "length"
        assert meta["num_retractions"] == 1 and meta["weight_version"] == "next"
        assert len(meta["output_token_logprobs"]) == long
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]  # the prompt's, as without the pause
        versions = meta["output_token_weight_versions"]
        cut = versions.index("next")
        assert len(versions) == long and 2 < cut < long
        assert set(versions[:cut]) == {before} and set(versions[cut:]) == {"next"}


def test_in_place_holds_a_call_with_its_cache_while_the_weights_change_under_it(sglang_server, tmp_path):
    """/pause_generation mode in_place: the running call stops at its next decode step and stays there, still
    running (its KV cache kept); a weights load from disk meanwhile runs on the engine's thread that holds it; after
    /continue_generation the call goes on from the same cache under the new weights: one reply, no retraction, no
    second prefill, each token's version recorded, and the tokens after the switch are the new weights' (greedy: the
    same call unpaused under the old weights gives the same head and another tail)."""
    from safetensors.torch import load_file, save_file

    url, model_dir = sglang_server
    auth = {"Authorization": f"Bearer {SGLANG_KEY}"}
    long = 400
    body = {"input_ids": [1, 5, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": long, "ignore_eos": True, "temperature": 0}}
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    tensors = load_file(f"{model_dir}/model.safetensors")
    save_file({k: -v if "lm_head" in k or "embed_tokens" in k else v for k, v in tensors.items()},
              str(flipped / "model.safetensors"))
    thread, box = generate_in_background(url, body)

    def held():
        state = server_state(url)
        assert state["running_calls"] == 1 and state["held"] and "reply" not in box
        steps = state["running_decode_steps"]
        load = requests.post(url + "/update_weights_from_disk", headers=auth, timeout=60,
                             json={"model_path": str(flipped), "weight_version": "next"})
        assert load.status_code == 200 and load.json()["success"], load.text
        state = server_state(url)
        assert state["running_decode_steps"] == steps and "reply" not in box  # still held where it stopped

    try:
        before = new_version_while_paused(url, "in_place", thread, held)
        reply = box["reply"]
    finally:
        requests.post(url + "/update_weights_from_disk", headers=auth, timeout=60,
                      json={"model_path": model_dir, "weight_version": "0"})
    unpaused = requests.post(url + "/generate", json=body, headers=auth, timeout=120).json()  # the old weights
    meta = reply["meta_info"]
    assert len(reply["output_ids"]) == long and meta["num_retractions"] == 0 and meta["weight_version"] == "next"
    assert meta["cached_tokens"] == 0 and len(meta["output_token_logprobs"]) == long
    versions = meta["output_token_weight_versions"]
    cut = versions.index("next")
    assert len(versions) == long and 2 < cut < long
    assert set(versions[:cut]) == {before} and set(versions[cut:]) == {"next"}
    assert reply["output_ids"][:cut] == unpaused["output_ids"][:cut]
    assert reply["output_ids"][cut:] != unpaused["output_ids"][cut:]
