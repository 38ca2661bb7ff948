"""The MetaServer's merge of a big world's version (weights.merge_shards): its shards put together once into one
shard of whole tensors. A part of MetaServer (services/metaserver.py)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from rlhf import tracing
from rlhf.pieces import assemble, piece_key
from rlhf.weights import _ST_DTYPES, decode_pieces, encode_shard, write_shard

log = logging.getLogger("rlhf.metaserver")
MERGED = "merged"  # the one shard of a merged version
_SAFETENSORS_NAME = {dtype: name for name, dtype in _ST_DTYPES.items()}


class MergedVersions:
    """MetaServer's merge (needs its shm_dir, checksum and the _Shard type it stores)."""

    shard_type: Any = None  # services.metaserver._Shard, set there

    async def _merge(self, v: Any, version: str) -> None:
        """A big world's version (weights.merge_shards): its shards put together once, here, into one shard of whole
        tensors, so that each rollout server's manifest lists the model's tensors (not every train rank's piece of
        each) and it reads one file instead of one per train rank. Every piece is checked to tile its parameter
        (rlhf.pieces.assemble); a failure is every manifest request's error."""
        loop = asyncio.get_running_loop()
        with tracing.span("metaserver.merge", version=version, shards=len(v.shards)):
            try:
                merged, entries = await loop.run_in_executor(None, self._merged, v, version)
            except Exception as exc:  # noqa: BLE001 — answered to every consumer (the manifest re-raises it)
                v.error = exc
                log.error("weights version %s: merging its %d shards failed: %s: %s", version, len(v.shards),
                          type(exc).__name__, exc)
                v.complete.set()
                return
        if v.dropped:  # evicted meanwhile: its new file goes too
            merged.drop()
            return
        for shard in v.shards.values():
            shard.drop()
        v.shards, v.entries, v.manifest = {MERGED: merged}, entries, b""
        v.complete.set()

    def _merged(self, v: Any, version: str) -> tuple[Any, dict[str, dict[str, Any]]]:
        decoded = {name: decode_pieces(shard.read()) for name, shard in v.shards.items()}
        whole = assemble(decoded)
        where = {piece_key(n, [0] * t.dim(), list(t.shape)): {"name": n, "offset": [0] * t.dim(), "whole": list(t.shape)}
                 for n, t in whole.items()}
        tensors = {key: whole[info["name"]] for key, info in where.items()}
        if self.shm_dir:
            path = os.path.join(self.shm_dir, f"v{version}-{MERGED}.safetensors")
            merged = self.shard_type(size=write_shard(tensors, path, self.checksum, where), path=path)
        else:
            data = encode_shard(tensors, self.checksum, where)
            merged = self.shard_type(size=len(data), data=data)
        entries = {key: {"shard": MERGED, "shape": list(t.shape), "dtype": _SAFETENSORS_NAME[t.dtype],
                         "bytes": t.numel() * t.element_size(), "checksum": self.checksum, **where[key]}
                   for key, t in tensors.items()}
        return merged, entries
