"""A calculator the model calls instead of multiplying in its head: tools for the tool_calls environment, and the
Calculator environment that also shows the warm start how to call them.

    python examples/grpo_trainer.py --env.path examples/envs/calculator.py:Calculator --task.operations '*' \
        --task.max_operand 999 --model.name tiny-llama-256 --sampling.max_new_tokens 80 --env.max_turns 2 \
        --rollout.prompts_per_step 16 --steps 60 --sft.batch_size 64 --sft.eval_every 5 --task.val_size 64

The model writes <tool_call>{"name":"multiply","arguments":{"a":123,"b":456}}</tool_call> and reads
<tool_response>56088</tool_response> after it, then answers 56088 (docs/environments.md). With
`--env.path tool_calls --env.tools examples/envs/calculator.py` the same tools come without the demonstration.
"""

import json

from rlhf.envs.tool_calls import ToolCallsEnv


def multiply(a: int, b: int) -> int:
    """a times b."""
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """a plus b."""
    return int(a) + int(b)


class Calculator(ToolCallsEnv):
    """tool_calls with this file's tools (multiply, add), and a demonstration for the SFT warm start: the call of
    multiply on the row's operands (compact JSON), the tool's answer (masked out of the loss: the model reads it,
    it does not learn to predict it) and the final answer."""

    def __init__(self, **options):
        options.pop("tools", None)  # this file's own
        super().__init__(__file__, **options)

    def demonstration(self, row):
        left, op, right = _operands(row["prompt"])
        name = {"*": "multiply", "+": "add"}[op]
        call = "<tool_call>" + json.dumps({"name": name, "arguments": {"a": left, "b": right}},
                                          separators=(",", ":")) + "</tool_call>"
        return [(call, True), (self.step(call).observation, False), (row["answer"], True)]


def _operands(prompt):
    """'123*456=' -> (123, '*', 456)."""
    for op in "*+":
        left, found, right = prompt.rstrip("=").partition(op)
        if found:
            return int(left or 0), op, int(right or 0)
    raise ValueError(f"not a product or a sum: {prompt!r}")


class AlwaysCalls(ToolCallsEnv):
    """A tool_calls environment that makes the model's first turn a call of `multiply` on the row's operands
    (whatever the model wrote), then goes on as tool_calls: for scenarios and demos with a model that has not
    learned the call format yet (examples/faults/scenario17.yaml)."""

    def __init__(self, tools: str = "examples/envs/calculator.py", **options):
        super().__init__(tools, **options)
        self.turn = 0

    def reset(self, row):
        self.turn = 0
        left, _, right = row["prompt"].rstrip("=").partition("*")
        self.first_call = {"name": "multiply", "arguments": {"a": int(left or 0), "b": int(right or 0)}}
        return super().reset(row)

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            action = f"<tool_call>{json.dumps(self.first_call)}</tool_call>"
        return super().step(action)
