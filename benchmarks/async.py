#!/usr/bin/env python
"""Synchronous against asynchronous GRPO (rollout.mode async) on the default workload, in one run.

Each (setup, mode) is a real run of the README's command, one after another on the same machine:

  setups  1+1   python examples/grpo_trainer.py                    (1 train rank, 1 rollout server)
          2+2   torchrun --nproc_per_node=2 ... --rollout.servers 2
  modes   sync          the seeds' system: generate with the step's weights, then train
          async-k1      --rollout.mode async --rollout.max_staleness 1
          async-k2      --rollout.mode async --rollout.max_staleness 2
          groups-k1     async-k1 with --rollout.buffer group (generated group by group; a step takes the first
                        groups that end)
          groups-k2     async-k2 with --rollout.buffer group

It prints a table per run: trained samples per second over the GRPO steps (their batch sizes over their seconds),
each side's busy fraction (1 - train_idle_s / seconds for the train ranks, 1 - rollout_idle_s / seconds for the
rollout servers), the steps' median staleness and rollout-vs-train logprob difference, the greedy eval accuracy
before and after and the GRPO phase's wall time; then the throughput ratio to sync per setup. --figure draws eval
accuracy against the GRPO phase's wall time (--eval-every steps apart).

    python benchmarks/async.py                                     # 1+1: sync, async-k1, async-k2 (~7 min here)
    python benchmarks/async.py --setups 1+1,2+2 --modes sync,async-k1 --figure docs/async_accuracy.png
    python benchmarks/async.py --steps 3 --modes sync,async-k1 -- --preset smoke   # seconds: a smoke check
    python benchmarks/async.py --modes sync,async-k1 --judge-latency 0.3   # a remote judge's 0.3 s (emulated)

--judge-latency S scores every run with benchmarks/remote_judge.py:judged: exact match after S seconds of wall time
that use no CPU here (EMULATED: asyncio.sleep), as a remote LLM judge or a sandbox farm would take.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODES = {"sync": [], "async-k1": ["--rollout.mode", "async", "--rollout.max_staleness", "1"],
         "async-k2": ["--rollout.mode", "async", "--rollout.max_staleness", "2"],
         "groups-k1": ["--rollout.mode", "async", "--rollout.max_staleness", "1", "--rollout.buffer", "group"],
         "groups-k2": ["--rollout.mode", "async", "--rollout.max_staleness", "2", "--rollout.buffer", "group"]}
SETUPS = ("1+1", "2+2")


def command(setup: str, mode: str, run_dir: str, seed: int, port: int, extra: list[str]) -> list[str]:
    script = os.path.join(ROOT, "examples", "grpo_trainer.py")
    head = [sys.executable, script] if setup == "1+1" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={port}", script, "--rollout.servers", "2"]
    return head + ["--seed", str(seed), "--run-dir", run_dir, *MODES[mode], *extra]


def one(setup: str, mode: str, work: str, seed: int, port: int, extra: list[str], env: dict[str, str]) -> dict:
    run_dir = os.path.join(work, f"{setup}-{mode}")
    out = subprocess.run(command(setup, mode, run_dir, seed, port, extra), capture_output=True, text=True, cwd=ROOT,
                         env=env)
    if out.returncode != 0:
        return {"setup": setup, "mode": mode, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        rows = list(csv.DictReader(fh))
    seconds = [float(r["seconds"]) for r in rows]
    wall, curve = 0.0, [(0.0, summary["eval_accuracy_before"])]
    for r, s in zip(rows, seconds):
        wall += s
        if r.get("eval_accuracy"):
            curve.append((wall, float(r["eval_accuracy"])))
    curve.append((wall, summary["eval_accuracy_after"]))

    def busy(column: str) -> float:
        return 1 - sum(float(r[column] or 0) for r in rows) / sum(seconds)

    return {"setup": setup, "mode": mode, "samples_per_s": sum(int(r["batch_size"]) for r in rows) / sum(seconds),
            "train_busy": busy("train_idle_s"), "rollout_busy": busy("rollout_idle_s"),
            "staleness": statistics.median(float(r["staleness_mean"]) for r in rows),
            "lp_diff": statistics.median(float(r["rollout_train_logprob_diff"] or 0) for r in rows),
            "before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"], "wall": wall,
            "curve": curve}


def figure(results: list[dict], path: str, judge_s: float = 0.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        if "curve" in r:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{r['setup']} {r['mode']}")
    ax.set_xlabel("GRPO wall time, s (after the SFT warm start)")
    ax.set_ylabel("greedy eval accuracy")
    ax.set_title("Sync against async GRPO, the default workload" + (
        f",\nscored by a remote judge (emulated: {judge_s:g} s a call)" if judge_s else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="1+1", help=f"comma-separated, of: {', '.join(SETUPS)}")
    ap.add_argument("--modes", default="sync,async-k1,async-k2", help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps of each run (default: the preset's)")
    ap.add_argument("--eval-every", type=int, default=0, help="an eval every N steps, for --figure (default: none)")
    ap.add_argument("--figure", default="", help="write eval accuracy against wall time here (PNG)")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--judge-latency", type=float, default=0.0, metavar="S",
                    help="score with benchmarks/remote_judge.py:judged, S seconds a call (EMULATED latency: no CPU)")
    ap.add_argument("extra", nargs="*", help="more flags for every run, after --")
    args = ap.parse_args()
    setups, modes = args.setups.split(","), args.modes.split(",")
    for name, given, valid in (("--setups", setups, SETUPS), ("--modes", modes, MODES)):
        bad = [x for x in given if x not in valid]
        if bad:
            raise SystemExit(f"{name}: {', '.join(bad)} not known (valid: {', '.join(valid)})")
    extra = list(args.extra) + (["--steps", str(args.steps)] if args.steps else []) + (
        ["--eval_every", str(args.eval_every)] if args.eval_every else [])
    env = dict(os.environ)
    if args.judge_latency < 0:
        raise SystemExit(f"--judge-latency: {args.judge_latency} (at least 0)")
    if args.judge_latency:
        env["RLHF_JUDGE_LATENCY_S"] = str(args.judge_latency)
        extra += ["--reward.functions", os.path.join(ROOT, "benchmarks", "remote_judge.py") + ":judged"]
    work = args.out or tempfile.mkdtemp(prefix="rlhf-async-")
    results = []
    try:
        for k, (setup, mode) in enumerate((s, m) for s in setups for m in modes):
            r = one(setup, mode, work, args.seed, 29700 + k, extra, env)
            results.append(r)
            print(f"{setup} {mode}: " + (f"failed: {r['error']}" if "error" in r else
                  f"{r['samples_per_s']:.1f} trained samples/s, eval {r['before']:.3f} -> {r['after']:.3f}, "
                  f"GRPO {r['wall']:.0f} s"), flush=True)
    finally:
        if not args.out:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print("\n| setup | mode | trained samples/s | vs sync | train busy | rollout busy | staleness (median) | "
          "rollout-train logprob diff (median) | eval before | eval after | GRPO wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {r["setup"]: r["samples_per_s"] for r in results if r["mode"] == "sync" and "error" not in r}
    for r in results:
        if "error" in r:
            print(f"| {r['setup']} | {r['mode']} | failed: {r['error']} | | | | | | | | |")
            continue
        ratio = f"{r['samples_per_s'] / base[r['setup']]:.2f}x" if r["setup"] in base else ""
        print(f"| {r['setup']} | {r['mode']} | {r['samples_per_s']:.1f} | {ratio} | {r['train_busy']:.0%} | "
              f"{r['rollout_busy']:.0%} | {r['staleness']:.2f} | {r['lp_diff']:.2g} | {r['before']:.3f} | "
              f"{r['after']:.3f} | {r['wall']:.0f} |")
    if args.figure:
        figure(results, args.figure, args.judge_latency)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
