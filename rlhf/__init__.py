"""rlhf: an instrumented, single-controller GRPO framework with built-in fault points."""

__version__ = "0.1.0"
