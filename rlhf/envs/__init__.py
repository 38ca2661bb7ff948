"""Environments: multi-turn episodes in which the policy acts and the environment answers (SkyRL's shape).

    env = build_env(cfg.env)             # --env.path tool_calls | path/to/file.py:Class | package.module:Class
    first = env.reset(row)               # the episode's row (prompt, answer, the dataset's other columns);
                                         # text to put after the prompt, or "" (nothing)
    result = env.step(action)            # the model's text of this turn -> StepResult(observation, reward, done, info)

base.py        Env, StepResult, the registry of built-in environments
loading.py     build_env (a built-in name or the user's class, checked with the file and the line)
adapters.py    SkyRL-gym's and gymnasium's environments behind the Env interface, unchanged
tool_calls.py  ToolCallsEnv (`tool_calls`): the model writes Hermes-style <tool_call>{"name": ..., "arguments": {...}}
               </tool_call>; the tools are the Python functions of env.tools (a file or a module); each call's
               output comes back as <tool_response>...</tool_response>
sandbox.py     the `python` tool (env.tools rlhf.envs.sandbox): the model's code in a child process with rlimits, a
               time limit, a fresh directory and no network

The environments run in the environment server (rlhf.services.env_server, job env-0), not in the controller.
"""

from rlhf.envs import tool_calls  # noqa: F401  (registers the built-in environments)
from rlhf.envs.base import ENVS, Env, EnvError, InfraError, StepResult, register_env
from rlhf.envs.loading import build_env

__all__ = ["ENVS", "Env", "EnvError", "InfraError", "StepResult", "build_env", "register_env"]
