"""Generation by groups (rollout.mode async, rollout.buffer group): the producer keeps the rollout servers generating
group by group, and a group enters the buffer as soon as it is generated (and scored, with dynamic sampling); a step
takes the first groups that fill its batch, in the order they ended. A long-tail group holds no batch: the groups
that ended before it are trained first, and it joins a later step's batch while it is within the staleness bound
(a step takes the oldest versions in the buffer first, then the groups in the order they ended).

    pipeline = GroupPipeline(produce_group, draw_one, keep, max_staleness=K, last_step=N, prompts_per_step=P, ...)
    pipeline.start(first_batch=start_step + 1, version=start_step)
    produced, waits = pipeline.take(step)      # the first P groups that ended and are fresh enough for `step`

The same interface as the batch-wise RolloutPipeline (control/async_rollout.py). The rules, per group:
- a group starts only while fewer groups are generating or waiting in the buffer than the steps its version may
  still serve need: (min(v + K, N) - t) x P, with v the weights version the servers hold and t the last step taken
  (K = 1: the next step's groups while this one trains, as batch-wise);
- its version is its oldest token's (AReaL's rule, as batch-wise counts it): a group of version v is trained at a
  step s <= v + K; one that waited past that (a pause spanned it) is dropped at the take, a WARNING and a count;
- dynamic sampling (algorithm.resample_rounds): a group whose samples all got one reward is dropped as it ends and
  another prompt drawn in its place, at most resample_rounds x P times between two takes (then it is kept).

Each call (rollout.groups_per_call groups: a native engine runs one call at a time, so one group a call gives up the
batching of a server's engine; sglang batches across calls) is the batch's own path (RolloutFanout.generate:
migration, continued aborted samples, the store data plane, environments' episodes), its first server chosen round
robin, and each of its groups enters the buffer on its own. A checkpoint's prompt
sampler state is the one before the earliest group not yet taken (a resume draws the groups in flight again, and
may draw again a prompt that a group drawn after it had already trained on). A producer that failed (a loss the
train side survives) starts again without the groups that were under way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from rlhf.batch import StepBatch
from rlhf.control.async_rollout import Produced
from rlhf.control.watchdog import POLL_S
from rlhf.faults import fault_point

log = logging.getLogger("rlhf.controller")

ADD = ("rollout_migrated", "dropped_groups", "rollout_restarts", "infra_errors", "infra_retries")  # summed over groups


def group_version(batch: StepBatch) -> int | None:
    """The oldest weights version of a group's samples (None: no sample has one, e.g. all aborted)."""
    versions = [int(v) for v in batch["weight_version"] if str(v).lstrip("-").isdigit()]
    return min(versions) if versions else None


class GroupPipeline:
    def __init__(self, produce_group: Callable[[int, list[Any], int, str], Produced], draw_one: Callable[[], Any],
                 keep: Callable[[Produced], bool] | None, max_staleness: int, last_step: int, prompts_per_step: int,
                 group_size: int, servers: int, sampler_state: Callable[[], dict], resample_rounds: int = 0,
                 per_call: int = 1) -> None:
        """produce_group(step, examples, first server, tag): their groups' Produced (one call); draw_one(): a prompt
        (called under the pipeline's lock, as a call starts); keep(produced): False to drop an equal group (dynamic
        sampling); per_call: groups a call generates at most (rollout.groups_per_call)."""
        self.produce_group, self.draw_one, self.keep = produce_group, draw_one, keep
        self.k, self.last, self.p, self.group_size = max_staleness, last_step, prompts_per_step, group_size
        self.servers, self.sampler_state, self.resample_rounds = servers, sampler_state, resample_rounds
        self.per_call = max(1, per_call)
        self.cond = threading.Condition()
        self.version: int | None = None  # the weights version every rollout server holds
        self.taken = 0  # the last step that took its batch
        self.started = 0  # groups started (each one's serial number)
        self.generating = 0  # groups being generated now
        self.buffer: list[tuple[int, int | None, Produced]] = []  # (serial, version, group) in the order they ended
        self.drawn: dict[int, dict] = {}  # serial -> the sampler's state before its prompt (until it is taken)
        self.error: tuple[int, BaseException] | None = None
        self.closed = False
        self.threads: list[threading.Thread] = []
        self.dropped_equal = 0  # since the last take (dynamic sampling's budget)
        self.dropped_stale = 0  # since the last take: groups past the staleness bound
        self.idle_s = 0.0  # since the last take: the time with no call under way (rollout_idle_s)
        self.calls = 0  # calls under way
        self.idle_since = time.perf_counter()
        self.first_start: float | None = None  # when the first group of the next batch started

    # ------------------------------------------------------------------ the train side

    def admitted(self, batch: int) -> bool:
        with self.cond:
            return self.version is not None and batch - self.k <= self.version

    def start(self, first_batch: int, version: int) -> None:
        with self.cond:
            self.version, self.taken, self.error = version, first_batch - 1, None
        workers = max(1, -(-self.p * max(self.k, 1) // self.per_call))  # as many as calls may be under way at once
        self.threads = [threading.Thread(target=self._work, name=f"rollout-producer-{i}", daemon=True)
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    def loaded(self, version: int) -> None:
        """Every rollout server now holds `version`: more groups may start."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def draw(self, batch: int, draw: Callable[[], Any]) -> Any:
        return draw()

    def sampler_state_after(self, step: int) -> dict:
        """The sampler's state before the earliest group drawn and not yet taken (the state now if none)."""
        with self.cond:
            return self.drawn[min(self.drawn)] if self.drawn else self.sampler_state()

    def take(self, batch: int, waiting: Callable[[float], None] | None = None) -> tuple[Produced, dict[str, float]]:
        """prompts_per_step groups that ended and may be trained at `batch` (each within the staleness bound: older ones
        are dropped), the oldest versions first, then in the order they ended, concatenated; and the waits, as
        RolloutPipeline.take."""
        fault_point("buffer.get", step=batch)
        t0 = time.perf_counter()
        with self.cond:
            while True:
                self._drop_stale(batch)
                if len(self.buffer) >= self.p or self.error is not None or self.closed:
                    break
                self.cond.wait(POLL_S if waiting is not None else None)
                if waiting is not None and len(self.buffer) < self.p:
                    self.cond.release()
                    try:
                        waiting(time.perf_counter() - t0)
                    finally:
                        self.cond.acquire()
            if len(self.buffer) < self.p:
                if self.error is not None:
                    raise self.error[1]
                raise RuntimeError(f"step {batch}: the rollout producer was closed before the batch was produced")
            # the oldest versions first (those nearest the bound), then in the order they ended
            order = sorted(self.buffer, key=lambda e: (e[1] if e[1] is not None else self.taken + self.k + 1))
            taken = order[:self.p]
            self.buffer = [e for e in self.buffer if all(e[0] != t[0] for t in taken)]
            for serial, _v, _g in taken:
                self.drawn.pop(serial, None)
            stale, self.dropped_stale = self.dropped_stale, 0
            equal, self.dropped_equal = self.dropped_equal, 0
            self.taken = batch
            now = time.perf_counter()
            idle = self.idle_s + (now - self.idle_since if self.calls == 0 else 0.0)
            self.idle_s, self.idle_since = 0.0, now
            first, self.first_start = self.first_start, None
            waits = {"train_idle_s": time.perf_counter() - t0, "rollout_idle_s": idle,
                     "buffer_groups": len(self.buffer), "groups_dropped": stale}
            if self.resample_rounds:  # dynamic sampling's columns, as batch-wise: groups replaced, prompts drawn
                waits.update(resampled_groups=equal, resample_prompts=equal)
            self.cond.notify_all()  # room for the next groups
        parts = [g for _s, _v, g in taken]
        scored = all("rewards" in p.batch.keys() for p in parts)  # by dynamic sampling, as each group ended
        for p in parts if not scored else []:  # a group that was not (none are, or a restart mixed them): all again
            p.batch.data.pop("rewards", None)
        merged = StepBatch.concat([p.batch for p in parts], self.group_size, strict=False)
        merged["sample_index"] = list(range(len(merged)))
        row: dict[str, Any] = {}
        for p in parts:
            for key, value in p.row.items():
                row[key] = row.get(key, 0) + value if key in ADD and isinstance(value, (int, float)) else value
        seconds = {"rollout": time.perf_counter() - first} if first is not None else {}
        means = {key: sum(p.means.get(key, 0.0) for p in parts) / len(parts) for key in parts[0].means} if scored \
            else {}  # every group has group_size samples: the batch's mean is the groups' mean
        return Produced(merged, None, row, seconds, means), waits

    def restart(self, batch: int, restore: Callable[[dict], None]) -> None:
        """After a producer failed and the train side survived what failed it: the workers start again; the groups
        under way when it failed are left out (their prompts are not drawn again), those in the buffer stay."""
        for t in self.threads:
            t.join()
        with self.cond:
            self.error = None
            buffered = {s for s, _v, _g in self.buffer}
            self.drawn = {s: st for s, st in self.drawn.items() if s in buffered}
        self.start(batch, self.version if self.version is not None else batch - 1)

    def close(self, wait_s: float = 0.0) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        deadline = time.monotonic() + wait_s
        for t in self.threads if wait_s > 0 else []:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ the producer's workers

    def _busy(self, change: int) -> None:
        """A call starts (+1) or ends (-1); the time with none under way adds up in idle_s (rollout_idle_s)."""
        now = time.perf_counter()
        if change > 0 and self.calls == 0:
            self.idle_s += now - self.idle_since
        self.calls += change
        if self.calls == 0:
            self.idle_since = now

    def _left(self) -> int:
        """How many more groups may start now (the module docstring's first rule)."""
        if self.version is None:
            return 0
        serves = min(self.version + self.k, self.last) - self.taken  # the steps a group started now may serve
        return serves * self.p - self.generating - len(self.buffer)

    def _room(self) -> bool:
        return self._left() > 0

    def _drop_stale(self, batch: int) -> None:
        fresh = [(s, v, g) for s, v, g in self.buffer if v is None or v >= batch - self.k]
        if len(fresh) < len(self.buffer):
            old = sorted({v for _s, v, _g in self.buffer if v is not None and v < batch - self.k})
            log.warning("step %d: %d group(s) of weights version(s) %s waited past the staleness bound (K = %d); "
                        "dropped", batch, len(self.buffer) - len(fresh), old, self.k)
            for s, _v, _g in self.buffer:
                if not any(s == f[0] for f in fresh):
                    self.drawn.pop(s, None)
            self.dropped_stale += len(self.buffer) - len(fresh)
            self.buffer = fresh

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.closed and self.error is None and not self._room():
                    self.cond.wait()
                if self.closed or self.error is not None:
                    return
                self._busy(+1)
                n = max(1, min(self.per_call, self._left()))  # groups in this call
                first, step = self.started, self.taken + 1
                self.started += n
                self.generating += n
                self.first_start = self.first_start or time.perf_counter()
                examples = []
                for serial in range(first, first + n):  # the sampler is shared by the workers
                    self.drawn[serial] = self.sampler_state()
                    examples.append(self.draw_one())
            try:
                produced = self.produce_group(step, examples, (first // self.per_call) % self.servers, f"g{first}-")
                fault_point("buffer.put", step=step)
                groups = [Produced(produced.batch.groups([i]), None, produced.row if i == 0 else {})
                          for i in range(n)]  # the call's counters go with its first group
                kept = [self.keep is None or self.keep(g) for g in groups]
            except BaseException as exc:  # noqa: BLE001 — the train side raises it when it takes a batch
                with self.cond:
                    self.generating -= n
                    self._busy(-1)
                    if self.error is None:
                        self.error = (step, exc)
                    self.cond.notify_all()
                if not self.closed:
                    log.warning("step %d: the rollout producer failed on a group: %s: %s", step, type(exc).__name__,
                                exc)
                return
            with self.cond:
                self.generating -= n
                self._busy(-1)
                for serial, group, keep in zip(range(first, first + n), groups, kept):
                    if not keep and self.dropped_equal < self.resample_rounds * self.p:
                        self.dropped_equal += 1
                        self.drawn.pop(serial, None)
                    else:
                        self.buffer.append((serial, group_version(group.batch), group))
                self.cond.notify_all()
