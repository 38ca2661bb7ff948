"""RolloutFanout: the rollout stage — prompts to the rollout servers by whole groups, results in one batch.

Each server gets a contiguous chunk of the prompts with `n = group_size` (sglang's /generate), so
a GRPO group never spans two servers.

When a server fails or times out, the policy decides:
  - migrate_requests: its groups are generated again on the servers that answered (whole groups, so
    the batch keeps its size and group structure); samples a server returned aborted with tokens
    (finish_reason abort: /abort_request, /pause_generation) continue from the tokens they have. A span `rollout.migrate` and the steps.csv column `rollout_migrated` record it.
  - strict_rollout: what could not be migrated fails the step here, naming the server.
  - neither (the seeds' system): a dead server's samples are dropped and a timed-out one's are kept as
    aborted, with no tokens, as sglang reports aborted requests — and the step goes on until a later
    stage trips over them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rlhf import tracing
from rlhf.batch import TOKENS, DistributedBatchMemory
from rlhf.config import Policy, RolloutConfig, SamplingConfig
from rlhf.control.fleet import RolloutServices
from rlhf.data import completion_text, encode_prompts, rl_batch
from rlhf.errors import HTTPStatusError, RpcTimeout
from rlhf.rollout.sglang_api import output_logprobs
from rlhf.transport.client import Client, LoopThread

log = logging.getLogger("rlhf.controller")

ABORTED = "aborted"  # weight_version of a sample whose request timed out (strict_rollout off)

def migratable(exc: BaseException) -> bool:
    """A failure of the server, not of the request: another server may well answer the same request
    (a 4xx would be refused by every server alike)."""
    if isinstance(exc, HTTPStatusError):
        return exc.status >= 500
    return isinstance(exc, Exception)


class RolloutFanout:
    def __init__(self, rollout: RolloutConfig, sampling: SamplingConfig, chat_template: bool, policy: Policy,
                 loop: LoopThread, services: RolloutServices, tokenizer: Any) -> None:
        """rollout, sampling: their sections; chat_template: task.chat_template; policy: the resilience section."""
        self.rollout, self.sampling, self.chat_template, self.policy = rollout, sampling, chat_template, policy
        self.loop, self.services, self.tokenizer = loop, services, tokenizer
        self.episodes: Any = None  # control.episodes.Episodes with env.path: each sample a multi-turn episode
        self._waiting: dict[str, list[float]] = {}  # rollout-R -> since when each of its /generate calls waits
        self._local = threading.local()  # what one call (one thread's) counts: rollout.buffer group runs several
        self._last_migrated = 0
        self.store = False  # rollout.data_plane store (set by the controller): rows stay in the rollout servers
        self.next_row = 0  # the next row id (rollout.data_plane store: unique in the run)
        self._rows_lock = threading.Lock()

    @property
    def waiting_on(self) -> dict[str, float]:
        """rollout-R -> since when its oldest unanswered /generate call has waited (the starvation watchdog's)."""
        return {peer: min(since) for peer, since in list(self._waiting.items()) if since}

    @property
    def migrated(self) -> int:
        """Samples of the last call generated (or continued) on another server than planned: this thread's last call
        (rollout.buffer group runs several at once), or, from a thread that made none, the last call's."""
        return getattr(self._local, "migrated", self._last_migrated)

    @migrated.setter
    def migrated(self, value: int) -> None:
        self._local.migrated = self._last_migrated = value

    async def generate_on(self, client: Client, step: int, input_ids: list[list[int]],
                          sampling: dict[str, Any] | list[dict[str, Any]], logprobs: bool,
                          rows: dict[str, Any] | None = None) -> list[dict]:
        """One /generate call on one server: its results (n of each input in turn), each with `logprobs` when asked;
        rows (rollout.data_plane store): the server keeps them under these ids and answers with metadata only."""
        body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": logprobs}
        if rows is not None:
            body["rlhf_rows"] = rows
        if logprobs and self.rollout.backend == "native":
            body["return_logprob_packed"] = True  # our servers' extension: float32 logprobs, a third of the JSON
        since = time.monotonic()
        self._waiting.setdefault(client.peer, []).append(since)  # the starvation watchdog reads who has not answered
        try:
            out = (await client.call("/generate", body, stage="rollout", step=step))[0]
        finally:
            self._waiting[client.peer].remove(since)
        if logprobs:
            for res in out:
                res["logprobs"] = output_logprobs(res)
        TOKENS.add(sum(len(res["output_ids"]) + len(res.get("logprobs") or ()) for res in out))
        return out

    def _spread(self, step: int, prompt_ids: list[list[int]], params: dict[str, Any] | list[dict[str, Any]],
                per: int, logprobs: bool, rows: Any = None, first: int = 0
                ) -> tuple[dict[int, list[dict]], list[tuple[int, list[int], BaseException]]]:
        """Prompt i's `per` results (n = per) by prompt index, spread over the servers in chunks, the first chunk to
        server `first`; params: one sampling_params for all, or one per prompt. With the policy's migrate_requests
        the chunks of servers that failed go once more to those that answered. rows(prompt indices): the rlhf_rows
        of a chunk (data_plane store; each result's rlhf_row then gets `at`, the server that holds it). Returns
        (results by prompt, [(server, its prompts, error)] for what is still missing)."""
        servers = self.services.rollout
        parts = chunk(list(range(len(prompt_ids))), len(servers))
        chunks = [parts[(r - first) % len(servers)] for r in range(len(servers))]
        done: dict[int, list[dict]] = {}

        async def one(at: int, idx: list[int]) -> None:  # at: the server's index
            if not idx:
                return
            sampling = [{**params[i], "n": per} for i in idx] if isinstance(params, list) else {**params, "n": per}
            out = await self.generate_on(servers[at], step, [prompt_ids[i] for i in idx], sampling, logprobs,
                                         rows(idx) if rows is not None else None)
            if rows is not None:
                for res in out:
                    res["rlhf_row"]["at"] = at
            done.update((i, out[k * per:(k + 1) * per]) for k, i in enumerate(idx))

        outcomes = self.loop.gather(*[one(r, idx) for r, idx in enumerate(chunks)], return_exceptions=True)
        failed: list[tuple[int, list[int], BaseException]] = []
        for r, (idx, out) in enumerate(zip(chunks, outcomes)):
            if isinstance(out, BaseException):
                if not isinstance(out, Exception):
                    raise out  # cancelled, interrupted: not a server's failure
                failed.append((r, idx, out))
        if not failed or not self.policy.migrate_requests:
            return done, failed
        healthy = [r for r in range(len(servers)) if r not in {f[0] for f in failed}]
        moving = [f for f in failed if migratable(f[2])]
        if not healthy or not moving:
            return done, failed
        # a slow server need not finish what nobody waits for any more
        self.loop.gather(*[servers[r].call("/abort_request", {"abort_all": True}, timeout_s=2.0, stage="rollout",
                                           step=step) for r, _i, exc in moving if isinstance(exc, RpcTimeout)],
                         return_exceptions=True)
        moved = [i for _r, idx, _e in moving for i in idx]
        parts = chunk(moved, len(healthy))
        log.warning("step %d: migrating %d prompts (%d samples) of %s to %s", step, len(moved), len(moved) * per,
                    ", ".join(f"rollout-{r} ({type(e).__name__}: {str(e)[:200]})" for r, _i, e in moving),
                    ", ".join(f"rollout-{healthy[k]} ({len(p)})" for k, p in enumerate(parts) if p))
        with tracing.span("rollout.migrate", stage="rollout", step=step, **{
                "rlhf.from": ",".join(f"rollout-{r}" for r, _i, _e in moving),
                "rlhf.to": ",".join(f"rollout-{r}" for r in healthy), "rlhf.prompts": len(moved)}):
            again = self.loop.gather(*[one(h, p) for h, p in zip(healthy, parts)], return_exceptions=True)
        still = [f for f in failed if not migratable(f[2])]
        for h, p, out in zip(healthy, parts, again):
            if isinstance(out, BaseException):
                log.warning("step %d: migration to rollout-%d failed: %s: %s", step, h, type(out).__name__, out)
                first = next(f for f in moving if set(p) & set(f[1]))  # report the original failure first
                still.append((first[0], p, first[2]))
                continue
            self.migrated += len(p) * per
        return done, still

    def _continue_aborted(self, step: int, prompt_ids: list[list[int]], done: dict[int, list[dict]],
                          params: dict[str, Any]) -> None:
        """Samples returned aborted continue from the tokens they have (prompt + tokens as the input, the rest
        of max_new_tokens, n = 1; none: generated afresh), spread over the servers; the parts become one sample."""
        todo = [(i, j) for i, rs in sorted(done.items()) for j, res in enumerate(rs)
                if (res["meta_info"].get("finish_reason") or {}).get("type") == "abort"
                and len(res["output_ids"]) < params["max_new_tokens"]]
        if not todo:
            return
        heads = [done[i][j]["output_ids"] for i, j in todo]
        log.warning("step %d: continuing %d aborted samples from their %d tokens on the servers", step, len(todo),
                    sum(len(h) for h in heads))
        with tracing.span("rollout.migrate", stage="rollout", step=step, **{"rlhf.continued": len(todo)}):
            tails, failed = self._spread(step, [prompt_ids[i] + h for (i, _j), h in zip(todo, heads)],
                                         [{**params, "max_new_tokens": params["max_new_tokens"] - len(h)} for h in heads],
                                         1, True)
        if failed:
            log.warning("step %d: %d aborted samples could not be continued (%s); kept as they are", step,
                        sum(len(f[1]) for f in failed), type(failed[0][2]).__name__)
        for k, rs in tails.items():
            i, j = todo[k]
            head, tail = done[i][j], rs[0]
            meta = {key: v for key, v in tail["meta_info"].items() if not key.startswith("output_token_logprobs")}
            meta["completion_tokens"] = len(head["output_ids"]) + len(tail["output_ids"])
            meta["output_token_weight_versions"] = token_versions(head) + token_versions(tail)  # spans versions
            done[i][j] = {"output_ids": head["output_ids"] + tail["output_ids"], "meta_info": meta,
                          "logprobs": head["logprobs"] + tail["logprobs"]}
            self.migrated += 1

    def generate(self, step: int, examples: list[Any], first: int = 0, tag: str = "") -> DistributedBatchMemory:
        """One GRPO batch: group_size samples of every example, with logprobs and decoded completions (with an
        environment, each sample an episode: control/episodes.py). first: the server the first prompts go to; tag:
        what tells this call's episodes from another's of the same step (rollout.buffer group runs them side by
        side)."""
        if self.episodes is not None:
            return self.episodes.generate(step, examples, tag)
        g, sp = self.rollout.group_size, self.sampling
        self.migrated = 0
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.chat_template)
        params = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                  "top_k": sp.top_k, "ignore_eos": sp.ignore_eos}
        base, rows = self.next_row, None
        if self.store:  # row ids: prompt i's samples are base + i * g + j, wherever they are generated
            with self._rows_lock:
                base, self.next_row = self.next_row, self.next_row + len(prompt_ids) * g
            rows = lambda idx: {  # noqa: E731
                "step": step, "ids": [base + i * g + j for i in idx for j in range(g)],
                "answers": [examples[i].answer for i in idx], "prompts": [examples[i].prompt for i in idx],
                "fields": [examples[i].fields for i in idx]}
        done, failed = self._spread(step, prompt_ids, params, g, True, rows, first)
        if failed and self.policy.strict_rollout:
            raise failed[0][2]
        if self.policy.migrate_requests and not self.store:  # store: the tokens are not here to continue from
            self._continue_aborted(step, prompt_ids, done, params)
        for r, idx, exc in failed:
            if isinstance(exc, RpcTimeout) and self.store:
                log.warning("step %d: rollout-%d timed out (%s); its %d samples are left out (rollout.data_plane "
                            "store keeps no row without tokens)", step, r, exc, len(idx) * g)
            elif isinstance(exc, RpcTimeout):  # in-flight requests are kept, aborted, with no tokens
                log.warning("step %d: rollout-%d timed out (%s); keeping its %d samples as aborted (no tokens)",
                            step, r, exc, len(idx) * g)
                done.update((i, [{"output_ids": [], "meta_info": {"weight_version": ABORTED}, "logprobs": []}] * g)
                            for i in idx)
            else:  # the seeds' controller goes on with what it has
                log.warning("step %d: rollout-%d failed (%s: %s); continuing with the samples of the other servers",
                            step, r, type(exc).__name__, exc)
        if not done:
            raise RuntimeError(f"step {step}: every rollout server failed")
        order = sorted(done)  # prompt order: a group's samples stay adjacent
        rep = [i for i in order for _ in range(g)]
        results = [res for i in order for res in done[i]]
        memory = self._metadata(step, examples, rep, results) if self.store else DistributedBatchMemory({
            "sample_index": list(range(len(rep))),
            "prompt_ids": [prompt_ids[i] for i in rep],
            "output_ids": [r["output_ids"] for r in results],
            "logprobs": [r["logprobs"] for r in results],
            "num_tokens": [len(prompt_ids[i]) + len(r["output_ids"]) for i, r in zip(rep, results)],
            "prompts": [examples[i].prompt for i in rep],
            "answers": [examples[i].answer for i in rep],
            "fields": [examples[i].fields for i in rep],  # each row's other columns, for the reward functions
            "completions": [completion_text(self.tokenizer, r) for r in results],
            # the version of each sample's oldest token (AReaL's rule: what the staleness bound counts), and of each
            "weight_version": [(token_versions(r) or [r["meta_info"]["weight_version"]])[0] for r in results],
            "token_versions": [token_versions(r) for r in results],  # token (a continued sample spans versions)
        }, g, strict=False)
        # sync: every sample is the step's version; async: no older than the bound (rollout.max_staleness)
        oldest = step - (self.rollout.max_staleness if self.rollout.mode == "async" else 0)
        stale = {v for v in memory["weight_version"] if v != ABORTED and not (v.lstrip("-").isdigit() and
                                                                              oldest <= int(v) <= step)}
        if stale:
            log.warning("step %d: samples from stale weight versions %s (expected %s)", step, sorted(stale),
                        str(step) if oldest == step else f"{oldest} to {step}")
        return memory

    def _metadata(self, step: int, examples: list[Any], rep: list[int], results: list[dict]) -> DistributedBatchMemory:
        """rollout.data_plane store: the batch the controller keeps — where each row is, its size, reward and
        version — and no token (the train ranks fetch their rows by id: rlhf.batch.client)."""
        rows = [r["rlhf_row"] for r in results]
        return DistributedBatchMemory({
            "sample_index": list(range(len(rep))),
            "row_id": [x["id"] for x in rows],
            "row_at": [x["at"] for x in rows],
            "num_tokens": [x["prompt_tokens"] + x["completion_tokens"] for x in rows],
            "row_reward": [x["reward"] for x in rows],
            "row_rewards": [x["rewards"] for x in rows],
            "prompts": [examples[i].prompt for i in rep],
            "answers": [examples[i].answer for i in rep],
            "fields": [examples[i].fields for i in rep],
            "weight_version": [r["meta_info"].get("oldest_weight_version") or r["meta_info"]["weight_version"]
                               for r in results],
        }, self.rollout.group_size, strict=False)

    def greedy(self, examples: list[Any]) -> list[str]:
        """One greedy completion per example, in order (evaluation), spread over the rollout servers (migrated
        like a step's when a server fails); with an environment, one greedy episode each, its last turn's text."""
        if self.episodes is not None:
            return self.episodes.greedy(examples)
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.chat_template)
        done, failed = self._spread(-1, prompt_ids, {"max_new_tokens": self.sampling.max_new_tokens,
                                                     "temperature": 0.0}, 1, False)
        if failed:
            raise failed[0][2]
        return [completion_text(self.tokenizer, done[i][0]) for i in range(len(examples))]


def token_versions(result: dict[str, Any]) -> list[str]:
    """The weights version each output token was generated by: a sample continued after an abort (its head under
    one version, the rest under the next) carries them in meta_info output_token_weight_versions; any other sample's
    tokens are all of its weight_version."""
    meta = result.get("meta_info") or {}
    return list(meta.get("output_token_weight_versions") or [meta.get("weight_version")] * len(result["output_ids"]))


def to_batch(share: DistributedBatchMemory, pad_id: int) -> dict[str, torch.Tensor]:
    """A rank's share of the rollout batch as the train ranks' padded tensors (built where first needed), with
    the mini-batch of each row (rlhf.batch)."""
    batch = rl_batch(share["prompt_ids"], share["output_ids"], share["logprobs"], pad_id,
                     share["loss_mask"] if "loss_mask" in share.keys() else None)
    if "mini_batch" in share.keys():
        batch["mini_batch"] = share["mini_batch"]
    return batch


def chunk(items: list[int], n: int) -> list[list[int]]:
    """n contiguous, near-equal chunks."""
    bounds = [round(i * len(items) / n) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]
