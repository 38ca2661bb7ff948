"""Environment server: the run's environments (env.path) behind HTTP, one process started by the scheduler as job
`env-0` (role `env`), like the reward server: the run token on every route but /health, a span per request, fault
points, its own log (logs/env-0.log), exit records and heartbeat, and stopped at cleanup. The controller's episodes
(control/episodes.py) reset and step their environments here, so a tool that hangs, crashes or eats memory does it
in this process, not in the controller's.

    python -m rlhf.services.env_server --run-dir D --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

    POST /reset  {"episodes": [{"id": str, "row": {...}}]}      ->  {"observations": [str]}
    POST /step   {"steps": [{"id": str, "action": str}]}        ->  {"results": [{"observation", "reward", "done",
                                                                      "info"}]}   (an episode that is done is closed)
    POST /close  {"ids": [str]}                                 ->  {"closed": n}
    GET  /health {"ok": true, "env": spec, "episodes": n, "stop": [...], "stepping": n,
                  "busy": {"episode", "tool", "for_s"} | null}
                 (stop: the strings that end a model turn; stepping: the episodes stepping now; busy: the one that has
                 stepped longest, its tool, how long)

A /step's episodes step env.parallel_calls at a time, each on a thread of its own (a tool that waits on a service or a
sandbox process overlaps the others'); the results come back in the request's order, and the first error (in that
order) fails the request once every step has ended.

Fault points: env.reset and env.step (before each episode's reset or step), tool.call (tool_calls: before a tool
runs), sandbox.exec (the python tool: before the model's code runs, rlhf.envs.sandbox).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import signal
import threading
import time
from typing import Any

from rlhf.envs import InfraError, build_env, sandbox
from rlhf.errors import BadRequest
from rlhf.faults import fault_point
from rlhf.services.boot import announce, boot, service_parser
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.http import Service, exit_now, run_process_loop, serve_forever

log = logging.getLogger("rlhf.env_server")


class EnvServer:
    def __init__(self, spec: str, options: dict[str, Any], token: str, policy: Any, drop_on_infra: bool = False,
                 parallel: int = 1) -> None:
        """drop_on_infra (env.on_infra_error drop_group): an episode whose step raises InfraError ends with the error
        in its result (`infra_error`), for the controller to drop its group; otherwise /step fails with it.
        parallel (env.parallel_calls): episodes a /step steps at once."""
        self.spec, self.make, self.drop_on_infra = spec, build_env(spec, options), drop_on_infra
        self.stop = list(getattr(self.make(), "stop", None) or [])
        self.envs: dict[str, Any] = {}  # the open episodes, by id
        self.busy: dict[str, tuple[Any, float]] = {}  # the episodes stepping now: (their environment, since)
        self.parallel = max(1, int(parallel))
        # one pool for the run's turns (threads started once, not every /step)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.parallel, "env-step") if self.parallel > 1 else None
        self._lock = threading.Lock()
        self.service = Service("env", 0, token, policy)
        self.service.open_paths = ("/health",)
        self.service.untraced_paths.add("/health")
        self.service.route("/reset", self.reset)
        self.service.route("/step", self.step)
        self.service.route("/close", self.close)
        self.service.route("/health", self.health, method="GET", inline=True)

    def health(self, args: dict, tensors: dict) -> dict:
        """Open on the event loop while a step runs: which episode is stepping, in which tool, for how long (the
        controller's stall watchdog reads it)."""
        busy = None
        with self._lock:
            stepping = dict(self.busy)
        if stepping:
            episode, (env, since) = min(stepping.items(), key=lambda item: item[1][1])
            busy = {"episode": episode, "tool": getattr(env, "current_tool", None),
                    "for_s": time.monotonic() - since}
        return {"ok": True, "env": self.spec, "episodes": len(self.envs), "stop": self.stop,
                "stepping": len(stepping), "busy": busy}

    def reset(self, args: dict, tensors: dict) -> dict:
        episodes = args.get("episodes")
        if not isinstance(episodes, list) or not all(isinstance(e, dict) and "id" in e for e in episodes):
            raise BadRequest('/reset takes {"episodes": [{"id": str, "row": {...}}]}')
        observations = []
        for e in episodes:
            fault_point("env.reset")
            env = self.make()
            observations.append(str(env.reset(dict(e.get("row") or {})) or ""))
            self.envs[str(e["id"])] = env
        return {"observations": observations}

    def step(self, args: dict, tensors: dict) -> dict:
        steps = args.get("steps")
        if not isinstance(steps, list) or not all(isinstance(s, dict) and "id" in s for s in steps):
            raise BadRequest('/step takes {"steps": [{"id": str, "action": str}]}')
        unknown = [str(s["id"]) for s in steps if str(s["id"]) not in self.envs]
        if unknown:
            raise BadRequest(f"/step: no open episode {unknown[0]!r} ({len(self.envs)} open; reset it first)")
        if self.pool is None or len(steps) == 1:
            return {"results": [self._step_one(s) for s in steps]}
        # each step on a thread of the pool, with this request's context (its span, the step's number for the faults)
        futures = [self.pool.submit(contextvars.copy_context().run, self._step_one, s) for s in steps]
        concurrent.futures.wait(futures)
        return {"results": [f.result() for f in futures]}  # the first error in the request's order, if any

    def _step_one(self, s: dict) -> dict:
        episode = str(s["id"])
        env = self.envs[episode]
        with self._lock:
            self.busy[episode] = (env, time.monotonic())
        try:
            fault_point("env.step")
            r = env.step(str(s.get("action", "")))
        except InfraError as exc:
            if not self.drop_on_infra:
                raise
            log.warning("episode %s: %s; its group is dropped (env.on_infra_error drop_group)", episode, exc)
            with self._lock:
                self.envs.pop(episode, None)
            return {"observation": "", "reward": None, "done": True, "info": {"infra_errors": 1},
                    "infra_error": str(exc)}
        finally:
            with self._lock:
                self.busy.pop(episode, None)
        if r.done:
            with self._lock:
                self.envs.pop(episode, None)
        return {"observation": str(r.observation or ""), "reward": r.reward, "done": bool(r.done), "info": r.info}

    def close(self, args: dict, tensors: dict) -> dict:
        ids = [str(i) for i in args.get("ids") or []]
        closed = sum(self.envs.pop(i, None) is not None for i in ids)
        return {"closed": closed}


def env_options(cfg: Any) -> dict[str, Any]:
    """The environment's constructor options (those its class takes): env.tools and what to do with an
    infrastructure failure (env.on_infra_error; auto: the policy's infra_errors_fail; drop_group: raise it, the
    server drops the episode)."""
    on_infra = cfg.env.on_infra_error
    if on_infra == "auto":
        on_infra = "fail" if cfg.resilience.infra_errors_fail else "model"
    return {**({"tools": cfg.env.tools} if cfg.env.tools else {}),
            "on_infra_error": "fail" if on_infra == "drop_group" else on_infra}


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(__doc__, rank=False, config=True)
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, "env", 0)  # the scheduler records its exit status
    sandbox.LIMITS = sandbox.Limits(cfg.env.sandbox_timeout_s, cfg.env.sandbox_cpu_s, cfg.env.sandbox_memory_mb)
    server = EnvServer(cfg.env.path, env_options(cfg), token, cfg.resilience, cfg.env.on_infra_error == "drop_group",
                       cfg.env.parallel_calls)
    log.info("environment server: %s%s", cfg.env.path, f" (tools {cfg.env.tools})" if cfg.env.tools else "")
    ready = announce(args.ready_file, args.host, "environment server", log)

    def on_term() -> None:  # at once: a step in flight is the controller's to fail
        raise SystemExit(128 + signal.SIGTERM)

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
        await serve_forever(server.service, args.host, args.port, ready)

    code = run_process_loop(serve, stop_process_telemetry)
    if code:  # a step still on the service's thread is not waited for
        exit_now(code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
