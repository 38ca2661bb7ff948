"""Environments written for other trainers run unchanged (rlhf.envs.adapters): SkyRL-gym's BaseTextEnv (built as
SkyRL builds it, its chat-message observations rendered), a registered skyrl_gym id on a SkyRL-format dataset,
gymnasium-style text environments; and a class that fits none is one error saying what an environment is."""

import csv
import json
import subprocess
import sys

import pytest

from rlhf.envs import EnvError, build_env
from tests.conftest import ROOT

skyrl_gym = pytest.importorskip("skyrl_gym", reason="pip install -e '.[test]' (skyrl-gym)")
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

ENVS = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

CLOSED = []


class Multiply(BaseTextEnv):
    """Written as a SkyRL user writes one: (env_config, extras), init, step -> observations as chat messages."""

    def __init__(self, env_config, extras={}):
        super().__init__()
        self.max_turns = env_config.max_turns
        self.target = extras["reward_spec"]["ground_truth"]
        self.hint = extras["extra_info"]["hint"]

    def init(self, prompt):
        return prompt + [{"role": "system", "content": self.hint}], {}

    def step(self, action):
        self.turns += 1
        if self.turns < self.max_turns:
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": f"[{action}?]"}], reward=0.25,
                                         done=False, metadata={"turn": self.turns})
        return BaseTextEnvStepOutput(observations=[], reward=float(action.strip() == self.target), done=True,
                                     metadata={})

    def close(self):
        CLOSED.append(self.target)


class Guess:
    """gymnasium's shape."""

    def __init__(self, limit=2):
        self.limit, self.tries = limit, 0

    def reset(self, *, seed=None, options=None):
        self.answer = options["row"]["answer"]
        return "guess: ", {}

    def step(self, action):
        self.tries += 1
        right = action.strip() == self.answer
        return ("no. ", float(right), right, self.tries >= self.limit, {})


class Neither:
    def act(self, text):
        return text
'''

ROW = {"prompt": [{"role": "user", "content": "3*4="}], "env_class": "multiply",
       "reward_spec": {"method": "rule", "ground_truth": "12"}, "extra_info": {"hint": " (a number) "}}


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def test_a_skyrl_environment_runs_as_skyrl_runs_it(envs):
    make = build_env(f"{envs}:Multiply", {"max_turns": 2})
    env = make()
    assert env.reset(dict(ROW)) == " (a number) "  # what init added after the prompt, rendered (no chat template)
    first = env.step("7")
    assert (first.observation, first.reward, first.done, first.info) == ("[7?]", 0.25, False, {"turn": 1})
    last = env.step("12")
    assert (last.observation, last.reward, last.done) == ("", 1.0, True)
    closed = sys.modules[env.cls.__module__].CLOSED
    assert closed == ["12"]  # closed when the episode ended


def test_a_registered_skyrl_gym_id_and_a_gymnasium_environment(envs):
    gsm8k = build_env("skyrl_gym:gsm8k", {})()
    assert gsm8k.reset({"prompt": [{"role": "user", "content": "2+3?"}], "reward_spec": {"ground_truth": "5"}}) == ""
    assert gsm8k.step("so #### 5").reward == 1.0
    guess = build_env(f"{envs}:Guess", {"limit": 2, "tools": "ignored: not a constructor argument"})()
    assert guess.reset({"answer": "9"}) == "guess: "
    miss = guess.step("8")
    assert (miss.observation, miss.reward, miss.done) == ("no. ", 0.0, False)
    hit = guess.step("9")
    assert (hit.reward, hit.done, hit.observation) == (1.0, True, "")


def test_a_class_that_fits_no_interface_is_one_error_naming_the_shapes(envs):
    with pytest.raises(EnvError) as err:
        build_env(f"{envs}:Neither", {})
    message = str(err.value)
    assert "Neither" in message and "envs.py:" in message and "it lacks reset, step" in message
    assert "SkyRL-gym's BaseTextEnv" in message and "gymnasium" in message
    with pytest.raises(EnvError, match="no skyrl_gym environment 'nope'.*gsm8k"):
        build_env("skyrl_gym:nope", {})


def test_skyrl_gym_without_an_id_takes_each_rows_env_class():
    """env.path skyrl_gym: each row's env_class picks its environment (SkyRL's datasets mix them); a row without
    one, or with an id skyrl_gym does not know, is an error naming what it has."""
    make = build_env("skyrl_gym", {})
    env = make()
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "env_class": "gsm8k", "reward_spec": {"ground_truth": "5"}}
    assert env.reset(row) == "" and type(env.env).__name__ == "GSM8kEnv"
    assert env.step("so #### 5").reward == 1.0
    with pytest.raises(EnvError, match="takes each row's environment from its env_class field; this row has none "
                                       r"\(its fields: prompt\)"):
        make().reset({"prompt": "2+3?"})
    with pytest.raises(EnvError, match="no skyrl_gym environment 'nope'"):
        make().reset({"prompt": "2+3?", "env_class": "nope"})


def test_grpo_on_a_skyrl_format_dataset_with_skyrl_gyms_own_environment(tmp_path):
    """SkyRL's gsm8k environment, unchanged, on a SkyRL-format JSONL dataset (chat-message prompts, env_class,
    reward_spec, extra_info; no answer column): the run trains, each episode's reward is the environment's."""
    data = tmp_path / "skyrl.jsonl"
    with open(data, "w") as fh:
        for a in range(10, 40):
            fh.write(json.dumps({"data_source": "sum", "prompt": [{"role": "user", "content": f"{a}+1="}],
                                 "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(a + 1)},
                                 "extra_info": {"split": "train", "index": a}}) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "2",
                          "--sft.max_steps", "0", "--task.path", str(data), "--task.eval_size", "4", "--task.val_size", "4",
                          "--env.path", "skyrl_gym:gsm8k", "--rollout.prompts_per_step", "4",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and all(0.0 <= float(r["reward_env"]) <= 1.0 for r in rows)
    assert "environment server: skyrl_gym:gsm8k" in (run_dir / "logs" / "env-0.log").read_text()


def test_the_base_class_of_skyrl_is_what_the_adapter_was_written_against():
    env = BaseTextEnv()
    assert env.init([{"role": "user", "content": "x"}]) == ([{"role": "user", "content": "x"}], {})
    assert set(BaseTextEnvStepOutput.__annotations__) >= {"observations", "reward", "done", "metadata"}
