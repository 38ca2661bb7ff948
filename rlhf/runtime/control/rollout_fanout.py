"""RolloutFanout: the rollout stage — prompts to the rollout servers by whole groups, results in one batch.

Each server gets a contiguous chunk of the prompts with `n = group_size` (sglang's /generate), so
a GRPO group never spans two servers. With the policy's strict_rollout a server that fails or
times out fails the step here; without it (the seeds' system) a dead server's samples are
dropped and a timed-out one's are kept as aborted, with no tokens, as sglang reports aborted
requests — and the step goes on until a later stage trips over them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlhf.config import Config
from rlhf.data import build_rl_batch, completion_text, encode_prompts
from rlhf.runtime.batch_memory import DistributedBatchMemory
from rlhf.runtime.client import Client, LoopThread
from rlhf.runtime.control.services import RolloutServices
from rlhf.runtime.errors import RpcTimeout

log = logging.getLogger("rlhf.controller")

ABORTED = "aborted"  # weight_version of a sample whose request timed out (strict_rollout off)

ROLLOUT_KEYS = ["sample_index", "prompt_ids", "output_ids", "logprobs", "num_tokens", "prompts", "answers",
                "completions", "weight_version"]


class RolloutFanout:
    def __init__(self, cfg: Config, loop: LoopThread, services: RolloutServices, tokenizer: Any) -> None:
        self.cfg, self.loop, self.services, self.tokenizer = cfg, loop, services, tokenizer

    def generate(self, step: int, examples: list[Any]) -> DistributedBatchMemory:
        """One GRPO batch: group_size samples of every example, with logprobs and decoded completions."""
        cfg, g = self.cfg, self.cfg.rollout.group_size
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], cfg.task.chat_template)
        params = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
                  "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k, "n": g, "ignore_eos": cfg.rollout.ignore_eos}
        chunks = chunk(list(range(len(examples))), len(self.services.rollout))

        async def one(client: Client, idx: list[int]) -> DistributedBatchMemory:
            if not idx:
                return DistributedBatchMemory({k: [] for k in ROLLOUT_KEYS}, g)
            results, _ = await client.call("/generate", {"input_ids": [prompt_ids[i] for i in idx],
                                                         "sampling_params": params, "return_logprob": True},
                                           stage="rollout", step=step)
            rep = [i for i in idx for _ in range(g)]
            return DistributedBatchMemory({
                "sample_index": [],  # filled after concat
                "prompt_ids": [prompt_ids[i] for i in rep],
                "output_ids": [r["output_ids"] for r in results],
                "logprobs": [[lp for lp, _t, _ in r["meta_info"]["output_token_logprobs"]] for r in results],
                "num_tokens": [len(prompt_ids[i]) + len(r["output_ids"]) for i, r in zip(rep, results)],
                "prompts": [examples[i].prompt for i in rep],
                "answers": [examples[i].answer for i in rep],
                "completions": [completion_text(self.tokenizer, r) for r in results],
                "weight_version": [r["meta_info"]["weight_version"] for r in results],
            }, g, strict=False)

        strict = cfg.resilience.strict_rollout
        results = self.loop.gather(*[one(c, idx) for c, idx in zip(self.services.rollout, chunks)],
                                   return_exceptions=not strict)
        parts = []
        for r, part in enumerate(results):
            if isinstance(part, RpcTimeout):  # in-flight requests are kept, aborted, with no tokens
                log.warning("step %d: rollout-%d timed out (%s); keeping its %d samples as aborted (no tokens)",
                            step, r, part, len(chunks[r]) * g)
                parts.append(self._aborted(chunks[r], examples, prompt_ids))
                continue
            if isinstance(part, BaseException):  # the seeds' controller goes on with what it has
                log.warning("step %d: rollout-%d failed (%s: %s); continuing with the samples of the other servers",
                            step, r, type(part).__name__, part)
                continue
            parts.append(part)
        if not parts:
            raise RuntimeError(f"step {step}: every rollout server failed")
        for p in parts:
            p["sample_index"] = [0] * len(p["output_ids"])
        memory = DistributedBatchMemory.concat(parts, g)
        memory["sample_index"] = list(range(len(memory)))
        stale = {v for v in memory["weight_version"] if v not in (str(step), ABORTED)}
        if stale:
            log.warning("step %d: samples from stale weight versions %s", step, sorted(stale))
        return memory

    def _aborted(self, idx: list[int], examples: list[Any], prompt_ids: list[list[int]]) -> DistributedBatchMemory:
        """The samples of a server that timed out, as sglang reports aborted requests (no tokens yet)."""
        rep = [i for i in idx for _ in range(self.cfg.rollout.group_size)]
        return DistributedBatchMemory({
            "sample_index": [0] * len(rep), "prompt_ids": [prompt_ids[i] for i in rep], "output_ids": [[] for _ in rep],
            "logprobs": [[] for _ in rep], "num_tokens": [len(prompt_ids[i]) for i in rep],
            "prompts": [examples[i].prompt for i in rep], "answers": [examples[i].answer for i in rep],
            "completions": ["" for _ in rep], "weight_version": [ABORTED] * len(rep),
        }, self.cfg.rollout.group_size, strict=False)

    def greedy(self, examples: list[Any]) -> list[str]:
        """One greedy completion per example, in order (evaluation), spread over the rollout servers."""
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.cfg.task.chat_template)
        chunks = chunk(list(range(len(examples))), len(self.services.rollout))
        params = {"max_new_tokens": self.cfg.rollout.max_new_tokens, "temperature": 0.0}

        async def one(client: Client, idx: list[int]) -> list[dict]:
            if not idx:
                return []
            return (await client.call("/generate", {"input_ids": [prompt_ids[i] for i in idx],
                                                    "sampling_params": params}, stage="rollout"))[0]

        parts = self.loop.gather(*[one(c, idx) for c, idx in zip(self.services.rollout, chunks)])
        order = [i for idx in chunks for i in idx]
        results = [r for part in parts for r in part]
        completions = {i: completion_text(self.tokenizer, r) for i, r in zip(order, results)}
        return [completions[i] for i in range(len(examples))]


def to_batch(shard: DistributedBatchMemory, pad_id: int) -> dict[str, torch.Tensor]:
    """A shard of the rollout batch as the train ranks' padded tensors (built where first needed)."""
    results = [{"output_ids": o, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, o)]}}
               for o, lps in zip(shard["output_ids"], shard["logprobs"])]
    return build_rl_batch(shard["prompt_ids"], results, pad_id)


def chunk(items: list[int], n: int) -> list[list[int]]:
    """n contiguous, near-equal chunks."""
    bounds = [round(i * len(items) / n) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]
