"""The stall watchdog: the rule on recorded heartbeats, and live GRPO runs where train rank 1 hangs before a
collective (the issue's example: the waiting rank used to be blamed after an RPC timeout, or never)."""

import asyncio
import datetime as dt

import pytest

from rlhf.control import watchdog
from rlhf.control.watchdog import RankView, StallWatchdog, find_stall, find_straggler
from rlhf.diagnosis import diagnose
from rlhf.errors import SyncStall
from tests.test_kills import run_with_fault
from tests.test_scenarios import markers


def beats(*rows, start=0.0, dt_s=0.5):
    """Feed each rank's heartbeats (phase, collective, collective_s at the first beat, cpu cores used) at 0.5 s."""
    views = []
    for rank, (phase, collective, inside_s, cores, n) in enumerate(rows):
        v = RankView(rank)
        for i in range(n):
            v.update({"rank": rank, "phase": phase, "step": 2, "collective": collective,
                      "collective_s": inside_s + i * dt_s if collective else 0.0, "cpu_s": cores * i * dt_s,
                      "disk_wait_threads": 0}, start + i * dt_s)
        views.append(v)
    return views, start + (max(r[4] for r in rows) - 1) * dt_s


def test_a_rank_waiting_in_a_collective_names_the_blocked_rank_missing_from_it():
    views, now = beats(("POST /train_step", "all_reduce(count)", 2.5, 0.0, 6), ("POST /train_step", "", 0, 0.01, 6))
    found = find_stall(views, 5.0, now)
    assert found is not None
    assert found.startswith("train-0 has been inside all_reduce(count) for 5.0 s at its step 2 (POST /train_step), "
                            "while train-1 is in POST /train_step at its step 2 (blocked"), found
    assert found.endswith("train-1 is missing from all_reduce(count)")


def test_no_stall_before_the_threshold_or_while_the_other_rank_computes():
    views, now = beats(("POST /train_step", "all_reduce(count)", 1.0, 0.0, 6), ("POST /train_step", "", 0, 0.0, 6))
    assert find_stall(views, 5.0, now) is None  # inside for 3.5 s only
    views, now = beats(("POST /train_step", "all_reduce(count)", 2.5, 0.0, 20), ("POST /train_step", "", 0, 1.0, 20))
    assert find_stall(views, 5.0, now) is None  # 12 s, but rank 1 uses a full core: a straggler, not a stall


def test_a_rank_in_disk_wait_is_working():
    views, now = beats(("POST /save", "all_reduce(count)", 2.5, 0.0, 8), ("POST /save", "", 0, 0.0, 1))
    for i in range(1, 8):
        views[1].update({"phase": "POST /save", "step": 2, "collective": "", "collective_s": 0.0, "cpu_s": 0.0,
                         "disk_wait_threads": 1}, i * 0.5)
    assert find_stall(views, 5.0, now) is None


def test_ranks_inside_different_collectives_deadlock_and_a_silent_rank_stalls():
    views, now = beats(("loop", "all_reduce(gradients)", 5.0, 0.0, 3), ("final_all_reduce", "all_reduce(count)", 1.0, 0.0, 3))
    assert "train-1 is missing from all_reduce(gradients)" in find_stall(views, 5.0, now)
    views, now = beats(("POST /train_step", "all_reduce(count)", 5.0, 0.0, 3), ("POST /train_step", "", 0, 1.0, 2))
    views[1].update(None, now)  # its heartbeat stops answering
    assert "its heartbeat stopped answering" in find_stall(views, 5.0, now)


def test_a_rank_that_has_not_answered_long_after_the_others_is_stuck_only_when_blocked():
    views, now = beats(("idle", "", 0, 0.0, 25), ("POST /compute_logprobs", "", 0, 0.0, 25))
    found = find_stall(views, 5.0, now, answered={0: 1.0}, method="/compute_logprobs")
    assert found is not None and found.endswith("train-1 is stuck") and "answered /compute_logprobs 11.0 s ago" in found
    assert find_stall(views, 5.0, now, answered={0: 5.0}, method="/compute_logprobs") is None  # 7 s: under 2 x 5 s
    views, now = beats(("idle", "", 0, 0.0, 25), ("POST /compute_logprobs", "", 0, 1.0, 25))
    assert find_stall(views, 5.0, now, answered={0: 1.0}, method="/compute_logprobs") is None  # still computing


def test_a_rank_that_computes_while_the_others_wait_is_a_straggler_not_a_stall():
    waiting = ("POST /train_step", "all_reduce(grads)", 1.0, 0.0, 6)  # inside for 3.5 s by the last beat
    views, now = beats(*[waiting] * 15, ("POST /train_step", "", 0, 1.0, 6))
    assert find_stall(views, 3.0, now) is None
    found = find_straggler(views, 3.0, now)
    assert found is not None and found.missing == 15, found
    assert found.startswith("train-15 is a straggler: 15 of 16 ranks have waited in all_reduce(grads) for up to 3.5 s")
    assert found.endswith("while train-15 is in POST /train_step at its step 2 (computing)")
    assert find_straggler(views, 5.0, now) is None  # not yet: the others have waited 3.5 s
    # blocked instead of computing: a stall (find_stall's), never a straggler
    views, now = beats(*[waiting] * 15, ("POST /train_step", "", 0, 0.0, 6))
    assert find_straggler(views, 3.0, now) is None and find_stall(views, 3.0, now).missing == 15
    # the first ranks in have waited 3.5 s, most of them far less: ranks still arriving, not a straggler
    spread = [("POST /train_step", "all_reduce(grads)", 1.0 - 0.2 * r, 0.0, 6) for r in range(15)]
    views, now = beats(*spread, ("POST /train_step", "", 0, 1.0, 6))
    assert find_straggler(views, 3.0, now) is None
    # three of 16 computing while the rest wait: more than an eighth of the world, a slow stage, not one straggler
    views, now = beats(*[waiting] * 13, *[("POST /train_step", "", 0, 1.0, 6)] * 3)
    assert find_straggler(views, 3.0, now) is None


def test_a_finding_stands_only_when_the_next_heartbeat_read_finds_it_again(monkeypatch):
    """One read of a big world's heartbeats spans its hosts: a collective that ends meanwhile shows some ranks still
    inside and others already out and idle. A stall is named when two reads in a row find the same missing rank."""
    monkeypatch.setattr(watchdog, "POLL_S", 0.02)

    def reader(flicker):
        reads = []

        async def read():
            reads.append(None)
            t = len(reads) * 0.02
            inside = {"rank": 0, "phase": "POST /train_step", "step": 2, "collective": "all_reduce(grads)",
                      "collective_s": 5.0 + t, "cpu_s": 0.0, "disk_wait_threads": 0}
            out = {**inside, "rank": 1} if flicker and len(reads) % 2 else \
                {"rank": 1, "phase": "idle", "step": 0, "collective": "", "collective_s": 0.0, "cpu_s": 0.0,
                 "disk_wait_threads": 0}
            return [inside, out]
        return read, reads

    async def supervise(flicker):
        read, reads = reader(flicker)
        dog = StallWatchdog([None, None], 0.04, True, read_beats=read)
        calls = [asyncio.get_running_loop().create_future() for _ in range(2)]
        asyncio.get_running_loop().call_later(5.0, lambda: [c.set_result(({}, {})) for c in calls])
        try:
            return await dog.supervise(calls, "/train_step", 2, "train"), reads
        except SyncStall as exc:
            return exc, reads

    found, reads = asyncio.run(supervise(flicker=False))
    assert isinstance(found, SyncStall) and "train-1 is missing from all_reduce(grads)" in str(found)
    assert len(reads) < 150  # named well before the call's end (5 s of 0.02 s reads)
    flickering, _ = asyncio.run(supervise(flicker=True))  # every other read has rank 1 inside it too: no stall
    assert not isinstance(flickering, SyncStall), flickering


HANG = ("    kind: hang\n    point: collective.all_reduce\n    target: {role: train, rank: 1}\n"
        "    when: {step: 2, max_hits: 1}\n")


def _stamp(line):
    return dt.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def _root_cause_lines(run_dir):
    lines = (run_dir / "logs" / "controller-0.log").read_text().splitlines()
    return [line for line in lines if " rlhf.diagnosis: root cause: " in line]


def _lines(run_dir):
    return (run_dir / "logs" / "controller-0.log").read_text().splitlines()


@pytest.mark.slow(reason="suite time (24 s): the fsdp all-gather hang (tests/test_sharding.py) runs the same stop by "
                         "default, the rank named in seconds and the stacks dumped; the sync stall names an all-reduce's")
def test_hardened_stops_a_collective_hang_in_seconds_naming_the_missing_rank(tmp_path):
    run_dir, out, last = run_with_fault(tmp_path, 4, HANG)
    onset = next(m["time"] for m in markers(run_dir) if m["event"] == "inject")
    assert "root cause: train-1" in last and "hang" in last, last
    first = next(line for line in _lines(run_dir) if " rlhf.diagnosis: root cause: " in line)
    assert "root cause: train-1" in first and _stamp(first) - onset <= 10.0, (first, onset)
    failed = next(line for line in _lines(run_dir) if "run failed" in line)
    assert "SyncStall" in failed and "train-1 is missing from all_reduce" in failed, failed
    assert _stamp(last) - onset <= 15.0  # cleanup gave the stalled handlers 1 s, not 30
    stuck = run_dir / "stacks" / "train-1.txt"  # hang forensics: every live process dumped its threads' stacks
    assert f"its stacks: {stuck}" in failed
    assert "rlhf/faults/kinds/hang.py" in stuck.read_text()  # where rank 1 is blocked
    assert "all_reduce" in (run_dir / "stacks" / "train-0.txt").read_text()  # rank 0 waits inside the collective
    assert (run_dir / "stacks" / "rollout-0.txt").stat().st_size > 0
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.stage, d.root.category) == ("train-1", "train", "hang"), d.render()


@pytest.mark.slow
def test_faithful_keeps_waiting_but_prints_the_root_cause_within_seconds(tmp_path):
    config = "  resilience: {preset: faithful}\n  timeouts: {cleanup_s: 5, rpc_s: 15}\n"
    run_dir, out, last = run_with_fault(tmp_path, 4, HANG, config)
    onset = next(m["time"] for m in markers(run_dir) if m["event"] == "inject")
    lines = _lines(run_dir)
    watchdog = next(line for line in lines if "stall watchdog" in line)
    assert "the run goes on waiting" in watchdog and "train-1 is missing from all_reduce" in watchdog
    live = next(line for line in lines if " rlhf.diagnosis: root cause: " in line)
    assert "root cause: train-1" in live and _stamp(live) - onset <= 10.0, (live, onset)
    failed = next(line for line in lines if "run failed" in line)  # the seeds' error: the waiting rank, much later
    assert "RpcTimeout: no reply from train-0" in failed and _stamp(failed) - onset >= 14.0, failed
    assert "root cause: train-1" in last, last
