"""Fault kinds that hold something outside the call (burners, writers, fill files, memory, a device leak): each runs
in a separate target process, so that the same test can SIGKILL it and check what remains."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from rlhf import faults
from rlhf.faults import fault_point
from tests.conftest import ROOT
from tests.test_faults import _disarm, arm, markers  # noqa: F401  (_disarm: the autouse fixture)

TARGET = """
import sys, time
from rlhf import faults
from rlhf.faults.parse import parse_faults_text
faults.arm(sys.argv[1], parse_faults_text(open(sys.argv[2]).read(), "target.yaml"))
faults.fault_point(sys.argv[3], step=1)
print("HIT", flush=True)
if len(sys.argv) > 4:
    time.sleep(float(sys.argv[4]))
    faults.restore_all("test done")
    print("RESTORED", flush=True)
time.sleep(120)
"""


def run_target(tmp_path, yaml_text, point="train.step", restore_after=None, wait=True):
    spec = tmp_path / "target.yaml"
    spec.write_text(textwrap.dedent(yaml_text))
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    os.makedirs(tmp_path / "faults", exist_ok=True)
    args = [sys.executable, str(script), str(tmp_path), str(spec), point]
    if restore_after is not None:
        args.append(str(restore_after))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    if wait:
        line = proc.stdout.readline()
        assert line.strip() == "HIT", proc.stderr.read() if proc.poll() is not None else line
    return proc


def wait_for_marker(run_dir, event, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [m for m in markers(run_dir) if m["event"] == event]
        if found:
            return found[-1]
        time.sleep(0.05)
    pytest.fail(f"no {event} marker in {timeout_s} s: {markers(run_dir)}")


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between two looks, or before the first
        return False


def gone(pids, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [p for p in pids if _alive(p)]:
            return True
        time.sleep(0.05)
    return False


CPU = """
    faults:
      - name: burn
        kind: cpu_contention
        point: train.step
        params: {load: 0.9, burners: 2}
"""
IO = """
    faults:
      - name: writers
        kind: io_contention
        point: train.step
        params: {writers: 2, block_kb: 256, max_mb: 8}
"""
FILL = """
    faults:
      - name: fill
        kind: disk_full
        point: train.step
        params: {mode: fill, fill_mb: 64, keep_free_mb: 512}
"""
MEMORY = """
    faults:
      - name: grow
        kind: memory_pressure
        point: train.step
        params: {rate_mb_s: 2000, cap_mb: 300}
"""


@pytest.mark.parametrize("end", ["restore", "sigkill"])
@pytest.mark.parametrize("kind", ["cpu", "io", "fill", "memory"])
def test_background_kind_has_a_real_effect_and_leaves_nothing(tmp_path, kind, end):
    spec = {"cpu": CPU, "io": IO, "fill": FILL, "memory": MEMORY}[kind]
    proc = run_target(tmp_path, spec, restore_after=1.5 if end == "restore" else None)
    try:
        verify = wait_for_marker(str(tmp_path), "verify")["details"]
        pids, paths = verify.get("pids", []), verify.get("paths", [])
        if kind == "cpu":
            assert len(pids) == 2 and verify["burner_cpu_percent"] > 60  # real CPU burnt
        elif kind == "io":
            assert len(pids) == 2 and verify["bytes_written"] > 0 and all(os.path.exists(p) for p in paths)
        elif kind == "fill":
            assert verify["fill_file_bytes"] == 64 << 20 and os.path.getsize(paths[0]) == 64 << 20
        elif kind == "memory":
            assert verify["held_bytes"] >= 64 << 20 and verify["rss_growth_bytes"] >= 60 << 20
            target = psutil.Process(proc.pid)
            deadline = time.monotonic() + 5
            while target.memory_info().rss < 300 << 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert target.memory_info().rss >= 300 << 20  # grew to the cap: real, touched memory
        if end == "restore":
            assert proc.stdout.readline().strip() == "RESTORED"
            restore = wait_for_marker(str(tmp_path), "restore")
            assert restore["details"]["reason"] == "test done"
            if kind == "memory":
                assert restore["details"]["released_bytes"] == 300 << 20
        else:
            proc.kill()
            proc.wait(10)
            report = faults.audit(str(tmp_path))  # the survivor's leftover audit
            if kind == "fill":
                assert any("removed" in c for c in report["cleaned"])
            assert report["unrestored"] or kind == "memory"
        assert gone(pids), f"helpers still alive: {pids}"
        assert not any(os.path.exists(p) for p in paths), paths
        assert faults.audit(str(tmp_path))["cleaned"] == []  # nothing left to clean a second time
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_device_memory_leak_fails_fresh_allocations_of_every_process_on_that_device(tmp_path):
    """The leaking process keeps going; the next fresh allocation on its device — by anyone — fails."""

    from rlhf import tracing
    from rlhf.services.colocation import device_name, fresh_allocation

    arm(tmp_path, """
        faults:
          - name: leak
            kind: device_memory_leak
            point: events.handle
            target: {role: rollout, rank: 0, peer: rollout_end}
            params: {leak_mb: 70000, capacity_mb: 81920}
    """)
    shared = device_name("train", 0, colocate=True)
    assert shared == device_name("rollout", 0, colocate=True) == "device-0"
    with tracing.use_role("rollout", 0, 3):
        fault_point("events.handle", peer="rollout_start", device=shared)  # another event: nothing
        fresh_allocation(str(tmp_path), shared, 1 << 20, "a buffer")
        fault_point("events.handle", peer="rollout_end", device=shared)  # returns: the leak is silent
    with pytest.raises(torch.OutOfMemoryError, match=r"1.00 MiB for the weights upload buffer \(device-0; 80.00 GiB "
                                                    r"total capacity; 68.36 GiB reserved by another process"):
        fresh_allocation(str(tmp_path), shared, 1 << 20, "the weights upload buffer")  # the train side, later
    fresh_allocation(str(tmp_path), "device-1", 1 << 20, "a buffer")  # another device is unaffected
    inject = next(m for m in markers(tmp_path) if m["event"] == "inject")
    assert inject["emulated"] is True and inject["context"] == {"device": "device-0"}
    faults.restore_all("test")  # the leaking process exits: its memory comes back
    fresh_allocation(str(tmp_path), shared, 1 << 20, "the weights upload buffer")
    assert not list((tmp_path / "devices").glob("*.leak.json"))


def test_process_kill_kills(tmp_path):
    out = run_target(tmp_path, """
        faults:
          - name: kill
            kind: process_kill
            point: train.step
    """, wait=False)
    assert out.wait(30) == -signal.SIGKILL
    assert [m["event"] for m in markers(str(tmp_path))] == ["inject"]
