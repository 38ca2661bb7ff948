"""The config tree's root, `Config`: one section per component. The sections live in workload.py (model, task,
train, parallel, algorithm, sft), reward.py (reward, reward_model), rollout.py (rollout, sampling, sglang) and
services.py (weights, runtime, timeouts, checkpoint, preflight, tracing, logger); the resilience policy in resilience.py.
What needs the disk or an import (a model directory, a reward file, sglang's modules) is checked in inputs.py. Each field's docstring (the string after it) is what `--help` prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlhf.config.checks import ConfigError, _positive
from rlhf.config.resilience import Policy
from rlhf.config.reward import RewardConfig, RewardModelConfig
from rlhf.config.rollout import AgentConfig, EnvConfig, RolloutConfig, SamplingConfig, SglangConfig
from rlhf.config.services import (
    CheckpointConfig,
    LoggerConfig,
    PreflightConfig,
    RuntimeConfig,
    SimConfig,
    TimeoutsConfig,
    TracingConfig,
    WeightsConfig,
)
from rlhf.config.workload import (
    PARALLEL_LAYOUTS,
    AlgorithmConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SFTConfig,
    TaskConfig,
)

__all__ = ["PARALLEL_LAYOUTS", "AgentConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "EnvConfig", "LoggerConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PreflightConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RuntimeConfig",
           "SFTConfig", "SamplingConfig", "SglangConfig", "SimConfig", "TaskConfig", "TimeoutsConfig", "TracingConfig",
           "WeightsConfig"]


@dataclass
class Config:
    """The whole run: one section per component (model, task, reward, reward_model, rollout, sampling, sglang, env, agent, train,
    parallel, algorithm, sft, weights, runtime, timeouts, checkpoint, preflight, tracing, logger, sim, resilience)."""

    seed: int = 1
    """Run seed: model init, data order, sampling."""
    steps: int = 100
    """GRPO steps (the controller's step count; the run ends after this many)."""
    run_dir: str = ""
    """Run directory for logs, steps.csv, summary.json; empty = runs/<utc timestamp>."""
    eval_every: int = 0
    """Also evaluate on the eval split every this many GRPO steps; 0 = only before and after."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sglang: SglangConfig = field(default_factory=SglangConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    resilience: Policy = field(default_factory=Policy)
    faults: list = field(default_factory=list)
    """Armed faults (docs/faults.md), normally from --faults FILE; every process arms those that target it."""

    def __post_init__(self) -> None:
        _positive("steps", self.steps, allow_zero=True)
        _positive("eval_every", self.eval_every, allow_zero=True)
        if self.rollout.backend == "sglang":
            if self.weights.mode == "meta":
                raise ConfigError("weights.mode: 'meta' needs rollout.backend native (the MetaServer pull is our "
                                  "extension); with rollout.backend sglang use --weights.mode distributed or disk")
            if not self.model.path:
                raise ConfigError("model.path: rollout.backend sglang loads a Hugging Face model directory; the "
                                  f"embedded {self.model.name!r} has no tokenizer sglang can read")

        if self.rollout.mode == "async" and self.runtime.colocate:
            raise ConfigError("rollout.mode: 'async' generates while the train ranks train; runtime.colocate makes "
                              "them take turns on one device (choose rollout.mode sync, or leave runtime.colocate off)")
        if self.sim.enabled:
            if self.rollout.backend != "native" or self.weights.mode not in ("meta", "disk"):
                raise ConfigError("sim.train_ranks: a simulated world runs native rollout servers and weights.mode meta "
                                  f"or disk; this run has rollout.backend {self.rollout.backend!r}, weights.mode "
                                  f"{self.weights.mode!r} (set rollout.backend native, weights.mode meta or disk)")
            if self.env.path or self.reward_model.path:
                raise ConfigError("sim.train_ranks: a simulated world has no environment or reward model server yet "
                                  "(leave env.path and reward_model.path empty)")
        if self.agent.path:
            held = [f"{name} {value!r}" for name, value, ok in (
                ("env.path", self.env.path, not self.env.path),
                ("rollout.data_plane", self.rollout.data_plane, self.rollout.data_plane != "store"),
                ("rollout.buffer", self.rollout.buffer, self.rollout.buffer != "group"),
                ("sim.train_ranks", self.sim.train_ranks, not self.sim.enabled),
                ("rollout.interrupt", self.rollout.interrupt,
                 self.rollout.mode != "async" or self.rollout.interrupt != "abort")) if not ok]
            if held:
                raise ConfigError(f"agent.path: an agent's episodes may become several samples each (a template that "
                                  f"re-renders its history), which {', '.join(held)} cannot take (leave env.path "
                                  "empty, rollout.data_plane auto or controller, rollout.buffer batch, "
                                  "no simulated world, rollout.interrupt retract or in_place: an aborted "
                                  "call would end the agent's turn)")
        if self.data_plane == "store":
            held = [f"{name} {value!r}" for name, value, ok in (
                ("rollout.backend", self.rollout.backend, self.rollout.backend == "native"),
                ("env.path", self.env.path, not self.env.path),
                ("reward_model.path", self.reward_model.path, not self.reward_model.path)) if not ok]
            if held:
                raise ConfigError(f"rollout.data_plane: {self.rollout.data_plane!r} (store here) keeps the rows in native rollout servers that score "
                                  f"them with the reward functions; this run has {', '.join(held)} (set "
                                  "rollout.backend native and leave env.path and reward_model.path empty, or choose "
                                  "rollout.data_plane controller)")
        if self.weights.transport == "cuda_ipc":
            if self.weights.mode != "meta":
                raise ConfigError(f"weights.transport: 'cuda_ipc' is how the MetaServer's shards travel; weights.mode "
                                  f"is {self.weights.mode!r} (choose weights.mode meta, or leave weights.transport shm)")
            if not self.model.device.startswith("cuda"):
                raise ConfigError(f"weights.transport: 'cuda_ipc' shares GPU memory; model.device is "
                                  f"{self.model.device!r} (choose model.device cuda, or weights.transport shm or http)")

    @property
    def data_plane(self) -> str:
        """rollout.data_plane resolved: auto is store in a simulated world (the rows stay where the world is big),
        controller otherwise."""
        if self.rollout.data_plane != "auto":
            return self.rollout.data_plane
        return "store" if self.sim.enabled and not self.agent.path else "controller"

    @property
    def drift_threshold(self) -> float:
        """weights.drift_threshold resolved: -1 is 1e-3 in float32 and 0 (off) in other dtypes."""
        return drift_threshold(self.weights.drift_threshold, self.model.dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def drift_threshold(value: float, dtype: str) -> float:
    """weights.drift_threshold for a model dtype: -1 (auto) is 1e-3 in float32, 0 (off) otherwise."""
    if value != -1:
        return value
    return 1e-3 if dtype == "float32" else 0.0

