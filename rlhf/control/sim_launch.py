"""The simulated world's launcher (sim.train_ranks > 0): what torchrun and rank 0 do for a real run, for simulated
train ranks.

    python examples/grpo_trainer.py --sim.train_ranks 1024 --rollout.servers 256 --steps 3
    │
    ├─ this process ─ the real Controller (MetaServer in-process), the world's c10d store (the simulated collective)
    ├─ train rank processes  ceil(N / sim.ranks_per_process) of `python -m rlhf.sim.train_ranks`, each its ranks on
    │                        their own ports
    └─ scheduler-0 (its own process) ─ rollout server jobs, each sim.servers_per_process servers
                               (`python -m rlhf.sim.rollout_servers`)

The controller, MetaServer, scheduler, stall watchdog, tracing, faults and `rlhf diagnose` are the ones every run
uses; only the train ranks' and rollout servers' compute is EMULATED (rlhf.sim). An entry point beside launch.py
(launch.run hands it a config with sim.train_ranks > 0). steps.csv rows carry `simulated`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any

from rlhf import exits, faults, tracing
from rlhf.batch import TOKENS
from rlhf.config import Config
from rlhf.control.controller import Controller
from rlhf.procs import own_threads, spawn, stop_group, wait_for_file
from rlhf.run_dir import CONTROLLER_LOGGERS, default_run_dir, make_run_dir, setup_logging
from rlhf.sim.cost import EMULATED
from rlhf.tracing import metrics
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.client import TRAFFIC
from rlhf.transport.http import DEFAULT_HOST

log = logging.getLogger("rlhf.launch")


class SimulatedController(Controller):
    """The real Controller; its steps.csv rows also say the world is simulated and what the step cost this process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.columns = [*self.columns, *SIM_COLUMNS]

    def step(self, step: int) -> dict[str, Any]:
        before, cpu, served = _traffic_totals(TRAFFIC.snapshot()), time.process_time(), self._metaserver_served()
        tokens = TOKENS.tokens
        row = super().step(step)
        after = _traffic_totals(TRAFFIC.snapshot())
        row.update(simulated=EMULATED, controller_cpu_s=time.process_time() - cpu, controller_rss_mb=_peak_rss_mb(),
                   **{k: a - b for k, a, b in zip(SIM_COLUMNS[3:7], after, before)},
                   controller_tokens=TOKENS.tokens - tokens, metaserver_bytes=self._metaserver_served() - served)
        return row

    def _metaserver_served(self) -> int:
        return self.services.metaserver.served if self.services.metaserver is not None else 0


# a simulated world's own steps.csv columns: what the step cost the controller's process (its clients' requests and
# bytes both ways; batch bytes: the /generate replies and the calls that carry the batch to the train ranks, tokens
# in the controller data plane, metadata in the store plane; tokens: rollout token ids and logprobs it handled)
SIM_COLUMNS = ("simulated", "controller_cpu_s", "controller_rss_mb", "controller_requests", "controller_bytes",
               "controller_batch_bytes", "heartbeat_requests", "controller_tokens", "metaserver_bytes")
TOKEN_PATHS = tuple(f"{prefix}{route}" for route in ("generate", "compute_logprobs", "train_step")
                    for prefix in ("/", "/fanout?to=", "/fanout_wait?to="))  # direct, or through a host's agent


HEARTBEAT_PATHS = ("/heartbeat", "/fanout_untraced?to=heartbeat", "/fanout_wait?to=heartbeat")  # a rank's, a host's


def _traffic_totals(snapshot: dict[str, tuple[int, int, int]]) -> tuple[int, int, int, int]:
    """Requests, bytes both ways, rollout token bytes, and heartbeat reads of this process's clients."""
    return (sum(v[0] for v in snapshot.values()), sum(v[1] + v[2] for v in snapshot.values()),
            sum(v[1] + v[2] for k, v in snapshot.items() if k in TOKEN_PATHS),
            sum(v[0] for k, v in snapshot.items() if k in HEARTBEAT_PATHS))


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_simulated(cfg: Config) -> dict[str, Any] | None:
    """A GRPO run in a simulated world of cfg.sim.train_ranks train ranks and cfg.rollout.servers rollout servers."""
    from torch.distributed import TCPStore

    world, per = cfg.sim.train_ranks, cfg.sim.ranks_per_process
    token = secrets.token_hex(16)
    run_dir = os.path.abspath(cfg.run_dir or default_run_dir(None))
    make_run_dir(run_dir)
    own_threads(1)
    if not cfg.tracing.rank_sample:  # auto: about 64 train ranks keep every span (the run's config records it)
        cfg.tracing.rank_sample = max(1, world // 64)
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as fh:
        fh.write(cfg.to_yaml())
    setup_logging(run_dir, "controller", 0, console_prefixes=CONTROLLER_LOGGERS + ("rlhf.sim",))
    tracing.setup_tracing(run_dir, "controller", 0, cfg.tracing)
    metrics.start_sampler(run_dir, "controller", 0, cfg.tracing.metrics_interval_s)
    if cfg.faults:
        faults.arm(run_dir, cfg.faults)
    exits.record_start(run_dir, "controller-0")
    store = TCPStore(DEFAULT_HOST, 0, is_master=True, wait_for_workers=False)
    processes = (world + per - 1) // per
    log.info("simulated world (%s compute): %d train ranks in %d processes, %d rollout servers in %d processes",
             EMULATED, world, processes, cfg.rollout.servers,
             (cfg.rollout.servers + cfg.sim.servers_per_process - 1) // cfg.sim.servers_per_process)
    hosts: list[tuple[int, int, Any]] = []
    env = {**os.environ, "RLHF_TOKEN": token}
    signal.signal(signal.SIGTERM, _terminated)
    failed = True
    try:
        for p in range(processes):
            first, count = p * per, min(per, world - p * per)
            ready = os.path.join(run_dir, f"train-{first}.host")
            if os.path.exists(ready):  # an earlier run's in this directory (a resume): its ports are gone
                os.remove(ready)
            cmd = [sys.executable, "-m", "rlhf.sim.train_ranks", "--run-dir", run_dir, "--config",
                   os.path.join(run_dir, "config.yaml"), "--first", str(first), "--count", str(count),
                   "--processes", str(processes), "--store", f"{DEFAULT_HOST}:{store.port}", "--ready-file", ready]
            hosts.append((first, count, spawn(cmd, env, os.path.join(run_dir, "logs", f"train-{first}.stdout"))))
        urls: list[str] = []
        agents: list[tuple[str, list[int]]] = []
        for first, count, proc in hosts:
            ready = json.loads(wait_for_file(os.path.join(run_dir, f"train-{first}.host"), cfg.timeouts.startup_s,
                                             proc))
            urls += ready["urls"]
            agents.append((ready["agent"], list(range(first, first + count))))
        controller = SimulatedController(cfg, run_dir, urls, token, nodes=[0] * world)
        if cfg.sim.fanout:  # one request per train rank process, fanned out there (rlhf.transport.fanout)
            controller.workers.use_agents(agents)
        summary = controller.run()
        failed = False
        return {**summary, "simulated": EMULATED} if summary is not None else None
    finally:
        _stop_hosts(run_dir, hosts, failed)
        exits.record_exit(run_dir, "controller-0", os.getpid(), 1 if failed else 0, by="controller-0",
                          expected=not failed)
        faults.restore_all("run end")
        stop_process_telemetry()


def _stop_hosts(run_dir: str, hosts: list[tuple[int, int, Any]], failed: bool) -> None:
    """Every train rank process ends: those the controller shut down exit by themselves, the rest are stopped. A
    process found dead by a signal (a fault's SIGKILL) gets the exit record of each of its ranks."""
    deadline = time.monotonic() + 10.0 + 2.0 * len(hosts)  # they end side by side, sharing the machine's cores
    for first, count, proc in hosts:
        died = proc.poll()
        if died is None:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 — still running: stopped below
                pass
        code = proc.returncode if proc.returncode is not None else stop_group(proc, grace_s=5.0)
        if died is not None and died < 0:
            for r in range(first, first + count):
                exits.record_exit(run_dir, f"train-{r}", proc.pid, died, by="controller-0", expected=False)
        elif code is not None and code < 0 and not failed:
            log.warning("train ranks %d-%d (pid %d) ended with %s", first, first + count - 1, proc.pid,
                        exits.describe(code))


class Terminated(Exception):
    """SIGTERM on the simulated world's launcher."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated("received SIGTERM")
