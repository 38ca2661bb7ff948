"""Loss functions and token aggregations, registered by name (see grpo.py for the math)."""

from rlhf.algorithms import grpo, sft  # noqa: F401  (registers the built-ins)
from rlhf.algorithms.base import AGGREGATIONS, LOSSES, register_aggregation, register_loss

__all__ = ["AGGREGATIONS", "LOSSES", "register_aggregation", "register_loss"]
