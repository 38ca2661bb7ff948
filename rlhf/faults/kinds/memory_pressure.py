"""memory_pressure: real memory growth in the target process at a rate, up to a cap."""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil

from rlhf.faults.kinds import FaultKind, Hit, register

MAX_CAP_MB = 16384


@register
class MemoryPressure(FaultKind):
    NAME = "memory_pressure"
    DOC = ("the target allocates and touches memory at rate_mb_s up to cap_mb (host RAM; device='cuda' allocates "
           "on the GPU when one is present), held for duration_s: real memory")
    PARAMS = {
        "rate_mb_s": ((float,), 256.0, "growth rate, MB per second"),
        "cap_mb": ((float,), 1024.0, f"the most it holds, MB (at most {MAX_CAP_MB}, and half the free memory)"),
        "device": ((str,), "host", "host or cuda"),
    }
    BACKGROUND = True

    @classmethod
    def check_param(cls, key: str, value: Any) -> str | None:
        if key == "cap_mb" and not 0 < value <= MAX_CAP_MB:
            return f"{value} is outside (0, {MAX_CAP_MB}] MB"
        if key == "device" and value not in ("host", "cuda"):
            return f"{value!r} is not a device; choose host or cuda"
        return super().check_param(key, value)

    def __init__(self, spec: Any, run_dir: str) -> None:
        super().__init__(spec, run_dir)
        self.blocks: list[Any] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.rss_before = 0
        self.cap = 0

    def _grow(self, cap_bytes: int, device: str) -> None:
        import torch

        chunk = 16 << 20
        interval = chunk / (self.params["rate_mb_s"] * (1 << 20))
        held = 0
        while held < cap_bytes and not self.stop.is_set():
            self.blocks.append(torch.ones(min(chunk, cap_bytes - held), dtype=torch.uint8, device=device))  # touched
            held += self.blocks[-1].numel()
            self.stop.wait(interval)

    def inject(self, hit: Hit) -> dict[str, Any]:
        device = self.params["device"]
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("memory_pressure device=cuda: no CUDA device in this process (use device: host)")
        import torch  # noqa: F401  (imported here, not on the growth thread's clock)

        cap = self.cap = int(min(self.params["cap_mb"] * (1 << 20), psutil.virtual_memory().available // 2))
        self.rss_before = psutil.Process().memory_info().rss
        self.active = True
        self.stop.clear()
        self.thread = threading.Thread(target=self._grow, args=(cap, "cpu" if device == "host" else device), name="fault-memory", daemon=True)
        self.thread.start()
        return {"cap_bytes": cap, "rate_mb_s": self.params["rate_mb_s"], "device": device}

    def verify(self) -> dict[str, Any]:
        """Wait (up to 5 s) until the first 64 MB (or the cap) are held, then report held bytes and RSS growth."""
        want = min(64 << 20, self.cap)
        deadline = time.monotonic() + 5.0
        while sum(b.numel() for b in self.blocks) < want and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.02)
        return {"held_bytes": sum(b.numel() for b in self.blocks),
                "rss_growth_bytes": psutil.Process().memory_info().rss - self.rss_before}

    def restore(self) -> dict[str, Any]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        held = sum(b.numel() for b in self.blocks)
        self.blocks.clear()
        self.active = False
        return {"released_bytes": held}
