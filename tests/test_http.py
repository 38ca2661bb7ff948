"""HTTP layer: token on every endpoint, typed errors round-trip, faithful bare 500s, tensors, timeouts."""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from rlhf.config.resilience import FAITHFUL, HARDENED
from rlhf.errors import HTTPStatusError, RemoteError, RpcConnectionError, RpcTimeout
from rlhf.transport import wire
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import BARE_500, Service, ServiceThread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BoomError(RuntimeError):
    pass


@pytest.fixture()
def served():
    started = []

    def start(policy=HARDENED):
        svc = Service("train", 3, token="secret", policy=policy)
        release = threading.Event()
        def echo(a, t):
            return {"got": a, "sum": float(sum(v.sum() for v in t.values()))}, {k: v * 2 for k, v in t.items()}

        svc.route("/echo", echo)
        svc.route("/compute_logprobs", echo)  # a real train route: fault peers must name one
        svc.route("/boom", lambda a, t: (_ for _ in ()).throw(BoomError("device out of memory on rank 3")))
        svc.route("/slow", lambda a, t: release.wait(5) and {"ok": True})
        thread = ServiceThread(svc)
        thread.start()
        started.append((thread, release))
        return thread

    loop = LoopThread()
    yield start, loop
    for thread, release in started:
        release.set()
        thread.stop()
    loop.close()


def test_request_without_or_with_wrong_token_is_rejected(served):
    start, loop = served
    srv = start()
    for token in ("", "wrong"):
        with pytest.raises(HTTPStatusError) as err:
            loop.run(Client(srv.url, token).call("/echo", {"x": 1}))
        assert err.value.status == 401
    args, _ = loop.run(Client(srv.url, "secret").call("/echo", {"x": 1}))
    assert args["got"] == {"x": 1}


def test_tensors_travel_as_safetensors_not_pickle(served):
    start, loop = served
    srv = start()
    t = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "ids": torch.tensor([1, 2, 3])}
    body, ctype = wire.encode({"step": 4}, t)
    assert ctype == wire.TENSORS_TYPE and b"pickle" not in body and body[8:9] == b"{"
    args, out = loop.run(Client(srv.url, "secret").call("/echo", {"step": 4}, t))
    assert args["got"] == {"step": 4} and args["sum"] == 21.0
    assert torch.equal(out["w"], t["w"] * 2) and torch.equal(out["ids"], t["ids"] * 2)
    with pytest.raises(ValueError, match="truncated"):
        wire.decode(body[:4] + b"\xff\xff\xff" + body[7:20], wire.TENSORS_TYPE)


def test_typed_error_round_trips_with_who_where_what(served):
    start, loop = served
    srv = start()
    with pytest.raises(RemoteError) as err:
        loop.run(Client(srv.url, "secret").call("/boom", {}, stage="train", step=7))
    info = err.value.info
    assert info.error_class == "BoomError" and "out of memory" in info.message
    assert (info.role, info.rank, info.stage, info.step) == ("train", 3, "train", 7)
    assert info.pid > 0 and info.host and "BoomError" in info.traceback
    assert "train-3" in str(err.value) and "stage train, step 7" in str(err.value)


def test_faithful_mode_yields_a_bare_500(served):
    start, loop = served
    srv = start(FAITHFUL)
    with pytest.raises(HTTPStatusError) as err:
        loop.run(Client(srv.url, "secret").call("/boom", {}, stage="train", step=7))
    assert err.value.status == 500 and err.value.text == BARE_500
    assert "BoomError" not in err.value.text and "memory" not in err.value.text


def test_timeouts_and_refused_connections_are_named(served):
    start, loop = served
    srv = start()
    with pytest.raises(RpcTimeout, match=r"no reply from train-3 \(http://127.0.0.1:\d+/slow\) within 0.3 s"):
        loop.run(Client(srv.url, "secret", peer="train-3").call("/slow", {}, timeout_s=0.3))
    port = srv.port
    srv.stop()
    with pytest.raises(RpcConnectionError, match=f"127.0.0.1:{port}"):
        loop.run(Client(f"http://127.0.0.1:{port}", "secret").call("/echo", {}))


@pytest.mark.parametrize("checksums", [False, True])
def test_data_cut_in_transit_is_silent_without_checksums_and_caught_with_them(served, tmp_path, checksums):
    """network_loss truncate_tensor at the server: without stage_checksums a short tensor passes on; with them
    the receiver names the sender. Only that one behaviour differs between the two servers."""
    from rlhf import faults

    start, loop = served
    srv = start(dataclasses.replace(HARDENED, stage_checksums=checksums))
    faults.arm(str(tmp_path), [{"name": "cut", "kind": "network_loss", "point": "rpc.server.handle",
                                "target": {"role": "train", "rank": 3, "peer": "/compute_logprobs"},
                                "params": {"mode": "truncate_tensor", "cut": 2}}])
    try:
        t = {"w": torch.arange(8, dtype=torch.float32).view(2, 4)}
        client = Client(srv.url, "secret", peer="train-3")
        if not checksums:
            _, out = loop.run(client.call("/compute_logprobs", {}, t))
            assert out["w"].shape == (2, 2) and torch.equal(out["w"], (t["w"] * 2)[:, :2])  # short, and nobody knows
        else:
            with pytest.raises(wire.CorruptPayload, match=r"reply from train-3 to /compute_logprobs: tensor 'w' arrived with "
                                                          r"shape \[2, 2\].*sent with shape \[2, 4\]"):
                loop.run(client.call("/compute_logprobs", {}, t))
    finally:
        faults.disarm()


def test_only_idempotent_requests_are_retried_after_a_transient_failure(served, caplog):
    """A 503 the first time: /compute_logprobs (idempotent) is sent again and succeeds, with a WARNING and a span
    event; /train_step (an optimizer step) never is; without the policy's retry_idempotent neither is."""
    from aiohttp import web

    _, loop = served
    svc = Service("train", 3, token="secret")
    hits = {"/compute_logprobs": 0, "/train_step": 0}

    def flaky(path):
        async def handler(request):
            hits[path] += 1
            if hits[path] == 1:
                return web.Response(status=503, text="busy")
            return web.json_response({"ok": True, "attempt": hits[path]})
        return handler

    for path in hits:
        svc.raw_route("POST", path, flaky(path))
    svc_thread = ServiceThread(svc)
    svc_thread.start()
    try:
        _retries(svc_thread, loop, hits, caplog)
    finally:
        svc_thread.stop()


def _retries(svc_thread, loop, hits, caplog):
    client = Client(svc_thread.url, "secret", timeout_s=5, retries=True)
    plain = Client(svc_thread.url, "secret", timeout_s=5)
    try:
        _check_retries(client, plain, loop, hits, caplog)
    finally:
        loop.run(client.close())
        loop.run(plain.close())


def _check_retries(client, plain, loop, hits, caplog):
    with caplog.at_level("WARNING", logger="rlhf.client"):
        args, _ = loop.run(client.call("/compute_logprobs", {}))
    assert args == {"ok": True, "attempt": 2}
    assert any("retrying POST /compute_logprobs" in r.message and "attempt 2 of 3" in r.message for r in caplog.records)
    with pytest.raises(HTTPStatusError) as err:
        loop.run(client.call("/train_step", {}))
    assert err.value.status == 503 and hits["/train_step"] == 1  # not repeated
    hits["/compute_logprobs"] = 0
    with pytest.raises(HTTPStatusError):
        loop.run(plain.call("/compute_logprobs", {}))
    assert hits["/compute_logprobs"] == 1


def test_a_process_computes_on_its_computing_service_thread_and_every_other_thread_is_serial():
    """One OpenMP pool a process (rlhf.procs.own_threads): the computing service's thread runs torch ops with its
    threads; the main thread and threads started later run them serially, so they start no pool of their own."""
    script = """
import json, threading, psutil, torch
from rlhf.procs import own_threads
from rlhf.transport.http import Service
own_threads(1)
compute = Service("train", 0, "t", threads=2)
other = Service("metaserver", 0, "t")  # not a computing service: serial
big = torch.randn(512, 512)
def threads_after(fn):
    before = psutil.Process().num_threads()
    fn()
    return psutil.Process().num_threads() - before
seen = {"main": torch.get_num_threads(), "main_pool": threads_after(lambda: big @ big)}
seen["compute"] = compute.executor.submit(torch.get_num_threads).result()
seen["compute_pool"] = compute.executor.submit(threads_after, lambda: [big @ big for _ in range(3)]).result()
seen["other"] = other.executor.submit(torch.get_num_threads).result()
later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads(),
                                                    later_pool=threads_after(lambda: big @ big)))
later.start(); later.join()
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert (seen["main"], seen["compute"], seen["other"], seen["later"]) == (1, 2, 1, 1), seen
    assert seen["compute_pool"] == 1, seen  # its own pool: one OpenMP worker beside the thread itself
    assert seen["main_pool"] == 0 and seen["later_pool"] == 0, seen  # serial threads start no pool


def test_a_parked_worker_thread_runs_what_is_submitted_meanwhile_then_returns_to_its_call():
    """rlhf.transport.worker.WorkerThread (the rollout server's engine thread): a call that parks the thread waits
    there while later submissions still run on the same thread, in order; it returns once its condition holds."""
    import threading

    from rlhf.transport.worker import WorkerThread
    from tests.conftest import wait_until

    worker = WorkerThread("test-worker")
    release = threading.Event()
    seen = []

    def held():
        seen.append(("held", threading.current_thread().name))
        worker.park(release.is_set)
        return "resumed"

    try:
        first = worker.submit(held)
        wait_until(lambda: worker.parked, 10, "the call to park")
        second = worker.submit(lambda: threading.current_thread().name)
        assert second.result(10) == "test-worker" and not first.done()  # served while the first is parked
        failing = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(10)
        release.set()
        worker.wake()
        assert first.result(10) == "resumed" and not worker.parked
        with pytest.raises(RuntimeError, match="worker thread only"):
            worker.park(lambda: True)
    finally:
        worker.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.submit(int)


def test_a_peer_clock_is_read_off_its_reply_and_named_once():
    """rlhf.clock: the peer's stamp against the midpoint of the request's send and receive, +/- half the round trip;
    named when off by more than the tolerance beyond that, once, and again only when it moved by more than the
    tolerance beyond both readings' uncertainty."""
    from rlhf import clock

    clock.watch(2.0)
    try:
        assert clock.observe("1001.0 4242", 1000.0, 1000.2) is None  # 0.9 s: within the tolerance
        assert clock.observe("1061.0 4242", 1000.0, 1002.0) == (60.0, 1.0, 4242)  # 60 s ahead, +/- 1 s
        assert clock.observe("1063.0 4242", 1000.0, 1000.2) is None  # 62.9 s: the same finding within the errors
        assert clock.observe("1010.0 4242", 1000.0, 1000.2)[0] == pytest.approx(9.9)  # it moved: named again
        assert clock.observe("990.0 4343", 1000.0, 1000.2)[0] == pytest.approx(-10.1)  # another process, behind
        assert clock.observe("1061.0 4444", 1000.0, 1130.0) is None  # a 130 s round trip hides 60 s
        assert clock.observe("garbage", 0.0, 0.0) is None
    finally:
        clock.watch(0.0)
        clock._reported.clear()
    assert clock.observe("1061.0 4545", 1000.0, 1000.2) is None  # a process that does not watch names nothing
