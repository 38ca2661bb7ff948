"""rollout.data_plane store on real processes: the rows stay in the rollout server that generated them (scored
there), the train rank fetches its share by row id, and the run trains exactly as the controller data plane does."""

import csv
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

REWARD = '''
def odd(completions, answers, prompts=None, **_):
    return [float(len(c) % 2) for c in completions]
'''

SAME = ("reward_mean", "reward_odd", "kl", "loss", "grad_norm", "entropy", "response_length", "rollout_tokens",
        "rollout_train_logprob_diff", "rollout_train_logprob_diff_max", "clip_fraction")


def _run(tmp_path, plane):
    run_dir = tmp_path / plane
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "2",
                          "--sft.max_steps", "0", "--reward.functions", f"{tmp_path}/rewards.py:odd",
                          "--algorithm.kl_coef", "0.05", "--algorithm.old_logprobs", "recompute",
                          "--rollout.data_plane", plane, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, list(csv.DictReader((run_dir / "steps.csv").open()))


def _spans(path):
    return [s["name"] for line in path.read_text().splitlines() for r in json.loads(line)["resourceSpans"]
            for scope in r["scopeSpans"] for s in scope["spans"]]


def test_the_store_data_plane_trains_exactly_as_the_controller_plane(tmp_path):
    """Same seed, two runs: every loss, KL, reward and logprob-difference column is equal to the last digit, while
    in the store run the server kept and scored the rows (rows.keep) and the rank fetched them (batch.fetch)."""
    (tmp_path / "rewards.py").write_text(REWARD)
    _, through = _run(tmp_path, "controller")
    store_dir, kept = _run(tmp_path, "store")
    assert len(through) == len(kept) == 2
    assert any(float(r["reward_mean"]) > 0 for r in kept) and any(float(r["kl"]) > 0 for r in kept)
    for a, b in zip(through, kept):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
    assert _spans(store_dir / "traces" / "rollout-0.jsonl").count("rows.keep") >= 2
    assert _spans(store_dir / "traces" / "train-0.jsonl").count("batch.fetch") == 2  # once a step: kept for train


@pytest.mark.parametrize("policy", [pytest.param("faithful", marks=pytest.mark.slow), "hardened"])  # the suite's time
def test_a_rows_reply_changed_in_transit_fails_where_it_arrives_or_is_fetched_again(tmp_path, policy):
    """rollout-0's /rows reply to the train rank cut 2 entries short at step 2 (as scenario 8 cuts a reference reply):
    faithful, the rank's reference pass fails on the short tensor; hardened (stage_checksums), the reply fails its
    sender's checksum where it arrives, naming rollout-0, and the rank fetches the rows again from the store (/rows
    is a read): the run finishes and `rlhf diagnose` names rollout-0's reply."""
    from rlhf.diagnosis import diagnose

    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n  - name: rows-reply-cut-short\n    kind: network_loss\n    point: rpc.server.handle\n"
                      "    target: {role: rollout, rank: 0, peer: /rows}\n    when: {step: 2, max_hits: 1}\n"
                      "    params: {mode: truncate_tensor, cut: 2}\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "3",
                          "--sft.max_steps", "0", "--rollout.data_plane", "store", "--resilience.preset", policy,
                          "--faults", str(faults), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    log = (run_dir / "logs" / "controller-0.log").read_text()
    if policy == "faithful":
        assert out.returncode != 0
        assert "run failed: step 2, stage reference:" in log and "CorruptPayload" not in log, log[-3000:]
        return
    assert out.returncode == 0, out.stderr[-3000:]
    assert "retrying POST /rows to rollout-0 (attempt 2 of 3; idempotent) after CorruptPayload: reply from rollout-0 " \
           "to /rows" in log, log[-3000:]
    assert len(list(csv.DictReader((run_dir / "steps.csv").open()))) == 3
    root = diagnose(str(run_dir)).root
    assert root is not None and (root.process, root.category, root.step) == ("rollout-0", "data_mismatch", 2)
