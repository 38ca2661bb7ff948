"""Which device each process uses, and which collective backend the train world can use.

    one GPU:   train rank r -> cuda:0, rollout server r -> cuda:0 (all share the card)
    N GPUs:    train rank r -> cuda:(r mod N); rollout server r -> cuda:((W + r) mod N), after the
               W train ranks, or cuda:(r mod N) with --colocate (pair r shares device r)

NCCL refuses two ranks of one communicator on the same GPU, so the train world uses nccl only
when every local rank has a GPU of its own, and gloo (which all-reduces and broadcasts CUDA
tensors through host memory) when ranks share one. `model.device` names the kind (cpu, cuda)
or pins one device (cuda:N) for every process.
"""

from __future__ import annotations

import os

import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _require_cuda(spec: str) -> int:
    n = gpu_count()
    if n == 0:
        raise RuntimeError(f"model.device={spec!r} but torch sees no CUDA device (torch {torch.__version__}); "
                           "use --model.device cpu")
    return n


def train_device(spec: str, local_rank: int) -> torch.device:
    """The device of train rank `local_rank` on this host."""
    if not spec.startswith("cuda"):
        return torch.device("cpu")
    n = _require_cuda(spec)
    if ":" in spec:
        return torch.device(spec)
    return torch.device("cuda", local_rank % n)


def rollout_device(spec: str, rank: int, train_ranks: int, colocate: bool) -> torch.device:
    """The device of rollout server `rank`: its train rank's when colocated, else the GPUs after the train ranks."""
    if not spec.startswith("cuda"):
        return torch.device("cpu")
    n = _require_cuda(spec)
    if ":" in spec:
        return torch.device(spec)
    return torch.device("cuda", (rank if colocate else train_ranks + rank) % n)


def train_backend(device: torch.device, local_world_size: int | None = None) -> tuple[str, str]:
    """(backend, why) for the train world of this host."""
    if device.type != "cuda":
        return "gloo", "CPU tensors"
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    n = gpu_count()
    if local <= n:
        return "nccl", f"{local} local rank(s) on {n} GPU(s), one GPU each"
    return "gloo", f"{local} local ranks share {n} GPU(s): NCCL refuses two ranks of one communicator on one GPU"


def _move(t: torch.Tensor, target: torch.device) -> torch.Tensor:
    if target.type == "cpu":  # pinned, so the way back is a fast DMA copy
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to(target, non_blocking=True)


def relocate(models: list[torch.nn.Module], optimizer: torch.optim.Optimizer | None, target: torch.device,
             gpu: torch.device) -> dict[str, float]:
    """Move parameters, gradients and optimizer state to `target` (pinned host memory or back to `gpu`).

    Colocation on a GPU: `rollout_start` moves the train side out so the rollout server can use the
    card, `rollout_end` moves it back. Returns this process's allocated device memory before and after
    (MB). AdamW's scalar `step` stays where torch keeps it (the host).
    """
    before = torch.cuda.memory_allocated(gpu)
    for model in models:
        for p in model.parameters():
            p.data = _move(p.data, target)
            if p.grad is not None:
                p.grad = _move(p.grad, target)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = _move(value, target)
    torch.cuda.synchronize(gpu)
    if target.type == "cpu":
        torch.cuda.empty_cache()
    return {"device_mb_before": before / 2**20, "device_mb_after": torch.cuda.memory_allocated(gpu) / 2**20}


def leak_path(run_dir: str, device: str) -> str:
    """The emulated device ledger's record of memory a process kept after releasing `device` (colocation)."""
    return os.path.join(run_dir, "devices", f"{device}.leak.json")
