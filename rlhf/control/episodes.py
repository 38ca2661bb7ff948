"""Multi-turn rollout: every sample an episode of model turns and environment answers (env.path).

    episodes = Episodes(cfg.env, make_env, fanout)     # fanout: the rollout servers' /generate, spread and migrated
    memory = episodes.generate(step, examples)           # the same batch columns as one completion a prompt, and:
        loss_mask    per response token: 1 the model's, 0 an observation's (out of the loss and the KL)
        turns, tool_calls, tool_errors, env_s, env_reward   per episode

A step's episodes advance together, turn by turn: one /generate call a turn for every episode still running
(each episode's prompt, its tokens so far and the answers, n = 1; the servers' prefill computes a common prefix once),
then every environment's step on its turn's text. An episode ends when its environment says done, answers nothing,
or after env.max_turns turns; its last turn's text is the completion the reward functions score, and the
environment's rewards (if it gives any) add to theirs. The observation tokens are appended as they are
(env.max_tool_output_tokens at most), with logprob 0 and mask 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rlhf.batch import DistributedBatchMemory
from rlhf.config import EnvConfig
from rlhf.data import completion_text, encode_prompts
from rlhf.envs import Env
from rlhf.faults import fault_point
from rlhf.rollout.sglang_api import output_logprobs

log = logging.getLogger("rlhf.controller")

EPISODE_COLUMNS = ("turns_mean", "tool_calls", "tool_errors", "env_s")  # steps.csv, with an environment


def episode_columns(batch: Any) -> dict[str, float]:
    """The step's episode statistics (steps.csv); {} without an environment."""
    if "turns" not in batch.keys():
        return {}
    n = max(len(batch["turns"]), 1)
    return {"turns_mean": sum(batch["turns"]) / n, "tool_calls": sum(batch["tool_calls"]),
            "tool_errors": sum(batch["tool_errors"]), "env_s": sum(batch["env_s"])}


class Episodes:
    def __init__(self, cfg: EnvConfig, make_env: Callable[[], Env], fanout: Any) -> None:
        self.cfg, self.make_env, self.fanout = cfg, make_env, fanout
        self.stop = list(getattr(make_env(), "stop", None) or [])  # strings that end a model turn (tool_calls: a call)

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
        envs = [self.make_env() for _ in k_example]
        context, env_s = [], [0.0] * len(envs)
        for k, (env, i) in enumerate(zip(envs, k_example)):
            t0 = time.perf_counter()
            fault_point("env.reset", step=step)
            first = env.reset({"prompt": examples[i].prompt, "answer": examples[i].answer, **examples[i].fields})
            env_s[k] += time.perf_counter() - t0
            context.append(prompt_ids[i] + (tok.encode(first, add_special_tokens=False) if first else []))
        ids: list[list[int]] = [[] for _ in envs]
        lps: list[list[float]] = [[] for _ in envs]
        mask: list[list[int]] = [[] for _ in envs]
        versions: list[list[str]] = [[] for _ in envs]
        answer, turns = [""] * len(envs), [0] * len(envs)
        calls, errors, reward = [0] * len(envs), [0] * len(envs), [0.0] * len(envs)
        rewarded = False
        params = {**sampling, **({"stop": self.stop, "no_stop_trim": True} if self.stop else {})}
        running = list(range(len(envs)))
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
                fault_point("env.step", step=step)
                result = envs[k].step(answer[k])
                env_s[k] += time.perf_counter() - t0
                calls[k] += int(result.info.get("tool_calls", 0))
                errors[k] += int(result.info.get("tool_errors", 0))
                if result.reward is not None:
                    reward[k] += float(result.reward)
                    rewarded = True
                if result.done or not result.observation or turn == self.cfg.max_turns - 1:
                    continue
                seen = tok.encode(result.observation, add_special_tokens=False)[:self.cfg.max_tool_output_tokens]
                ids[k] += seen
                lps[k] += [0.0] * len(seen)
                mask[k] += [0] * len(seen)
                versions[k] += [""] * len(seen)
                still.append(k)
            running = still
            if not running:
                break
        rep = k_example
        return DistributedBatchMemory({
            "sample_index": list(range(len(rep))),
            "prompt_ids": [context[k] for k in range(len(rep))],
            "output_ids": ids, "logprobs": lps, "loss_mask": mask,
            "num_tokens": [len(context[k]) + len(ids[k]) for k in range(len(rep))],
            "prompts": [examples[i].prompt for i in rep], "answers": [examples[i].answer for i in rep],
            "fields": [examples[i].fields for i in rep], "completions": answer,
            "weight_version": [next((v for v in vs if v), "") for vs in versions],
            "token_versions": versions, "turns": turns, "tool_calls": calls, "tool_errors": errors, "env_s": env_s,
            **({"env_reward": reward} if rewarded else {}),
        }, g, strict=False)
