"""Presets: functions that return a Config."""

from __future__ import annotations

from typing import Callable

from rlhf.config.sections import Config


def preset_default() -> Config:
    """The embedded default: tiny Llama, 2-operand addition, CPU, a few minutes on a laptop."""
    return Config()


def preset_smoke() -> Config:
    """Seconds-long run for tests and wiring checks; it does not aim to learn."""
    cfg = Config(steps=2)
    cfg.task.eval_size = 32
    cfg.task.val_size = 16
    cfg.rollout.prompts_per_step = 4
    cfg.rollout.group_size = 4
    cfg.sft.max_steps = 10
    cfg.sft.eval_every = 5
    cfg.sft.batch_size = 16
    cfg.train.micro_batch_size = 8
    cfg.algorithm.resample_rounds = 0  # an untrained model's groups are all wrong: more rounds would find none
    return cfg


def preset_real_model() -> Config:
    """A pretrained 100 M-1 B model from --model.path: small steps, a real KL anchor, checkpoints every 10 steps.

    The default's settings are tuned for a random tiny model that must move far; a pretrained model
    at lr 1e-4 leaves its reference at once (KL 51.6 on the first informative step, seen on
    SmolLM2-135M). No SFT warm start (the model already answers), one optimizer step per GRPO step
    (on-policy), and the 2-slot parity checkpoint every 10 steps instead of every step (a 135 M
    model's slot is 1.6 GB with optimizer state: half a step's time on CPU).
    """
    cfg = Config(steps=50)
    cfg.train.lr = 1e-6
    cfg.train.warmup_steps = 5
    cfg.train.mini_batches = 1
    cfg.train.micro_batch_size = 16
    cfg.train.weight_decay = 0.0
    cfg.algorithm.kl_coef = 0.04
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.group_size = 8
    cfg.sampling.max_new_tokens = 16
    cfg.sft.max_steps = 0
    cfg.checkpoint.latest_every = 10
    cfg.weights.mode = "meta"
    return cfg


PRESETS: dict[str, Callable[[], Config]] = {"default": preset_default, "smoke": preset_smoke,
                                            "real-model": preset_real_model}
