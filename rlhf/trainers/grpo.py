"""GRPO in one process: SFT warm start → eval → GRPO steps → eval.

The loop reads top to bottom, one line per canonical stage (DESIGN.md §2):

    weights_update → rollout → reward → reference → advantage → train

The rollout engine holds its own copy of the weights and receives the policy's weights as
safetensors bytes each step, exactly as a rollout server will over HTTP; the distributed
runtime replaces these in-process calls with RPCs without changing the stages.
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from typing import Any

import torch

from rlhf.algorithms.grpo import group_advantages
from rlhf.config import Config
from rlhf.data import PromptSampler, build_rl_batch, encode_prompts
from rlhf.evaluation import evaluate
from rlhf.models import build_model_and_tokenizer, count_parameters
from rlhf.rollout.engine import RolloutEngine
from rlhf.run_dir import StepsWriter, write_json
from rlhf.stages import StageClock
from rlhf.tasks import build_task, reward_fn
from rlhf.train.engine import TrainEngine
from rlhf.trainers.sft import run_sft
from rlhf.weights import export_state, from_safetensors_bytes, to_safetensors_bytes

log = logging.getLogger("rlhf.grpo")

STEP_COLUMNS = [
    "step", "seconds", "reward_mean", "reward_std", "equal_reward_groups", "kl", "clip_fraction",
    "entropy", "response_length", "loss", "grad_norm", "ratio_mean", "rollout_tokens", "rollout_tokens_per_s",
    "weights_update_s", "rollout_s", "reward_s", "reference_s", "advantage_s", "train_s", "eval_accuracy",
]


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)


class GRPOTrainer:
    def __init__(self, cfg: Config, run_dir: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        seed_everything(cfg.seed)
        self.model, self.tokenizer = build_model_and_tokenizer(cfg.model, seed=cfg.seed)
        self.task = build_task(cfg.task)
        self.reward = reward_fn(cfg.task.reward)
        self.sampler = PromptSampler(self.task.split("train"), seed=cfg.seed)
        self.sampling_params = {
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "top_k": cfg.rollout.top_k,
            "n": cfg.rollout.group_size,
        }
        log.info("model %s: %.2fM parameters; task %s: %d train / %d val / %d eval problems",
                 cfg.model.path or cfg.model.name, count_parameters(self.model) / 1e6, cfg.task.name,
                 len(self.task.split("train")), len(self.task.split("val")), len(self.task.split("eval")))

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start = time.perf_counter()
        sft_result = run_sft(cfg, self.model, self.tokenizer, self.task, self.reward)
        # The policy's train engine (with the warm-started model frozen as the KL reference)
        # and a rollout engine with its own copy of the weights.
        self.train_engine = TrainEngine(
            self.model, cfg.train, cfg.algorithm, temperature=cfg.rollout.temperature or 1.0,
            keep_reference=cfg.algorithm.kl_coef > 0,
        )
        rollout_seed = cfg.rollout.seed if cfg.rollout.seed >= 0 else cfg.seed + 17
        self.rollout_engine = RolloutEngine(copy.deepcopy(self.model), self.tokenizer, seed=rollout_seed)

        before = self.evaluate()
        log.info("eval accuracy before GRPO: %.3f (%d problems, greedy)", before, len(self.task.split("eval")))
        writer = StepsWriter(os.path.join(self.run_dir, "steps.csv"), STEP_COLUMNS)
        step_times, rollout_tokens, rollout_seconds = [], 0, 0.0
        try:
            for step in range(1, cfg.steps + 1):
                row = self.step(step)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                    row["eval_accuracy"] = self.evaluate()
                writer.write(row)
                step_times.append(row["seconds"])
                rollout_tokens += row["rollout_tokens"]
                rollout_seconds += row["rollout_s"]
                log.info("step %d/%d reward %.3f kl %.4f clip %.3f len %.2f %.2fs", step, cfg.steps,
                         row["reward_mean"], row["kl"], row["clip_fraction"], row["response_length"], row["seconds"])
        finally:
            writer.close()
        after = self.evaluate()
        log.info("eval accuracy after GRPO: %.3f (before %.3f, gain %+.3f)", after, before, after - before)
        summary = {
            "eval_accuracy_before": before,
            "eval_accuracy_after": after,
            "eval_problems": len(self.task.split("eval")),
            "steps": cfg.steps,
            "seconds": time.perf_counter() - start,
            "step_time_median_s": statistics.median(step_times) if step_times else 0.0,
            "rollout_tokens_per_s": rollout_tokens / rollout_seconds if rollout_seconds else 0.0,
            "seed": cfg.seed,
            **sft_result,
            "run_dir": self.run_dir,
        }
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        return summary

    def evaluate(self) -> float:
        self.sync_weights("eval")
        return evaluate(self.rollout_engine.generate, self.tokenizer, self.task.split("eval"), self.reward,
                        self.cfg.rollout.max_new_tokens)["accuracy"]

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, Any]:
        clock = StageClock()
        t0 = time.perf_counter()
        with clock.stage("weights_update"):
            self.sync_weights(str(step))
        with clock.stage("rollout"):
            examples = self.sampler.next(self.cfg.rollout.prompts_per_step)
            prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples])
            results = self.rollout_engine.generate(prompt_ids, self.sampling_params, return_logprob=True)
        with clock.stage("reward"):
            group = self.cfg.rollout.group_size
            answers = [e.answer for e in examples for _ in range(group)]
            prompts = [e.prompt for e in examples for _ in range(group)]
            completions = [self.tokenizer.decode(r["output_ids"]) for r in results]
            rewards = torch.tensor(self.reward(completions, answers, prompts), dtype=torch.float32)
            batch = build_rl_batch([p for p in prompt_ids for _ in range(group)], results, self.tokenizer.pad_token_id)
        with clock.stage("reference"):
            if self.train_engine.reference is not None:
                batch["ref_logprobs"] = self.train_engine.compute_logprobs(batch, "reference")
            if self.cfg.algorithm.old_logprobs == "recompute":
                batch["old_logprobs"] = self.train_engine.compute_logprobs(batch, "policy")
        with clock.stage("advantage"):
            batch["advantages"], adv_stats = group_advantages(rewards, group, self.cfg.algorithm.scale_by_std)
        with clock.stage("train"):
            metrics = self.train_engine.train_step(batch)
        tokens = sum(len(r["output_ids"]) for r in results)
        return {
            "step": step,
            "seconds": time.perf_counter() - t0,
            **adv_stats,
            **metrics,
            "rollout_tokens": tokens,
            "rollout_tokens_per_s": tokens / clock.seconds["rollout"],
            **{f"{k}_s": v for k, v in clock.seconds.items()},
        }

    def sync_weights(self, version: str) -> None:
        """weights_update: policy → safetensors bytes → rollout engine (the wire format of the runtime)."""
        payload = to_safetensors_bytes(export_state(self.train_engine.model if hasattr(self, "train_engine") else self.model))
        self.rollout_engine.update_weights_from_tensors(from_safetensors_bytes(payload), version)
