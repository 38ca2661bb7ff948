"""network_partition: the target process's host loses its link for duration_s (a real partition, in the kernel)."""

from __future__ import annotations

import os
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register
from rlhf.hosts import host_link, link_state


@register
class NetworkPartition(FaultKind):
    NAME = "network_partition"
    DOC = ("the link of the target process's host goes down for duration_s, then up: every protocol (gloo, c10d, "
           "HTTP) stops reaching the host, in the kernel; needs a host made by rlhf.hosts (root, network namespaces: "
           "RLHF_HOST_LINK in the process's environment), never a real machine's link")
    PARAMS: dict = {}
    BACKGROUND = True

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.link = ""

    def inject(self, hit: Hit) -> dict[str, Any]:
        self.link = host_link(f"{hit.role}-{hit.rank}", self.NAME)
        link_state(self.link, up=False)
        self.active = True
        return {"link": self.link, "host": os.environ.get("RLHF_HOST", "")}

    def verify(self) -> dict[str, Any]:
        return {"link_up": link_state(self.link)} if self.link else {}

    def restore(self) -> dict[str, Any]:
        if not self.active:
            return {}
        link_state(self.link, up=True)
        self.active = False
        return {"link": self.link, "link_up": link_state(self.link)}
