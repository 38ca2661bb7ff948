"""Two torchrun launches (--nnodes 2, c10d rendezvous) on this machine form one run. Each "node" is a host of its own:
a network namespace with its own stack and address (rlhf.hosts: 10.77.0.1 and 10.77.0.2 on a bridge) where this
machine allows it (root, Linux), else an address of loopback's (127.0.0.1 and 127.0.0.2, one stack). Each node has its
own scheduler, which runs that node's rollout server under that node's train rank."""

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from rlhf.hosts import Hosts, remove_leftovers, unavailable
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port, steps, wait_for_rows

NO_HOSTS = unavailable()


def launch(run_dir, port, node, address, rdzv, mode, n_steps):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv}:{port}", f"--rdzv-id=two-nodes-{port}", f"--local-addr={address}",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir), "--preset", "smoke", "--rollout.servers", "2",
            "--steps", str(n_steps), "--sft.max_steps", "0", *WEIGHTS[mode]]


WEIGHTS = {"distributed": ["--weights.mode", "distributed"],  # the broadcast: a gloo group across the hosts
           # shards through the MetaServer, by shared memory where the MetaServer's /dev/shm is seen (host A), else
           # over HTTP (host B: its own /dev/shm): the default transport across hosts
           "meta": ["--weights.mode", "meta"]}


def listening(hosts, name):
    """The TCP addresses listened on inside host `name` (ss, in its network namespace)."""
    out = hosts.run(name, ["ss", "-Hltn"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.split()}


@pytest.mark.parametrize("mode, n_steps", [("distributed", 6), pytest.param("meta", 6, marks=pytest.mark.slow)])
def test_two_nodes_form_one_run_each_with_its_scheduler_and_rollout_server(tmp_path, mode, n_steps):
    """The weights across hosts: train rank 0 (node 0) broadcasts them to a gloo group of both nodes' rollout servers,
    across the two hosts (the MetaServer's path is the one every single-node test takes). In namespaces the c10d
    rendezvous, the train ranks' gloo collectives, the weights broadcast and every HTTP call cross the bridge, and
    host B's processes listen on B's address alone."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs, tree, heard = [], {}, set()
    hosts = None if NO_HOSTS else Hosts(["A", "B"]).__enter__()
    addresses = ["127.0.0.1", "127.0.0.2"] if hosts is None else [hosts.address("A"), hosts.address("B")]
    try:
        for node in (0, 1):
            cmd = launch(run_dir, port, node, addresses[node], addresses[0], mode, n_steps)
            kw = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(subprocess.Popen(cmd, env={**os.environ, "RLHF_HOST": addresses[node]}, **kw)
                         if hosts is None else hosts.popen("AB"[node], cmd, **kw))
        wait_for_rows(run_dir, 2, procs[0])
        for p in psutil.Process(procs[1].pid).children(recursive=True):  # what runs under node 1's train rank
            try:
                tree[p.pid] = (p.ppid(), " ".join(p.cmdline()))
            except psutil.Error:
                continue
        if hosts is not None:
            heard = listening(hosts, "B")
        outs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if hosts is not None:
            hosts.close()
    assert_none_left(run_dir)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    scheduler = next(pid for pid, (_, cmd) in tree.items() if "rlhf.services.scheduler" in cmd)
    assert "--rank 1" in tree[scheduler][1]
    rollout = next(pid for pid, (_, cmd) in tree.items() if "rlhf.services.rollout_server" in cmd)
    assert tree[rollout][0] == scheduler and "--rank 1" in tree[rollout][1]
    assert (run_dir / "rollout-1.url").read_text().startswith(f"http://{addresses[1]}:")
    assert (run_dir / "scheduler-1.url").read_text().startswith(f"http://{addresses[1]}:")
    assert (run_dir / "rollout-0.url").read_text().startswith(f"http://{addresses[0]}:")
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert f"(+ scheduler-1 http://{addresses[1]}:" in log and "2 train ranks" in log
    assert [int(r["step"]) for r in steps(run_dir)] == list(range(1, n_steps + 1))
    if mode == "distributed":
        assert "weights update group formed: train-0 and 2 rollout servers (gloo)" in log
    assert all(r["weights_verified"] in ("True", "true", "1") for r in steps(run_dir))
    if hosts is not None:  # B's services, its scheduler and its gloo ends listened on B's address alone
        assert heard and heard <= {addresses[1], "127.0.0.1"}, heard
        assert not any(n.startswith(f"rlhf{os.getpid()}") for n in
                       subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no network-namespace hosts here: {NO_HOSTS}")
def test_hosts_are_torn_down_also_after_their_maker_is_killed(tmp_path):
    """A process that made two hosts and a process inside one is SIGKILLed: its namespaces and bridge are left, and
    the next use removes them (and the process inside) before it makes its own; a partition and a bandwidth cap act
    on the host's link and are gone with it."""
    maker = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from rlhf.hosts import Hosts\n"
        "h = Hosts(['A', 'B']).__enter__()\n"
        "h.popen('B', [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "h.cap('B', 5)\n"
        "h.partition('A')\n"
        "print(h.ns('A'), h.ns('B'), h.bridge, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        names = maker.stdout.readline().split()
        assert len(names) == 3, names
        inside = [int(p) for p in subprocess.run(["ip", "netns", "pids", names[1]], capture_output=True,
                                                 text=True).stdout.split()]
        assert inside
        link = subprocess.run(["ip", "-n", names[0], "-o", "link", "show", "eth0"], capture_output=True, text=True)
        assert "state DOWN" in link.stdout
        qdisc = subprocess.run(["ip", "netns", "exec", names[1], "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "5Mbit" in qdisc
    finally:
        maker.kill()
        maker.wait()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert names[0] in left and names[1] in left  # a SIGKILL leaves them
    removed = remove_leftovers()
    assert set(names) <= set(removed), removed
    assert not any(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for n in names[:2])
    assert names[2] not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) for p in inside) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in inside)
    with pytest.raises(KeyError, match="no host 'C'"):
        Hosts(["A", "B"]).address("C")
    with pytest.raises(ValueError, match="names are 1-4 letters"):
        Hosts(["A", "A"])


@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no network-namespace hosts here: {NO_HOSTS}")
def test_each_host_has_a_dev_shm_of_its_own_shared_by_what_its_command_starts():
    """As on real hosts: a file a process on A puts in /dev/shm is seen by A's process's children, not by B nor by
    this machine, and goes with A's last process."""
    probe = f"rlhf-probe-{os.getpid()}"
    with Hosts(["A", "B"]) as hosts:
        a = hosts.popen("A", ["sh", "-c", f"touch /dev/shm/{probe} && sh -c 'ls /dev/shm' && read line"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert a.stdout.readline().strip() == probe  # a child of A's command sees it
            assert hosts.run("B", ["ls", "-A", "/dev/shm"], capture_output=True, text=True).stdout == ""
            assert not os.path.exists(f"/dev/shm/{probe}")
        finally:
            a.communicate("\n", timeout=10)
    assert not os.path.exists(f"/dev/shm/{probe}")


KIND_SNIPPET = """
import json, types
from rlhf.faults.kinds import KINDS, Hit
spec = types.SimpleNamespace(params={params})
kind = KINDS.get("{kind}")(spec, ".")
out = {{"inject": kind.inject(Hit("train.step", "train", 1, 3)), "verify": kind.verify()}}
out["restore"] = kind.restore()
print(json.dumps(out))
"""


@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no network-namespace hosts here: {NO_HOSTS}")
def test_partition_and_bandwidth_cap_act_on_the_hosts_link_in_the_kernel_and_are_undone(tmp_path):
    """network_partition, fired in a process on host B, takes B's link down and up again; bandwidth_cap puts a tbf
    qdisc at the rate on it and removes it; outside a host made by rlhf.hosts they refuse, touching nothing."""
    from rlhf.faults.kinds import KINDS, Hit
    from rlhf.hosts import HostsError

    with Hosts(["A", "B"]) as hosts:
        for kind, params, during in (("network_partition", {}, {"link_up": False}),
                                     ("bandwidth_cap", {"rate_mbit": 8}, "rate 8Mbit")):
            out = hosts.run("B", [sys.executable, "-c", KIND_SNIPPET.format(kind=kind, params=params)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert out.returncode == 0, out.stderr[-2000:]
            report = __import__("json").loads(out.stdout)
            assert report["inject"]["link"] == "eth0" and report["inject"]["host"] == hosts.address("B")
            if isinstance(during, dict):
                assert report["verify"] == during and report["restore"]["link_up"] is True
            else:
                assert "tbf" in report["verify"]["qdisc"] and during in report["verify"]["qdisc"], report
                assert "tbf" not in report["restore"]["qdisc"], report
    kind = KINDS.get("network_partition")(__import__("types").SimpleNamespace(params={}), str(tmp_path))
    with pytest.raises(HostsError, match="not on a host made by rlhf.hosts"):
        kind.inject(Hit("train.step", "train", 1, 3))


PARTITION = """
config:
  steps: 3
  rollout: {{servers: 2}}
  sft: {{max_steps: 0}}
faults:
  - name: host-b-partitioned
    kind: network_partition
    point: train.step
    target: {{host: B}}
    when: {{step: 2, max_hits: 1}}
    duration_s: {duration}
"""


def run_on_hosts(tmp_path, duration_s, *flags):
    """A 2-host, 3-step run whose host B loses its link at step 2 for duration_s; (exit codes, run dir)."""
    from rlhf.hosts import torchrun

    faults = tmp_path / "partition.yaml"
    faults.write_text(PARTITION.format(duration=duration_s))
    run_dir = tmp_path / "run"
    port = free_port()
    with Hosts(["A", "B"]) as hosts:
        procs = [hosts.popen(name, torchrun(hosts, node, port, [f"{ROOT}/examples/grpo_trainer.py", "--run-dir",
                                                                str(run_dir), "--preset", "smoke", "--faults",
                                                                str(faults), *flags]),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                 for node, name in enumerate(hosts.names)]
        try:
            outs = [p.communicate(timeout=240)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert_none_left(run_dir)
    return [p.returncode for p in procs], outs, run_dir


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no network-namespace hosts here: {NO_HOSTS}")
def test_a_partition_of_host_b_shorter_than_the_grace_is_survived_and_named(tmp_path):
    """Host B's link goes down for 12 s as train-1 starts step 2 (in the kernel: the train ranks' gloo all-reduce
    hangs): the watchdog finds train-1 alive but unreachable within seconds and, hardened (wait_out_partitions),
    waits for the network; the run finishes, and `rlhf diagnose` names host B (network), not a dead process."""
    from rlhf.diagnosis import diagnose

    codes, outs, run_dir = run_on_hosts(tmp_path, 12)
    assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert [int(r["step"]) for r in steps(run_dir)] == [1, 2, 3]
    log = (run_dir / "logs" / "controller-0.log").read_text().splitlines()
    warned = [line for line in log if " WARNING " in line and "stall watchdog (step 2, stage train" in line]
    assert warned and "train-1 (http://10.77.0.2:" in warned[0] and "its host is unreachable (a partition)" in \
        warned[0], warned
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.category) == ("train-1", "network"), d.render()
    assert "host B (10.77.0.2) became unreachable" in d.root.summary


@pytest.mark.slow
@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no network-namespace hosts here: {NO_HOSTS}")
def test_a_partition_longer_than_the_grace_fails_in_seconds_naming_host_b(tmp_path):
    """The link stays down 60 s, the grace is 3 s: the step fails with SyncStall some 8 s in (not at gloo's 30
    minutes), naming train-1 alive but unreachable; `rlhf diagnose` names host B (network)."""
    from rlhf.diagnosis import diagnose

    codes, outs, run_dir = run_on_hosts(tmp_path, 60, "--runtime.partition_grace_s", "3")
    assert codes[0] != 0
    failed = next(line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
                  if "run failed" in line)
    assert "step 2, stage train: SyncStall" in failed and \
        re.search(r"its host is unreachable \(a partition\), for \d+ s \(runtime.partition_grace_s\)", failed), failed
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.category) == ("train-1", "network"), d.render()
