#!/usr/bin/env python
"""Episodes that advance independently against episodes in lockstep, with a remote tool's long tail, in one run.

Each mode is a real GRPO run (1 train rank, 1 rollout server, env-0; 16 prompts a step, 8 episodes each) of
benchmarks/remote_tool.py:Chain: every
episode calls a remote tool at each of its first 3 turns and ends at the 4th; a call takes 0.05 s, one in 32 takes
2 s (EMULATED: time.sleep, wall time that uses no CPU here, as a search API or a sandbox farm would).

  modes   independent   --env.batch_wait_s 0.05 (the default): each episode's next turn goes to a free rollout
                        server when its own tool call is back
          lockstep      --env.batch_wait_s 1000: every turn waits for the step's slowest call
          async         independent, and --rollout.mode async --rollout.max_staleness 1: the next step's episodes
                        run while this step trains (each token's weights version recorded)
          async-k2      the same, --rollout.max_staleness 2
          groups        async, and --rollout.buffer group: generated group by group, a step takes the first groups
                        that end (a group held by a slow call joins a later batch while within the bound)
          groups-k2     the same, --rollout.max_staleness 2

It prints the median seconds a step (steps.csv seconds) and of its rollout stage (rollout_s: in async, what the
trainer waited for the batch), the time the episodes spent at env-0 (env_s, summed over the step's episodes), turns
an episode, the steps' median staleness, and each mode's steps per second against lockstep's.

    python benchmarks/episodes.py                                  # ~5 min here
    python benchmarks/episodes.py --steps 3 --tail-s 5 -- --rollout.prompts_per_step 8
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ASYNC = ["--env.batch_wait_s", "0.05", "--rollout.mode", "async"]
MODES = {"independent": ["--env.batch_wait_s", "0.05"], "lockstep": ["--env.batch_wait_s", "1000"],
         "async": [*ASYNC, "--rollout.max_staleness", "1"], "async-k2": [*ASYNC, "--rollout.max_staleness", "2"],
         "groups": [*ASYNC, "--rollout.max_staleness", "1", "--rollout.buffer", "group"],
         "groups-k2": [*ASYNC, "--rollout.max_staleness", "2", "--rollout.buffer", "group"]}


def one(mode: str, work: str, args: argparse.Namespace, extra: list[str]) -> dict:
    run_dir = os.path.join(work, mode)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--env.path",
           os.path.join(ROOT, "benchmarks", "remote_tool.py") + ":Chain", "--env.max_turns", "4",
           "--env.parallel_calls", "64", "--sampling.max_new_tokens", str(args.max_new_tokens), "--sft.max_steps", "0",
           "--rollout.prompts_per_step", str(args.prompts), "--steps", str(args.steps), "--eval-every", "0",
           "--run-dir", run_dir, *MODES[mode], *extra]
    env = {**os.environ, "RLHF_TOOL_LATENCY_S": str(args.latency_s), "RLHF_TOOL_TAIL_S": str(args.tail_s),
           "RLHF_TOOL_TAIL_EVERY": str(args.tail_every)}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        return {"mode": mode, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        rows = list(csv.DictReader(fh))[1:]  # the first step warms up
    return {"mode": mode, "rollout_s": statistics.median(float(r["rollout_s"]) for r in rows),
            "seconds": statistics.median(float(r["seconds"]) for r in rows),
            "staleness": statistics.median(float(r.get("staleness_mean") or 0) for r in rows),
            "env_s": statistics.median(float(r["env_s"]) for r in rows),
            "turns": statistics.median(float(r["turns_mean"]) for r in rows), "steps": len(rows),
            "dropped": sum(int(r.get("groups_dropped") or 0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="arguments after -- go to every run (examples/grpo_trainer.py)")
    ap.add_argument("--modes", default="independent,lockstep,async",
                    help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--latency-s", type=float, default=0.05, help="a tool call's round trip")
    ap.add_argument("--tail-s", type=float, default=2.0, help="a slow call's round trip")
    ap.add_argument("--tail-every", type=int, default=32, help="one call in this many is slow")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="tokens a turn")
    ap.add_argument("--prompts", type=int, default=16, help="prompts a step (rollout.group_size episodes each)")
    ap.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad[0]!r} (choices: {', '.join(MODES)})")
    work = tempfile.mkdtemp(prefix="rlhf-episodes-")
    rows = []
    for mode in modes:
        print(f"[episodes] {mode} → {work}/{mode}", file=sys.stderr, flush=True)
        rows.append(one(mode, work, args, args.extra))
    base = next((r["seconds"] for r in rows if r["mode"] == "lockstep" and "error" not in r), None)
    print(f"tool call {args.latency_s:g} s, one in {args.tail_every} {args.tail_s:g} s (emulated); "
          f"steps after the first: {args.steps - 1}")
    print("| mode | s/step | rollout s/step | env-0 s/step (all episodes) | turns/episode | staleness | groups dropped "
          "| vs lockstep |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error']} | | | | | | |")
            continue
        ratio = f"{base / r['seconds']:.2f}x" if base else ""
        print(f"| {r['mode']} | {r['seconds']:.2f} | {r['rollout_s']:.2f} | {r['env_s']:.1f} | {r['turns']:.2f} | "
              f"{r['staleness']:.2f} | {r['dropped']} | {ratio} |")


if __name__ == "__main__":
    main()
