"""rollout.data_plane store on real processes: the rows stay in the rollout server that generated them (scored
there), the train rank fetches its share by row id, and the run trains exactly as the controller data plane does."""

import csv
import json
import subprocess
import sys

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
