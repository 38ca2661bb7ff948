"""bandwidth_cap: the target process's host sends at rate_mbit for duration_s (a tbf qdisc on its link, in the
kernel)."""

from __future__ import annotations

import os
from typing import Any

from rlhf.faults.kinds import REQUIRED, FaultKind, Hit, register
from rlhf.hosts import cap_link, host_link, link_qdisc, uncap_link


@register
class BandwidthCap(FaultKind):
    NAME = "bandwidth_cap"
    DOC = ("the link of the target process's host sends at rate_mbit for duration_s (a tbf qdisc, in the kernel: "
           "every protocol); needs a host made by rlhf.hosts (root, network namespaces: RLHF_HOST_LINK in the "
           "process's environment), never a real machine's link")
    PARAMS = {"rate_mbit": ((float, int), REQUIRED, "the link's rate, Mbit/s")}
    BACKGROUND = True

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "rate_mbit" and not 0 < value <= 100000:
            return f"{value} is outside (0, 100000] Mbit/s"
        return super().check_param(key, value)

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.link = ""

    def inject(self, hit: Hit) -> dict[str, Any]:
        self.link = host_link(f"{hit.role}-{hit.rank}", self.NAME)
        cap_link(self.link, float(self.params["rate_mbit"]))
        self.active = True
        return {"link": self.link, "host": os.environ.get("RLHF_HOST", ""), "rate_mbit": self.params["rate_mbit"]}

    def verify(self) -> dict[str, Any]:
        return {"qdisc": link_qdisc(self.link)} if self.link else {}

    def restore(self) -> dict[str, Any]:
        if not self.active:
            return {}
        uncap_link(self.link)
        self.active = False
        return {"link": self.link, "qdisc": link_qdisc(self.link)}
