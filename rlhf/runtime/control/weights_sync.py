"""WeightSync: the weights_update stage — the train ranks' weights to every rollout server as one version.

    meta  every rank uploads its shard to the MetaServer while every rollout server waits for the
          version's manifest and pulls (shared memory on this host, HTTP otherwise); both sides at once
    disk  rank 0 writes an HF directory (weights/latest, tokenizer included) that every rollout server
          loads; with the policy's private_weights_dir off, native servers load the newest parity
          checkpoint instead, written in place (the seeds' system); sglang servers always load the
          HF directory (a checkpoint slot is not one)

`verify` then asks every rollout server for its weight_version and checksum (weights.verify).
Fault points: weights_update.upload / .update / .save_dir (on the workers and servers).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rlhf.config import Config
from rlhf.runtime.client import Client, LoopThread
from rlhf.runtime.control.services import RolloutServices
from rlhf.runtime.control.workers import WorkerGroup

OUTER_MARGIN_S = 10.0  # a call that wraps a server-side wait gets this much longer than the wait


class WeightsMismatch(RuntimeError):
    """A rollout server's weights or version differ from the trainer's after a weights update."""


class WeightSync:
    def __init__(self, cfg: Config, run_dir: str, token: str, loop: LoopThread, workers: WorkerGroup,
                 services: RolloutServices) -> None:
        self.cfg, self.run_dir, self.token, self.loop = cfg, run_dir, token, loop
        self.workers, self.services = workers, services
        self.latest_slot = ""  # the newest parity checkpoint (disk mode reads it without private_weights_dir)

    def update(self, version: str, step: int) -> dict[str, float]:
        """Push the train ranks' weights to every rollout server as `version`; upload and update seconds."""
        cfg = self.cfg
        if cfg.weights.mode == "meta":
            return self.loop.run(self._update_meta(version, step))
        t0 = time.perf_counter()
        if not cfg.resilience.private_weights_dir and self.latest_slot and cfg.rollout.backend == "native":
            path = os.path.join(self.run_dir, "checkpoints", self.latest_slot)
        else:
            path = os.path.join(self.run_dir, "weights", "latest")
            self.workers.call("save_weights_dir", {"path": path}, step=step, stage="weights_update")
        upload = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.loop.gather(*[
            c.call("/update_weights_from_disk", {"model_path": path, "weight_version": version},
                   timeout_s=cfg.weights.update_timeout_s, stage="weights_update", step=step)
            for c in self.services.rollout])
        return {"upload_s_max": upload, "update_s_max": time.perf_counter() - t1}

    async def _update_meta(self, version: str, step: int) -> dict[str, float]:
        cfg, url = self.cfg, self.services.metaserver_url
        meta = Client(url, self.token, peer="metaserver-0", retries=self.cfg.resilience.retry_idempotent)
        try:
            await meta.call("/versions", {"version": version, "shards": len(self.workers)}, stage="weights_update",
                            step=step)
        finally:
            await meta.close()

        async def timed(coro: Any) -> float:
            t = time.perf_counter()
            await coro
            return time.perf_counter() - t

        uploads = [timed(c.call("/upload_weights", {"metaserver_url": url, "version": version,
                                                    "timeout_s": cfg.weights.upload_timeout_s,
                                                    "shm_dir": self.services.shm_dir},
                                timeout_s=cfg.weights.upload_timeout_s, stage="weights_update", step=step))
                   for c in self.workers.clients]
        updates = [timed(c.call("/update_weights_from_meta",
                                {"metaserver_url": url, "weight_version": version,
                                 "wait_s": cfg.weights.update_timeout_s, "timeout_s": cfg.weights.update_timeout_s},
                                # the server's own wait ends first, so its error (not our timeout) comes back
                                timeout_s=cfg.weights.update_timeout_s + OUTER_MARGIN_S, stage="weights_update",
                                step=step))
                   for c in self.services.rollout]
        times = await asyncio.gather(*uploads, *updates)  # upload and update in parallel; wait for both sides
        n = len(uploads)
        return {"upload_s_max": max(times[:n]), "update_s_max": max(times[n:]) if times[n:] else 0.0}

    def verify(self, version: str, step: int) -> int:
        """Every rollout server must report `version` and the trainer's checksum; returns 1 or raises.
        sglang servers have no checksum route: their /model_info weight_version is checked alone."""
        if self.cfg.rollout.backend == "sglang":
            infos = self.loop.gather(*[c.call("/model_info", method="GET", stage="weights_update", step=step)
                                       for c in self.services.rollout])
            wrong = [f"rollout-{r}: version {info.get('weight_version')!r}" for r, (info, _) in enumerate(infos)
                     if str(info.get("weight_version")) != version]
            if wrong:
                raise WeightsMismatch(f"step {step}: trainer has version {version}; " + "; ".join(wrong))
            return 1
        trainer = self.workers.call("weights_checksum", step=step, stage="weights_update")[0][0]
        replies = self.loop.gather(*[c.call("/weights_checksum", method="GET", stage="weights_update", step=step)
                                     for c in self.services.rollout])
        wrong = [f"rollout-{r}: version {rep['weight_version']} checksum {rep['checksum'][:12]}"
                 for r, (rep, _) in enumerate(replies)
                 if rep["weight_version"] != version or rep["checksum"] != trainer["checksum"]]
        if wrong:
            raise WeightsMismatch(f"step {step}: trainer has version {version} checksum {trainer['checksum'][:12]}; "
                                  + "; ".join(wrong))
        return 1
