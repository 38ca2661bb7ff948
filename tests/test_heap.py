"""runtime.heap_mmap_threshold_mb (rlhf.procs.bound_heap): freed large tensors leave the process's resident memory.

Each case is a fresh process: a 24 MB block freed first (glibc then raises its mmap threshold to that size), then
16 blocks of 8 MB allocated, each followed by a small live one, and freed. With glibc's default their pages stay resident (the
heap keeps them); with the bound each had pages of its own, handed back when it was freed."""

import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import sys, psutil, torch
torch.set_num_threads(1)  # one thread: glibc's main arena
from rlhf.procs import bound_heap
assert bound_heap(float(sys.argv[1])) == (float(sys.argv[1]) > 0)
rss = lambda: psutil.Process().memory_info().rss
first = torch.empty(6 << 20).fill_(1)  # 24 MB, freed: glibc's own threshold grows to 24 MB
del first
base = rss()
blocks, live = [], []
for _ in range(16):
    blocks.append(torch.empty(2 << 20).fill_(1))  # 8 MB each
    live.append(torch.empty(1000).fill_(1))  # a small live block after each: no freed block is at the heap's top
del blocks
print((rss() - base) / 2**20)
"""

def retained_mb(threshold_mb: float) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold_mb)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_leave_resident_memory_under_the_bound_and_stay_without_it():
    assert retained_mb(4.0) < 8  # 128 MB allocated and freed: handed back
    assert retained_mb(0) > 16  # glibc's own threshold: what the bound is for (this machine's glibc keeps them)
