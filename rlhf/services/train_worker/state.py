"""What a train rank's weights and checkpoints do: the pieces of the weights it holds to the MetaServer (meta mode), the HF
directory (disk mode), the weights checksum, checkpoint files (written now, bounded, or on a writer thread) and
their load on resume."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import random
import shutil
import threading
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhf import tracing
from rlhf.checkpoint import sharded as sharded_ckpt
from rlhf.checkpoint import slots as ckpt
from rlhf.errors import BadRequest
from rlhf.faults import afault_point, fault_point
from rlhf.pieces import own_pieces, piece_digests
from rlhf.services.colocation import fresh_allocation
from rlhf.services.metaserver import push_shard
from rlhf.train.parallel import Gathered, local
from rlhf.transport import cuda_ipc
from rlhf.transport import weights_group as wg
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import DEFAULT_HOST
from rlhf.weights import (
    PIECES,
    checksum,
    encode_shard,
    export_state,
    import_state,
    save_state_dir,
    weights_by_name,
    write_shard,
)

log = logging.getLogger("rlhf.train_worker")


def _metaserver_client(worker: Any, url: str) -> tuple[LoopThread, Client]:
    """A loop and a client a train rank keeps for its uploads (one connection, no new event loop a step: about a
    millisecond a weights update)."""
    kept = getattr(worker, "_metaserver", None)
    if kept is None or kept[1].base_url != url.rstrip("/"):
        loop = kept[0] if kept is not None else LoopThread("metaserver-client")
        kept = worker._metaserver = (loop, Client(url, worker.token, peer="metaserver-0",
                                                  retries=worker.cfg.resilience.retry_idempotent))
    return kept


def save_reference(directory: str, reference: torch.nn.Module, rank: int, world: int, sharded: bool) -> None:
    """The KL reference, once at GRPO's start, for a resume: replicated, rank 0 writes model.safetensors; sharded,
    each rank writes its own pieces (shards/rank<r>.safetensors, the sharded checkpoint's format: nothing gathered)
    and rank 0 removes what another layout left. Each file appears whole (a temporary name, then a rename)."""
    def put(items: list) -> None:
        for name, tensors in items:
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tensors, metadata = tensors if isinstance(tensors, tuple) else (tensors, None)
            save_file({k: v.contiguous() for k, v in tensors.items()}, path + ".tmp", metadata=metadata)
            os.replace(path + ".tmp", path)

    if not sharded:
        if rank == 0:
            shutil.rmtree(os.path.join(directory, sharded_ckpt.SHARDS), ignore_errors=True)
            put([("model.safetensors", dict(reference.named_parameters()))])
        return
    if rank == 0:
        folder = os.path.join(directory, sharded_ckpt.SHARDS)
        stale = [os.path.join(folder, f) for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                 if f.startswith("rank") and int(f[4:9]) >= world]  # another world's ranks (ours overwrite theirs)
        for path in [os.path.join(directory, "model.safetensors"), *stale]:
            if os.path.exists(path):
                os.unlink(path)
    put(sharded_ckpt.snapshot(rank, reference, None))


def load_reference(directory: str, reference: torch.nn.Module) -> None:
    """save_reference's files into the reference as it is laid out now (sharded pieces are read into any layout by
    torch.distributed.checkpoint: every rank takes part)."""
    if sharded_ckpt.is_sharded_slot(directory):
        sharded_ckpt.load(directory, reference, None)
    else:
        import_state(reference, load_file(os.path.join(directory, "model.safetensors")))


class WeightsAndCheckpoints:
    """A train rank's weights and checkpoint endpoints (a part of TrainWorker)."""

    def weights_checksum(self, args: dict, tensors: dict) -> dict:
        """The checksum of the whole model as the rollout servers get it; args['pieces'] (and always in a sharded
        layout): a digest of each piece this rank uploads instead, with where it lies (own_pieces), nothing
        gathered, for a piece-by-piece comparison with the rollout servers' slices."""
        if args.get("pieces") or self.layout.sharded:
            part, where = own_pieces(self.model, self.rank, self.world_size, self.wire_dtype)
            digests = piece_digests(part, self.cfg.weights.verify_checksum)
            return {"pieces": {key: {**where[key], "shape": list(t.shape), "digest": digests[key]}
                               for key, t in part.items()}}
        return {"checksum": checksum(export_state(self.model, self.wire_dtype), self.cfg.weights.verify_checksum)}

    def get_weights_by_name(self, args: dict, tensors: dict) -> list:
        """sglang's /get_weights_by_name on the trainer's side: a parameter's first entries as the rollout servers
        get them (cast to the wire dtype), for the spot check that compares the two (a replicated layout)."""
        if args.get("spot"):  # our extension: the names too, drawn here (the controller holds no model)
            names = [n for n, _ in self.model.named_parameters()]
            rest = random.Random(int(args.get("seed", 0))).sample(names[1:-1], min(int(args["spot"]) - 2,
                                                                                  max(len(names) - 2, 0)))
            picked = list(dict.fromkeys([names[0], *rest, names[-1]]))
            return [{"name": n, "values": weights_by_name(self.model, {**args, "name": n}, self.wire_dtype)}
                    for n in picked]
        return weights_by_name(self.model, args, self.wire_dtype)

    def upload_weights(self, args: dict, tensors: dict) -> dict:
        """Send this rank's shard of the weights to the MetaServer as version args['version'].

        args['transport'] cuda_ipc: pack the shard into one buffer on this rank's GPU, kept for args['keep']
        versions, and PUT one CUDA IPC handle per rollout server (args['consumers']); else args['shm_dir'] set and
        seen here (the MetaServer's host): write the shard as a file there and PUT its path; else PUT the bytes (a
        rank on another host: its /dev/shm is not the MetaServer's).
        """
        version, shard = str(args["version"]), f"rank{self.rank}"
        with tracing.span("weights.serialize"):
            # only what this rank holds (its DTensor pieces; its share of replicated rows): no collective, no
            # gather, each piece named by its HF parameter and slice
            uploaders = int(args.get("uploaders") or self.world_size)  # weights.uploaders: each 1/N of the rows
            part, where = own_pieces(self.model, self.rank, uploaders, self.wire_dtype)
            fresh_allocation(self.run_dir, self.device, sum(t.numel() * t.element_size() for t in part.values()),
                             "the weights upload buffer")
            path, body, ipc = "", None, None
            if args.get("transport") == "cuda_ipc":
                flat, header = cuda_ipc.pack(part, {"checksum": "none", PIECES: json.dumps(where)})
                self._ipc_buffers[version] = flat  # until the MetaServer has evicted the version
                while len(self._ipc_buffers) > max(1, int(args.get("keep", 2))):
                    self._ipc_buffers.pop(next(iter(self._ipc_buffers)))
                ipc = {"header": header, "handles": cuda_ipc.share(flat, int(args.get("consumers", 1)))}
                size = flat.numel()
            elif args.get("shm_dir") and os.path.isdir(args["shm_dir"]):
                path = os.path.join(args["shm_dir"], f"v{version}-{shard}.safetensors")
                size = write_shard(part, path, self.cfg.weights.checksum, where)
            else:
                body = encode_shard(part, self.cfg.weights.checksum, where)
                size = len(body)
        t0 = time.perf_counter()

        loop, client = _metaserver_client(self, args["metaserver_url"])

        async def put() -> None:
            await afault_point("weights_update.upload", peer="metaserver-0")
            await push_shard(client, version, shard, body, float(args.get("timeout_s", 600)), path=path, ipc=ipc)

        try:
            loop.run_as_caller(put())
        except BaseException:
            if path and os.path.exists(path):
                os.unlink(path)  # never handed over: the MetaServer does not own it
            raise
        return {"rank": self.rank, "tensors": len(part), "bytes": size, "seconds": time.perf_counter() - t0}

    def weights_group(self, args: dict, tensors: dict) -> dict:
        """distributed mode, on train rank 0 (the group's rank 0, the source): action 'open' starts the group's
        rendezvous store on this host and returns its address and port with the tensors the broadcast sends (names,
        wire dtype, shapes, in order); 'join' joins the group (blocks until every rollout server has joined too);
        'destroy' leaves it."""
        action = args.get("action")
        if action == "destroy":
            self._weights_group = self._weights_store = None
            return {"ok": True}
        if action == "open":
            self._weights_group = None
            self._weights_store = wg.open_store(DEFAULT_HOST, float(args.get("timeout_s", 300)))
            return {"master_address": DEFAULT_HOST, "master_port": self._weights_store.port,
                    "tensors": wg.describe(self.model.named_parameters(), self.wire_dtype)}
        if action == "join":
            self._weights_backend, self._weights_buffers = str(args.get("backend", "gloo")), wg.Buffers()
            with tracing.span("weights.group_join", world_size=int(args["world_size"])):
                self._weights_group = wg.join(DEFAULT_HOST, self._weights_store.port, 0, int(args["world_size"]),
                                              self._weights_backend, float(args.get("timeout_s", 300)),
                                              str(args.get("group_name", wg.GROUP)), store=self._weights_store,
                                              host=DEFAULT_HOST)
            return {"ok": True}
        raise BadRequest(f"weights_group action {action!r}: valid: open, join, destroy")

    def broadcast_weights(self, args: dict, tensors: dict) -> dict:
        """distributed mode: every bucket (args['buckets']: lists of names) packed into one flat buffer and broadcast
        from this rank (group rank 0) to every rollout server. In a sharded layout every train rank is called: each
        parameter is gathered (every rank taking part) and rank 0 sends it; the others only help gather."""
        state = Gathered(self.model, self.wire_dtype)
        sent, t0 = 0, time.perf_counter()
        for names in args["buckets"]:
            part = state.only(names) if self.layout.sharded else {n: state[n] for n in names}
            if self.rank != 0:
                continue
            if self._weights_group is None:
                raise RuntimeError("train-0: no weights update group (weights_group open and join first)")
            on = local(next(self.model.parameters())).device if self._weights_backend == "nccl" else "cpu"
            buffer = wg.pack([part[n] for n in names], on, self._weights_buffers)
            fault_point("weights_update.broadcast", peer=str(args.get("group_name", wg.GROUP)))
            with self.dp.inside(f"broadcast(weights, {len(names)} tensors)"), \
                    tracing.span("weights.broadcast", tensors=len(names), bytes=buffer.numel()):
                wg.broadcast(self._weights_group, buffer)
            sent += buffer.numel()
        return {"rank": self.rank, "bytes": sent, "seconds": time.perf_counter() - t0}

    def save_weights_dir(self, args: dict, tensors: dict) -> dict:
        """Disk mode: rank `writer` (0 unless the weights fallback picks a rank that is free) writes an HF
        safetensors directory the rollout servers load."""
        fault_point("weights_update.save_dir")
        writer = self.rank == int(args.get("writer", 0))
        state = None
        if self.layout.sharded:  # gathered parameter by parameter, every rank taking part; the writer keeps them
            gathered = Gathered(self.model)
            state = gathered.only(gathered if writer else ())
        if writer:
            path = args["path"]
            tmp = path + ".tmp"
            save_state_dir(self.model, tmp, self.tokenizer, tensors=state)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        return {"rank": self.rank, "path": args["path"]}

    def save(self, args: dict, tensors: dict) -> dict:
        """Write this rank's checkpoint files into args['directory'] (staging or the slot itself).

        background: snapshot now, write on this rank's writer thread, reply at once (files: {}); the writer
        is a daemon thread, so a write stuck in an IO hang never blocks the next step's calls.
        """
        engine = self._engine()
        t0 = time.perf_counter()
        self.own_files.remove(args.get("remove"))  # its files of the slots the last saves replaced
        if args.get("background"):
            items = ckpt.snapshot_rank_files(self.rank, self.model, engine.optimizer, copy=True,
                                            sharded=self.layout.sharded)
            self.own_files.wrote(args.get("slot"), (name for name, _ in items))
            self._writes.put((args["directory"], items, bool(args.get("fsync", True)), tracing.current_step()))
            self._start_writer()
            return {"rank": self.rank, "files": {}, "pending": self._writes.qsize(), "seconds": time.perf_counter() - t0}
        if args.get("stall_s"):
            items = ckpt.snapshot_rank_files(self.rank, self.model, engine.optimizer, sharded=self.layout.sharded)
            files = ckpt.write_bounded(args["directory"], items, bool(args.get("fsync", True)), float(args["stall_s"]),
                                       f"train-{self.rank}")
        else:
            files = ckpt.write_rank_files(args["directory"], self.rank, self.model, engine.optimizer,
                                          sharded=self.layout.sharded,
                                          fsync=bool(args.get("fsync", True)))
        self.own_files.wrote(args.get("slot"), files)
        return {"rank": self.rank, "files": files, "seconds": time.perf_counter() - t0}

    def _start_writer(self) -> None:
        if self._writer is not None:
            return
        ctx = contextvars.copy_context()

        def run() -> None:
            while True:
                directory, items, fsync, step = self._writes.get()
                log.info("train-%d: background checkpoint write to %s started (step %d)", self.rank, directory, step)
                try:
                    with tracing.at_step(step), tracing.span("checkpoint.background_write", directory=directory):
                        ckpt.write_items(directory, items, fsync)
                    log.info("train-%d: background checkpoint write to %s done", self.rank, directory)
                except Exception as exc:  # nobody waits for this thread: the log is the only trace
                    log.error("train-%d: background checkpoint write to %s failed: %s: %s", self.rank, directory,
                              type(exc).__name__, exc)

        self._writer = threading.Thread(target=ctx.run, args=(run,), name=f"ckpt-writer-{self.rank}", daemon=True)
        self._writer.start()

    def load(self, args: dict, tensors: dict) -> dict:
        engine = self._engine()
        fault_point("checkpoint.load", path=args["path"])
        ckpt.load_rank_files(args["path"], self.rank, self.model, engine.optimizer)
        self.sync_hf(into_policy=True)  # train.engine megatron: the loaded HF weights into the GPTModel
        engine.optimizer_steps = int(args.get("optimizer_steps", engine.optimizer_steps))
        return {"rank": self.rank, "loaded": args["path"]}
