#!/usr/bin/env python
"""What tracing costs: GRPO step time with tracing off vs on (file exporter), on the default run.

Three measurements:

  points       the cost of a disarmed fault point per hit (sync and async), and how many points
               a step hits (counted by arming a zero-delay fault on every point of a smoke run).

and for tracing:

  end to end   the default run (`python examples/grpo_trainer.py`, world size 1, one rollout
               server) is warmed up once (SFT + 1 step), then resumed from that checkpoint in
               fresh run directories for --steps steps with `--tracing.enabled false` and `true`,
               alternating off/on --repeats times (this machine's speed drifts by ±15 % between
               minutes; pairing neighbours cancels most of it). Median step time per mode, and
               the median of the per-pair ratios.
  per span     the cost of one span (start, attributes, end, batch export to the file) in a
               tight loop, times the spans a step actually makes (counted from the traces):
               an estimate of the overhead that the noise of end-to-end timing cannot resolve.

    python benchmarks/overhead.py                    # --steps 30 --repeats 3
    python benchmarks/overhead.py --part points      # the cost of disarmed fault points only
    python benchmarks/overhead.py --steps 50 --repeats 5
"""

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def run(run_dir: str, steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--run-dir", run_dir, "--steps", str(steps),
           *extra]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def step_times(run_dir: str, skip: int) -> list[float]:
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        return [float(r["seconds"]) for r in list(csv.DictReader(fh))[skip:]]


def spans_per_step(run_dir: str) -> float:
    from rlhf.tracing.read import load_spans

    ts = load_spans(run_dir)
    roots = ts.step_roots()
    by_trace = ts.by_trace()
    return statistics.median(len(by_trace[r.trace_id]) for r in roots.values())


def per_span_cost_us(rounds: int = 20, per_round: int = 1000) -> float:
    from rlhf import tracing
    from rlhf.config import TracingConfig

    tmp = tempfile.mkdtemp(prefix="rlhf-bench-span-")
    try:
        tracing.setup_tracing(tmp, "controller", 0, TracingConfig())
        with tracing.span("warmup", new_trace=True):
            pass
        t0 = time.perf_counter()
        for _ in range(rounds):  # rounds below the span queue's size (2048), so no span is dropped
            with tracing.span("step", step=1, new_trace=True):
                for _ in range(per_round):
                    with tracing.span("rollout", stage="rollout", step=1, peer="rollout-0"):
                        pass
            tracing.flush()  # the export to the file is part of the cost
        elapsed = time.perf_counter() - t0
        tracing.shutdown_tracing()
        return elapsed / (rounds * (per_round + 1)) * 1e6
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def disarmed_point_cost_ns(n: int = 1_000_000) -> tuple[float, float]:
    """Per-hit cost of a disarmed fault point, sync and async (nothing armed in this process)."""
    import asyncio

    from rlhf import faults

    faults.disarm()
    point = faults.fault_point
    t0 = time.perf_counter()
    for _ in range(n):
        point("train.step", step=1)
    sync_ns = (time.perf_counter() - t0) / n * 1e9

    async def many() -> float:
        t = time.perf_counter()
        for _ in range(n // 10):
            await faults.afault_point("rpc.client.send", peer="train-1")
        return (time.perf_counter() - t) / (n // 10) * 1e9

    return sync_ns, asyncio.run(many())


def point_hits_per_step(steps: int = 6) -> float:
    """Arm a zero-delay network_delay on every point and count the injections per step of a smoke run."""
    import json as _json

    tmp = tempfile.mkdtemp(prefix="rlhf-bench-points-")
    try:
        spec = os.path.join(tmp, "all.yaml")
        with open(spec, "w") as fh:
            fh.write("faults:\n  - name: count\n    kind: network_delay\n    point: '*'\n    params: {delay_ms: 0}\n")
        run_dir = os.path.join(tmp, "run")
        run(run_dir, steps, ["--preset", "smoke", "--faults", spec])
        with open(os.path.join(run_dir, "faults", "markers.jsonl")) as fh:
            hits = [m for m in map(_json.loads, fh) if m["event"] == "inject" and m["step"] >= 1]
        return len(hits) / steps
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps per measured run")
    ap.add_argument("--repeats", type=int, default=3, help="off/on pairs")
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--part", choices=["all", "tracing", "points"], default="all")
    args = ap.parse_args()
    if args.part in ("all", "points"):
        sync_ns, async_ns = disarmed_point_cost_ns()
        hits = point_hits_per_step()
        print("\nFault points, all disarmed\n")
        print("| measure | value |")
        print("|---|---:|")
        print(f"| one disarmed point, sync | {sync_ns:.0f} ns |")
        print(f"| one disarmed point, async (await) | {async_ns:.0f} ns |")
        print(f"| points hit per step (world 1 smoke run, counted by arming every point) | {hits:.0f} |")
        print(f"| disarmed cost per step | {hits * max(sync_ns, async_ns) / 1000:.1f} us |")
        if args.part == "points":
            return

    base = tempfile.mkdtemp(prefix="rlhf-bench-overhead-")
    try:
        warm = os.path.join(base, "warm")
        print("[overhead] warm-up run: SFT warm start + 1 GRPO step", file=sys.stderr, flush=True)
        run(warm, 1, [])
        times: dict[str, list[float]] = {"off": [], "on": []}
        ratios = []
        spans = 0.0
        for i in range(args.repeats):
            medians = {}
            for mode in ("off", "on"):
                d = os.path.join(base, f"{mode}-{i}")
                shutil.copytree(os.path.join(warm, "checkpoints"), os.path.join(d, "checkpoints"))
                run(d, 1 + args.steps, ["--tracing.enabled", "true" if mode == "on" else "false"])
                t = step_times(d, args.skip)
                times[mode] += t
                medians[mode] = statistics.median(t)
                if mode == "on":
                    spans = spans_per_step(d)
            ratios.append(medians["on"] / medians["off"])
            print(f"[overhead] pair {i + 1}/{args.repeats}: off {medians['off'] * 1000:.1f} ms, "
                  f"on {medians['on'] * 1000:.1f} ms", file=sys.stderr, flush=True)
        span_us = per_span_cost_us()
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"\nTracing overhead on the default run (world 1, 1 rollout server), {args.repeats} off/on pairs x "
              f"{args.steps} steps\n")
        print("| measure | value |")
        print("|---|---:|")
        print(f"| step time, tracing off (median) | {off * 1000:.1f} ms |")
        print(f"| step time, tracing on, file exporter (median) | {on * 1000:.1f} ms |")
        print(f"| ratio on/off, median of pairs | {statistics.median(ratios):.3f} |")
        print(f"| pair ratios | {', '.join(f'{r:.3f}' for r in ratios)} |")
        print(f"| spans per step (all processes) | {spans:.0f} |")
        print(f"| cost of one span incl. export | {span_us:.1f} us |")
        print(f"| estimated overhead per step | {spans * span_us / 1000:.2f} ms = "
              f"{100 * spans * span_us / 1e6 / off:.2f} % |")
        print(json.dumps({"off_ms": off * 1000, "on_ms": on * 1000, "ratio": statistics.median(ratios),
                          "spans_per_step": spans, "span_us": span_us}))
    finally:
        if args.keep:
            print(f"[overhead] run directories kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
