"""Silently stale weights (scenario 13): a rollout server acknowledges a weights update and keeps its old weights.
Nothing fails; the step's rollout_train_logprob_diff jumps, `rlhf diagnose` names the server from steps.csv alone
(faithful), and hardened's drift check names it by checksum. Real processes, real weights, the smoke preset."""

import csv
import json
import subprocess
import sys

import pytest
import torch
import yaml

from rlhf.diagnosis import diagnose
from rlhf.services.rollout_server.memory import keeping, stale_mode
from tests.conftest import ROOT
from tests.test_async import REWARDS


def _run(tmp_path, preset):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    faults = tmp_path / "stale.yaml"
    faults.write_text(yaml.safe_dump({"faults": [{
        "name": "rollout-keeps-old-weights", "kind": "weights_stale", "point": "weights_update.update",
        "target": {"role": "rollout", "rank": 0}, "when": {"step": 3, "max_hits": 1}, "params": {"mode": "keep"}}]}))
    run_dir = tmp_path / preset
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "4",
                          "--sft.max_steps", "0", "--rollout.prompts_per_step", "8", "--reward.functions",
                          f"{rewards}:odd", "--algorithm.resample_rounds", "0", "--task.eval_size", "8",
                          "--weights.verify", "false", "--resilience", preset, "--faults", str(faults),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]  # nothing fails: the fault is silent
    with open(run_dir / "steps.csv") as fh:
        return run_dir, list(csv.DictReader(fh))


def _diffs(rows):
    return [float(r["rollout_train_logprob_diff"]) for r in rows]


@pytest.mark.parametrize("preset", [pytest.param("faithful", marks=pytest.mark.slow(
    reason="suite time: hardened's run by default")), "hardened"])
def test_a_server_that_keeps_its_old_weights_shows_in_the_logprob_difference_and_is_named(tmp_path, preset):
    run_dir, rows = _run(tmp_path, preset)
    diffs = _diffs(rows)
    assert diffs[2] > 1e-3 and max(diffs[:2] + diffs[3:]) < 1e-4, diffs  # step 3 only; step 4's update repairs it
    marker = [json.loads(line) for line in (run_dir / "faults" / "markers.jsonl").read_text().splitlines()]
    assert any(m["event"] == "inject" and m["kind"] == "weights_stale" and m["step"] == 3 for m in marker)
    log = (run_dir / "logs" / "controller-0.log").read_text()
    if preset == "hardened":
        assert [r["weights_drift"] for r in rows] == ["0", "0", "1", "0"]
        warning = next(line for line in log.splitlines() if "logprobs differ by" in line)
        assert "step 3:" in warning and "rollout-0: version 3 checksum" in warning, warning
    else:
        assert [r["weights_drift"] for r in rows] == [""] * 4 and "logprobs differ by" not in log
    d = diagnose(str(run_dir))
    assert d.root is not None and d.root.process == "rollout-0" and d.root.category == "weights_drift", d.render()
    assert d.root.step == 3


@pytest.mark.parametrize("mode,kept", [("keep", 4), ("half", 2)])
def test_the_stale_load_acknowledges_the_update_and_keeps_the_old_values(mode, kept):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    before = [p.detach().clone() for p in model.parameters()]

    def load():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    keeping(model, stale_mode([{}, {"stale": mode}]), load)
    same = [torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    assert same == [False] * (4 - kept) + [True] * kept
    keeping(model, stale_mode(()), load)  # no fault: the load is the load
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
