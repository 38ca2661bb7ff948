"""RolloutServices: what GRPO starts besides the train ranks, and stops again, whatever happened.

    MetaServer       in this process (HTTP on its own thread): relays weight shards, train → rollout
    Scheduler        its own process: starts the rollout server jobs, stops them when our lease lapses
    RolloutServer r  one job each (sglang-compatible HTTP API), colocated with train rank r or not
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from rlhf.config import Config
from rlhf.devices import rollout_device
from rlhf.procs import wait_for_file
from rlhf.runtime.client import Client, LoopThread
from rlhf.runtime.metaserver import MetaServer
from rlhf.runtime.scheduler import SchedulerClient

log = logging.getLogger("rlhf.controller")


class RolloutServices:
    def __init__(self, cfg: Config, run_dir: str, token: str, loop: LoopThread, train_ranks: int) -> None:
        self.cfg, self.run_dir, self.token, self.loop, self.train_ranks = cfg, run_dir, token, loop, train_ranks
        self.metaserver: MetaServer | None = None
        self.metaserver_url = ""
        self.scheduler: SchedulerClient | None = None
        self.rollout: list[Client] = []

    @property
    def shm_dir(self) -> str:
        return self.metaserver.shm_dir if self.metaserver else ""

    def start(self) -> None:
        cfg = self.cfg
        self.metaserver = MetaServer(self.token, cfg.weights.max_versions, cfg.weights.max_bytes, cfg.resilience,
                                     cfg.weights.transport)
        self.metaserver_url = self.metaserver.start()
        self.scheduler = SchedulerClient(self.run_dir, self.token, cfg.runtime.scheduler_lease_s,
                                         cfg.runtime.startup_timeout_s, self.loop)
        threads = str(max(1, (os.cpu_count() or 2) // cfg.rollout.servers))
        ready_files = []
        for r in range(cfg.rollout.servers):
            ready = os.path.join(self.run_dir, f"rollout-{r}.url")
            if os.path.exists(ready):
                os.remove(ready)
            cmd = [sys.executable, "-m", "rlhf.runtime.rollout_server", "--run-dir", self.run_dir, "--rank", str(r),
                   "--config", os.path.join(self.run_dir, "config.yaml"), "--ready-file", ready]
            if cfg.runtime.colocate:
                cmd.append("--colocate")
            cmd += ["--device", str(rollout_device(cfg.model.device, r, self.train_ranks, cfg.runtime.colocate))]
            env = {"RLHF_TOKEN": self.token, "RLHF_ROLLOUT_THREADS": threads, "PYTHONPATH": _pythonpath()}
            self.scheduler.submit(f"rollout-{r}", "rollout", cmd, env,
                                  colocate_with=f"train-{r}" if cfg.runtime.colocate else "")
            ready_files.append(ready)
        urls = [wait_for_file(f, cfg.runtime.startup_timeout_s) for f in ready_files]
        self.rollout = [Client(u, self.token, cfg.runtime.rollout_timeout_s, peer=f"rollout-{r}",
                               retries=cfg.resilience.retry_idempotent)
                        for r, u in enumerate(urls)]
        log.info("services up: metaserver %s, scheduler %s, %d rollout servers, %d train ranks",
                 self.metaserver_url, self.scheduler.url, len(urls), self.train_ranks)

    def stop(self, level: int = logging.ERROR) -> None:
        """Every job through the scheduler (each error logged at `level` as it happens), then the MetaServer."""
        if self.scheduler is not None:
            scheduler = self.scheduler

            async def stop_all() -> list[Any]:
                jobs = (await scheduler.client.call("/jobs", method="GET", stage="cleanup"))[0]
                return await asyncio.gather(*[scheduler.stop_job(j["name"], self.cfg.runtime.cleanup_timeout_s)
                                              for j in jobs], return_exceptions=True)

            try:
                for result in self.loop.run(stop_all()):
                    if isinstance(result, BaseException):
                        log.log(level, "cleanup: stop job: %s: %s", type(result).__name__, result)
            except (RuntimeError, OSError, TimeoutError) as exc:
                log.log(level, "cleanup: %s: %s", type(exc).__name__, exc)
            scheduler.close()
        if self.metaserver is not None:
            self.metaserver.stop()

    def clients(self) -> list[Client]:
        return self.rollout + ([self.scheduler.client] if self.scheduler else [])


def _pythonpath() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
