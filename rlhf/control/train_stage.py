"""The train side of a step, from the scored batch to the trained policy: the batch path, the reference and
recomputed logprobs, the advantages, the train step on every rank.

    stage = TrainStage(cfg.algorithm, cfg.rollout.group_size, cfg.train.mini_batches, workers, pad_id)
    shares, split = stage.split(step, batch)       # reward stage: global batch → mini-batches → each over the dp
                                                   # ranks, token-balanced inside each (rlhf.batch)
    stats = stage.advantages(batch, shares, first)  # advantage stage: the whole batch's, a column of every share
    batches = stage.logprobs(step, shares, row)     # reference stage: reference (KL on), old-policy (recompute)
    metrics = stage.train(step, batches)            # train stage: every rank's train_step, merged

Each rank's train tensors are built once, where the logprob passes first need them (to_batch), with the
advantages and the mini-batch of each row already columns of its share.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

import torch

from rlhf.algorithms.grpo import ADVANTAGE_COLUMNS, group_advantages
from rlhf.batch import TOKENS, StepBatch
from rlhf.config import AlgorithmConfig
from rlhf.control.rollout_fanout import to_batch
from rlhf.control.workers import TRAIN_COLUMNS, WorkerGroup, logprob_diff, merge_train_metrics
from rlhf.faults import fault_point

log = logging.getLogger("rlhf.controller")
SLOW = 2.0  # rebalance_stragglers: a share this many times the median's compute a token is cut (noise stays under)


class TrainStage:
    columns = (*ADVANTAGE_COLUMNS, *TRAIN_COLUMNS, "rebalanced")  # steps.csv: the advantages' statistics, the train
                                                                    # metrics, shares cut for a slow rank

    def __init__(self, algorithm: AlgorithmConfig, group_size: int, mini_batches: int, workers: WorkerGroup,
                 pad_id: int, stores: Callable[[], list[str]] | None = None, rebalance: bool = False) -> None:
        """stores: where each rollout server's rows are now (rollout.data_plane store: the ranks fetch them there).
        rebalance: resilience.rebalance_stragglers (a slow data-parallel rank gets a smaller share)."""
        self.algorithm, self.group_size, self.mini_batches = algorithm, group_size, mini_batches
        self.workers, self.layout, self.pad_id, self.stores = workers, workers.layout, pad_id, stores
        self.rebalance = rebalance
        self.speeds: list[float] | None = None  # each data-parallel share's relative compute speed; None: equal
        self.rebalanced = 0  # shares this step's split cut for a slow rank (steps.csv rebalanced)

    def split(self, step: int, batch: StepBatch) -> tuple[list[StepBatch], dict[str, Any]]:
        """Each data-parallel rank's share of the batch (with a sample_index and a mini_batch column) and the
        split's stats (rlhf.batch)."""
        fault_point("data.split", step=step)
        self.rebalanced = sum(s < 1.0 for s in self.speeds or ())
        return batch.shares(self.layout.dp, self.mini_batches, tokens_key="num_tokens", speeds=self.speeds)

    def advantages(self, batch: StepBatch, shares: list[StepBatch], first: torch.Tensor | None = None
                   ) -> dict[str, Any]:
        """The whole batch's group advantages, each share's as its `advantages` column; returns the reward
        statistics of the step's first round (`first`, when dynamic sampling replaced groups: what the policy itself
        drew), else of the batch."""
        if "episode" in batch.keys() and batch.group_size != self.group_size:  # an agent's episodes as several
            # samples each (one sample each is a batch of groups as any other): the advantage is the episode's
            return self._episode_advantages(batch, shares)
        advantages, stats = group_advantages(batch["rewards"], self.group_size, self.algorithm.scale_by_std)
        if first is not None:
            stats = group_advantages(first, self.group_size, self.algorithm.scale_by_std)[1]
        for share in shares:
            share["advantages"] = advantages[torch.tensor(share["sample_index"], dtype=torch.long)]
        return stats

    def _episode_advantages(self, batch: StepBatch, shares: list[StepBatch]) -> dict[str, Any]:
        """agent.path: each episode's reward (its first sample's) against its group's episodes; every sample of an
        episode gets the episode's advantage. The statistics are the episodes'."""
        episodes = [int(e) for e in batch["episode"]]
        firsts: dict[int, int] = {}
        for i, e in enumerate(episodes):
            firsts.setdefault(e, i)
        order = {e: j for j, e in enumerate(sorted(firsts))}  # the episodes in order: groups of group_size
        first = torch.tensor([firsts[e] for e in order], dtype=torch.long)  # each episode's first sample
        episode = torch.tensor([order[e] for e in episodes], dtype=torch.long)
        advantages, stats = group_advantages(batch["rewards"][first], self.group_size, self.algorithm.scale_by_std)
        for share in shares:
            share["advantages"] = advantages[episode[torch.tensor(share["sample_index"], dtype=torch.long)]]
        return stats

    def logprobs(self, step: int, shares: list[StepBatch], row: dict[str, Any]) -> list[dict[str, Any]]:
        """Each data-parallel share's train batch, with reference logprobs (KL on) and recomputed old-policy ones
        (if asked: then they, the first forward under the rollout's weights, give rollout_train_logprob_diff)."""
        if self.stores is not None:
            return self._kept_logprobs(step, shares, row)
        alg = self.algorithm
        batches = []
        for share in shares:  # built where first needed
            batches.append({**to_batch(share, self.pad_id), "advantages": share["advantages"]})
        which = self._which()
        if not which:
            return batches
        # both passes in one call when both are needed: the batch crosses once
        per_rank = self.per_rank(batches)
        _count_tokens(per_rank)
        replies = self.workers.call("compute_logprobs", {"which": which}, per_rank, step, "reference")
        _count_tokens([out for _, out in replies])
        replies = replies[::self.layout.tp]
        if "policy" in which:
            if alg.off_policy != "none":  # the behaviour policy's, for the importance weight
                for b in batches:
                    b["rollout_logprobs"] = b["old_logprobs"]
            row.update(logprob_diff([(b["old_logprobs"], out["policy"], b["response_mask"])
                                     for b, (_, out) in zip(batches, replies)]))
        for b, (_, out) in zip(batches, replies):
            for w in which:
                b[{"reference": "ref_logprobs", "policy": "old_logprobs"}[w]] = out[w]
        return batches

    def _which(self) -> list[str]:
        alg = self.algorithm
        return [w for w, needed in (("reference", alg.kl_coef > 0), ("policy", alg.old_logprobs == "recompute"))
                if needed]

    def _kept_logprobs(self, step: int, shares: list[StepBatch], row: dict[str, Any]) -> list[dict[str, Any]]:
        """rollout.data_plane store: each share as the ids of its rows and the servers that hold them (each rank
        fetches its own, and keeps them and these passes' logprobs for the train step); the advantages and
        mini-batches go as small tensors. The recompute pass's rollout/train difference comes back as sums."""
        stores = self.stores() if self.stores is not None else []
        plans = []
        for share in shares:
            # only the stores this share's rows are in (a simulated host's servers share one: one fetch for them)
            urls = sorted({stores[a] for a in share["row_at"]})
            local = {u: k for k, u in enumerate(urls)}
            servers = [min(a for a in share["row_at"] if stores[a] == u) for u in urls]  # a server of each, named
            plans.append({"fetch": {"ids": list(share["row_id"]), "at": [local[stores[a]] for a in share["row_at"]],
                                    "urls": urls, "servers": servers},
                          "tensors": {"advantages": share["advantages"], "mini_batch": share["mini_batch"]}})
        which = self._which()
        if which:
            per_rank = self.per_rank(plans)
            replies = self.workers.call("compute_logprobs", [
                {"which": which, "fetch": p["fetch"], "step": step, "keep_rollout": self.algorithm.off_policy != "none"}
                for p in per_rank], [p["tensors"] for p in per_rank], step, "reference")[::self.layout.tp]
            if "policy" in which:
                tokens = sum(r["lp_diff_tokens"] for r, _ in replies)
                row.update(rollout_train_logprob_diff=sum(r["lp_diff_sum"] for r, _ in replies) / max(tokens, 1.0),
                           rollout_train_logprob_diff_max=max(r["lp_diff_max"] for r, _ in replies))
        return plans

    def train(self, step: int, batches: list[dict[str, Any]], rows: int | None = None) -> dict[str, Any]:
        """Every rank's train_step on its share; the metrics of one rank of each TP group (their parts add up).
        rows: the global batch's rows when groups were taken out on purpose (else the configured batch is checked)."""
        args = {"step": step, **({"rows": rows} if rows else {})}
        per_rank = self.per_rank(batches)
        if self.stores is not None and self._which():  # the ranks kept their rows, advantages and logprobs
            replies = self.workers.call("train_step", {**args, "kept": True}, None, step, "train")
        elif self.stores is not None:  # no logprob pass: the ranks fetch their rows now
            replies = self.workers.call("train_step", [{**args, "fetch": p["fetch"]} for p in per_rank],
                                        [p["tensors"] for p in per_rank], step, "train")
        else:
            _count_tokens(per_rank)
            replies = self.workers.call("train_step", args, per_rank, step, "train")
        metrics = [m for m, _ in replies[::self.layout.tp]]
        if self.rebalance:
            self._rebalance(step, metrics)
        return {**merge_train_metrics(metrics), "rebalanced": self.rebalanced}

    def _rebalance(self, step: int, metrics: list[dict[str, Any]]) -> None:
        """The next splits' speeds from this step's compute seconds per token of each data-parallel share: one at
        SLOW x the others' median or more gets that median / its own (a WARNING when it changes), the others 1."""
        rates = [m["compute_s"] / m["tokens"] if m.get("compute_s") and m.get("tokens") else 0.0 for m in metrics]
        if sum(r > 0 for r in rates) < 2:
            return
        # each share against the median of the others (with two ranks, the other one)
        medians = [statistics.median([x for j, x in enumerate(rates) if j != d and x > 0] or [r])
                   for d, r in enumerate(rates)]
        speeds = [round(m / r, 3) if r > 0 and r >= SLOW * m else 1.0 for r, m in zip(rates, medians)]
        before = self.speeds or [1.0] * len(speeds)
        for d, (old, new) in enumerate(zip(before, speeds)):
            who = f"train-{d * self.layout.tp}" + (f" (and its {self.layout.tp - 1} TP peers)" if self.layout.tp > 1 else "")
            if new < 1.0 and abs(new - old) > 0.05:
                log.warning("step %d: %s took %.1fx the median rank's compute a token in stage train, a straggler; its "
                            "share of the next steps' batches is cut to %.2f of the others' "
                            "(resilience.rebalance_stragglers)", step, who,
                            rates[d] / medians[d], new)
            elif new == 1.0 and old < 1.0:
                log.info("step %d: %s computes at the others' pace again; equal shares", step, who)
        self.speeds = speeds if any(s < 1.0 for s in speeds) else None

    def per_rank(self, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each train rank's batch: its data-parallel share's (the ranks of a TP group compute on the same one)."""
        return [batches[self.layout.dp_rank(r)] for r in range(len(self.workers))]


TOKEN_TENSORS = ("input_ids", "old_logprobs", "ref_logprobs", "rollout_logprobs", "logprobs", "reference", "policy")


def _count_tokens(tensors: list[dict[str, Any]]) -> None:
    """The rollout tokens and logprobs in batches sent to (or replies from) the train ranks (rlhf.batch.TOKENS)."""
    TOKENS.add(sum(t[k].numel() for t in tensors for k in TOKEN_TENSORS if k in t))
