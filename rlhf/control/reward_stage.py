"""The reward stage: every sample's reward from the task's reward functions and the reward model's score, and
dynamic sampling's swap of the groups that carry no advantage (algorithm.resample_rounds, DAPO's).

    stage = RewardStage(cfg.reward, cfg.reward_model, cfg.rollout.group_size, cfg.algorithm.resample_rounds, loop, fleet,
                        survival)   # survival: reward-0 lost in a /score starts again (restart_rollout)
    batch["rewards"] = stage.score(step, batch, row)
    batch = stage.resample(step, batch, row, draw, generate, clock)   # before rollout_end
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlhf import tracing
from rlhf.algorithms.grpo import equal_groups
from rlhf.batch import StepBatch
from rlhf.config import RewardConfig, RewardModelConfig
from rlhf.control.fleet import RolloutServices
from rlhf.control.survival import RolloutSurvival
from rlhf.faults import fault_point
from rlhf.tasks.scoring import row_fields, scorer_of
from rlhf.transport.client import LoopThread


class RewardStage:
    def __init__(self, reward_cfg: RewardConfig, model_cfg: RewardModelConfig, group_size: int, resample_rounds: int,
                 loop: LoopThread, fleet: RolloutServices, survival: RolloutSurvival | None = None) -> None:
        self.reward = scorer_of(reward_cfg)  # the run's rewards, weighted (rlhf.tasks.scoring)
        self.model_weight = model_cfg.weight
        self.group_size, self.resample_rounds = group_size, resample_rounds
        self.loop, self.fleet, self.survival = loop, fleet, survival
        # steps.csv: what dynamic sampling did, then each reward function's mean (and the reward model's)
        self.columns = ["resampled_groups", "resample_prompts", "equal_groups_trained", *self.reward.labels,
                        *(["reward_model"] if model_cfg.path else [])]

    def score(self, step: int, batch: StepBatch, row: dict[str, Any] | None) -> torch.Tensor:
        """Every sample's reward: the reward functions (and the reward model's weighted score). Each function's
        mean goes to `row` (steps.csv reward_<name>) and the stage's span, unless row is None."""
        fault_point("reward.compute", step=step)
        if "row_reward" in batch.keys():  # rollout.data_plane store: scored where the rows are, beside them
            rewards = torch.tensor(batch["row_reward"], dtype=torch.float32)
            parts = batch["row_rewards"]
            means = {label: sum(p[label] for p in parts) / max(len(parts), 1) for label in self.reward.labels}
        else:
            rewards = torch.tensor(self.reward(batch["completions"], batch["answers"], batch["prompts"],
                                               row_fields(batch["fields"])))
            means = dict(self.reward.means)
        if "env_reward" in batch.keys():  # an environment's rewards (env.path) add to the functions'
            env_reward = torch.tensor(batch["env_reward"], dtype=rewards.dtype)
            rewards = rewards + env_reward
            means["reward_env"] = float(env_reward.mean())
        if "agent_reward" in batch.keys():  # an agent's own reward (agent.path) is its episode's; NaN: it left it
            own = torch.tensor(batch["agent_reward"], dtype=rewards.dtype)
            rewards = torch.where(torch.isnan(own), rewards, own)
            if not bool(torch.isnan(own).all()):
                means["reward_agent"] = float(own[~torch.isnan(own)].mean())
        if self.fleet.reward is not None:
            def scores_of() -> torch.Tensor:
                return self._reward_model_scores(step, batch["prompts"], batch["completions"])

            scores = scores_of() if self.survival is None else self.survival.survive_service(
                step, row if row is not None else {}, "the reward model's scores", scores_of)
            rewards = rewards + self.model_weight * scores
            means["reward_model"] = float(scores.mean())
        if row is not None:
            row.update(means)
            span = tracing.trace.get_current_span()
            for key, value in means.items():
                span.set_attribute(f"rlhf.{key}", value)
        return rewards

    def _reward_model_scores(self, step: int, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """reward-0's score of each completion (reward_model.path): one /score call for the step's batch."""
        assert self.fleet.reward is not None
        reply = self.loop.run(self.fleet.reward.call("/score", {"prompts": list(prompts),
                                                                "completions": list(completions)},
                                                     stage="reward", step=step))[0]
        scores = reply.get("scores")
        if not isinstance(scores, list) or len(scores) != len(completions):
            raise RuntimeError(f"reward-0 answered /score with {len(scores) if isinstance(scores, list) else scores!r} "
                               f"scores for {len(completions)} completions")
        return torch.tensor(scores, dtype=torch.float32)

    def resample(self, step: int, batch: StepBatch, row: dict[str, Any], draw: Callable[[int], list[Any]],
                 generate: Callable[[list[Any]], StepBatch], clock: Any) -> StepBatch:
        """Dynamic sampling: each round draws (`draw(n)`) as many fresh prompts as the batch has groups whose
        samples all got one reward, generates them (`generate`), and puts those of their groups that did not in
        the equal groups' places; a group still equal after the last round stays (it adds only its KL). The batch
        keeps its size and order of groups; `resampled_groups` counts the groups replaced, `resample_prompts` the
        prompts drawn, `equal_groups_trained` the equal groups left in the batch trained on."""
        g = self.group_size
        replaced = drawn = 0
        for _ in range(self.resample_rounds):
            equal = equal_groups(batch["rewards"], g) if batch.group_size == g else []
            if not equal:  # none; or an agent's episodes as several samples each: groups cannot be swapped whole
                break
            with clock.stage("rollout"):
                examples = draw(len(equal))
                extra = generate(examples)
            drawn += len(examples)
            with clock.stage("reward"):
                extra["rewards"] = self.score(step, extra, None)
            if extra.group_size != g:  # an agent's episodes as several samples: the batch stays as it is
                break
            still = set(equal_groups(extra["rewards"], g))
            swap = dict(zip(equal, [i for i in range(len(extra) // g) if i not in still]))
            if swap:  # one take from both: group i stays, or becomes extra's group swap[i] (after batch's groups)
                n = len(batch) // g
                batch = StepBatch.concat([batch, extra], g, strict=False).groups(
                    [n + swap[i] if i in swap else i for i in range(n)])
                replaced += len(swap)
        batch["sample_index"] = list(range(len(batch)))
        if "episode" in batch.keys() and batch.group_size == g:  # an agent's, one sample each: numbered again
            batch["episode"] = list(range(len(batch)))
        row["resampled_groups"], row["resample_prompts"] = replaced, drawn
        row["equal_groups_trained"] = len(equal_groups(batch["rewards"], g)) if batch.group_size == g else 0
        return batch
