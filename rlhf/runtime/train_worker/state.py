"""What a train rank's weights and checkpoints do: its share of the weights to the MetaServer (meta mode), the HF
directory (disk mode), the weights checksum, checkpoint files (written now, bounded, or on a writer thread) and
their load on resume."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import shutil
import threading
import time

from rlhf import tracing
from rlhf.faults import afault_point, fault_point
from rlhf.runtime import checkpoint as ckpt
from rlhf.runtime.client import Client
from rlhf.runtime.colocation import fresh_allocation
from rlhf.runtime.metaserver import push_shard
from rlhf.train.parallel import Gathered
from rlhf.weights import checksum, encode_shard, save_state_dir, write_shard

log = logging.getLogger("rlhf.train_worker")


def shard_names(names: list[str], rank: int, world_size: int) -> list[str]:
    """Which parameters rank `rank` uploads: every world_size-th name (a stand-in for TP/PP shards)."""
    return sorted(names)[rank::world_size]


class WeightsAndCheckpoints:
    """A train rank's weights and checkpoint endpoints (a part of TrainWorker)."""

    def weights_checksum(self, args: dict, tensors: dict) -> dict:
        """The checksum of the whole model as the rollout servers get it. In a sharded layout every rank is called (the
        pieces are gathered one parameter at a time); args['digest'] false: this rank only takes part."""
        state = Gathered(self.model, self.wire_dtype)
        if not args.get("digest", True):
            state.only(())
            return {"checksum": ""}
        return {"checksum": checksum(state, self.cfg.weights.verify_checksum)}

    def upload_weights(self, args: dict, tensors: dict) -> dict:
        """Send this rank's shard of the weights to the MetaServer as version args['version'].

        args['shm_dir'] set (same host): write the shard as a file there and PUT its path; else PUT the bytes.
        """
        version, shard = str(args["version"]), f"rank{self.rank}"
        with tracing.span("weights.serialize"):
            state = Gathered(self.model, self.wire_dtype)  # sharded layouts: gathered, every rank taking part
            names = shard_names(list(state), self.rank, self.world_size)
            part = state.only(names)  # this rank's share, never the whole model
            fresh_allocation(self.run_dir, self.device, sum(t.numel() * t.element_size() for t in part.values()),
                             "the weights upload buffer")
            path, body = "", None
            if args.get("shm_dir"):
                path = os.path.join(args["shm_dir"], f"v{version}-{shard}.safetensors")
                size = write_shard(part, path, self.cfg.weights.checksum)
            else:
                body = encode_shard(part, self.cfg.weights.checksum)
                size = len(body)
        t0 = time.perf_counter()

        async def put() -> None:
            client = Client(args["metaserver_url"], self.token, peer="metaserver-0",
                            retries=self.cfg.resilience.retry_idempotent)
            try:
                await afault_point("weights_update.upload", peer="metaserver-0")
                await push_shard(client, version, shard, body, float(args.get("timeout_s", 600)), path=path)
            finally:
                await client.close()

        try:
            asyncio.run(put())
        except BaseException:
            if path and os.path.exists(path):
                os.unlink(path)  # never handed over: the MetaServer does not own it
            raise
        return {"rank": self.rank, "tensors": len(names), "bytes": size, "seconds": time.perf_counter() - t0}

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
        if args.get("background"):
            items = ckpt.snapshot_rank_files(self.rank, self.model, engine.optimizer, copy=True,
                                            sharded=self.layout.sharded)
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
        engine.optimizer_steps = int(args.get("optimizer_steps", engine.optimizer_steps))
        return {"rank": self.rank, "loaded": args["path"]}
