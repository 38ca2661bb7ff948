"""Multi-turn rollout: every sample an episode of model turns and environment answers (env.path).

    episodes = Episodes(cfg.env, fanout, services)     # fanout: the rollout servers' /generate; services.env: env-0
    memory = episodes.generate(step, examples)           # the same batch columns as one completion a prompt, and:
        loss_mask    per response token: 1 the model's, 0 an observation's (out of the loss and the KL)
        turns, tool_calls, tool_errors, env_s, env_reward   per episode

A step's episodes advance together, turn by turn: one /generate call a turn for every episode still running
(each episode's prompt, its tokens so far and the answers, n = 1; the servers' prefill computes a common prefix once),
then one /step call to the environment server (job env-0, rlhf.services.env_server) with every episode's turn text;
the environments live there, one per episode, from /reset to done (or /close). An episode ends when its environment says done, answers nothing,
or after env.max_turns turns; its last turn's text is the completion the reward functions score, and the
environment's rewards (if it gives any) add to theirs. The observation tokens are appended as they are
(env.max_tool_output_tokens at most), with logprob 0 and mask 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rlhf.analysis import WATCHDOG_REPORT_ONLY
from rlhf.batch import DistributedBatchMemory
from rlhf.config import EnvConfig, Policy
from rlhf.control.watchdog import POLL_S
from rlhf.data import completion_text, encode_prompts
from rlhf.errors import SyncStall
from rlhf.rollout.sglang_api import output_logprobs

log = logging.getLogger("rlhf.controller")

EPISODE_COLUMNS = ("turns_mean", "tool_calls", "tool_errors", "infra_errors", "dropped_groups", "env_s")  # steps.csv


def episode_columns(batch: Any) -> dict[str, float]:
    """The step's episode statistics (steps.csv; dropped_groups comes from the rollout stage); {} without an
    environment."""
    if "turns" not in batch.keys():
        return {}
    n = max(len(batch["turns"]), 1)
    return {"turns_mean": sum(batch["turns"]) / n, "tool_calls": sum(batch["tool_calls"]),
            "tool_errors": sum(batch["tool_errors"]), "infra_errors": sum(batch["infra_errors"]),
            "env_s": sum(batch["env_s"])}


class Episodes:
    def __init__(self, cfg: EnvConfig, fanout: Any, services: Any, stall_s: float = 0.0,
                 policy: Policy | None = None) -> None:
        """stall_s: runtime.watchdog_stall_s (0: no watchdog); policy: resilience (stall_stops_run)."""
        self.cfg, self.fanout, self.services, self.stall_s, self.policy = cfg, fanout, services, stall_s, policy
        self.stop: list[str] | None = None  # strings that end a model turn (tool_calls: a call), from env-0's /health
        self.dropped = 0  # groups the last batch lost to infrastructure failures (env.on_infra_error drop_group)

    def _env(self, path: str, body: dict[str, Any], step: int) -> dict[str, Any]:
        """One call to the environment server (stage rollout: the episodes are the step's rollout); a /step
        under the stall watchdog."""
        client = self.services.env
        assert client is not None, "env.path is set but the environment server (env-0) is not up"
        if path != "/step" or not self.stall_s:
            return self.fanout.loop.run(client.call(path, body, stage="rollout", step=step))[0]
        return self.fanout.loop.run(self._watched_step(client, body, step))

    async def _watched_step(self, client: Any, body: dict[str, Any], step: int) -> dict[str, Any]:
        """The stall watchdog of an environment step: one episode inside it (a tool, the environment) for
        runtime.watchdog_stall_s while the step's other episodes wait for their turn is named in seconds, not at
        timeouts.rollout_s: SyncStall with the policy's stall_stops_run, else one ERROR line and the step waits."""
        call = asyncio.ensure_future(client.call("/step", body, stage="rollout", step=step))
        reported = False
        while True:
            done, _ = await asyncio.wait([call], timeout=POLL_S)
            if done:
                return call.result()[0]
            if reported:
                continue
            try:
                busy = (await client.call("/health", method="GET", timeout_s=2.0, traced=False))[0].get("busy")
            except Exception:  # noqa: BLE001 — the step's own error says more
                continue
            if not busy or busy["for_s"] < self.stall_s:
                continue
            where = f"tool {busy['tool']!r}" if busy.get("tool") else "its environment's step"
            found = (f"env-0 has been in {where} of episode {busy['episode']} for {busy['for_s']:.1f} s at step "
                     f"{step}, while the step's other {len(body['steps']) - 1} episodes wait for their turn")
            if self.policy is not None and self.policy.stall_stops_run:
                call.cancel()
                raise SyncStall(f"stall watchdog (step {step}, stage rollout, env-0 /step): {found}")
            log.error("stall watchdog (step %d, stage rollout, env-0 /step): %s; %s", step, found,
                      WATCHDOG_REPORT_ONLY)
            reported = True

    def generate(self, step: int, examples: list[Any]) -> DistributedBatchMemory:
        """A GRPO batch: rollout.group_size episodes of every example, sampled."""
        sp = self.fanout.sampling
        self.fanout.migrated = 0
        return self._run(step, examples, self.fanout.rollout.group_size, {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "ignore_eos": sp.ignore_eos})

    def greedy(self, examples: list[Any]) -> list[str]:
        """Evaluation: one greedy episode of every example; each one's answer (its last turn's text)."""
        return self._run(-1, examples, 1, {"max_new_tokens": self.fanout.sampling.max_new_tokens,
                                           "temperature": 0.0})["completions"]

    def _run(self, step: int, examples: list[Any], g: int, sampling: dict[str, Any]) -> DistributedBatchMemory:
        fanout, tok = self.fanout, self.fanout.tokenizer
        prompt_ids = encode_prompts(tok, [e.prompt for e in examples], fanout.chat_template)
        k_example = [i for i in range(len(examples)) for _ in range(g)]  # episode k's example: a group adjacent
        if self.stop is None:
            self.stop = list(self.fanout.loop.run(self.services.env.call("/health", method="GET"))[0].get("stop") or [])
        n = len(k_example)
        ids_of = [f"{step}-{k}" for k in range(n)]  # the episodes' ids at env-0 (step -1: an evaluation's)
        t0 = time.perf_counter()
        firsts = self._env("/reset", {"episodes": [
            {"id": ids_of[k], "row": {"prompt": examples[i].prompt, "answer": examples[i].answer,
                                      **examples[i].fields}} for k, i in enumerate(k_example)]}, step)["observations"]
        env_s = [(time.perf_counter() - t0) / max(n, 1)] * n
        context = [prompt_ids[i] + (tok.encode(first, add_special_tokens=False) if first else [])
                   for i, first in zip(k_example, firsts)]
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        versions: list[list[str]] = [[] for _ in range(n)]
        answer, turns = [""] * n, [0] * n
        calls, errors, infra, reward = [0] * n, [0] * n, [0] * n, [0.0] * n
        rewarded = False
        params = {**sampling, **({"stop": self.stop, "no_stop_trim": True} if self.stop else {})}
        running, closed, dropped = list(range(n)), set(), {}
        for turn in range(self.cfg.max_turns):
            done, failed = fanout._spread(step, [context[k] + ids[k] for k in running], params, 1, True)
            if failed:
                raise failed[0][2]  # an episode cannot go on without its turn (resilience comes with env servers)
            still = []
            for pos, k in enumerate(running):
                out = done[pos][0]
                ids[k] += out["output_ids"]
                lps[k] += output_logprobs(out)
                mask[k] += [1] * len(out["output_ids"])
                versions[k] += [out["meta_info"]["weight_version"]] * len(out["output_ids"])
                answer[k] = completion_text(tok, out)
                turns[k] += 1
            t0 = time.perf_counter()
            results = self._env("/step", {"steps": [{"id": ids_of[k], "action": answer[k]} for k in running]},
                                step)["results"]
            for k in running:
                env_s[k] += (time.perf_counter() - t0) / len(running)
            last = turn == self.cfg.max_turns - 1
            for k, result in zip(running, results):
                info = result.get("info") or {}
                calls[k] += int(info.get("tool_calls", 0))
                errors[k] += int(info.get("tool_errors", 0))
                infra[k] += int(info.get("infra_errors", 0))
                if result.get("reward") is not None:
                    reward[k] += float(result["reward"])
                    rewarded = True
                if result.get("done"):
                    closed.add(k)  # env-0 closed it
                if result.get("infra_error"):  # env.on_infra_error drop_group: the episode's group leaves the batch
                    dropped.setdefault(k // g, result["infra_error"])
                if result.get("done") or not result.get("observation") or last:
                    continue
                seen = tok.encode(result["observation"], add_special_tokens=False)[:self.cfg.max_tool_output_tokens]
                ids[k] += seen
                lps[k] += [0.0] * len(seen)
                mask[k] += [0] * len(seen)
                versions[k] += [""] * len(seen)
                still.append(k)
            running = still
            if not running:
                break
        open_ids = [ids_of[k] for k in range(n) if k not in closed]  # ended here (the turn limit, no answer)
        if open_ids:
            self._env("/close", {"ids": open_ids}, step)
        rep = k_example
        memory = DistributedBatchMemory({
            "sample_index": list(range(len(rep))),
            "prompt_ids": [context[k] for k in range(len(rep))],
            "output_ids": ids, "logprobs": lps, "loss_mask": mask,
            "num_tokens": [len(context[k]) + len(ids[k]) for k in range(len(rep))],
            "prompts": [examples[i].prompt for i in rep], "answers": [examples[i].answer for i in rep],
            "fields": [examples[i].fields for i in rep], "completions": answer,
            "weight_version": [next((v for v in vs if v), "") for vs in versions],
            "token_versions": versions, "turns": turns, "tool_calls": calls, "tool_errors": errors, "infra_errors": infra,
            "env_s": env_s,
            **({"env_reward": reward} if rewarded else {}),
        }, g, strict=False)
        self.dropped = len(dropped)
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
