"""Process hygiene: children die with their parent, whole process groups are stopped.

Every child we start gets PR_SET_PDEATHSIG(SIGKILL) (Linux) and its own session, so it dies
when the thread that started it dies, and `stop_group` can end it with everything it started.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

PR_SET_PDEATHSIG = 1


def freeze_gc() -> None:
    """Collect once, then move every object alive now (torch, transformers, the model, the services) out of the
    garbage collector's reach, so the collections a step's allocations trigger scan only what steps allocate.

    Called by each long-lived process once it is up. Without it a full collection walks every object of the
    imports and the model, ~0.2 s on a 2-core machine, paid at random inside a step: one such pause in decoding
    a 512-sample rollout reply (json.loads of 2.6 MB) took it from 35 ms to 230 ms."""
    gc.collect()
    gc.freeze()


def _libc() -> Any:
    """The C library (ctypes), or None where it cannot be loaded."""
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim): after a whole model is replaced by its
    shards (FSDP, tensor parallel), the freed copy would otherwise stay in the process's resident memory. A no-op
    where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def bound_heap(mmap_threshold_mb: float) -> bool:
    """glibc: allocations of at least mmap_threshold_mb get pages of their own (mmap), handed back to the system
    when freed, and the threshold stops growing (glibc raises it each time a large mmapped block is freed, after
    which large tensors live in the heap and their pages stay resident after they are freed). 0 or no glibc: nothing
    is changed (False)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mmap_threshold_mb <= 0 or mallopt is None:
        return False
    threshold = int(mmap_threshold_mb * (1 << 20))
    # M_MMAP_THRESHOLD; and M_TRIM_THRESHOLD as glibc's own adjustment sets it (twice the mmap threshold): a fixed
    # threshold would otherwise leave it at 128 KB, and the heap's top would be given back and taken again around
    # every step's smaller tensors
    return bool(mallopt(-3, threshold)) and bool(mallopt(-1, 2 * threshold))


def own_threads(n: int) -> None:
    """Set the intra-op thread count (OpenMP and MKL) of the calling thread to n; threads that have not run a
    torch op yet start from n too.

    torch keeps the count per thread, and GNU OpenMP keeps one pool of worker threads per thread that ran a
    parallel op. Once its pools hold more threads than the machine has CPUs, its workers stop spinning
    between ops and sleep, and each op waits for them to wake: on a 2-core CPU the train worker's matmuls, on
    its service thread after the process's main thread had built the model with 2 threads, ran 1.6x slower
    (an SFT step 0.29 s against 0.16-0.19 s). So a process computes on one thread with the threads it is
    given and every other thread stays serial: call own_threads(1) on the main thread before any torch op;
    a Service with `threads` n runs own_threads(n) on its thread, then sets the constructing thread serial
    again, so threads started later (clients' event loops, other services) start serial.

    A no-op in a process that has not loaded torch: the scheduler never does (it only routes JSON and starts
    processes), and the processes that compute load it before they start their services."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.get_num_threads()  # torch sets a thread's count on its first op, from the process-wide value: do it now
    torch.set_num_threads(n)


def cpu_share(processes: int, beside: int = 0) -> int:
    """Intra-op threads for each of `processes` computing processes of one kind: the machine's CPUs over them, and
    over the `beside` others that compute at the same time (async GRPO: the train ranks and the rollout servers
    compute at once; more threads than CPUs make each OpenMP pool sleep between ops, own_threads). At least 1."""
    return max(1, (os.cpu_count() or 2) // (processes + beside))


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def second_sigterm_stops(first_at: float) -> None:
    """After a first SIGTERM was taken: the next one ends the process at once, except repeats within 1 s of the
    first. A dying multithreaded parent (torchrun) delivers PDEATHSIG again each time a thread of it that had
    adopted this child exits: one event, several signals."""

    def handler(signum: int, frame: Any) -> None:
        if time.monotonic() - first_at < 1.0:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def _child_setup() -> None:
    os.setsid()
    set_pdeathsig(signal.SIGKILL)


def spawn(cmd: Sequence[str], env: dict[str, str] | None = None, log_path: str | None = None,
          cwd: str | None = None, join: Callable[[], None] | None = None) -> subprocess.Popen:
    """Start a child in its own session that is SIGKILLed when this process (thread) dies. join: run in the child
    before it runs anything (rlhf.contain.Cgroup.join: its cgroup)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL

    def setup() -> None:
        _child_setup()
        if join is not None:
            join()

    try:
        return subprocess.Popen(list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=setup, cwd=cwd, close_fds=True)
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after grace_s; return the exit code."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # grandchildren may outlive it
        return proc.returncode
    _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    _kill_group(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        pass


def wait_for_file(path: str, timeout_s: float, proc: subprocess.Popen | None = None) -> str:
    """Wait until `path` exists and is non-empty (a child's ready file); fail early if the child died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip()
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"child pid {proc.pid} exited with {proc.returncode} before writing {path}")
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
