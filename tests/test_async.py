"""Asynchronous GRPO (rollout.mode async): the producer's staleness bound, K = 0 as the synchronous run, and a run
with K = 1 that resumes with the bound in force — real processes, real HTTP, on the smoke preset."""

import csv
import json
import subprocess
import sys
import threading

import pytest

from rlhf.control.async_rollout import Produced, RolloutPipeline, staleness_columns
from tests.conftest import ROOT

REWARDS = '''
def odd(completions, answers, prompts=None, **_):
    """1 for a completion that starts with an odd digit: an untrained model hits it now and then, so its groups
    carry an advantage and the weights move from the first step."""
    return [float(c[:1] in "13579") for c in completions]
'''

TIMING = ("seconds", "rollout_tokens_per_s")


def _pipeline(k, last, produce=None, group_size=2):
    versions = {}

    def record(b):
        versions[b] = pipeline.version
        return Produced(batch=[0] * group_size * 3)

    pipeline = RolloutPipeline(produce or record, k, last, group_size, lambda: {})
    return pipeline, versions


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_producer_starts_a_batch_only_within_k_versions_and_never_past_the_last_step(k):
    """Driven as the controller drives it: the train side takes step s's batch and loads version s (before the take
    when the batch waits for it). Every batch b starts with the servers on a version >= b - K, and none past the
    last step is produced."""
    last = 6
    pipeline, versions = _pipeline(k, last)
    pipeline.start(1, 0)
    for step in range(1, last + 1):
        if not pipeline.admitted(step):
            pipeline.loaded(step)
        produced, waits = pipeline.take(step)
        assert len(produced.batch) == 6 and waits["train_idle_s"] >= 0
        if pipeline.version < step:
            pipeline.loaded(step)
    pipeline.thread.join(5)
    assert not pipeline.thread.is_alive()  # after the last step nothing waits for a policy
    assert sorted(versions) == list(range(1, last + 1))
    assert all(b - v <= k for b, v in versions.items()), versions
    assert any(b - v == k for b, v in versions.items())  # the bound is reached, not only kept


def test_a_producer_failure_is_raised_by_the_step_that_takes_the_batch():
    def produce(b):
        if b == 2:
            raise ConnectionError("rollout-0 went away")
        return Produced(batch=[0, 0])

    pipeline, _ = _pipeline(1, 5, produce)
    pipeline.start(1, 0)
    pipeline.take(1)
    pipeline.loaded(1)
    with pytest.raises(ConnectionError, match="rollout-0"):
        pipeline.take(2)


def test_close_ends_a_producer_waiting_for_admission_and_a_take_waiting_for_it():
    pipeline, _ = _pipeline(0, 5)
    pipeline.start(1, 0)  # batch 1 waits for version 1, which never comes
    errors = []
    taker = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, pipeline.take, 1)))
    taker.start()
    pipeline.close(wait_s=5)
    taker.join(5)
    assert not pipeline.thread.is_alive() and not taker.is_alive() and errors


def test_staleness_columns_leave_aborted_samples_out():
    assert staleness_columns(5, ["4", "4", "5", "aborted"]) == {
        "staleness_mean": pytest.approx(2 / 3), "staleness_max": 1, "off_policy_fraction": pytest.approx(2 / 3)}
    assert staleness_columns(3, ["aborted"])["staleness_max"] == 0


def _run(tmp_path, name, *args):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    run_dir = tmp_path / name
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke",
                          "--sft.max_steps", "0", "--rollout.prompts_per_step", "8", "--reward.functions",
                          f"{rewards}:odd", "--algorithm.resample_rounds", "1", "--task.eval_size", "8",
                          "--run-dir", str(run_dir), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        return list(csv.DictReader(fh)), json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_k0_through_the_async_path_is_the_synchronous_run(tmp_path):
    """Same prompts, same samples, same training: every steps.csv column but the timings is equal, with dynamic
    sampling on and weights that move every step; the rollout and train logprobs agree (same weights)."""
    sync, _ = _run(tmp_path, "sync", "--steps", "3")
    async0, _ = _run(tmp_path, "async", "--steps", "3", "--rollout.mode", "async", "--rollout.max_staleness", "0")
    assert len(sync) == len(async0) == 3
    assert all(float(r["grad_norm"]) > 0 for r in sync)
    for a, b in zip(sync, async0):
        assert {k: v for k, v in a.items() if not (k.endswith("_s") or k.endswith("_s_max") or k in TIMING)} == \
            {k: v for k, v in b.items() if not (k.endswith("_s") or k.endswith("_s_max") or k in TIMING)}
    assert all(float(r["staleness_max"]) == 0 and float(r["rollout_train_logprob_diff_max"]) < 1e-4 for r in sync)


def test_k1_trains_one_version_behind_stale_weights_are_named_and_the_bound_holds_after_a_resume(tmp_path):
    """K = 1 on 2 servers: each batch was generated by the version before its step's (staleness 1, so the train
    side's logprobs differ from the rollout's by the step's update; with the recomputed old logprobs and truncated
    importance weights); resumed from step 3's checkpoint to step 5 the bound still holds (the versions count, not
    a counter that a resume resets).

    Meanwhile rollout-0 answers step 3's weights update and keeps its old weights (scenario 13's fault), with
    weights.verify off as with a real sglang server: the logprob difference cannot show it (the trainer is a version
    ahead at every step), but the spot check after each update (sglang's /get_weights_by_name, the trainer's values
    beside each server's) names rollout-0 at step 3 only, no false finding at the other steps; `rlhf diagnose` names
    it too."""
    from rlhf.diagnosis import diagnose

    off_policy = ["--algorithm.old_logprobs", "recompute", "--algorithm.off_policy", "tis", "--rollout.servers", "2"]
    stale = ["--weights.verify", "false", "--faults", f"{ROOT}/examples/faults/scenario13.yaml",
             "--resilience", "hardened"]
    rows, summary = _run(tmp_path, "run", "--steps", "3", "--rollout.mode", "async", *off_policy, *stale)
    assert [int(r["staleness_max"]) for r in rows] == [1, 1, 1]
    assert all(float(r["rollout_train_logprob_diff"]) > 1e-4 for r in rows[1:])  # what the drift check cannot read
    assert [int(r["weights_stale"]) for r in rows] == [0, 0, 1]
    log = (tmp_path / "run" / "logs" / "controller-0.log").read_text()
    assert "step 3: rollout-0's weights are not the trainer's version 3" in log, log[-3000:]
    root = diagnose(str(tmp_path / "run")).root
    assert (root.process, root.category, root.step) == ("rollout-0", "weights_drift", 3), root
    more, summary = _run(tmp_path, "run", "--steps", "5", "--rollout.mode", "async", *off_policy)
    assert summary["resumed_from_step"] == 3
    assert [int(r["step"]) for r in more][-2:] == [4, 5]
    assert all(0 <= float(r["staleness_max"]) <= 1 for r in more)


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario11_a_server_that_never_pauses_is_named_at_the_weights_update(tmp_path):
    """Async, 2 ranks, 2 servers: rollout-1's /pause_generation hangs before the step-3 weights update. The pause
    call times out naming rollout-1 and the route; the run fails in weights_update, and `rlhf diagnose` names
    rollout-1 from the evidence alone."""
    from tests.test_scenarios import assert_diagnosed, log_lines, run_scenario

    run_dir, out = run_scenario(tmp_path, 11)
    assert out.returncode != 0
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["staleness_max"]) for r in rows] == [1, 1]  # steps 1-2 trained one version behind
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage weights_update" in first and "rollout-1" in first and "/pause_generation" in first, first
    assert_diagnosed(run_dir, "rollout-1", "weights_update", "timeout")


@pytest.mark.parametrize("mode,expected", [("none", None), ("tis", [[1.0, 2.0, 0.5], [3.0, 0.0, 0.0]]),
                                           ("decoupled", [[1.0, 0.0, 0.5], [3.0, 0.0, 0.0]])])
def test_off_policy_weights_each_token_by_the_capped_importance_ratio(mode, expected):
    """w = pi_prox / pi_rollout per token: tis truncates it at is_cap, decoupled leaves out the tokens past it."""
    import math
    from types import SimpleNamespace

    import torch

    from rlhf.train.engine import off_policy_advantages

    w = torch.tensor([[1.0, 4.0, 0.5], [1.0, 1.0, 1.0]])
    part = {"advantages": torch.tensor([1.0, 3.0]), "rollout_logprobs": torch.full((2, 3), -1.0),
            "old_logprobs": torch.log(w) - 1.0}
    part["old_logprobs"][1, 1:] = -1.0 + math.log(0.0 + 1e-45)  # pi_prox ~ 0: a weight of ~0
    out = off_policy_advantages(part, SimpleNamespace(off_policy=mode, is_cap=2.0))
    if expected is None:
        assert out is part["advantages"]
    else:
        assert torch.allclose(out, torch.tensor(expected), atol=1e-6), out


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario15_a_slow_server_starves_the_trainer_without_an_error_and_is_named(tmp_path):
    """Async, 2 ranks, 2 servers: every /generate to rollout-1 waits 3 s from batch 2 on. Nothing fails and no
    process logs an error; the train side waits most of each step from step 2, the starvation watchdog names
    rollout-1 live (a WARNING, 2 s into a wait), and `rlhf diagnose` names rollout-1 (slow_rollout) from steps.csv
    and the servers' /generate spans."""
    from rlhf.diagnosis import diagnose
    from tests.test_scenarios import log_lines, run_scenario

    run_dir, out = run_scenario(tmp_path, 15, "--steps", "4", "--runtime.watchdog_stall_s", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    starved = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "starvation watchdog" in line]
    assert starved and "still generating it: rollout-1 (its /generate unanswered for " in starved[0] and \
        "nothing running there: in transit" in starved[0] and \
        "idle: rollout-0" in starved[0], starved  # named live, 2 s into the wait (runtime.watchdog_stall_s)
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    idle = [float(r["train_idle_s"]) for r in rows]
    assert idle[0] < 1.0 and all(i > 2.0 for i in idle[1:]), idle
    assert not [line for name in ("controller-0", "rollout-0", "rollout-1", "train-0", "train-1")
                for line in log_lines(run_dir, name, "ERROR")]
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.category, d.root.step) == ("rollout-1", "slow_rollout", 2), \
        d.render()


@pytest.mark.slow
def test_scenario12_a_crash_and_a_resume_keep_the_staleness_bound(tmp_path):
    """Async K = 1, 2 ranks, 2 servers: train-1 SIGKILLed at step 4; the same command again resumes from step 3's
    checkpoint and trains steps 4-6 with every sample still within one version of its step."""
    from tests.test_scenarios import run_scenario

    run_dir, out = run_scenario(tmp_path, 12)
    assert out.returncode != 0
    again_dir, again = run_scenario(tmp_path, 12)
    assert again_dir == run_dir and again.returncode == 0, again.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(int(r["staleness_max"]) == 1 for r in rows)
    with open(run_dir / "summary.json") as fh:
        assert json.load(fh)["resumed_from_step"] == 3


@pytest.mark.slow
def test_scenario14_the_end_comes_while_a_batch_is_under_way_and_nothing_waits(tmp_path):
    """Async K = 2, 2 ranks, 2 servers: the producer is generating batch 4 (rollout-1 holds each of its /generate
    calls 30 s) when train-1's step 3 raises. The run fails naming train-1, every process has exited within seconds
    of the failure (nothing waits for the batch or for a version that will never come), and `rlhf diagnose` names
    train-1."""
    from tests.test_scenarios import assert_diagnosed, log_lines, run_scenario, stamp

    run_dir, out = run_scenario(tmp_path, 14)
    assert out.returncode != 0
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage train" in first and "train-1" in first, first
    with open(run_dir / "exits.jsonl") as fh:
        last_exit = max(json.loads(line)["time"] for line in fh)
    assert last_exit - stamp(first) < 5.0, last_exit - stamp(first)
    assert_diagnosed(run_dir, "train-1", "train", "exception")


@pytest.mark.slow
def test_the_receiver_that_never_entered_the_broadcast_is_named_not_the_sender(tmp_path):
    """weights.mode distributed, 2 servers: rollout-1 never joins step 3's broadcast. The stall watchdog names
    rollout-1 (rollout-0 already has its copy: gloo's root sends to each receiver in turn), the run fails from
    train-0's broadcast, and `rlhf diagnose` names rollout-1, not the sender left waiting."""
    from tests.test_scenarios import assert_diagnosed, run_scenario

    run_dir, out = run_scenario(tmp_path, "broadcast_receiver_hang")
    assert out.returncode != 0
    log = (run_dir / "logs" / "controller-0.log").read_text().splitlines()  # the watchdog's report is ours: all lines
    watchdog = next(line for line in log if " ERROR " in line and "stall watchdog" in line)
    assert "while rollout-1 is not receiving it; rollout-1 is missing from the weights broadcast" in watchdog, watchdog
    assert_diagnosed(run_dir, "rollout-1", "weights_update", "hang")


def test_a_rollout_server_killed_mid_batch_is_left_out_of_the_pause_and_started_again(tmp_path):
    """Async K = 1, 2 servers: rollout-0 SIGKILLed as the step-3 weights update pauses it. The pause finds it gone:
    hardened starts it again and leaves it out of the pause and the continue (it has nothing running), the update
    gives it the step's weights, and the run finishes (before: "cannot reach rollout-0 …/pause_generation" failed
    the run in weights_update)."""
    faults = tmp_path / "kill.yaml"
    faults.write_text("faults:\n  - name: kill-rollout0\n    kind: process_kill\n    point: rpc.server.handle\n"
                      "    target: {role: rollout, rank: 0, peer: /pause_generation}\n    when: {step: 3}\n")
    rows, summary = _run(tmp_path, "run", "--steps", "3", "--rollout.mode", "async", "--rollout.servers", "2",
                         "--faults", str(faults))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert sum(int(r["rollout_restarts"] or 0) for r in rows) == 1
    log = (tmp_path / "run" / "logs" / "controller-0.log").read_text()
    assert "rollout-0 went down during its /pause_generation" in log and "left out of it" in log, log[-3000:]

