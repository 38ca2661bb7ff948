"""Bodies that cross processes: JSON, or safetensors with the JSON arguments in its metadata.

Never pickle. A tensor-carrying body is one safetensors blob whose `__metadata__["json"]`
holds the call's JSON arguments, so one parser (the safetensors header) reads both.

With checksums on (`encode(..., checksums=True)`: the policy's stage_checksums), the sender also puts the
sha256 and shape of every tensor in `__metadata__["sha256"]`, taken where the tensor was made,
and the receiver checks them: data that changed between stages fails where it arrives, naming
the sender, instead of as a shape error stages later. Without them, like the seeds' system, a
changed tensor travels on unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and safetensors load where tensors are handled: a process that only routes JSON (the scheduler) starts
# without them (torch alone is about a second of a process's start)

JSON_TYPE = "application/json"
TENSORS_TYPE = "application/x-rlhf-safetensors"


class CorruptPayload(ValueError):
    """A tensor that does not match the checksum its sender computed."""


@dataclass(frozen=True)
class RawBody:
    """A body that is already encoded (a weight shard's safetensors bytes, or the JSON naming its file): the client
    sends it as it is, with its content type, through the same fault points, retries and typed errors as any call."""

    data: bytes
    content_type: str


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """name -> [sha256 of the bytes, shape] for each tensor."""
    import torch

    out = {}
    for name, t in tensors.items():
        flat = t.detach().contiguous().reshape(-1).cpu()
        out[name] = [hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest(),
                     list(t.shape)]
    return out


def encode(obj: Any = None, tensors: dict[str, torch.Tensor] | None = None,
           sums: dict[str, list] | None = None, checksums: bool = False) -> tuple[bytes, str]:
    """sums: checksums taken earlier (where the tensors were made); computed here when `checksums` is on."""
    if isinstance(obj, RawBody):
        return obj.data, obj.content_type
    if tensors:
        from rlhf.weights import to_safetensors_bytes

        metadata = {"json": json.dumps(obj)}
        if sums is None and checksums:
            sums = digests(tensors)
        if sums is not None:
            metadata["sha256"] = json.dumps(sums)
        return to_safetensors_bytes(tensors, metadata=metadata), TENSORS_TYPE
    return json.dumps(obj).encode(), JSON_TYPE


def decode(body: bytes, content_type: str) -> tuple[Any, dict[str, torch.Tensor]]:
    if content_type.startswith(TENSORS_TYPE):
        if len(body) < 8:
            raise ValueError(f"tensor body of {len(body)} bytes is shorter than its header length field")
        (header_len,) = struct.unpack("<Q", body[:8])
        if header_len > len(body) - 8:
            raise ValueError(f"tensor body truncated: header says {header_len} bytes, body has {len(body) - 8}")
        header = json.loads(body[8 : 8 + header_len])
        meta = header.get("__metadata__", {})
        obj = json.loads(meta.get("json", "null"))
        from rlhf.weights import from_safetensors_bytes

        tensors = from_safetensors_bytes(body)
        if "sha256" in meta:
            expected = json.loads(meta["sha256"])
            for name, (digest, shape) in digests(tensors).items():
                want = expected.get(name)
                if want is None or want[0] != digest:
                    raise CorruptPayload(f"tensor {name!r} arrived with shape {shape} and does not match its sender's "
                                         f"checksum (sent with shape {want[1] if want else '?'})")
        return obj, tensors
    if not body:
        return None, {}
    return json.loads(body), {}


def shapes(tensors: dict[str, Any]) -> str:
    """'logprobs:128x12;mask:128x12': a reply's tensor shapes, for the sender's and the receiver's spans."""
    return ";".join(f"{k}:{'x'.join(str(d) for d in getattr(v, 'shape', ()))}" for k, v in sorted(tensors.items()))
