"""The MetaServer's shared-memory directories: where they live and how a dead server's are swept.

Apart from the MetaServer so that the scheduler, which sweeps at its start, imports neither torch nor the
weights code.
"""

from __future__ import annotations

import os
import shutil
import tempfile

SHM_PREFIX = "rlhf-meta-"  # + pid-random: one directory per MetaServer process


def shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def sweep_stale_shm(root: str | None = None) -> list[str]:
    """Remove shared-memory directories left by MetaServers whose process no longer exists."""
    root = root or shm_root()
    removed = []
    for name in os.listdir(root):
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            pid = int(name[len(SHM_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed
