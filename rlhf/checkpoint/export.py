"""`rlhf export RUN_DIR OUT [--step N]`: a Hugging Face model directory from any parity checkpoint of a run.

The newest valid checkpoint (its checksums verified), or the one of step N: a replicated slot's model.safetensors,
or a sharded slot's pieces (shards/rank<r>.safetensors, each piece at its offsets) put together whole, in this
process, without torch.distributed. The model's config comes from the run's config.yaml (the built-in preset, or
the --model.path directory's config and tokenizer); OUT gets config.json, generation_config.json,
model.safetensors and the tokenizer's files, which `--model.path OUT` (or transformers) loads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import load_file

from rlhf.checkpoint import sharded as sharded_checkpoint
from rlhf.checkpoint import slots as ckpt


def whole_model(slot: str) -> dict[str, torch.Tensor]:
    """The slot's parameters whole, by name."""
    if not sharded_checkpoint.is_sharded_slot(slot):
        return load_file(os.path.join(slot, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    shapes = sharded_checkpoint.whole_shapes(slot)
    for key, piece, start in sharded_checkpoint.pieces(slot):
        if not key.startswith("model."):
            continue
        data = piece[:]
        name = key[len("model."):]
        region = out.setdefault(name, torch.zeros(shapes[key], dtype=data.dtype))
        for dim, (offset, size) in enumerate(zip(start, data.shape)):
            region = region.narrow(dim, offset, size)
        region.copy_(data)
    return out


def pick_slot(run_dir: str, step: int | None) -> tuple[str, dict]:
    checkpoints = os.path.join(run_dir, "checkpoints")
    if step is None:
        found = ckpt.newest_checkpoint(checkpoints, check_sums=True)
        if found is None:
            raise SystemExit(f"rlhf export: {run_dir} has no valid checkpoint (checkpoints/latest_*, periodic/step_*)")
        return found
    candidates = [os.path.join(checkpoints, "periodic", f"step_{step}"),
                  os.path.join(checkpoints, "latest_odd"), os.path.join(checkpoints, "latest_even")]
    have = []
    for path in candidates:
        meta = ckpt.verify_slot(path, check_sums=True)
        if meta is not None:
            have.append(meta["step"])
            if meta["step"] == step:
                return path, meta
    raise SystemExit(f"rlhf export: no valid checkpoint of step {step} in {checkpoints} "
                     f"(valid ones: steps {sorted(set(have)) or 'none'}; periodic/step_N keep more of them)")


def export(run_dir: str, out: str, step: int | None = None) -> tuple[str, int]:
    """Write the HF directory; returns (the slot it came from, its step)."""
    from transformers import AutoModelForCausalLM

    from rlhf.config import build_config
    from rlhf.models import MODEL_PRESETS, load_tokenizer
    from rlhf.models.tokenizer import CharTokenizer
    from rlhf.weights import save_state_dir

    slot, meta = pick_slot(run_dir, step)
    cfg = build_config(config_file=os.path.join(run_dir, "config.yaml"))
    if cfg.model.path:
        from transformers import AutoConfig

        config, tokenizer = AutoConfig.from_pretrained(cfg.model.path), load_tokenizer(cfg.model.path)
    else:
        tokenizer = CharTokenizer()
        config = MODEL_PRESETS[cfg.model.name](tokenizer.vocab_size)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = whole_model(slot)
    expected = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    wrong = sorted(set(expected) ^ set(tensors)) + [n for n in expected if n in tensors and
                                                   tuple(tensors[n].shape) != expected[n]]
    if wrong:
        raise SystemExit(f"rlhf export: {slot} does not fit the run's model ({cfg.model.path or cfg.model.name}): "
                         f"{wrong[:5]}")
    save_state_dir(skeleton, out, tokenizer, tensors=tensors)
    return slot, int(meta["step"])


def export_main(argv: list[str] | None = None, prog: str = "rlhf export") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Write a Hugging Face model directory from a run's parity checkpoint: the newest valid one, or --step N's; "
        "replicated or sharded (parallel.layout fsdp, parallel.tp_size), put together whole here."))
    parser.add_argument("run_dir", help="the run directory (its checkpoints/ and config.yaml)")
    parser.add_argument("out", help="the directory to write (config.json, model.safetensors, the tokenizer)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.run_dir, "config.yaml")):
        parser.error(f"{args.run_dir} is not a run directory (it has no config.yaml)")
    slot, step = export(args.run_dir, args.out, args.step)
    print(f"exported step {step} from {slot} to {args.out}", file=sys.stderr)
    return 0
