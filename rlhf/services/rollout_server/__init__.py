"""Rollout server: the native engine behind sglang's HTTP API (`python -m rlhf.services.rollout_server`).

What is where:

    server.py    RolloutServer: its routes, readiness and info, graceful drain; the process's main and serve loop
    generate.py  /generate and its queue (shedding, streaming), abort, pause, continue
    memory.py    weight updates (disk, MetaServer), weight version, memory release/resume, colocation events
"""

from rlhf.services.rollout_server.memory import MEMORY_TAGS, DeviceMemoryNotReleased, memory_tags
from rlhf.services.rollout_server.server import RolloutServer, main, serve

__all__ = ["MEMORY_TAGS", "DeviceMemoryNotReleased", "RolloutServer", "main", "memory_tags", "serve"]
