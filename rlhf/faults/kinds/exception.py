"""exception: a named error raised at the point (a device out-of-memory error among them)."""

from __future__ import annotations

import builtins
from typing import Any

from rlhf.faults.kinds import FaultKind, Hit, register

CLASSES = ("RuntimeError", "ValueError", "TimeoutError", "OSError", "ConnectionError", "MemoryError", "KeyError",
           "FloatingPointError", "OutOfMemoryError")


def error_class(name: str) -> type[BaseException]:
    if name == "OutOfMemoryError":
        import torch

        return torch.OutOfMemoryError  # what torch raises for CUDA OOM; exists in CPU builds too
    return getattr(builtins, name)


@register
class Exception_(FaultKind):
    NAME = "exception"
    DOC = "raise a named error at the point; OutOfMemoryError is torch's device OOM (its message says CUDA)"
    PARAMS = {
        "error": ((str,), "RuntimeError", "class: " + ", ".join(CLASSES)),
        "message": ((str,), "", "the error message (default: a realistic one for the class)"),
    }

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "error" and value not in CLASSES:
            return f"{value!r} is not an injectable error; choose one of: {', '.join(CLASSES)}"
        return super().check_param(key, value)

    def inject(self, hit: Hit) -> dict[str, Any]:
        cls = error_class(self.params["error"])
        message = self.params["message"] or (
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 77.80 GiB already "
            "allocated) [injected]" if self.params["error"] == "OutOfMemoryError"
            else f"injected {self.params['error']} at {hit.point}")
        raise cls(message)
