"""The registries of loss functions and token aggregations (the built-ins register in grpo.py and sft.py)."""

from __future__ import annotations

from typing import Callable

from rlhf.registry import Registry

LOSSES: Registry[Callable] = Registry("loss")
AGGREGATIONS: Registry[Callable] = Registry("aggregation")
register_loss = LOSSES.register
register_aggregation = AGGREGATIONS.register
