"""The `python` tool: the model's code run in a sandbox (a child process of the environment server).

    --env.path tool_calls --env.tools rlhf.envs.sandbox
    <tool_call>{"name": "python", "arguments": {"code": "print(123 * 456)"}}</tool_call>
    <tool_response>56088</tool_response>

Each call runs `python -I -c CODE` in a fresh working directory (removed after) as a process group of its own, with
rlimits (CPU seconds, address space, file size, no core files), a wall-clock limit (the group is killed past it),
an environment with nothing of the server's (no token), and — where this process may make one (root, Linux) — a
network namespace of its own with no interface but loopback (no network). A sandbox that cannot start (OSError), is
killed from outside, or passes its wall-clock limit starved of CPU (it waited for a CPU, per the kernel's schedstat,
more than it ran and for at least half the limit: the machine's load, as verl's sandboxes time out under load) is
the infrastructure's failure (InfraError), not the code's; a code that computes or sleeps past the limit is the
code's. What the limits are is LIMITS, set by
the environment server from env.sandbox_* keys. Its answer is what the code printed (stdout, then stderr), cut to
LIMITS.output_chars; a code that fails says how (its exit status, or the limit it passed). Fault point sandbox.exec
(before each run).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from rlhf.envs.base import InfraError
from rlhf.faults import fault_point

__all__ = ["python"]  # the tools this module gives the tool_calls environment

CLONE_NEWNET = 0x40000000


@dataclass
class Limits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_chars: int = 2000


LIMITS = Limits()


def _isolate() -> None:  # in the child, before exec
    mb = LIMITS.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_CPU, (LIMITS.cpu_s, LIMITS.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (mb, mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)  # a namespace with loopback only (down)


STARVED = 0.5  # a run that waited this share of its time limit for a CPU (more than it ran) timed out of load


def cpu_and_wait(pid: int) -> tuple[float, float]:
    """Seconds process pid has run on a CPU and waited on a run queue for one (the kernel's schedstat, Linux); (0, 0)
    where there is none."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as fh:
            ran_ns, waited_ns = fh.read().split()[:2]
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(ran_ns) / 1e9, int(waited_ns) / 1e9


def network_isolated() -> bool:
    """Whether a sandboxed run gets a network namespace of its own (root on Linux)."""
    return os.geteuid() == 0 and sys.platform.startswith("linux")


def python(code: str) -> str:
    """Run Python code in the sandbox; what it printed."""
    fault_point("sandbox.exec")
    work = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", str(code)], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work},
                                preexec_fn=_isolate)  # noqa: PLW1509 — rlimits and the namespace need the child
        try:
            out, err = proc.communicate(timeout=LIMITS.timeout_s)
        except subprocess.TimeoutExpired:
            ran_s, waited_s = cpu_and_wait(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if waited_s > ran_s and waited_s >= STARVED * LIMITS.timeout_s:  # the machine's load, not the code
                raise InfraError(f"the sandbox (pid {proc.pid}) ran past its {LIMITS.timeout_s:g} s limit starved of "
                                 f"CPU: it ran {ran_s:.2f} s and waited {waited_s:.2f} s for a CPU (the machine's "
                                 "load, not the code)") from None
            return f"error: the code ran past {LIMITS.timeout_s:g} s and was stopped"
        text = (out + err)[:LIMITS.output_chars]
        if proc.returncode == -signal.SIGXCPU:
            return f"error: the code used its {LIMITS.cpu_s} s of CPU and was stopped\n{text}".rstrip()
        if proc.returncode < 0:  # killed from outside (the OOM killer, an operator): the sandbox's failure
            raise InfraError(f"the sandbox (pid {proc.pid}) was killed by {signal.Signals(-proc.returncode).name}, "
                             "not by its limits")
        return text if proc.returncode == 0 else f"error: exit status {proc.returncode}\n{text}".rstrip()
    finally:
        shutil.rmtree(work, ignore_errors=True)
