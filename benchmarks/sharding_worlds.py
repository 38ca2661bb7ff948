#!/usr/bin/env python
"""One torchrun world of benchmarks/sharding.py (launched by it, not by hand): `--worker` takes the layouts part's
train steps of one (layout, world) and writes each rank's figures to --out; `--weights-worker` serves the weights
part's updates through the MetaServer whose address the launcher put in the TCPStore at --store-port."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

# name -> (parallel.layout, parallel.tp_size); fsdp-keep: fsdp with parallel.fsdp_reshard_after_forward false
LAYOUTS = {"dp": ("dp", 1), "fsdp": ("fsdp", 1), "fsdp-keep": ("fsdp", 1), "tp": ("dp", 2), "fsdp+tp": ("fsdp", 2)}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from rlhf.config import AlgorithmConfig, ModelConfig, OptimConfig
    from rlhf.models import build_model_and_tokenizer
    from rlhf.train.dist import GlooDataParallel
    from rlhf.train.engine import TrainEngine
    from rlhf.train.parallel import build_mesh, local, make_layout

    device = init_world(args.device)
    torch.set_num_threads(1)
    parallel, tp = LAYOUTS[args.layout]
    model, _ = build_model_and_tokenizer(ModelConfig(name=args.model, dtype="float32"), seed=1, device="cpu")
    model.to(device)
    layout = make_layout(parallel, tp, dist.get_world_size(), model.config,
                         reshard_after_forward=args.layout != "fsdp-keep")
    mesh = build_mesh(layout, device.type)
    dp = GlooDataParallel(device, mesh["dp"].get_group() if mesh is not None else None)
    optim = OptimConfig(micro_batch_size=args.rows, mini_batches=1, warmup_steps=0)
    engine = TrainEngine(model, optim, AlgorithmConfig(kl_coef=0.0), keep_reference=False, dp=dp, layout=layout,
                         mesh=mesh)
    g = torch.Generator().manual_seed(dist.get_rank() // layout.tp)
    rows = max(1, args.rows // layout.dp)
    ids = torch.randint(3, min(model.config.vocab_size, 30000), (rows, args.tokens), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones_like(ids),
             "advantages": torch.randn(rows, generator=g)}
    batch["response_mask"][:, : args.tokens // 2] = 0
    batch["old_logprobs"] = engine.compute_logprobs(batch, "policy")

    def nbytes(tensors) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    params = nbytes(model.parameters())
    times = []
    grads = 0
    for i in range(args.steps + 1):
        if i == 1:  # after the warm-up step: gradients of one backward, as the optimizer step sees them
            part = engine._to_device(batch)  # (train_step moves its batch itself; this backward is ours)
            engine._accumulate(part, lambda p, lp, e: ((lp * p["response_mask"]).sum() * 0.0, {"tokens": 1.0}),
                               with_entropy=False)
            grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
            engine.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(batch)
        if i:
            times.append(time.perf_counter() - t0)
    optimizer = nbytes(v for s in engine.optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
    peak_rss = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    mine = torch.tensor([params, grads, optimizer, peak_rss, statistics.median(times)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump({"layout": layout.describe(), "per_rank": [t.tolist() for t in every],
                       "model_params": sum(p.numel() for p in model.parameters()) if not layout.sharded else None}, fh)
    dist.destroy_process_group()


def init_world(device_name: str) -> Any:
    """Join the torchrun world; returns this rank's device. CUDA: cuda:(local rank mod GPUs), nccl for CUDA tensors
    when every local rank has a GPU of its own (gloo for host tensors), gloo for both when ranks share one."""
    import torch
    import torch.distributed as dist

    if device_name != "cuda":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    device = torch.device("cuda", local % gpus)
    torch.cuda.set_device(device)
    own = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus
    dist.init_process_group("cpu:gloo,cuda:nccl" if own else "gloo")
    return device


def weights_worker(args: argparse.Namespace) -> None:
    """One train rank of part `weights`: for each path and repeat, wait for the parent's go, make this rank's share
    of the weights as that path does, write it into the MetaServer's shared-memory folder and PUT its path."""
    import asyncio

    import torch
    import torch.distributed as dist

    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer
    from rlhf.pieces import own_pieces
    from rlhf.services.metaserver import push_shard
    from rlhf.train.parallel import Gathered, build_mesh, make_layout, parallelize
    from rlhf.transport.client import Client
    from rlhf.weights import write_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel, tp = LAYOUTS[args.layout]
    model, _ = build_model_and_tokenizer(ModelConfig(name=args.model, dtype="float32"), seed=1, device="cpu")
    layout = make_layout(parallel, tp, world, model.config)
    if layout.sharded:
        parallelize(model, layout, build_mesh(layout, "cpu"))
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False)
    url, token, shm_dir = store.get("url").decode(), store.get("token").decode(), store.get("shm_dir").decode()
    wire = torch.bfloat16

    def share(path: str) -> tuple[dict, dict | None]:
        if path == "pieces":  # what the runtime does: only this rank's pieces, no collective
            return own_pieces(model, rank, world, wire)
        # the path before: every parameter whole (gathered in a sharded layout), every world-th name kept
        state = Gathered(model, wire)
        return state.only(sorted(state)[rank::world]), None

    async def put(version: str, part: dict, where: dict | None) -> int:
        client = Client(url, token)
        try:
            path = os.path.join(shm_dir, f"v{version}-rank{rank}.safetensors")
            size = write_shard(part, path, "crc32", where)
            await push_shard(client, version, f"rank{rank}", None, 600, path=path)
            return size
        finally:
            await client.close()

    for version in store.get("versions").decode().split(","):
        store.wait([f"go/{version}"])
        t0 = time.perf_counter()
        part, where = share(version.split("-")[1])
        size = asyncio.run(put(version, part, where))
        del part, where
        store.set(f"up/{version}/{rank}", json.dumps({"seconds": time.perf_counter() - t0, "bytes": size}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="the layouts part's train steps")
    parser.add_argument("--weights-worker", action="store_true", help="the weights part's updates")
    parser.add_argument("--layout", default="dp", help=f"of: {', '.join(LAYOUTS)}")
    parser.add_argument("--model", default="llama-500m", help="model preset")
    parser.add_argument("--rows", type=int, default=4, help="sequences in the global batch")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed train steps (after one warm-up step)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the ranks compute")
    parser.add_argument("--store-port", type=int, default=0, help="the launcher's TCPStore (weights worker)")
    parser.add_argument("--out", default="", help="JSON file for the ranks' figures (worker)")
    args = parser.parse_args()
    if args.layout not in LAYOUTS:
        parser.error(f"--layout {args.layout!r}: choose one of {', '.join(LAYOUTS)}")
    if args.worker == args.weights_worker:
        parser.error("one of --worker or --weights-worker")
    (worker if args.worker else weights_worker)(args)


if __name__ == "__main__":
    main()
