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
