"""Weights as named tensors: export, import, checksum, safetensors bytes and HF directories.

Tied parameters (embedding and LM head) appear once, under the first name `named_parameters`
gives them, so the safetensors format (which refuses shared storage) can carry them.
Nothing here unpickles: bytes are safetensors, directories are HF safetensors folders.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import sys
import warnings
import zlib
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save


def export_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Detached parameters by name (shared parameters once), cast to `dtype` when given (fp32 master -> bf16)."""
    if dtype is None:
        return {name: p.detach() for name, p in model.named_parameters()}
    return {name: p.detach().to(dtype) for name, p in model.named_parameters()}


@torch.no_grad()
def weights_by_name(model: torch.nn.Module, args: dict, dtype: torch.dtype | None = None) -> list:
    """sglang's /get_weights_by_name: parameter args['name']'s first args['truncate_size'] (100) entries along its
    first dimension, as (nested) lists of floats, cast to `dtype` first (the dtype the rollout side holds)."""
    from rlhf.errors import BadRequest

    params = dict(model.named_parameters())
    name, size = args.get("name"), args.get("truncate_size", 100)
    if name not in params:
        near = [n for n in params if str(name).split(".")[-1] in n][:3] or list(params)[:3]
        raise BadRequest(f"get_weights_by_name: no parameter {name!r}; e.g. {', '.join(near)}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise BadRequest(f"get_weights_by_name: truncate_size must be a positive integer, got {size!r}")
    p = params[name]
    if is_dtensor(p):
        raise BadRequest(f"get_weights_by_name: {name} is laid out in pieces on this rank (a sharded layout)")
    t = p.detach()[:size]
    return (t.to(dtype) if dtype is not None else t).float().cpu().tolist()


@torch.no_grad()
def import_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into the model's parameters; names and shapes must match exactly. A parameter laid out in
    pieces (a DTensor: FSDP, tensor parallel) keeps this rank's piece of its tensor, cut here (no communication)."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        src = tensors[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"weights: {name} has shape {tuple(src.shape)}, model expects {tuple(p.shape)}")
        copy_whole_(p, src)


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter laid out in pieces), without importing torch.distributed.tensor (half
    a second of every process's start): until something imported it, no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@torch.no_grad()
def copy_whole_(target: torch.Tensor, src: torch.Tensor) -> None:
    """target <- src, a whole tensor: a target laid out in pieces (a DTensor: FSDP, tensor parallel) takes this
    rank's piece of it, cut here (no communication)."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        piece = target.to_local()
        piece.copy_(distribute_tensor(src.to(device=piece.device, dtype=target.dtype), target.device_mesh,
                                      target.placements, src_data_rank=None).to_local())
    else:
        target.copy_(src.to(device=target.device, dtype=target.dtype))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (any dtype, incl. bfloat16), row-major, on the CPU."""
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


CHECKSUMS = ("crc32", "sha256", "none")  # weights.checksum choices; crc32: 3.7 GB/s here, sha256: 1.6 GB/s


def _raw(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a CPU tensor's data (hashlib and zlib read the buffer directly)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def digest(buffer: Any, algorithm: str) -> str:
    """Checksum of a bytes-like object: crc32 (8 hex digits) or sha256 (64)."""
    if algorithm == "crc32":
        return f"{zlib.crc32(buffer):08x}"
    if algorithm == "sha256":
        return hashlib.sha256(buffer).hexdigest()
    raise ValueError(f"checksum algorithm {algorithm!r}: choose one of {', '.join(CHECKSUMS[:2])}")


def checksum(tensors: dict[str, torch.Tensor], algorithm: str = "sha256") -> str:
    """One digest over names, dtypes, shapes and raw bytes, in name order (weights verification)."""
    if algorithm == "crc32":
        value = 0
        for name in sorted(tensors):
            t = tensors[name].detach().cpu()
            value = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode(), value)
            value = zlib.crc32(_raw(t), value)
        return f"crc32:{value:08x}"
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_raw(t))
    return h.hexdigest()


# ---------------------------------------------------------------- weight shards on the wire

PIECES = "pieces"  # shard metadata: tensor key -> {"name": parameter, "offset": [...], "whole": its shape}

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class ShardCorrupt(ValueError):
    """A weights shard whose bytes do not match the digests its uploader wrote into it."""


def _shard_parts(tensors: dict[str, torch.Tensor], algorithm: str, pieces: dict[str, dict] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    metadata = {"checksum": algorithm}
    if algorithm != "none":
        metadata["digests"] = json.dumps({k: digest(_raw(v), algorithm) for k, v in cpu.items()})
    if pieces:
        metadata[PIECES] = json.dumps(pieces)
    return cpu, metadata


def encode_shard(tensors: dict[str, torch.Tensor], algorithm: str = "crc32", pieces: dict[str, dict] | None = None
                 ) -> bytes:
    """One safetensors blob with a digest per tensor, computed by the sender, in its metadata.

    The digests travel inside the shard, so any consumer checks end to end what the uploader
    sent, and the relay in between (the MetaServer) never re-hashes or decodes a tensor.
    `pieces` (rlhf.pieces.own_pieces): where each tensor lies in its parameter, also in the metadata.
    """
    cpu, metadata = _shard_parts(tensors, algorithm, pieces)
    return st_save(cpu, metadata=metadata)


def write_shard(tensors: dict[str, torch.Tensor], path: str, algorithm: str = "crc32",
                pieces: dict[str, dict] | None = None) -> int:
    """encode_shard's blob written straight to a file (one copy of the tensors); returns its size."""
    cpu, metadata = _shard_parts(tensors, algorithm, pieces)
    tmp = path + ".tmp"
    save_file(cpu, tmp, metadata=metadata)
    os.replace(tmp, path)  # a reader never maps a half-written shard
    return os.path.getsize(path)


def shard_header(buffer: Any, size: int | None = None) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor entries, metadata, data offset) of a safetensors blob, reading only its JSON header.

    `buffer` may hold just the header's bytes when `size` gives the whole blob's length.
    """
    size = len(buffer) if size is None else size
    if len(buffer) < 8:
        raise ShardCorrupt(f"weights shard of {len(buffer)} bytes is shorter than its header length field")
    (n,) = struct.unpack("<Q", buffer[:8])
    if n > min(len(buffer), size) - 8:
        raise ShardCorrupt(f"weights shard truncated: header says {n} bytes, body has {size - 8}")
    header = json.loads(bytes(buffer[8:8 + n]))
    metadata = header.pop("__metadata__", {}) or {}
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if 8 + n + end > size:
        raise ShardCorrupt(f"weights shard truncated: tensors end at byte {8 + n + end}, body has {size}")
    return header, metadata, 8 + n


def decode_shard(buffer: bytes, verify: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of a shard as zero-copy views of `buffer`, each checked against its sender's digest."""
    return decode_pieces(buffer, verify)[0]


def decode_pieces(buffer: bytes, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """decode_shard, and where each tensor lies in its parameter (the uploader's own_pieces; {} for a shard of
    whole tensors named by their parameter)."""
    header, metadata, base = shard_header(buffer)
    pieces = json.loads(metadata.get(PIECES, "{}"))
    digests = json.loads(metadata["digests"]) if "digests" in metadata else {}
    algorithm = metadata.get("checksum", "none")
    view = memoryview(buffer)
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        chunk = view[base + start: base + end]
        if verify and digests:
            want = digests.get(name)
            if want is None or digest(chunk, algorithm) != want:
                raise ShardCorrupt(f"weights tensor {name!r} does not match the {algorithm} digest its uploader sent")
        dtype = _ST_DTYPES[entry["dtype"]]
        with warnings.catch_warnings():  # read-only bytes: we only ever copy out of these views
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(chunk, dtype=dtype) if end > start else torch.empty(0, dtype=dtype)
        out[name] = flat.view(entry["shape"])
    return out, pieces


def to_safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def from_safetensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def save_state_dir(model: torch.nn.Module, directory: str, tokenizer=None,
                   tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write an HF model directory (config.json [+ generation_config.json] + model.safetensors [+ tokenizer]).

    Not `model.save_pretrained`: inside an initialised torch.distributed world transformers writes the weights
    only on global rank 0 and skips every other rank without a word, and any train rank may write here (the
    weights fallback picks one that is free). Tied weights (lm_head = embed_tokens) are written once, under
    the first name, as transformers does. `tensors`: the weights by parameter name (a sharded model's, gathered
    whole), instead of the model's own state dict.
    """
    os.makedirs(directory, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, t in (tensors if tensors is not None else model.state_dict()).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_state_dir(directory: str) -> dict[str, torch.Tensor]:
    """Read every *.safetensors file of a directory into one name → tensor dict."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def load_model_dir(model_path: str) -> dict[str, torch.Tensor]:
    """The weights a rollout server loads from a directory: an HF model directory's *.safetensors, or in a parity
    checkpoint slot (meta.json or optimizer.json beside it) its model.safetensors only."""
    if os.path.exists(os.path.join(model_path, "meta.json")) or os.path.exists(os.path.join(model_path, "optimizer.json")):
        return load_file(os.path.join(model_path, "model.safetensors"))
    return load_state_dir(model_path)


def save_tensors_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
