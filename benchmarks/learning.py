#!/usr/bin/env python
"""Does the default run learn at every seed? The README's default command, on one rank and two, and on an HF directory.

Runs each (setup, seed) as a real run one after another and prints, per run, where the SFT warm start stopped, the
greedy held-out accuracy before and after GRPO, the gain, and the GRPO steps' median share of groups whose 8 samples
all got the same reward (they carry no advantage), and a summary per setup:

  default   python examples/grpo_trainer.py --seed S
  2-rank    torchrun --nproc_per_node=2 examples/grpo_trainer.py --seed S
  hf-dir    the same on an HF directory (rlhf.models.hf_dir: another character tokenizer, a 0.8 M Llama) and the
            addition set as JSONL: --model.path DIR --task.name jsonl --task.path add.jsonl --seed S
  async-k1  python examples/grpo_trainer.py --rollout.mode async --rollout.max_staleness 1 --seed S
  async-k2  the same with --rollout.max_staleness 2
  calculator          3-digit products with the calculator tool, episodes through the environment server; the warm
                      start learns the call format from the environment's demonstrations (examples/envs/calculator.py)
  calculator-no-tool  the same products answered in the model's head (the tool is what learns: stays near 0)
  calculator-agent    the same products through an agent written with the openai package
                      (examples/agents/calculator_agent.py: agent.path, its completions trained on token for token);
                      the warm start on the Calculator environment's demonstrations (sft.env_path)

    python benchmarks/learning.py                                   # default at seeds 1-5, the others at 1-3
    python benchmarks/learning.py --setups default --seeds 2 -- --train.lr 2e-4      # one seed, one override
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
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

GOALS = {"default": 0.15, "2-rank": 0.15, "hf-dir": 0.10, "async-k1": 0.15, "async-k2": 0.15, "calculator": 0.15,
         "calculator-no-tool": None, "calculator-agent": 0.15}
PRODUCTS = ["--task.operations", "*", "--task.max_operand", "999", "--model.name", "tiny-llama-256",
            "--rollout.prompts_per_step", "16", "--steps", "60", "--sft.max_steps", "1000", "--sft.batch_size", "64",
            "--sft.eval_every", "5", "--task.val_size", "64"]
CALCULATOR = {"calculator": PRODUCTS + ["--env.path", "examples/envs/calculator.py:Calculator",
                                        "--sampling.max_new_tokens", "80", "--env.max_turns", "2"],
              "calculator-no-tool": PRODUCTS + ["--sampling.max_new_tokens", "8"],
              "calculator-agent": PRODUCTS + ["--agent.path", "examples/agents/calculator_agent.py:agent",
                                              "--sft.env_path", "examples/envs/calculator.py:Calculator",
                                              "--sampling.max_new_tokens", "80", "--env.max_turns", "2"]}
ASYNC = {"async-k1": ["--rollout.mode", "async", "--rollout.max_staleness", "1"],
         "async-k2": ["--rollout.mode", "async", "--rollout.max_staleness", "2"]}


def command(setup: str, seed: int, run_dir: str, work: str, extra: list[str]) -> list[str]:
    script = os.path.join(ROOT, "examples", "grpo_trainer.py")
    base = [sys.executable, script] if setup != "2-rank" else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={29600 + seed}", script]
    args = ["--seed", str(seed), "--run-dir", run_dir, *ASYNC.get(setup, []), *CALCULATOR.get(setup, [])]
    if setup == "hf-dir":
        from rlhf.models.hf_dir import write_addition_jsonl, write_model_dir

        model_dir, data = os.path.join(work, "hfdir"), os.path.join(work, "add.jsonl")
        if not os.path.isdir(model_dir):
            write_model_dir(model_dir)
            write_addition_jsonl(data)
        args += ["--model.path", model_dir, "--task.name", "jsonl", "--task.path", data]
    return base + args + extra


def one(setup: str, seed: int, work: str, extra: list[str]) -> dict:
    run_dir = os.path.join(work, f"{setup}-{seed}")
    t0 = time.perf_counter()
    out = subprocess.run(command(setup, seed, run_dir, work, extra), capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"setup": setup, "seed": seed, "error": out.stderr.strip().splitlines()[-1][:200]}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        rows = list(csv.DictReader(fh))
    batch = [int(r["batch_size"]) for r in rows]
    groups = [float(r["equal_reward_groups"]) for r in rows]
    return {"setup": setup, "seed": seed, "before": summary["eval_accuracy_before"],
            "after": summary["eval_accuracy_after"], "sft": f"{summary['sft_stopped']} at {summary['sft_steps']}" + (
                f" (val {summary['sft_val_accuracy']:.2f})" if summary["sft_val_accuracy"] is not None else ""),
            "equal": statistics.median(g for g in groups),
            "batch": batch[0] if batch else 0, "wall": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="default,2-rank,hf-dir,async-k1,async-k2", help=f"of: {', '.join(GOALS)}")
    ap.add_argument("--seeds", default="", help="comma-separated (default: 1-5 for default, 1-3 for the others)")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("extra", nargs="*", help="dotted overrides for every run, after --")
    args = ap.parse_args()
    setups = args.setups.split(",")
    bad = [s for s in setups if s not in GOALS]
    if bad:
        raise SystemExit(f"--setups: {', '.join(bad)} not known (valid: {', '.join(GOALS)})")
    work = args.out or tempfile.mkdtemp(prefix="rlhf-learning-")
    results = []
    for setup in setups:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([1, 2, 3, 4, 5] if setup == "default"
                                                                             else [1, 2, 3])
        for seed in seeds:
            r = one(setup, seed, work, args.extra)
            results.append(r)
            if "error" in r:
                print(f"{setup} seed {seed}: failed: {r['error']}", flush=True)
            else:
                print(f"{setup} seed {seed}: {r['before']:.3f} -> {r['after']:.3f} ({r['after'] - r['before']:+.3f}), "
                      f"warm start {r['sft']}, {r['wall']:.0f} s", flush=True)
    print("\n| setup | seed | warm start | eval before | eval after | gain | goal | equal-reward groups (median) |")
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['setup']} | {r['seed']} | failed: {r['error']} | | | | | |")
            continue
        gain, goal = r["after"] - r["before"], GOALS[r["setup"]]
        ok = "(a baseline)" if goal is None else f"≥ {goal:+.2f}: " + ("met" if gain >= goal else "**not met**")
        print(f"| {r['setup']} | {r['seed']} | {r['sft']} | {r['before']:.3f} | {r['after']:.3f} | {gain:+.3f} | "
              f"{ok} | {r['equal']:.0f} of {r['batch'] // 8} |")
    if not args.out:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
