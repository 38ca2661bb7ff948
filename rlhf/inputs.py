"""Every check of a run's inputs that reads the disk or imports, in one place, all reported together.

The config sections check their values as they are built (a typo fails at once); what exists only outside the
config — a model or reward-model directory, a reward file, a dataset, sglang's or megatron's modules, the layout
against the model's shape and the launch's world — is checked here, before anything starts, and every problem is
listed at once (`input_problems`). The trainers' command lines and `rlhf.control.launch.run` both call it."""

from __future__ import annotations

import importlib.util
import json
import os

from rlhf.config import Config, ConfigError
from rlhf.envs import EnvError, build_env
from rlhf.models import model_shape
from rlhf.models.reward_model import check_reward_model_dir
from rlhf.services.env_server import env_options
from rlhf.trackers import missing_packages
from rlhf.train.parallel import layout_problems

SGLANG_SERVER_MODULES = ("sglang", "sgl_kernel", "fastapi", "uvicorn", "zmq")  # what sglang.launch_server imports


def input_problems(cfg: Config, world: int | None = None) -> list[str]:
    """What of the run's inputs is not there or not usable, one line each (empty: all usable). `world`: the train
    ranks (default: $WORLD_SIZE, torchrun's)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    problems = _model_problems(cfg) + layout_problems(cfg.parallel.layout, cfg.parallel.tp_size, world,
                                                      model_shape(cfg.model))
    problems += _engine_problems(cfg)
    problems += missing_packages(cfg.logger.names)  # a tracker's library, before anything starts
    for spec in (s.strip() for s in cfg.reward.functions.split(",")):
        target = spec.rpartition(":")[0]
        if target.endswith(".py") and not os.path.isfile(target):
            problems.append(f"reward.functions: file {target!r} does not exist (from {os.getcwd()})")
    for key, value in (("env.path", cfg.env.path.rpartition(":")[0]), ("env.tools", cfg.env.tools),
                       ("sft.env_path", cfg.sft.env_path.rpartition(":")[0])):
        if value.endswith(".py") and not os.path.isfile(value):
            problems.append(f"{key}: file {value!r} does not exist (from {os.getcwd()})")
    for path in (p for p in (cfg.env.path, cfg.sft.env_path) if p and not problems):  # imported here, as the
        try:                                                                             # reward functions are
            build_env(path, env_options(cfg))
        except (EnvError, ValueError) as err:
            problems.append(str(err) if path == cfg.env.path else f"sft.env_path: {err}")
    agent_file = cfg.agent.path.rpartition(":")[0]
    if agent_file.endswith(".py") and not os.path.isfile(agent_file):
        problems.append(f"agent.path: file {agent_file!r} does not exist (from {os.getcwd()})")
    elif cfg.agent.path:
        from rlhf.control.agents import load_agent

        try:
            load_agent(cfg.agent.path)
        except ValueError as err:
            problems.append(str(err))
    if cfg.reward_model.path:
        problem = check_reward_model_dir(cfg.reward_model.path)
        if problem:
            problems.append(problem)
    if cfg.task.name in ("jsonl", "dataset") and cfg.task.path and not os.path.exists(cfg.task.path):
        problems.append(f"task.path: {cfg.task.path!r} does not exist (a JSONL, Parquet or CSV file, or a Hugging "
                        "Face datasets directory)")
    if cfg.rollout.backend == "sglang" and cfg.sglang.launcher.split(".")[0] == "sglang":
        missing = [m for m in SGLANG_SERVER_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            problems.append(
                f"rollout.backend: 'sglang' needs the sglang server, and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed. On a GPU machine: pip install 'sglang[all]'; "
                "or use --rollout.backend native, or --sglang.launcher rlhf.services.sglang_launch (our engine behind "
                "sglang's API)")
    return problems


def check_inputs(cfg: Config, world: int | None = None) -> None:
    """Raise one ConfigError listing every problem of input_problems."""
    problems = input_problems(cfg, world)
    if problems:
        raise ConfigError("\n".join(problems))


def _model_problems(cfg: Config) -> list[str]:
    if not cfg.model.path:
        return []
    config_file = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(config_file):
        what = "has no config.json" if os.path.isdir(cfg.model.path) else "is not a directory"
        return [f"model.path: {cfg.model.path!r} {what} (expected a local Hugging Face model folder: config.json, "
                "*.safetensors, the tokenizer's files); or leave it empty for the built-in model.name"]
    try:
        with open(config_file, encoding="utf-8") as f:
            model_config = json.load(f)
    except (OSError, ValueError) as err:  # JSONDecodeError says the line and column
        return [f"model.path: {config_file!r} is not readable JSON: {err}"]
    model_type = model_config.get("model_type") if isinstance(model_config, dict) else None
    if not model_type:
        return [f"model.path: {config_file!r} has no \"model_type\" (a Hugging Face config names its architecture)"]
    from rlhf.rollout.engine import SUPPORTED_MODEL_TYPES

    if cfg.rollout.backend == "native" and model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model.path: model_type {model_type!r} is not one the native rollout engine runs; valid: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (or --rollout.backend sglang)"]
    return []


def _engine_problems(cfg: Config) -> list[str]:
    if cfg.train.engine != "megatron":
        return []
    problems = []
    if cfg.parallel.layout != "dp" or cfg.parallel.tp_size != 1:
        problems.append(f"train.engine megatron: parallel.layout {cfg.parallel.layout!r} and parallel.tp_size "
                        f"{cfg.parallel.tp_size} are the native engine's layouts (valid with megatron: parallel.layout "
                        "dp, parallel.tp_size 1)")
    if cfg.runtime.colocate:
        problems.append("train.engine megatron: runtime.colocate is not supported yet (valid: runtime.colocate false)")
    from rlhf.train.megatron import MegatronUnavailable, check_megatron

    try:
        check_megatron("cuda" if cfg.model.device.startswith("cuda") else cfg.model.device)
    except MegatronUnavailable as err:
        problems.append(str(err))
    return problems
