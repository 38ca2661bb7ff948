"""The weights update group: the train side and every rollout server as one torch.distributed process group of
their own (not the train world), the weights broadcast from the trainer (group rank 0) bucket by bucket, as
sglang's `/init_weights_update_group` and `/update_weights_from_distributed` do it.

    the trainer     opens a TCPStore on its host (rank 0 of the group), reports its address and port
    rollout-i       joins as rank 1 + i (sglang's rank_offset) of 1 + servers ranks
    each bucket     a flat uint8 buffer: the bucket's tensors' bytes back to back in the order of its names
                    (sglang's `flattened_bucket` load format), one broadcast from rank 0

gloo on a CPU, nccl on a GPU (each process on its own device). A member that dies or hangs ends every other
member's broadcast at the group's timeout (the watchdog names it sooner). Only raw tensor bytes cross: the names,
dtypes and shapes travel in the HTTP request (JSON).
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

GROUP = "weight_update_group"  # sglang's default group name
BACKENDS = ("gloo", "nccl")


def open_store(host: str, timeout_s: float) -> Any:
    """The group's rendezvous store, served by the trainer (port chosen by the system)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join(master_address: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float,
         group_name: str = GROUP, store: Any = None, host: str = "") -> Any:
    """This process's member of the group (blocks until all world_size members have joined, or timeout_s). host: the
    address this member's gloo connections use (the address this process serves on; '' lets gloo pick one from the
    host name)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: valid: {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, int(master_port), is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend nccl needs a CUDA device; this process has none (use gloo)")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    if not host:
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def broadcast(group: Any, buffer: torch.Tensor) -> None:
    """Rank 0's buffer into every member's (in place)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


class Buffers:
    """One flat uint8 buffer per device, grown to the largest bucket and used again for every bucket and update: a
    fresh buffer each time costs the kernel's first touch of its pages (on this project's VM, as much as the
    broadcast itself)."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def get(self, size: int, device: Any = "cpu") -> torch.Tensor:
        key = str(device)
        if key not in self.held or self.held[key].numel() < size:
            self.held.pop(key, None)
            self.held[key] = torch.empty(size, dtype=torch.uint8, device=device)
        return self.held[key][:size]


def pack(tensors: list[torch.Tensor], device: Any = "cpu", buffers: Buffers | None = None) -> torch.Tensor:
    """The bucket's tensors' bytes back to back, as one uint8 tensor (in `buffers`' buffer when given)."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    size = sum(f.numel() for f in flat)
    out = buffers.get(size, device) if buffers is not None else torch.empty(size, dtype=torch.uint8, device=device)
    start = 0
    for f in flat:
        out[start:start + f.numel()].copy_(f)
        start += f.numel()
    return out


def bucket_bytes(dtypes: list[str], shapes: list[list[int]]) -> int:
    return sum(math.prod(s) * to_dtype(d).itemsize for d, s in zip(dtypes, shapes))


def unpack(buffer: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]
           ) -> list[tuple[str, torch.Tensor]]:
    """pack's inverse: views of `buffer`, one per name."""
    out, start = [], 0
    for name, d, shape in zip(names, dtypes, shapes):
        dtype = to_dtype(d)
        end = start + math.prod(shape) * dtype.itemsize
        out.append((name, buffer[start:end].view(dtype).view(shape)))
        start = end
    return out


def describe(named: Any, dtype: torch.dtype | None = None) -> list[dict]:
    """{name, dtype, shape} of each (name, tensor), in name order (as sent: in `dtype` when given): plan_buckets'
    input."""
    return [{"name": n, "dtype": dtype_name(dtype or t.dtype), "shape": list(t.shape)} for n, t in sorted(named)]


def plan_buckets(tensors: list[dict], max_bytes: int) -> list[dict]:
    """Cut the model's tensors ({name, dtype, shape}, in order) into buckets of at most max_bytes (a tensor larger
    than that is a bucket of its own): each {names, dtypes, shapes, bytes}."""
    buckets: list[dict] = []
    for t in tensors:
        size = math.prod(t["shape"]) * to_dtype(t["dtype"]).itemsize
        if not buckets or (buckets[-1]["bytes"] + size > max_bytes and buckets[-1]["names"]):
            buckets.append({"names": [], "dtypes": [], "shapes": [], "bytes": 0})
        b = buckets[-1]
        b["names"].append(t["name"])
        b["dtypes"].append(t["dtype"])
        b["shapes"].append(list(t["shape"]))
        b["bytes"] += size
    return buckets
