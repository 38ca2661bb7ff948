"""The device lease: a real cross-process lock, named holders, dropped by the kernel when the holder dies."""

import subprocess
import sys

import pytest

from rlhf.services.colocation import DeviceBusy, DeviceLease, device_name, fresh_allocation, leak_path


def test_lease_is_exclusive_and_names_its_holder(tmp_path):
    train = DeviceLease(str(tmp_path), 0, "train-0")
    rollout = DeviceLease(str(tmp_path), 0, "rollout-0")
    train.acquire(0)
    assert train.held and train.current_holder().startswith("train-0 pid ")
    with pytest.raises(DeviceBusy, match=r"device 0: out of memory — held by train-0 pid \d+.*rollout-0 waited 0.05 s"):
        rollout.acquire(0.05)
    train.release()
    rollout.acquire(0)
    assert rollout.held and rollout.current_holder().startswith("rollout-0")
    DeviceLease(str(tmp_path), 1, "train-1").acquire(0)  # another device is another lock
    rollout.release()
    rollout.release()  # twice is harmless


def test_the_kernel_drops_the_lease_of_a_dead_holder(tmp_path):
    code = ("import sys; from rlhf.services.colocation import DeviceLease; "
            f"DeviceLease({str(tmp_path)!r}, 0, 'rollout-0').acquire(0); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lease = DeviceLease(str(tmp_path), 0, "train-0")
        with pytest.raises(DeviceBusy, match="held by rollout-0"):
            lease.acquire(0)
        holder.kill()
        holder.wait(10)
        lease.acquire(5)  # the lock died with its holder
        assert lease.held
    finally:
        holder.kill()
        holder.wait(10)


def test_device_names_and_the_emulated_leak_ledger(tmp_path):
    import json

    import torch

    assert device_name("rollout", 1, True) == "device-1" and device_name("rollout", 1, False) == "rollout-1"
    fresh_allocation(str(tmp_path), "device-0", 1 << 20, "the KV cache")  # no ledger: nothing happens
    path = leak_path(str(tmp_path), "device-0")
    (tmp_path / "devices").mkdir(exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"capacity_mb": 81920, "leaked_mb": 81000, "pid": 1}, fh)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 1.00 MiB for the KV cache"):
        fresh_allocation(str(tmp_path), "device-0", 1 << 20, "the KV cache")
