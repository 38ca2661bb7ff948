"""Hosts on one machine: network namespaces, each a "host" with a network stack and an address of its own, joined by a
bridge (root, Linux) — for the multi-host tests, and for reproducing a multi-host incident on one machine.

    rlhf hosts run -- examples/grpo_trainer.py --faults F   # one torchrun a host (A: rank 0, the controller), c10d
    rlhf hosts clean                                         # what a killed use left behind

    with Hosts(["A", "B"]) as hosts:          # namespaces rlhf<pid>-A and -B: 10.77.0.1 and 10.77.0.2 on a bridge
        hosts.address("B")                    # '10.77.0.2'
        proc = hosts.popen("B", [sys.executable, "-m", "http.server", "--bind", hosts.address("B")])
        hosts.partition("B")                  # B's link down: every protocol (gloo, c10d, HTTP) stops reaching it
        hosts.heal("B")                       # and up again
        hosts.cap("B", 10)                    # a tbf qdisc: B's traffic out at 10 Mbit/s
        hosts.uncap("B")

Inside a host the link is `eth0` (HOST_LINK) and loopback is up; the processes see RLHF_HOST (the host's address, which
rlhf's services bind), RLHF_HOST_NAME (a fault's `target: {host: B}`) and RLHF_HOST_LINK in their environment,
GLOO_SOCKET_IFNAME too (gloo's collectives on that link); each command a host runs gets an empty /dev/shm of its own,
as on a real host (a process's children share it). Every name carries this process's pid: entering removes what an earlier use whose process is gone left behind
(after a kill), and leaving stops every process still inside a host and deletes the namespaces and the bridge (their
links and qdiscs go with them), also after an exception. Where it cannot work, `unavailable()` says why (not root, no
`ip`, no network namespaces). Delay and loss are not here (this kernel has no netem): the in-process network_delay and
network_loss fault kinds stand for them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

import psutil

SUBNET = "10.77.0"  # 10.77.0.0/24: nothing else on this machine uses it
HOST_LINK = "eth0"  # a host's link, inside its namespace
_NAME = re.compile(r"^rlhf(\d+)-(\w+)$")  # a namespace of ours: rlhf<pid>-<host>


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit status {out.returncode}'}")
    return out


class HostsError(RuntimeError):
    """A host could not be made, changed or removed (the ip command, and what it said)."""


def unavailable() -> str:
    """Why hosts cannot be made here ('' when they can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"rlhf{os.getpid()}-probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def _pids_in(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def remove_leftovers(all_of_them: bool = False) -> list[str]:
    """Delete the namespaces (their processes killed) and bridges that uses whose process is gone left behind (every
    one of ours with all_of_them); the names removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _NAME.match(ns)
        if m and (all_of_them or not psutil.pid_exists(int(m.group(1)))):
            _delete_ns(ns)
            removed.append(ns)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"^\d+: (rlhf(\d+)br)[:@]", line)
        if m and (all_of_them or not psutil.pid_exists(int(m.group(2)))):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _delete_ns(ns: str) -> None:
    for pid in _pids_in(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", ns, check=False)


class Hosts:
    def __init__(self, names: list[str] | tuple[str, ...] = ("A", "B")) -> None:
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9]{1,4}", n)]
        if bad or not names or len(names) > 250 or len(set(names)) != len(names):
            raise ValueError(f"hosts: names are 1-4 letters or digits, distinct (got {list(names)!r})")
        self.names = list(names)
        self.tag = f"rlhf{os.getpid()}"
        self.bridge = f"{self.tag}br"
        self.made: list[str] = []  # namespaces made so far (removed on leaving, also half-way)

    def ns(self, name: str) -> str:
        return f"{self.tag}-{self._known(name)}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(self._known(name)) + 1}"

    def _known(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"no host {name!r} (hosts: {', '.join(self.names)})")
        return name

    def __enter__(self) -> Hosts:
        why = unavailable()
        if why:
            raise HostsError(f"cannot make hosts here: {why}")
        remove_leftovers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                ns, outside = self.ns(name), f"{self.tag}v{i}"
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", HOST_LINK, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", HOST_LINK)
                _ip("-n", ns, "link", "set", HOST_LINK, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process inside the hosts and delete them and the bridge; safe to call twice."""
        for ns in self.made:
            _delete_ns(ns)
        self.made = []
        _ip("link", "del", self.bridge, check=False)

    def environ(self, name: str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a process on host `name` gets: RLHF_HOST (its address), RLHF_HOST_NAME (fault targets'
        `host`), RLHF_HOST_LINK (what network_partition and bandwidth_cap act on), GLOO_SOCKET_IFNAME."""
        return {**(os.environ if base is None else base), "RLHF_HOST": self.address(name), "RLHF_HOST_NAME": name,
                "RLHF_HOST_LINK": HOST_LINK, "GLOO_SOCKET_IFNAME": HOST_LINK}

    def command(self, name: str, cmd: list[str]) -> list[str]:
        """cmd as run inside host `name`'s network stack, with a /dev/shm of its own: `ip netns exec` gives it a mount
        namespace, where an empty tmpfs goes over /dev/shm (real hosts share no shared memory; what cmd starts shares
        cmd's; the tmpfs goes with the last of them)."""
        return ["ip", "netns", "exec", self.ns(name), "sh", "-c", 'mount -t tmpfs -o mode=1777 rlhf-shm /dev/shm && '
                'exec "$@"', f"rlhf-host-{name}", *cmd]

    def popen(self, name: str, cmd: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start cmd on host `name` (environ() added to env); it is stopped on leaving if still running."""
        return subprocess.Popen(self.command(name, cmd), env=self.environ(name, env), **kwargs)

    def run(self, name: str, cmd: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, cmd), env=self.environ(name, env), **kwargs)

    def partition(self, name: str) -> None:
        """Host `name`'s link down: nothing reaches it or leaves it until heal()."""
        _ip("-n", self.ns(name), "link", "set", HOST_LINK, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.ns(name), "link", "set", HOST_LINK, "up")

    def cap(self, name: str, rate_mbit: float) -> None:
        """Host `name`'s outgoing traffic at rate_mbit (a tbf qdisc on its link)."""
        cap_link(HOST_LINK, rate_mbit, netns=self.ns(name))

    def uncap(self, name: str) -> None:
        uncap_link(HOST_LINK, netns=self.ns(name))


def cap_link(link: str, rate_mbit: float, netns: str = "") -> None:
    """A tbf qdisc at rate_mbit on `link` (of network namespace netns; '' this process's)."""
    burst = max(1600, int(rate_mbit * 1e6 / 8 / 250))  # one timer tick's worth at 250 Hz, at least a packet
    _tc(netns, "qdisc", "replace", "dev", link, "root", "tbf", "rate", f"{rate_mbit * 1000:g}kbit", "burst",
        str(burst), "latency", "400ms")


def uncap_link(link: str, netns: str = "") -> None:
    _tc(netns, "qdisc", "del", "dev", link, "root", check=False)


def _tc(netns: str, *args: str, check: bool = True) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["tc", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise HostsError(f"tc {' '.join(args)}: {out.stderr.strip() or f'exit status {out.returncode}'}")


def host_link(who: str, kind: str) -> str:
    """The link of the host this process runs on (RLHF_HOST_LINK, set by Hosts); a fault kind that acts on it refuses
    to touch a link that rlhf.hosts did not make."""
    link = os.environ.get("RLHF_HOST_LINK", "")
    if not link:
        raise HostsError(f"{kind} on {who}: this process is not on a host made by rlhf.hosts (RLHF_HOST_LINK is not "
                         "set), and a real machine's link is never taken down or capped (docs/hosts.md)")
    return link


def link_state(link: str, up: bool | None = None) -> bool:
    """Set `link` up or down (this process's network namespace) when `up` is given; whether it is up."""
    if up is not None:
        _ip("link", "set", link, "up" if up else "down")
    return "state DOWN" not in _ip("-o", "link", "show", link).stdout and ",UP" in _ip("-o", "link", "show",
                                                                                          link).stdout


def link_qdisc(link: str) -> str:
    """The root qdisc of `link` (this process's network namespace), as tc shows it."""
    out = subprocess.run(["tc", "qdisc", "show", "dev", link, "root"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def torchrun(hosts: Hosts, node: int, port: int, script: list[str], nproc: int = 1) -> list[str]:
    """The torchrun command of host number `node` (its train ranks; node 0 runs rank 0, the controller, and the c10d
    rendezvous store on its address), for a run of one launch a host."""
    first, here = hosts.address(hosts.names[0]), hosts.address(hosts.names[node])
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts.names)}", f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={first}:{port}", f"--rdzv-id=rlhf-hosts-{port}",
            f"--local-addr={here}", f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}", *script]


def hosts_main(argv: list[str] | None = None, prog: str = "rlhf hosts") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "A multi-host run on this machine: each host a network namespace with its own address (10.77.0.N) on a "
        "bridge, one torchrun a host, the c10d rendezvous on the first; the hosts are removed when the run ends "
        "(root, Linux). `clean` removes what a killed use left behind."))
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run SCRIPT [ARGS] on the hosts (after --)")
    run.add_argument("--hosts", default="A,B", help="the hosts' names, comma-separated (default A,B)")
    run.add_argument("--nproc-per-node", type=int, default=1, help="train ranks a host (default 1)")
    run.add_argument("--port", type=int, default=29400, help="the rendezvous port on the first host")
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- examples/grpo_trainer.py [flags]")
    sub.add_parser("clean", help="remove the hosts a killed use left behind")
    args = parser.parse_args(argv)
    if args.what == "clean":
        print("\n".join(f"removed {n}" for n in remove_leftovers()) or "nothing to remove")
        return 0
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("run: give the script after --, e.g. rlhf hosts run -- examples/grpo_trainer.py")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
    names = [n for n in args.hosts.split(",") if n]
    try:
        hosts = Hosts(names)
    except ValueError as exc:
        parser.error(f"--hosts: {exc}")
    with hosts:
        procs = []
        for node, name in enumerate(names):
            print(f"host {name}: {hosts.address(name)} (namespace {hosts.ns(name)}), train ranks "
                  f"{node * args.nproc_per_node}..{(node + 1) * args.nproc_per_node - 1}"
                  + (", the controller and the rendezvous" if node == 0 else ""), flush=True)
            procs.append(hosts.popen(name, torchrun(hosts, node, args.port, script, args.nproc_per_node)))
        try:
            codes = [p.wait() for p in procs]
        except KeyboardInterrupt:
            for p in procs:
                p.send_signal(signal.SIGINT)
            codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)
