"""The rollout side of a step: the step's weights to the rollout servers and its batch from them, synchronous or
generated ahead (rollout.mode async).

    stage = RolloutStage(cfg.rollout, cfg.steps, sampler, fanout, survival, rewards, events, update_weights)
    stage.start(start_step)                       # after the startup's weights update
    produced = stage.batch(step, row, clock)      # weights_update, events, rollout (+ dynamic sampling's rounds)

sync   weights_update → events(rollout_start) → rollout → [reward → more rounds] → events(rollout_end): the batch
       is generated now with the step's weights (the seeds' system).
async  the producer (control/async_rollout.py) generated the batch ahead, within rollout.max_staleness versions;
       the step's weights go out before the batch is taken when the batch waits for them (K = 0: the sync run),
       else after it, and the producer starts the next batches with them while this one trains.

Dynamic sampling (algorithm.resample_rounds) scores the batch and replaces its groups without advantage where the
batch is produced: in the step (sync) or in the producer (async), so a batch in the buffer is already scored.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from rlhf import tracing
from rlhf.algorithms.grpo import equal_groups
from rlhf.config import RolloutConfig
from rlhf.control.async_rollout import Produced, RolloutPipeline
from rlhf.control.events import ColocationEvents, freed_mb
from rlhf.control.group_rollout import GroupPipeline
from rlhf.control.reward_stage import RewardStage
from rlhf.control.rollout_fanout import RolloutFanout
from rlhf.control.survival import RolloutSurvival
from rlhf.data import PromptSampler
from rlhf.errors import RpcConnectionError
from rlhf.faults import afault_point
from rlhf.stages import StageClock

log = logging.getLogger("rlhf.controller")


class RolloutStage:
    def __init__(self, cfg: RolloutConfig, steps: int, sampler: PromptSampler, fanout: RolloutFanout,
                 survival: RolloutSurvival, rewards: RewardStage, events: ColocationEvents,
                 update_weights: Callable[[int, dict[str, Any]], None], stall_s: float = 0.0) -> None:
        """cfg: the rollout section; steps: the run's last step (the producer makes no batch past it); stall_s:
        runtime.watchdog_stall_s (the starvation watchdog's; 0: off)."""
        self.cfg, self.sampler, self.fanout, self.survival = cfg, sampler, fanout, survival
        self.rewards, self.events, self.update_weights, self.stall_s = rewards, events, update_weights, stall_s
        self._scoring = threading.Lock()
        self.pipeline: RolloutPipeline | GroupPipeline | None = None
        if cfg.mode == "async" and cfg.buffer == "group":
            self.pipeline = GroupPipeline(self._produce_group, lambda: sampler.next(1)[0],
                                          self._keep_group if rewards.resample_rounds else None, cfg.max_staleness,
                                          steps, cfg.prompts_per_step, cfg.group_size, cfg.servers, sampler.state_dict,
                                          rewards.resample_rounds, cfg.per_call)
        elif cfg.mode == "async":
            self.pipeline = RolloutPipeline(self._produce_ahead, cfg.max_staleness, steps, cfg.group_size,
                                            sampler.state_dict)

    def start(self, start_step: int) -> None:
        """After the startup's weights update (version start_step): async, the producer starts."""
        if self.pipeline is not None:
            log.info("rollout mode async: batches generated ahead, at most %d weights version(s) behind the step "
                     "that trains on them", self.cfg.max_staleness)
            self.pipeline.start(start_step + 1, start_step)

    def batch(self, step: int, row: dict[str, Any], clock: Any) -> Produced:
        """The step's weights to the rollout servers and its batch from them (module docstring)."""
        pipeline = self.pipeline
        ahead = pipeline is not None and pipeline.admitted(step)
        if not ahead:
            self._weights(step, row, clock)
        with clock.stage("events"):
            row["train_offload_mb"] = freed_mb(self.events.notify("rollout_start", step), "train")
        if pipeline is None:  # while the rollout servers hold the device (colocated: the lease)
            produced = self._produce(step, row, clock, lambda: self.sampler.next(self.cfg.prompts_per_step))
        else:
            produced, waits, updated = self._take(step, row, clock)
            row.update(produced.row, **waits)
            ahead = ahead and not updated
        if ahead:
            self._weights(step, row, clock)
        with clock.stage("events"):
            row["rollout_release_mb"] = freed_mb(self.events.notify("rollout_end", step), "rollout")
        return produced

    def _take(self, step: int, row: dict[str, Any], clock: Any) -> tuple[Produced, dict[str, float], bool]:
        """The producer's batch for `step`. When the producer failed on it with a loss it could not survive where it
        happened (no rollout server left to migrate to, their scheduler gone: restart_rollout), the services start
        again here, get this step's weights, and the producer makes the batch again; True then (the step's weights
        are out)."""
        assert self.pipeline is not None
        with clock.stage("rollout"):
            try:
                return (*self.pipeline.take(step, self._starving(step)), False)
            except RpcConnectionError as exc:
                if not self.survival.recover(step, row, exc, f"the producer's batch {step}"):
                    raise
        self._weights(step, row, clock)  # the new servers' weights (the others' too: this step's)
        log.warning("step %d: the producer makes batch %d again, with step %d's weights", step, step, step)
        self.pipeline.restart(step, self.sampler.load_state_dict)
        with clock.stage("rollout"):
            produced, waits = self.pipeline.take(step, self._starving(step))
        return produced, waits, True

    def _starving(self, step: int) -> Callable[[float], None]:
        """The starvation watchdog of a step waiting for its batch: once past runtime.watchdog_stall_s, one WARNING
        naming the rollout servers still generating it (the producer's /generate calls they have not answered, and
        their /server_info: running and queued calls) beside those that are idle — the trainer starved by a slow
        server is named in seconds, with no error."""
        told = False

        def waiting(seconds: float) -> None:
            nonlocal told
            if told or not self.stall_s or seconds < self.stall_s:
                return
            told = True
            now, waiting_on = time.monotonic(), dict(self.fanout.waiting_on)
            infos = self.fanout.loop.gather(*[c.call("/server_info", method="GET", timeout_s=2.0, traced=False)
                                              for c in self.fanout.services.rollout], return_exceptions=True)
            busy, idle = [], []
            for r, info in enumerate(infos):
                state = info[0]["internal_states"][0] if not isinstance(info, BaseException) else {}
                since = waiting_on.get(f"rollout-{r}")
                if since is None and not state.get("running_calls") and not state.get("queued_calls"):
                    idle.append(f"rollout-{r}")
                    continue
                inside = ("it does not answer /server_info" if not state else
                          f"{state['running_calls']} call(s) running, {state['queued_calls']} queued there"
                          if state["running_calls"] or state["queued_calls"] else "nothing running there: in transit")
                busy.append(f"rollout-{r} ({'its /generate unanswered for %.1f s; ' % (now - since) if since else ''}"
                            f"{inside})")
            log.warning("starvation watchdog (step %d, stage rollout): the train side has waited %.1f s for batch "
                        "%d; still generating it: %s%s", step, seconds, step, ", ".join(busy) or "no server",
                        f"; idle: {', '.join(idle)}" if idle else "")

        return waiting

    def _weights(self, step: int, row: dict[str, Any], clock: Any) -> None:
        """The step's weights update; async: inside a pause of every rollout server (rollout.interrupt), continued
        after it (sglang's /pause_generation and /continue_generation)."""
        with clock.stage("weights_update"):
            if self.pipeline is not None:
                self._every_server(step, "/pause_generation", {"mode": self.cfg.interrupt}, "rollout.pause", row)
            self.survival.survive(step, row, "the weights update", lambda: self.update_weights(step, row))
            if self.pipeline is not None:
                self._every_server(step, "/continue_generation", {}, "rollout.continue", row,
                                   resync=lambda: self.update_weights(step, row))
        if self.pipeline is not None:
            self.pipeline.loaded(step)

    def _every_server(self, step: int, route: str, body: dict[str, Any], point: str, row: dict[str, Any],
                      resync: Callable[[], Any] | None = None) -> None:
        """One call on every rollout server at once (fault point `point` before each, peer rollout-R). A server found
        gone (restart_rollout) is started again and left out: a new server has nothing to pause or continue; the
        update that follows a pause gives it the step's weights with the others, `resync` after a continue."""
        async def one(r: int, client: Any) -> Any:
            await afault_point(point, step=step, peer=f"rollout-{r}")
            return await client.call(route, body, stage="weights_update", step=step)

        results = self.fanout.loop.gather(*[one(r, c) for r, c in enumerate(self.fanout.services.rollout)],
                                          return_exceptions=True)
        failed = [e for e in results if isinstance(e, BaseException)]
        if not failed:
            return
        lost = [e for e in failed if isinstance(e, RpcConnectionError) and e.peer.startswith("rollout-")]
        if len(lost) < len(failed) or not self.survival.revived(step, row, lost[0], f"its {route}",
                                                                  "left out of it"):
            raise failed[0]
        if resync is not None:  # the update is over: the new server gets the step's weights now
            resync()

    def _produce(self, step: int, row: dict[str, Any], clock: Any, draw: Callable[[], list[Any]]) -> Produced:
        """Step `step`'s batch: its prompts' rollout, then, with algorithm.resample_rounds (dynamic sampling), its
        rewards and the rounds that replace the groups without advantage."""
        with clock.stage("rollout"):
            batch = self._generate(step, row, draw())
        first = None  # the first round's rewards, when more rounds replace groups (dynamic sampling)
        if self.rewards.resample_rounds:
            with clock.stage("reward"):
                first = batch["rewards"] = self.rewards.score(step, batch, row)
            batch = self.rewards.resample(step, batch, row, self.sampler.next,
                                          lambda examples: self._generate(step, row, examples), clock)
        return Produced(batch, first, seconds=clock.seconds)

    def _produce_ahead(self, step: int) -> Produced:
        """The producer thread's batch for `step` (async), in a trace of its own."""
        assert self.pipeline is not None
        pipeline, row, clock = self.pipeline, {}, StageClock(step, claim=False)  # the train side's is the current
        with tracing.span("rollout.ahead", new_trace=True, step=step):
            produced = self._produce(step, row, clock, lambda: pipeline.draw(
                step, lambda: self.sampler.next(self.cfg.prompts_per_step)))
        produced.row = row
        return produced

    def _produce_group(self, step: int, examples: list[Any], first: int, tag: str) -> Produced:
        """Groups for the buffer (rollout.buffer group): each example's group_size samples, first on server `first`,
        in a trace of its own; `step` is the first step they may serve."""
        row: dict[str, Any] = {}
        with tracing.span("rollout.group", new_trace=True, step=step, **{"rlhf.group": tag.rstrip("-"),
                                                                         "rlhf.groups": len(examples)}):
            batch = self._generate(step, row, examples, first, tag)
        return Produced(batch, None, row)

    def _keep_group(self, produced: Produced) -> bool:
        """Dynamic sampling by groups: False for a group whose samples all got one reward (scored now, as it ends).
        The group keeps its rewards and their means: the step that takes it does not score it again."""
        with self._scoring:  # the reward functions keep their last means: one group at a time
            produced.batch["rewards"] = self.rewards.score(-1, produced.batch, produced.means)
        return not equal_groups(produced.batch["rewards"], self.cfg.group_size)

    def _generate(self, step: int, row: dict[str, Any], examples: list[Any], first: int = 0, tag: str = "") -> Any:
        """The rollout of `examples` (group_size samples each), surviving a lost rollout server (sync) or env-0 (both
        modes; async: a lost server the fanout cannot migrate from fails the step that takes the batch); the samples it moved to another server add up in rollout_migrated."""
        if self.pipeline is None:
            batch = self.survival.survive(step, row, "the rollout", lambda: self.fanout.generate(step, examples),
                                          resync=lambda: self.update_weights(step, row))
        else:  # the producer: a lost env-0 starts again and the episodes run again (a lost server's samples migrate)
            batch = self.survival.survive_service(step, row, "the rollout",
                                                  lambda: self.fanout.generate(step, examples, first, tag))
        row["rollout_migrated"] = row.get("rollout_migrated", 0) + self.fanout.migrated
        if self.fanout.episodes is not None:  # groups an infrastructure failure took out (env.on_infra_error)
            row["dropped_groups"] = row.get("dropped_groups", 0) + self.fanout.episodes.dropped
        return batch

    def sampler_state(self, step: int) -> dict:
        """The prompt sampler's state a checkpoint after `step` keeps: after the step's batch, not after the batches
        drawn ahead (a resume draws them again)."""
        return self.pipeline.sampler_state_after(step) if self.pipeline is not None else self.sampler.state_dict()

    @property
    def exact_rng(self) -> bool:
        """Whether the rollout servers' sampling RNG can be saved between batches (not with a batch in flight)."""
        return self.pipeline is None or self.cfg.max_staleness == 0

    def close(self, wait_s: float = 0.0) -> None:
        """No batch starts after this; one in flight ends as its servers stop (wait_s: for the producer to end)."""
        if self.pipeline is not None:
            self.pipeline.close(wait_s)
