"""Configuration: a tree of dataclasses, presets as functions, YAML files, dotted overrides.

Every component owns one dataclass. Each field carries a one-line docstring (the string literal right after
it) that `--help` prints, with units. Values are resolved in this order:

    preset function  →  --config FILE.yaml  →  --section.field VALUE on the command line

and every section validates itself in ``__post_init__`` with a message that lists the valid choices, so a
typo fails before any work starts.

What is where:

    sections.py    Config, the root: one field per section
    workload.py    what is trained and how (ModelConfig, TaskConfig, OptimConfig as `train`, ParallelConfig,
                   AlgorithmConfig, SFTConfig)
    reward.py      RewardConfig (the reward functions), RewardModelConfig (`reward_model`)
    rollout.py     RolloutConfig, SamplingConfig (`sampling`), SglangConfig (`sglang`), EnvConfig (`env`)
    services.py    how the processes run (WeightsConfig, RuntimeConfig, TimeoutsConfig, CheckpointConfig,
                   PreflightConfig, TracingConfig, LoggerConfig as `logger`: the experiment trackers)

Every check that reads the disk or imports (a model or reward-model directory, a reward file, a dataset, sglang's
and megatron's modules, the layout against the model) is rlhf.inputs.input_problems, all reported together.
    resilience.py  Policy: the resilience behaviours by name, FAITHFUL / HARDENED (the `resilience` section)
    presets.py     preset functions: default, smoke, real-model
    parse.py       build_config: preset + YAML + dotted overrides; --help's text; YAML loading
    checks.py      ConfigError and the checks the sections run
"""

from rlhf.config.checks import ConfigError
from rlhf.config.parse import (
    MOVED_KEYS,
    apply_overrides,
    build_config,
    dotted_to_nested,
    format_help,
    iter_fields,
    load_yaml,
    parse_overrides,
)
from rlhf.config.presets import PRESETS, preset_default, preset_real_model, preset_smoke
from rlhf.config.resilience import FAITHFUL, HARDENED, Policy
from rlhf.config.sections import (
    AgentConfig,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    EnvConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PreflightConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RuntimeConfig,
    SamplingConfig,
    SFTConfig,
    SglangConfig,
    TaskConfig,
    TimeoutsConfig,
    TracingConfig,
    WeightsConfig,
)

__all__ = ["FAITHFUL", "HARDENED", "MOVED_KEYS", "PRESETS", "AgentConfig", "AlgorithmConfig",
           "CheckpointConfig", "Config", "ConfigError", "EnvConfig", "LoggerConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "Policy",
           "PreflightConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RuntimeConfig", "SFTConfig",
           "SamplingConfig", "SglangConfig", "TaskConfig", "TimeoutsConfig", "TracingConfig", "WeightsConfig",
           "apply_overrides", "build_config", "dotted_to_nested", "format_help", "iter_fields", "load_yaml",
           "parse_overrides", "preset_default", "preset_real_model", "preset_smoke"]
