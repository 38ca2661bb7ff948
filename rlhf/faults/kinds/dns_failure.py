"""dns_failure: the callee's name does not resolve (a real resolver lookup of an unresolvable name)."""

from __future__ import annotations

import socket
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register


@register
class DnsFailure(FaultKind):
    NAME = "dns_failure"
    DOC = "name resolution of the peer fails: a real getaddrinfo of '<peer>.invalid' raises socket.gaierror"
    PARAMS: dict = {}

    def inject(self, hit: Hit) -> dict[str, Any]:
        name = f"{hit.peer or 'peer'}.invalid"
        try:
            socket.getaddrinfo(name, 80)
        except socket.gaierror as exc:
            raise socket.gaierror(exc.errno, f"{exc.strerror} ({name}; dns_failure)") from None
        raise RuntimeError(f"dns_failure: {name} unexpectedly resolved")
