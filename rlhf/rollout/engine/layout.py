"""The batch's layout: which prefill rows hold the same state (the prefix plan), the cache layouts' limits and
the knobs that pick them, and what a caller may do between decode steps."""

from __future__ import annotations

from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
BLOCK_COLUMNS = 128  # the block cache layout while a group's n samples x max_new_tokens generated slots fit this
LAYOUTS = ("auto", "block", "grouped")  # RLHF_ROLLOUT_LAYOUT: auto picks by BLOCK_COLUMNS
RELAYOUT = 4  # copy the running rows' caches into a dense layout once they are at most 1/RELAYOUT of the layout
# A decode step runs each distinct sequence of a group once (RLHF_ROLLOUT_SHARE=0: every row) when the distinct ones
# are at most SHARE_AT of the rows it computes (below that the gathers and scatters cost more than the rows saved)
SHARE_AT = 0.75
# the prefill runs each distinct prefix of the prompts once (a common template, the same prompt twice) when they are at
# most PREFILL_SHARE_AT of its rows
PREFILL_SHARE_AT = 0.9


def prefix_plan(prompts: list[list[int]], P: int) -> tuple[list[int], list[int], list[int]]:
    """Which rows of a prefill hold the same state. The prompts are left-padded to P columns, flat row i*P + c.
    A row's state is set by its prompt's tokens from the first one up to its column (positions count from a
    prompt's first token, so a common prefix is common at any padding); every pad row holds the same state (it
    sees only itself). Returns (the first row of each distinct state, in row order; each row's state, an index
    into them; per prompt, how many of its tokens an earlier prompt holds: the length of its longest common
    prefix with one). Equal prompts have equal states throughout."""
    firsts: list[int] = []
    state_of: dict[Any, int] = {}  # (previous state, token), or -1 for a pad -> state
    expand: list[int] = []
    shared: list[int] = []
    for i, p in enumerate(prompts):
        pad, prev = P - len(p), -1
        shared.append(0)
        for c in range(P):
            key = -1 if c < pad else (prev, p[c - pad])
            k = state_of.get(key)
            if k is None:
                k = state_of[key] = len(firsts)
                firsts.append(i * P + c)
            elif c >= pad:  # a token's state seen before: an earlier prompt's (a prompt's own states all differ)
                shared[i] += 1
            expand.append(k)
            if c >= pad:
                prev = k
    return firsts, expand, shared


class StepControl:
    """What a caller may do between decode steps: the rollout server's abort, pause, stop strings and streaming.

    `step` runs after every decode step on the engine's thread (it may block: a pause in place). It returns the
    rows that finish with this step's token, each with its finish reason (sglang's: {"type": "abort", ...} or
    {"type": "stop", "matched": "<stop string>"}). Rows are a call's output rows, prompt-major (prompt i's n
    samples are rows i*n .. i*n+n-1).
    """

    wants_tokens = False  # pass each step's new tokens to `step` (one host transfer a step)
    # (step, version): weights loaded while `step` held the call (a pause in place); the tokens from that step on
    # come from them (the decode loop sets it)
    switches: tuple[tuple[int, str], ...] = ()

    def step(self, t: int, rows: list[int] | None, tokens: list[int] | None) -> dict[int, dict[str, Any]]:
        return {}
