"""`weights.transport cuda_ipc`: a train rank's shard stays on its GPU; rollout servers on the same GPU copy it device
to device.

The train rank packs its pieces into one flat byte buffer on its device (`pack`, laid out as a safetensors data
section, with the safetensors header beside it), shares the buffer through CUDA IPC once per rollout server
(`share`: the handle and torch's reference counter as plain bytes and integers in JSON, never pickled), and keeps it
until the MetaServer has evicted the version. The MetaServer relays the header and the handles as it relays a shm
file's path. A rollout server finds the GPU by its UUID (the processes may number their devices differently), opens
the handle (`open_shared`), takes a view of each piece (`unpack`) and copies it into its parameters; torch's IPC
reference counting keeps the producer's memory until the consumer has released it.

What it saves, against `shm`: the device-to-host copy, the shared-memory write and read, the host-to-device copy.
What it needs: the train ranks and the rollout servers on one host and their tensors on CUDA (`Config` checks it).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import torch

from rlhf.weights import _ST_DTYPES

ALIGN = 256  # every piece starts on this byte boundary in the flat buffer (aligned vector copies out of it)
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


class IpcError(RuntimeError):
    """A CUDA IPC weights handle this process cannot open (another host, a CPU process, a GPU it does not see)."""


def pack(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
         ) -> tuple[torch.Tensor, dict[str, Any]]:
    """(one flat uint8 buffer on the tensors' device holding every tensor's bytes, its safetensors-style header:
    key -> {dtype, shape, data_offsets}, plus "__metadata__")."""
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors.items():
        if t.dtype not in _ST_NAMES:
            raise TypeError(f"{key}: dtype {t.dtype} cannot travel as a weights piece (one of "
                            f"{', '.join(str(d) for d in _ST_NAMES)})")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += -(-nbytes // ALIGN) * ALIGN
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for key, t in tensors.items():
        start, end = header[key]["data_offsets"]
        if end > start:
            flat[start:end].view(t.dtype).view(t.shape).copy_(t.detach())
    header["__metadata__"] = dict(metadata or {})
    return flat, header


def unpack(flat: torch.Tensor, header: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(views of `flat` by key, in each one's dtype and shape; the header's metadata). Nothing is copied."""
    out: dict[str, torch.Tensor] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(entry["dtype"])
        start, end = entry["data_offsets"]
        if dtype is None or not 0 <= start <= end <= flat.numel():
            raise ValueError(f"weights piece {key!r}: dtype {entry['dtype']!r}, bytes [{start}, {end}) do not fit a "
                             f"buffer of {flat.numel()} bytes")
        piece = flat[start:end].view(dtype) if end > start else torch.empty(0, dtype=dtype, device=flat.device)
        out[key] = piece.view(entry["shape"])
    return out, dict(header.get("__metadata__", {}))


def header_bytes(header: dict[str, Any]) -> bytes:
    """The header as a safetensors file begins (8-byte length, JSON), for code that reads shard headers."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share(flat: torch.Tensor, consumers: int) -> list[dict[str, Any]]:
    """One handle per consumer of a CUDA buffer (each carries its own slot of torch's reference counter, which that
    consumer releases), as JSON-able dicts."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if flat.device.type != "cuda":
        raise IpcError(f"weights.transport cuda_ipc shares CUDA memory; this shard is on {flat.device}")
    uuid = device_uuid(flat.device)
    out = []
    for _ in range(consumers):
        fn, args = reduce_tensor(flat)
        if fn is not rebuild_cuda_tensor:
            raise IpcError(f"torch shared the buffer with {getattr(fn, '__name__', fn)}, not rebuild_cuda_tensor")
        (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_bytes, storage_offset,
         _grad, ref_counter, ref_counter_offset, event, event_sync) = args
        out.append({"uuid": uuid, "device": int(device), "nbytes": flat.numel(), "tensor_offset": int(tensor_offset),
                    "handle": _b64(handle), "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset),
                    "ref_counter": _b64(ref_counter), "ref_counter_offset": int(ref_counter_offset),
                    "event": _b64(event), "event_sync": bool(event_sync)})
    return out


def open_shared(desc: dict[str, Any], device: torch.device, who: str) -> torch.Tensor:
    """The producer's flat buffer, mapped into this process on `device` (which must be the same GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if device.type != "cuda":
        raise IpcError(f"{who} runs on {device}: weights.transport cuda_ipc needs the rollout servers on the train "
                       "ranks' GPUs (choose weights.transport shm or http)")
    index = next((i for i in range(torch.cuda.device_count())
                  if device_uuid(torch.device("cuda", i)) == desc["uuid"]), None)
    if index is None:
        raise IpcError(f"{who} does not see the GPU the shard is on ({desc['uuid']}): weights.transport cuda_ipc needs "
                       "the train ranks and rollout servers on one host, on GPUs each of them sees")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([desc["nbytes"]]), (1,), desc["tensor_offset"], torch.storage.TypedStorage,
        torch.uint8, index, _unb64(desc["handle"]), desc["storage_bytes"], desc["storage_offset"], False,
        _unb64(desc["ref_counter"]), desc["ref_counter_offset"], _unb64(desc["event"]), desc["event_sync"])


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)
