"""MetaServer: shards over HTTP and through shared memory, digests checked end to end, files owned and removed."""

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from rlhf.services.metaserver import SHM_PREFIX, MetaServer, pull_weights, push_shard, shm_root
from rlhf.tracing.metrics import ACTIVITY
from rlhf.transport.client import Client
from rlhf.weights import ShardCorrupt, encode_shard, write_shard

TOKEN = "meta-test-token"


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}


async def _publish_and_pull(url, meta, version, parts, transport, checksum="crc32"):
    client = Client(url, TOKEN, peer="metaserver-0")
    try:
        await client.call("/versions", {"version": version, "shards": len(parts)})
        for i, part in enumerate(parts):
            part, where = part if isinstance(part, tuple) else (part, None)  # (own_pieces' tensors, where)
            if transport == "shm":
                path = os.path.join(meta.shm_dir, f"v{version}-rank{i}.safetensors")
                write_shard(part, path, checksum, where)
                await push_shard(client, version, f"rank{i}", None, 10, path=path)
            else:
                await push_shard(client, version, f"rank{i}", encode_shard(part, checksum, where), 10)
        manifest, _ = await client.call(f"/weights/{version}/manifest?wait_s=5", method="GET")
        return manifest, await pull_weights(client, version, 5, 10)
    finally:
        await client.close()


async def _delete(url, version):
    client = Client(url, TOKEN)
    try:
        await client.call(f"/weights/{version}", method="DELETE")
    finally:
        await client.close()


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_shards_arrive_bit_exact_with_digests_in_the_manifest(transport):
    meta = MetaServer(TOKEN, transport=transport)
    url = meta.start()
    try:
        parts = [_tensors(1), {"c.weight": torch.arange(12.0).view(3, 4)}]
        manifest, got = asyncio.run(_publish_and_pull(url, meta, "3", parts, transport))
        for part in parts:
            for name, t in part.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t)
        assert manifest["tensors"]["a.weight"]["checksum"] == "crc32" and len(manifest["tensors"]["a.weight"]["digest"]) == 8
        assert ("path" in manifest["shards"]["rank0"]) == (transport == "shm")
        if transport == "shm":
            assert sorted(os.listdir(meta.shm_dir)) == ["v3-rank0.safetensors", "v3-rank1.safetensors"]
    finally:
        meta.stop()
    assert not meta.shm_dir or not os.path.exists(meta.shm_dir)  # stop() removes every file it owned


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_each_rank_sends_its_rows_and_the_puller_puts_every_parameter_together(transport):
    """Three ranks of a replicated model each send 1/3 of every parameter's rows (own_pieces), named by parameter and
    slice; the manifest says where each piece lies, and the puller's tensors are the model's, bit for bit. A piece
    missing or sent twice is named with its parameter and the shards it came from."""
    from rlhf.pieces import PiecesMismatch, own_pieces

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    whole = {n: p.detach() for n, p in model.named_parameters()}
    parts = [own_pieces(model, r, 3, torch.bfloat16) for r in range(3)]
    meta = MetaServer(TOKEN, transport=transport)
    url = meta.start()
    try:
        manifest, got = asyncio.run(_publish_and_pull(url, meta, "1", parts, transport))
        assert sorted(got) == sorted(whole)
        for name, t in whole.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
        entry = manifest["tensors"]["0.weight[5:7,0:5]"]  # 7 rows over 3 ranks: 3, 2, 2
        assert (entry["shard"], entry["name"], entry["offset"], entry["whole"], entry["shape"]) == \
            ("rank2", "0.weight", [5, 0], [7, 5], [2, 5])
        assert {e["shard"] for e in manifest["tensors"].values() if e["name"] == "2.bias"} == {"rank0", "rank1"}
        with pytest.raises(PiecesMismatch, match=r"weights 2: parameter 0\.bias \(pieces from rank0, rank1\): "
                                                 r"its pieces cover 5 of its 7 elements"):
            asyncio.run(_publish_and_pull(url, meta, "2", parts[:2], transport))  # rank 2's rows never sent
        with pytest.raises(PiecesMismatch, match=r"weights 3: parameter 0\.bias \(pieces from rank0, rank1, "
                                                 r"rank2\): pieces overlap"):
            asyncio.run(_publish_and_pull(url, meta, "3", [parts[0], parts[1], parts[1]], transport))
    finally:
        meta.stop()


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_a_version_of_many_shards_is_merged_into_one_of_whole_tensors(transport):
    """weights.merge_shards: past merge_above shards the MetaServer puts the version together once; the manifest then
    lists each parameter once (not each rank's piece of it), every puller reads one shard, the uploaders' files are
    gone, and a version whose pieces do not tile is every puller's error, naming the parameter."""
    from rlhf.errors import RemoteError
    from rlhf.pieces import own_pieces

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    whole = {n: p.detach() for n, p in model.named_parameters()}
    parts = [own_pieces(model, r, 3) for r in range(3)]
    meta = MetaServer(TOKEN, transport=transport, merge_above=2)
    url = meta.start()
    try:
        manifest, got = asyncio.run(_publish_and_pull(url, meta, "1", parts, transport, checksum="none"))
        assert list(manifest["shards"]) == ["merged"]
        assert sorted(e["name"] for e in manifest["tensors"].values()) == sorted(whole)  # O(tensors)
        for name, t in whole.items():
            assert torch.equal(got[name], t), name
        if transport == "shm":
            assert sorted(os.listdir(meta.shm_dir)) == ["v1-merged.safetensors"]
        with pytest.raises(RemoteError, match=r"parameter 0\.bias \(pieces from rank0, rank1, rank2\): pieces overlap"):
            asyncio.run(_publish_and_pull(url, meta, "2", [parts[0], parts[1], parts[1]], transport, checksum="none"))
    finally:
        meta.stop()


def test_eviction_and_delete_remove_shared_memory_files():
    meta = MetaServer(TOKEN, max_versions=1, transport="shm")
    url = meta.start()
    try:
        asyncio.run(_publish_and_pull(url, meta, "1", [_tensors(1)], "shm"))
        asyncio.run(_publish_and_pull(url, meta, "2", [_tensors(2)], "shm"))  # opening 2 evicts 1
        assert os.listdir(meta.shm_dir) == ["v2-rank0.safetensors"]
        asyncio.run(_delete(url, "2"))
        assert os.listdir(meta.shm_dir) == []
    finally:
        meta.stop()


def test_a_manifest_waiting_for_a_shard_that_never_comes_ends_when_the_version_goes_or_the_server_stops():
    """A rollout server waits on the manifest while a train rank uploads; when that rank dies, nobody sends the shard.
    Deleting the version (410, dropped), or stopping the MetaServer (the run's cleanup: 504 incomplete, as at the
    wait's end) answers the waiting request at once instead of holding it (and the server's shutdown) for its whole
    wait_s."""
    import concurrent.futures
    import time

    from rlhf.errors import HTTPStatusError

    meta = MetaServer(TOKEN, transport="http")
    url = meta.start()
    stopped = False

    async def wait_for(version, then):
        client = Client(url, TOKEN, peer="metaserver-0")
        try:
            await client.call("/versions", {"version": version, "shards": 2})
            waiting = asyncio.create_task(client.call(f"/weights/{version}/manifest?wait_s=60", method="GET",
                                                      timeout_s=90))
            while not meta.waiting:  # the manifest request is in its wait
                await asyncio.sleep(0.01)
            assert ACTIVITY.name == "idle"  # a long poll is not what this process (rank 0's) is doing
            t0 = time.monotonic()
            await then()
            with pytest.raises(HTTPStatusError) as info:
                await waiting
            return info.value, time.monotonic() - t0
        finally:
            await client.close()

    async def delete():
        await _delete(url, "1")

    async def stop():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            await asyncio.get_running_loop().run_in_executor(pool, meta.stop)

    try:
        exc, took = asyncio.run(wait_for("1", delete))
        assert exc.status == 410 and "dropped" in str(exc) and took < 5, (exc, took)
        exc, took = asyncio.run(wait_for("2", stop))
        stopped = True
        assert exc.status == 504 and "incomplete" in str(exc) and "stopping" in str(exc) and took < 5, (exc, took)
    finally:
        if not stopped:
            meta.stop()


def test_a_corrupted_tensor_is_named_by_the_puller():
    meta = MetaServer(TOKEN, transport="shm")
    url = meta.start()
    try:
        async def go():
            client = Client(url, TOKEN)
            await client.call("/versions", {"version": "9", "shards": 1})
            path = os.path.join(meta.shm_dir, "v9-rank0.safetensors")
            write_shard(_tensors(3), path, "crc32")
            with open(path, "r+b") as fh:  # flip one byte of the last tensor's data, in place
                fh.seek(-1, os.SEEK_END)
                last = fh.read(1)
                fh.seek(-1, os.SEEK_END)
                fh.write(bytes([last[0] ^ 0xFF]))
            await push_shard(client, "9", "rank0", None, 10, path=path)
            try:
                await pull_weights(client, "9", 5, 10)
            finally:
                await client.close()

        with pytest.raises(ShardCorrupt, match="shard rank0.*'b.bias'.*crc32"):
            asyncio.run(go())
    finally:
        meta.stop()


def test_shm_put_refuses_a_path_outside_its_folder(tmp_path):
    meta = MetaServer(TOKEN, transport="shm")
    url = meta.start()
    try:
        outside = str(tmp_path / "x.safetensors")
        write_shard(_tensors(1), outside)

        async def go():
            client = Client(url, TOKEN)
            try:
                await client.call("/versions", {"version": "1", "shards": 1})
                await push_shard(client, "1", "rank0", None, 10, path=outside)
            finally:
                await client.close()

        with pytest.raises(Exception, match="400.*not in this MetaServer's directory"):
            asyncio.run(go())
        assert os.path.exists(outside)  # not ours: never deleted
    finally:
        meta.stop()


def test_a_new_metaserver_removes_folders_of_dead_ones():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(shm_root(), f"{SHM_PREFIX}{int(dead.stdout)}-test")
    os.makedirs(stale)
    with open(os.path.join(stale, "v1-rank0.safetensors"), "wb") as fh:
        fh.write(b"left by a SIGKILLed run")
    meta = MetaServer(TOKEN, transport="shm")
    try:
        assert not os.path.exists(stale)
        assert os.path.exists(meta.shm_dir)  # its own folder (a live pid) is kept
    finally:
        meta.stop()


@pytest.mark.parametrize("typed", [True, False])
def test_an_exception_inside_the_metaserver_is_logged_there_and_reaches_the_caller(caplog, typed):
    """A handler bug (here: a /versions call without `shards`) is logged by the MetaServer with its step and
    comes back by class and message; with typed_errors off it is the seeds' bare 500 (and still logged)."""
    import dataclasses

    from rlhf.config.resilience import HARDENED
    from rlhf.errors import HTTPStatusError, RemoteError

    meta = MetaServer(TOKEN, transport="http", policy=dataclasses.replace(HARDENED, typed_errors=typed))
    url = meta.start()
    try:
        call = Client(url, TOKEN, peer="metaserver-0").call("/versions", {"version": "3"}, stage="weights_update",
                                                            step=3)
        with caplog.at_level("ERROR", logger="rlhf.http"):
            if typed:
                with pytest.raises(RemoteError) as err:
                    asyncio.run(call)
                info = err.value.info
                assert (info.error_class, info.message, info.role, info.stage, info.step) == \
                    ("KeyError", "'shards'", "metaserver", "weights_update", 3)
            else:
                with pytest.raises(HTTPStatusError) as err:
                    asyncio.run(call)
                assert err.value.status == 500 and "KeyError" not in err.value.text
        logged = [r.getMessage() for r in caplog.records if r.name == "rlhf.http"]
        assert any("metaserver-0: POST /versions failed at step 3: KeyError: 'shards'" in m for m in logged), logged
    finally:
        meta.stop()


def test_a_shard_put_again_is_kept_and_goes_through_the_clients_fault_point(tmp_path):
    """The shard PUT is a client hop like any other: rpc.client.send fires on it (peer metaserver-0), and it is
    idempotent, so the policy's retry sends it again; a retried shared-memory PUT names the same file, which the
    MetaServer keeps (it dropped it once, as if an older shard of that name)."""
    from rlhf import faults
    from rlhf.faults.points import idempotent

    assert idempotent("PUT", "/weights/3/rank0") and not idempotent("PUT", "/generate")
    meta = MetaServer(TOKEN, transport="shm")
    url = meta.start()
    try:
        async def go():
            client = Client(url, TOKEN, peer="metaserver-0", retries=True)
            try:
                await client.call("/versions", {"version": "4", "shards": 1})
                faults.arm(str(tmp_path), [{"name": "dns-once", "kind": "dns_failure", "point": "rpc.client.send",
                                            "target": {"peer": "metaserver"}, "when": {"max_hits": 1}}])
                path = os.path.join(meta.shm_dir, "v4-rank0.safetensors")
                write_shard(_tensors(5), path, "crc32")
                await push_shard(client, "4", "rank0", None, 10, path=path)  # the fault's one hit: sent again
                await push_shard(client, "4", "rank0", None, 10, path=path)  # as a retry after a lost reply would
                assert os.path.exists(path)
                return await pull_weights(client, "4", 5, 10)
            finally:
                await client.close()

        got = asyncio.run(go())
        assert torch.equal(got["a.weight"], _tensors(5)["a.weight"])
    finally:
        faults.disarm()
        meta.stop()
    with open(tmp_path / "faults" / "markers.jsonl") as fh:
        assert '"dns-once"' in fh.read()


def test_a_rollout_models_slices_are_compared_with_the_pieces_each_rank_holds():
    """weights.verify in a sharded layout: each train rank's digest of each piece it holds against the digest of the
    same slice of a rollout server's model; a change to one row is found in that piece alone, named by its key."""
    from rlhf.pieces import own_pieces, piece_digests, slice_digests

    trainer = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    rollout = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    rollout.load_state_dict(trainer.state_dict())
    sent, where = {}, {}
    for rank in range(2):
        part, info = own_pieces(trainer, rank, 2, torch.bfloat16)
        sent.update(piece_digests(part, "sha256"))
        where.update({k: {**info[k], "shape": list(t.shape)} for k, t in part.items()})
    assert slice_digests(rollout, where, "sha256") == sent and len(sent) == 8  # 4 parameters x 2 ranks' rows
    with torch.no_grad():
        rollout[0].weight[6].add_(1.0)  # a row in rank 1's half of the first weight
    got = slice_digests(rollout, where, "sha256")
    assert [k for k in sent if got[k] != sent[k]] == ["0.weight[4:8,0:6]"]
    assert slice_digests(rollout, {"x[0:1]": {"name": "missing.weight", "offset": [0], "shape": [1]}},
                         "sha256") == {"x[0:1]": "absent"}


def test_a_rank_or_server_on_another_host_moves_its_shard_over_http_and_the_version_opens_without_a_round_trip(
        monkeypatch):
    """weights.transport shm across hosts: train rank 1 does not see the MetaServer's shared-memory folder (another
    host's /dev/shm) and PUTs its bytes; rank 0 beside the MetaServer writes its file. A rollout server that sees
    neither file (on a third host) fetches both over HTTP and ends with the trainer's model. The version was opened
    by the controller's direct call (MetaServer.open_version), with no POST /versions."""
    from types import SimpleNamespace

    from rlhf.config import Config
    from rlhf.pieces import import_pieces
    from rlhf.services import metaserver
    from rlhf.services.train_worker.state import WeightsAndCheckpoints

    torch.manual_seed(0)
    trained, rollout = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)), \
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    meta = MetaServer(TOKEN, transport="shm")
    url = meta.start()
    ranks = [SimpleNamespace(model=trained, rank=r, world_size=2, wire_dtype=torch.float32, run_dir="", device="cpu",
                             cfg=Config(), token=TOKEN) for r in range(2)]
    try:
        asyncio.run(meta.open_version("7", 2))
        for rank, shm_dir in zip(ranks, [meta.shm_dir, os.path.join(meta.shm_dir + "-elsewhere")]):
            WeightsAndCheckpoints.upload_weights(rank, {"version": "7", "metaserver_url": url, "timeout_s": 10,
                                                        "transport": "shm", "shm_dir": shm_dir}, {})
        assert os.listdir(meta.shm_dir) == ["v7-rank0.safetensors"]  # rank 1's shard is held as bytes
        monkeypatch.setattr(metaserver.os.path, "exists", lambda path: False)  # a host that sees no shard file

        async def pull():
            client = Client(url, TOKEN)
            try:
                manifest, _ = await client.call("/weights/7/manifest?wait_s=5", method="GET")
                return manifest, await metaserver.pull_pieces(client, "7", 5, 10)
            finally:
                await client.close()

        manifest, pieces = asyncio.run(pull())
        assert "path" in manifest["shards"]["rank0"] and "path" not in manifest["shards"]["rank1"]
        import_pieces(rollout, pieces)
        for a, b in zip(trained.parameters(), rollout.parameters()):
            assert torch.equal(a, b)
    finally:
        meta.stop()
