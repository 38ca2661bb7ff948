"""Environment server: the run's environments (env.path) behind HTTP, one process started by the scheduler as job
`env-0` (role `env`), like the reward server: the run token on every route but /health, a span per request, fault
points, its own log (logs/env-0.log), exit records and heartbeat, and stopped at cleanup. The controller's episodes
(control/episodes.py) reset and step their environments here, so a tool that hangs, crashes or eats memory does it
in this process, not in the controller's.

    python -m rlhf.services.env_server --run-dir D --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

    POST /reset  {"episodes": [{"id": str, "row": {...}}]}      ->  {"observations": [str]}
    POST /step   {"steps": [{"id": str, "action": str}], "hold_s": s (optional)}
                                                     ->  {"results": {id: {"observation", "reward", "done", "info"}},
                                                          "pending": [id]}    (an episode that is done is closed)
    POST /results {"ids": [str], "hold_s": s}         ->  the same, for episodes a /step left pending
    POST /close  {"ids": [str]}                                 ->  {"closed": n}
    GET  /health {"ok": true, "env": spec, "episodes": n, "stop": [...], "stepping": n,
                  "busy": {"episode", "tool", "for_s"} | null}
                 (stop: the strings that end a model turn; stepping: the episodes stepping now; busy: the one that has
                 stepped longest, its tool, how long: since its tool's latest try, for a tool called again)

Episodes step env.parallel_calls at a time, each on a thread of its own (a tool that waits on a service or a sandbox
process overlaps the others'), those of one /step request and of requests made at the same time alike. Without
hold_s a /step answers when all its episodes have stepped; with it (the controller's episodes: control/episodes.py),
when the first has and up to hold_s later, the others `pending`, collected the same way by /results: a slow episode
holds only itself. The first error (in the request's order) among the ended ones fails the request.

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

from rlhf import contain
from rlhf.envs import InfraError, build_env, sandbox
from rlhf.errors import BadRequest
from rlhf.faults import fault_point
from rlhf.services.boot import announce, boot, service_parser
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.http import Service, exit_now, run_process_loop, serve_forever

log = logging.getLogger("rlhf.env_server")


class EnvServer:
    def __init__(self, spec: str, options: dict[str, Any], token: str, policy: Any, drop_on_infra: bool = False,
                 parallel: int = 1, tokenizer: Any = None) -> None:
        """drop_on_infra (env.on_infra_error drop_group): an episode whose step raises InfraError ends with the error
        in its result (`infra_error`), for the controller to drop its group; otherwise /step fails with it.
        parallel (env.parallel_calls): episodes a /step steps at once. tokenizer: the model's, whose chat template
        renders the chat-message observations of another trainer's environment (rlhf.envs.adapters)."""
        self.spec, self.make, self.drop_on_infra = spec, build_env(spec, options, tokenizer), drop_on_infra
        self.stop = list(getattr(self.make(), "stop", None) or [])
        self.envs: dict[str, Any] = {}  # the open episodes, by id
        self.busy: dict[str, tuple[Any, float]] = {}  # the episodes stepping now: (their environment, since)
        self.stepping: dict[str, asyncio.Future] = {}  # episode -> its step's result, until a reply carries it
        self.parallel = max(1, int(parallel))
        # one pool for the run's steps (threads started once, not every /step): every /step request's episodes
        self.pool = concurrent.futures.ThreadPoolExecutor(self.parallel, "env-step")
        self._lock = threading.Lock()
        self.service = Service("env", 0, token, policy)
        self.service.open_paths = ("/health",)
        self.service.untraced_paths.add("/health")
        self.service.route("/reset", self.reset)
        self.service.route("/step", self.step)
        self.service.route("/results", self.results)
        self.service.route("/close", self.close)
        self.service.route("/health", self.health, method="GET", inline=True)

    def health(self, args: dict, tensors: dict) -> dict:
        """Open on the event loop while a step runs: which episode is stepping, in which tool, for how long (the
        controller's stall watchdog reads it)."""
        busy = None
        with self._lock:
            stepping = dict(self.busy)
        if stepping:  # a tool called again after an infrastructure failure counts from its latest try
            since_of = {e: max(since, getattr(env, "tool_since", 0.0) or 0.0) for e, (env, since) in stepping.items()}
            episode = min(since_of, key=since_of.__getitem__)
            busy = {"episode": episode, "tool": getattr(stepping[episode][0], "current_tool", None),
                    "for_s": time.monotonic() - since_of[episode]}
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

    async def step(self, args: dict, tensors: dict) -> dict:
        """On the event loop: the request's episodes go to the pool (env.parallel_calls threads). Without hold_s the
        reply waits for all of them; with it, for the first to end and then up to hold_s more, and the episodes still
        stepping are `pending`, their results for /results (so one slow episode holds nobody's reply)."""
        steps = args.get("steps")
        if not isinstance(steps, list) or not all(isinstance(s, dict) and "id" in s for s in steps):
            raise BadRequest('/step takes {"steps": [{"id": str, "action": str}], "hold_s": seconds (optional)}')
        unknown = [str(s["id"]) for s in steps if str(s["id"]) not in self.envs]
        if unknown:
            raise BadRequest(f"/step: no open episode {unknown[0]!r} ({len(self.envs)} open; reset it first)")
        busy = [str(s["id"]) for s in steps if str(s["id"]) in self.stepping]
        if busy:
            raise BadRequest(f"/step: episode {busy[0]!r} is still stepping (its result is for /results)")
        loop = asyncio.get_running_loop()
        for s in steps:  # on a thread of the pool, with this request's context (its span, the step for the faults)
            self.stepping[str(s["id"])] = loop.run_in_executor(self.pool, contextvars.copy_context().run,
                                                               self._step_one, s)
        return await self._collect([str(s["id"]) for s in steps], args.get("hold_s"))

    async def results(self, args: dict, tensors: dict) -> dict:
        """The results of episodes a /step left pending: the first to end, and those that end up to hold_s after."""
        ids = args.get("ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest('/results takes {"ids": [str], "hold_s": seconds}')
        unknown = [str(i) for i in ids if str(i) not in self.stepping]
        if unknown:
            raise BadRequest(f"/results: episode {unknown[0]!r} is not stepping ({len(self.stepping)} are)")
        return await self._collect([str(i) for i in ids], args.get("hold_s", 0.0))

    async def _collect(self, ids: list[str], hold_s: float | None) -> dict:
        futures = [self.stepping[i] for i in ids]
        if hold_s is None:
            await asyncio.wait(futures)
        else:
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(futures, timeout=float(hold_s))
        ended = [i for i, f in zip(ids, futures) if f.done()]
        for i in ended:
            self.stepping.pop(i, None)
        out = {"results": {i: f.result() for i, f in zip(ids, futures) if f.done()}}  # the first error, if any
        return {**out, "pending": [i for i in ids if i not in out["results"]]}

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
        envs = [self.envs.pop(i, None) for i in ids]
        for i in ids:
            self.stepping.pop(i, None)
        for env in envs:  # an environment with a close() (SkyRL's, gymnasium's) releases what it holds
            if env is not None and callable(getattr(env, "close", None)):
                env.close()
        return {"closed": sum(env is not None for env in envs)}


def env_options(cfg: Any) -> dict[str, Any]:
    """The environment's constructor options (those its class takes): env.tools and what to do with an
    infrastructure failure (env.on_infra_error; auto: the policy's infra_errors_fail and retry_infra_errors;
    drop_group: raise it, the server drops the episode)."""
    on_infra = cfg.env.on_infra_error
    if on_infra == "auto":
        policy = cfg.resilience
        on_infra = ("retry" if policy.retry_infra_errors else "fail") if policy.infra_errors_fail else "model"
    return {**({"tools": cfg.env.tools} if cfg.env.tools else {}),
            "on_infra_error": "fail" if on_infra == "drop_group" else on_infra,
            **({"infra_retries": cfg.env.infra_retries} if on_infra == "retry" else {})}


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(__doc__, rank=False, config=True)
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, "env", 0)  # the scheduler records its exit status
    contain.keep_orphans()  # what the environment starts and detaches (setsid) stays ours, to stop as we exit
    sandbox.LIMITS = sandbox.Limits(cfg.env.sandbox_timeout_s, cfg.env.sandbox_cpu_s, cfg.env.sandbox_memory_mb)
    tokenizer = None  # another trainer's environment answers in chat messages: the model's template renders them
    if ":" in cfg.env.path and cfg.model.path:
        from rlhf.models import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    server = EnvServer(cfg.env.path, env_options(cfg), token, cfg.resilience, cfg.env.on_infra_error == "drop_group",
                       cfg.env.parallel_calls, tokenizer)
    log.info("environment server: %s%s", cfg.env.path, f" (tools {cfg.env.tools})" if cfg.env.tools else "")
    ready = announce(args.ready_file, args.host, "environment server", log)

    def on_term() -> None:  # at once: a step in flight is the controller's to fail
        raise SystemExit(128 + signal.SIGTERM)

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
        await serve_forever(server.service, args.host, args.port, ready)

    code = run_process_loop(serve, stop_process_telemetry)
    left = contain.stop_descendants()  # the scheduler's cgroup kill covers a SIGKILL of this process too
    if left:
        log.info("stopped %d process(es) the environment left running: %s", len(left), ", ".join(left[:8]))
    if code:  # a step still on the service's thread is not waited for
        exit_now(code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
