"""The reward's sections: reward (the reward functions and their weights) and reward_model (a learned reward model
served by its own process). Each field's docstring is what `--help` prints; each section validates its values in
__post_init__ (a reward file and a reward model directory are checked in inputs.py, with the other inputs)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.checks import ConfigError, _choice, _positive
from rlhf.tasks.scoring import reward_problem


@dataclass
class RewardConfig:
    """The reward functions a step's completions are scored with."""

    functions: str = "exact_match"
    """Reward(s), comma-separated (or a YAML list): a built-in name (exact_match, last_number, contains_answer, math_equal, format_regex), a function in a package (package.module:function) or in a file (path/to/rewards.py:function), called with completions, answers, prompts and each row's other columns as keyword arguments."""
    weights: str = ""
    """One weight per reward.functions entry, comma-separated (or a YAML list); empty: 1.0 each. The reward is their weighted sum."""
    async_timeout_s: float = 60.0
    """How long an async def reward function may take for one step's completions, seconds."""
    format_regex: str = ""
    """The format_regex reward's pattern (re.search, DOTALL), e.g. '^<think>.*</think>'."""

    def __post_init__(self) -> None:
        problem = reward_problem(self.functions, self.weights, self.format_regex)
        if problem:
            raise ConfigError(problem)
        _positive("reward.async_timeout_s", self.async_timeout_s)


@dataclass
class RewardModelConfig:
    """A learned reward model, served by its own process (job reward-0) and called in the reward stage."""

    path: str = ""
    """A local Hugging Face sequence-classification directory (Llama, Mistral or Qwen2 ...ForSequenceClassification, one label); its score times reward_model.weight is added to the reward functions' weighted sum. Empty: none."""
    weight: float = 1.0
    """The reward model's score is multiplied by this before it is added to the weighted sum of reward.functions."""
    chat_template: bool = False
    """Score the prompt and the completion as a user and an assistant turn through the reward model's chat template (else their plain concatenation)."""
    batch_size: int = 16
    """Sequences per reward model forward."""
    dtype: str = "float32"
    """The reward model's dtype: float32, bfloat16 or float16."""
    device: str = ""
    """Its torch device; empty: model.device."""
    timeout_s: float = 300.0
    """How long one step's /score call may take, seconds (then the step fails naming reward-0)."""

    def __post_init__(self) -> None:
        _choice("reward_model.dtype", self.dtype, ["float32", "bfloat16", "float16"])
        _positive("reward_model.batch_size", self.batch_size)
        _positive("reward_model.timeout_s", self.timeout_s)
        if self.device and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"reward_model.device: {self.device!r} is not valid; choose cpu, cuda or cuda:N (or "
                              "leave it empty for model.device)")
