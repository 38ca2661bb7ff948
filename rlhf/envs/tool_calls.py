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
step; with retry the call is made again, up to infra_retries more times with a growing wait between (tenacity),
each failure a WARNING and counted in `infra_retries`, and raised as with fail when none succeeds (a tool that is
retried must be safe to run twice: a sandbox's run starts afresh); with model (faithful) the model reads it as the
tool's answer, as verl hands it over, and `infra_errors` counts it.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import time
from typing import Any, Callable

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from rlhf.envs.base import Env, EnvError, InfraError, StepResult, register_env
from rlhf.faults import fault_point
from rlhf.tasks.scoring import load_module

log = logging.getLogger("rlhf.env_server")

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
    RETRY_WAIT_S = (0.2, 5.0)  # the first wait before a retry, and the longest (doubling, with jitter)

    def __init__(self, tools: str = "", on_infra_error: str = "fail", infra_retries: int = 3, **options: Any) -> None:
        super().__init__(tools=tools, on_infra_error=on_infra_error, infra_retries=infra_retries, **options)
        self.tools, self.on_infra_error, self.infra_retries = load_tools(tools), on_infra_error, int(infra_retries)
        self.retried = 0  # infrastructure failures of this step's calls that were made again (on_infra_error retry)
        self.stop = [STOP]  # the environment server tells the episodes: a turn ends after a call
        self.row: dict[str, Any] = {}
        self.current_tool: str | None = None  # the tool running now (the environment server's /health shows it)
        self.tool_since = 0.0  # when its latest try began (time.monotonic: a retried call is not a stall)

    def reset(self, row: dict[str, Any]) -> str:
        self.row = row
        return ""

    def step(self, action: str) -> StepResult:
        calls = CALL.findall(action)
        if not calls:
            return StepResult(done=True, info={"tool_calls": 0, "tool_errors": 0})
        answers, errors, infra = [], 0, 0
        self.retried = 0
        for text in calls:
            output, ok, infra_failed = self.call(text)
            errors += not ok
            infra += infra_failed
            answers.append(f"<tool_response>{output}</tool_response>")
        return StepResult(observation="".join(answers), info={"tool_calls": len(calls), "tool_errors": errors,
                                                              "infra_errors": infra, "infra_retries": self.retried})

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
            return str(self._run(str(name), fn, call.get("arguments", {}))), True, False
        except TypeError as exc:
            return f"error: {exc}", False, False
        except (InfraError, OSError) as exc:  # not the model's doing
            if self.on_infra_error in ("fail", "retry"):
                tries = f" after {self.infra_retries + 1} tries" if self.on_infra_error == "retry" else ""
                raise InfraError(f"tool {name!r} failed{tries}: {type(exc).__name__}: {exc} (the infrastructure, "
                                 f"not the model's call; env.on_infra_error {self.on_infra_error})") from exc
            return f"error: {type(exc).__name__}: {exc}", False, True
        except Exception as exc:  # noqa: BLE001 — the tool's own failure on the model's input is its answer
            return f"error: {type(exc).__name__}: {exc}", False, False
        finally:
            self.current_tool = None

    def _run(self, name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        """The tool's answer; with on_infra_error retry, an infrastructure failure makes the call again."""
        if self.on_infra_error != "retry":
            fault_point("tool.call")
            return fn(**arguments)

        def again(state: Any) -> None:
            self.retried += 1
            exc = state.outcome.exception()
            log.warning("tool %r failed (try %d of %d): %s: %s (the infrastructure, not the model's call); calling "
                        "it again in %.1f s (env.on_infra_error retry)", name, state.attempt_number,
                        self.infra_retries + 1, type(exc).__name__, exc, state.next_action.sleep)

        first, longest = self.RETRY_WAIT_S
        for attempt in Retrying(stop=stop_after_attempt(self.infra_retries + 1), reraise=True, before_sleep=again,
                                wait=wait_exponential_jitter(multiplier=first, max=longest, jitter=first),
                                retry=retry_if_exception_type((InfraError, OSError))):
            with attempt:
                self.tool_since = time.monotonic()
                fault_point("tool.call")
                return fn(**arguments)
        raise AssertionError("unreachable: tenacity reraises the last failure")
