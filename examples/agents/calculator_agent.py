"""A calculator agent written with the `openai` package, as one would write it for any OpenAI-compatible endpoint:
it offers the model two tools, runs the call the model makes, gives it the answer and returns. GRPO trains the
policy on exactly the tokens its completions were made of (agent.path; docs/environments.md, "Agents").

    python examples/grpo_trainer.py --agent.path examples/agents/calculator_agent.py:agent \
        --sft.env_path examples/envs/calculator.py:Calculator --task.operations '*' --task.max_operand 999 \
        --model.name tiny-llama-256 --sampling.max_new_tokens 80 --rollout.prompts_per_step 16 --steps 60 \
        --sft.batch_size 64 --sft.eval_every 5 --task.val_size 64

The warm start learns the call format from the Calculator environment's demonstrations (the tiny model's chat
template renders this agent's conversation as the same tokens). The agent returns None: the reward functions score
its last completion (the answer after the tool's).
"""

import json

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"a {word} b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}} for name, word in (("multiply", "times"), ("add", "plus"))]
FUNCTIONS = {"multiply": lambda a, b: int(a) * int(b), "add": lambda a, b: int(a) + int(b)}
TURNS = 2  # a call, then the answer


def run_tool(call) -> str:
    """The tool's answer, or the error the model reads instead."""
    try:
        return str(FUNCTIONS[call.function.name](**json.loads(call.function.arguments)))
    except Exception as exc:  # noqa: BLE001 — a bad call is the model's mistake: it reads what went wrong
        return f"error: {type(exc).__name__}: {exc}"


async def agent(client, row):
    """One episode: the model's turns until it answers without a call (at most TURNS)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=80)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append({"role": "assistant", "content": message.content or "",
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return None
