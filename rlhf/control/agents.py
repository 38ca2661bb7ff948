"""An agent harness drives the policy (agent.path): the user's function runs each episode with an OpenAI client,
and every completion it asks for is recorded token for token and trained on.

    agents = Agents(cfg.agent, fanout, token, stall_s, policy)   # set as fanout.episodes: the rollout's samples
    batch = agents.generate(step, examples)   # rollout.group_size episodes of every example, their samples:
        prompt_ids, output_ids, logprobs, loss_mask, token_versions   each sample's tokens as the servers made them
        episode        the episode a sample belongs to (an episode may be several samples)
        agent_reward   the agent's own reward (NaN: it returned None, the reward functions score it)
    agents.greedy(examples)                   # evaluation: one episode of every example at temperature 0
    agents.close()

The gateway (rlhf/control/agent_gateway.py) is an HTTP server in the controller's process; each episode's client
has the base URL `http://127.0.0.1:PORT/e/<episode>/v1`, and every completion it asks for is made with the run's
sampling, batched with the other episodes' calls, recorded and spanned there.

An episode's calls become one sample when each call's prompt extends the previous call's prompt and output (the
tokens in between, the tool's answers and the template's markup, are the observation: logprob 0, out of the loss,
as with env.path), and several samples when one does not (a template that renders history again); each sample of an
episode gets the episode's advantage (its reward against the other episodes of its group). steps.csv: agent_calls,
agent_merged (episodes trained as one sample), agent_split (episodes trained as several).

The stall watchdog (runtime.watchdog_stall_s) names an episode whose agent has made no call for that long (its row,
its last call: an ERROR line; the agent's own tools may take that long); agent.timeout_s fails the step naming it. An agent that raises fails the step with its error, its row
and its last call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import time
from typing import Any, Callable

from opentelemetry import context as otel_context

from rlhf.batch import DistributedBatchMemory
from rlhf.config import Policy
from rlhf.control.agent_gateway import Call, Episode, Gateway
from rlhf.control.episodes import Episodes
from rlhf.control.watchdog import POLL_S
from rlhf.transport.client import LoopThread

log = logging.getLogger("rlhf.controller")

AGENT_COLUMNS = ("agent_calls", "agent_merged", "agent_split", "reward_agent")  # steps.csv


class AgentError(RuntimeError):
    """The user's agent failed an episode: which agent, which row, after which call, and its own error."""


def load_agent(spec: str) -> tuple[Callable[..., Any], bool]:
    """agent.path -> (the function, whether it is a coroutine function); ValueError says what is wrong with it."""
    from rlhf.tasks.scoring import load_module

    target, _, attr = spec.strip().rpartition(":")
    module = load_module(target, "agent")
    fn = getattr(module, attr, None)
    if not callable(fn):
        have = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"agent.path {spec!r}: {target} has no function {attr!r} (its functions: "
                         f"{', '.join(have) or 'none'})")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        where = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}" if inspect.isfunction(fn) else target
        raise ValueError(f"agent.path {spec!r} ({where}): an agent is fn(client, row), called with an OpenAI client "
                         f"and the dataset row; {attr}{inspect.signature(fn)} cannot take them") from None
    try:
        import openai  # noqa: F401 — the client the agent is given
    except ImportError:
        raise ValueError(f"agent.path {spec!r}: an agent is given an OpenAI client, and the openai package is not "
                         "installed (pip install openai)") from None
    return fn, inspect.iscoroutinefunction(fn)


def samples_of(calls: list[Call]) -> list[dict[str, Any]]:
    """An episode's calls as samples: a call whose prompt extends the sample so far (its prompt and output) joins
    it, the tokens between them as an observation (logprob 0, mask 0); any other call starts a sample."""
    samples: list[dict[str, Any]] = []
    for c in calls:
        cur = samples[-1] if samples else None
        so_far = cur["prompt_ids"] + cur["output_ids"] if cur is not None else None
        if so_far is not None and len(c.prompt_ids) >= len(so_far) and c.prompt_ids[:len(so_far)] == so_far:
            seen = c.prompt_ids[len(so_far):]
            cur["output_ids"] += seen + c.ids
            cur["logprobs"] += [0.0] * len(seen) + c.lps
            cur["loss_mask"] += [0] * len(seen) + [1] * len(c.ids)
            cur["token_versions"] += [""] * len(seen) + c.versions
            cur["turns"] += 1
        else:
            samples.append({"prompt_ids": list(c.prompt_ids), "output_ids": list(c.ids), "logprobs": list(c.lps),
                            "loss_mask": [1] * len(c.ids), "token_versions": list(c.versions), "turns": 1})
    return samples


class Agents:
    def __init__(self, spec: str, max_calls: int, timeout_s: float, fanout: Any, token: str, stall_s: float = 0.0,
                 policy: Policy | None = None) -> None:
        self.spec, self.timeout_s, self.fanout, self.token = spec, timeout_s, fanout, token
        self.stall_s, self.policy = stall_s, policy
        self.fn, self.is_async = load_agent(spec)
        self.gateway = Gateway(fanout, token, max_calls, policy)
        self.loop: LoopThread | None = None  # the agents' own event loop: theirs blocks nothing of the run's
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # a plain function's episodes
        self.http: Any = None  # one HTTP client for every episode's OpenAI client (making one is ~40 ms of CPU)

    def start(self) -> None:
        if not self.gateway.url:
            log.info("agent %s: its OpenAI endpoint is %s/e/<episode>/v1", self.spec, self.gateway.start())
        import openai

        if self.is_async and self.loop is None:
            self.loop = LoopThread("agent-loop")
            self.http = openai.DefaultAsyncHttpxClient(timeout=self.timeout_s)
        if not self.is_async and self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="agent")
            self.http = openai.DefaultHttpxClient(timeout=self.timeout_s)

    def close(self) -> None:
        """The gateway, the agents' loop or threads and their HTTP client (stop_services)."""
        self.gateway.stop()
        if self.loop is not None:  # episodes still running (a failed step's) end first: their clients close
            async def drain() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.http.aclose()

            try:
                self.loop.run(drain(), timeout=10.0)
            except concurrent.futures.TimeoutError:
                log.warning("agent: episodes still running 10 s after the run asked them to stop; left behind")
            self.loop.close()
            self.loop = None
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.http.close()
            self.pool = None

    @property
    def dropped(self) -> int:
        return 0  # an agent's episodes are never dropped: a failure fails the step

    def generate(self, step: int, examples: list[Any], tag: str = "") -> DistributedBatchMemory:
        """A GRPO batch: rollout.group_size episodes of every example (module docstring)."""
        g = self.fanout.rollout.group_size
        eps, rewards = self._run(step, examples, g, False, tag)
        return self._batch(step, examples, g, eps, rewards)

    def greedy(self, examples: list[Any]) -> list[str]:
        """Evaluation: one episode of every example at temperature 0; each one's last completion's text."""
        eps, _rewards = self._run(-1, examples, 1, True)
        return [ep.calls[-1].text for ep in eps]

    def _run(self, step: int, examples: list[Any], g: int, greedy: bool, tag: str = ""
             ) -> tuple[list[Episode], list[float]]:
        self.start()
        gw = self.gateway
        self.fanout.migrated = 0
        gw.dead, gw.migrated = set(), 0
        eps = [Episode(f"{step}-{tag}{k}", k, {"prompt": examples[k // g].prompt, "answer": examples[k // g].answer,
                                               **examples[k // g].fields}, step, greedy)
               for k in range(g * len(examples))]
        here = otel_context.get_current()
        for e in eps:
            e.trace = here
        with gw.lock:
            gw.episodes.update({e.id: e for e in eps})
        try:
            rewards = self._wait(step, eps, [self._launch(e) for e in eps])
        finally:
            with gw.lock:
                for e in eps:
                    gw.episodes.pop(e.id, None)
        self.fanout.migrated = gw.migrated
        return eps, rewards

    def _launch(self, ep: Episode) -> concurrent.futures.Future:
        import openai

        url, timeout = f"{self.gateway.url}/e/{ep.id}/v1", self.timeout_s
        if self.is_async:
            assert self.loop is not None

            async def one() -> Any:  # the shared HTTP client stays open: it is closed with the run's agents
                client = openai.AsyncOpenAI(base_url=url, api_key=self.token, max_retries=0, timeout=timeout,
                                            http_client=self.http)
                return await self.fn(client, dict(ep.row))

            return asyncio.run_coroutine_threadsafe(one(), self.loop.loop)

        def plain() -> Any:
            client = openai.OpenAI(base_url=url, api_key=self.token, max_retries=0, timeout=timeout,
                                   http_client=self.http)
            return self.fn(client, dict(ep.row))

        assert self.pool is not None
        return self.pool.submit(plain)

    def _wait(self, step: int, eps: list[Episode], futures: list[concurrent.futures.Future]) -> list[float]:
        """Every episode's reward (NaN: none returned); the first failure (a server's before the agent's, which it
        caused), a stall past agent.timeout_s or the watchdog's finding fails the step, the others cancelled."""
        try:
            while True:
                done, _ = concurrent.futures.wait(futures, POLL_S, return_when=concurrent.futures.FIRST_EXCEPTION)
                for ep, f in zip(eps, futures):
                    if f.done() and f.exception() is not None:
                        self._failed(step, ep, f.exception())
                if len(done) == len(futures):
                    break
                now = time.monotonic()
                for ep, f in zip(eps, futures):
                    if f.done():
                        continue
                    if now - ep.started > self.timeout_s:
                        raise AgentError(f"step {step}: agent {self.spec} ran episode {ep.id} (row {ep.k}: "
                                         f"{ep.row['prompt']!r}) past agent.timeout_s {self.timeout_s:g} s; its "
                                         f"last call: {ep.last_call()}")
                    if self.stall_s and not ep.warned and not ep.in_flight and now - ep.last > self.stall_s:
                        ep.warned = True  # named, not stopped: an agent's own tool may think that long
                        log.error("stall watchdog (step %d, stage rollout, agent): agent %s has made no call in "
                                  "episode %s (row %d: %r) for %.1f s; its last call: %s; %d of %d episodes ended "
                                  "meanwhile (agent.timeout_s %g s fails the step)", step, self.spec, ep.id, ep.k,
                                  ep.row["prompt"], now - ep.last, ep.last_call(), sum(x.done() for x in futures),
                                  len(futures), self.timeout_s)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        rewards = []
        for ep, f in zip(eps, futures):
            value = f.result()
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise AgentError(f"step {step}: agent {self.spec} returned {value!r} for episode {ep.id} (row "
                                 f"{ep.k}); an agent returns its episode's reward (a number) or None (the reward "
                                 "functions score its last completion)")
            if not ep.calls:
                raise AgentError(f"step {step}: agent {self.spec} ended episode {ep.id} (row {ep.k}: "
                                 f"{ep.row['prompt']!r}) without a completion: nothing to train on (an agent calls "
                                 "the model at least once)")
            rewards.append(math.nan if value is None else float(value))
        return rewards

    def _failed(self, step: int, ep: Episode, exc: BaseException) -> None:
        if ep.infra is not None:  # the agent failed on a rollout server's failure: that is the step's error
            raise ep.infra
        raise AgentError(f"step {step}: agent {self.spec} failed episode {ep.id} (row {ep.k}: {ep.row['prompt']!r}) "
                         f"after {len(ep.calls)} call(s); its last call: {ep.last_call()}: {type(exc).__name__}: "
                         f"{exc}") from exc

    def _batch(self, step: int, examples: list[Any], g: int, eps: list[Episode], rewards: list[float]
               ) -> DistributedBatchMemory:
        rows: list[dict[str, Any]] = []
        for ep, reward in zip(eps, rewards):
            e = examples[ep.k // g]
            for s in samples_of(ep.calls):
                rows.append({**s, "episode": ep.k, "agent_reward": reward, "agent_calls": len(ep.calls),
                             "completions": ep.calls[-1].text, "prompts": e.prompt, "answers": e.answer,
                             "fields": e.fields})
        columns = ("prompt_ids", "output_ids", "logprobs", "loss_mask", "token_versions", "episode",
                   "agent_reward", "agent_calls", "completions", "prompts", "answers", "fields")
        memory = DistributedBatchMemory({
            "sample_index": list(range(len(rows))), **{c: [r[c] for r in rows] for c in columns},
            "num_tokens": [len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows],
            "weight_version": [next((v for v in r["token_versions"] if v), "") for r in rows],
        }, g if len(rows) == len(eps) else 1, strict=False)
        return memory


def agent_columns(batch: Any) -> dict[str, float]:
    """The step's agent statistics (steps.csv; reward_agent is the reward stage's); {} without an agent."""
    if "episode" not in batch.keys():
        return {}
    samples: dict[int, int] = {}  # per episode
    calls = 0
    for episode, n in zip(batch["episode"], batch["agent_calls"]):
        calls += n if episode not in samples else 0
        samples[episode] = samples.get(episode, 0) + 1
    return {"agent_calls": calls, "agent_merged": sum(n == 1 for n in samples.values()),
            "agent_split": sum(n > 1 for n in samples.values())}


def multi_turn(cfg: Any, fanout: Any, services: Any, token: str) -> Episodes | Agents | None:
    """What makes each sample more than one completion: an environment's episodes (env.path), an agent's
    (agent.path), or neither (the config allows one at most)."""
    if cfg.env.path:
        return Episodes(cfg.env, fanout, services, cfg.runtime.watchdog_stall_s, cfg.resilience)
    if cfg.agent.path:
        return Agents(cfg.agent.path, cfg.agent.max_calls, cfg.agent.timeout_s, fanout, token,
                      cfg.runtime.watchdog_stall_s, cfg.resilience)
    return None
