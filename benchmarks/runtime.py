#!/usr/bin/env python
"""Runtime costs: where a GRPO step's time goes, and what a weights update costs.

Part `stages` runs the real system (torchrun, 2 train ranks, 2 rollout servers) for --steps
steps per weights mode and prints the median seconds of every stage of a step
with its share of the step, read from the run's steps.csv. `--from-run DIR` reads an existing
run directory instead of starting one.

Part `bandwidth` moves the weights of --model (default `llama-25m`, ~100 MB fp32) the way a
step does, with one process per train rank and per rollout server, and a MetaServer in this
process as in the controller:

  meta   every train rank serialises its share (1/ranks of every tensor's rows) and PUTs it to the MetaServer while every
         rollout server already waits on the manifest, fetches all shards, checks each tensor's crc32 and
         loads them into its model; time = from the start signal until the last server loaded.
  distributed  train rank 0 and the rollout servers form a gloo process group; rank 0 broadcasts the weights
         bucket by bucket (a flat buffer each, --bucket-mb) and each server copies them into its model (as
         /update_weights_from_distributed); any host
  disk   rank 0 writes an HF safetensors directory (as `save_weights_dir`), then every rollout
         server reads it and loads it into its model (as `/update_weights_from_disk`).
  copy   a plain in-memory copy of the same bytes (param.copy_), one process: the floor.

Rates are the model's bytes divided by the wall time (each server receives the whole model).

    python benchmarks/runtime.py                                   # both parts
    python benchmarks/runtime.py --part bandwidth --repeats 5
    python benchmarks/runtime.py --part stages --steps 20 --modes meta,disk
    python benchmarks/runtime.py --part stages --from-run runs/a runs/b
"""

import argparse
import asyncio
import csv
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

STAGES = ["weights_update", "events", "rollout", "reward", "reference", "advantage", "train",
          "latest_recover_save", "periodic_recover_save"]


# ---------------------------------------------------------------------------- stages


def stage_table(run_dir: str, skip: int) -> list[tuple[str, float, float]]:
    with open(os.path.join(run_dir, "steps.csv")) as f:
        rows = list(csv.DictReader(f))[skip:]
    if not rows:
        raise SystemExit(f"{run_dir}/steps.csv has no steps after skipping {skip}")
    step = statistics.median(float(r["seconds"]) for r in rows)
    out = []
    for s in STAGES:
        values = [float(r[f"{s}_s"]) for r in rows if r.get(f"{s}_s") not in (None, "")]
        med = statistics.median(values) if values else 0.0
        out.append((s, med, med / step if step else 0.0))
    out.append(("step (median)", step, 1.0))
    return out


def run_stages(args: argparse.Namespace) -> None:
    runs: list[tuple[str, str]] = []
    if args.from_run:
        runs = [(os.path.basename(os.path.normpath(d)), d) for d in args.from_run]
    else:
        base = tempfile.mkdtemp(prefix="rlhf-bench-runtime-")
        for mode in args.modes.split(","):
            run_dir = os.path.join(base, mode)
            cmd = ["torchrun", "--nproc_per_node", str(args.ranks), "--master_port", "0", "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", "127.0.0.1:0", os.path.join(ROOT, "examples", "grpo_trainer.py"),
                   "--run-dir", run_dir, "--steps", str(args.steps), "--rollout.servers", str(args.servers),
                   "--weights.mode", mode, "--seed", str(args.seed)]
            print(f"[stages] {mode}: {' '.join(cmd[4:])}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            print(f"[stages] {mode}: done in {time.perf_counter() - t0:.0f} s ({run_dir})", file=sys.stderr, flush=True)
            runs.append((mode, run_dir))
    tables = {name: stage_table(d, args.skip) for name, d in runs}
    names = list(tables)
    print(f"\nPer-stage time of a GRPO step, median over steps (first {args.skip} skipped), seconds and share of step\n")
    print("| stage | " + " | ".join(f"{n} s | {n} %" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for i, (stage, _, _) in enumerate(tables[names[0]]):
        cells = " | ".join(f"{tables[n][i][1]:.3f} | {100 * tables[n][i][2]:.1f}" for n in names)
        print(f"| {stage} | {cells} |")
    print("\n(stage medians need not add up to the step median; `events` is 0 unless --colocate)")


# ---------------------------------------------------------------------------- bandwidth


def _build(model_name: str, seed: int):
    import torch

    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer

    torch.set_num_threads(1)
    return build_model_and_tokenizer(ModelConfig(name=model_name), seed=seed)


def _uploader(rank: int, world: int, model_name: str, url: str, token: str, repeats: int, barrier, results,
              shm_dir: str = "", checksum: str = "none") -> None:
    from rlhf.pieces import own_pieces
    from rlhf.services.metaserver import push_shard
    from rlhf.transport.client import Client
    from rlhf.weights import encode_shard, write_shard

    model, _ = _build(model_name, seed=rank)

    async def put(version: str) -> int:  # as TrainWorker.upload_weights does
        client = Client(url, token)
        try:
            part, where = own_pieces(model, rank, world)
            if shm_dir:
                path = os.path.join(shm_dir, f"v{version}-rank{rank}.safetensors")
                size = write_shard(part, path, checksum, where)
                await push_shard(client, version, f"rank{rank}", None, 600, path=path)
                return size
            body = encode_shard(part, checksum, where)
            await push_shard(client, version, f"rank{rank}", body, 600)
            return len(body)
        finally:
            await client.close()

    for i in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        nbytes = asyncio.run(put(f"r{i}"))
        results.put(("upload", rank, time.perf_counter() - t0, nbytes))


def _puller(rank: int, model_name: str, url: str, token: str, repeats: int, barrier, results) -> None:
    from rlhf.pieces import import_pieces
    from rlhf.services.metaserver import pull_pieces
    from rlhf.transport.client import Client

    model, _ = _build(model_name, seed=100 + rank)

    async def pull(version: str) -> None:
        client = Client(url, token)
        try:
            import_pieces(model, await pull_pieces(client, version, 600, 600))
        finally:
            await client.close()

    for i in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        asyncio.run(pull(f"r{i}"))
        results.put(("pull", rank, time.perf_counter() - t0, 0))


def _disk_reader(rank: int, model_name: str, path: str, repeats: int, barrier, results) -> None:
    from rlhf.weights import import_state, load_state_dir

    model, _ = _build(model_name, seed=200 + rank)
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        import_state(model, load_state_dir(path))
        results.put(("read", rank, time.perf_counter() - t0, 0))


def _member(model_name: str, seed: int, port: int, rank: int, world: int, bucket_mb: float) -> tuple:
    """A process of the weights update group: (group, its model's parameters by name, the bucket plan)."""
    from rlhf.transport import weights_group as wg

    model, _ = _build(model_name, seed=seed)
    group = wg.join("127.0.0.1", port, rank, world, "gloo", 300)
    params = dict(sorted(model.named_parameters()))
    return group, params, wg.plan_buckets(wg.describe(params.items()), int(bucket_mb * 2**20))


def _broadcaster(model_name: str, port: int, world: int, bucket_mb: float, repeats: int, barrier, results) -> None:
    """Train rank 0 in distributed mode: every bucket packed flat and broadcast to the group."""
    from rlhf.transport import weights_group as wg

    group, params, plan = _member(model_name, 0, port, 0, world, bucket_mb)
    buffers = wg.Buffers()
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        for b in plan:
            wg.broadcast(group, wg.pack([params[n].detach() for n in b["names"]], "cpu", buffers))
        results.put(("broadcast", 0, time.perf_counter() - t0, 0))


def _receiver(rank: int, model_name: str, port: int, world: int, bucket_mb: float, repeats: int, barrier,
              results) -> None:
    """A rollout server in distributed mode: each bucket received into one flat buffer, then copied into the model
    (as /update_weights_from_distributed with the flattened_bucket format)."""
    import torch

    from rlhf.transport import weights_group as wg

    group, params, plan = _member(model_name, 100 + rank, port, 1 + rank, world, bucket_mb)
    buffers = wg.Buffers()
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        for b in plan:
            buffer = buffers.get(b["bytes"])
            wg.broadcast(group, buffer)
            with torch.no_grad():
                for name, t in wg.unpack(buffer, b["names"], b["dtypes"], b["shapes"]):
                    params[name].copy_(t)
        results.put(("receive", rank, time.perf_counter() - t0, 0))


async def _open_version(url: str, token: str, version: str, shards: int) -> None:
    from rlhf.transport.client import Client

    client = Client(url, token)
    try:
        await client.call("/versions", {"version": version, "shards": shards})
    finally:
        await client.close()


def _collect(results, n: int) -> list[tuple]:
    return [results.get(timeout=600) for _ in range(n)]


def run_bandwidth(args: argparse.Namespace) -> None:
    import torch

    from rlhf.services.metaserver import MetaServer
    from rlhf.weights import save_state_dir

    ctx = mp.get_context("spawn")
    model, tokenizer = _build(args.model, seed=0)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    mb = nbytes / 1e6
    print(f"[bandwidth] {args.model}: {sum(p.numel() for p in params) / 1e6:.1f} M params, {mb:.1f} MB; "
          f"{args.ranks} train ranks, {args.servers} rollout servers, {args.repeats} repeats", file=sys.stderr, flush=True)
    rows: dict[str, list[float]] = {"copy": []}
    total = args.warmup + args.repeats  # the first updates of a fresh process pay the kernel's first touch of
    # new memory (on this project's VM, 0.13 s instead of 0.016 s to write a 55 MB shard): not the steady state

    # copy: the same bytes, in memory
    dst = [torch.empty_like(p) for p in params]
    for i in range(total):
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, p in zip(dst, params):
                d.copy_(p)
        if i >= args.warmup:
            rows["copy"].append(time.perf_counter() - t0)

    # meta, over each transport
    token = "bench-token"
    for transport in ("shm", "http"):
        key = f"meta ({transport})"
        for k in (key, f"{key} upload (max rank)", f"{key} update (max server)"):
            rows[k] = []
        server = MetaServer(token, max_versions=2, max_bytes=4 * nbytes + (64 << 20), transport=transport)
        url = server.start()
        barrier, results = ctx.Barrier(1 + args.ranks + args.servers), ctx.Queue()
        procs = [ctx.Process(target=_uploader, args=(r, args.ranks, args.model, url, token, total, barrier,
                                                     results, server.shm_dir, args.checksum))
                 for r in range(args.ranks)]
        procs += [ctx.Process(target=_puller, args=(r, args.model, url, token, total, barrier, results))
                  for r in range(args.servers)]
        try:
            for p in procs:
                p.start()
            for i in range(total):
                asyncio.run(_open_version(url, token, f"r{i}", args.ranks))
                barrier.wait(timeout=300)
                t0 = time.perf_counter()
                got = _collect(results, args.ranks + args.servers)
                seconds = time.perf_counter() - t0
                what = "warm-up" if i < args.warmup else "repeat"
                print(f"[bandwidth] {key} {what} {i + 1}/{total}: {seconds:.2f} s", file=sys.stderr, flush=True)
                if i < args.warmup:
                    continue
                rows[key].append(seconds)
                rows[f"{key} upload (max rank)"].append(max(g[2] for g in got if g[0] == "upload"))
                rows[f"{key} update (max server)"].append(max(g[2] for g in got if g[0] == "pull"))
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            server.stop()

    # distributed: train rank 0 broadcasts to a gloo group of the servers (sglang's update_weights_from_distributed)
    from rlhf.transport import weights_group as wg

    rows["distributed (gloo broadcast)"] = []
    store = wg.open_store("127.0.0.1", 300)
    world = 1 + args.servers
    barrier = ctx.Barrier(1 + world)
    procs = [ctx.Process(target=_broadcaster, args=(args.model, store.port, world, args.bucket_mb, total, barrier,
                                                    results))]
    procs += [ctx.Process(target=_receiver, args=(r, args.model, store.port, world, args.bucket_mb, total, barrier,
                                                  results)) for r in range(args.servers)]
    try:
        for p in procs:
            p.start()
        for i in range(total):
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            _collect(results, world)
            seconds = time.perf_counter() - t0
            print(f"[bandwidth] distributed {'warm-up' if i < args.warmup else 'repeat'} {i + 1}/{total}: "
                  f"{seconds:.2f} s", file=sys.stderr, flush=True)
            if i >= args.warmup:
                rows["distributed (gloo broadcast)"].append(seconds)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        del store

    # disk
    for k in ("disk", "disk write (rank 0)", "disk read+load (max server)"):
        rows[k] = []
    tmp = tempfile.mkdtemp(prefix="rlhf-bench-disk-")
    path = os.path.join(tmp, "latest")
    barrier = ctx.Barrier(1 + args.servers)
    procs = [ctx.Process(target=_disk_reader, args=(r, args.model, path, total, barrier, results))
             for r in range(args.servers)]
    try:
        for p in procs:
            p.start()
        for i in range(total):
            t0 = time.perf_counter()
            shutil.rmtree(path, ignore_errors=True)
            save_state_dir(model, path, tokenizer)
            write = time.perf_counter() - t0
            barrier.wait(timeout=300)
            t1 = time.perf_counter()
            got = _collect(results, args.servers)
            seconds = write + time.perf_counter() - t1
            print(f"[bandwidth] disk {'warm-up' if i < args.warmup else 'repeat'} {i + 1}/{total}: {seconds:.2f} s",
                  file=sys.stderr, flush=True)
            if i < args.warmup:
                continue
            rows["disk write (rank 0)"].append(write)
            rows["disk read+load (max server)"].append(max(g[2] for g in got))
            rows["disk"].append(seconds)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nWeights update of {args.model} ({mb:.1f} MB fp32), {args.ranks} train ranks -> {args.servers} rollout "
          f"servers, median of {args.repeats} after {args.warmup} warm-up updates\n")
    print("| path | seconds | MB/s per server | vs copy |")
    print("|---|---:|---:|---:|")
    floor = statistics.median(rows["copy"])
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.3f} | {mb / med:,.0f} | {med / floor:.0f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "stages", "bandwidth"], default="all")
    ap.add_argument("--model", default="llama-25m", help="model preset for the bandwidth part")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5,
                    help="bandwidth: updates run first and not counted (a fresh process's first touch of new memory)")
    ap.add_argument("--ranks", type=int, default=2, help="train ranks (uploaders)")
    ap.add_argument("--servers", type=int, default=2, help="rollout servers (pullers / readers / receivers)")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="distributed: MB per broadcast bucket")
    ap.add_argument("--checksum", default="none", choices=["crc32", "sha256", "none"],
                    help="per-tensor digest the uploader writes and every rollout server checks (weights.checksum)")
    ap.add_argument("--steps", type=int, default=20, help="steps per run for the stages part")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--modes", default="meta,disk", help="weights modes for the stages part")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--from-run", nargs="+", default=[], help="read steps.csv of these run directories instead of running")
    args = ap.parse_args()
    if args.part in ("all", "bandwidth"):
        run_bandwidth(args)
    if args.part in ("all", "stages"):
        run_stages(args)


if __name__ == "__main__":
    main()
