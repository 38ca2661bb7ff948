"""weights.transport cuda_ipc, what a CPU can check: the flat buffer's layout, the MetaServer relaying a shard that
stays in its uploader's GPU memory, and the refusals a process that cannot map it gets. The handle's round trip
between two processes on one GPU is tests/test_gpu.py::test_cuda_ipc_weights (marked gpu)."""

import asyncio
import json

import pytest
import torch

from rlhf.errors import HTTPStatusError
from rlhf.pieces import own_pieces
from rlhf.services.metaserver import MetaServer, pull_pieces, push_shard
from rlhf.transport import cuda_ipc
from rlhf.transport.client import Client
from rlhf.weights import PIECES, shard_header

TOKEN = "ipc-test-token"


def _tensors():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(5, 7, generator=g), "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
            "c.steps": torch.arange(4, dtype=torch.int64), "d.scale": torch.tensor(2.5, dtype=torch.float16),
            "e.empty": torch.empty(0, 4)}


def test_pack_lays_every_tensor_on_an_aligned_offset_and_unpack_gives_views_of_the_same_bytes():
    tensors = _tensors()
    flat, header = cuda_ipc.pack(tensors, {"note": "x"})
    assert flat.dtype == torch.uint8 and flat.numel() % cuda_ipc.ALIGN == 0
    starts = [header[k]["data_offsets"][0] for k in tensors]
    assert all(s % cuda_ipc.ALIGN == 0 for s in starts) and starts == sorted(set(starts))
    views, metadata = cuda_ipc.unpack(flat, header)
    assert metadata == {"note": "x"} and list(views) == list(tensors)
    for key, t in tensors.items():
        assert views[key].dtype == t.dtype and views[key].shape == t.shape and torch.equal(views[key], t)
    views["a.weight"][0, 0] = 100.0  # views, not copies: what the rollout server copies out is the buffer itself
    assert flat[:4].view(torch.float32).item() == 100.0
    # the header as a safetensors file begins: the relay's header reader takes it unchanged
    head = cuda_ipc.header_bytes(header)
    entries, meta, base = shard_header(head, size=len(head) + flat.numel())
    assert base == len(head) and entries["c.steps"]["dtype"] == "I64" and meta == {"note": "x"}


def test_unpack_refuses_a_header_that_does_not_fit_its_buffer_and_pack_an_unknown_dtype():
    flat, header = cuda_ipc.pack({"w": torch.ones(4)})
    header["w"]["data_offsets"] = [0, flat.numel() + 4]
    with pytest.raises(ValueError, match=r"weights piece 'w'.*do not fit a buffer of 256 bytes"):
        cuda_ipc.unpack(flat, header)
    with pytest.raises(TypeError, match=r"z: dtype torch.complex64 cannot travel"):
        cuda_ipc.pack({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(cuda_ipc.IpcError, match="shares CUDA memory; this shard is on cpu"):
        cuda_ipc.share(flat, 1)


def test_the_metaserver_relays_a_gpu_resident_shard_by_header_and_handles_and_a_cpu_server_is_refused():
    """A shard PUT as {header, handles}: the manifest lists its pieces as for any shard, plus the handles; the
    MetaServer holds none of its bytes; GET of its bytes is a 409 that says where they are; a rollout server on a
    CPU that pulls it is told why it cannot map it and what to choose instead."""
    model = torch.nn.Linear(6, 4)
    part, where = own_pieces(model, 0, 1)
    _, header = cuda_ipc.pack(part, {"checksum": "none", PIECES: json.dumps(where)})
    handles = [{"uuid": "GPU-test", "device": 0, "nbytes": 256, "handle": "AAAA"}] * 2  # never opened here
    meta = MetaServer(TOKEN)
    url = meta.start()

    async def scenario():
        client = Client(url, TOKEN, peer="metaserver-0")
        try:
            await client.call("/versions", {"version": "4", "shards": 1})
            await push_shard(client, "4", "rank0", None, 10, ipc={"header": header, "handles": handles})
            manifest, _ = await client.call("/weights/4/manifest?wait_s=5", method="GET")
            with pytest.raises(HTTPStatusError) as got:
                await client.call("/weights/4/rank0", method="GET", raw=True)
            with pytest.raises(cuda_ipc.IpcError) as refused:
                await pull_pieces(client, "4", 5, 10, device=torch.device("cpu"), consumer=1, who="rollout-1")
            with pytest.raises(ValueError, match=r"shared with 2 rollout server\(s\); rollout-2 is number 2"):
                await pull_pieces(client, "4", 5, 10, device=torch.device("cpu"), consumer=2, who="rollout-2")
            health, _ = await client.call("/health", method="GET")
            return manifest, got.value, refused.value, health
        finally:
            await client.close()

    try:
        manifest, got, refused, health = asyncio.run(scenario())
    finally:
        meta.stop()
    entries = manifest["tensors"]
    assert {e["name"] for e in entries.values()} == {"weight", "bias"}
    assert entries[next(k for k, e in entries.items() if e["name"] == "weight")]["shape"] == [4, 6]
    shard = manifest["shards"]["rank0"]
    assert shard["cuda_ipc"]["handles"] == handles and shard["bytes"] == cuda_ipc.ALIGN + 4 * 6 * 4 and "path" not in shard
    assert health["bytes"] == 0  # the bytes are in the uploader's GPU memory, not the MetaServer's
    assert got.status == 409 and "stays in its train rank's GPU memory" in str(got)
    assert "rollout-1 runs on cpu" in str(refused) and "choose weights.transport shm or http" in str(refused)


def test_two_train_ranks_shards_through_the_relay_land_in_a_rollout_model(monkeypatch):
    """The upload and the pull as the runtime runs them (TrainWorker.upload_weights' cuda_ipc branch, the
    MetaServer, pull_pieces, import_pieces) for 2 replicated train ranks, each sending its half of the rows; the
    two CUDA calls (share's reduce_tensor, open_shared's rebuild) are stood in for by a registry of this process,
    so what runs here is everything but the mapping. The rollout model ends equal to the trainer's."""
    from types import SimpleNamespace

    from rlhf.config import Config
    from rlhf.pieces import import_pieces
    from rlhf.services.train_worker.state import WeightsAndCheckpoints

    shared: dict[int, torch.Tensor] = {}
    monkeypatch.setattr(cuda_ipc, "share", lambda flat, n: [{"id": id(shared.setdefault(id(flat), flat))}] * n)
    monkeypatch.setattr("rlhf.services.metaserver.open_shared", lambda desc, device, who: shared[desc["id"]])
    torch.manual_seed(0)
    trained, rollout = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)), \
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    meta = MetaServer(TOKEN)
    url = meta.start()
    ranks = [SimpleNamespace(model=trained, rank=r, world_size=2, wire_dtype=torch.float32, run_dir="", device="cpu",
                             cfg=Config(), token=TOKEN, _ipc_buffers={}) for r in range(2)]
    try:
        for version in ("1", "2", "3"):
            with torch.no_grad():
                trained[0].weight.add_(1.0)
            asyncio.run(_open(url, version))
            for rank in ranks:
                WeightsAndCheckpoints.upload_weights(rank, {"version": version, "metaserver_url": url, "timeout_s": 10,
                                                            "transport": "cuda_ipc", "consumers": 1, "keep": 2}, {})
            import_pieces(rollout, asyncio.run(_pull(url, version)))
            for a, b in zip(trained.parameters(), rollout.parameters()):
                assert torch.equal(a, b)
    finally:
        meta.stop()
    assert all(list(rank._ipc_buffers) == ["2", "3"] for rank in ranks)  # the versions the MetaServer still holds


async def _open(url, version):
    client = Client(url, TOKEN)
    try:
        await client.call("/versions", {"version": version, "shards": 2})
    finally:
        await client.close()


async def _pull(url, version):
    client = Client(url, TOKEN)
    try:
        return await pull_pieces(client, version, 5, 10, device=torch.device("cpu"), who="rollout-0")
    finally:
        await client.close()
