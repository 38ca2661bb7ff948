"""Loss functions and token aggregations, registered by name (see grpo.py for the math)."""

from __future__ import annotations

from typing import Callable

LOSSES: dict[str, Callable] = {}
AGGREGATIONS: dict[str, Callable] = {}


def register_loss(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        LOSSES[name] = fn
        return fn

    return deco


def register_aggregation(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        AGGREGATIONS[name] = fn
        return fn

    return deco


from rlhf.algorithms import grpo, sft  # noqa: E402,F401  (registers the built-ins)
