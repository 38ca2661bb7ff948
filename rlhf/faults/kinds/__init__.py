"""Fault kinds: one small class per file, registered by name (toxiproxy's toxics are the model).

A kind says what it does (DOC), which parameters it takes (PARAMS), whether it acts at the point
each time it triggers (inline: delays, errors, hangs, kills) or starts an effect that lasts
`duration_s` (background: burners, allocations, fills, writers), and whether its effect is
real or emulated on this machine (EMULATED, said in its DOC too).

    inject(hit) -> dict     act (inline) or start the effect (background); returns what it did
    transport_effect(hit)   for kinds that act on one request or reply (HTTP error, reset, cut body,
                            cut tensors): a TransportEffect the HTTP server applies, knowing no fault name
    verify()    -> dict     evidence that it landed: burners burning, bytes held, delay measured
    restore()   -> dict     undo; safe to call twice; also run at run end and by the leftover audit

Kinds import torch where they use it, not at the top: the helper processes (CPU burners, IO
writers: `python -m rlhf.faults.helpers`) import this package and must start in a fraction of a
second, not after torch's two.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from rlhf.registry import Registry


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a parameter without a default (PARAMS: (types, REQUIRED, doc))


@dataclass
class Hit:
    point: str
    role: str
    rank: int
    step: int = -1
    peer: str = ""
    context: dict[str, Any] = field(default_factory=dict)


class TransportEffect:
    """What a fault does to one request on the server side. The transport calls both hooks on every
    effect a fired fault returns; the defaults change nothing."""

    async def replace_reply(self, request: Any) -> Any:
        """A reply (aiohttp StreamResponse) sent instead of running the handler, or None to run it."""
        return None

    def reply_tensors(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The reply's tensors as they leave (after the sender's checksums were taken)."""
        return tensors


class FaultKind:
    NAME = ""
    DOC = ""
    PARAMS: dict[str, tuple[tuple[type, ...], Any, str]] = {}
    BACKGROUND = False
    EMULATED = False

    def __init__(self, spec: Any, run_dir: str) -> None:
        self.spec, self.params, self.run_dir = spec, spec.params, run_dir
        self.active = False

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        """A problem with one parameter value, or None."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            return f"must be >= 0, got {value}"
        return None

    @classmethod
    def check_spec(cls, point: str, matched: tuple[str, ...], target: Any, params: dict[str, Any]) -> str | None:
        return None

    def inject(self, hit: Hit) -> dict[str, Any]:
        raise NotImplementedError

    async def ainject(self, hit: Hit) -> dict[str, Any]:
        return self.inject(hit)

    def transport_effect(self, hit: Hit) -> TransportEffect | None:
        """Kinds that act on the request or reply at rpc.server.handle return what the server must do."""
        return None

    def verify(self) -> dict[str, Any]:
        return {}

    def restore(self) -> dict[str, Any]:
        self.active = False
        return {}

    def resources(self) -> dict[str, Any]:
        """What the leftover audit must check after a crash: {"pids": [...], "paths": [...]}."""
        return {}


KINDS: Registry = Registry("fault kind")


def register(cls: type[FaultKind]) -> type[FaultKind]:
    KINDS.register(cls.NAME)(cls)
    return cls


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_load_all()
