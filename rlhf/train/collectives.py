"""Fault points and the heartbeat inside the sharded layouts' own collectives.

    collective.all_gather      FSDP2 gathers a layer's parameters (before its forward, and again before its backward)
    collective.reduce_scatter  FSDP2 reduce-scatters a layer's gradients after its backward
    collective.all_reduce      tensor parallel sums a row-wise layer's (o_proj, down_proj) output over its TP group;
                               the same point as the data-parallel gradient all-reduce (rlhf.train.dist)

FSDP2's collectives are its own: each FSDP module is handed a custom all-gather and reduce-scatter
(`set_custom_all_gather` / `set_custom_reduce_scatter`, the interfaces of FSDP2's `_fsdp_api`) that ask the fault
point, mark the rank as inside the collective for its heartbeat (what the stall watchdog reads: a rank that never
joins an all-gather is named while the others wait in it), run the torch.distributed call FSDP would, and wait
for it there. On gloo (CPU) each is an all_reduce of the same buffer instead: gloo's all_reduce moves it faster than
its own reduce_scatter_tensor and all_gather_into_tensor (the reduce-scatter sums the whole buffer, then keeps this
rank's part; the all-gather sums this rank's part in its place with zeros elsewhere: the same values, a -0.0 turned
+0.0). Tensor parallel's all-reduce runs in the row-wise style's output hook: hooks around it do the same.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlhf import tracing
from rlhf.faults import fault_point


class _Untracked:
    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        yield


def fsdp_comms(tracker: Any = None) -> tuple[Any, Any]:
    """(all-gather, reduce-scatter) for FSDP2 modules, with fault points and the heartbeat. tracker: the rank's
    data-parallel hooks (rlhf.train.dist.GlooDataParallel: `inside(what)`), or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    track = tracker if tracker is not None else _Untracked()

    class FaultedAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool = False) -> dist.Work | None:
            fault_point("collective.all_gather", numel=input_tensor.numel(), stage=tracing.current_stage())
            with track.inside("all_gather(fsdp parameters)"):
                if _gloo(group):  # this rank's part in its place, zeros elsewhere, summed: every rank's parts
                    n = input_tensor.numel()
                    start = dist.get_rank(group) * n
                    flat = output_tensor.view(-1)
                    mine = flat[start:start + n]
                    if mine.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input in place already
                        mine.copy_(input_tensor.view(-1))
                    flat[:start].zero_()
                    flat[start + n:].zero_()
                    _gloo_all_reduce(output_tensor, group)
                else:
                    dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            return None  # done: FSDP waits on nothing

    class FaultedReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> dist.Work | None:
            fault_point("collective.reduce_scatter", numel=input_tensor.numel(), stage=tracing.current_stage())
            with track.inside("reduce_scatter(fsdp gradients)"):
                if _gloo(group):  # the whole sum (in FSDP's own input buffer, freed after this), then this rank's part
                    n = output_tensor.numel()
                    start = dist.get_rank(group) * n
                    _gloo_all_reduce(input_tensor, group, op)
                    output_tensor.view(-1).copy_(input_tensor.view(-1)[start:start + n])
                else:
                    dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return None

    return FaultedAllGather(), FaultedReduceScatter()


def _gloo_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM) -> None:
    """gloo's all_reduce in place; a CUDA tensor (ranks sharing one GPU) goes through host memory, copied on FSDP's
    own stream (the current one in its hooks), not through gloo's CUDA path."""
    if not tensor.is_cuda:
        dist.all_reduce(tensor, op=op, group=group)
        return
    host = tensor.to("cpu")  # waits for the stream's work on the tensor
    dist.all_reduce(host, op=op, group=group)
    tensor.copy_(host)


def _gloo(group: dist.ProcessGroup) -> bool:
    """Whether `group` runs on gloo, whose all_reduce of a buffer is faster than its reduce-scatter (1.7-2x) and its
    all-gather (1.1-1.3x) of the same buffer (benchmarks/sharding.py's notes; 2 and 4 CPU ranks here)."""
    return dist.get_backend(group) == "gloo"


def watch_tp(layer: torch.nn.Module, names: list[str], tracker: Any = None) -> None:
    """Around each row-wise module's output all-reduce (its tensor-parallel output hook): the fault point first, and
    the heartbeat's "inside the all-reduce" until it is done."""
    track = tracker if tracker is not None else _Untracked()
    for name in names:
        module = layer.get_submodule(name)
        state: dict[str, Any] = {}

        def before(mod: torch.nn.Module, args: Any, output: Any, state: dict = state) -> None:
            fault_point("collective.all_reduce", what="tp", stage=tracing.current_stage())
            state["inside"] = track.inside("all_reduce(tp output)")
            state["inside"].__enter__()

        def after(mod: torch.nn.Module, args: Any, output: Any, state: dict = state) -> None:
            inside = state.pop("inside", None)
            if inside is not None:
                inside.__exit__(None, None, None)

        module.register_forward_hook(before, prepend=True)  # before the style's output hook (the all-reduce)
        module.register_forward_hook(after)  # after it
