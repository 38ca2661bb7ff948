"""Colocation events over real HTTP: acknowledged with retries (tenacity) or fire and forget, per the policy."""

import asyncio
import threading

import pytest

from rlhf.config import build_config
from rlhf.control.events import EVENT_ATTEMPTS, ColocationEvents, EventNotDelivered
from rlhf.control.workers import WorkerGroup
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import Service, ServiceThread


class _Services:
    def __init__(self, rollout):
        self.rollout = rollout


@pytest.fixture()
def pair():
    """train-0 answers every event; rollout-0 swallows the first `lost` events (no reply within the timeout)."""
    release = threading.Event()
    state = {"lost": 0, "seen": 0}

    async def rollout_event(args, tensors):
        state["seen"] += 1
        if state["seen"] <= state["lost"]:  # never answered in time: the controller's call times out
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 5)
        return {"event": args["event"], "ok": True}

    threads = []
    for role, fn in (("train", lambda a, t: {"event": a["event"], "ok": True}), ("rollout", rollout_event)):
        svc = Service(role, 0, "tok")
        svc.route("/events", fn)
        thread = ServiceThread(svc)
        thread.start()
        threads.append(thread)
    loop = LoopThread()

    def make(*overrides):
        cfg = build_config(dotted=[("runtime.colocate", "true"), ("timeouts.event_s", "0.3"), *overrides])
        workers = WorkerGroup([threads[0].url], "tok", loop, 5)
        rollout = [Client(threads[1].url, "tok", peer="rollout-0")]
        return ColocationEvents(cfg.runtime.colocate, cfg.timeouts.event_s, cfg.rollout.backend, cfg.resilience, loop,
                                workers, _Services(rollout))

    yield make, state
    release.set()
    for t in threads:
        t.stop()
    loop.close()


def test_acked_event_is_retried_until_delivered(pair, caplog):
    make, state = pair
    state["lost"] = EVENT_ATTEMPTS - 1
    with caplog.at_level("WARNING", logger="rlhf.controller"):
        replies = make().notify("rollout_start", 4)
    assert [peer for peer, _ in replies] == ["train-0", "rollout-0"]
    assert replies[1][1][0] == {"event": "rollout_start", "ok": True} and state["seen"] == EVENT_ATTEMPTS
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == EVENT_ATTEMPTS - 1 and "event rollout_start to rollout-0: attempt 1 failed (RpcTimeout: no reply from rollout-0" in retries[0]


def test_acked_event_lost_every_time_fails_the_step_naming_the_peer(pair):
    make, state = pair
    state["lost"] = 99
    with pytest.raises(EventNotDelivered, match=r"rollout_end to rollout-0 at step 2: not acknowledged after 3 attempts"):
        make().notify("rollout_end", 2)
    assert state["seen"] == EVENT_ATTEMPTS


def test_without_acked_events_a_lost_event_is_a_warning_and_the_step_goes_on(pair, caplog):
    make, state = pair
    state["lost"] = 99
    with caplog.at_level("WARNING", logger="rlhf.controller"):
        replies = make(("resilience.acked_events", "false")).notify("rollout_end", 2)
    assert dict(replies)["rollout-0"] is None and state["seen"] == 1  # sent once, never retried
    assert any("not delivered (RpcTimeout" in r.getMessage() and "continuing" in r.getMessage() for r in caplog.records)
