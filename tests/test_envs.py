"""Environments (env.path): the tool_calls environment, loading the user's class, the multi-turn rollout whose
observation tokens are masked out of the loss, and a GRPO run whose every sample is an episode."""

import asyncio
import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from rlhf.envs import EnvError, build_env
from tests.conftest import ROOT
from tests.test_scenarios import assert_none_left

TOOLS = f"{ROOT}/examples/envs/calculator.py"


def test_tool_calls_runs_each_call_and_answers_it_and_counts_what_went_wrong():
    env = build_env("tool_calls", {"tools": TOOLS})()
    assert env.reset({"prompt": "123*456=", "answer": "56088"}) == ""
    both = env.step('<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>'
                    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert (both.observation, both.done, both.info) == (
        "<tool_response>56088</tool_response><tool_response>3</tool_response>", False,
        {"tool_calls": 2, "tool_errors": 0, "infra_errors": 0, "infra_retries": 0})
    bad = env.step('<tool_call>{"name": "divide", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
                   '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert bad.info == {"tool_calls": 3, "tool_errors": 3, "infra_errors": 0, "infra_retries": 0}
    assert "no tool 'divide' (tools: add, multiply)" in bad.observation and "not JSON" in bad.observation
    assert "missing 1 required positional argument: 'b'" in bad.observation
    end = env.step("the answer is 56088")
    assert end.done and end.observation == "" and end.reward is None


def test_a_bad_environment_is_one_error_naming_what_and_where(tmp_path):
    with pytest.raises(EnvError, match="'sandbox' is not a built-in environment \\(built-in: tool_calls\\)"):
        build_env("sandbox")
    envs = tmp_path / "envs.py"
    envs.write_text("class Half:\n    def reset(self, row):\n        return ''\n\ndef helper():\n    pass\n")
    with pytest.raises(EnvError, match="has no 'Game' \\(its classes: Half\\)"):
        build_env(f"{envs}:Game")
    with pytest.raises(EnvError, match=rf"{envs}:1\): an environment is a class with reset\(row\) and step\(action\) "
                                       r"\(this project's Env\), .*; it lacks step"):
        build_env(f"{envs}:Half")
    (tmp_path / "none.py").write_text("X = 1\n")
    with pytest.raises(EnvError, match="env.tools: .*none.py defines no public function"):
        build_env("tool_calls", {"tools": str(tmp_path / "none.py")})


def test_observation_tokens_are_out_of_the_loss_and_its_gradient(diverse):
    """A response of model tokens and an environment's answer between them: what the masked tokens' old and
    reference logprobs say changes neither the loss nor any gradient, and they are not counted."""
    from rlhf.config import AlgorithmConfig, OptimConfig
    from rlhf.data import rl_batch
    from rlhf.train.engine import TrainEngine

    model, _tok = diverse
    gen = torch.Generator().manual_seed(1)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    outputs = [torch.randint(4, 30, (9,), generator=gen).tolist(), torch.randint(4, 30, (7,), generator=gen).tolist()]
    masks = [[1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1]]  # model, observation, model
    grads = []
    for garbage in (0.0, 5.0):
        lps = [[-1.0 if m else -garbage for m in mask] for mask in masks]
        batch = rl_batch(prompts, outputs, lps, 0, masks)
        batch["advantages"] = torch.tensor([1.0, -0.5])
        batch["ref_logprobs"] = batch["old_logprobs"] - 0.3 + garbage * (1 - batch["response_mask"])
        m = __import__("copy").deepcopy(model)
        engine = TrainEngine(m, OptimConfig(micro_batch_size=2, mini_batches=1, grad_clip=0, warmup_steps=0),
                             AlgorithmConfig(kl_coef=0.1), keep_reference=False)
        engine.optimizer = torch.optim.SGD(engine.params, lr=1.0)  # the update is minus the gradient
        before = [p.detach().clone() for p in engine.params]
        metrics = engine.train_step(batch)
        grads.append([(p.detach() - b) for p, b in zip(engine.params, before)])
        assert metrics["tokens"] == sum(map(sum, masks))  # the observation tokens are not counted
    assert any(g.abs().max() > 1e-6 for g in grads[0])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-7)


ENV = '''
from rlhf.envs import Env, StepResult


class Echo(Env):
    """Answers every turn with '=' (an observation of one token) and a reward read from the turn's text; never
    done by itself."""

    def reset(self, row):
        self.answer = row["answer"]
        return ""

    def step(self, action):
        return StepResult(observation="=", reward=sum(map(ord, action)) % 3 / 2, info={"tool_calls": 1})
'''


def test_a_grpo_run_whose_samples_are_episodes(tmp_path):
    """Every sample an episode of env.max_turns turns (the environment never ends one), its environment in the
    environment server (job env-0): steps.csv counts them, the environment's rewards add to the reward functions',
    and the run trains on them; env-0 has its log and exit record and is gone after the run."""
    envs = tmp_path / "echo.py"
    envs.write_text(ENV)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--sft.max_steps",
                          "0", "--env.path", f"{envs}:Echo", "--env.max_turns", "3", "--sampling.max_new_tokens", "3",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2
    for r in rows:
        assert float(r["turns_mean"]) == 3 and int(r["tool_calls"]) == 3 * 16 and int(r["tool_errors"]) == 0
        assert 0 < float(r["reward_env"]) <= 3 and float(r["env_s"]) >= 0 and float(r["grad_norm"]) > 0
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    assert "environment server: " in (run_dir / "logs" / "env-0.log").read_text()
    with open(run_dir / "exits.jsonl") as fh:
        assert "env-0" in {json.loads(line).get("process") for line in fh}
    assert_none_left(run_dir)


def test_the_python_tool_runs_code_in_a_sandbox(monkeypatch):
    """What the code prints comes back; past the wall-clock limit its process group is killed; it gets a fresh
    working directory (removed after), nothing of the server's environment, and no network where a namespace can
    be made (root); the memory limit holds."""
    import os

    from rlhf.envs import sandbox

    monkeypatch.setattr(sandbox, "LIMITS", sandbox.Limits(timeout_s=1.0, cpu_s=1, memory_mb=256))
    monkeypatch.setenv("RLHF_TOKEN", "secret")
    assert sandbox.python("print(123 * 456)") == "56088\n"
    assert sandbox.python("import time\nwhile True: time.sleep(0.01)") == \
        "error: the code ran past 1 s and was stopped"
    where = sandbox.python("import os; print(os.getcwd()); print(os.environ.get('RLHF_TOKEN'))").split()
    assert where[0].startswith(os.path.join(os.path.realpath("/tmp"), "rlhf-sandbox-")) or "rlhf-sandbox-" in where[0]
    assert where[1] == "None" and not os.path.exists(where[0])
    assert "MemoryError" in sandbox.python("x = bytearray(1 << 30)")
    assert sandbox.python("import sys; sys.exit(3)") == "error: exit status 3"
    if sandbox.network_isolated():
        assert "Network is unreachable" in sandbox.python(
            "import socket; socket.create_connection(('192.0.2.1', 80), timeout=2)")
    env = build_env("tool_calls", {"tools": "rlhf.envs.sandbox"})()
    answer = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>')
    assert answer.observation == "<tool_response>1024\n</tool_response>" and answer.info["tool_errors"] == 0


@pytest.mark.slow  # the suite's budget: the default suite keeps the hardened run of the same fault, below
def test_a_killed_environment_server_fails_the_step_and_is_named(tmp_path):
    """Faithful: env-0 SIGKILLed at step 2's first /step: the step fails naming env-0 (no episode goes on with an
    error text as the tool's answer), nothing is left running, and `rlhf diagnose` names env-0's death."""
    from rlhf.diagnosis import diagnose

    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults",
                          f"{ROOT}/examples/faults/scenario16.yaml", "--run-dir", str(run_dir), "--resilience",
                          "faithful"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    first = next(line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
                 if " ERROR " in line and "run failed" in line)
    assert "step 2, stage rollout: RpcConnectionError: cannot reach env-0" in first, first
    assert_none_left(run_dir)
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.category, d.root.step) == ("env-0", "process_death", 2), \
        d.render()


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])  # the suite's time
def test_hardened_starts_a_killed_environment_server_again_and_runs_the_steps_episodes_again(tmp_path, mode):
    """Hardened (restart_rollout): the same kill; env-0 starts again, step 2's episodes run again from their reset
    on it, and the run finishes; steps.csv counts the restart at step 2 and env-0's log shows two starts. Async
    (K = 1): env-0 dies under the producer, generating batch 2 while step 1 trains; the producer starts it again
    and runs the batch's episodes again, and no step sees the producer's error."""
    run_dir = tmp_path / "run"
    flags = ["--rollout.mode", "async", "--rollout.max_staleness", "1"] if mode == "async" else []
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults",
                          f"{ROOT}/examples/faults/scenario16.yaml", "--run-dir", str(run_dir), *flags],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["rollout_restarts"] or 0) for r in rows] == [0, 1, 0]
    assert [r["batch_size"] for r in rows] == [rows[0]["batch_size"]] * 3  # step 2 kept its whole batch
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "env-0 is down (lost during the rollout: " in log and "starting it again" in log
    assert (run_dir / "logs" / "env-0.log").read_text().count("environment server: tool_calls") == 2
    assert_none_left(run_dir)


INFRA_TOOLS = '''
from rlhf.envs import InfraError


def search(query):
    raise ConnectionError("search service at 10.0.0.7:8080 refused the connection")


def sandbox(code):
    raise InfraError("the sandbox (pid 4242) was killed by SIGKILL, not by its limits")


def parse(text):
    return int(text)
'''


@pytest.mark.parametrize("policy", ["fail", "model"])
def test_an_infrastructure_failure_is_not_the_models_tool_output_unless_asked(tmp_path, policy):
    """A tool whose service is unreachable, or a sandbox killed from outside: with fail (hardened) the step's /step
    raises naming the tool, and the model never reads it; with model (faithful, verl's) the error is the tool's
    answer and infra_errors counts it. The model's own bad input (int('x')) is its answer either way."""
    from rlhf.envs import InfraError

    tools = tmp_path / "tools.py"
    tools.write_text(INFRA_TOOLS)
    env = build_env("tool_calls", {"tools": str(tools), "on_infra_error": policy})()
    mistake = env.step('<tool_call>{"name": "parse", "arguments": {"text": "x"}}</tool_call>')
    assert mistake.observation.startswith("<tool_response>error: ValueError: invalid literal") and \
        mistake.info == {"tool_calls": 1, "tool_errors": 1, "infra_errors": 0, "infra_retries": 0}
    for call, what in (('{"name": "search", "arguments": {"query": "q"}}', "ConnectionError: search service"),
                       ('{"name": "sandbox", "arguments": {"code": "1"}}', "InfraError: the sandbox (pid 4242)")):
        if policy == "fail":
            with pytest.raises(InfraError, match=f"tool .* failed: {re.escape(what)}.*not the model.s call"):
                env.step(f"<tool_call>{call}</tool_call>")
        else:
            out = env.step(f"<tool_call>{call}</tool_call>")
            assert what in out.observation and out.info["infra_errors"] == 1


FLAKY_SERVICE = '''
failures = {"left": 0}

def lookup(key):
    if failures["left"]:
        failures["left"] -= 1
        raise ConnectionError("lookup service reset the connection")
    return key.upper()
'''


def test_retry_calls_a_tool_again_after_its_infrastructure_failed_and_fails_the_step_when_none_succeeds(
        tmp_path, monkeypatch, caplog):
    """env.on_infra_error retry: two ConnectionErrors, then the service answers: the model reads the answer, not an
    error, and infra_retries counts the two (a WARNING each); a service that never answers fails the step after
    infra_retries + 1 tries, naming the tool; the model's own mistake is never retried."""
    from rlhf.envs import InfraError
    from rlhf.envs.tool_calls import ToolCallsEnv

    monkeypatch.setattr(ToolCallsEnv, "RETRY_WAIT_S", (0.01, 0.02))
    tools = tmp_path / "service.py"
    tools.write_text(FLAKY_SERVICE)
    env = build_env("tool_calls", {"tools": str(tools), "on_infra_error": "retry", "infra_retries": 2})()
    failures = env.tools["lookup"].__globals__["failures"]  # the tools' module, as the environment loaded it
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call>'
    failures["left"] = 2
    out = env.step(call)
    assert out.observation == "<tool_response>AB</tool_response>"
    assert out.info == {"tool_calls": 1, "tool_errors": 0, "infra_errors": 0, "infra_retries": 2}
    assert [r.getMessage() for r in caplog.records if "try 1 of 3" in r.getMessage()]
    failures["left"] = 3
    with pytest.raises(InfraError, match="tool 'lookup' failed after 3 tries: ConnectionError"):
        env.step(call)
    mistake = env.step('<tool_call>{"name": "lookup", "arguments": {"nope": 1}}</tool_call>')
    assert mistake.info["tool_errors"] == 1 and mistake.info["infra_retries"] == 0


def test_a_sandbox_starved_of_cpu_past_its_limit_is_the_infrastructures_failure(monkeypatch):
    """Past its wall-clock limit, a run that mostly waited for a CPU (burners on every core: the machine's load,
    verl #3478's sandbox timeouts under load) is an InfraError; a code that computes or sleeps past it is the
    code's, answered to the model."""
    from rlhf.envs import InfraError, sandbox
    from rlhf.procs import spawn, stop_group

    monkeypatch.setattr(sandbox, "LIMITS", sandbox.Limits(timeout_s=1.0, cpu_s=5, memory_mb=256))
    assert sandbox.python("while True: pass") == "error: the code ran past 1 s and was stopped"
    burners = [spawn([sys.executable, "-c", "while True: pass"]) for _ in range(3 * len(os.sched_getaffinity(0)))]
    try:
        with pytest.raises(InfraError, match=r"ran past its 1 s limit starved of CPU: it ran 0\.\d+ s and waited"):
            sandbox.python("while True: pass")
    finally:
        for b in burners:
            stop_group(b, grace_s=0.5)


@pytest.mark.slow
def test_a_long_tail_tool_call_is_named_in_seconds_not_at_the_timeout(tmp_path):
    """One multiply call hangs 60 s in env-0 at step 2 while the step's other episodes wait: the stall watchdog
    names env-0, the tool and the episode runtime.watchdog_stall_s (5 s) in, and the run fails then (hardened),
    not at timeouts.rollout_s; `rlhf diagnose` names env-0 (hang)."""
    from rlhf.diagnosis import diagnose
    from tests.test_scenarios import stamp

    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults",
                          f"{ROOT}/examples/faults/scenario17.yaml", "--task.operations", "*", "--run-dir",
                          str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    log = (run_dir / "logs" / "controller-0.log").read_text().splitlines()
    first = next(line for line in log if " ERROR " in line and "run failed" in line)
    assert "step 2, stage rollout: SyncStall: stall watchdog" in first and "env-0 has been in tool 'multiply'" in first
    ended = re.search(r"the step's other 63 episodes went on \((\d+) of them ended\)", first)
    assert ended and int(ended.group(1)) > 0, first  # the others did not wait for the hung call's episode
    began = next(line for line in log if "step 1/3" in line)  # step 2 began about here
    assert stamp(first) - stamp(began) < 15, first
    assert_none_left(run_dir)
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.category) == ("env-0", "hang"), d.render()


FLAKY_TOOLS = '''
def multiply(a, b):
    if (a + b) % 3 == 0:
        raise ConnectionError(f"calculator service refused multiply({a}, {b})")
    return a * b
'''


def test_drop_group_trains_the_step_without_the_groups_an_infrastructure_failure_hit(tmp_path):
    """env.on_infra_error drop_group: the episodes whose tool's service refused them end with the failure, their
    groups leave the step's batch (steps.csv dropped_groups, a WARNING naming the failure), and the run trains on
    the others."""
    tools = tmp_path / "flaky.py"
    tools.write_text(FLAKY_TOOLS)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--sft.max_steps",
                          "0", "--rollout.prompts_per_step", "8", "--task.operations", "*", "--env.path",
                          f"{ROOT}/examples/envs/calculator.py:AlwaysCalls", "--env.tools", str(tools),
                          "--env.on_infra_error", "drop_group", "--env.max_turns", "2", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    dropped = [int(r["dropped_groups"]) for r in rows]
    assert sum(dropped) > 0 and all(0 <= d < 8 for d in dropped), dropped
    assert [int(r["batch_size"]) for r in rows] == [(8 - d) * 4 for d in dropped]
    warned = [line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
              if " WARNING " in line and "dropped" in line and "groups" in line]
    assert warned and "calculator service refused multiply" in warned[0], warned


@pytest.mark.slow
@pytest.mark.parametrize("resilience", ["faithful", "hardened"])
def test_scenario18_a_tool_service_down_is_the_models_output_only_when_faithful(tmp_path, resilience):
    """Every multiply call raises ConnectionError from step 2: faithful hands it to the model and the run goes on
    (steps.csv infra_errors the only trace); hardened fails step 2 naming the tool and the infrastructure."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults",
                          f"{ROOT}/examples/faults/scenario18.yaml", "--resilience", resilience, "--run-dir",
                          str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    if resilience == "faithful":
        assert out.returncode == 0, out.stderr[-3000:]
        assert [int(r["infra_errors"]) for r in rows] == [0, 64, 64]
    else:
        assert out.returncode != 0 and len(rows) == 1
        first = next(line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
                     if " ERROR " in line and "run failed" in line)
        assert "step 2, stage rollout" in first and "tool 'multiply' failed after 4 tries: ConnectionError" in first, \
            first  # hardened retries (resilience.retry_infra_errors), then fails
    from rlhf.diagnosis import diagnose

    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.step, d.root.category) == ("env-0", 2, "tool_infra"), \
        d.render()  # faithful: from steps.csv's infra_errors; hardened: the failure
    assert_none_left(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("resilience", ["faithful", "hardened"])
def test_scenario19_sandbox_runs_starved_by_load_are_the_infrastructures(tmp_path, resilience):
    """24 burners load env-0's CPUs for 3 s at step 2 while every episode runs code in the sandbox: the runs that
    pass their limit starved of CPU are infrastructure failures, handed to the model in faithful (infra_errors, the
    only trace; diagnose reads it) and retried in hardened until the load has passed (every answer the code's)."""
    from rlhf.diagnosis import diagnose

    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--faults",
                          f"{ROOT}/examples/faults/scenario19.yaml", "--resilience", resilience, "--run-dir",
                          str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    infra, retries, mistakes = ([int(r[k]) for r in rows] for k in ("infra_errors", "infra_retries", "tool_errors"))
    if resilience == "faithful":
        assert infra[0] == 0 and infra[1] > 0 and retries == [0, 0, 0], (infra, retries)
    else:
        assert retries[1] > 0 and infra == [0, 0, 0] and mistakes == [0, 0, 0], (infra, retries, mistakes)
    d = diagnose(str(run_dir))
    assert d.root is not None and (d.root.process, d.root.step, d.root.category) == ("env-0", 2, "tool_infra"), \
        d.render()
    assert_none_left(run_dir)


def test_the_environment_server_answers_the_episodes_that_end_first_and_the_slow_one_later(tmp_path):
    """/step with hold_s: the reply carries the episodes that ended (the first, and those up to hold_s after it) and
    leaves the slow one pending, its result for /results once it ends: one slow episode holds nobody's reply."""
    from rlhf.config import HARDENED
    from rlhf.errors import BadRequest
    from rlhf.services.env_server import EnvServer

    tools = tmp_path / "tools.py"
    tools.write_text("import threading\nrelease = threading.Event()\n\n"
                     "def slow(n: int) -> int:\n    release.wait(timeout=30)\n    return n\n\n"
                     "def fast(n: int) -> int:\n    return n\n")
    server = EnvServer("tool_calls", {"tools": str(tools)}, "t", HARDENED, parallel=4)
    call = '<tool_call>{{"name": "{}", "arguments": {{"n": {}}}}}</tool_call>'
    ids = ["a", "b", "c"]
    server.reset({"episodes": [{"id": i, "row": {"prompt": "1*2="}} for i in ids]}, {})

    async def go() -> tuple[dict, dict]:
        first = await server.step({"steps": [{"id": "a", "action": call.format("fast", 1)},
                                             {"id": "b", "action": call.format("slow", 2)},
                                             {"id": "c", "action": call.format("fast", 3)}], "hold_s": 0.05}, {})
        with pytest.raises(BadRequest, match="'b' is still stepping"):
            await server.step({"steps": [{"id": "b", "action": ""}]}, {})
        server.envs["b"].tools["slow"].__globals__["release"].set()
        return first, await server.results({"ids": first["pending"], "hold_s": 0.05}, {})

    first, later = asyncio.run(go())
    assert sorted(first["results"]) == ["a", "c"] and first["pending"] == ["b"]
    assert first["results"]["a"]["observation"] == "<tool_response>1</tool_response>"
    assert later == {"results": {"b": later["results"]["b"]}, "pending": []}
    assert later["results"]["b"]["observation"] == "<tool_response>2</tool_response>" and server.stepping == {}
    server.pool.shutdown(wait=False)
    server.service.executor.shutdown(wait=False)


def test_the_environment_server_steps_a_turns_episodes_at_once(tmp_path):
    """env.parallel_calls: the episodes of one /step run their tools at the same time (a barrier that only opens
    when all four calls are inside it), their results in the request's order and their open episodes kept; one
    at a time, the first call waits alone at the barrier and breaks it."""
    from rlhf.config import HARDENED
    from rlhf.services.env_server import EnvServer

    tools = tmp_path / "tools.py"
    tools.write_text("import threading\n_gate = threading.Barrier(4)\n\n"
                     "def meet(n: int) -> int:\n    _gate.wait(timeout=2)\n    return n * 10\n")
    call = '<tool_call>{{"name": "meet", "arguments": {{"n": {}}}}}</tool_call>'
    for parallel, answers in ((4, [f"<tool_response>{n * 10}</tool_response>" for n in range(4)]), (1, None)):
        server = EnvServer("tool_calls", {"tools": str(tools)}, "t", HARDENED, parallel=parallel)
        ids = [f"e{n}" for n in range(4)]
        server.reset({"episodes": [{"id": i, "row": {"prompt": "1*2="}} for i in ids]}, {})
        reply = asyncio.run(server.step({"steps": [{"id": i, "action": call.format(n)} for n, i in enumerate(ids)]},
                                        {}))
        results = [reply["results"][i] for i in ids]
        if answers is not None:
            assert [r["observation"] for r in results] == answers and not any(r["done"] for r in results)
            assert sorted(server.envs) == ids and server.busy == {}
        else:  # one after another: nobody joins the first call at the barrier
            assert "BrokenBarrierError" in results[0]["observation"] and results[0]["info"]["tool_errors"] == 1
        server.service.executor.shutdown(wait=False)


def test_the_calculator_demonstrates_its_call_and_the_warm_start_masks_the_tools_answer():
    """Env.demonstration (examples/envs/calculator.py:Calculator): the call in compact JSON, the tool's real answer
    and the final answer; build_sft_batch trains on the call, the answer and the stop token, never on the tool's
    answer (the model reads it at rollout, as the episodes mask it); a turn ends after a call (env-0's stop)."""
    from rlhf.data import build_sft_batch
    from rlhf.models.tokenizer import CharTokenizer
    from rlhf.tasks.base import Example

    make = build_env(f"{TOOLS}:Calculator", {})
    env = make()
    row = {"prompt": "123*456=", "answer": "56088"}
    env.reset(row)
    demo = env.demonstration(row)
    call = '<tool_call>{"name":"multiply","arguments":{"a":123,"b":456}}</tool_call>'
    assert demo == [(call, True), ("<tool_response>56088</tool_response>", False), ("56088", True)]
    assert env.stop == ["</tool_call>"] and build_env("tool_calls", {"tools": TOOLS})().stop == ["</tool_call>"]
    tok = CharTokenizer()
    batch = build_sft_batch(tok, [Example("123*456=", "56088")], demos=[demo])
    ids, mask = batch["input_ids"][0].tolist(), batch["response_mask"][0].tolist()
    prompt = len(tok.encode("123*456="))
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert trained == call + "56088" and mask[-1] == 1.0 and sum(mask[:prompt]) == 0
    assert len(ids) == prompt + len(call) + len("<tool_response>56088</tool_response>") + len("56088") + 1


def test_the_warm_starts_val_episodes_end_a_turn_at_the_environments_stop_string():
    """rlhf.evaluation's episodes (the SFT warm start's val check with an environment) end a row's turn on the
    step whose token completes a stop string, and only that row."""
    from rlhf.evaluation import _stop_control
    from rlhf.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    call, other = tok.encode('<tool_call>{"a":1}</tool_call>', False), tok.encode("12345 and more text here", False)
    control = _stop_control(tok, ["</tool_call>"], 2)
    ended = {}
    for t in range(len(call)):
        for r, how in control.step(t, [0, 1], [call[t], other[t % len(other)]]).items():
            ended.setdefault(r, (t, how))
    assert ended == {0: (len(call) - 1, {"type": "stop", "matched": "</tool_call>"})}


@pytest.mark.slow  # the suite's time (16 s): the default suite keeps env-0 killed and started again inside a step
def test_hardened_survives_the_environment_server_lost_during_an_evaluation(tmp_path):
    """env-0 SIGKILLed at the first turn it answers, inside the evaluation before the first step (an evaluation's
    episodes are run as a step's are): hardened starts env-0 again and the evaluation runs once more, from the
    episodes' reset; the run finishes with the steps' rows untouched."""
    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n  - name: env-killed-in-eval\n    kind: process_kill\n    point: env.step\n"
                      "    target: {role: env}\n    when: {max_hits: 1}\n    params: {signal: KILL}\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--env.path", "tool_calls",
                          "--env.tools", "examples/envs/calculator.py", "--sft.max_steps", "0", "--steps", "1",
                          "--rollout.prompts_per_step", "8", "--task.eval_size", "16", "--faults", str(faults), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "env-0 is down (lost during the evaluation: " in log and "starting it again" in log, log[-3000:]
    assert (run_dir / "logs" / "env-0.log").read_text().count("environment server: tool_calls") == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and 0.0 <= summary["eval_accuracy_before"] <= 1.0
    assert_none_left(run_dir)
