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
    python benchmarks/gpu_grpo.py --tiny --device cpu --peer trl    # the same, against TRL, on a CPU (float32)
    python benchmarks/gpu_grpo.py --tiny -- --runtime.heap_mmap_threshold_mb 0     # flags after -- go to our run

`--tiny` runs the default tiny model and batch on the GPU and prints the runtime's own cost per
step: all but generate, the reference/policy forward, forward/backward and the optimizer (taken from the
step's spans). `--peer trl` then runs TRL's GRPOTrainer in this process on the same model, prompts, group
size, lengths, sampling, coefficients and optimizer steps per generation, and prints both step times.
"""

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

STAGES = ["weights_update", "events", "rollout", "reward", "reference", "advantage", "train", "latest_recover_save"]


def workload(args) -> list[tuple[str, str]]:
    """The run's settings as dotted overrides: what our runtime gets as flags and TRL's config is built from."""
    dotted = [("model.device", args.device), ("model.dtype", args.dtype), ("sft.max_steps", "0"),
              ("checkpoint.latest_every", "0"), ("weights.verify", "false"), ("task.eval_size", "64"),
              ("rollout.prompts_per_step", "32"),  # the tiny workload as measured (the default run has 64 since)
              ("algorithm.resample_rounds", "0")]  # one generation a step, as TRL's GRPOTrainer (no dynamic sampling)
    if not args.tiny:
        dotted += [("model.name", "llama-110m"), ("rollout.prompts_per_step", "64"), ("rollout.group_size", "8"),
                   ("sampling.max_new_tokens", "128"), ("sampling.ignore_eos", "true"), ("train.mini_batches", "1"),
                   ("train.micro_batch_size", str(args.micro_batch))]
    return dotted


def run_ours(args, run_dir: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--run-dir", run_dir,
           "--steps", str(args.steps)] + [x for key, value in workload(args) for x in (f"--{key}", value)] + \
        args.overrides
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    with open(os.path.join(run_dir, "steps.csv")) as fh:
        return list(csv.DictReader(fh))[args.warmup:]


COMPUTE_SPANS = ("generate", "forward", "forward_backward", "optimizer.step")


def own_cost(run_dir: str, steps: list[dict]) -> tuple[float, dict[str, float]]:
    """Median per step of: step time minus generate, forward (logprobs), forward_backward and optimizer.step span
    time; and where it goes: per stage, the stage's time minus those spans inside it, and the time between stages.

    Spans of one step that run at the same time (two rollout servers) both count, so this is a floor.
    """
    from rlhf.tracing.read import load_spans

    traces = load_spans(run_dir)
    by_trace = traces.by_trace()
    totals: dict[int, float] = {}
    parts: dict[str, list[float]] = {}
    for step, root in traces.step_roots().items():  # one trace per step, across every process
        spans = by_trace.get(root.trace_id, [])
        by_id = {s.span_id: s for s in spans}

        def stage_of(s: Any) -> str:  # the step's child this span descends from
            while s.parent_id in by_id and s.parent_id != root.span_id:
                s = by_id[s.parent_id]
            return s.name

        compute: dict[str, float] = {}
        for s in spans:
            if s.name in COMPUTE_SPANS:
                compute[stage_of(s)] = compute.get(stage_of(s), 0.0) + s.duration_s
        totals[step] = sum(compute.values())
        stages = {s.name: s.duration_s for s in spans if s.parent_id == root.span_id}
        for name, seconds in stages.items():
            parts.setdefault(name, []).append(seconds - compute.get(name, 0.0))
        parts.setdefault("(between stages)", []).append(root.duration_s - sum(stages.values()))
    values = [float(r["seconds"]) - totals.get(int(r["step"]), 0.0) for r in steps]
    return statistics.median(values), {k: statistics.median(v) for k, v in parts.items()}


def run_trl(args) -> float | None:
    """TRL's GRPOTrainer on the same workload: the same model (preset and seed), prompts, group size, completion
    length, sampling, KL and clip coefficients, learning rate, and optimizer steps per generation (one
    generation of the whole batch, then `train.mini_batches` optimizer steps over it, as ours). Its tokenizer
    is the Hugging Face twin of ours (the same ids). Returns its median seconds per GRPO step, or None when trl
    is not installed."""
    try:
        import trl
        from datasets import Dataset
    except ImportError:
        print("peer: trl is not installed (pip install trl); skipped")
        return None
    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from rlhf.config import build_config
    from rlhf.models import build_model_and_tokenizer
    from rlhf.models.hf_dir import make_tokenizer
    from rlhf.tasks import build_task, reward_fn

    hf_logging.set_verbosity_error()
    cfg = build_config(dotted=workload(args))
    ro, sp, tr, alg = cfg.rollout, cfg.sampling, cfg.train, cfg.algorithm
    batch = ro.prompts_per_step * ro.group_size
    micro = min(tr.micro_batch_size, batch // tr.mini_batches)
    score = reward_fn(cfg.reward.functions)

    def reward(prompts, completions, answer, **_):
        return score(completions, answer, prompts)

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            ends.append(time.perf_counter())

    problems = build_task(cfg.task).split("train")
    with tempfile.TemporaryDirectory(prefix="rlhf-trl-") as work:  # the model TRL loads, its output dir: removed
        model_dir = os.path.join(work, "model")  # TRL loads its reference model from a path
        model, _ = build_model_and_tokenizer(cfg.model, seed=cfg.seed, dtype="float32")  # fp32 master, as ours
        model.save_pretrained(model_dir)
        del model
        tokenizer = make_tokenizer()
        tokenizer.save_pretrained(model_dir)
        config = trl.GRPOConfig(
            output_dir=os.path.join(work, "out"), report_to="none", save_strategy="no", disable_tqdm=True,
            logging_steps=10**6, seed=cfg.seed, use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16",
            per_device_train_batch_size=micro, gradient_accumulation_steps=batch // tr.mini_batches // micro,
            steps_per_generation=batch // micro, num_generations=ro.group_size,
            max_completion_length=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=max(sp.top_k, 0), beta=alg.kl_coef, epsilon=alg.clip_eps_low, epsilon_high=alg.clip_eps_high,
            learning_rate=tr.lr, weight_decay=tr.weight_decay, max_grad_norm=tr.grad_clip,
            max_steps=args.steps * tr.mini_batches,
            generation_kwargs={"min_new_tokens": sp.max_new_tokens} if sp.ignore_eos else None,
            model_init_kwargs={"dtype": torch.float32})
        trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[reward], args=config, processing_class=tokenizer,
                                  train_dataset=Dataset.from_list([{"prompt": p.prompt, "answer": p.answer}
                                                                   for p in problems]),
                                  callbacks=[Clock()])
        start = time.perf_counter()
        trainer.train()
    marks = [start] + ends[tr.mini_batches - 1::tr.mini_batches]  # the end of each GRPO step (its last optimizer step)
    steps = [b - a for a, b in zip(marks, marks[1:])][args.warmup:]
    step_s = statistics.median(steps)
    print(f"\npeer: TRL {trl.__version__} GRPOTrainer, same workload: {step_s:.3f} s a step (median of {len(steps)} "
          f"after {args.warmup} warm-up; {tr.mini_batches} optimizer step(s) of {batch // tr.mini_batches} samples "
          f"a step)")
    return step_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of each run (the first --warmup left out)")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--micro-batch", type=int, default=128, help="train.micro_batch_size of the 110 M workload")
    ap.add_argument("--tiny", action="store_true", help="the default tiny workload instead of the 110 M one")
    ap.add_argument("--peer", choices=["trl"], default=None,
                    help="also run TRL's GRPOTrainer on the same workload and print the ratio (needs: pip install trl)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same comparison on a machine without a GPU (float32)")
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("overrides", nargs="*", help="after --: more flags for our run (e.g. -- --runtime.heap_mmap_threshold_mb 0)")
    ap.add_argument("--run-dir", default="", help="keep the run here (default: a temporary folder, removed at the end)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_grpo.py: no CUDA device here (--device cpu runs the comparison on the CPU)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu" and args.dtype != "float32":
        raise SystemExit("benchmarks/gpu_grpo.py --device cpu: use --dtype float32 (bf16 autocast on a CPU measures "
                         "nothing a GPU user sees)")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="rlhf-gpu-grpo-")
    steps = run_ours(args, run_dir)
    step_s = statistics.median(float(r["seconds"]) for r in steps)
    what = "tiny default workload" if args.tiny else "llama-110m, 64 prompts x 8 samples, 128 new tokens (EOS ignored)"
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"\nGRPO on {where}, {what}, {args.dtype}, median of {len(steps)} steps "
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
        own, where = own_cost(run_dir, steps)
        print(f"runtime's own cost per step (step minus generate, forward, forward/backward, optimizer spans): "
              f"{own * 1000:.1f} ms; by stage (its time minus those spans in it), ms: " +
              ", ".join(f"{k} {v * 1000:.1f}" for k, v in sorted(where.items(), key=lambda kv: -kv[1]) if v >= 5e-4))
    except (ImportError, AttributeError, KeyError, OSError) as exc:
        print(f"runtime's own cost: not read ({type(exc).__name__}: {exc})")
    if args.run_dir:
        print(f"run directory: {run_dir}")
    else:  # a temporary one: nothing is left behind (--run-dir keeps the run)
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.peer == "trl":
        peer = run_trl(args)
        if peer is not None:
            print(f"ours {step_s:.3f} s a step, TRL {peer:.3f} s: TRL / ours = {peer / step_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
