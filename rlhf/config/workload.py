"""The sections of what is trained and how: model, task, train (OptimConfig: the optimizer, the batch's cuts, the
engine), parallel (the train ranks' layout), algorithm, sft. The rollout's sections are in rollout.py, the reward's in
reward.py. Each field's docstring (the string after it) is what `--help` prints, with units; each section
validates itself in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.algorithms import AGGREGATIONS, LOSSES
from rlhf.config.checks import ConfigError, _choice, _in_range, _positive
from rlhf.models import MODEL_PRESETS
from rlhf.tasks import TASKS

PARALLEL_LAYOUTS = ("dp", "fsdp")  # parallel.layout (rlhf.train.parallel lays them out)


@dataclass
class ModelConfig:
    name: str = "tiny-llama"
    """Built-in architecture preset (random init, no download); ignored when `path` is set. See rlhf.models.MODEL_PRESETS."""
    path: str = ""
    """Local Hugging Face model directory (config.json + *.safetensors + tokenizer); empty = use `name`."""
    dtype: str = "float32"
    """Parameter dtype for training and rollout: float32, bfloat16 or float16."""
    device: str = "cpu"
    """Torch device: cpu, cuda, or cuda:N (GPU paths need the `gpu` extra and a CUDA build of torch)."""

    def __post_init__(self) -> None:
        if not self.path:
            _choice("model.name", self.name, MODEL_PRESETS)
        _choice("model.dtype", self.dtype, ["float32", "bfloat16", "float16"])
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"model.device: {self.device!r} is not valid; choose cpu, cuda or cuda:N")


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Task from the registry (rlhf.tasks.TASKS): arithmetic, or dataset (jsonl is its old name): rows from task.path; a task.path with the default name means dataset."""
    prompt_key: str = "prompt"
    """dataset: the column holding each row's prompt (a string, or a list of chat messages {role, content})."""
    answer_key: str = "answer"
    """dataset: the column holding each row's reference answer."""
    split: str = "train"
    """dataset: which split of a Hugging Face datasets directory (save_to_disk of a DatasetDict) to read."""
    seed: int = 0
    """Seed of the data split (independent of the run seed, so every run sees the same eval set)."""
    max_operand: int = 99
    """arithmetic: operands are integers in [0, max_operand]."""
    operations: str = "+"
    """arithmetic: which operators appear in problems, as one string, e.g. '+-'."""
    eval_size: int = 256
    """Held-out problems for final evaluation (greedy decoding), never trained on."""
    val_size: int = 128
    """Held-out problems for the SFT warm-start stopping rule, disjoint from eval and train."""
    path: str = ""
    """dataset: a JSONL (.jsonl/.json), Parquet or CSV file, or a Hugging Face datasets directory (save_to_disk)."""
    chat_template: bool = False
    """Render each prompt as one user turn through the tokenizer's chat template (instruct models); the template's BOS only."""

    def __post_init__(self) -> None:
        if self.path and self.name == "arithmetic":
            self.name = "dataset"  # --task.path data.parquet is enough
        _choice("task.name", self.name, TASKS)
        _positive("task.max_operand", self.max_operand)
        bad = set(self.operations) - set("+-*")
        if not self.operations or bad:
            raise ConfigError(f"task.operations: {self.operations!r} is not valid; use characters from '+-*'")
        _positive("task.eval_size", self.eval_size)
        _positive("task.val_size", self.val_size)
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ConfigError(f"task.path: required when task.name is {self.name!r} (a JSONL, Parquet or CSV file, or "
                              "a Hugging Face datasets directory)")


@dataclass
class OptimConfig:
    """The train section: the optimizer, how a step's batch is cut, the engine (the layout is `parallel`)."""

    lr: float = 1e-4
    """AdamW learning rate for GRPO steps (peak, after warmup)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    micro_batch_size: int = 64
    """Samples per forward/backward; gradients accumulate over micro-batches."""
    mini_batches: int = 2
    """Optimizer steps per GRPO step (the batch is cut in this many mini-batches; >1 makes the ratio leave 1)."""
    warmup_steps: int = 10
    """Linear learning-rate warmup over this many optimizer steps (a fresh AdamW's first steps are sign-like)."""
    engine: str = "native"
    """GRPO train engine: native (the HF model) or megatron (megatron-core's GPTModel, local layer spec, converted from and to HF names; needs CUDA and megatron-core: pip install -e '.[gpu]')."""

    def __post_init__(self) -> None:
        _positive("train.lr", self.lr)
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _in_range("train.beta1", self.beta1, 0.0, 0.999999)
        _in_range("train.beta2", self.beta2, 0.0, 0.999999)
        _positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _positive("train.micro_batch_size", self.micro_batch_size)
        _positive("train.mini_batches", self.mini_batches)
        _positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _choice("train.engine", self.engine, ["native", "megatron"])


@dataclass
class ParallelConfig:
    """How the GRPO train ranks split the model: the data-parallel layout and tensor parallel."""

    layout: str = "dp"
    """GRPO train layout: dp (every rank holds the whole model and AdamW state, gradients all-reduced) or fsdp (FSDP2: parameters, gradients and AdamW state sharded over the data-parallel ranks). The SFT warm start runs replicated before it."""
    tp_size: int = 1
    """Tensor-parallel ranks per model replica: attention heads and MLP columns split among them (DTensor); train ranks = data-parallel ranks x parallel.tp_size, and tp_size must divide the heads, KV heads and MLP width."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free each layer's gathered parameters after its forward and gather them again for its backward (the least memory); false: keep them from the forward to the backward (one all-gather a layer fewer a micro-batch; the whole model's compute-dtype parameters held meanwhile)."""

    def __post_init__(self) -> None:
        _choice("parallel.layout", self.layout, PARALLEL_LAYOUTS)
        _positive("parallel.tp_size", self.tp_size)


@dataclass
class AlgorithmConfig:
    loss: str = "grpo"
    """Policy loss from the registry (rlhf.algorithms.LOSSES)."""
    aggregation: str = "token_mean"
    """How token losses become one number (rlhf.algorithms.AGGREGATIONS): token_mean or sequence_mean."""
    clip_eps_low: float = 0.2
    """Lower clip range of the ratio: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip range of the ratio: ratio <= 1 + clip_eps_high."""
    kl_coef: float = 0.01
    """Weight of the k3 KL estimate to the reference policy; 0 skips the reference stage."""
    scale_by_std: bool = True
    """Divide group-centred advantages by the group's reward std (the paper); False = Dr. GRPO style."""
    old_logprobs: str = "rollout"
    """Ratio denominator: 'rollout' uses the rollout engine's logprobs, 'recompute' runs the train engine."""
    off_policy: str = "none"
    """Off-policy correction of the ratio's denominator (asynchronous GRPO, or any rollout whose logprobs are not the
    train engine's): none; tis: each token's loss weighted by min(pi_prox / pi_rollout, is_cap) (truncated
    importance sampling); decoupled: AReaL's decoupled objective, the same ratio clipped around pi_prox, tokens
    whose weight passes is_cap left out. pi_prox is the train engine's recomputed logprob (needs old_logprobs
    recompute)."""
    is_cap: float = 2.0
    """algorithm.off_policy: the importance weight's cap (tis: truncated at it; decoupled: tokens above it masked)."""
    resample_rounds: int = 2
    """Dynamic sampling (DAPO): up to this many more rollout rounds a step, each replacing the groups whose samples all got one reward (no advantage) with groups of fresh prompts that did not; 0 = off. steps.csv's reward columns stay those of the step's first round."""

    def __post_init__(self) -> None:
        _choice("algorithm.loss", self.loss, LOSSES)
        _choice("algorithm.aggregation", self.aggregation, AGGREGATIONS)
        _in_range("algorithm.clip_eps_low", self.clip_eps_low, 0.0, 1.0)
        _positive("algorithm.clip_eps_high", self.clip_eps_high, allow_zero=True)
        _positive("algorithm.kl_coef", self.kl_coef, allow_zero=True)
        _choice("algorithm.old_logprobs", self.old_logprobs, ["rollout", "recompute"])
        _choice("algorithm.off_policy", self.off_policy, ["none", "tis", "decoupled"])
        _positive("algorithm.is_cap", self.is_cap)
        if self.off_policy != "none" and self.old_logprobs != "recompute":
            raise ConfigError(f"algorithm.off_policy: {self.off_policy!r} weighs each token by pi_prox / pi_rollout, "
                              "and pi_prox is the train engine's recomputed logprob: set algorithm.old_logprobs "
                              "recompute (or algorithm.off_policy none)")
        _positive("algorithm.resample_rounds", self.resample_rounds, allow_zero=True)


@dataclass
class SFTConfig:
    max_steps: int = 3000
    """Upper bound on SFT optimizer steps (the warm start usually stops earlier, in the band)."""
    batch_size: int = 256
    """Examples per SFT step."""
    lr: float = 1e-3
    """AdamW learning rate for SFT (constant after warmup)."""
    eval_every: int = 25
    """Evaluate held-out (val) accuracy every this many SFT steps."""
    band_low: float = 0.2
    """Warm start stops at the first evaluation with val accuracy >= band_low ..."""
    band_high: float = 0.45
    """... and reports whether it landed inside the band or jumped past band_high."""
    stop_in_band: bool = True
    """True: stop when val accuracy enters the band (GRPO warm start). False: run max_steps (SFT baseline)."""
    termination: str = "controller"
    """SFT baseline: 'controller' (the controller decides every step) or 'per_rank_duration' (each rank trains until its own clock says duration_s passed: the seeds' sync stall)."""
    duration_s: float = 30.0
    """per_rank_duration: how long each rank trains by its own wall clock (rlhf.clock), seconds."""
    env_path: str = ""
    """The environment whose demonstrations the warm start trains on and whose greedy episodes give its val accuracy
    (as env.path does; empty: env.path's). With agent.path, the environment that teaches the model what the agent's
    episodes look like (e.g. examples/envs/calculator.py:Calculator for examples/agents/calculator_agent.py)."""

    def __post_init__(self) -> None:
        _positive("sft.max_steps", self.max_steps, allow_zero=True)
        _positive("sft.batch_size", self.batch_size)
        _positive("sft.lr", self.lr)
        _positive("sft.eval_every", self.eval_every)
        _choice("sft.termination", self.termination, ["controller", "per_rank_duration"])
        _positive("sft.duration_s", self.duration_s)
        _in_range("sft.band_low", self.band_low, 0.0, 1.0)
        _in_range("sft.band_high", self.band_high, 0.0, 1.0)
        if self.band_high < self.band_low:
            raise ConfigError(f"sft.band_high ({self.band_high}) must be >= sft.band_low ({self.band_low})")
