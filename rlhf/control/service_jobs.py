"""env-0 and reward-0: the jobs beside the rollout servers (env.path, reward_model.path), submitted to this node's
scheduler with the run's config, connected once their ready file appears, and started again (restart_rollout). A part
of RolloutServices (control/fleet.py)."""

from __future__ import annotations

import os
import sys
import time

from rlhf.control.sglang_jobs import pythonpath
from rlhf.procs import wait_for_file
from rlhf.transport.client import Client


class ServiceJobs:
    """RolloutServices' env-0 and reward-0 (needs its cfg, run_dir, token, loop, scheduler, env, reward, revive_lock,
    starts, _still_starting)."""

    def _submit_service(self, name: str, module: str, wanted: bool) -> str:
        """Submit job `name` (reward-0: reward_model.path; env-0: env.path) to this node's scheduler, the run's
        config as its own; returns its ready file ("" when not wanted). It loads while the rollout servers load."""
        if not wanted:
            return ""
        assert self.scheduler is not None
        ready = os.path.join(self.run_dir, f"{name}.url")
        os.path.exists(ready) and os.remove(ready)
        cmd = [sys.executable, "-m", module, "--run-dir", self.run_dir,
               "--config", os.path.join(self.run_dir, "config.yaml"), "--ready-file", ready]
        env = {"RLHF_TOKEN": self.token, "RLHF_REWARD_THREADS": "1", "PYTHONPATH": pythonpath()}
        contain = {"pids_max": self.cfg.env.max_processes, "memory_mb": self.cfg.env.memory_mb}  # env: one cgroup
        self.scheduler.submit(name, name.split("-")[0], cmd, env, contain=contain if name.startswith("env-") else None)
        return ready

    def _connect_service(self, name: str, ready: str, what: str, timeout_s: float) -> Client | None:
        """Until the job's ready file appears; a job that ended first (a model or an environment it cannot load)
        fails at once, with where its error is."""
        if not ready:
            return None
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        while not (os.path.exists(ready) and os.path.getsize(ready) > 0):
            self._still_starting(name, what, "its ready file", deadline, f"{self.run_dir}/logs/{name}.log")
            time.sleep(0.1)  # a poll interval: the condition is the ready file (or the job's end)
        url = wait_for_file(ready, 1.0)
        return Client(url, self.token, timeout_s, peer=name, retries=self.cfg.resilience.retry_idempotent)

    def restart_service(self, name: str) -> None:
        """env-0 or reward-0 started again (resilience.restart_rollout), its client pointed at the new one."""
        cfg = self.cfg
        with self.revive_lock:
            if name == "env-0":
                ready = self._submit_service(name, "rlhf.services.env_server", True)
                old, self.env = self.env, self._connect_service(name, ready, f"env.path {cfg.env.path}",
                                                                cfg.timeouts.rollout_s)
            else:
                ready = self._submit_service(name, "rlhf.services.reward_server", True)
                old, self.reward = self.reward, self._connect_service(
                    name, ready, f"reward_model.path {cfg.reward_model.path}", cfg.reward_model.timeout_s)
            self.starts[name] = self.starts.get(name, 0) + 1
        if old is not None:
            self.loop.run(old.close())

    def service(self, name: str) -> Client | None:
        """env-0's or reward-0's client (None: the run has none)."""
        return self.env if name == "env-0" else self.reward

    def _connect_services(self, ready: dict[str, str]) -> None:
        cfg = self.cfg
        self.reward = self._connect_service("reward-0", ready["reward-0"], f"reward_model.path {cfg.reward_model.path}",
                                            cfg.reward_model.timeout_s)
        self.env = self._connect_service("env-0", ready["env-0"], f"env.path {cfg.env.path}", cfg.timeouts.rollout_s)
