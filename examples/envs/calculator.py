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
