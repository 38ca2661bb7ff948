#!/usr/bin/env python
"""Which collectives gloo runs on CUDA tensors here: the path of train ranks that share one GPU (NCCL refuses two
ranks of one communicator on one GPU, so they reduce over gloo).

Each collective runs in a world of its own (2 ranks under torchrun, both on cuda:0, gloo), so one that crashes
the process (a SIGSEGV) does not hide the next; prints one line per collective: ok (and the result checked against
the same collective on the host), or how it failed.

    python benchmarks/gloo_cuda.py                 # every probe
    python benchmarks/gloo_cuda.py --ops all_reduce,mesh_full_tensor
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import torch

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "functional_all_reduce",
       "functional_all_gather", "mesh_1d", "mesh_2d", "mesh_full_tensor", "mesh_partial_reduce")


def probe(op: str) -> None:
    """One collective on this rank's CUDA tensor; raises when its result is wrong."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = os.environ.get("PROBE_DEVICE", "cuda")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) if kind == "cuda" else \
        torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    x = torch.arange(8, dtype=torch.float32, device=dev) + 10 * rank
    expect_sum = sum(torch.arange(8, dtype=torch.float32) + 10 * r for r in range(world))
    if op == "all_reduce":
        dist.all_reduce(x)
        got, want = x, expect_sum
    elif op == "broadcast":
        dist.broadcast(x, src=0)
        got, want = x, torch.arange(8, dtype=torch.float32)
    elif op == "all_gather_into_tensor":
        got = torch.empty(8 * world, device=dev)
        dist.all_gather_into_tensor(got, x)
        want = torch.cat([torch.arange(8, dtype=torch.float32) + 10 * r for r in range(world)])
    elif op == "reduce_scatter_tensor":
        got = torch.empty(8 // world, device=dev)
        dist.reduce_scatter_tensor(got, x)
        want = expect_sum.view(world, -1)[rank]
    elif op == "functional_all_reduce":
        import torch.distributed._functional_collectives as funcol

        got = funcol.all_reduce(x, "sum", dist.group.WORLD)
        got, want = funcol.wait_tensor(got), expect_sum
    elif op == "functional_all_gather":
        import torch.distributed._functional_collectives as funcol

        got = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))
        want = torch.cat([torch.arange(8, dtype=torch.float32) + 10 * r for r in range(world)])
    elif op in ("mesh_1d", "mesh_2d"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(kind, (world,) if op == "mesh_1d" else (world, 1),
                                mesh_dim_names=("dp",) if op == "mesh_1d" else ("dp", "tp"))
        got, want = torch.tensor(float(mesh.size())), torch.tensor(float(world))
    elif op == "mesh_full_tensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(kind, (world,))
        whole = torch.arange(16, dtype=torch.float32, device=dev)
        got, want = distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None).full_tensor(), whole.cpu()
    else:  # mesh_partial_reduce: a DTensor's norm, as gradient clipping computes it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(kind, (world,))
        whole = torch.arange(16, dtype=torch.float32, device=dev)
        norm = torch.linalg.vector_norm(distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None))
        got, want = norm.full_tensor(), torch.linalg.vector_norm(whole.cpu())
    if kind == "cuda":
        torch.cuda.synchronize()
    if not torch.allclose(got.cpu(), want.cpu()):
        raise AssertionError(f"{op}: got {got.cpu().tolist()}, expected {want.cpu().tolist()}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    ap.add_argument("--ranks", type=int, default=2, help="ranks sharing the GPU")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per probe")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same probes on host tensors (checks the probes themselves)")
    ap.add_argument("--logs", default="", help="write each probe's whole output here (one file a probe)")
    ap.add_argument("--probe", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe(args.probe)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gloo_cuda.py needs a CUDA device")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"--ops: unknown {', '.join(bad)}; valid: {', '.join(OPS)}")
    where = f"CUDA tensors, {args.ranks} ranks sharing {torch.cuda.get_device_name()}" if args.device == "cuda" else \
        f"host tensors, {args.ranks} ranks"
    print(f"gloo on {where} (torch {torch.__version__})")
    failed = 0
    for op in ops:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.abspath(__file__), "--probe", op]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env={**os.environ, "PYTHONFAULTHANDLER": "1", "PROBE_DEVICE": args.device})
            ok = out.returncode == 0
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                with open(os.path.join(args.logs, f"{op}.log"), "w") as fh:
                    fh.write(out.stdout + out.stderr)
            why = "" if ok else _why(out.stdout + out.stderr)
        except subprocess.TimeoutExpired:
            ok, why = False, f"no result in {args.timeout:.0f} s"
        failed += not ok
        print(f"  {op:24s} {'ok' if ok else 'FAILED: ' + why}", flush=True)
    return 1 if failed else 0


def _why(text: str) -> str:
    """The failure in a line: the signal, or the last exception, and the innermost frame faulthandler printed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    signal = next((ln for ln in lines if "Fatal Python error" in ln or "Signals.SIG" in ln or "exitcode" in ln), "")
    error = next((ln for ln in reversed(lines) if "Error" in ln and not ln.startswith("File")), "")
    frame = next((ln for ln in lines if ln.startswith("File ")), "")
    return " | ".join(x for x in (signal, error, frame) if x)[:600]


if __name__ == "__main__":
    sys.exit(main())
