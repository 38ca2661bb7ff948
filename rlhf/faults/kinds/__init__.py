"""Fault kinds: one small class per file, registered by name (toxiproxy's toxics are the model).

A kind says what it does (DOC), which parameters it takes (PARAMS), whether it acts at the point
each time it triggers (inline: delays, errors, hangs, kills) or starts an effect that lasts
`duration_s` (background: burners, allocations, fills, writers), and whether its effect is
real or emulated on this machine (EMULATED, said in its DOC too).

    inject(hit) -> dict     act (inline) or start the effect (background); returns what it did
    verify()    -> dict     evidence that it landed: burners burning, bytes held, delay measured
    restore()   -> dict     undo; safe to call twice; also run at run end and by the leftover audit
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from rlhf.registry import Registry


@dataclass
class Hit:
    point: str
    role: str
    rank: int
    step: int = -1
    peer: str = ""
    context: dict[str, Any] = field(default_factory=dict)


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
