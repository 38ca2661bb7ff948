"""Dynamic sampling (algorithm.resample_rounds): groups whose samples all got one reward are replaced by groups of
fresh prompts that did not, before the step trains."""

import csv
import subprocess
import sys

import torch

from rlhf.algorithms.grpo import equal_groups
from rlhf.batch import DistributedBatchMemory
from tests.conftest import ROOT


def test_equal_groups_and_taking_groups_keep_each_groups_rows_together():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert equal_groups(rewards, 2) == [0, 2, 3]
    assert equal_groups(rewards, 4) == []
    memory = DistributedBatchMemory({"sample_index": list(range(8)), "rewards": rewards}, group_size=2)
    taken = memory.groups([3, 0])
    assert taken["sample_index"] == [6, 7, 0, 1] and taken["rewards"].tolist() == [0.5, 0.5, 1.0, 1.0]


REWARDS = """
def fifth(completions, **kwargs):
    # 1 for a completion whose length is a multiple of 5: a group of 4 gets one reward for all its samples often
    return [1.0 if len(c) % 5 == 0 else 0.0 for c in completions]
"""


def test_a_run_with_dynamic_sampling_trains_on_groups_that_carry_an_advantage(tmp_path):
    """A real run (smoke preset, 8 prompts x 4 samples a step): each step's first round has groups without
    advantage; the extra rounds draw fresh prompts for them and put the groups that carry an advantage in their
    places, so fewer equal groups are trained on, and the batch keeps its size."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "3",
                          "--sft.max_steps", "0", "--rollout.prompts_per_step", "8", "--reward.functions",
                          f"{rewards}:fifth", "--algorithm.resample_rounds", "2", "--task.eval_size", "8",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3
    for r in rows:
        equal, replaced, drawn = int(r["equal_reward_groups"]), int(r["resampled_groups"]), int(r["resample_prompts"])
        assert int(r["batch_size"]) == 32
        assert replaced <= equal and drawn >= equal and replaced <= drawn
        assert int(r["equal_groups_trained"]) == equal - replaced, r
    assert sum(int(r["resampled_groups"]) for r in rows) > 0
