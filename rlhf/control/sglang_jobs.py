"""The rollout servers as real sglang servers (rollout.backend sglang): one job each, launched with sglang's own
flags from a 0600 YAML file (the API key never shows in `ps`), each waited for on its /health. A part of
RolloutServices (control/fleet.py)."""

from __future__ import annotations

import os
import socket
import sys
import time

import yaml

from rlhf.devices import rollout_device
from rlhf.errors import HTTPStatusError, RpcConnectionError, RpcTimeout
from rlhf.transport.client import Client
from rlhf.transport.http import DEFAULT_HOST


class SglangJobs:
    """RolloutServices' sglang servers (needs its cfg, run_dir, token, loop, scheduler, train_ranks, _still_starting)."""

    def _start_sglang(self, threads: str) -> list[str]:
        """One sglang server job per rollout server, flags mapped from our config; waits for each /health."""
        cfg, scheduler = self.cfg, self.scheduler
        assert scheduler is not None
        urls = []
        for r in range(cfg.rollout.servers):
            device = str(rollout_device(cfg.model.device, r, self.train_ranks, cfg.runtime.colocate))
            kind, _, index = device.partition(":")
            port = free_port()
            flags = {"model_path": os.path.abspath(cfg.model.path), "host": DEFAULT_HOST, "port": port,
                     "api_key": self.token, "dtype": cfg.model.dtype, "device": kind, "base_gpu_id": int(index or 0),
                     "mem_fraction_static": cfg.sglang.mem_fraction, "tp_size": cfg.sglang.tp_size,
                     "random_seed": (cfg.sampling.seed if cfg.sampling.seed >= 0 else cfg.seed + 17) + 1000 * r,
                     "skip_server_warmup": True}
            if cfg.resilience.shed_load and cfg.rollout.max_queued_requests:
                flags["max_queued_requests"] = cfg.rollout.max_queued_requests
            path = os.path.join(self.run_dir, f"rollout-{r}.sglang.yaml")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(flags, f)
            cmd = [sys.executable, "-m", cfg.sglang.launcher, "--config", path]
            env = {"RLHF_RUN_DIR": self.run_dir, "RLHF_RANK": str(r), "RLHF_ROLLOUT_THREADS": threads,
                   "PYTHONPATH": pythonpath()}
            scheduler.submit(f"rollout-{r}", "rollout", cmd, env,
                                colocate_with=f"train-{r}" if cfg.runtime.colocate else "")
            urls.append(f"http://{DEFAULT_HOST}:{port}")
        for r, url in enumerate(urls):
            self._wait_healthy(f"rollout-{r}", url)
            os.remove(os.path.join(self.run_dir, f"rollout-{r}.sglang.yaml"))  # read at start only; it holds the key
        return urls

    def _wait_healthy(self, name: str, url: str) -> None:
        """Until GET /health answers 200 (an sglang server loads its model first: minutes on a GPU), or the job
        has ended, or timeouts.startup_s."""
        assert self.scheduler is not None
        probe = Client(url, self.token, timeout_s=5, peer=name)
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        try:
            while True:
                try:
                    self.loop.run(probe.call("/health", method="GET", traced=False))
                    return
                except (RpcConnectionError, HTTPStatusError, RpcTimeout):
                    pass
                self._still_starting(name, self.cfg.sglang.launcher, f"GET {url}/health", deadline,
                                     f"{self.run_dir}/logs/{name}.stdout")
                time.sleep(0.2)  # a poll interval, not a wait for a result: the condition is /health's answer
        finally:
            self.loop.run(probe.close())


def free_port() -> int:
    """A port free on this host's service address now (sglang takes its port as a flag, not 0)."""
    with socket.socket() as sock:
        sock.bind((DEFAULT_HOST, 0))
        return sock.getsockname()[1]


def pythonpath() -> str:
    """The PYTHONPATH a job gets: the directory that holds this rlhf package first (the one this controller runs)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
