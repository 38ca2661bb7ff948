"""Weights by piece: what each train rank holds of each parameter, named by HF parameter name and slice, and the
whole parameters put together again from every rank's pieces.

    own_pieces      this rank's pieces (its DTensor piece; its share of the rows of what several ranks hold alike):
                    every element of the model is sent by exactly one rank, nothing is gathered
    assemble        whole tensors from every shard's pieces, checked to tile each parameter exactly
    import_pieces   the same, each piece copied straight into its slice of a model's parameter
    piece_digests / slice_digests   weights verification by piece (the trainer's pieces against a model's slices)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhf.weights import _raw, copy_whole_, digest, is_dtensor


class PiecesMismatch(ValueError):
    """The pieces of a parameter that arrived do not put together its whole tensor (a gap, an overlap, a piece out
    of bounds, or uploaders that disagree on its shape or dtype)."""


def replica_of(t: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """(index, count): this rank is replica `index` of the `count` ranks that hold the same piece of `t`.

    A plain tensor is held whole by every rank of the world. A DTensor's piece is held by every rank whose mesh
    coordinates differ only on the dimensions it is replicated over: its Replicate placements, and the dimensions
    of the world's mesh its own (sub-)mesh leaves out (FSDP x TP keeps the embedding on the `dp` mesh alone)."""
    if not is_dtensor(t):
        return rank, world
    mesh = t.device_mesh
    root = _root_mesh(mesh) if mesh.mesh_dim_names else mesh  # the world's mesh this one was cut from
    names = list(mesh.mesh_dim_names or [])
    coordinate = root.get_coordinate() or []
    index, count = 0, 1
    for dim, name in enumerate(root.mesh_dim_names or [None] * root.ndim):
        if name in names and not t.placements[names.index(name)].is_replicate():
            continue
        if root is mesh and not t.placements[dim].is_replicate():
            continue
        size = root.size(dim)
        index, count = index * size + coordinate[dim], count * size
    return index, count


def _root_mesh(mesh: Any) -> Any:
    if hasattr(mesh, "_get_root_mesh"):  # torch >= 2.9
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def piece_key(name: str, offset: list[int], shape: list[int]) -> str:
    """A piece's name on the wire: the parameter's HF name and its slice, e.g. `lm_head.weight[0:128,0:64]`."""
    return f"{name}[{','.join(f'{o}:{o + n}' for o, n in zip(offset, shape))}]"


@torch.no_grad()
def own_pieces(model: torch.nn.Module, rank: int, world: int, dtype: torch.dtype | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """What this rank uploads of the model: (tensors by piece key, where each lies in its parameter).

    Every rank sends only what it holds: its own piece of a sharded parameter (FSDP's rows, TP's heads), and of a
    piece that `count` ranks hold alike (replicated data parallel, TP's replicated norms), its 1/count share of the
    rows. The pieces of the world tile every parameter exactly once; nothing is gathered, no collective is made."""
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, dict] = {}
    for name, p in sorted(model.named_parameters()):
        if is_dtensor(p):
            held, offset = p.to_local(), list(p.__create_chunk_list__()[0].offsets)
        else:
            held, offset = p.detach(), [0] * p.dim()
        index, count = replica_of(p, rank, world)
        if held.dim() == 0:  # a scalar: replica 0 sends it
            if index:
                continue
            piece = held
        else:
            rows = torch.tensor_split(held, count, dim=0)
            piece = rows[index]
            offset[0] += sum(r.shape[0] for r in rows[:index])
            if piece.numel() == 0:  # fewer rows than replicas, or FSDP's last ranks holding none of a small tensor
                continue
        key = piece_key(name, offset, list(piece.shape))
        tensors[key] = piece.to(dtype) if dtype is not None else piece
        where[key] = {"name": name, "offset": offset, "whole": list(p.shape)}
    return tensors, where


def piece_digests(tensors: dict[str, torch.Tensor], algorithm: str) -> dict[str, str]:
    """A digest of each piece's raw bytes (weights verification by piece: nothing gathered on the train side)."""
    return {key: digest(_raw(t.detach().cpu()), algorithm) for key, t in tensors.items()}


@torch.no_grad()
def slice_digests(model: torch.nn.Module, where: dict[str, dict], algorithm: str) -> dict[str, str]:
    """The digests of the model's own slices named by `where` (key -> {name, offset, shape}): what a rollout server
    holds of each piece a train rank sent, for comparison with that rank's piece_digests."""
    params = dict(model.named_parameters())
    out = {}
    for key, info in where.items():
        p = params.get(info["name"])
        if p is None or len(info["offset"]) != p.dim():
            out[key] = "absent"
            continue
        out[key] = digest(_raw(p[_slices(info["offset"], info["shape"])].detach().cpu()), algorithm)
    return out


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]))


Tiling = dict[str, tuple[list[int], list[tuple[list[int], torch.Tensor]]]]  # name -> (whole shape, its pieces)


def _tiling(shards: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict]]]) -> Tiling:
    """Every parameter's pieces, checked to tile it exactly (all of them before any is used)."""
    parts: dict[str, list[tuple[str, list[int], list[int], torch.Tensor]]] = {}
    for shard, (tensors, where) in sorted(shards.items()):
        for key, t in tensors.items():
            info = where.get(key, {"name": key, "offset": [0] * t.dim(), "whole": list(t.shape)})
            parts.setdefault(info["name"], []).append((shard, list(info["offset"]), list(info["whole"]), t))
    plan: Tiling = {}
    for name, got in parts.items():
        whole, dtype = got[0][2], got[0][3].dtype
        boxes = [(offset, list(t.shape)) for _, offset, _, t in got]
        problem = ""
        if any(w != whole for _, _, w, _ in got) or any(t.dtype != dtype for *_, t in got):
            problem = "its uploaders disagree on its shape or dtype: " + "; ".join(
                f"{s}: {w} {t.dtype}" for s, _, w, t in got)
        elif any(len(o) != len(whole) or any(x < 0 or x + n > w for x, n, w in zip(o, shape, whole))
                 for o, shape in boxes):
            problem = f"a piece lies outside its shape {whole}: {[piece_key(name, o, n) for o, n in boxes]}"
        elif any(_overlap(boxes[i], boxes[j]) for i in range(len(boxes)) for j in range(i)):
            problem = f"pieces overlap: {sorted(piece_key(name, o, n) for o, n in boxes)}"
        elif sum(t.numel() for *_, t in got) != math.prod(whole):
            problem = (f"its pieces cover {sum(t.numel() for *_, t in got)} of its {math.prod(whole)} elements "
                       f"(shape {whole}): {sorted(piece_key(name, o, n) for o, n in boxes)}")
        if problem:
            raise PiecesMismatch(f"parameter {name} (pieces from {', '.join(sorted({s for s, *_ in got}))}): "
                                 f"{problem}")
        plan[name] = (whole, [(offset, t) for _, offset, _, t in got])
    return plan


def _slices(offset: list[int], shape: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def assemble(shards: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict]]]) -> dict[str, torch.Tensor]:
    """Whole tensors by parameter name from every shard's pieces (shard -> decode_pieces' result).

    A parameter that came in one piece is that piece (no copy); else a tensor is made and each piece copied into
    its slice. Each parameter's pieces must tile it exactly: same whole shape and dtype from every uploader, every
    piece inside it, none overlapping, every element covered; anything else is a PiecesMismatch naming the
    parameter and the shards its pieces came from."""
    return {name: _put_together(whole, got) for name, (whole, got) in _tiling(shards).items()}


def _put_together(whole: list[int], got: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    if len(got) == 1:
        return got[0][1]
    out = torch.empty(whole, dtype=got[0][1].dtype)
    for offset, t in got:
        out[_slices(offset, t.shape)].copy_(t)
    return out


@torch.no_grad()
def import_pieces(model: torch.nn.Module, shards: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict]]]) -> None:
    """import_state from pieces: each piece copied straight into its slice of the model's parameter (no whole
    tensor made). Every piece is checked (assemble's tiling, the model's names and shapes) before the first copy,
    so a refused update leaves the model as it was."""
    plan = _tiling(shards)
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(plan)), sorted(set(plan) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    wrong = [f"{n}: {whole}, model {list(params[n].shape)}" for n, (whole, _) in plan.items()
             if whole != list(params[n].shape)]
    if wrong:
        raise ValueError(f"weights: shapes differ from the model's: {wrong[:5]}")
    for name, (whole, got) in plan.items():
        p = params[name]
        if is_dtensor(p):  # a laid-out target: put it together, then keep this rank's piece
            copy_whole_(p, _put_together(whole, got))
            continue
        for offset, t in got:
            p[_slices(offset, t.shape)].copy_(t)
