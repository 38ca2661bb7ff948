"""WeightSync: the weights_update stage — the train ranks' weights to every rollout server as one version.

    meta  every rank uploads its shard to the MetaServer while every rollout server waits for the
          version's manifest and pulls (shared memory on this host, HTTP otherwise); both sides at once
    distributed  train rank 0 and every rollout server form one process group (sglang's /init_weights_update_group;
          formed again when a server is started again or migrated) and rank 0 broadcasts the weights bucket by
          bucket while every server receives them (/update_weights_from_distributed, a flat buffer a bucket); the
          servers may be on any host, and real sglang servers take part the same way
    disk  rank 0 writes an HF directory (weights/latest, tokenizer included) that every rollout server
          loads; with the policy's private_weights_dir off, native servers load the newest parity
          checkpoint instead, written in place (the seeds' system); sglang servers always load the
          HF directory (a checkpoint slot is not one)

`verify` then asks every rollout server for its weight_version and checksum (weights.verify).
Fault points: weights_update.upload / .update / .save_dir / .broadcast (on the workers and servers).

With the policy's weights_fallback, a meta update that fails (an upload, the MetaServer, a pull) is done
again through disk by a train rank that is free (every rank holds the whole model); the stuck upload, if
any, ends on its own timeout while the step goes on. In a sharded layout every rank takes part in the write (the
writer gathers the pieces), so the fallback waits for every upload to end first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from rlhf import tracing
from rlhf.config import Config
from rlhf.control.broadcast import OUTER_MARGIN_S, BroadcastUpdate
from rlhf.control.fleet import RolloutServices
from rlhf.control.workers import WorkerGroup
from rlhf.transport.client import LoopThread

log = logging.getLogger("rlhf.controller")

SPOT = 4  # parameters a spot check of the rollout servers' weights reads (WeightSync.spot_check)


def _differing(a: list, b: list) -> int:
    """How many entries of two (nested) lists of floats differ (a length or shape that differs: all of them)."""
    flat_a, flat_b = _flat(a), _flat(b)
    if len(flat_a) != len(flat_b):
        return max(len(flat_a), len(flat_b))
    return sum(x != y for x, y in zip(flat_a, flat_b))


def _flat(x: Any) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


class WeightsMismatch(RuntimeError):
    """A rollout server's weights or version differ from the trainer's after a weights update."""


class WeightSync(BroadcastUpdate):
    columns = ("upload_s_max", "update_s_max", "weights_verified", "weights_fallback", "weights_drift",
               "weights_stale")  # steps.csv
    def __init__(self, cfg: Config, run_dir: str, token: str, loop: LoopThread, workers: WorkerGroup,
                 services: RolloutServices) -> None:
        self.cfg, self.run_dir, self.token, self.loop = cfg, run_dir, token, loop
        self.workers, self.services = workers, services
        self.latest_slot = ""  # the newest parity checkpoint (disk mode reads it without private_weights_dir)
        self.source = 0  # the train rank whose weights verify compares with (the fallback's writer)
        self.fell_back = 0  # 1 when this step's meta update was done through disk (steps.csv weights_fallback)
        self.group: dict | None = None  # distributed mode: the weights update group's members and buckets
        self.held = ("", "")  # the version the rollout servers hold and where it is still kept (catch_up)

    def update(self, version: str, step: int) -> dict[str, float]:
        """Push the train ranks' weights to every rollout server as `version`; upload and update seconds."""
        cfg = self.cfg
        self.source, self.fell_back, self.held = 0, 0, ("", "")
        if cfg.weights.mode == "meta":
            times = self.loop.run(self._update_meta(version, step))
            self.held = (version, "" if self.fell_back else "meta")
            return times
        if cfg.weights.mode == "distributed":
            return self.loop.run(self._update_distributed(version, step))
        t0 = time.perf_counter()
        if not cfg.resilience.private_weights_dir and self.latest_slot and cfg.rollout.backend == "native":
            path, kept = os.path.join(self.run_dir, "checkpoints", self.latest_slot), ""  # a slot is rewritten
        else:
            path = kept = os.path.join(self.run_dir, "weights", "latest")
            self.workers.call("save_weights_dir", {"path": path}, step=step, stage="weights_update")
        upload = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.loop.gather(*self._load_from_disk(path, version, step))
        self.held = (version, kept)
        return {"upload_s_max": upload, "update_s_max": time.perf_counter() - t1}

    def after_restart(self, before: list[Any], step: int) -> None:
        """Weights for the rollout servers started again after the last update (an evaluation's loss; `before`: the
        servers' clients then): the version the others hold, from where it is still kept (meta: the MetaServer's
        copy; disk: the weights directory), not the trainer's weights, which have moved on since. Where it is not
        kept (the update fell back to disk, a checkpoint slot, distributed mode), every server gets the trainer's
        weights as they are now; a WARNING says which."""
        new = [r for r, c in enumerate(self.services.rollout) if r >= len(before) or c is not before[r]]
        version, where = self.held
        if new and version and where:
            self.loop.gather(*(self._pull_meta(r, version, step) for r in new) if where == "meta" else
                             self._load_from_disk(where, version, step, new))
            log.warning("step %d: rollout-%s loaded weights version %s again, the version the servers held", step,
                        ",".join(map(str, new)), version)
            return
        log.warning("step %d: weights version %s is not kept where a new server could load it; every rollout server "
                    "gets the trainer's weights as they are now", step, version or step)
        self.update(f"{step}-again", step)

    def _pull_meta(self, r: int, version: str, step: int) -> Any:
        """Rollout server r's pull of `version` from the MetaServer; the server's own wait ends first, so its error
        (not our timeout) comes back."""
        wait = self.cfg.weights.update_timeout_s
        return self.services.rollout[r].call(
            "/update_weights_from_meta", {"metaserver_url": self.services.metaserver_url, "weight_version": version,
                                          "consumer": r, "wait_s": wait, "timeout_s": wait},
            timeout_s=wait + OUTER_MARGIN_S, stage="weights_update", step=step)

    def _load_from_disk(self, path: str, version: str, step: int, servers: list[int] | None = None) -> list[Any]:
        return [c.call("/update_weights_from_disk", {"model_path": path, "weight_version": version},
                       timeout_s=self.cfg.weights.update_timeout_s, stage="weights_update", step=step)
                for r, c in enumerate(self.services.rollout) if servers is None or r in servers]

    async def _update_meta(self, version: str, step: int) -> dict[str, float]:
        cfg, url = self.cfg, self.services.metaserver_url
        uploaders = self.uploaders()
        try:  # in this process: no round trip
            await self.services.metaserver.open_version(version, uploaders, step)
        except Exception as exc:  # noqa: BLE001 — re-raised unless the policy falls back to disk
            if not cfg.resilience.weights_fallback:
                raise
            return await self._fallback(version, step, [], exc)

        async def timed(coro: Any) -> float:
            t = time.perf_counter()
            await coro
            return time.perf_counter() - t

        uploads = [asyncio.ensure_future(timed(call)) for call in self.workers.start(
            "upload_weights", {"metaserver_url": url, "version": version, "timeout_s": cfg.weights.upload_timeout_s,
                               "shm_dir": self.services.shm_dir, "transport": cfg.weights.transport,
                               "consumers": len(self.services.rollout), "keep": cfg.weights.max_versions,
                               "uploaders": uploaders},
            timeout_s=cfg.weights.upload_timeout_s, stage="weights_update", step=step,
            ranks=list(range(uploaders)) if uploaders < len(self.workers) else None)]
        updates = [asyncio.ensure_future(timed(self._pull_meta(r, version, step)))
                   for r in range(len(self.services.rollout))]
        if not cfg.resilience.weights_fallback:
            times = await asyncio.gather(*uploads, *updates)  # upload and update in parallel; wait for both sides
        else:
            await asyncio.wait(uploads + updates, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in uploads + updates if t.done() and t.exception() is not None]
            if failed:
                for t in updates:
                    t.cancel()  # the servers' own waits end within wait_s; the disk load replaces what they wait for
                return await self._fallback(version, step, uploads, failed[0])
            times = [t.result() for t in uploads + updates]
        n = len(uploads)
        return {"upload_s_max": max(times[:n]), "update_s_max": max(times[n:]) if times[n:] else 0.0}

    def uploaders(self) -> int:
        """The train ranks that upload a version (weights.uploaders in a replicated layout; else every rank)."""
        n, wanted = len(self.workers), self.cfg.weights.uploaders
        return min(n, wanted) if wanted and not self.workers.layout.sharded else n

    async def _fallback(self, version: str, step: int, uploads: list[asyncio.Future], exc: BaseException
                        ) -> dict[str, float]:
        """weights_fallback: `version` through disk, written by a train rank whose upload has ended (a rank still
        stuck in its upload would serve the write only after it); the first error is raised if disk fails too."""
        t0 = time.perf_counter()
        sharded = self.workers.layout.sharded
        if uploads and sharded:  # every rank gathers its pieces for the writer: all of them must be free
            await asyncio.wait(uploads)  # bounded by the upload timeout
        elif uploads and not any(t.done() for t in uploads):
            await asyncio.wait(uploads, return_when=asyncio.FIRST_COMPLETED)  # bounded by the upload timeout
        writer = next((r for r, t in enumerate(uploads) if t.done()), 0)
        still = [f"train-{r}" for r, t in enumerate(uploads) if not t.done()]  # the MetaServer waits for their shards
        for t in uploads:  # a stuck upload ends on its own timeout; its error is evidence in its rank's log
            t.add_done_callback(lambda f: f.cancelled() or f.exception())
        what = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("step %d: weights version %s through the MetaServer failed (%s)%s; falling back to disk, "
                    "written by train-%d", step, version, what,
                    f"; {', '.join(still)}'s upload had not ended (its shard not at the MetaServer)" if still else "",
                    writer)
        path = os.path.join(self.run_dir, "weights", "latest")
        with tracing.span("weights.fallback", stage="weights_update", step=step,
                          **{"rlhf.writer": f"train-{writer}", "rlhf.error": what}):
            try:
                await self.workers.acall("save_weights_dir", {"path": path, "writer": writer}, stage="weights_update",
                                         step=step, ranks=None if sharded else [writer])
                upload = time.perf_counter() - t0
                t1 = time.perf_counter()
                await asyncio.gather(*self._load_from_disk(path, version, step))
            except Exception as disk_exc:  # noqa: BLE001 — the meta failure came first: it is the run's error
                log.warning("step %d: the disk fallback failed too (%s: %s)", step, type(disk_exc).__name__,
                            str(disk_exc)[:300])
                raise exc from disk_exc
        self.source, self.fell_back = writer, 1
        return {"upload_s_max": upload, "update_s_max": time.perf_counter() - t1}

    def drift(self, step: int, figures: dict[str, Any]) -> int | None:
        """resilience.detect_weights_drift: when the step's rollout_train_logprob_diff passes weights.drift_threshold
        under the same weights version (sync, or async at K = 0), every rollout server's checksum against the
        trainer's names the servers whose weights differ (a WARNING); 1 then, 0 if not, None when not checked."""
        cfg = self.cfg
        diff, top = figures.get("rollout_train_logprob_diff"), figures.get("rollout_train_logprob_diff_max")
        threshold = cfg.drift_threshold
        if not cfg.resilience.detect_weights_drift or not threshold or cfg.rollout.overlaps or diff is None:
            return None
        if diff <= threshold:
            return 0
        try:
            self.verify(str(step), step)
            why = ("every rollout server's weights checksum equals the trainer's: not the weights (the rollout's "
                   "numerics or sampling settings)")
        except WeightsMismatch as exc:
            why = f"weights differ: {exc}"
        log.warning("step %d: rollout and train logprobs differ by %.3g on average (max %.3g) under the same weights "
                    "version %d (weights.drift_threshold %g): %s; the next weights update replaces them (stage "
                    "weights_update)", step, diff, top or 0.0, step, threshold, why)
        return 1

    def spot_check(self, version: str, step: int) -> int | None:
        """resilience.detect_weights_drift with weights.verify off (a real sglang server has no checksum route):
        after the update, every rollout server's /get_weights_by_name (sglang's route) of SPOT parameters (the first,
        the last and some drawn by the step) against the trainer's, cast as they were sent. A server whose values
        differ while it reports the version holds silently stale weights: a WARNING naming it. Returns how many
        servers did (steps.csv weights_stale), None when not checked (a simulated world holds no weights; a sharded
        trainer's rank holds only its pieces)."""
        cfg = self.cfg
        if not cfg.resilience.detect_weights_drift or cfg.weights.verify or cfg.sim.enabled \
                or self.workers.layout.sharded:
            return None
        [(picked, _)] = self.workers.call("get_weights_by_name", {"spot": SPOT, "seed": step, "truncate_size": 64},
                                          stage="weights_update", step=step, ranks=[self.source])
        calls = [c.call("/get_weights_by_name", {"name": p["name"], "truncate_size": 64}, stage="weights_update",
                        step=step) for c in self.services.rollout for p in picked]
        replies = self.loop.gather(*calls)
        stale = 0
        for r in range(len(self.services.rollout)):
            mine = [reply for reply, _ in replies[r * len(picked):(r + 1) * len(picked)]]
            differ = [(p["name"], _differing(p["values"], v)) for p, v in zip(picked, mine)]
            differ = [(name, n) for name, n in differ if n]
            if differ:
                stale += 1
                name, n = differ[0]
                log.warning("step %d: rollout-%d's weights are not the trainer's version %s, which it reports: %d of "
                            "%d spot-checked parameters differ (%s: %d of its first values): silently stale weights "
                            "(resilience.detect_weights_drift, sglang's /get_weights_by_name); the next weights "
                            "update sends them again", step, r, version, len(differ), len(picked), name, n)
        return stale

    def _verify_pieces(self, version: str, step: int) -> int:
        """A sharded layout, piece by piece: every train rank gives a digest of each piece it holds (nothing is
        gathered), every rollout server a digest of the same slices of its model; each must match."""
        ranks = self.workers.call("weights_checksum", {"pieces": True}, stage="weights_update", step=step)
        owner: dict[str, tuple[int, str]] = {}
        where: dict[str, dict] = {}
        for r, (reply, _) in enumerate(ranks):
            for key, info in reply["pieces"].items():
                owner[key] = (r, info.pop("digest"))
                where[key] = info
        replies = self.loop.gather(*[c.call("/weights_checksum", {"pieces": where}, stage="weights_update", step=step)
                                     for c in self.services.rollout])
        wrong = []
        for i, (rep, _) in enumerate(replies):
            differ = [key for key, (_, d) in owner.items() if rep["pieces"].get(key) != d]
            if rep["weight_version"] != version or differ:
                first = f" (first: {differ[0]} from train-{owner[differ[0]][0]})" if differ else ""
                wrong.append(f"rollout-{i}: version {rep['weight_version']}, {len(differ)} of {len(owner)} pieces "
                             f"differ{first}")
        if wrong:
            raise WeightsMismatch(f"step {step}: trainer has version {version}; " + "; ".join(wrong))
        return 1

    async def _rollout_checksums(self, step: int) -> list[tuple[Any, dict]]:
        """Every rollout server's weights checksum and version."""
        return list(await asyncio.gather(*[c.call("/weights_checksum", method="GET", stage="weights_update", step=step)
                                           for c in self.services.rollout]))

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
        if self.workers.layout.sharded:
            return self._verify_pieces(version, step)
        # every rank holds the same weights: one rank's checksum (the fallback writer's, when a rank was stuck)
        [(trainer, _)], replies = self.loop.gather(
            self.workers.acall("weights_checksum", stage="weights_update", step=step, ranks=[self.source]),
            self._rollout_checksums(step))
        wrong = [f"rollout-{r}: version {rep['weight_version']} checksum {rep['checksum'][:12]}"
                 for r, (rep, _) in enumerate(replies)
                 if rep["weight_version"] != version or rep["checksum"] != trainer["checksum"]]
        if wrong:
            raise WeightsMismatch(f"step {step}: trainer has version {version} checksum {trainer['checksum'][:12]}; "
                                  + "; ".join(wrong))
        return 1
