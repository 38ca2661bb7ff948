"""tool_calls: the model calls Python functions in Hermes' format and reads their answers.

A turn of the model that holds one or more

    <tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>

has each call run (the functions of env.tools: every public function of a file or a module, by name) and the
episode goes on with their outputs after it, each as

    <tool_response>56088</tool_response>

A turn without a call ends the episode (its text is the answer the reward functions score). A call that is not
JSON, names no known tool or has arguments the function does not take is answered with what is wrong (the model's
mistake: `tool_errors` counts it); so is a tool that raises (its class and message). A failure of the
infrastructure — InfraError, or an OSError (ConnectionError, TimeoutError, ...) from the tool — is not the
model's: with on_infra_error fail (env.on_infra_error; hardened) it is raised, naming the tool, and fails the
step; with model (faithful) the model reads it as the tool's answer, as verl hands it over, and `infra_errors`
counts it.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any, Callable

from rlhf.envs.base import Env, EnvError, InfraError, StepResult, register_env
from rlhf.faults import fault_point
from rlhf.tasks.scoring import load_module

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
STOP = "</tool_call>"  # a turn's generation stops after a call: the answer comes before the model goes on


def load_tools(spec: str) -> dict[str, Callable[..., Any]]:
    """env.tools: a file (path/to/tools.py) or a module (package.module); every public function it defines (those
    of its __all__, if it has one). rlhf.envs.sandbox gives `python`, code run in a sandbox."""
    if not spec:
        raise EnvError("env.tools: the tool_calls environment needs the file or module of its tools "
                       "(e.g. --env.tools examples/envs/calculator.py)")
    try:
        module = load_module(spec, "tools")
    except ValueError as exc:
        raise EnvError(f"env.tools: {exc}") from exc
    names = getattr(module, "__all__", None)  # a module may say which of its functions are tools
    tools = {name: fn for name, fn in vars(module).items()
             if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == module.__name__
             and (names is None or name in names)}
    if not tools:
        raise EnvError(f"env.tools: {spec} defines no public function to call")
    return tools


@register_env("tool_calls")
class ToolCallsEnv(Env):
    def __init__(self, tools: str = "", on_infra_error: str = "fail", **options: Any) -> None:
        super().__init__(tools=tools, on_infra_error=on_infra_error, **options)
        self.tools, self.on_infra_error = load_tools(tools), on_infra_error
        self.stop = [STOP]  # the environment server tells the episodes: a turn ends after a call
        self.row: dict[str, Any] = {}
        self.current_tool: str | None = None  # the tool running now (the environment server's /health shows it)

    def reset(self, row: dict[str, Any]) -> str:
        self.row = row
        return ""

    def step(self, action: str) -> StepResult:
        calls = CALL.findall(action)
        if not calls:
            return StepResult(done=True, info={"tool_calls": 0, "tool_errors": 0})
        answers, errors, infra = [], 0, 0
        for text in calls:
            output, ok, infra_failed = self.call(text)
            errors += not ok
            infra += infra_failed
            answers.append(f"<tool_response>{output}</tool_response>")
        return StepResult(observation="".join(answers), info={"tool_calls": len(calls), "tool_errors": errors,
                                                              "infra_errors": infra})

    def call(self, text: str) -> tuple[str, bool, bool]:
        """One call's answer, whether it ran, and whether the infrastructure failed it (handed to the model)."""
        try:
            call = json.loads(text)
        except ValueError as exc:
            return f"error: the call is not JSON ({exc})", False, False
        if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
            return 'error: a call is {"name": ..., "arguments": {...}}', False, False
        name = call.get("name")
        fn = self.tools.get(name)
        if fn is None:
            return f"error: no tool {name!r} (tools: {', '.join(sorted(self.tools))})", False, False
        self.current_tool = str(name)
        try:
            fault_point("tool.call")
            return str(fn(**call.get("arguments", {}))), True, False
        except TypeError as exc:
            return f"error: {exc}", False, False
        except (InfraError, OSError) as exc:  # not the model's doing
            if self.on_infra_error == "fail":
                raise InfraError(f"tool {name!r} failed: {type(exc).__name__}: {exc} (the infrastructure, not the "
                                 "model's call; env.on_infra_error fail)") from exc
            return f"error: {type(exc).__name__}: {exc}", False, True
        except Exception as exc:  # noqa: BLE001 — the tool's own failure on the model's input is its answer
            return f"error: {type(exc).__name__}: {exc}", False, False
        finally:
            self.current_tool = None
