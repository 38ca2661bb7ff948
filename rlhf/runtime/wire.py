"""Bodies that cross processes: JSON, or safetensors with the JSON arguments in its metadata.

Never pickle. A tensor-carrying body is one safetensors blob whose `__metadata__["json"]`
holds the call's JSON arguments, so one parser (the safetensors header) reads both.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from rlhf.weights import from_safetensors_bytes, to_safetensors_bytes

JSON_TYPE = "application/json"
TENSORS_TYPE = "application/x-rlhf-safetensors"


def encode(obj: Any = None, tensors: dict[str, torch.Tensor] | None = None) -> tuple[bytes, str]:
    if tensors:
        return to_safetensors_bytes(tensors, metadata={"json": json.dumps(obj)}), TENSORS_TYPE
    return json.dumps(obj).encode(), JSON_TYPE


def decode(body: bytes, content_type: str) -> tuple[Any, dict[str, torch.Tensor]]:
    if content_type.startswith(TENSORS_TYPE):
        if len(body) < 8:
            raise ValueError(f"tensor body of {len(body)} bytes is shorter than its header length field")
        (header_len,) = struct.unpack("<Q", body[:8])
        if header_len > len(body) - 8:
            raise ValueError(f"tensor body truncated: header says {header_len} bytes, body has {len(body) - 8}")
        header = json.loads(body[8 : 8 + header_len])
        obj = json.loads(header.get("__metadata__", {}).get("json", "null"))
        return obj, from_safetensors_bytes(body)
    if not body:
        return None, {}
    return json.loads(body), {}
