"""Run under torchrun: checkpoints written in one layout and resumed in another take the step the writer would take.

    python -m torch.distributed.run --nproc_per_node=N tests/sharded_resume.py --out result.json \
        [--save fsdp:DIR] [--load DIR:fsdp ...] [--pairs fsdp>dp,tp2>fsdp,dp>fsdp] [--foreign DIR:tiny-qwen2-gqa]

--save LAYOUT:DIR   train 2 GRPO steps in LAYOUT, write the checkpoint to DIR (each rank its own files), then take
                    a third step: its loss, grad norm and the weights after it are the reference ("save:LAYOUT")
--load DIR:LAYOUT   read DIR's checkpoint into LAYOUT on this world and take the third step ("load:DIR:LAYOUT")
--pairs A>B,...     both in this world: save in A, load into B, and the weights and AdamW state read back equal
                    those written, bit for bit
--foreign DIR:MODEL read DIR's checkpoint into another model: the error says what differs

Data: one global batch, cut as the controller cuts it (rlhf.batch: mini-batches, then each over the dp ranks;
tests/sharded_steps.share_of), so every world and layout takes the same optimizer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.checkpoint import slots as ckpt  # noqa: E402
from rlhf.config import AlgorithmConfig, ModelConfig, OptimConfig  # noqa: E402
from rlhf.models import build_model_and_tokenizer  # noqa: E402
from rlhf.train.dist import GlooDataParallel  # noqa: E402
from rlhf.train.engine import TrainEngine  # noqa: E402
from rlhf.train.parallel import build_mesh, full_state, is_dtensor, make_layout  # noqa: E402
from tests.sharded_steps import global_batch, share_of  # noqa: E402

MODEL = "tiny-llama"


def engine_in(layout_name: str, model_name: str = MODEL) -> tuple[TrainEngine, object, dict]:
    parallel, tp = {"dp": ("dp", 1), "fsdp": ("fsdp", 1), "tp2": ("dp", 2), "fsdp+tp2": ("fsdp", 2)}[layout_name]
    model, _ = build_model_and_tokenizer(ModelConfig(name=model_name, dtype="float32"), seed=11, device="cpu")
    layout = make_layout(parallel, tp, dist.get_world_size(), model.config)
    mesh = build_mesh(layout, "cpu")
    dp = GlooDataParallel("cpu", mesh["dp"].get_group() if mesh is not None else None)
    optim = OptimConfig(micro_batch_size=2, warmup_steps=0)
    engine = TrainEngine(model, optim, AlgorithmConfig(kl_coef=0.0), keep_reference=False, dp=dp, layout=layout,
                         mesh=mesh)
    batch = global_batch(model.config.vocab_size)
    mine, _ = share_of(batch, layout.dp_rank(dist.get_rank()), layout.dp, optim.mini_batches)
    return engine, layout, mine


def step(engine: TrainEngine, layout, mine: dict) -> dict:
    mine = dict(mine)
    mine["old_logprobs"] = engine.compute_logprobs(mine, "policy")
    m = engine.train_step(mine)
    parts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([m["loss"]], dtype=torch.float64))
    return {"loss": float(sum(parts[r] for r in range(0, dist.get_world_size(), layout.tp))),
            "grad_norm": m["grad_norm"]}


def optimizer_whole(engine: TrainEngine) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out = {}
    for p, state in engine.optimizer.state.items():
        for key, value in state.items():
            out[f"{names[id(p)]}.{key}"] = value.full_tensor() if is_dtensor(value) else value.clone()
    return out


def save(layout_name: str, directory: str) -> tuple[dict, dict, dict]:
    engine, layout, mine = engine_in(layout_name)
    for _ in range(2):
        step(engine, layout, mine)
    written = ckpt.write_rank_files(directory, dist.get_rank(), engine.model, engine.optimizer, fsync=False,
                                    sharded=layout.sharded)
    dist.barrier()
    state = ({k: v.clone() for k, v in full_state(engine.model).items()}, optimizer_whole(engine))
    record = step(engine, layout, mine)
    return record, {k: v.clone() for k, v in full_state(engine.model).items()}, {"state": state, "files": written}


def load(directory: str, layout_name: str, model_name: str = MODEL) -> tuple[dict, dict, tuple]:
    engine, layout, mine = engine_in(layout_name, model_name)
    ckpt.load_rank_files(directory, dist.get_rank(), engine.model, engine.optimizer)
    engine.optimizer_steps = 4
    state = ({k: v.clone() for k, v in full_state(engine.model).items()}, optimizer_whole(engine))
    record = step(engine, layout, mine)
    return record, {k: v.clone() for k, v in full_state(engine.model).items()}, state


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", default="")
    parser.add_argument("--load", action="append", default=[])
    parser.add_argument("--pairs", default="")
    parser.add_argument("--foreign", default="")
    parser.add_argument("--weights-dir", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out: dict = {}
    weights: dict[str, dict] = {}
    if args.save:
        name, directory = args.save.split(":", 1)
        record, after, saved = save(name, directory)
        out[f"save:{name}"] = record
        weights[f"save-{name}"] = after
        weights[f"at-save-{name}"] = saved["state"][0]  # what the checkpoint holds: `rlhf export` must give it
    for spec in args.load:
        directory, name = spec.rsplit(":", 1)
        record, after, _ = load(directory, name)
        out[f"load:{os.path.basename(directory)}:{name}"] = record
        weights[f"load-{os.path.basename(directory)}-{name}"] = after
    for pair in filter(None, args.pairs.split(",")):
        src, dst = pair.split(">")
        directory = os.path.join(args.weights_dir, f"pair-{src}")
        saved_record, saved_after, saved = save(src, directory)
        record, after, state = load(directory, dst)
        out[f"pair:{pair}"] = {
            "saved": saved_record, "loaded": record, "max_weight_diff": max_diff(saved_after, after),
            "read_back_model_diff": max_diff(saved["state"][0], state[0]),
            "read_back_optimizer_diff": max_diff(saved["state"][1], state[1]),
            "optimizer_keys": sorted(state[1]) == sorted(saved["state"][1]),
            "files": sorted(saved["files"])}
    if args.foreign:
        directory, model_name = args.foreign.split(":", 1)
        try:
            load(directory, "fsdp", model_name)
            out["foreign"] = "loaded"
        except ValueError as exc:
            out["foreign"] = str(exc)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        if args.weights_dir:
            from safetensors.torch import save_file

            for key, tensors in weights.items():
                save_file({k: v.contiguous() for k, v in tensors.items()},
                          os.path.join(args.weights_dir, f"{key}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
