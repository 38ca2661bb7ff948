"""Checkpoints of a sharded layout: each rank writes the pieces it holds; any layout reads them back (resharding).

A sharded slot holds, beside meta.json and each rank's rng files,

    shards/rank<r>.safetensors   rank r's piece of every sharded tensor (FSDP's rows, TP's heads), plus the whole
                                 replicated ones from the one rank that owns them: model.<name> for parameters and
                                 optim.<name>.<exp_avg|exp_avg_sq|step> for AdamW's state; the safetensors metadata
                                 gives each piece's offsets in its whole tensor (DCP's DCP_SHARDING_INFO)
    optimizer-groups.json        AdamW's param groups (rank 0)

No rank gathers the model: a rank writes its own pieces through the same writer as every checkpoint file (the
checkpoint.write and checkpoint.fsync points, a checksum per file in meta.json, abandon_stuck_saves). Resume reads
them with torch.distributed.checkpoint's safetensors reader into the layout the run has now (another world size,
FSDP into replicated dp, TP into FSDP): DCP plans which pieces each rank needs and reads them in place. A slot of
the replicated format (model.safetensors) loads into a sharded layout too (rlhf.checkpoint.slots), each rank
cutting its pieces from it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from rlhf.pieces import replica_of
from rlhf.train.parallel import is_dtensor, local

SHARDS = "shards"
GROUPS = "optimizer-groups.json"
SHARDING_INFO = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint.hf_storage's metadata key, with "saved_offsets"


def is_sharded_slot(path: str) -> bool:
    return os.path.isdir(os.path.join(path, SHARDS))


def _owns(t: torch.Tensor, rank: int) -> bool:
    """Whether this rank writes (its piece of) t: a piece several ranks hold alike is written once, by the first of
    them (coordinate 0 of every mesh dimension it is replicated over, those its own mesh leaves out included); a
    plain tensor (the same on every rank) by rank 0."""
    return replica_of(t, rank, 1)[0] == 0


def _flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """model.<name> and optim.<name>.<key> -> the live tensors (DTensors in a sharded layout)."""
    flat = {f"model.{name}": p.detach() for name, p in model.named_parameters()}
    if optimizer is not None:
        for name, p in model.named_parameters():
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    flat[f"optim.{name}.{key}"] = value
    return flat


def snapshot(rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             copy: bool = False) -> list[tuple[str, Any]]:
    """This rank's files of a sharded slot (for checkpoint.write_items): its pieces with their offsets, and (rank 0)
    the optimizer's param groups. copy: detached from the live tensors (a background write)."""
    tensors, offsets = {}, {}
    for key, t in _flat_state(model, optimizer).items():
        if not _owns(t, rank):
            continue
        piece = local(t)
        if piece.numel() == 0 and piece.dim() > 0:  # FSDP's last ranks may hold no rows of a small tensor
            continue
        start = list(t.__create_chunk_list__()[0].offsets) if is_dtensor(t) else [0] * t.dim()
        piece = piece.detach().contiguous().cpu()
        tensors[key] = piece.clone() if copy else piece
        offsets[key] = {"saved_offsets": start}
    items: list[tuple[str, Any]] = [(f"{SHARDS}/rank{rank:05d}.safetensors",
                                     (tensors or {"empty": torch.zeros(0)}, {SHARDING_INFO: json.dumps(offsets)}))]
    if rank == 0 and optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        items.append((GROUPS, {"param_groups": groups}))
    return items


def pieces(path: str) -> Iterator[tuple[str, Any, list[int]]]:
    """Every piece of a sharded slot: (key, its safetensors slice, its offsets in the whole tensor), file by file."""
    folder = os.path.join(path, SHARDS)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            info = json.loads((f.metadata() or {}).get(SHARDING_INFO, "{}"))
            for key in f.keys():
                if key != "empty":
                    piece = f.get_slice(key)
                    yield key, piece, info.get(key, {}).get("saved_offsets", [0] * len(piece.get_shape()))


def whole_shapes(path: str) -> dict[str, list[int]]:
    """key -> the whole tensor's shape, from every shard file's pieces and offsets."""
    shapes: dict[str, list[int]] = {}
    for key, piece, start in pieces(path):
        end = [s + o for s, o in zip(piece.get_shape(), start)]
        shapes[key] = [max(a, b) for a, b in zip(shapes.get(key, end), end)]
    return shapes


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its AdamW state (zeros) without moving it: a step at lr 0 on zero gradients, so the
    checkpoint's state can be read into it in place."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read a sharded slot into `model` (and AdamW) in the layout they have now. Another model's checkpoint (names
    or shapes that differ) is refused with what differs, before anything is read."""
    import torch.distributed.checkpoint as dcp

    if optimizer is not None:
        init_optimizer_state(optimizer)
    template = _flat_state(model, optimizer)
    saved = whole_shapes(path)
    missing = sorted(k for k in template if k not in saved)
    wrong = [f"{k}: checkpoint {saved[k]}, model {list(t.shape)}" for k, t in template.items()
             if k in saved and saved[k] != list(t.shape)]
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in template)
    if missing or wrong or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}, shapes {wrong[:4]}")
    with torch.no_grad():
        dcp.load(template, storage_reader=dcp.HuggingFaceStorageReader(os.path.join(path, SHARDS)))
    if optimizer is not None and os.path.exists(os.path.join(path, GROUPS)):
        with open(os.path.join(path, GROUPS), encoding="utf-8") as fh:
            groups = json.load(fh)["param_groups"]
        for group, saved_group in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
