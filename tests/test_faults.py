"""Fault points: spec validation, matching, the inline kinds' real effects, markers, restore. The kinds that hold
something outside the call (burners, writers, fill files, memory) are in test_faults_background.py."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from rlhf import clock, faults
from rlhf.errors import HTTPStatusError, RemoteError, RpcConnectionError
from rlhf.faults import afault_point, fault_point
from rlhf.faults.parse import parse_faults_text
from rlhf.faults.spec import FaultSpecError
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import Service, ServiceThread
from tests.conftest import ROOT


def arm(tmp_path, yaml_text):
    os.makedirs(tmp_path / "faults", exist_ok=True)
    return faults.arm(str(tmp_path), parse_faults_text(textwrap.dedent(yaml_text), "test.yaml"))


def markers(run_dir):
    path = os.path.join(run_dir, "faults", "markers.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.disarm()


# ---------------------------------------------------------------------------- spec errors


BAD_SPECS = {
    "unknown kind": ("faults:\n  - kind: netwrk_delay\n    point: rollout.generate\n",
                     ["test.yaml:2", "faults[0].kind", "did you mean 'network_delay'", "kinds: bandwidth_cap, clock_skew"]),
    "unknown point": ("faults:\n  - kind: hang\n    point: rollout.generat\n",
                      ["test.yaml:3", "faults[0].point", "did you mean 'rollout.generate'", "points: weights_update"]),
    "wrong type": ("faults:\n  - kind: network_delay\n    point: rpc.client.send\n    params: {delay_ms: fast}\n",
                   ["test.yaml:4", "faults[0].params.delay_ms", "expected delay in milliseconds, got 'fast'"]),
    "missing field": ("faults:\n  - name: x\n    kind: hang\n", ["test.yaml:2", "missing field 'point'"]),
    "missing param": ("faults:\n  - kind: network_delay\n    point: rpc.client.send\n",
                      ["test.yaml:2", "network_delay needs parameter 'delay_ms'"]),
    "bad role": ("faults:\n  - kind: hang\n    point: train.step\n    target: {role: trainer}\n",
                 ["test.yaml:4", "faults[0].target.role", "did you mean 'train'", "roles: controller"]),
    "unknown param": ("faults:\n  - kind: cpu_contention\n    point: train.step\n    params: {lod: 0.5}\n",
                      ["test.yaml:4", "has no parameter 'lod'", "did you mean 'load'", "its parameters: load, burners"]),
    "yaml syntax": ("faults:\n  - kind: hang\n    point: [train.step\n", ["test.yaml:4", "YAML syntax error"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_a_bad_spec_gives_one_clear_message_with_the_line(case, tmp_path):
    text, expected = BAD_SPECS[case]
    with pytest.raises(FaultSpecError) as err:
        parse_faults_text(text, "test.yaml")
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, (part, message)
    path = tmp_path / "test.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "rlhf.cli", "faults", "validate", str(path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and expected[1] in out.stderr


def test_valid_files_validate_and_list_names_every_kind_and_point(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("faults:\n  - name: d\n    kind: network_delay\n    point: rpc.*\n    target: {role: train, ranks: [0, 1]}\n"
                    "    when: {steps: [2, 3], max_hits: 1}\n    params: {delay_ms: 5}\n")
    out = subprocess.run([sys.executable, "-m", "rlhf.cli", "faults", "validate", str(good)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "1 fault" in out.stdout and "network_delay at rpc.* on train rank 0,1" in out.stdout
    listing = subprocess.run([sys.executable, "-m", "rlhf.cli", "faults", "list"], capture_output=True, text=True,
                             cwd=ROOT).stdout
    for name in faults.KINDS:
        assert f"\n  {name}" in listing
    for point in faults.POINTS:
        assert f"\n  {point} " in listing
    assert "EMULATED" in listing  # emulated kinds say so


def test_a_bad_fault_file_stops_the_trainer_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_SPECS["unknown kind"][0])
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults", str(bad), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "bad.yaml:2: faults[0].kind" in out.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- matching


def test_target_step_and_max_hits_decide_where_a_fault_fires(tmp_path):
    from rlhf import tracing

    arm(tmp_path, """
        faults:
          - name: boom
            kind: exception
            point: train.step
            target: {role: train, rank: 1}
            when: {steps: [3, 4], max_hits: 1}
            params: {error: ValueError, message: injected}
    """)
    with tracing.use_role("train", 0):
        fault_point("train.step", step=3)  # other rank: nothing
    with tracing.use_role("train", 1):
        fault_point("train.step", step=2)  # other step: nothing
        with pytest.raises(ValueError, match="injected"):
            fault_point("train.step", step=3)
        fault_point("train.step", step=4)  # max_hits reached
    m = markers(str(tmp_path))
    assert [x["event"] for x in m] == ["inject"] and m[0]["rank"] == 1 and m[0]["step"] == 3


def test_disarmed_points_do_nothing_and_cost_little():
    faults.disarm()
    t0 = time.perf_counter()
    for _ in range(100_000):
        fault_point("train.step", step=1)
    per_hit = (time.perf_counter() - t0) / 100_000
    assert per_hit < 5e-6  # generous for CI noise; benchmarks/overhead.py reports the real number


# ---------------------------------------------------------------------------- inline kinds


def test_network_delay_waits_the_delay_sync_and_async_and_records_it(tmp_path):
    import asyncio

    arm(tmp_path, """
        faults:
          - name: slow
            kind: network_delay
            point: rpc.client.send
            target: {peer: metaserver}
            params: {delay_ms: 150, jitter_ms: 20}
    """)
    t0 = time.perf_counter()
    fault_point("rpc.client.send", peer="metaserver-0")
    assert 0.125 <= time.perf_counter() - t0 < 0.5
    t0 = time.perf_counter()
    fault_point("rpc.client.send", peer="train-1")  # another peer: no delay
    assert time.perf_counter() - t0 < 0.05
    t0 = time.perf_counter()
    asyncio.run(afault_point("rpc.client.send", peer="metaserver-0"))
    assert time.perf_counter() - t0 >= 0.125
    verify = [m for m in markers(str(tmp_path)) if m["event"] == "verify"]
    assert len(verify) == 2 and all(125 <= v["details"]["measured_ms"] < 500 for v in verify)


@pytest.fixture()
def service():
    svc = Service("metaserver", 0, token="t")
    svc.route("/versions", lambda a, t: {"ok": True, "payload": "x" * 1000})
    thread = ServiceThread(svc)
    thread.start()
    loop = LoopThread()
    yield thread, loop
    loop.close()
    thread.stop()


@pytest.mark.parametrize("mode", ["reset", "truncate"])
def test_network_loss_on_the_server_really_breaks_the_connection(tmp_path, service, mode):
    thread, loop = service
    arm(tmp_path, f"""
        faults:
          - name: loss
            kind: network_loss
            point: rpc.server.handle
            target: {{role: metaserver, peer: /versions}}
            when: {{max_hits: 1}}
            params: {{mode: {mode}}}
    """)
    client = Client(thread.url, "t", peer="metaserver-0")
    with pytest.raises(RpcConnectionError) as err:
        loop.run(client.call("/versions", {}))
    assert ("Payload" in str(err.value) or "payload" in str(err.value)) if mode == "truncate" else True
    assert loop.run(client.call("/versions", {}))[0]["ok"]  # the next request goes through (max_hits 1)
    loop.run(client.close())


def test_dns_failure_is_a_real_resolver_error_seen_as_a_connection_error(tmp_path, service):
    import socket

    thread, loop = service
    arm(tmp_path, """
        faults:
          - name: dns
            kind: dns_failure
            point: events.notify
            target: {peer: rollout-0}
    """)
    client = Client(thread.url, "t", peer="rollout-0")
    with pytest.raises(RpcConnectionError) as err:
        loop.run(client.call("/versions", {}, points=("events.notify",)))
    assert isinstance(err.value.cause, socket.gaierror) and "rollout-0.invalid" in str(err.value)
    loop.run(client.close())


def test_http_error_and_exception_come_back_as_http_replies(tmp_path, service):
    thread, loop = service
    arm(tmp_path, """
        faults:
          - name: unavailable
            kind: http_error
            point: rpc.server.handle
            target: {role: metaserver}
            when: {max_hits: 1}
            params: {status: 503, body: overloaded}
          - name: oom
            kind: exception
            point: rpc.server.handle
            target: {role: metaserver}
            when: {steps: [7]}
            params: {error: OutOfMemoryError}
    """)
    client = Client(thread.url, "t")
    with pytest.raises(HTTPStatusError) as err:
        loop.run(client.call("/versions", {}))
    assert err.value.status == 503 and "overloaded" in err.value.text
    with pytest.raises(RemoteError) as err:
        loop.run(client.call("/versions", {}, step=7))
    assert err.value.info.error_class == "OutOfMemoryError" and "CUDA out of memory" in err.value.info.message
    assert err.value.info.role == "metaserver" and err.value.info.step == 7
    loop.run(client.close())


def test_hang_blocks_until_restored(tmp_path):
    arm(tmp_path, """
        faults:
          - name: stuck
            kind: hang
            point: checkpoint.fsync
    """)
    done = threading.Event()
    threading.Thread(target=lambda: (fault_point("checkpoint.fsync"), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # really blocked
    faults.restore_all("test")
    assert done.wait(5)
    events = [m["event"] for m in markers(str(tmp_path))]
    # the released point records its verify while restore records itself: those two race, inject comes first
    assert events[0] == "inject" and sorted(events[1:]) == ["restore", "verify"], events


def test_device_memory_pressure_is_emulated_and_ends_in_a_device_oom(tmp_path):
    arm(tmp_path, """
        faults:
          - name: grow
            kind: device_memory_pressure
            point: train.step
            params: {capacity_mb: 1000, start_mb: 900, rate_mb_s: 1000}
    """)
    fault_point("train.step", step=1)  # starts the growth, below capacity
    deadline = time.monotonic() + 10
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory.*emulated device budget"):
        while time.monotonic() < deadline:  # the budget fills at 1000 MB/s: the 100 MB left go in ~0.1 s
            fault_point("train.step", step=2)
    assert all(m["emulated"] for m in markers(str(tmp_path)))


def test_disk_full_enospc_at_a_write_point(tmp_path):
    arm(tmp_path, """
        faults:
          - name: full
            kind: disk_full
            point: checkpoint.write
    """)
    with pytest.raises(OSError) as err:
        fault_point("checkpoint.write", path=str(tmp_path / "model.safetensors"))
    assert err.value.errno == errno.ENOSPC and "emulated" in str(err.value)


def test_clock_skew_shifts_the_targets_wall_time_and_is_restored(tmp_path):
    arm(tmp_path, """
        faults:
          - name: skew
            kind: clock_skew
            point: sft.step
            params: {offset_s: -120}
    """)
    fault_point("sft.step", step=1)
    assert clock.now() - time.time() == pytest.approx(-120, abs=0.1)
    faults.restore_all("test")
    assert clock.now() - time.time() == pytest.approx(0, abs=0.1)


def test_a_bare_fault_file_name_finds_the_bundled_scenario(tmp_path, monkeypatch, capsys):
    """`--faults scenario2.yaml` from any directory, as the project's own example command is written."""
    from rlhf.cli_args import make_parser, parse_config
    from rlhf.faults.cli import list_text

    monkeypatch.chdir(tmp_path)  # no scenario2.yaml here
    for name in ("scenario2.yaml", "scenario2"):
        cfg, _ = parse_config(["--faults", name], make_parser("grpo", "test"))
        assert [f["name"] for f in cfg.faults] == ["cpu-contention-rollout1", "oom-kill-rollout1"]
        assert cfg.rollout.servers == 2  # the file's config section applied too
    with pytest.raises(SystemExit):
        parse_config(["--faults", "scenario99.yaml"], make_parser("grpo", "test"))
    assert "no bundled fault file of that name" in capsys.readouterr().err and "scenario2.yaml" in list_text()


def test_a_restarted_process_does_not_fire_again_at_a_step_its_predecessor_hit(tmp_path):
    """A fault in a run that restarts (torchrun --max-restarts, a resumed run, a restarted rollout server) fires
    once per step of the run: the earlier process's markers count, for the step and for max_hits."""
    from rlhf import tracing

    spec = """
        faults:
          - name: boom
            kind: exception
            point: train.step
            target: {role: train, rank: 1}
            when: {steps: [3, 4, 5], max_hits: 2}
            params: {error: ValueError, message: injected}
    """
    os.makedirs(tmp_path / "faults")
    earlier = {"time": 0, "event": "inject", "fault": "boom", "role": "train", "rank": 1, "step": 3, "pid": -1}
    (tmp_path / "faults" / "markers.jsonl").write_text(json.dumps(earlier) + "\nnot json\n")
    arm(tmp_path, spec)
    with tracing.use_role("train", 1):
        fault_point("train.step", step=3)  # the step replayed after the restart runs clean
        with pytest.raises(ValueError, match="injected"):
            fault_point("train.step", step=4)
        fault_point("train.step", step=5)  # max_hits 2: one before the restart, one after
    with open(tmp_path / "faults" / "markers.jsonl") as fh:
        mine = [json.loads(line) for line in fh.readlines()[2:]]
    assert [(m["event"], m["step"]) for m in mine if m["pid"] == os.getpid()] == [("inject", 4)]
