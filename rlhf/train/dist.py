"""torch.distributed for the SPMD train workers: init (gloo on CPU, nccl on GPU), the data-parallel
hooks the train engine needs, and a rendezvous for small strings through the c10d store.

`python examples/grpo_trainer.py` without torchrun is world size 1: we fill in the torchrun
environment for one local process so the same code path runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from rlhf import tracing
from rlhf.devices import train_backend, train_device
from rlhf.faults import fault_point
from rlhf.tracing.metrics import ACTIVITY
from rlhf.train.parallel import local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str = "cpu"
    why: str = ""


def init_distributed(device: str = "cpu", timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun world (or make a world of one) on this rank's device (rlhf.devices)."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = train_device(device, local_rank)
    backend, why = train_backend(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(rendezvous("env://", timeout=timeout))
        # torchrun keeps one store for every restart of its workers (static rendezvous, and c10d's shared
        # store): a restarted world read the old world's gloo addresses and failed in connectFullMesh. Keys of
        # each attempt live under their own prefix.
        store = dist.PrefixStore(f"rlhf/attempt-{restart_count()}", store)
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size,
                                **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, str(dev), why)


def restart_count() -> int:
    """How many times torchrun restarted this run's workers (--max-restarts) before this attempt; 0 without it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def store() -> dist.Store:
    """The c10d key-value store of the world (raw bytes; no pickling)."""
    return dist.distributed_c10d._get_default_store()


def publish(key: str, value: str) -> None:
    store().set(f"rlhf/{key}", value.encode())


def fetch(key: str) -> str:
    return store().get(f"rlhf/{key}").decode()


class GlooDataParallel:
    """The train engine's DataParallel hooks over the data-parallel group: the whole world, or with tensor
    parallel the ranks holding the same TP shard (the mesh's `dp` dimension), which train on different data."""

    def __init__(self, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        # nccl reduces only CUDA tensors: counts made on the host go to the rank's device for the collective
        self.device = torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")
        self.in_collective: tuple[str, float] | None = None  # (what, since): the heartbeat shows a rank stuck in one
        self._outer: tuple[str, int, float] = ("idle", -1, time.time())

    def _enter(self, what: str) -> None:
        self.in_collective = (what, time.monotonic())
        self._outer = (ACTIVITY.name, ACTIVITY.step, ACTIVITY.since)
        ACTIVITY.set(what, ACTIVITY.step)  # the heartbeat (metrics/) shows which ranks are inside a collective

    def _leave(self) -> None:
        self.in_collective = None
        ACTIVITY.name, ACTIVITY.step, ACTIVITY.since = self._outer

    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        """Marks this rank as inside collective `what` (the heartbeat, the watchdog) while the block runs, with its
        span: for the collectives a sharded layout runs (FSDP's all-gathers and reduce-scatters, TP's all-reduce)."""
        self._enter(what)
        try:
            with tracing.span(f"collective.{what.split('(')[0]}", what=what):
                yield
        finally:
            self._leave()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self.device, copy=True)
        fault_point("collective.all_reduce")
        self._enter("all_reduce(count)")
        with tracing.span("collective.all_reduce", what="count", numel=out.numel()):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        self._leave()
        return out.to(tensor.device)

    def all_gather_values(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (the same length on every rank), in rank order: of the whole world."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        self._enter("all_gather")
        with tracing.span("collective.all_gather", numel=mine.numel()):
            dist.all_gather(out, mine)
        self._leave()
        return [t.tolist() for t in out]

    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over the data-parallel ranks in one flat buffer (the loss is already globally normalised).
        Under tensor parallel each rank sums its own shard of a split weight (a DTensor's local part)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        pieces = [local(g) for g in grads]
        flat = torch.cat([g.reshape(-1) for g in pieces])
        fault_point("collective.all_reduce")
        self._enter("all_reduce(gradients)")
        with tracing.span("collective.all_reduce", what="gradients", numel=flat.numel()):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        self._leave()
        offset = 0
        for p, g, piece in zip(params, grads, pieces):
            n = piece.numel()
            piece.copy_(flat[offset : offset + n].view_as(piece))
            p.grad = g
            offset += n


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
