#!/usr/bin/env python
"""GRPO on a GPU: seconds per step and each stage's share, through the real runtime.

Runs examples/grpo_trainer.py (controller, train worker, MetaServer, scheduler, a rollout server
on the same GPU) with a ~110 M-param Llama (hidden 768, 12 layers, 32 k vocabulary), 64 prompts
x 8 samples, 128 new tokens with EOS ignored, one optimizer step per GRPO step, no SFT warm
start and no per-step checkpoint, then reads the run's steps.csv.

    python benchmarks/gpu_grpo.py                      # bf16, 8 steps (the first 2 are warm-up)
    python benchmarks/gpu_grpo.py --dtype float32 --steps 6
    python benchmarks/gpu_grpo.py --peer trl           # also TRL's GRPOTrainer, when trl is installed
    python benchmarks/gpu_grpo.py --tiny               # the tiny default workload: the runtime's own cost

`--tiny` runs the default tiny model and batch on the GPU and prints the runtime's own cost per
step: all but generate, the reference/policy forward, forward/backward and the optimizer (taken from the
step's spans).
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

STAGES = ["weights_update", "events", "rollout", "reward", "reference", "advantage", "train", "latest_recover_save"]


def run_ours(args, run_dir: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--run-dir", run_dir,
           "--steps", str(args.steps), "--model.device", "cuda", "--model.dtype", args.dtype,
           "--sft.max_steps", "0", "--checkpoint.latest_every", "0", "--weights.verify", "false",
           "--task.eval_size", "64"]
    if not args.tiny:
        cmd += ["--model.name", "llama-110m", "--rollout.prompts_per_step", "64", "--rollout.group_size", "8",
                "--rollout.max_new_tokens", "128", "--rollout.ignore_eos", "true", "--train.mini_batches", "1",
                "--train.micro_batch_size", str(args.micro_batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        return list(csv.DictReader(fh))[args.warmup:]


def own_cost(run_dir: str, steps: list[dict]) -> float:
    """Median per step of: step time minus generate, forward (logprobs), forward_backward and optimizer.step span
    time.

    Spans of one step that run at the same time (two rollout servers) both count, so this is a floor.
    """
    from rlhf.tracing.read import load_spans

    traces = load_spans(run_dir)
    by_trace = traces.by_trace()
    compute: dict[int, float] = {}
    for step, root in traces.step_roots().items():  # one trace per step, across every process
        compute[step] = sum(s.duration_s for s in by_trace.get(root.trace_id, [])
                            if s.name in ("generate", "forward", "forward_backward", "optimizer.step"))
    values = [float(r["seconds"]) - compute.get(int(r["step"]), 0.0) for r in steps]
    return statistics.median(values)


def run_trl(args) -> float | None:
    try:
        import trl  # noqa: F401
    except ImportError:
        print("peer: trl is not installed (pip install trl); skipped")
        return None
    raise SystemExit("--peer trl: not wired on this machine yet (trl was importable, but this script does not "
                     "drive it; see the README)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--micro-batch", type=int, default=128, help="train.micro_batch_size of the 110 M workload")
    ap.add_argument("--tiny", action="store_true", help="the default tiny workload instead of the 110 M one")
    ap.add_argument("--peer", choices=["trl"], default=None)
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--run-dir", default="", help="keep the run here (default: a temporary folder)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_grpo.py needs a CUDA device")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="rlhf-gpu-grpo-")
    steps = run_ours(args, run_dir)
    step_s = statistics.median(float(r["seconds"]) for r in steps)
    what = "tiny default workload" if args.tiny else "llama-110m, 64 prompts x 8 samples, 128 new tokens (EOS ignored)"
    print(f"\nGRPO on {torch.cuda.get_device_name()}, {what}, {args.dtype}, median of {len(steps)} steps "
          f"after {args.warmup} warm-up\n")
    print("| stage | seconds | share |")
    print("|---|---:|---:|")
    for stage in STAGES:
        vals = [float(r[f"{stage}_s"]) for r in steps if r.get(f"{stage}_s") not in (None, "")]
        med = statistics.median(vals) if vals else 0.0
        print(f"| {stage} | {med:.3f} | {med / step_s:.0%} |")
    print(f"| **step** | **{step_s:.3f}** | |")
    tokens = statistics.median(float(r["rollout_tokens_per_s"]) for r in steps)
    print(f"\nrollout tokens/s (prompt + completion, per the rollout stage): {tokens:,.0f}")
    try:
        print(f"runtime's own cost per step (step minus generate, forward, forward/backward, optimizer spans): "
              f"{own_cost(run_dir, steps) * 1000:.1f} ms")
    except (ImportError, AttributeError, KeyError, OSError) as exc:
        print(f"runtime's own cost: not read ({type(exc).__name__}: {exc})")
    print(f"run directory: {run_dir}")
    if args.peer == "trl":
        run_trl(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
