"""The reward-model stage (reward_model.path): a sequence-classification model served by job reward-0, its score
added to the task's rewards with reward_model.weight; its death and its hang named by `rlhf diagnose`.

The reward model here is a tiny random-init LlamaForSequenceClassification built by the test (no download)."""

import csv
import json
import math
import subprocess
import sys

import pytest

from rlhf.diagnosis import diagnose
from rlhf.models.hf_dir import write_model_dir
from rlhf.models.reward_model import RewardModel, check_reward_model_dir, write_reward_model_dir
from rlhf.tracing.read import load_spans
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left

RUN = [sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--sft.max_steps", "0"]


def faulted_run(tmp_path, name, kind, when, *args):
    """A smoke GRPO run with one fault at reward_model.score on reward-0; (run dir, the finished process), nothing
    of it left running."""
    faults = tmp_path / "fault.yaml"
    faults.write_text(f"faults:\n  - name: {name}\n    point: reward_model.score\n    kind: {kind}\n"
                      f"    target: {{role: reward}}\n    when: {when}\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([*RUN, *args, "--faults", str(faults), "--run-dir", str(run_dir)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert_none_left(run_dir)
    return run_dir, out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return write_reward_model_dir(str(tmp_path_factory.mktemp("rm") / "rm"))


def test_scores_do_not_depend_on_the_batch_or_its_padding(rm_dir):
    rm = RewardModel(rm_dir, batch_size=3)  # 4 pairs: a batch of 3 (padded to the longest) and one of 1
    prompts, completions = ["1+2=", "10+4=", "7+7=", "99+1="], ["3</s>", "14 and more", "", "100"]
    together = rm.score(prompts, completions)
    alone = [rm.score([p], [c])[0] for p, c in zip(prompts, completions)]
    assert together == pytest.approx(alone, abs=1e-5)
    assert all(math.isfinite(s) for s in together) and len({round(s, 5) for s in together}) == 4
    with pytest.raises(ValueError, match="chat template"):
        RewardModel(rm_dir, chat_template=True)  # the character tokenizer has none


def test_a_directory_that_is_no_reward_model_is_refused_before_anything_starts(tmp_path, rm_dir):
    causal = write_model_dir(str(tmp_path / "lm"), layers=1, hidden=32, heads=2, kv_heads=2, ffn=64)
    problem = check_reward_model_dir(causal)
    assert "LlamaForCausalLM" in problem and "ForSequenceClassification" in problem
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    two = tmp_path / "two-labels"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "bad", "1": "good"}}))
    assert "2 labels" in check_reward_model_dir(str(two))
    assert check_reward_model_dir(rm_dir) is None
    out = subprocess.run([*RUN, "--reward_model.path", causal, "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "reward_model.path" in out.stderr and "LlamaForCausalLM" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_grpo_adds_the_reward_models_score_and_a_killed_reward_server_is_started_again_and_named(tmp_path, rm_dir):
    """Steps 1-3 score with reward-0 (each step's reward = exact match + 0.5 x the model's score, the model's mean
    in steps.csv and in a span of reward-0); at step 4 reward-0 is killed inside /score: hardened (restart_rollout)
    starts it again and scores the batch again, the run finishes, and `rlhf diagnose` names reward-0, killed by
    SIGKILL, in the reward stage."""
    run_dir, out = faulted_run(tmp_path, "kill-reward-server", "process_kill",
                               "{step: 4, max_hits: 1}\n    params: {signal: KILL}", "--steps", "4",
                               "--reward_model.path", rm_dir, "--reward_model.weight", "0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert [int(r["rollout_restarts"] or 0) for r in rows] == [0, 0, 0, 1]
    for r in rows:
        model, rule = float(r["reward_model"]), float(r["reward_exact_match"])
        assert model != 0.0 and float(r["reward_mean"]) == pytest.approx(rule + 0.5 * model, abs=1e-6)
    scores = [s for s in load_spans(str(run_dir)).spans if s.service == "reward-0" and s.name == "POST /score"]
    assert len(scores) >= 4 and {s.attributes.get("rlhf.step") for s in scores} >= {1, 2, 3, 4}
    log = (run_dir / "logs" / "reward-0.log").read_text()
    assert "scored 16 completions" in log and log.count("reward server") >= 2, log[-2000:]
    assert "reward-0 is down (lost during the reward model's scores" in out.stderr + \
        (run_dir / "logs" / "controller-0.log").read_text()
    root = diagnose(str(run_dir)).root
    assert root.process == "reward-0" and root.stage == "reward" and "SIGKILL" in root.exit, root


@pytest.mark.slow  # suite time: the reward server's death is in the default suite
def test_a_hung_reward_server_fails_the_step_at_reward_timeout_s_and_is_named(tmp_path, rm_dir):
    run_dir, out = faulted_run(tmp_path, "hang-reward-server", "hang", "{step: 2}", "--steps", "2",
                               "--reward_model.path", rm_dir, "--reward_model.timeout_s", "2")
    assert out.returncode != 0 and "RpcTimeout: no reply from reward-0" in out.stderr, out.stderr[-3000:]
    root = diagnose(str(run_dir)).root
    assert root.process == "reward-0" and root.stage == "reward" and root.step == 2, root
