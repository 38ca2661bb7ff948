#!/usr/bin/env python
"""The control plane's own cost by world size, in simulated worlds (rlhf.sim: the real controller, MetaServer,
scheduler, watchdog, tracing and `rlhf diagnose`; train ranks and rollout servers EMULATED, zero compute).

For each world (train ranks x rollout servers) it runs GRPO for --steps steps, one group of 8 samples per train rank
a step (rollout.prompts_per_step = train ranks, one mini-batch), and reads the run's steps.csv and files:

    step_s            median wall seconds a step (steps 2..N): the controller's own cost plus the simulated world's
                      HTTP handling, which shares this machine's cores with it
    controller_cpu_s  median CPU seconds of the controller's process a step (its MetaServer included)
    controller_rss_mb its peak resident memory
    requests          requests its clients send a step (heartbeats included), and MB both ways
    token_mb          rollout token bytes through the controller a step (/generate replies, the batches it sends
                      to /compute_logprobs and /train_step); 0 when it handled no token (rollout.data_plane store:
                      the rows stay in the rollout servers, the ranks fetch them; batch_mb is then row ids and
                      advantages)
    batch_mb          bytes of those routes a step, tokens or metadata
    meta_mb           MB the MetaServer answered with a weights update (manifests and shards)
    hb/s              heartbeat reads a second (the stall watchdog)
    spans, trace_mb   spans and trace bytes a step (every process's traces/)
    diagnose_s, _mb   `rlhf diagnose` on the run directory: seconds and peak memory (the run's own --steps; the
                      issue's 100-step directory is --steps 100)

    python benchmarks/scale.py                                   # 2x2,16x4,64x16,256x64,1024x256
    python benchmarks/scale.py --worlds 2x2,64x16 --plane both --steps 5 --json scale.json --figure docs/scale.png
"""

import argparse
import csv
import glob
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

DIAGNOSE = ("import json, resource, sys, time; from rlhf.cli import main; t = time.perf_counter(); "
            "code = main(['diagnose', sys.argv[1], '--json']); "
            "print('SCALE', json.dumps({'seconds': time.perf_counter() - t, "
            "'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), file=sys.stderr)")


def parse_worlds(text: str) -> list[tuple[int, int]]:
    worlds = []
    for part in text.split(","):
        try:
            train, servers = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--worlds: {part!r} is not TRAINxSERVERS (e.g. 1024x256)") from None
        if train < 1 or servers < 1:
            raise SystemExit(f"--worlds: {part!r}: both counts must be at least 1")
        worlds.append((train, servers))
    return worlds


# the control plane before this project's big-world changes: every rank uploads its 1/world of the weights, the
# MetaServer's manifest lists every rank's piece of every tensor, the controller calls each rank itself, and every
# rollout token passes through it (rollout.data_plane controller)
BEFORE = ["--weights.uploaders", "0", "--weights.merge_shards", "0", "--sim.fanout", "false",
          "--rollout.data_plane", "controller"]


def run_world(train: int, servers: int, steps: int, base: str, extra: list[str], plane: str = "after") -> dict:
    run_dir = os.path.join(base, f"world-{train}x{servers}-{plane}")
    extra = (BEFORE if plane == "before" else []) + extra
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--sim.train_ranks", str(train),
           "--rollout.servers", str(servers), "--steps", str(steps), "--run-dir", run_dir,
           "--rollout.prompts_per_step", str(train), "--train.mini_batches", "1", "--algorithm.resample_rounds", "0",
           "--timeouts.startup_s", "600", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise SystemExit(f"world {train}x{servers} failed (exit {done.returncode}), run dir {run_dir}:\n{tail}")
    with open(os.path.join(run_dir, "steps.csv")) as f:
        rows = list(csv.DictReader(f))
    later = rows[1:] or rows

    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in later)

    seconds = sum(float(r["seconds"]) for r in rows)
    spans = trace_bytes = 0
    for path in glob.glob(os.path.join(run_dir, "traces", "*.jsonl")):
        trace_bytes += os.path.getsize(path)
        with open(path, encoding="utf-8") as fh:
            spans += sum(line.count('"spanId"') for line in fh)
    t0 = time.perf_counter()
    diag = subprocess.run([sys.executable, "-c", DIAGNOSE, run_dir], capture_output=True, text=True, cwd=ROOT)
    found = [line for line in diag.stderr.splitlines() if line.startswith("SCALE ")]
    measured = json.loads(found[-1][6:]) if found else {"seconds": time.perf_counter() - t0, "rss_mb": float("nan")}
    return {"train_ranks": train, "rollout_servers": servers, "plane": plane, "steps": len(rows), "run_s": wall,
            "own_cost_s": med("seconds"), "controller_cpu_s": med("controller_cpu_s"),
            "controller_rss_mb": max(float(r["controller_rss_mb"]) for r in rows),
            "requests_per_step": med("controller_requests"), "controller_mb_per_step": med("controller_bytes") / 1e6,
            # the batch's bytes on the routes that carry it, when they carried rollout tokens (the controller plane);
            # the store plane's carry row ids and advantages only (controller_tokens: the tokens it handled, counted)
            "controller_token_bytes": med("controller_batch_bytes") if med("controller_tokens") else 0.0,
            "controller_batch_bytes": med("controller_batch_bytes"), "controller_tokens": med("controller_tokens"),
            "metaserver_bytes_per_update": med("metaserver_bytes"),
            "heartbeats_per_s": sum(float(r["heartbeat_requests"]) for r in rows) / max(seconds, 1e-9),
            "spans_per_step": spans / len(rows), "trace_bytes_per_step": trace_bytes / len(rows),
            "diagnose_s": measured["seconds"], "diagnose_rss_mb": measured["rss_mb"], "run_dir": run_dir}


COLUMNS = [("world", "{train_ranks}x{rollout_servers}"), ("plane", "{plane}"), ("step_s", "{own_cost_s:.2f}"),
           ("ctl_cpu_s", "{controller_cpu_s:.2f}"), ("ctl_rss_mb", "{controller_rss_mb:.0f}"),
           ("requests", "{requests_per_step:.0f}"), ("ctl_mb", "{controller_mb_per_step:.1f}"),
           ("token_mb", "{token_mb:.2f}"), ("batch_mb", "{batch_mb:.2f}"), ("meta_mb", "{meta_mb:.1f}"), ("hb/s", "{heartbeats_per_s:.0f}"),
           ("spans", "{spans_per_step:.0f}"), ("trace_mb", "{trace_mb:.2f}"), ("diagnose_s", "{diagnose_s:.1f}"),
           ("diagnose_mb", "{diagnose_rss_mb:.0f}"), ("run_s", "{run_s:.0f}")]


def table(records: list[dict]) -> str:
    rows = [[name for name, _ in COLUMNS]]
    for rec in records:
        view = {**rec, "token_mb": rec["controller_token_bytes"] / 1e6, "batch_mb": rec["controller_batch_bytes"] / 1e6,
                "meta_mb": rec["metaserver_bytes_per_update"] / 1e6, "trace_mb": rec["trace_bytes_per_step"] / 1e6}
        rows.append([fmt.format(**view) for _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def figure(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series = (("own_cost_s", "step wall s", "o"), ("controller_cpu_s", "controller CPU s / step", "s"),
              ("trace_bytes_per_step", "trace MB / step", "^"), ("controller_token_bytes", "token MB / step via "
                                                                                          "controller", "v"))
    for plane, style in (("before", "--"), ("after", "-")):
        mine = [r for r in records if r["plane"] == plane]
        if not mine:
            continue
        x = [r["train_ranks"] + r["rollout_servers"] for r in mine]
        for i, (key, label, marker) in enumerate(series):
            scale = 1e6 if "bytes" in key else 1.0
            ax.plot(x, [r[key] / scale for r in mine], style, marker=marker, color=f"C{i}", label=f"{label} ({plane})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("processes in the world (train ranks + rollout servers), simulated")
    ax.set_title("Control plane cost by world size (zero compute)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2x2,16x4,64x16,256x64,1024x256", help="TRAINxSERVERS, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per world (step 1 is left out of medians)")
    parser.add_argument("--plane", choices=["after", "before", "both"], default="after",
                        help="the control plane measured: after (today's defaults), before (every rank uploads, "
                             "manifests list every piece, a request per rank, every token through the "
                             "controller), or both, side by side")
    parser.add_argument("--json", default="", help="write one record per world to this file")
    parser.add_argument("--figure", default="", help="a log-log figure of the table (PNG)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("extra", nargs="*", help="more trainer flags after --, e.g. -- --tracing.enabled false")
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps: at least 1")
    worlds = parse_worlds(args.worlds)
    base = tempfile.mkdtemp(prefix="rlhf-scale-")
    records = []
    try:
        planes = ["before", "after"] if args.plane == "both" else [args.plane]
        for train, servers in worlds:
            for plane in planes:
                print(f"world {train}x{servers} ({plane}): {args.steps} steps ...", file=sys.stderr, flush=True)
                records.append(run_world(train, servers, args.steps, base, args.extra, plane))
                print(table(records[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        if records:
            print(table(records))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(records, fh, indent=1)
        if args.figure and records:
            figure(records, args.figure)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"run directories in {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
