"""Run under torchrun: GRPO steps of one global batch in replicated dp and in each sharded layout, on one world.

    python -m torch.distributed.run --nproc_per_node=N tests/sharded_steps.py --model tiny-llama \
        --layouts fsdp,tp2 --steps 3 --out result.json [--device cuda]

(--layouts "": replicated dp alone, e.g. on one rank: the run every other world is held against). Beside the JSON,
RESULT.json.safetensors holds each layout's trained weights ("<layout>/<name>"), to compare across worlds.
Every layout starts from the same seeded weights and trains on the same global batch (each data-parallel group
its share of it); rank 0 writes, per layout, each step's loss and grad norm and the largest difference of the
updated weights (gathered whole) and of the first logprobs from those of replicated dp, and whether the pieces each
rank uploads (rlhf.weights.own_pieces) put together give those weights exactly. tests/test_sharding.py asserts on
them. `--device cuda`: every rank computes on cuda:(local rank mod GPUs), over gloo when ranks share a GPU (NCCL
refuses two ranks of one communicator on one GPU), nccl otherwise; results are compared on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.batch import plan_shares  # noqa: E402
from rlhf.config import AlgorithmConfig, ModelConfig, OptimConfig  # noqa: E402
from rlhf.models import build_model_and_tokenizer  # noqa: E402
from rlhf.pieces import assemble, own_pieces  # noqa: E402
from rlhf.train.dist import GlooDataParallel  # noqa: E402
from rlhf.train.engine import TrainEngine  # noqa: E402
from rlhf.train.parallel import build_mesh, full, is_dtensor, laid_out_model, make_layout, via_host  # noqa: E402
from rlhf.weights import decode_pieces, encode_shard  # noqa: E402


def global_batch(vocab: int, rows: int = 8, length: int = 14, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    lengths = torch.randint(length - 4, length + 1, (rows,), generator=g)
    attention = (torch.arange(length)[None] < lengths[:, None]).long()
    response = attention.clone()
    response[:, :6] = 0  # the prompt
    return {"input_ids": ids * attention, "attention_mask": attention, "response_mask": response,
            "advantages": torch.randn(rows, generator=g)}


def share_of(batch: dict[str, torch.Tensor], share: int, dp: int, minis: int) -> tuple[dict[str, torch.Tensor],
                                                                                  torch.Tensor]:
    """Data-parallel group `share` of `dp`'s rows as the controller cuts them (rlhf.batch: the global batch in
    mini-batches, each over the dp ranks), with their mini_batch column; and where those rows are in the batch."""
    rows, mini = plan_shares(batch["attention_mask"].sum(1).tolist(), minis, dp)
    index = torch.tensor(rows[share])
    return {**{k: v[index] for k, v in batch.items()}, "mini_batch": torch.tensor(mini[share])}, index


DEVICE = torch.device("cpu")


def _build(model_name: str):
    model, tok = build_model_and_tokenizer(ModelConfig(name=model_name, dtype="float32"), seed=11, device="cpu")
    return model.to(DEVICE), tok


def run(layout_name: str, model_name: str, steps: int, batch: dict[str, torch.Tensor]) -> dict:
    parallel, tp = ("fsdp", 1) if layout_name == "fsdp" else ("dp", 1) if layout_name == "dp" else \
        ("fsdp" if layout_name.startswith("fsdp+") else "dp", int(layout_name.rsplit("tp", 1)[1]))
    model, _ = _build(model_name)
    layout = make_layout(parallel, tp, dist.get_world_size(), model.config)
    mesh = build_mesh(layout, DEVICE.type)
    dp = GlooDataParallel(DEVICE, mesh["dp"].get_group() if mesh is not None else None)
    optim = OptimConfig(micro_batch_size=2, warmup_steps=0)  # the default lr, clip and 2 optimizer steps a step
    engine = TrainEngine(model, optim, AlgorithmConfig(kl_coef=0.05), keep_reference=True, dp=dp, layout=layout,
                         mesh=mesh)
    share = layout.dp_rank(dist.get_rank())
    mine, order = share_of(batch, share, layout.dp, optim.mini_batches)
    mine["old_logprobs"] = engine.compute_logprobs(mine, "policy")
    mine["ref_logprobs"] = engine.compute_logprobs(mine, "reference")
    first = mine["old_logprobs"].cpu()
    records = []
    for _ in range(steps):
        m = engine.train_step(mine)
        # the step's loss is each data-parallel group's part of it: summed over one rank of each TP group
        parts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.tensor([m["loss"]], dtype=torch.float64))
        records.append({"loss": float(sum(parts[r] for r in range(0, dist.get_world_size(), layout.tp))),
                        "grad_norm": m["grad_norm"]})
        mine["old_logprobs"] = engine.compute_logprobs(mine, "policy")
    weights = {n: full(p).cpu().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():  # the host gather (ranks sharing a GPU) gives what DTensor's own does
        if is_dtensor(p) and not torch.equal(via_host(p), weights[n]):
            raise AssertionError(f"{n}: gathered on the host differs from DTensor.full_tensor")
    whole = torch.zeros_like(batch["attention_mask"], dtype=torch.float32)
    if dist.get_rank() % layout.tp == 0:  # one rank of each TP group puts its rows back in the batch's order
        whole[order] = first
    dist.all_reduce(whole)
    local_bytes = sum(p.to_local().numel() if is_dtensor(p) else p.numel() for p in model.parameters()) * 4
    return {"records": records, "weights": weights, "logprobs": whole, "layout": layout.describe(),
            "param_bytes_rank": local_bytes, **pieces_check(model, weights), **built_check(model_name, layout, mesh),
            **bf16_reference_check(model_name, layout, mesh, batch, share, optim)}


def bf16_reference_check(model_name: str, layout, mesh, batch: dict, share: int, optim) -> dict:
    """Under fsdp with bf16 compute the frozen reference is kept in bf16 (FSDP computes it in bf16 anyway): its
    logprobs equal the fp32-master policy's bit for bit before any step; and after a no-grad forward the root unit
    (embedding, LM head) is sharded again, not left gathered."""
    if not layout.fsdp:
        return {}
    model, _ = _build(model_name)
    engine = TrainEngine(model, optim, AlgorithmConfig(kl_coef=0.05), keep_reference=True, layout=layout, mesh=mesh,
                         compute_dtype=torch.bfloat16)
    mine, _ = share_of(batch, share, layout.dp, optim.mini_batches)
    policy, reference = engine.compute_logprobs(mine, "policy"), engine.compute_logprobs(mine, "reference")
    return {"reference_dtypes": sorted({str(p.dtype) for p in engine.reference.parameters()}),
            "policy_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "bf16_reference_exact": bool(torch.equal(policy, reference)) and bool(policy.abs().sum() > 0),
            "root_sharded": all(is_dtensor(p) for m in (model, engine.reference) for p in m.parameters())}


def built_check(model_name: str, layout, mesh) -> dict:
    """A model built straight into the layout (laid_out_model: a meta skeleton, each rank filling its pieces one
    whole parameter at a time) holds the very weights of the model built whole with the same seed."""
    if not layout.sharded:
        return {"built_exact": True}
    whole, _ = build_model_and_tokenizer(ModelConfig(name=model_name, dtype="float32"), seed=11, device="cpu")
    built, _ = laid_out_model(ModelConfig(name=model_name, dtype="float32"), 11, layout, mesh, device=DEVICE.type)
    params = dict(built.named_parameters())
    exact = sorted(params) == sorted(n for n, _ in whole.named_parameters()) and all(
        torch.equal(full(params[n]).cpu(), p)
        for n, p in whole.named_parameters()) and any(is_dtensor(p) for p in params.values())
    buffers = all(torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(built.named_buffers(), whole.named_buffers()))
    return {"built_exact": bool(exact and buffers)}


def pieces_check(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict:
    """The weight upload's pieces (each rank's own, as it sends them: a safetensors blob with digests and where each
    piece lies) are exchanged and put together as a rollout server does; they must equal the weights bit for bit,
    every element sent once."""
    world = dist.get_world_size()
    part, where = own_pieces(model, dist.get_rank(), world)
    part = {k: t.cpu() for k, t in part.items()}
    blob = torch.frombuffer(bytearray(encode_shard(part, "crc32", where)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([blob.numel()]))
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:blob.numel()] = blob
    blobs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(blobs, padded)
    shards = {f"rank{r}": decode_pieces(bytes(b[:int(n)].numpy())) for r, (b, n) in enumerate(zip(blobs, sizes))}
    whole = assemble(shards)
    sent = [sum(t.numel() * t.element_size() for t in tensors.values()) for tensors, _ in shards.values()]
    exact = sorted(whole) == sorted(weights) and all(torch.equal(whole[n], w) for n, w in weights.items())
    return {"pieces_exact": exact, "piece_bytes": sent,
            "model_bytes": sum(w.numel() * w.element_size() for w in weights.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--layouts", default="fsdp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    global DEVICE
    backend = "gloo"
    if args.device == "cuda":
        local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        DEVICE = torch.device("cuda", local % gpus)
        torch.cuda.set_device(DEVICE)
        # host tensors (the results exchanged here) always go through gloo
        backend = "cpu:gloo,cuda:nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=args.device == "cuda")  # CUDA: a warning where none exists
    model, tok = build_model_and_tokenizer(ModelConfig(name=args.model), seed=11)
    batch = global_batch(model.config.vocab_size)
    base = run("dp", args.model, args.steps, batch)
    pieces = ("pieces_exact", "piece_bytes", "model_bytes", "built_exact")
    out = {"dp": {"records": base["records"], "layout": base["layout"], "param_bytes_rank": base["param_bytes_rank"],
                  **{k: base[k] for k in pieces}}}
    weights = {f"dp/{n}": w for n, w in base["weights"].items()}
    for name in [n for n in args.layouts.split(",") if n]:
        got = run(name, args.model, args.steps, batch)
        weights.update({f"{name}/{n}": w for n, w in got["weights"].items()})
        diff = max(float((got["weights"][n] - w).abs().max()) for n, w in base["weights"].items())
        out[name] = {"records": got["records"], "layout": got["layout"], "max_weight_diff": diff,
                     "max_logprob_diff": float((got["logprobs"] - base["logprobs"]).abs().max()),
                     "param_bytes_rank": got["param_bytes_rank"], **{k: got[k] for k in pieces},
                     **{k: got[k] for k in ("reference_dtypes", "policy_dtypes", "bf16_reference_exact",
                                            "root_sharded") if k in got}}
    start, _ = build_model_and_tokenizer(ModelConfig(name=args.model, dtype="float32"), seed=11)
    out["dp"]["max_update"] = max(float((base["weights"][n] - p.detach()).abs().max())
                                  for n, p in start.named_parameters())
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        save_file({k: w.contiguous() for k, w in weights.items()}, f"{args.out}.safetensors")  # for other worlds
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
