"""An environment whose episodes run code in the sandbox: the `python` tool (rlhf.envs.sandbox) behind tool_calls,
for scenarios with a model that has not learned to write code yet.

    python examples/grpo_trainer.py --env.path examples/envs/sandboxed.py:AlwaysRuns --task.operations '*'

AlwaysRuns makes the model's first turn a `python` call that computes the row's product the slow way (a loop of
LOOPS additions, about 0.1 s of one CPU here), whatever the model wrote, then goes on as tool_calls
(examples/faults/scenario19.yaml: sandbox runs that time out when the machine is loaded).
"""

import json

from rlhf.envs.tool_calls import ToolCallsEnv

LOOPS = 1_000_000


class AlwaysRuns(ToolCallsEnv):
    def __init__(self, **options):
        options.pop("tools", None)
        super().__init__("rlhf.envs.sandbox", **options)
        self.turn, self.code = 0, ""

    def reset(self, row):
        self.turn = 0
        left, _, right = row["prompt"].rstrip("=").partition("*")
        a, b = int(left or 0), int(right or 0)
        self.code = f"x = 0\nfor _ in range({LOOPS}):\n    x += 1\nprint({a} * {b} * x // {LOOPS})"
        return super().reset(row)

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            action = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": self.code}}) + "</tool_call>"
        return super().step(action)
