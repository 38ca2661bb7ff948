"""The `python` tool: the model's code run in a sandbox (a child process of the environment server).

    --env.path tool_calls --env.tools rlhf.envs.sandbox
    <tool_call>{"name": "python", "arguments": {"code": "print(123 * 456)"}}</tool_call>
    <tool_response>56088</tool_response>

Each call runs `python -I -c CODE` in a fresh working directory (removed after) as a process group of its own, with
rlimits (CPU seconds, address space, file size, no core files), a wall-clock limit (the group is killed past it),
an environment with nothing of the server's (no token), and — where this process may make one (root, Linux) — a
network namespace of its own with no interface but loopback (no network). A sandbox that cannot start (OSError) or
is killed from outside is the infrastructure's failure (InfraError), not the code's. What the limits are is LIMITS, set by
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
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
