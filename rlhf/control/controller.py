"""The single controller: it alone decides the step, what each stage does, and when the run ends.

    torchrun --nproc_per_node=N examples/grpo_trainer.py
    │
    ├─ rank 0 ─ Controller (this loop) ── MetaServer (HTTP, weight relay, in-process)
    │          └ TrainWorker 0 (RPC server thread)          ┐ SPMD: one torch.distributed
    ├─ rank 1 ─ TrainWorker 1 (RPC server)                  │ world (gloo on CPU, nccl on GPU),
    ├─ …                                                    ┘ data parallel
    │
    └─ Scheduler service (own process, HTTP; stops its jobs when our lease lapses)
        └─ RolloutServer 0 … M-1 (own processes, sglang-compatible HTTP API)

One step, top to bottom (`Controller.step`):

    weights_update → events(rollout_start) → rollout → events(rollout_end) → reward
    → data split (global batch → mini-batches → each over the dp ranks, rlhf.batch) → advantage → reference → train
    → latest_recover_save → periodic_recover_save

(with algorithm.resample_rounds, dynamic sampling: rollout → reward, then up to that many more rollout → reward
rounds for the groups without advantage, all before events(rollout_end)). The rollout side up to
events(rollout_end) is control/rollout_stage.py: synchronous, or with rollout.mode async a batch generated ahead
within rollout.max_staleness weights versions (control/async_rollout.py).

Fan-out is explicit: `self.workers.call("train_step", ...)` calls the method on every rank. What
each stage delegates lives in `control/` (rollout_stage, reward_stage, train_stage, weights_sync, events,
rollout_fanout, survival, fleet); the
run around the steps (startup, ledger, checkpoints, cleanup, summary) in `control/lifecycle.py`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rlhf import tracing
from rlhf.checkpoint import slots as ckpt
from rlhf.config import Config
from rlhf.control.agents import AGENT_COLUMNS, agent_columns, multi_turn
from rlhf.control.async_rollout import ASYNC_COLUMNS, staleness_columns
from rlhf.control.episodes import EPISODE_COLUMNS, episode_columns
from rlhf.control.events import ColocationEvents
from rlhf.control.fleet import RolloutServices
from rlhf.control.lifecycle import RunLifecycle, TrackedClock
from rlhf.control.reward_stage import RewardStage
from rlhf.control.rollout_fanout import RolloutFanout
from rlhf.control.rollout_stage import RolloutStage
from rlhf.control.survival import RolloutSurvival
from rlhf.control.train_stage import TrainStage
from rlhf.control.weights_sync import WeightSync
from rlhf.data import PromptSampler
from rlhf.evaluation import accuracy
from rlhf.models import load_tokenizer, pad_token_id
from rlhf.models.tokenizer import CharTokenizer
from rlhf.stages import STAGES
from rlhf.tasks import build_task
from rlhf.transport.client import Client

log = logging.getLogger("rlhf.controller")

STEP_COLUMNS = ("step", "seconds")  # the rest of a steps.csv row: each stage's own columns (Controller.__init__)
ROLLOUT_COLUMNS = ("rollout_tokens", "rollout_tokens_per_s", "batch_size", "dp_imbalance")


class Controller(RunLifecycle):
    label = "GRPO"

    def __init__(self, cfg: Config, run_dir: str, worker_urls: list[str], token: str,
                 nodes: list[int] | None = None) -> None:
        """nodes: the node (torchrun's GROUP_RANK) of each train rank; rollout server r runs on train rank r's node,
        under that node's scheduler."""
        super().__init__(cfg, run_dir, worker_urls, token)
        self.task = build_task(cfg.task)
        # the controller needs only the tokenizer (prompts in, completions out), never the weights
        self.tokenizer = load_tokenizer(cfg.model.path) if cfg.model.path else CharTokenizer()
        self.sampler = PromptSampler(self.task.split("train"), seed=cfg.seed)
        self.services = RolloutServices(cfg, run_dir, token, self.loop, len(self.workers), nodes,
                                        self.workers)
        self.weights = WeightSync(cfg, run_dir, token, self.loop, self.workers, self.services)
        self.events = ColocationEvents(cfg.runtime.colocate, cfg.timeouts.event_s, cfg.rollout.backend, cfg.resilience,
                                       self.loop, self.workers, self.services)
        self.fanout = RolloutFanout(cfg.rollout, cfg.sampling, cfg.task.chat_template, cfg.resilience, self.loop,
                                    self.services, self.tokenizer)
        self.fanout.store = cfg.data_plane == "store"  # rows stay in the rollout servers; replies are metadata
        # each sample an environment's episode (control/episodes.py) or an agent's calls (control/agents.py)
        self.fanout.episodes = multi_turn(cfg, self.fanout, self.services, token)
        self.survival = RolloutSurvival(cfg.resilience, self.services)
        self.rewards = RewardStage(cfg.reward, cfg.reward_model, cfg.rollout.group_size, cfg.algorithm.resample_rounds,
                                   self.loop, self.services, self.survival)
        self.trainer = TrainStage(cfg.algorithm, cfg.rollout.group_size, cfg.train.mini_batches, self.workers,
                                  pad_token_id(None, self.tokenizer),
                                  self.services.stores if cfg.data_plane == "store" else None,
                                  rebalance=self.policy.rebalance_stragglers)
        self.columns = [*STEP_COLUMNS, *TrainStage.columns, *ROLLOUT_COLUMNS,
                        *(f"{stage}_s" for stage in STAGES if stage != "cleanup"), *WeightSync.columns,
                        *ColocationEvents.columns, *RolloutSurvival.columns, "saves_failed", "stragglers", "eval_accuracy",
                        *self.rewards.columns, *ASYNC_COLUMNS,
                        *(("groups_dropped",) if cfg.rollout.buffer == "group" else ()),
                        *((*EPISODE_COLUMNS, "reward_env") if cfg.env.path else ()),
                        *(AGENT_COLUMNS if cfg.agent.path else ())]
        # the train layout: a batch is cut in layout.dp shares; the ranks of one TP group get the same share
        self.layout = self.workers.layout
        self.sft_result: dict[str, Any] = {}
        self.rollout = RolloutStage(cfg.rollout, cfg.steps, self.sampler, self.fanout, self.survival, self.rewards,
                                    self.events, self._update_weights, cfg.runtime.watchdog_stall_s)

    def startup(self) -> None:
        log.info("train layout: %s over %d rank%s", self.layout.describe(), len(self.workers),
                 "s" * (len(self.workers) != 1))
        self.services.start()
        self.resumed = self.resume_or_warm_start()
        self.weights.update(str(self.start_step), step=self.start_step)
        self.rollout.start(self.start_step)

    def resume_or_warm_start(self) -> bool:
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        found = ckpt.newest_checkpoint(checkpoints, check_sums=self.policy.atomic_checkpoints) \
            if self.cfg.checkpoint.resume else None
        if found is None:
            self.where.update(step=-1, stage="sft warm start")
            with tracing.span("sft", stage="sft"):  # a stage of its own in the trace (and for rlhf diagnose)
                # judged by its progress (the ranks' SFT steps), not cut at timeouts.rpc_s: a real model's takes hours
                (result, _), *_ = self.workers.call("sft_warm_start", stage="sft", progress_s=self.cfg.timeouts.rpc_s)
            self.sft_result = result
            self.workers.call("begin_grpo", {"save_reference": True})
            if result["sft_stopped"] != "skipped":
                log.info("warm start: %s at sft step %d, val accuracy %.3f", result["sft_stopped"],
                         result["sft_steps"], result["sft_val_accuracy"])
            self.where.update(step=-1, stage="startup")
            return False
        path, meta = found
        self.where.update(step=-1, stage="resume")
        state = meta["controller"]
        self.workers.call("begin_grpo", {"load_reference": True})
        self.workers.call("load", {"path": path, "optimizer_steps": state["optimizer_steps"]})
        self.sampler.load_state_dict(state["sampler"])
        self.sft_result, self.start_step = state["sft"], int(meta["step"])
        self.eval_before = state.get("eval_accuracy_before")  # the run's, not the resume's
        rng = state.get("rollout_rng") or []
        if not self.services.set_rng_states(rng):  # the rollouts then differ from the uninterrupted run's
            log.info("rollout servers' sampling RNG: the checkpoint has %d state(s) for %d servers; the servers "
                     "without theirs start from their seed", sum(s is not None for s in rng), len(self.services.rollout))
        log.info("resumed from %s at step %d", path, self.start_step)
        self.where.update(step=-1, stage="startup")
        return True

    def step(self, step: int) -> dict[str, Any]:
        clock, t0 = TrackedClock(step, self.where), time.perf_counter()
        row: dict[str, Any] = {"step": step}
        if (revived := self.survival.revive_dead(step)) is not None:
            row["rollout_restarts"] = revived
        produced = self.rollout.batch(step, row, clock)
        batch, first = produced.batch, produced.first
        with clock.stage("reward"):
            if "rewards" not in batch.keys():  # not scored by dynamic sampling already
                batch["rewards"] = self.rewards.score(step, batch, row)
            else:
                row.update(produced.means)
            shares, split = self.trainer.split(step, batch)
        with clock.stage("advantage"):
            stats = self.trainer.advantages(batch, shares, first)
        with clock.stage("reference"):
            batches = self.trainer.logprobs(step, shares, row)
        with clock.stage("train"):
            merged = self.trainer.train(step, batches, len(batch) if row.get("dropped_groups") or
                                        "episode" in batch.keys() else None)  # groups out, or agents' samples
        row["weights_drift"] = self.weights.drift(step, {**merged, **row})  # row: the recompute pass's, if any
        row["saves_failed"] = self._save(step, clock)
        named = self.workers.watchdog.stragglers if self.workers.watchdog is not None else []
        row["stragglers"], self.stragglers_seen = len(named) - self.stragglers_seen, len(named)  # named this step
        tokens, seconds = int(sum(batch["num_tokens"])), time.perf_counter() - t0
        generating = produced.seconds.get("rollout") or clock.seconds["rollout"]
        # sync: the train ranks wait out the rollout and its scoring (a judge's round trips, dynamic sampling's rounds)
        row.setdefault("train_idle_s", clock.seconds["rollout"] + clock.seconds.get("reward", 0.0))
        row.setdefault("rollout_idle_s", seconds - clock.seconds["rollout"])  # and the servers the rest
        row.setdefault("buffer_groups", 0)
        return {**row, **stats, **merged, "seconds": seconds, "rollout_tokens": tokens,
                "rollout_tokens_per_s": tokens / generating, "batch_size": len(batch),
                "dp_imbalance": split["imbalance"], **staleness_columns(step, batch["weight_version"]),
                **episode_columns(batch), **agent_columns(batch),
                **{f"{k}_s": v for k, v in clock.seconds.items()}}

    def _save(self, step: int, clock: TrackedClock) -> int:
        """latest_recover_save and periodic_recover_save when due; returns the saves that failed and were skipped."""
        cfg = self.cfg
        self.saves_failed = 0
        if cfg.checkpoint.latest_every and step % cfg.checkpoint.latest_every == 0:
            with clock.stage("latest_recover_save"):
                self.checkpoint(ckpt.slot_for_step(step), step)
                self.weights.latest_slot = ckpt.slot_for_step(step)  # in place, saved or not: what disk mode reads
        if cfg.checkpoint.periodic_every and step % cfg.checkpoint.periodic_every == 0:
            with clock.stage("periodic_recover_save"):
                self.checkpoint(os.path.join("periodic", f"step_{step}"), step, background=cfg.checkpoint.periodic_async)
        return self.saves_failed

    def _update_weights(self, step: int, row: dict[str, Any]) -> None:
        row.update(self.weights.update(str(step), step))
        row["weights_fallback"] = self.weights.fell_back
        if self.cfg.weights.verify:
            row["weights_verified"] = self.weights.verify(str(step), step)
        row["weights_stale"] = self.weights.spot_check(str(step), step)

    def after_step(self, step: int, row: dict[str, Any]) -> None:
        if self.cfg.eval_every and step % self.cfg.eval_every == 0 and step < self.cfg.steps:
            row["eval_accuracy"] = self.evaluate()
        log.info("step %d/%d reward %.3f kl %.4f clip %.3f len %.2f %.2fs", step, self.cfg.steps, row["reward_mean"],
                 row["kl"], row["clip_fraction"], row["response_length"], row["seconds"])

    def evaluate(self) -> float:
        """Greedy accuracy on the eval split, spread over the rollout servers; survived as a step's rollout is
        (restart_rollout): a lost server's problems migrate to the others, and when none is left (their scheduler
        died) or env-0 or reward-0 was lost, they start again and the evaluation runs once more."""
        after = max(int(self.where.get("step", -1)), self.start_step)  # the last step done (the logs' step)
        self.where.update(step=-1, stage="evaluate")
        examples = self.task.split("eval")
        with tracing.span("evaluate", new_trace=True) as sp:
            self.events.notify("rollout_start", -1)
            servers = list(self.services.rollout)
            try:
                completions = self.survival.survive(after, {}, "the evaluation", lambda: self.fanout.greedy(examples),
                                                    lambda: self.weights.after_restart(servers, after),
                                                    again="running it again")
            finally:
                self.events.notify("rollout_end", -1)
            score = accuracy(completions, examples, self.rewards.reward)
            sp.set_attribute("rlhf.eval_accuracy", score)
            return score

    def eval_note(self) -> str:
        return f" ({len(self.task.split('eval'))} problems, greedy)"

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a resume needs. Async: the sampler's state after this step's batch (not after the batches drawn
        ahead, which a resume draws again); the rollout servers' RNG only at K = 0 (else it is mid-batch)."""
        return {"sampler": self.rollout.sampler_state(step), "sft": self.sft_result,
                "optimizer_steps": step * self.cfg.train.mini_batches, "eval_accuracy_before": self.eval_before,
                "rollout_rng": self.services.rng_states() if self.rollout.exact_rng else []}

    def summary_extras(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = sum(r["rollout_tokens"] for r in rows)  # over the seconds spent generating (async: ahead)
        rollout_s = sum(r["rollout_tokens"] / r["rollout_tokens_per_s"] for r in rows if r["rollout_tokens_per_s"])
        return {"eval_problems": len(self.task.split("eval")),
                "resumed_from_step": self.start_step if self.resumed else None,
                "rollout_tokens_per_s": tokens / rollout_s if rollout_s else 0.0,
                "rollout_servers": self.cfg.rollout.servers, "weights_mode": self.cfg.weights.mode,
                "train_layout": self.layout.describe(),
                "colocate": self.cfg.runtime.colocate, **self.sft_result}

    def stop_services(self) -> None:
        self.rollout.close()  # async: no batch starts now; one in flight ends as its servers stop
        if self.fanout.episodes is not None:
            self.fanout.episodes.close()
        self.services.stop(self.cleanup_level)
        self.rollout.close(wait_s=5.0)

    def clients(self) -> list[Client]:
        return super().clients() + self.services.clients()
