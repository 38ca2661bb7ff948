#!/usr/bin/env python
"""Sharded training: memory per rank and seconds per step of each layout, and a whole GRPO run dp cannot hold.

Part `layouts` starts one torchrun world (gloo, CPU) per (layout, world size) on --model (default `llama-500m`, a
~0.54 B-parameter Llama, random init, no download) and takes --steps GRPO train steps of one synthetic batch
(--rows sequences of --tokens tokens, the first half prompt) after one warm-up step. Per rank it measures the bytes
of parameters, gradients (after a backward) and AdamW state this rank holds, the process's peak RSS, and the
median seconds of a train step. A (layout, world) whose replicated copies would not fit this machine's memory
(16 bytes a parameter on each rank) is listed as skipped with what it would need.

Part `weights` moves the weights of --model (bf16 on the wire) from each layout's train ranks (--weights-layouts,
--worlds) through a real MetaServer (shared memory, as the runtime on one host) into a rollout model in this
process, by two paths: `pieces`, what the runtime does (each rank sends only what it holds: its DTensor pieces, its
share of the rows of what it holds alike with others; the rollout side puts every parameter together), and
`gathered`, the path before it (every parameter gathered whole, each rank keeping every world-th name). Seconds
from the go to the last tensor loaded, and the weights' GB/s over them.

Part `run` is the real runtime: `examples/grpo_trainer.py` under torchrun with --run-world train ranks and
--parallel.layout fsdp on --model for 2 GRPO steps (no warm start; --run-dtype bfloat16: bf16 compute and a bf16
rollout server, fp32 master weights and AdamW state), sampling every process of the run (train ranks, rollout
server, scheduler) a few times a second; it prints the whole run's peak three ways: the machine's used memory over
its level before the run, the processes' PSS summed, and their RSS summed (which counts shared pages once per
process).

    python benchmarks/sharding.py                                   # both parts
    python benchmarks/sharding.py --part layouts --worlds 2 --layouts dp,fsdp --model llama-25m
    python benchmarks/sharding.py --part weights --worlds 2,4 --model llama-110m
    python benchmarks/sharding.py --part run --run-world 4
    python benchmarks/sharding.py --part run --device cuda --model qwen2-1.5b --run-world 2 --run-steps 3

`--device cuda`: every rank (and the run's rollout server) on the GPU, cuda:(local rank mod GPUs); ranks that share a
GPU reduce over gloo (NCCL refuses two ranks of one communicator on one GPU), nccl otherwise. The layouts table's
peak is then torch's peak CUDA allocation per rank, and part run adds the GPUs' used memory (nvidia-ml-py, 5 Hz).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
WORLDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_worlds.py")  # one world, under torchrun

from sharding_worlds import LAYOUTS  # noqa: E402  (the benchmarks folder is this script's own)


def launch(cmd: list[str], log_path: str, on_poll: Any = None) -> tuple[int, str]:
    """Run cmd in its own process group (rlhf.procs.spawn), its output into log_path; the whole group is stopped
    when it ends or this script does (Ctrl-C, an error): no process is left behind. on_poll(proc) runs 5 times a
    second meanwhile. Returns (exit code, output)."""
    from rlhf.procs import spawn, stop_group

    proc = spawn(cmd, env=dict(os.environ), log_path=log_path, cwd=ROOT)
    try:
        while proc.poll() is None:
            if on_poll is not None:
                on_poll(proc)
            time.sleep(0.2)
    finally:
        code = stop_group(proc)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        return (code if code is not None else -1), fh.read()


def rank_errors(text: str) -> str:
    """What the ranks of a failed world said: each rank's exception line and the frames of this project above it
    (torchrun's own summary after them says only the exit codes), or the output's end when no rank raised."""
    lines = text.splitlines()
    picked = [ln for i, ln in enumerate(lines)
              if re.match(r"^\[rank\d+\]: \w*(Error|Exception)\b", ln)
              or ("/rlhf/" in ln or "/benchmarks/" in ln) and ln.lstrip("[rank0123456789]: ").startswith("File ")]
    return "\n".join(picked[-40:]) if picked else text[-2000:]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights_part(args: argparse.Namespace) -> None:
    """The weights upload of each layout and world, by each path, through a real MetaServer (shared memory) into a
    rollout model in this process: seconds from the go to the last tensor loaded, and GB/s of the bf16 weights."""
    import asyncio

    import torch
    import torch.distributed as dist

    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer
    from rlhf.pieces import import_pieces
    from rlhf.services.metaserver import MetaServer, pull_pieces
    from rlhf.transport.client import Client

    torch.set_num_threads(2)
    rollout, _ = build_model_and_tokenizer(ModelConfig(name=args.model, dtype="bfloat16"), seed=2, device="cpu")
    nbytes = sum(p.numel() * p.element_size() for p in rollout.parameters())
    print(f"weights: {args.model}, {nbytes / 1e9:.2f} GB in bf16 to one rollout model; {args.repeats} timed updates "
          "after one warm-up, per layout, world and path", flush=True)
    token = "bench-weights"
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for name in args.weights_layouts.split(","):
            meta = MetaServer(token, max_versions=1, max_bytes=4 * nbytes, transport="shm")
            url = meta.start()
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            versions = [f"{name}-{path}-{i}" for path in ("gathered", "pieces") for i in range(args.repeats + 1)]
            for key, value in (("url", url), ("token", token), ("shm_dir", meta.shm_dir),
                               ("versions", ",".join(versions))):
                store.set(key, value)
            tmp = tempfile.mkdtemp(prefix="rlhf-bench-weights-")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", WORLDS,
                   "--weights-worker", "--layout", name, "--model", args.model, "--store-port", str(store.port)]
            from rlhf.procs import spawn, stop_group

            proc = spawn(cmd, env=dict(os.environ), log_path=os.path.join(tmp, "out.log"), cwd=ROOT)
            timings: dict[str, list[tuple[float, float]]] = {"gathered": [], "pieces": []}
            try:
                for version in versions:
                    async def update() -> None:
                        client = Client(url, token)
                        try:
                            await client.call("/versions", {"version": version, "shards": world})
                            store.set(f"go/{version}", "1")
                            import_pieces(rollout, await pull_pieces(client, version, 600, 600))  # as a rollout server
                        finally:
                            await client.close()

                    t0 = time.perf_counter()
                    asyncio.run(update())
                    seconds = time.perf_counter() - t0
                    ups = [json.loads(store.get(f"up/{version}/{r}")) for r in range(world)]
                    if not version.endswith("-0"):  # the first of each path warms up
                        timings[version.split("-")[1]].append((seconds, max(u["seconds"] for u in ups)))
                if proc.wait(timeout=120) != 0:
                    raise SystemExit(f"weights worker failed:\n{open(os.path.join(tmp, 'out.log')).read()[-3000:]}")
            finally:
                stop_group(proc)
                meta.stop()
                shutil.rmtree(tmp, ignore_errors=True)
            for path, got in timings.items():
                seconds = statistics.median(t for t, _ in got)
                rows.append((world, name, path, statistics.median(u for _, u in got), seconds, nbytes / seconds / 1e9))
            print(f"world {world} {name}: done", flush=True)
    print()
    print("| world | layout | path | upload s (slowest rank) | update s (go to loaded) | GB/s |")
    print("|---:|---|---|---:|---:|---:|")
    for world, name, path, upload, seconds, rate in rows:
        label = "pieces (each rank its own)" if path == "pieces" else "gathered, by name (before)"
        print(f"| {world} | {name} | {label} | {upload:.2f} | {seconds:.2f} | {rate:.2f} |")


# ---------------------------------------------------------------------------- the tables


def model_params(name: str) -> int:
    import torch

    from rlhf.models import MODEL_PRESETS

    config = MODEL_PRESETS[name](256)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def machine_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def layouts_part(args: argparse.Namespace) -> None:
    n = model_params(args.model)
    print(f"model {args.model}: {n / 1e9:.2f} B parameters, {n * 4 / 2**30:.1f} GiB fp32; batch {args.rows} x "
          f"{args.tokens} tokens; {args.steps} timed steps after 1 warm-up; this machine {machine_bytes() / 2**30:.0f} "
          f"GiB", flush=True)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        base = None
        for name in args.layouts.split(","):
            parallel, tp = LAYOUTS[name]
            if world % tp:
                continue
            # replicated (dp, or dp x tp: each TP rank a 1/tp share of the layers, the embeddings whole) on each rank:
            # parameters, gradients, their flat all-reduce buffer and AdamW's two moments, 20 bytes a parameter
            need = world * n * 20 * (1.0 if tp == 1 else 0.6) if parallel == "dp" else 0
            if need > 0.8 * machine_bytes():
                if tp == 1:
                    base = base or {"layout": f"dp x{world} (replicated)", "state": n * 16.0}  # computed, not run
                rows.append((world, name, None, f"skipped: ~{need / 2**30:.0f} GiB of replicas"
                             + (f" (model+opt {n * 16 / 2**30:.2f} GiB / rank, computed)" if tp == 1 else "")))
                print(f"world {world} {name}: skipped (~{need / 2**30:.0f} GiB of replicas)", flush=True)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "out.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                       "--master_addr=127.0.0.1", f"--master_port={free_port()}", WORLDS, "--worker",
                       "--layout", name, "--model", args.model, "--rows", str(args.rows), "--tokens", str(args.tokens),
                       "--steps", str(args.steps), "--out", out, "--device", args.device]
                t0 = time.perf_counter()
                code, text = launch(cmd, os.path.join(tmp, "out.log"))
                if code != 0:
                    killed = "SIGKILL" in text or "exitcode  : -9" in text
                    rows.append((world, name, None, "failed: killed (out of memory)" if killed else
                                 f"failed: exit {code}"))
                    print(f"world {world} {name}: failed\n{rank_errors(text)}", flush=True)
                    continue
                with open(out) as fh:
                    got = json.load(fh)
            per_rank = got["per_rank"]
            state = max(p[0] + p[1] + p[2] for p in per_rank)
            result = {"layout": got["layout"], "params": max(p[0] for p in per_rank),
                      "grads": max(p[1] for p in per_rank), "optimizer": max(p[2] for p in per_rank), "state": state,
                      "rss": max(p[3] for p in per_rank), "step_s": statistics.median(p[4] for p in per_rank)}
            if name == "dp":
                base = result
            rows.append((world, name, result, ""))
            print(f"world {world} {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        for w, name, result, note in rows:
            if w == world and result is not None and base is not None:
                result["vs_dp_state"] = result["state"] / base["state"]
                if "step_s" in base:
                    result["vs_dp_step"] = result["step_s"] / base["step_s"]
    gib = 2**30
    print()
    peak = "peak CUDA allocated / rank" if args.device == "cuda" else "peak RSS / rank"
    print(f"| world | layout | params / rank | grads / rank | AdamW / rank | model+opt / rank | vs dp | {peak} "
          "| s/step | vs dp |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world, name, r, note in rows:
        if r is None:
            print(f"| {world} | {name} | {note} | | | | | | | |")
            continue
        vs_state = f"{r['vs_dp_state']:.2f}x" if "vs_dp_state" in r else "-"
        vs_step = f"{r['vs_dp_step']:.2f}x" if "vs_dp_step" in r else "-"
        print(f"| {world} | {r['layout']} | {r['params'] / gib:.2f} GiB | {r['grads'] / gib:.2f} GiB | "
              f"{r['optimizer'] / gib:.2f} GiB | {r['state'] / gib:.2f} GiB | {vs_state} | {r['rss'] / gib:.2f} GiB | "
              f"{r['step_s']:.2f} | {vs_step} |")


def run_part(args: argparse.Namespace) -> None:
    """A whole GRPO run under fsdp, the RSS of every one of its processes summed, sampled at 5 Hz."""
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.run_world}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(ROOT, "examples",
                                                                                       "grpo_trainer.py"),
               "--run-dir", run_dir, "--model.name", args.model, "--model.dtype", args.run_dtype,
               "--parallel.layout", "fsdp", "--steps", str(args.run_steps), "--model.device", args.device,
               "--sft.max_steps", "0", "--rollout.servers", "1", "--rollout.prompts_per_step", "4",
               "--rollout.group_size", "4", "--sampling.max_new_tokens", "4", "--train.micro_batch_size", "4",
               "--task.eval_size", "4", "--task.val_size", "4", "--checkpoint.latest_every", "0",
               "--timeouts.rpc_s", "1800", "--weights.upload_timeout_s", "1800",
               "--weights.update_timeout_s", "1800", "--weights.max_versions", "1"]
        t0 = time.perf_counter()
        # three views of the run's memory, each at its own peak: the RSS of every process summed (counts each page
        # that several processes map, torch's libraries and the shared-memory weights, once per process), their PSS
        # summed (a shared page split between its mappers: what the processes cost together), and how much the
        # machine's used memory (total - available, tmpfs files included) rose over its level before the run
        baseline = used_bytes()
        peak: dict[str, Any] = {"rss": 0, "pss": 0, "machine": 0, "parts": {}, "gpu": 0}
        gpus = gpu_handles() if args.device == "cuda" else []
        gpu_base = sum(gpu_used(h) for h in gpus)

        def sample(proc: Any) -> None:
            if gpus:
                peak["gpu"] = max(peak["gpu"], sum(gpu_used(h) for h in gpus) - gpu_base)
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = {}
            for p in family:
                try:
                    rss[p] = p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            total = sum(rss.values())
            peak["rss"] = max(peak["rss"], total)
            peak["machine"] = max(peak["machine"], used_bytes() - baseline)
            if total < 0.97 * peak["rss"]:
                return  # PSS walks every page of every process: read only near the peak, not to slow the run
            pss_total, parts = 0, {}
            for p, r in rss.items():
                try:
                    pss = p.memory_full_info().pss
                    name = " ".join(p.cmdline()[1:3])[-40:]
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                pss_total += pss
                parts[f"{p.pid} {name}"] = (r, pss)
            if pss_total > peak["pss"]:
                peak["pss"], peak["parts"] = pss_total, parts

        code, text = launch(cmd, os.path.join(tmp, "run.log"), sample)
        wall = time.perf_counter() - t0
    if code != 0:
        print(text[-3000:])
        raise SystemExit(f"the run failed (exit {code})")
    summary = json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))
    print(f"GRPO run: {args.model} ({args.run_dtype}) on {args.run_world} train ranks ({args.device}), parallel.layout "
          f"fsdp ({summary['train_layout']}), {args.run_steps} steps, 1 rollout server: finished in {wall:.0f} s, step "
          f"median {summary['step_time_median_s']:.1f} s")
    gib = 2**30
    if gpus:
        print(f"GPU memory used by the run at its peak (nvidia-ml-py, {len(gpus)} GPU(s), over its level before the "
              f"run): {peak['gpu'] / gib:.2f} GiB of {sum(gpu_total(h) for h in gpus) / gib:.0f} GiB")
    print(f"whole run's peak memory (machine {machine_bytes() / gib:.0f} GiB): the machine's used memory rose by "
          f"{peak['machine'] / gib:.2f} GiB; every process's PSS summed {peak['pss'] / gib:.2f} GiB; their RSS summed "
          f"{peak['rss'] / gib:.2f} GiB (shared pages counted once per process)")
    print("  at the PSS peak:     RSS       PSS")
    for name, (rss, pss) in sorted(peak["parts"].items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {rss / gib:16.2f} GiB {pss / gib:5.2f} GiB  {name}")


def gpu_handles() -> list[Any]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]


def gpu_used(handle: Any) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def gpu_total(handle: Any) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


def used_bytes() -> int:
    """The machine's used memory: total - available (page cache that can be dropped does not count; tmpfs does)."""
    import psutil

    vm = psutil.virtual_memory()
    return vm.total - vm.available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["layouts", "weights", "run", "all"], default="all")
    parser.add_argument("--model", default="llama-500m", help="model preset (default llama-500m, ~0.54 B params)")
    parser.add_argument("--worlds", default="2,4", help="train world sizes of part layouts")
    parser.add_argument("--layouts", default="dp,fsdp,tp,fsdp+tp", help=f"of: {', '.join(LAYOUTS)}")
    parser.add_argument("--rows", type=int, default=4, help="sequences in the global batch")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed train steps (after one warm-up step)")
    parser.add_argument("--run-world", type=int, default=4, help="train ranks of part run")
    parser.add_argument("--run-steps", type=int, default=2, help="GRPO steps of part run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks compute (cuda: ranks sharing a GPU reduce over gloo)")
    parser.add_argument("--run-dtype", default="bfloat16",
                        help="part run's model.dtype: the rollout server's weights and the train compute (FSDP keeps "
                             "fp32 master weights and AdamW state)")
    parser.add_argument("--weights-layouts", default="dp,fsdp", help=f"layouts of part weights, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed weights updates of part weights (after one)")
    args = parser.parse_args()
    if args.part in ("layouts", "all"):
        layouts_part(args)
    if args.part in ("weights", "all"):
        weights_part(args)
    if args.part in ("run", "all"):
        run_part(args)


if __name__ == "__main__":
    main()
