"""tool_calls: the model calls Python functions in Hermes' format and reads their answers.

A turn of the model that holds one or more

    <tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>

has each call run (the functions of env.tools: every public function of a file or a module, by name) and the
episode goes on with their outputs after it, each as

    <tool_response>56088</tool_response>

A turn without a call ends the episode (its text is the answer the reward functions score). A call that is not
JSON, names no known tool or has arguments the function does not take is answered with what is wrong (the model's
mistake: `tool_errors` counts it); a tool that raises is answered with the error's class and message, also counted.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from typing import Any, Callable

from rlhf.envs.base import Env, EnvError, StepResult, register_env
from rlhf.faults import fault_point
from rlhf.tasks.scoring import load_module_file

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
STOP = "</tool_call>"  # a turn's generation stops after a call: the answer comes before the model goes on


def load_tools(spec: str) -> dict[str, Callable[..., Any]]:
    """env.tools: a file (path/to/tools.py) or a module (package.module); every public function it defines (those
    of its __all__, if it has one). rlhf.envs.sandbox gives `python`, code run in a sandbox."""
    if not spec:
        raise EnvError("env.tools: the tool_calls environment needs the file or module of its tools "
                       "(e.g. --env.tools examples/envs/calculator.py)")
    if spec.endswith(".py"):
        module = load_module_file(spec, "tools")
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            raise EnvError(f"env.tools: cannot import module {spec!r}: {exc}") from exc
    names = getattr(module, "__all__", None)  # a module may say which of its functions are tools
    tools = {name: fn for name, fn in vars(module).items()
             if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == module.__name__
             and (names is None or name in names)}
    if not tools:
        raise EnvError(f"env.tools: {spec} defines no public function to call")
    return tools


@register_env("tool_calls")
class ToolCallsEnv(Env):
    def __init__(self, tools: str = "", **options: Any) -> None:
        super().__init__(tools=tools, **options)
        self.tools = load_tools(tools)
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> str:
        self.row = row
        return ""

    def step(self, action: str) -> StepResult:
        calls = CALL.findall(action)
        if not calls:
            return StepResult(done=True, info={"tool_calls": 0, "tool_errors": 0})
        answers, errors = [], 0
        for text in calls:
            output, ok = self.call(text)
            errors += not ok
            answers.append(f"<tool_response>{output}</tool_response>")
        return StepResult(observation="".join(answers), info={"tool_calls": len(calls), "tool_errors": errors})

    def call(self, text: str) -> tuple[str, bool]:
        """One call's answer and whether it ran."""
        try:
            call = json.loads(text)
        except ValueError as exc:
            return f"error: the call is not JSON ({exc})", False
        if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
            return 'error: a call is {"name": ..., "arguments": {...}}', False
        fn = self.tools.get(call.get("name"))
        if fn is None:
            return f"error: no tool {call.get('name')!r} (tools: {', '.join(sorted(self.tools))})", False
        try:
            fault_point("tool.call", peer=str(call.get("name")))
            return str(fn(**call.get("arguments", {}))), True
        except TypeError as exc:
            return f"error: {exc}", False
        except Exception as exc:  # noqa: BLE001 — the tool's own failure is its answer
            return f"error: {type(exc).__name__}: {exc}", False
