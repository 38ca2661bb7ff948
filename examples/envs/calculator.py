"""Tools for the tool_calls environment: a calculator the model calls instead of multiplying in its head.

    python examples/grpo_trainer.py --env.path tool_calls --env.tools examples/envs/calculator.py \
        --task.operations '*' --task.max_operand 999

The model writes <tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call> and reads
<tool_response>56088</tool_response> after it (docs/environments.md).
"""


def multiply(a: int, b: int) -> int:
    """a times b."""
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """a plus b."""
    return int(a) + int(b)


class AlwaysCalls:
    """A tool_calls environment that makes the model's first turn a call of `multiply` on the row's operands
    (whatever the model wrote), then hands the rest to tool_calls: for scenarios and demos with a model that has
    not learned the call format yet (examples/faults/scenario17.yaml)."""

    def __init__(self, tools: str = "examples/envs/calculator.py", **options):
        from rlhf.envs.tool_calls import ToolCallsEnv

        self.inner = ToolCallsEnv(tools, **options)
        self.turn = 0

    @property
    def current_tool(self):
        return self.inner.current_tool

    def reset(self, row):
        self.turn = 0
        left, _, right = row["prompt"].rstrip("=").partition("*")
        self.call = {"name": "multiply", "arguments": {"a": int(left or 0), "b": int(right or 0)}}
        return self.inner.reset(row)

    def step(self, action):
        import json

        self.turn += 1
        if self.turn == 1:
            action = f"<tool_call>{json.dumps(self.call)}</tool_call>"
        return self.inner.step(action)
