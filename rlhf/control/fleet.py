"""RolloutServices: what GRPO starts besides the train ranks, and stops again, whatever happened.

    MetaServer       in this process (HTTP on its own thread): relays weight shards, train → rollout
    Scheduler        its own process: starts the rollout server jobs, stops them when our lease lapses
    RolloutServer r  one job each (sglang-compatible HTTP API), colocated with train rank r or not;
                     with rollout.backend sglang, `python -m <sglang.launcher> --config FILE` instead
                     (sglang's launch flags in a 0600 YAML file: the API key never shows in `ps`)
    RewardServer     with reward_model.path: job reward-0 on this node (rlhf.services.reward_server)
    EnvServer        with env.path: job env-0 on this node (rlhf.services.env_server), the episodes' environments
                     (either one started again when it dies, or its scheduler does, with restart_rollout)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from rlhf import exits
from rlhf.config import Config
from rlhf.control.service_jobs import ServiceJobs
from rlhf.control.sglang_jobs import SglangJobs, free_port, pythonpath  # noqa: F401 (free_port: this module's API too)
from rlhf.control.workers import WorkerGroup
from rlhf.devices import rollout_device
from rlhf.errors import HTTPStatusError, RpcConnectionError, RpcTimeout
from rlhf.procs import cpu_share, wait_for_file
from rlhf.services.metaserver import MetaServer
from rlhf.services.scheduler import RemoteScheduler, SchedulerClient
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.fanout import HostRelay, RelayedClient

log = logging.getLogger("rlhf.controller")


class RolloutServices(SglangJobs, ServiceJobs):
    def __init__(self, cfg: Config, run_dir: str, token: str, loop: LoopThread, train_ranks: int,
                 nodes: list[int] | None = None, workers: WorkerGroup | None = None) -> None:
        self.cfg, self.run_dir, self.token, self.loop, self.train_ranks = cfg, run_dir, token, loop, train_ranks
        self.nodes = nodes or [0] * train_ranks  # each train rank's node; rollout server r runs on rank r's
        self.workers = workers  # the train ranks: the first of each other node starts that node's scheduler
        self.metaserver: MetaServer | None = None
        self.metaserver_url = ""
        self.scheduler: SchedulerClient | None = None  # node 0's, the controller's own process
        self.remote: dict[int, RemoteScheduler] = {}  # the other nodes', started by their first train rank
        self.rollout: list[Client] = []
        self.reward: Client | None = None  # the reward server (reward_model.path), else None
        self.env: Client | None = None  # the environment server (env.path), else None
        self.jobs: list[tuple[list[str], dict[str, str], str]] = []  # rollout server r's (command, env, ready file)
        self.job_of: list[str] = []  # rollout server r's scheduler job: rollout-r, or in a simulated world its host's
        self.relays: dict[str, HostRelay] = {}  # a simulated host's agent, by job (sim.fanout)
        self.revive_lock = threading.RLock()  # async: the producer and the train side may both start a service again
        self.starts: dict[str, int] = {}  # how many times env-0 / reward-0 were started again
        self.revivals = 0  # rollout servers started again, all told (they need the step's weights)

    @property
    def shm_dir(self) -> str:
        return self.metaserver.shm_dir if self.metaserver else ""

    def start(self) -> None:
        cfg = self.cfg
        self.metaserver = MetaServer(self.token, cfg.weights.max_versions, cfg.weights.max_bytes, cfg.resilience,
                                     cfg.weights.transport, merge_above=cfg.weights.merge_shards,
                                     checksum=cfg.weights.checksum)
        self.metaserver_url = self.metaserver.start()
        self.scheduler = self._start_scheduler()
        # async GRPO: the rollout servers generate while the train ranks train, so they share the CPUs
        threads = str(cpu_share(cfg.rollout.servers, self.train_ranks if cfg.rollout.overlaps else 0))
        jobs = {"reward-0": self._submit_service("reward-0", "rlhf.services.reward_server", bool(cfg.reward_model.path)),
                "env-0": self._submit_service("env-0", "rlhf.services.env_server", bool(cfg.env.path))}
        if cfg.rollout.backend == "sglang":
            urls = self._start_sglang(threads)
            self.rollout = [Client(u, self.token, cfg.timeouts.rollout_s, peer=f"rollout-{r}",
                                   retries=cfg.resilience.retry_idempotent) for r, u in enumerate(urls)]
            self._connect_services(jobs)
            log.info("services up: metaserver %s, scheduler %s, %d sglang servers (%s)%s, %d train ranks",
                     self.metaserver_url, self.scheduler.url, len(urls), cfg.sglang.launcher,
                     ", reward-0" if self.reward else "", self.train_ranks)
            return
        self._start_node_schedulers()
        ready_files = []
        per_job = cfg.sim.servers_per_process if cfg.sim.enabled else 1
        for r in range(cfg.rollout.servers):
            ready = os.path.join(self.run_dir, f"rollout-{r}.url")
            first = r - r % per_job
            env = {"RLHF_TOKEN": self.token, "RLHF_ROLLOUT_THREADS": threads, "PYTHONPATH": pythonpath()}
            if cfg.sim.enabled:  # a simulated world: one job serves servers first .. first + per_job - 1 (rlhf.sim)
                cmd = [sys.executable, "-m", "rlhf.sim.rollout_servers", "--run-dir", self.run_dir, "--first",
                       str(first), "--count", str(min(per_job, cfg.rollout.servers - first)), "--config",
                       os.path.join(self.run_dir, "config.yaml"), "--ready-dir", self.run_dir,
                       "--ready-file", os.path.join(self.run_dir, f"rollout-{first}.host")]
            else:
                cmd = [sys.executable, "-m", "rlhf.services.rollout_server", "--run-dir", self.run_dir, "--rank",
                       str(r), "--config", os.path.join(self.run_dir, "config.yaml"), "--ready-file", ready]
                if cfg.runtime.colocate:
                    cmd.append("--colocate")
                cmd += ["--device", str(rollout_device(cfg.model.device, r, self.train_ranks, cfg.runtime.colocate))]
            self.jobs.append((cmd, env, ready))
            self.job_of.append(f"rollout-{first}")
            if r == first:
                self._submit(r)
            ready_files.append(ready)
        urls = [self._ready_url(r, f) for r, f in enumerate(ready_files)]
        self.rollout = [self._rollout_client(r, u) for r, u in enumerate(urls)]
        self._connect_services(jobs)
        log.info("services up: metaserver %s, scheduler %s%s, %d rollout servers%s, %d train ranks",
                 self.metaserver_url, self.scheduler.url,
                 "".join(f" (+ {s.name} {s.url})" for s in self.remote.values()), len(urls),
                 f", reward server {self.reward.base_url}" if self.reward else "", self.train_ranks)

    def _ready_url(self, r: int, ready: str) -> str:
        """Rollout server r's URL once its ready file is written; its job ending first (a server that cannot start)
        fails at once, naming where its output is."""
        if self.node_of(r) != 0:  # another node's scheduler owns it: its ready file or the timeout
            return wait_for_file(ready, self.cfg.timeouts.startup_s)
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        while not (os.path.exists(ready) and os.path.getsize(ready) > 0):
            self._still_starting(self.job_of[r], f"rollout-{r}", "its ready file", deadline,
                                 f"{self.run_dir}/logs/{self.job_of[r]}.stdout")
            time.sleep(0.1)  # a poll interval: the condition is the ready file (or the job's end)
        return wait_for_file(ready, 1.0)

    def _start_scheduler(self) -> SchedulerClient:
        cfg = self.cfg
        scheduler = SchedulerClient(self.run_dir, self.token, cfg.timeouts.scheduler_lease_s,
                                    cfg.timeouts.startup_s, self.loop)
        if self._revivable():
            scheduler.death_level = logging.WARNING  # revive() starts another: a death it survives
        return scheduler

    def _revivable(self) -> bool:
        return self.cfg.resilience.restart_rollout and self.cfg.rollout.backend == "native" \
            and not self.cfg.runtime.colocate

    def _scheduler_ended(self) -> bool:
        """Whether the scheduler process has ended (a call that just failed on it gets 2 s for the exit to show)."""
        assert self.scheduler is not None
        try:
            self.scheduler.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _restart_scheduler(self, step: int) -> None:
        dead = self.scheduler
        assert dead is not None
        log.warning("step %d: scheduler-0 (pid %d) is gone (%s) and its rollout servers with it; starting a new "
                    "scheduler (resilience.restart_rollout)", step, dead.proc.pid, exits.describe(dead.proc.returncode))
        dead.close()
        self.scheduler = self._start_scheduler()
        for name in [n for n in ("env-0", "reward-0") if self.service(n) is not None]:  # they went with it too
            log.warning("step %d: %s went with scheduler-0; starting it again on the new scheduler", step, name)
            self.restart_service(name)

    def node_of(self, r: int) -> int:
        """Rollout server r's node: that of train rank r (mod the train ranks), so a colocated pair shares a host."""
        return self.nodes[r % len(self.nodes)]

    def _start_node_schedulers(self) -> None:
        """Multi-node: each other node that runs a rollout server gets a scheduler of its own, started by its first
        train rank (the servers are processes of that host)."""
        cfg = self.cfg
        for node in sorted({self.node_of(r) for r in range(cfg.rollout.servers)} - {0}):
            leader = self.nodes.index(node)
            assert self.workers is not None, "a multi-node run needs the train ranks to start its schedulers"
            [(reply, _)] = self.workers.call("start_scheduler", {
                "node": node, "lease_s": cfg.timeouts.scheduler_lease_s,
                "startup_timeout_s": cfg.timeouts.startup_s}, stage="startup", ranks=[leader])
            self.remote[node] = RemoteScheduler(reply["url"], self.token, reply["name"], self.loop)

    def _scheduler_of(self, r: int) -> Any:
        node = self.node_of(r)
        return self.scheduler if node == 0 else self.remote[node]

    def _rollout_client(self, r: int, url: str) -> Any:
        """Rollout server r's client; in a simulated world with sim.fanout, its calls go through its host's agent
        with those of the host's other servers (rlhf.transport.fanout.HostRelay: one request a route per host)."""
        cfg = self.cfg
        client = Client(url, self.token, cfg.timeouts.rollout_s, peer=f"rollout-{r}",
                        retries=cfg.resilience.retry_idempotent)
        if not (cfg.sim.enabled and cfg.sim.fanout):
            return client
        job = self.job_of[r]
        if job not in self.relays:
            host = json.loads(wait_for_file(self._host_file(job), cfg.timeouts.startup_s))
            self.relays[job] = HostRelay(Client(host["agent"], self.token, cfg.timeouts.rollout_s, peer=job))
        return RelayedClient(client, r, self.relays[job])

    def _host_file(self, job: str) -> str:
        return os.path.join(self.run_dir, f"{job}.host")

    def _submit(self, r: int) -> None:
        """Rollout server r's job (in a simulated world: its host's, every server of it)."""
        assert self.scheduler is not None
        cmd, env, _ = self.jobs[r]
        job = self.job_of[r]
        for s, name in enumerate(self.job_of):
            if name == job and os.path.exists(self.jobs[s][2]):
                os.remove(self.jobs[s][2])
        if os.path.exists(self._host_file(job)):
            os.remove(self._host_file(job))
        self._scheduler_of(r).submit(job, "rollout", cmd, env,
                                     colocate_with=f"train-{r}" if self.cfg.runtime.colocate else "")

    def _down(self, step: int) -> dict[int, str]:
        """The rollout servers to start again, each with why: its job has ended, or it does not answer GET /health
        within 2 s (its job is stopped). A scheduler found dead on the way (killed between two of these calls) is
        started again, and then every server of it is down: its jobs went with it (PDEATHSIG). The schedulers' job
        lists and every server's /health are asked at once: one round trip before the step, 2 s at most."""
        cfg, n, schedulers = self.cfg, len(self.rollout), [self.scheduler, *self.remote.values()]
        assert self.scheduler is not None
        try:
            health = [c.call("/health", method="GET", timeout_s=2.0, traced=False) for c in self.rollout]
            replies = self.loop.gather(*[s.ajobs() for s in schedulers], *health, return_exceptions=True)
            lists, probes = replies[:len(schedulers)], replies[len(schedulers):]
            failed = next((x for x in lists if isinstance(x, BaseException)), None)
            if failed is not None:  # a scheduler's failure first, as when they were asked one after the other
                raise failed
            if self.scheduler.proc.poll() is not None:  # it ended after answering
                return self._after_scheduler_death(step)
            states = {j["name"]: j["state"] for found in lists for j in found}
            down = {r: f"its job is {states.get(self.job_of[r], 'gone')}" for r in range(n)
                    if states.get(self.job_of[r]) != "running"}
            stopped: set[str] = set()
            for r, probe in ((r, probes[r]) for r in range(n) if r not in down):
                if isinstance(probe, (RpcConnectionError, RpcTimeout, HTTPStatusError)):
                    down[r] = f"it does not answer /health ({type(probe).__name__})"
                    if self.job_of[r] not in stopped:
                        stopped.add(self.job_of[r])
                        self.loop.run(self._scheduler_of(r).stop_job(self.job_of[r], cfg.timeouts.cleanup_s, step))
                elif isinstance(probe, BaseException):
                    raise probe
            return down
        except (RpcConnectionError, RpcTimeout):
            if not self._scheduler_ended():
                raise
            return self._after_scheduler_death(step)

    def _remote_states(self) -> dict[str, str]:
        """Job states on the other nodes' schedulers (each lives and dies with its node's first train rank)."""
        return {j["name"]: j["state"] for remote in self.remote.values() for j in remote.jobs()}

    def _after_scheduler_death(self, step: int) -> dict[int, str]:
        """scheduler-0 is started again; its servers are down, another node's are down when their job is not running."""
        self._restart_scheduler(step)
        states = self._remote_states()
        return {r: "its scheduler is gone" if self.node_of(r) == 0 else f"its job is {states.get(self.job_of[r], 'gone')}"
                for r in range(len(self.rollout))
                if self.node_of(r) == 0 or states.get(self.job_of[r]) != "running"}

    def revive(self, step: int) -> list[str]:
        """The policy's restart_rollout: every rollout server whose job has ended, or that does not answer
        GET /health within 2 s, is (stopped and) started again; returns their names. Native, not colocated
        servers only (an sglang server's launch file is gone; a colocated one would need its lease handed over)."""
        with self.revive_lock:
            return self._revive(step)

    def _revive(self, step: int) -> list[str]:
        cfg = self.cfg
        if self.scheduler is None or not self.jobs or not self._revivable():
            return []
        down = self._down(step)
        for r in list(down):  # a simulated world's servers share a process: it starts again with all of them
            for s, job in enumerate(self.job_of):
                if job == self.job_of[r] and s not in down:
                    down[s] = f"it shares its process ({job}) with rollout-{r}"
        submitted: set[str] = set()
        for r, why in down.items():
            log.warning("step %d: rollout-%d is down (%s); starting it again (resilience.restart_rollout); it gets step "
                        "%d's weights before it is used", step, r, why, step)
            if self.job_of[r] not in submitted:  # all of them first, then wait: they start side by side
                submitted.add(self.job_of[r])
                self._submit(r)
        restarted = list(down)
        for job in submitted:  # its agent went with its process: the new one's is read again
            gone = self.relays.pop(job, None)
            if gone is not None:
                self.loop.run(gone.agent.close())
        for r in restarted:
            url = wait_for_file(self.jobs[r][2], cfg.timeouts.startup_s)
            self.loop.run(self.rollout[r].close())
            self.rollout[r] = self._rollout_client(r, url)
        self.revivals += len(restarted)
        return [f"rollout-{r}" for r in restarted]

    def rng_states(self) -> list[str | None]:
        """Every rollout server's sampling generator state (native backend; [] for sglang servers). A server that
        does not answer (it died this step; the next step starts it again) gives None: the checkpoint does not
        wait for it, and the resumed server starts from its seed."""
        if self.cfg.rollout.backend != "native":
            return []

        async def get_all() -> list[Any]:
            return await asyncio.gather(*[c.call("/rng_state", method="GET") for c in self.rollout],
                                        return_exceptions=True)

        states: list[str | None] = []
        for r, reply in enumerate(self.loop.run(get_all())):
            if isinstance(reply, (RpcConnectionError, RpcTimeout, HTTPStatusError)):
                log.info("rollout-%d's sampling RNG is not in this checkpoint: %s", r, reply)
                states.append(None)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                states.append(reply[0]["state"])
        return states

    def set_rng_states(self, states: list[str | None]) -> bool:
        """Give each rollout server back its generator state from a checkpoint; False when the server count changed
        or a state is missing (those servers start from their seed; the samples then differ from the uninterrupted
        run's, nothing else does)."""
        if self.cfg.rollout.backend != "native" or len(states) != len(self.rollout):
            return False

        async def set_all() -> list[Any]:
            return await asyncio.gather(*[c.call("/rng_state", {"state": s})
                                          for c, s in zip(self.rollout, states) if s is not None])

        self.loop.run(set_all())
        return all(s is not None for s in states)

    def _still_starting(self, name: str, what: str, waiting_for: str, deadline: float, output: str) -> None:
        """While a job comes up: its job ended (a model it cannot load) or timeouts.startup_s passed is one
        error naming it and where its output is."""
        assert self.scheduler is not None
        job = next((j for j in self.scheduler.jobs() if j["name"] == name), None)
        if job is None or job["state"] != "running":
            raise RuntimeError(f"{name} ({what}) ended before {waiting_for} answered: "
                               f"{job['state'] if job else 'no such job'}; its output is in {output}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} ({what}): no {waiting_for} within timeouts.startup_s "
                               f"({self.cfg.timeouts.startup_s:g} s); its output is in {output}")

    def stop(self, level: int = logging.ERROR) -> None:
        """The MetaServer, then every job through its scheduler (each error logged at `level` as it happens). The
        MetaServer goes first: a rollout server waiting on it for shards that will not come (their uploader died)
        is answered at once, and so stops at its SIGTERM instead of at the scheduler's SIGKILL."""
        if self.metaserver is not None:
            self.metaserver.stop()
        for scheduler in [*self.remote.values(), *([self.scheduler] if self.scheduler is not None else [])]:

            async def stop_all(scheduler: Any = scheduler) -> list[Any]:
                jobs = (await scheduler.client.call("/jobs", method="GET", stage="cleanup"))[0]
                return await asyncio.gather(*[scheduler.stop_job(j["name"], self.cfg.timeouts.cleanup_s)
                                              for j in jobs], return_exceptions=True)

            try:
                for result in self.loop.run(stop_all()):
                    if isinstance(result, BaseException):
                        log.log(level, "cleanup: stop job: %s: %s", type(result).__name__, result)
            except (RuntimeError, OSError, TimeoutError) as exc:
                log.log(level, "cleanup: %s: %s", type(exc).__name__, exc)
            scheduler.close()  # another node's: its first train rank stops the scheduler itself at shutdown

    def clients(self) -> list[Client]:
        return self.rollout + ([self.reward] if self.reward else []) + ([self.env] if self.env else []) + \
            ([self.scheduler.client] if self.scheduler else []) + \
            [s.client for s in self.remote.values()]

    def stores(self) -> list[str]:
        """Where each rollout server's rows are (rollout.data_plane store): its own URL, or in a simulated world its
        host's first server's (the host's servers share one store); a server started again has a new one."""
        first: dict[str, int] = {}
        for r, job in enumerate(self.job_of):
            first.setdefault(job, r)
        return [self.rollout[first[self.job_of[r]]].base_url for r in range(len(self.rollout))]
