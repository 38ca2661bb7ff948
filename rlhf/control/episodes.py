"""Multi-turn rollout: every sample an episode of model turns and environment answers (env.path).

    episodes = Episodes(cfg.env, fanout, services)     # fanout: the rollout servers' /generate; services.env: env-0
    memory = episodes.generate(step, examples)           # the same batch columns as one completion a prompt, and:
        loss_mask    per response token: 1 the model's, 0 an observation's (out of the loss and the KL)
        turns, tool_calls, tool_errors, infra_errors, infra_retries, env_s, env_reward   per episode

A step's episodes advance independently of each other. Each rollout server takes the episodes that are ready for
their next turn (all of them at first; its share when several servers are free) in one /generate call (each
episode's prompt, its tokens so far and the answers, n = 1; the servers' prefill computes a common prefix once);
each episode's turn then goes to the environment server (job env-0, rlhf.services.env_server) in a /step call of its
own, and the episode is ready again when its answer is back. A free server waits up to env.batch_wait_s for episodes whose
steps are still running, so a turn's episodes stay in one batch unless one of them is slow: a long-tail tool call
holds its own episode, not the others' turns nor the servers (the step still ends with its slowest episode). The
environments live at env-0, one per episode, from /reset to done (or /close). An episode ends when its environment
says done, answers nothing, or after env.max_turns turns; its last turn's text is the completion the reward functions
score, and the environment's rewards (if it gives any) add to theirs. The observation tokens are appended as they are
(env.max_tool_output_tokens at most), with logprob 0 and mask 0.

A rollout server that fails a turn's call (resilience.migrate_requests) leaves the step: its episodes' turns go to
the others (steps.csv rollout_migrated); without the policy, or with no server left, the step fails on it. The stall
watchdog (runtime.watchdog_stall_s) names an episode whose environment step has run that long: the episode, the tool
(from env-0's /health) and what the step's other episodes did meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from rlhf.analysis import WATCHDOG_REPORT_ONLY
from rlhf.batch import DistributedBatchMemory
from rlhf.config import EnvConfig, Policy
from rlhf.control.rollout_fanout import migratable, token_versions
from rlhf.control.watchdog import POLL_S
from rlhf.data import completion_text, encode_prompts
from rlhf.errors import SyncStall

log = logging.getLogger("rlhf.controller")

EPISODE_COLUMNS = ("turns_mean", "tool_calls", "tool_errors", "infra_errors", "infra_retries", "dropped_groups",
                   "env_s")  # steps.csv


def episode_columns(batch: Any) -> dict[str, float]:
    """The step's episode statistics (steps.csv; dropped_groups comes from the rollout stage); {} without an
    environment."""
    if "turns" not in batch.keys():
        return {}
    n = max(len(batch["turns"]), 1)
    return {"turns_mean": sum(batch["turns"]) / n, "tool_calls": sum(batch["tool_calls"]),
            "tool_errors": sum(batch["tool_errors"]), "infra_errors": sum(batch["infra_errors"]),
            "infra_retries": sum(batch["infra_retries"]), "env_s": sum(batch["env_s"])}


class Episodes:
    def __init__(self, cfg: EnvConfig, fanout: Any, services: Any, stall_s: float = 0.0,
                 policy: Policy | None = None) -> None:
        """stall_s: runtime.watchdog_stall_s (0: no watchdog); policy: resilience (stall_stops_run)."""
        self.cfg, self.fanout, self.services, self.stall_s, self.policy = cfg, fanout, services, stall_s, policy
        self.stop: list[str] | None = None  # strings that end a model turn (tool_calls: a call), from env-0's /health
        self._local = threading.local()  # what one call (one thread's) counts: rollout.buffer group runs several

    def _env(self, path: str, body: dict[str, Any], step: int) -> dict[str, Any]:
        """One call to the environment server (stage rollout: the episodes are the step's rollout)."""
        client = self.services.env
        assert client is not None, "env.path is set but the environment server (env-0) is not up"
        return self.fanout.loop.run(client.call(path, body, stage="rollout", step=step))[0]

    def _stalled(self, step: int, episode: str, for_s: float, tool: str | None, others: str) -> None:
        """The stall watchdog's finding: SyncStall with the policy's stall_stops_run, else one ERROR line."""
        where = f"tool {tool!r}" if tool else "its environment's step"
        found = f"env-0 has been in {where} of episode {episode} for {for_s:.1f} s at step {step}, while {others}"
        if self.policy is not None and self.policy.stall_stops_run:
            raise SyncStall(f"stall watchdog (step {step}, stage rollout, env-0 /step): {found}")
        log.error("stall watchdog (step %d, stage rollout, env-0 /step): %s; %s", step, found, WATCHDOG_REPORT_ONLY)

    async def _drive(self, step: int, run: _Run, ids_of: list[str], params: dict[str, Any], g: int) -> None:
        """Every episode to its end: the rollout servers' workers generate the ready episodes' turns, each turn's
        environment step its own /step call, the watchdog beside them; the first failure cancels the rest."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Condition()
        servers = list(self.fanout.services.rollout)
        alive = set(range(len(servers)))
        wait_s = self.cfg.batch_wait_s
        for k in run.ready:
            run.ready[k] = loop.time()

        async def worker(tasks: asyncio.TaskGroup, r: int) -> None:
            while True:
                async with changed:
                    run.idle += 1
                    # wait for a ready episode, then (up to env.batch_wait_s from the oldest) for those still stepping
                    await changed.wait_for(lambda: run.left == 0 or run.ready)
                    while run.left and run.stepping and loop.time() < min(run.ready.values()) + wait_s:
                        try:
                            await asyncio.wait_for(changed.wait(), min(run.ready.values()) + wait_s - loop.time())
                        except TimeoutError:
                            break
                        if not run.ready:
                            await changed.wait_for(lambda: run.left == 0 or run.ready)
                    if run.left == 0:
                        run.idle -= 1
                        return
                    share = -(-len(run.ready) // max(run.idle, 1))  # the free servers split what is ready
                    take = sorted(run.ready)[:share]
                    for k in take:
                        del run.ready[k]
                    run.idle -= 1
                try:  # each episode's turn gets what its turn has left of max_new_tokens (an aborted one goes on)
                    outs = await self.fanout.generate_on(
                        servers[r], step, [run.context[k] + run.ids[k] for k in take],
                        [{**params, "n": 1, "max_new_tokens": run.budget[k] or params["max_new_tokens"]} for k in take],
                        True)
                except Exception as exc:
                    alive.discard(r)
                    if not (self.policy is not None and self.policy.migrate_requests and alive and migratable(exc)):
                        raise
                    log.warning("step %d: rollout-%d failed a turn of %d episodes (%s: %s); it leaves the step, "
                                "their turns go to %s", step, r, len(take), type(exc).__name__, str(exc)[:200],
                                ", ".join(f"rollout-{a}" for a in sorted(alive)))
                    run.migrated += len(take)  # (on the loop's thread: the caller adds it up)
                    async with changed:
                        run.ready.update((k, loop.time()) for k in take)
                        changed.notify_all()
                    return
                stepping = []
                for k, out in zip(take, outs):
                    if self._took_turn(run, k, out, params["max_new_tokens"]):
                        run.stepping[k] = loop.time()
                        stepping.append(k)
                if len(stepping) < len(take):  # turns aborted by a pause (rollout.interrupt abort): on from their tokens
                    async with changed:
                        run.ready.update((k, loop.time()) for k in take if k not in stepping)
                        changed.notify_all()
                if stepping:
                    tasks.create_task(self._steps(run, stepping, ids_of, step, g, changed))

        async def watchdog() -> None:
            named: set[str] = set()
            while run.left:
                async with changed:
                    try:
                        await asyncio.wait_for(changed.wait_for(lambda: run.left == 0), POLL_S)
                    except TimeoutError:
                        pass
                now = loop.time()
                if not any(now - since >= self.stall_s for since in run.stepping.values()):
                    continue
                try:  # which episode env-0 has been stepping longest (not those queued for its threads), in which tool
                    busy = (await self.services.env.call("/health", method="GET", timeout_s=2.0, traced=False))[0]["busy"]
                except Exception:  # noqa: BLE001 — the step's own error says more
                    continue
                if not busy or busy["for_s"] < self.stall_s or busy["episode"] in named:
                    continue
                named.add(busy["episode"])
                self._stalled(step, busy["episode"], busy["for_s"], busy.get("tool"),
                              f"the step's other {run.n - 1} episodes went on ({run.n - run.left} of them ended)")

        try:
            async with asyncio.TaskGroup() as tasks:
                for r in range(len(servers)):
                    tasks.create_task(worker(tasks, r))
                if self.stall_s:
                    tasks.create_task(watchdog())
        except BaseExceptionGroup as group:  # the first failure, as it was raised
            first = group.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        if run.left:  # every server left the step
            raise RuntimeError(f"step {step}: every rollout server failed; {run.left} episodes did not end")

    def _took_turn(self, run: _Run, k: int, out: dict[str, Any], max_new_tokens: int) -> bool:
        """Episode k's turn (or its part) appended, each token with the weights version that generated it; whether
        the turn is over (False: aborted with tokens to go, by a pause with rollout.interrupt abort, and the policy's
        migrate_requests: it goes on from its tokens)."""
        new = out["output_ids"]
        run.ids[k] += new
        run.lps[k] += out["logprobs"]
        run.mask[k] += [1] * len(new)
        run.versions[k] += token_versions(out)
        left = (run.budget[k] or max_new_tokens) - len(new)
        aborted = (out["meta_info"].get("finish_reason") or {}).get("type") == "abort"
        if aborted and left > 0 and self.policy is not None and self.policy.migrate_requests:
            run.budget[k] = left
            run.turn_ids[k] += new
            return False
        run.answer[k] = completion_text(self.fanout.tokenizer, {**out, "output_ids": run.turn_ids[k] + new})
        run.budget[k], run.turn_ids[k] = 0, []
        run.turns[k] += 1
        return True

    async def _steps(self, run: _Run, ks: list[int], ids_of: list[str], step: int, g: int,
                     changed: asyncio.Condition) -> None:
        """The turns of episodes ks at env-0: one /step for them all; each is ready for its next turn (or has ended)
        when its result is back. env-0 answers with those that end first (env.batch_wait_s after the first) and
        leaves the rest pending, collected by /results the same way: a slow one holds only itself."""
        client, hold = self.services.env, self.cfg.batch_wait_s
        of = {ids_of[k]: k for k in ks}
        t0 = time.perf_counter()
        reply = (await client.call("/step", {"steps": [{"id": ids_of[k], "action": run.answer[k]} for k in ks],
                                             "hold_s": hold}, stage="rollout", step=step))[0]
        while True:
            for episode, result in reply["results"].items():
                run.env_s[of[episode]] += time.perf_counter() - t0
                await self._stepped(run, of[episode], result, g, changed)
            if not reply["pending"]:
                return
            reply = (await client.call("/results", {"ids": reply["pending"], "hold_s": hold}, stage="rollout",
                                       step=step))[0]

    async def _stepped(self, run: _Run, k: int, result: dict[str, Any], g: int, changed: asyncio.Condition) -> None:
        """Episode k's turn answered: counted, its observation appended; ready for its next turn or ended."""
        info = result.get("info") or {}
        run.calls[k] += int(info.get("tool_calls", 0))
        run.errors[k] += int(info.get("tool_errors", 0))
        run.infra[k] += int(info.get("infra_errors", 0))
        run.retries[k] += int(info.get("infra_retries", 0))
        if result.get("reward") is not None:
            run.reward[k] += float(result["reward"])
            run.rewarded = True
        if result.get("done"):
            run.closed.add(k)  # env-0 closed it
        if result.get("infra_error"):  # env.on_infra_error drop_group: the episode's group leaves the batch
            run.dropped.setdefault(k // g, result["infra_error"])
        goes_on = not result.get("done") and result.get("observation") and run.turns[k] < self.cfg.max_turns
        if goes_on:
            seen = self.fanout.tokenizer.encode(result["observation"],
                                                add_special_tokens=False)[:self.cfg.max_tool_output_tokens]
            run.ids[k] += seen
            run.lps[k] += [0.0] * len(seen)
            run.mask[k] += [0] * len(seen)
            run.versions[k] += [""] * len(seen)
        async with changed:
            del run.stepping[k]
            if goes_on:
                run.ready[k] = asyncio.get_running_loop().time()
            else:
                run.left -= 1
            changed.notify_all()

    def close(self) -> None:
        """Nothing of its own to stop: env-0 is a job of the fleet's."""

    @property
    def dropped(self) -> int:
        """Groups this thread's last batch lost to infrastructure failures (env.on_infra_error drop_group)."""
        return getattr(self._local, "dropped", 0)

    def generate(self, step: int, examples: list[Any], tag: str = "") -> DistributedBatchMemory:
        """A GRPO batch: rollout.group_size episodes of every example, sampled; tag: in its episodes' ids at env-0,
        what tells them from another call's of the same step."""
        sp = self.fanout.sampling
        self.fanout.migrated = 0
        return self._run(step, examples, self.fanout.rollout.group_size, {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "ignore_eos": sp.ignore_eos}, tag)

    def greedy(self, examples: list[Any]) -> list[str]:
        """Evaluation: one greedy episode of every example; each one's answer (its last turn's text)."""
        return self._run(-1, examples, 1, {"max_new_tokens": self.fanout.sampling.max_new_tokens,
                                           "temperature": 0.0})["completions"]

    def _run(self, step: int, examples: list[Any], g: int, sampling: dict[str, Any], tag: str = ""
             ) -> DistributedBatchMemory:
        fanout, tok = self.fanout, self.fanout.tokenizer
        prompt_ids = encode_prompts(tok, [e.prompt for e in examples], fanout.chat_template)
        k_example = [i for i in range(len(examples)) for _ in range(g)]  # episode k's example: a group adjacent
        if self.stop is None:
            self.stop = list(self.fanout.loop.run(self.services.env.call("/health", method="GET"))[0].get("stop") or [])
        n = len(k_example)
        ids_of = [f"{step}-{tag}{k}" for k in range(n)]  # the episodes' ids at env-0 (step -1: an evaluation's)
        t0 = time.perf_counter()
        firsts = self._env("/reset", {"episodes": [
            {"id": ids_of[k], "row": {"prompt": examples[i].prompt, "answer": examples[i].answer,
                                      **examples[i].fields}} for k, i in enumerate(k_example)]}, step)["observations"]
        run = _Run(n, (time.perf_counter() - t0) / max(n, 1))
        run.context = [prompt_ids[i] + (tok.encode(first, add_special_tokens=False) if first else [])
                       for i, first in zip(k_example, firsts)]
        params = {**sampling, **({"stop": self.stop, "no_stop_trim": True} if self.stop else {})}
        self.fanout.loop.run(self._drive(step, run, ids_of, params, g))
        self.fanout.migrated += run.migrated
        open_ids = [ids_of[k] for k in range(n) if k not in run.closed]  # ended here (the turn limit, no answer)
        if open_ids:
            self._env("/close", {"ids": open_ids}, step)
        rep, dropped = k_example, run.dropped
        memory = DistributedBatchMemory({
            "sample_index": list(range(n)),
            "prompt_ids": run.context, "output_ids": run.ids, "logprobs": run.lps, "loss_mask": run.mask,
            "num_tokens": [len(run.context[k]) + len(run.ids[k]) for k in range(n)],
            "prompts": [examples[i].prompt for i in rep], "answers": [examples[i].answer for i in rep],
            "fields": [examples[i].fields for i in rep], "completions": run.answer,
            "weight_version": [next((v for v in vs if v), "") for vs in run.versions],
            "token_versions": run.versions, "turns": run.turns, "tool_calls": run.calls, "tool_errors": run.errors,
            "infra_errors": run.infra, "infra_retries": run.retries, "env_s": run.env_s,
            **({"env_reward": run.reward} if run.rewarded else {}),
        }, g, strict=False)
        self._local.dropped = len(dropped)
        if not dropped:
            return memory
        if step < 0:  # evaluation: an example whose episode the infrastructure ended counts as not answered
            log.warning("evaluation: %d of %d episodes ended by an infrastructure failure count as wrong; first: %s",
                        len(dropped), len(examples), next(iter(dropped.values())))
            memory["completions"] = ["" if k // g in dropped else a for k, a in enumerate(memory["completions"])]
            return memory
        if len(dropped) == len(examples):
            raise RuntimeError(f"step {step}: every group lost an episode to an infrastructure failure (env-0): "
                               f"{next(iter(dropped.values()))}")
        log.warning("step %d: dropped %d of %d groups, each with an episode an infrastructure failure ended "
                    "(env.on_infra_error drop_group); first: %s", step, len(dropped), len(examples),
                    next(iter(dropped.values())))
        kept = memory.groups([i for i in range(len(examples)) if i not in dropped])
        kept["sample_index"] = list(range(len(kept)))  # the batch's rows, numbered again
        return kept


class _Run:
    """A step's episodes as they go: each one's tokens, logprobs, mask, versions and counts, and who is where."""

    def __init__(self, n: int, reset_s: float) -> None:
        self.n = n
        self.context: list[list[int]] = []
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.mask: list[list[int]] = [[] for _ in range(n)]
        self.versions: list[list[str]] = [[] for _ in range(n)]
        self.answer, self.turns = [""] * n, [0] * n
        self.calls, self.errors, self.infra, self.reward = [0] * n, [0] * n, [0] * n, [0.0] * n
        self.retries = [0] * n
        self.budget = [0] * n  # tokens left in a turn an abort cut (0: a new turn, sampling.max_new_tokens)
        self.turn_ids: list[list[int]] = [[] for _ in range(n)]  # an aborted turn's tokens so far
        self.env_s = [reset_s] * n
        self.rewarded = False
        self.closed: set[int] = set()  # env-0 closed them (done)
        self.dropped: dict[int, str] = {}  # group -> the infrastructure failure that ended one of its episodes
        self.ready: dict[int, float] = {k: 0.0 for k in range(n)}  # waiting for a turn: since (loop time)
        self.stepping: dict[int, float] = {}  # at env-0 now: since
        self.left = n  # episodes not ended
        self.migrated = 0  # episodes whose turn went to another server than planned
        self.idle = 0  # rollout servers waiting for episodes
