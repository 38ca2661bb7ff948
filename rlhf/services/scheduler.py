"""Scheduler service: starts, lists and stops jobs; stops them all when the controller's lease lapses.

    python -m rlhf.services.scheduler --run-dir D --ready-file F --lease-s 10   (token in RLHF_TOKEN)

    POST   /jobs        {name, role, command: [...], env: {...}, colocate_with, contain: {pids_max, memory_mb}}
                        -> {name, pid}     (contain: the job and all it starts in a cgroup of their own, rlhf.contain)
    GET    /jobs        every job with its state
    GET    /jobs/<name> one job
    DELETE /jobs/<name> stop it (SIGTERM to its process group, SIGKILL after a grace period)
    POST   /lease       the controller's heartbeat
    GET    /health

Jobs are started from the event-loop (main) thread with PDEATHSIG, so they die with the
scheduler; the scheduler dies with the controller (PDEATHSIG too) and, should the controller
hang instead, stops every job once `lease_s` passes without a heartbeat. No orphans: a contained job's cgroup is
killed whenever the job stops or dies (what it started that detached from its process group goes with it), and a
scheduler kills what its killed predecessor's cgroups still hold as it starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rlhf import exits, tracing
from rlhf.config import Config, build_config
from rlhf.config.resilience import HARDENED, Policy
from rlhf.contain import Cgroup, run_prefix, sweep
from rlhf.procs import spawn, stop_group, wait_for_file
from rlhf.services.boot import announce, boot, service_parser
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import Service, serve_forever
from rlhf.transport.shm import sweep_stale_shm

log = logging.getLogger("rlhf.scheduler")


@dataclass
class Job:
    name: str
    role: str
    command: list[str]
    env: dict[str, str]
    colocate_with: str = ""
    proc: Any = None
    started_at: float = field(default_factory=time.time)
    stopped: bool = False
    stopping: bool = False  # we asked it to stop: its exit is expected, not a death to report
    box: Cgroup | None = None  # contained: its cgroup

    def describe(self) -> dict[str, Any]:
        code = self.proc.poll() if self.proc is not None else None
        state = "stopped" if self.stopped else ("running" if code is None else f"exited({code})")
        return {"name": self.name, "role": self.role, "pid": self.proc.pid if self.proc else None, "state": state,
                "colocate_with": self.colocate_with, "started_at": self.started_at}


class Scheduler:
    def __init__(self, run_dir: str, token: str, lease_s: float, policy: Policy = HARDENED, rank: int = 0) -> None:
        self.run_dir, self.lease_s = run_dir, lease_s
        self.jobs: dict[str, Job] = {}
        self.last_renewal = time.monotonic()
        self.service = Service("scheduler", rank, token, policy)
        self.name = f"scheduler-{rank}"
        # this run's cgroups: rlhf-<run>-<job>-<n> (a job started again gets a fresh one)
        self.prefix = run_prefix(run_dir)
        self.boxes = 0
        self.contain_warned = False
        self.service.untraced_paths.add("/lease")  # a heartbeat every few seconds; not worth a trace each
        route = self.service.raw_route  # behind the same auth, spans and typed errors as every service
        route("POST", "/jobs", self._submit)
        route("GET", "/jobs", self._list)
        route("GET", "/jobs/{name}", self._get)
        route("DELETE", "/jobs/{name}", self._cancel)
        route("POST", "/lease", self._renew)
        route("GET", "/health", self._health)

    async def _submit(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["name"]
        if name in self.jobs and not await self._gone(self.jobs[name]):
            return web.json_response({"error": f"job {name!r} is already running"}, status=409)
        job = Job(name, body.get("role", ""), list(body["command"]), dict(body.get("env") or {}),
                  body.get("colocate_with", ""))
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        if body.get("contain") is not None:
            job.box = self._box(name, body["contain"])
        with tracing.span("scheduler.start_job", job=name, job_role=job.role) as sp:
            job.proc = spawn(job.command, env={**os.environ, **job.env},
                             log_path=os.path.join(self.run_dir, "logs", f"{name}.stdout"),
                             join=job.box.join if job.box is not None else None)
            sp.set_attribute("rlhf.job_pid", job.proc.pid)
        self.jobs[name] = job
        log.info("started job %s (role %s) pid %d", name, job.role, job.proc.pid)
        return web.json_response(job.describe())

    def _box(self, name: str, limits: dict[str, Any]) -> Cgroup | None:
        """A cgroup for job `name` with its limits; None (a WARNING, once) where there are no cgroups."""
        self.boxes += 1
        box = Cgroup.make(f"{self.prefix}{name}-{self.boxes}", int(limits.get("pids_max") or 0),
                          float(limits.get("memory_mb") or 0))
        if box is None and not self.contain_warned:
            self.contain_warned = True
            log.warning("job %s is not contained: %s; it stops what it started as it exits (a child subreaper), and "
                        "what it started outlives a SIGKILL of it", name, Cgroup.why)
        return box

    def _release(self, job: Job) -> None:
        """The job has ended: kill what its cgroup still holds (what it started and left running) and remove it."""
        if job.box is None:
            return
        left, job.box = job.box.kill(), None
        if left:
            log.warning("job %s left %d process(es) running (%s): killed with its cgroup", job.name, len(left),
                        ", ".join(left[:8]))

    async def _gone(self, job: Job, grace_s: float = 2.0) -> bool:
        """Whether `job` has ended. A process killed by SIGKILL closes its sockets before its exit shows: a caller
        that saw its connection drop and asks for it again at once gets `grace_s` for the exit to show (polled; its
        death is recorded as the watcher would have)."""
        deadline = time.monotonic() + grace_s
        while job.describe()["state"] == "running":
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)  # a poll interval: the condition is the process's exit
        self._reap(job)
        return True

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response([j.describe() for j in self.jobs.values()])

    def _job(self, request: web.Request) -> Job:
        name = request.match_info["name"]
        if name not in self.jobs:
            raise web.HTTPNotFound(text=f"no job {name!r} (jobs: {sorted(self.jobs)})")
        return self.jobs[name]

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).describe())

    async def _cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        died = job.proc.poll() is not None  # before we stopped it: it died on its own
        job.stopping = True
        if died and not job.stopped:
            log.error("job %s (role %s, pid %d) died: %s", job.name, job.role, job.proc.pid, exits.describe(job.proc.poll()))
        with tracing.span("scheduler.stop_job", job=job.name, job_pid=job.proc.pid) as sp:
            code = await asyncio.get_running_loop().run_in_executor(None, stop_group, job.proc)
            sp.set_attribute("rlhf.exit_code", code if code is not None else -1)
            await asyncio.get_running_loop().run_in_executor(None, self._release, job)
        self._ended(job, code, expected=not died)
        log.info("stopped job %s (exit %s)", job.name, code)
        return web.json_response(job.describe())

    async def _renew(self, request: web.Request) -> web.Response:
        self.last_renewal = time.monotonic()
        return web.json_response({"lease_s": self.lease_s})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "jobs": len(self.jobs), "lease_age_s": time.monotonic() - self.last_renewal})

    def _ended(self, job: Job, code: int | None, expected: bool) -> None:
        """Mark the job stopped and record its exit status (once: the watcher may have seen it die first)."""
        if not job.stopped:
            exits.record_exit(self.run_dir, job.name, job.proc.pid, code, by=self.name, expected=expected)
        job.stopped = True

    def stop_all(self, reason: str) -> None:
        for job in self.jobs.values():
            if not job.stopped and job.proc is not None:
                log.warning("stopping job %s: %s", job.name, reason)
                died = job.proc.poll() is not None
                job.stopping = True
                self._ended(job, stop_group(job.proc, grace_s=2.0), expected=not died)
            self._release(job)

    async def watch_jobs(self, period_s: float = 0.2) -> None:
        """A job that exits on its own is an error the moment it happens, with its exit status (a signal too)."""
        while True:
            await asyncio.sleep(period_s)
            for job in self.jobs.values():
                self._reap(job)

    def _reap(self, job: Job) -> None:
        """A job that ended without being asked to: logged as a death and its exit recorded."""
        code = job.proc.poll() if job.proc is not None and not (job.stopped or job.stopping) else None
        if code is not None:
            log.error("job %s (role %s, pid %d) died: %s", job.name, job.role, job.proc.pid, exits.describe(code))
            self._ended(job, code, expected=False)
            self._release(job)

    async def watch_lease(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.lease_s / 4))
            if time.monotonic() - self.last_renewal > self.lease_s:
                log.error("controller lease lapsed (%.1f s without renewal): stopping every job", self.lease_s)
                self.stop_all("lease lapsed")
                _sweep_shm()
                stop_process_telemetry()
                os._exit(3)


def _sweep_shm() -> None:
    """A controller that died (SIGKILL) left its MetaServer's shared-memory shards: remove those of dead pids."""
    removed = sweep_stale_shm()
    if removed:
        log.warning("removed shared-memory weight folder(s) of dead MetaServers: %s", ", ".join(removed))


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(__doc__, rank=False, config=False)
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--rank", type=int, default=0, help="the node whose rollout servers it starts (scheduler-N)")
    args = parser.parse_args(argv)
    me = f"scheduler-{args.rank}"
    # the controller died: SIGTERM stops the jobs and cleans up (on_term), then exits; it never loads torch (compute
    # off) and reads the run's config.yaml when there is one; the process that started it records its exit status
    token, cfg = boot(parser, args, "scheduler", args.rank, load_config=lambda: _run_config(args.run_dir),
                      deathsig=signal.SIGTERM, compute=False)
    scheduler = Scheduler(args.run_dir, token, args.lease_s, cfg.resilience if cfg is not None else HARDENED,
                          args.rank)
    left = sweep(scheduler.prefix)  # a killed predecessor's contained jobs left these running
    if left:
        log.warning("killed %d process(es) a previous scheduler's jobs left in their cgroups: %s", len(left),
                    ", ".join(left[:8]))

    def on_term(signum: int, frame: Any) -> None:
        scheduler.stop_all(f"scheduler got signal {signum}")
        exits.record_exit(args.run_dir, me, os.getpid(), 0, by=me, expected=False,
                          reason=f"received {signal.Signals(signum).name}")
        _sweep_shm()
        stop_process_telemetry()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    async def run() -> None:
        watchers = [asyncio.create_task(scheduler.watch_lease()), asyncio.create_task(scheduler.watch_jobs())]

        ready = announce(args.ready_file, args.host, "scheduler", log, f", lease {args.lease_s:.1f} s")
        try:
            await serve_forever(scheduler.service, args.host, args.port, ready)
        finally:
            for watcher in watchers:
                watcher.cancel()

    try:
        asyncio.run(run())
    finally:
        scheduler.stop_all("scheduler exiting")
        stop_process_telemetry()
    return 0


def _run_config(run_dir: str) -> Config | None:
    """The run's config.yaml (its faults and resilience policy), or None when started on its own."""
    path = os.path.join(run_dir, "config.yaml")
    return build_config(config_file=path) if os.path.exists(path) else None


class _Jobs:
    """Calls on a scheduler's job API (its `client` and the caller's `loop`)."""

    client: Client
    loop: LoopThread

    def submit(self, name: str, role: str, command: list[str], env: dict[str, str], colocate_with: str = "",
               contain: dict[str, Any] | None = None) -> dict:
        """contain: {pids_max, memory_mb}: the job and everything it starts in a cgroup of their own."""
        body = {"name": name, "role": role, "command": command, "env": env, "colocate_with": colocate_with}
        return self.loop.run(self.client.call("/jobs", {**body, **({"contain": contain} if contain is not None
                                                                    else {})}))[0]

    def jobs(self) -> list[dict]:
        return self.loop.run(self.ajobs())

    async def ajobs(self) -> list[dict]:
        return (await self.client.call("/jobs", method="GET"))[0]

    async def stop_job(self, name: str, timeout_s: float, step: int = -1) -> dict:
        return (await self.client.call(f"/jobs/{name}", method="DELETE", timeout_s=timeout_s, stage="cleanup",
                                       step=step, points=("scheduler.stop_job",)))[0]


class RemoteScheduler(_Jobs):
    """Another node's scheduler, started (and its lease renewed) by that node's first train rank: the controller
    submits and stops that node's rollout server jobs through it."""

    def __init__(self, url: str, token: str, name: str, loop: LoopThread) -> None:
        self.url, self.name, self.loop = url, name, loop
        self.client = Client(url, token, peer=name)

    def close(self) -> None:
        self.loop.run(self.client.close())


class SchedulerClient(_Jobs):
    """The controller's handle: starts the scheduler process, renews its lease, submits/stops jobs."""

    def __init__(self, run_dir: str, token: str, lease_s: float, startup_timeout_s: float, loop: LoopThread,
                 rank: int = 0, owner: str = "controller-0") -> None:
        """rank: the node whose rollout servers it starts (scheduler-N; node 0's is the controller's, another node's
        is started by that node's first train rank, `owner`, which renews its lease)."""
        self.run_dir, self.token, self.lease_s, self.loop = run_dir, token, lease_s, loop
        self.name, self.owner = f"scheduler-{rank}", owner
        ready = os.path.join(run_dir, "scheduler.url" if rank == 0 else f"scheduler-{rank}.url")
        if os.path.exists(ready):
            os.remove(ready)
        self.proc = spawn([sys.executable, "-m", "rlhf.services.scheduler", "--run-dir", run_dir, "--ready-file", ready,
                           "--lease-s", str(lease_s), "--rank", str(rank)],
                          env={**os.environ, "RLHF_TOKEN": token},
                          log_path=os.path.join(run_dir, "logs", "scheduler.stdout" if rank == 0 else
                                                f"scheduler-{rank}.stdout"))
        self.died = False
        self.death_level = logging.ERROR  # WARNING when the controller starts another (resilience.restart_rollout)
        self.url = wait_for_file(ready, startup_timeout_s, self.proc)
        self.client = Client(self.url, token, peer=self.name)
        # the lease on a loop thread of its own: a busy RPC loop (a big world's replies) must not let it lapse
        self._lease_loop = LoopThread(f"{self.name}-lease")
        self._lease_client = Client(self.url, token, peer=self.name)
        self._renewer: asyncio.Future | None = asyncio.run_coroutine_threadsafe(  # type: ignore[assignment]
            self._renew_forever(), self._lease_loop.loop)

    async def _renew_forever(self) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:  # it died: nothing will stop the rollout servers' jobs; say so with its status
                log.log(self.death_level, "%s (pid %d) died: %s", self.name, self.proc.pid, exits.describe(code))
                exits.record_exit(self.run_dir, self.name, self.proc.pid, code, by=self.owner, expected=False)
                self.died = True
                return
            try:
                await self._lease_client.call("/lease", {}, timeout_s=self.lease_s / 2, traced=False)
            except (ConnectionError, TimeoutError, RuntimeError) as exc:
                if self.proc.poll() is not None:
                    continue  # it is dead: say so (above) rather than that a renewal failed
                log.warning("scheduler lease renewal failed: %s", exc)
            await asyncio.sleep(self.lease_s / 4)

    def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
            try:
                self._lease_loop.run(self._lease_client.close(), timeout=5.0)
            except Exception as exc:  # noqa: BLE001 — closing a connection must not hide the run's own error
                log.debug("closing the lease client: %s: %s", type(exc).__name__, exc)
            self._lease_loop.close()
        died = self.proc.poll() is not None  # it ended before we stopped it: between two renewals
        if died and not self.died:
            log.log(self.death_level, "%s (pid %d) died: %s", self.name, self.proc.pid,
                    exits.describe(self.proc.returncode))
        code = stop_group(self.proc)
        if not self.died:  # else its death was recorded when it happened
            exits.record_exit(self.run_dir, self.name, self.proc.pid, code, by=self.owner, expected=not died)


if __name__ == "__main__":
    sys.exit(main())
