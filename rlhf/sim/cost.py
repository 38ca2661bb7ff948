"""The simulated world's cost model and collective (EMULATED compute; rlhf.sim).

    cost = CostModel(seconds_per_token, jitter, seed)
    cost.spend(tokens)            # sleeps tokens x seconds_per_token x a lognormal draw (0: returns at once)

    barrier = StoreBarrier(host, port, processes, local_ranks)
    barrier.wait(rank, "all_reduce(grads)")   # every rank of the world, across processes; the name and since when
                                              # are this rank's `inside` (its heartbeat shows them, as a real rank's)
"""

from __future__ import annotations

import datetime
import random
import threading
from typing import Callable

EMULATED = "EMULATED"


class CostModel:
    """Seconds of emulated compute: tokens x seconds_per_token, times a lognormal(0, jitter) draw."""

    def __init__(self, seconds_per_token: float, jitter: float = 0.0, seed: int = 0) -> None:
        self.seconds_per_token, self.jitter = seconds_per_token, jitter
        self.rng = random.Random(seed)
        self.slowdown = 1.0  # a fault may make one rank slower (a straggler)

    def seconds(self, tokens: float) -> float:
        base = tokens * self.seconds_per_token * self.slowdown
        return base * self.rng.lognormvariate(0.0, self.jitter) if base and self.jitter else base

    def spend(self, tokens: float, stop: threading.Event | None = None) -> float:
        """Emulate the compute of `tokens` (a wait of its seconds; `stop` ends it early); returns the seconds."""
        seconds = self.seconds(tokens)
        if seconds > 0:
            (stop or threading.Event()).wait(seconds)
        return seconds


class StoreBarrier:
    """A collective every rank of the world joins, in order (the n-th call of every rank is one collective): the
    ranks of this process meet locally, then one of them meets the other processes over the world's c10d TCPStore.
    A rank that never comes keeps every other rank inside it, as a real all-reduce does."""

    def __init__(self, host: str, port: int, processes: int, local_ranks: int, timeout_s: float = 3600.0) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        self.processes, self.local_ranks = processes, local_ranks
        self._lock = threading.Lock()
        self._arrived: dict[int, int] = {}
        self._done: dict[int, threading.Event] = {}
        self._count: dict[int, int] = {}  # each local rank's collectives so far
        self._sums: dict[int, int] = {}  # each collective's local sum, then the world's

    def wait(self, rank: int, what: str, inside: Callable[[str | None], None], stop: threading.Event,
             value: int | None = None) -> int:
        """Join this rank's next collective `what`; `inside(what)` before, `inside(None)` once every rank is in. A rank
        whose process is shutting down (`stop`) leaves it with an error, as a real rank's collective fails when its
        process group is torn down. With a `value`, returns the sum of every rank's (an all-reduce of an integer: a
        batch's rows, through the store); without, 0 (a barrier: the gradients' all-reduce, whose bytes are EMULATED)."""
        with self._lock:
            seq = self._count.get(rank, 0)
            self._count[rank] = seq + 1
            done = self._done.setdefault(seq, threading.Event())
            self._arrived[seq] = self._arrived.get(seq, 0) + 1
            self._sums[seq] = self._sums.get(seq, 0) + int(value or 0)
            last = self._arrived[seq] == self.local_ranks
        inside(what)
        try:
            if last:  # this process's ranks are all in: meet the other processes
                key = f"sim/collective/{seq}"
                with self._lock:
                    local = self._sums[seq]
                if value is not None:
                    self.store.add(key + "/sum", local)
                if self.store.add(key, 1) == self.processes:
                    self.store.set(key + "/done", "1")
                while not self.store.check([key + "/done"]):
                    if stop.wait(0.005):
                        raise CollectiveAborted(f"{what}: this process is shutting down inside it")
                total = self.store.add(key + "/sum", 0) if value is not None else 0
                with self._lock:
                    self._arrived.pop(seq, None)
                    self._done.pop(seq, None)
                    self._sums[seq] = total
                done.set()
            else:
                while not done.wait(0.2):
                    if stop.is_set():
                        raise CollectiveAborted(f"{what}: this process is shutting down inside it")
            with self._lock:
                total = self._sums[seq]
                self._arrived[seq] = self._arrived.get(seq, 0) + 1  # the readers, counted again to free the sum
                if self._arrived[seq] == self.local_ranks:
                    self._arrived.pop(seq, None)
                    self._sums.pop(seq, None)
            return total
        finally:
            inside(None)


class CollectiveAborted(RuntimeError):
    """A simulated rank left a collective because its process is shutting down (the world ended around it)."""
