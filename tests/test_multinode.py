"""Two torchrun launches (--nnodes 2, c10d rendezvous) on this machine form one run. Each "node" has its own service
address (RLHF_HOST: 127.0.0.1 and 127.0.0.2, both loopback) and its own scheduler, which runs that node's rollout
server under that node's train rank."""

import os
import subprocess
import sys

import psutil
import pytest

from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port, steps, wait_for_rows


@pytest.mark.parametrize("mode, n_steps", [("distributed", 6)])
def test_two_nodes_form_one_run_each_with_its_scheduler_and_rollout_server(tmp_path, mode, n_steps):
    """The weights across hosts: train rank 0 (node 0) broadcasts them to a gloo group of both nodes' rollout servers,
    across the two addresses (the MetaServer's path is the one every single-node test takes)."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}",
               f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir), "--preset", "smoke", "--rollout.servers",
               "2", "--steps", str(n_steps), "--sft.max_steps", "0", "--weights.mode", mode]
        env = {**os.environ, "RLHF_HOST": f"127.0.0.{node + 1}"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      cwd=ROOT))
    try:
        wait_for_rows(run_dir, 2, procs[0])
        tree = {}  # what runs under node 1's train rank
        for p in psutil.Process(procs[1].pid).children(recursive=True):
            try:
                tree[p.pid] = (p.ppid(), " ".join(p.cmdline()))
            except psutil.Error:
                continue
        outs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert_none_left(run_dir)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    scheduler = next(pid for pid, (_, cmd) in tree.items() if "rlhf.services.scheduler" in cmd)
    assert "--rank 1" in tree[scheduler][1]
    rollout = next(pid for pid, (_, cmd) in tree.items() if "rlhf.services.rollout_server" in cmd)
    assert tree[rollout][0] == scheduler and "--rank 1" in tree[rollout][1]
    assert (run_dir / "rollout-1.url").read_text().startswith("http://127.0.0.2:")
    assert (run_dir / "scheduler-1.url").read_text().startswith("http://127.0.0.2:")
    assert (run_dir / "rollout-0.url").read_text().startswith("http://127.0.0.1:")
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "(+ scheduler-1 http://127.0.0.2:" in log and "2 train ranks" in log
    assert [int(r["step"]) for r in steps(run_dir)] == list(range(1, n_steps + 1))
    if mode == "distributed":
        assert "weights update group formed: train-0 and 2 rollout servers (gloo)" in log
    assert all(r["weights_verified"] in ("True", "true", "1") for r in steps(run_dir))
