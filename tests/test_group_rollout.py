"""Generation by groups (rollout.buffer group): the buffer's rules on a fake producer, whose groups end when the test
says so (rlhf.control.group_rollout), and one real async run that trains on groups."""

import csv
import subprocess
import sys
import threading

import pytest
import torch

from rlhf.batch import StepBatch
from rlhf.control.async_rollout import Produced
from rlhf.control.group_rollout import GroupPipeline
from tests.conftest import ROOT


class Groups:
    """A producer whose group of example e ends when gates[e] is set (set: at once); each sample says the version
    the servers held when its group started."""

    def __init__(self, slow: set[int]) -> None:
        self.gates = {e: threading.Event() for e in slow}
        self.drawn = 0
        self.pipeline: GroupPipeline | None = None
        self.started: list[int] = []

    def draw(self) -> int:
        self.drawn += 1
        return self.drawn - 1

    def produce(self, step: int, examples: list[int], first: int, tag: str) -> Produced:
        (example,) = examples  # one group a call
        version = self.pipeline.version
        self.started.append(example)
        if example in self.gates:
            assert self.gates[example].wait(30)
        return Produced(StepBatch({"sample_index": [0, 1], "example": [example] * 2,
                                   "weight_version": [str(version)] * 2}, 2), None, {"rollout_migrated": 1})


def _pipeline(groups: Groups, k: int, last: int = 4) -> GroupPipeline:
    groups.pipeline = GroupPipeline(groups.produce, groups.draw, None, max_staleness=k, last_step=last,
                                    prompts_per_step=2, group_size=2, servers=2, sampler_state=lambda: {})
    return groups.pipeline


def _examples(produced: Produced) -> list[int]:
    return produced.batch["example"][::2]


def test_a_long_tail_group_joins_a_later_batch_instead_of_holding_this_one():
    """K = 2, 2 groups a step: group 0 hangs; step 1 takes groups 1 and 2 (the first that ended), and group 0 is
    trained at a later step once it ends, within the bound; the rows' counters add up over the groups."""
    groups = Groups(slow={0})
    pipeline = _pipeline(groups, k=2)
    pipeline.start(1, version=0)
    first, waits = pipeline.take(1)
    assert _examples(first) == [1, 2] and first.batch["sample_index"] == [0, 1, 2, 3]
    assert first.row["rollout_migrated"] == 2 and waits["buffer_groups"] >= 0
    pipeline.loaded(1)
    groups.gates[0].set()
    with pipeline.cond:  # group 0 has ended
        assert pipeline.cond.wait_for(lambda: any(g.batch["example"][0] == 0 for _s, _v, g in pipeline.buffer), 30)
    seen = []
    for step in (2, 3):
        produced, _ = pipeline.take(step)
        seen += _examples(produced)
        versions = {int(v) for v in produced.batch["weight_version"]}
        assert all(step - v <= 2 for v in versions), (step, versions)  # within the staleness bound
        pipeline.loaded(step)
    assert 0 in seen[:2]  # at the next step: the oldest versions first (nearest the bound)
    pipeline.close(wait_s=5)


def test_groups_start_only_while_their_version_may_still_serve_a_step_and_stale_ones_are_dropped():
    """K = 0: nothing starts before the step's weights are out (a group of an older version could serve no step);
    K = 1: a group that ended past its bound (it spanned two updates) is dropped at the take, and another fills the
    batch."""
    groups = Groups(slow=set())
    pipeline = _pipeline(groups, k=0)
    pipeline.start(1, version=0)
    assert not pipeline.admitted(1)
    assert not groups.started  # serves no step yet
    pipeline.loaded(1)
    produced, _ = pipeline.take(1)
    assert {int(v) for v in produced.batch["weight_version"]} == {1}
    pipeline.close(wait_s=5)

    groups = Groups(slow=set())
    pipeline = _pipeline(groups, k=1)
    pipeline.start(1, version=0)
    pipeline.take(1)
    pipeline.loaded(1)
    pipeline.take(2)
    pipeline.loaded(2)
    with pipeline.cond:  # a group of version 0 that ended only now: past its bound at step 3
        pipeline.buffer.insert(0, (1000, 0, Produced(StepBatch({"sample_index": [0, 1], "example": [-1, -1],
                                                                 "weight_version": ["0", "0"]}, 2))))
    produced, waits = pipeline.take(3)
    assert -1 not in _examples(produced) and waits["groups_dropped"] == 1
    pipeline.close(wait_s=5)


@pytest.mark.slow  # the suite's time (~16 s): the rules above run by default; this is their wiring on real processes
def test_an_async_run_trains_on_groups(tmp_path):
    """rollout.buffer group on real processes: 2 rollout servers, K = 2; every step trains a whole batch of groups,
    each within the staleness bound."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "3",
                          "--sft.max_steps", "0", "--rollout.mode", "async", "--rollout.max_staleness", "2",
                          "--rollout.buffer", "group", "--rollout.servers", "2", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "steps.csv").open()))
    assert len(rows) == 3 and len({r["batch_size"] for r in rows}) == 1
    assert all(0 <= int(r["staleness_max"]) <= 2 for r in rows) and all(r["groups_dropped"] == "0" for r in rows)
    spans = (run_dir / "traces" / "controller-0.jsonl").read_text()
    assert '"rollout.group"' in spans


def test_a_call_of_several_groups_puts_each_in_the_buffer_on_its_own():
    """rollout.groups_per_call 2: one call generates two groups (a native engine batches them); each enters the
    buffer as a group of its own, the call's counters with the first, and a step takes them as any others."""
    calls = []

    def produce(step, examples, first, tag):
        calls.append(list(examples))
        return Produced(StepBatch({"sample_index": list(range(2 * len(examples))),
                                   "example": [e for e in examples for _ in range(2)],
                                   "weight_version": ["0"] * 2 * len(examples)}, 2), None, {"rollout_migrated": 3})

    drawn = iter(range(100))
    pipeline = GroupPipeline(produce, lambda: next(drawn), None, max_staleness=1, last_step=2, prompts_per_step=4,
                             group_size=2, servers=2, sampler_state=lambda: {}, per_call=2)
    pipeline.start(1, version=0)
    produced, _ = pipeline.take(1)
    assert all(len(c) == 2 for c in calls) and sorted(_examples(produced)) == [0, 1, 2, 3]
    assert produced.row["rollout_migrated"] == 3 * 2  # two calls, counted once each
    assert produced.batch["sample_index"] == list(range(8))
    pipeline.close(wait_s=5)


def test_dynamic_sampling_scores_each_group_once_and_the_step_takes_its_rewards():
    """algorithm.resample_rounds with groups: keep() scores a group as it ends (the rewards stay in it, their means
    with it); a step's batch carries the kept groups' rewards and the mean of their means, so the step does not
    score them again (the controller scores only a batch without rewards)."""
    scored = []

    def keep(produced):
        example = produced.batch["example"][0]
        scored.append(example)
        rewards = [1.0, 1.0] if example % 2 == 0 else [0.0, float(example)]  # even examples: one reward, dropped
        produced.batch["rewards"] = torch.tensor(rewards)
        produced.means["reward_x"] = sum(rewards) / 2
        return example % 2 == 1

    groups = Groups(slow=set())
    groups.pipeline = pipeline = GroupPipeline(
        groups.produce, groups.draw, keep, max_staleness=1, last_step=1, prompts_per_step=2, group_size=2,
        servers=2, sampler_state=lambda: {}, resample_rounds=2)
    pipeline.start(1, version=0)
    produced, waits = pipeline.take(1)
    pipeline.close(wait_s=5)
    kept = _examples(produced)
    assert all(e % 2 == 1 for e in kept) and waits["resampled_groups"] >= 1
    assert produced.batch["rewards"].tolist() == [r for e in kept for r in (0.0, float(e))]
    assert produced.means == {"reward_x": sum(e / 2 for e in kept) / 2}
    assert sorted(scored) == sorted(set(scored))  # each group scored once
