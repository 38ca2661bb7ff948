"""Weights as named tensors: export, import, checksum, safetensors bytes and HF directories.

Tied parameters (embedding and LM head) appear once, under the first name `named_parameters`
gives them, so the safetensors format (which refuses shared storage) can carry them.
Nothing here unpickles: bytes are safetensors, directories are HF safetensors folders.
"""

from __future__ import annotations

import glob
import hashlib
import os

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save


def export_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached parameters by name (shared parameters once)."""
    return {name: p.detach() for name, p in model.named_parameters()}


@torch.no_grad()
def import_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters; names, shapes and dtypes must match exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        src = tensors[name]
        if src.shape != p.shape:
            raise ValueError(f"weights: {name} has shape {tuple(src.shape)}, model expects {tuple(p.shape)}")
        p.copy_(src.to(device=p.device, dtype=p.dtype))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (any dtype, incl. bfloat16), row-major, on the CPU."""
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def to_safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def from_safetensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def save_state_dir(model: torch.nn.Module, directory: str, tokenizer=None) -> None:
    """Write an HF model directory (config.json + model.safetensors [+ tokenizer])."""
    from transformers.utils import logging as hf_logging

    os.makedirs(directory, exist_ok=True)
    hf_logging.disable_progress_bar()  # a progress bar per save would flood the rank's log
    model.save_pretrained(directory, safe_serialization=True)
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


def save_tensors_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
