"""Loss functions and token aggregations, registered by name (see grpo.py for the math)."""

from __future__ import annotations

from typing import Callable

from rlhf.registry import Registry

LOSSES: Registry[Callable] = Registry("loss")
AGGREGATIONS: Registry[Callable] = Registry("aggregation")
register_loss = LOSSES.register
register_aggregation = AGGREGATIONS.register

from rlhf.algorithms import grpo, sft  # noqa: E402,F401  (registers the built-ins)
