"""The agent harness (agent.path, rlhf/control/agents.py): an episode's completions as samples, token for token;
each sample's advantage its episode's; the config and the agent's file checked before anything starts; and real
runs whose agents use the openai package's client against the run's gateway."""

import csv
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhf.batch import StepBatch
from rlhf.config import HARDENED, AlgorithmConfig, ConfigError, build_config
from rlhf.control.agents import AgentError, Agents, Call, load_agent, samples_of
from rlhf.control.train_stage import TrainStage
from rlhf.diagnosis.rules import _subject
from rlhf.tasks.base import Example
from rlhf.transport.client import LoopThread
from tests.conftest import ROOT

pytest.importorskip("openai", reason="pip install -e '.[test]' (the openai package)")


def test_calls_that_extend_each_other_are_one_sample_and_a_new_prompt_starts_another():
    first = Call([1, 2], [3, 4], [-0.1, -0.2], ["1", "1"], "x", 0)
    second = Call([1, 2, 3, 4, 9, 9], [5], [-0.3], ["2"], "y", 1)  # extends: 9 9 is the observation
    third = Call([7, 1, 2], [6], [-0.4], ["2"], "z", 1)  # a history rendered again: does not extend
    samples = samples_of([first, second, third])
    assert len(samples) == 2
    one, two = samples
    assert one["prompt_ids"] == [1, 2] and one["output_ids"] == [3, 4, 9, 9, 5]
    assert one["loss_mask"] == [1, 1, 0, 0, 1] and one["logprobs"] == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert one["token_versions"] == ["1", "1", "", "", "2"] and one["turns"] == 2
    assert two["prompt_ids"] == [7, 1, 2] and two["output_ids"] == [6] and two["loss_mask"] == [1]
    # a call whose prompt is shorter than the sample so far, or differs inside it, starts a sample too
    assert len(samples_of([first, Call([1, 2, 3], [8], [-1.0], ["1"], "", 0)])) == 2
    assert len(samples_of([first, Call([1, 9, 3, 4, 5], [8], [-1.0], ["1"], "", 0)])) == 2


def test_every_sample_of_an_episode_gets_the_episodes_advantage():
    """Groups of 2 episodes; episode 1 and 3 are two samples each. The advantages are the episodes' (their rewards
    normalised in their group), whatever the number of samples."""
    stage = TrainStage.__new__(TrainStage)
    stage.group_size, stage.algorithm = 2, AlgorithmConfig()
    batch = StepBatch({"episode": [0, 1, 1, 2, 3, 3], "sample_index": list(range(6))}, 1, strict=False)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])  # episode 2 and 3 tie: advantage 0
    shares = [batch.rows([0, 2, 4]), batch.rows([1, 3, 5])]
    stats = stage._episode_advantages(batch, shares)
    assert stats["groups"] == 2 and stats["equal_reward_groups"] == 1
    a0, a1, a2 = shares[0]["advantages"].tolist()
    b0, b1, b2 = shares[1]["advantages"].tolist()
    assert a0 > 0 and a1 == b0 == -a0 and a2 == b1 == b2 == 0.0  # samples 1, 2 (episode 1) share one advantage


def test_a_bad_agent_is_one_clear_line_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="names no function"):
        build_config(dotted=[("agent.path", "agents.py")])
    with pytest.raises(ConfigError, match="env.path 'tool_calls'"):
        build_config(dotted=[("agent.path", "a.py:fn"), ("env.path", "tool_calls"), ("env.tools", "t.py")])
    path = tmp_path / "agents.py"
    path.write_text("def helper(x):\n    return x\n\n\ndef agent(client):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"has no function 'run' \(its functions: agent, helper\)"):
        load_agent(f"{path}:run")
    with pytest.raises(ValueError, match=rf"\({path}:5\): an agent is fn\(client, row\)"):
        load_agent(f"{path}:agent")
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--agent.path", f"{tmp_path}/no.py:fn"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and f"agent.path: file '{tmp_path}/no.py' does not exist" in out.stderr


def test_an_agent_drives_grpo_through_the_gateway_and_its_tokens_are_trained_on(tmp_path):
    """tests/token_agent.py checks the gateway's contract from inside each episode (n, the max_tokens cap, a seed and
    temperature overruled, logprobs only when asked, no top logprobs, a stream) and makes four completions, the
    second extending the first: every episode is three samples, trained with its episode's advantage; its calls are
    spans of the step's trace. rollout-1 is SIGKILLed in step 2: its episodes' calls go on on rollout-0 and the
    evaluation after the run gets a server started again (hardened)."""
    run_dir = tmp_path / "run"
    faults = tmp_path / "kill.yaml"  # rollout-1 SIGKILLed inside step 2's first /generate: its calls go on elsewhere
    faults.write_text("faults:\n  - {name: killed, kind: process_kill, point: rollout.generate, target: {role: rollout, "
                      "rank: 1}, when: {step: 2}, params: {signal: KILL}}\n")
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "2",
                          "--faults", str(faults),
                          "--sft.max_steps", "0", "--rollout.servers", "2", "--sampling.max_new_tokens", "8",
                          "--task.eval_size", "8",
                          "--agent.path", f"{ROOT}/tests/token_agent.py:agent", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the run samples at 1.0" in out.stderr and "a seed in the agent's requests is dropped" in out.stderr
    rows = list(csv.DictReader((run_dir / "steps.csv").open()))
    episodes = 4 * 4  # smoke: 4 prompts x group of 4
    for r in rows:
        assert int(r["agent_calls"]) == 4 * episodes and int(r["agent_split"]) == episodes
        assert int(r["agent_merged"]) == 0 and int(r["batch_size"]) == 3 * episodes
        assert 0.0 <= float(r["reward_agent"]) <= 1.0 and float(r["reward_mean"]) == float(r["reward_agent"])
    assert int(rows[0]["rollout_migrated"]) == 0 and int(rows[1]["rollout_migrated"]) > 0
    assert "rollout-1 failed agent episode" in out.stderr and "its episodes' calls go on on the other servers" in \
        out.stderr
    spans = [s for line in (run_dir / "traces" / "controller-0.jsonl").open()
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    rollout = {s["traceId"] for s in spans if s["name"] == "stage.rollout" or s["name"] == "rollout"}
    calls = [s for s in spans if s["name"] == "agent.call"]
    assert len(calls) >= 2 * 4 * episodes and all(s.get("parentSpanId") for s in calls)
    assert rollout and sum(s["traceId"] in rollout for s in calls) >= 2 * 4 * episodes


class _Fanout:
    """What Agents needs of the rollout fanout, with no rollout server: agents here fail before any call."""

    def __init__(self) -> None:
        self.loop = LoopThread("test-rpc")
        self.services = SimpleNamespace(rollout=[])
        self.sampling = SimpleNamespace(max_new_tokens=8, temperature=1.0, top_p=1.0)
        self.rollout = SimpleNamespace(group_size=2)
        self.migrated = 0


AGENTS = '''
import asyncio


async def hangs(client, row):
    await asyncio.Event().wait()  # an agent stuck on something of its own (a tool, a lock)


async def raises(client, row):
    if row["prompt"] == "2+2=":
        raise KeyError("score")
    await asyncio.Event().wait()
'''


@pytest.mark.parametrize("name,stall_s,timeout_s,named,words", [
    ("hangs", 0.3, 1.5, ["stall watchdog (step 3, stage rollout, agent)", "has made no call in episode 3-0",
                         "(row 0: '1+1=')", "its last call: no call yet"],
     ["ran episode 3-0 (row 0: '1+1=') past agent.timeout_s 1.5 s"]),
    ("raises", 0.0, 60, [], ["failed episode 3-2 (row 2: '2+2=') after 0 call(s)", "KeyError: 'score'"]),
])
def test_an_agent_that_hangs_or_fails_is_named_with_its_row_and_last_call(tmp_path, caplog, name, stall_s, timeout_s,
                                                                          named, words):
    """A hung agent: the stall watchdog names it (an ERROR line: its own tool may think that long), agent.timeout_s
    fails the step naming it; an agent that raises fails the step with its error, row and last call."""
    (tmp_path / "agents.py").write_text(AGENTS)
    fanout = _Fanout()
    agents = Agents(f"{tmp_path}/agents.py:{name}", 8, timeout_s, fanout, "token", stall_s, HARDENED)
    try:
        with pytest.raises(AgentError) as caught:
            agents.generate(3, [Example("1+1=", "2"), Example("2+2=", "4")])
        for word in words:
            assert word in str(caught.value), str(caught.value)
        for word in named:
            assert word in caplog.text, caplog.text
        # the diagnosis blames the agent (in the controller's process), not the server of its last call it names
        assert _subject("controller-0", f"run failed: step 3, stage rollout: AgentError: {caught.value} (its last "
                                        "call: call 2 on rollout-1)") == ("controller-0", True)
        assert agents.gateway.episodes == {}  # the step's episodes are gone: a late call gets 404
    finally:
        agents.close()
        fanout.loop.close()
