"""The sections of what is trained and how: model, task, reward (a reward model), rollout, train (OptimConfig),
algorithm, sft. Each field's docstring (the string after it) is what `--help` prints, with units; each section
validates itself in __post_init__."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from rlhf.algorithms import AGGREGATIONS, LOSSES
from rlhf.config.checks import ConfigError, _choice, _in_range, _positive
from rlhf.models import MODEL_PRESETS
from rlhf.tasks import TASKS
from rlhf.tasks.scoring import reward_problem

PARALLEL_LAYOUTS = ("dp", "fsdp")  # train.parallel (rlhf.train.parallel lays them out)
SGLANG_SERVER_MODULES = ("sglang", "sgl_kernel", "fastapi", "uvicorn", "zmq")  # what sglang.launch_server imports


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
    reward: str = "exact_match"
    """Reward(s), comma-separated (or a YAML list): a built-in name (exact_match, last_number, contains_answer, math_equal, format_regex), a function in a package (package.module:function) or in a file (path/to/rewards.py:function), called with completions, answers, prompts and each row's other columns as keyword arguments."""
    reward_weights: str = ""
    """One weight per task.reward, comma-separated (or a YAML list); empty: 1.0 each. The reward is their weighted sum."""
    reward_timeout_s: float = 60.0
    """How long an async def reward function may take for one step's completions, seconds."""
    format_regex: str = ""
    """The format_regex reward's pattern (re.search, DOTALL), e.g. '^<think>.*</think>'."""
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
        problem = reward_problem(self.reward, self.reward_weights, self.format_regex)
        if problem:
            raise ConfigError(problem)
        _positive("task.reward_timeout_s", self.reward_timeout_s)
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
class RewardModelConfig:
    model_path: str = ""
    """A reward model: a local Hugging Face sequence-classification directory (Llama, Mistral or Qwen2 ...ForSequenceClassification, one label), served by its own process (job reward-0) and called in the reward stage; its score times reward.weight is added to the task's rewards. Empty: none."""
    weight: float = 1.0
    """The reward model's score is multiplied by this before it is added to the weighted sum of task.reward."""
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
        _choice("reward.dtype", self.dtype, ["float32", "bfloat16", "float16"])
        _positive("reward.batch_size", self.batch_size)
        _positive("reward.timeout_s", self.timeout_s)
        if self.device and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"reward.device: {self.device!r} is not valid; choose cpu, cuda or cuda:N (or leave it "
                              "empty for model.device)")
        if self.model_path:
            from rlhf.models.reward_model import check_reward_model_dir

            problem = check_reward_model_dir(self.model_path)
            if problem:
                raise ConfigError(problem)


@dataclass
class RolloutConfig:
    group_size: int = 8
    """GRPO group size: samples generated per prompt (sglang's `n`)."""
    prompts_per_step: int = 64
    """Distinct prompts per GRPO step; the batch is prompts_per_step * group_size samples. 64: at 32 the default run's gradient was noise-dominated and its gain depended on the seed (docs/results.md: the default run, version by version)."""
    max_new_tokens: int = 6
    """Longest completion in tokens; longer samples stop with finish_reason 'length'."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy. Logprobs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables it (sglang's convention)."""
    seed: int = -1
    """Sampling seed; -1 derives it from the run seed."""
    servers: int = 1
    """Rollout server processes (jobs of the scheduler) when run under the distributed runtime."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every sample, past EOS (benchmarks: fixed work per step)."""
    backend: str = "native"
    """Rollout servers: 'native' (our engine, with our extensions: MetaServer pulls, /events, checksums) or
    'sglang' (a real sglang server per job, driven through sglang's own routes only; needs weights.mode
    distributed or disk, and model.path)."""
    sglang_launcher: str = "sglang.launch_server"
    """With backend sglang: the module the scheduler runs as `python -m MODULE --config FILE` (sglang's launch
    flags in a YAML file, the API key among them). rlhf.services.sglang_launch is our engine behind exactly
    sglang's routes (tests, CPU machines)."""
    mem_fraction: float = 0.85
    """With backend sglang: --mem-fraction-static, the share of GPU memory sglang takes for weights and KV cache."""
    tp_size: int = 1
    """With backend sglang: --tp-size, GPUs per rollout server (tensor parallel)."""
    mode: str = "sync"
    """'sync': each step generates its batch with the step's weights, then trains on it (the seeds' system). 'async':
    a producer generates the next steps' batches while the train ranks train, each sample at most
    rollout.max_staleness weights versions older than the step that trains on it (docs/async.md)."""
    max_staleness: int = 1
    """rollout.mode async: K, how many weights versions a trained-on sample may lag the step's (a sample generated
    by version v is trained at a step <= v + K); 0 is the synchronous run through the async path."""
    interrupt: str = "retract"
    """rollout.mode async: how each weights update pauses the rollout servers (sglang's /pause_generation mode,
    then /continue_generation after the update). retract and in_place: running engine calls finish first (the native
    engine does not preempt a call yet) and queued ones wait; abort: running requests end now with their tokens
    (finish_reason abort) and, with resilience.migrate_requests, continue from them under the new weights."""
    max_queued_requests: int = 16
    """Calls a rollout server lets wait for its engine; with the policy's shed_load on, one more is answered 503
    with Retry-After and the client sends it again after that (sglang's --max-queued-requests); 0: no limit."""

    @property
    def overlaps(self) -> bool:
        """Whether the rollout servers generate while the train ranks train (async with K >= 1; K = 0 takes turns)."""
        return self.mode == "async" and self.max_staleness > 0

    def __post_init__(self) -> None:
        _choice("rollout.backend", self.backend, ("native", "sglang"))
        if self.sglang_launcher == "rlhf.runtime.sglang_launch":  # the module's name before the layers' folders
            logging.getLogger("rlhf.config").warning(
                "rollout.sglang_launcher rlhf.runtime.sglang_launch has moved: use rlhf.services.sglang_launch")
            self.sglang_launcher = "rlhf.services.sglang_launch"
        _choice("rollout.mode", self.mode, ("sync", "async"))
        _positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        _choice("rollout.interrupt", self.interrupt, ("retract", "in_place", "abort"))
        _positive("rollout.tp_size", self.tp_size)
        _positive("rollout.max_queued_requests", self.max_queued_requests, allow_zero=True)
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"rollout.mem_fraction: must be in (0, 1], got {self.mem_fraction!r}")
        if self.backend == "sglang" and self.sglang_launcher.split(".")[0] == "sglang":
            missing = [m for m in SGLANG_SERVER_MODULES if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(
                    f"rollout.backend: 'sglang' needs the sglang server, and {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not installed. On a GPU machine: pip install "
                    f"'sglang[all]'; or use --rollout.backend native, "
                    "or --rollout.sglang_launcher rlhf.services.sglang_launch (our engine behind sglang's API)")
        _positive("rollout.servers", self.servers)
        _positive("rollout.group_size", self.group_size)
        _positive("rollout.prompts_per_step", self.prompts_per_step)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k: must be -1 (off) or >= 1, got {self.top_k!r}")


@dataclass
class OptimConfig:
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
    parallel: str = "dp"
    """GRPO train layout: dp (every rank holds the whole model and AdamW state, gradients all-reduced) or fsdp (FSDP2: parameters, gradients and AdamW state sharded over the data-parallel ranks). The SFT warm start runs replicated before it."""
    tp_size: int = 1
    """Tensor-parallel ranks per model replica: attention heads and MLP columns split among them (DTensor); train ranks = data-parallel ranks x tp_size, and tp_size must divide the heads, KV heads and MLP width."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free each layer's gathered parameters after its forward and gather them again for its backward (the least memory); false: keep them from the forward to the backward (one all-gather a layer fewer a micro-batch; the whole model's compute-dtype parameters held meanwhile)."""
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
        _choice("train.parallel", self.parallel, PARALLEL_LAYOUTS)
        _positive("train.tp_size", self.tp_size)
        _choice("train.engine", self.engine, ["native", "megatron"])


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
