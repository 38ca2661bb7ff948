"""The stall watchdog: while the controller waits on the train ranks, it reads their heartbeats and names
the rank that keeps the others waiting, in seconds instead of an RPC timeout (timeouts.rpc_s, 600 s).

    every 0.5 s once a call has run runtime.watchdog_stall_s / 2:   GET /heartbeat on every rank
    │  rank: what it runs (request or SFT loop phase) at which step, the collective it is inside and since
    │  when, its process CPU seconds and its threads in disk wait (a rank with neither is blocked, not working)
    ├─ a rank inside a collective for >= watchdog_stall_s while another rank is not in it, and that rank is
    │  blocked, inside another collective, or silent (no heartbeat reply)            → a stall
    └─ a rank that has not answered the call 2 x watchdog_stall_s after another rank did, and has been
       blocked (or silent) that long                                                  → a stall

A missing rank that is alive (its heartbeat file in the run directory fresh) but does not answer over the network is
behind a partition: with the policy's `wait_out_partitions` the call waits runtime.partition_grace_s for the network
(a WARNING) before the finding stands. What a stall does is the policy's `stall_stops_run`: on (hardened), the call
fails at once with SyncStall naming the missing rank; off (faithful, the seeds' system), the report and the live diagnosis are printed
and the call goes on waiting for its timeout. A rank that is still computing, or waiting on its disk, is a
straggler, not a stall: the watchdog names it once a call (a WARNING: "train-N is a straggler", counted in
steps.csv `stragglers`) while at most an eighth of the world keeps the rest waiting, and leaves it to the call's
timeout: the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from rlhf import exits, stacks
from rlhf.analysis import WATCHDOG_REPORT_ONLY
from rlhf.errors import SyncStall
from rlhf.transport.client import Client

log = logging.getLogger("rlhf.controller")

BLOCKED_CORES = 0.25  # below this CPU use (in cores), with no thread in disk wait, a rank is not working
POLL_S = 0.5


@dataclass
class RankView:
    """What the watchdog knows of one rank: its last heartbeat and how much it worked between heartbeats."""

    rank: int
    beat: dict[str, Any] | None = None
    silent: bool = False  # its heartbeat did not answer
    idle_since: float | None = None  # monotonic time since which it used no CPU and had no thread in disk wait
    last: tuple[float, float] | None = None  # (time, cpu_s) of the previous heartbeat
    working: bool = False  # the last two heartbeats showed it working (CPU use or a thread in disk wait)

    def update(self, beat: dict[str, Any] | None, now: float) -> None:
        self.beat, self.silent = (beat, False) if beat is not None else (self.beat, True)
        if beat is None:
            return
        cpu = float(beat.get("cpu_s", 0.0))
        if self.last is not None:
            t0, cpu0 = self.last
            working = (cpu - cpu0) / max(now - t0, 1e-3) >= BLOCKED_CORES or beat.get("disk_wait_threads", 0) > 0
            self.working = working
            if working:
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = t0
        self.last = (now, cpu)

    def blocked_for(self, now: float) -> float:
        return now - self.idle_since if self.idle_since is not None else 0.0

    def where(self, now: float) -> str:
        """'POST /train_step at its step 2 (blocked: no CPU use or disk wait for 4.5 s)'."""
        b = self.beat or {}
        if self.silent and not b:
            return "an unknown place (its heartbeat does not answer)"
        text = f"{b.get('phase', '?')} at its step {b.get('step', -1)}"
        if b.get("collective"):
            text += f" ({b['collective']} for {b['collective_s']:.1f} s)"
        if self.silent:
            return text + " (its heartbeat stopped answering)"
        if self.idle_since is not None:
            return text + f" (blocked: no CPU use or disk wait for {self.blocked_for(now):.1f} s)"
        return text + " (computing)"


class Finding(str):
    """The watchdog's sentence, and the rank it names as missing."""

    missing: int = -1

    @classmethod
    def of(cls, text: str, missing: int) -> Finding:
        found = cls(text)
        found.missing = missing
        return found


def find_stall(views: list[RankView], stall_s: float, now: float, answered: dict[int, float] | None = None,
               method: str = "") -> Finding | None:
    """The stall in these heartbeats, as a sentence naming the missing rank; None when there is none yet.

    answered: rank -> monotonic time it answered the current call (ranks that have left it)."""
    answered = answered or {}
    inside = [v for v in views if v.beat and v.beat.get("collective") and v.beat["collective_s"] >= stall_s]
    if inside:
        waiter = max(inside, key=lambda v: v.beat["collective_s"])
        what = waiter.beat["collective"]
        missing = [v for v in views if v is not waiter and (not v.beat or v.beat.get("collective") != what)]
        stuck = [v for v in missing if v.silent or (v.beat and v.beat.get("collective")) or v.blocked_for(now) >= 1.0]
        if stuck:
            m, w = stuck[0], waiter.beat
            return Finding.of(f"train-{waiter.rank} has been inside {what} for {w['collective_s']:.1f} s at its "
                              f"step {w.get('step', -1)} ({w.get('phase', '?')}), while train-{m.rank} is in "
                              f"{m.where(now)}; train-{m.rank} is missing from {what}", m.rank)
    if answered and len(answered) < len(views):
        first_rank, first = min(answered.items(), key=lambda kv: kv[1])
        for v in views:
            if v.rank in answered:
                continue
            waited = now - first
            if waited >= 2 * stall_s and (v.silent or v.blocked_for(now) >= 2 * stall_s):
                return Finding.of(f"train-{first_rank} answered {method} {waited:.1f} s ago, while train-{v.rank} is "
                                  f"in {v.where(now)}: train-{v.rank} is stuck", v.rank)
    return None


def find_straggler(views: list[RankView], stall_s: float, now: float) -> Finding | None:
    """A rank that keeps the others waiting while it computes (slow, not stuck): most of the world (three quarters or
    more) has been inside one collective, their median for >= stall_s, and every rank that answered and is not in it
    (at most an eighth of the world, at least one) was seen working in its last two heartbeats. A rank whose
    heartbeat did not answer is unknown, neither. None when there is none, or when a missing rank is blocked (a
    stall's, find_stall)."""
    known = [v for v in views if v.beat and not v.silent]  # a rank whose heartbeat did not answer: unknown
    inside = [v for v in known if v.beat.get("collective") and v.beat["collective_s"] >= stall_s]
    if not inside:
        return None
    waiter = max(inside, key=lambda v: v.beat["collective_s"])
    what, w = waiter.beat["collective"], waiter.beat
    waiting = [v for v in known if v.beat.get("collective") == what]
    missing = [v for v in known if v.beat.get("collective") != what]
    if not missing or len(missing) > max(1, len(views) // 8) or len(waiting) < 3 * len(views) // 4:
        return None
    if statistics.median(v.beat["collective_s"] for v in waiting) < stall_s:  # most have waited, not the first few
        return None
    if any(v.beat.get("collective") or not v.working for v in missing):
        return None
    m = missing[0]
    others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return Finding.of(f"train-{m.rank} is a straggler{others}: {len(waiting)} of {len(views)} ranks "
                      f"have waited in {what} for up to {w['collective_s']:.1f} s at step {w.get('step', -1)}, while "
                      f"train-{m.rank} is in {m.where(now)}", m.rank)


class StallWatchdog:
    """Supervises one fan-out call to the train ranks (see the module docstring)."""

    def __init__(self, clients: list[Client], stall_s: float, stops_run: bool, run_dir: str = "",
                 on_report: Callable[[str], None] | None = None, partition_grace_s: float = 0.0,
                 read_beats: Callable[[], Awaitable[list[dict[str, Any] | None]]] | None = None) -> None:
        """run_dir: where every live process dumps its stacks when a stall is found (rlhf.stacks); '' skips it.
        partition_grace_s: how long a missing rank that is alive but unreachable (a partition) is waited for.
        read_beats: every rank's heartbeat (None: it did not answer) in one read, e.g. per host through its agent
        (WorkerGroup.heartbeats); by default one GET /heartbeat per rank."""
        self.clients, self.stall_s, self.stops_run, self.on_report = clients, stall_s, stops_run, on_report
        self.run_dir, self.partition_grace_s = run_dir, partition_grace_s
        self.read_beats = read_beats or self._beats
        self.stragglers: list[str] = []  # every straggler named (a WARNING each); the controller counts them a step

    def unreachable(self, found: Finding, views: list[RankView]) -> str:
        """'' unless the missing rank is alive and unreachable: its heartbeat does not answer over the network while
        the heartbeat file it writes in the run directory (metrics/train-N.csv, every second) is fresh; then where it
        is (its host) and how fresh the file is."""
        if found.missing < 0 or not self.run_dir or not views[found.missing].silent:
            return ""
        try:
            age = time.time() - os.path.getmtime(os.path.join(self.run_dir, "metrics", f"train-{found.missing}.csv"))
        except OSError:
            return ""
        if age > 3.0:
            return ""
        return (f"train-{found.missing} ({self.clients[found.missing].base_url}) is alive (its heartbeat file is "
                f"{age:.1f} s old) but does not answer over the network: its host is unreachable (a partition)")

    async def _beats(self) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*[self._beat(c) for c in self.clients]))

    async def _beat(self, client: Client) -> dict[str, Any] | None:
        try:
            beat, _ = await client.call("/heartbeat", method="GET", timeout_s=2.0, traced=False)
            return beat
        except Exception:  # noqa: BLE001 — a rank that cannot answer its heartbeat is evidence, not an error here
            return None

    async def _stacks(self, found: Finding) -> str:
        """Every live process dumps its Python stacks; the stuck rank's file is named in the finding."""
        if not self.run_dir:
            return ""
        written = await asyncio.get_running_loop().run_in_executor(None, stacks.dump, self.run_dir,
                                                                   f"stall watchdog: {found}",
                                                                   exits.all_lives(self.run_dir))
        if not written:
            return ""
        stuck = written.get(f"train-{found.missing}")
        return (f"; its stacks: {stuck}" if stuck else "") + f" ({len(written)} processes dumped theirs to " \
            f"{os.path.dirname(next(iter(written.values())))})"

    async def supervise(self, calls: list[asyncio.Future], method: str, step: int, stage: str) -> list[Any]:
        """The calls' results in rank order, as asyncio.gather would give them, unless a stall is found first."""
        gathered = asyncio.gather(*calls)
        if not self.stall_s:
            return await gathered
        start = time.monotonic()
        views = [RankView(r) for r in range(len(calls))]
        answered: dict[int, float] = {}
        named: set[int] = set()  # stragglers named in this call
        suspect = -1  # the rank the last read found missing: named when this read finds it again
        reported = False
        partitioned_since: float | None = None  # when the missing rank was first found alive but unreachable
        while True:
            done, _ = await asyncio.wait([gathered], timeout=POLL_S)
            if done:
                return gathered.result()
            now = time.monotonic()
            for r, c in enumerate(calls):
                if c.done() and not c.cancelled() and c.exception() is None and r not in answered:
                    answered[r] = now
            if reported or now - start < self.stall_s / 2:
                continue
            beats = await self.read_beats()
            now = time.monotonic()
            for view, beat in zip(views, beats):
                view.update(beat, now)
            if gathered.done():  # the call ended while the heartbeats were read: what they say is already past
                return gathered.result()
            found = find_stall(views, self.stall_s, now, answered, method)
            # a finding stands when the next read finds it again: one read spans the world's hosts, so a collective
            # that ended meanwhile can show some ranks still inside it and others already out and idle
            if found is not None and found.missing != suspect:
                suspect, found = found.missing, None
            elif found is None:
                suspect = -1
            where = f"step {step}, stage {stage}" if step >= 0 else f"stage {stage}"
            if found is None:
                partitioned_since = None
                slow = find_straggler(views, self.stall_s, now)
                if slow is not None and slow.missing not in named:
                    named.add(slow.missing)
                    self.stragglers.append(slow)
                    log.warning("stall watchdog (%s, %s): %s; the run goes on (a rank that computes is slow, not "
                                "stuck: the call's timeout, timeouts.rpc_s, bounds it)", where, method, slow)
                continue
            cut_off = self.unreachable(found, views) if self.partition_grace_s else ""
            if cut_off:  # wait for the network, up to the grace (resilience.wait_out_partitions)
                if partitioned_since is None:
                    partitioned_since = now
                    log.warning("stall watchdog (%s, %s): %s; waiting up to %.0f s for it (runtime.partition_grace_s)",
                                where, method, cut_off, self.partition_grace_s)
                if now - partitioned_since < self.partition_grace_s:
                    continue
                found = Finding.of(f"{found}; {cut_off}, for {now - partitioned_since:.0f} s "
                                   "(runtime.partition_grace_s)", found.missing)
            found = Finding.of(found + await self._stacks(found), found.missing)
            if self.stops_run:
                gathered.cancel()
                raise SyncStall(f"stall watchdog ({where}, {method}): {found}")
            log.error("stall watchdog (%s, %s): %s; %s", where, method, found, WATCHDOG_REPORT_ONLY)
            reported = True
            if self.on_report is not None:
                self.on_report(found)
