"""Command-line parsing shared by the trainers: top-level flags + dotted config overrides."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from rlhf.config import PRESETS, Config, ConfigError, build_config, format_help, parse_overrides
from rlhf.config.resilience import PRESET_NAMES
from rlhf.faults.parse import load_fault_config, load_fault_file, resolve_fault_file
from rlhf.faults.spec import FaultSpecError


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override any of them as --section.key VALUE; booleans also as a bare flag):"
        + format_help()
        + "\n\nOrder of precedence: --preset < --config FILE < --seed/--steps/--run-dir < --section.key.",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file with config sections (same keys as below)")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting config (default: default)")
    parser.add_argument("--run-dir", "--run_dir", dest="run_dir", metavar="DIR",
                        help="run directory (default: runs/<utc time>)")
    parser.add_argument("--steps", type=int, help="number of steps (GRPO steps; SFT steps for sft_trainer)")
    parser.add_argument("--seed", type=int, help="run seed (model init, data order, sampling)")
    parser.add_argument("--eval-every", "--eval_every", dest="eval_every", type=int, metavar="N",
                        help="also evaluate every N GRPO steps (default: 0, only before and after)")
    parser.add_argument("--colocate", action="store_true", default=None,
                        help="train rank r and rollout server r share device r (= --runtime.colocate)")
    parser.add_argument("--preflight", action="store_true", default=None,
                        help="time every train rank's matmul and all_gather before step 1 and name a straggler "
                             "(= --preflight.enabled; --preflight.exclude refuses to start with one)")
    parser.add_argument("--resilience", choices=list(PRESET_NAMES),
                        help="resilience preset (= --resilience.preset); switch one behaviour with "
                             "--resilience.<behaviour> true|false (listed below)")
    parser.add_argument("--logger", metavar="NAMES",
                        help="experiment trackers, comma-separated: console, tensorboard, wandb, mlflow "
                             "(= --logger.backends; default console)")
    parser.add_argument("--faults", action="append", metavar="FILE", default=[],
                        help="fault spec YAML (repeatable), or the name of a bundled one (scenario2.yaml); validated before "
                             "anything starts (rlhf faults list)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return parser


def parse_config(argv: list[str] | None, parser: argparse.ArgumentParser) -> tuple[Config, argparse.Namespace]:
    """Parse argv into a validated Config; on a bad value print one clear line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        dotted, rest = parse_overrides(argv)
    except ConfigError as err:
        parser.error(str(err))
    args = parser.parse_args(rest)
    scenario: list[tuple[str, Any]] = []
    if args.faults:
        try:
            args.faults = [resolve_fault_file(path) for path in args.faults]  # a bare name finds a bundled file
        except FaultSpecError as err:
            parser.error(str(err))
        for path in args.faults:
            try:  # a file that is not YAML is reported, with its line, by the validation below
                scenario += _flatten(load_fault_config(path))
            except yaml.YAMLError:
                pass
            except FaultSpecError as err:
                parser.error(str(err))
    try:
        cfg = build_config(
            preset=args.preset,
            config_file=args.config,
            dotted=[("runtime.colocate", "true")] * bool(args.colocate) + [("preflight.enabled", "true")] * bool(args.preflight)
            + [("resilience.preset", args.resilience)] * bool(args.resilience)
            + [("logger.backends", args.logger)] * bool(args.logger) + dotted,
            scenario=scenario,
            top_level={"seed": args.seed, "steps": args.steps, "run_dir": args.run_dir, "eval_every": args.eval_every},
        )
    except ConfigError as err:
        parser.error(str(err))
    from rlhf.inputs import input_problems  # torch (a reward model's check): only the trainers' commands pay it

    problems = input_problems(cfg)
    if problems:
        parser.error("\n".join(problems))
    if args.faults:
        # torchrun's --nproc_per_node (one process without it), or a simulated world's train ranks
        world = cfg.sim.train_ranks or int(os.environ.get("WORLD_SIZE", "1"))
        specs, problems, need = [], [], world
        for path in args.faults:  # every problem of every file at once: schema and this run's world, in file order
            try:
                specs += load_fault_file(path, world=(world, cfg.rollout.servers))
            except FaultSpecError as err:
                problems.append(str(err))
                need = max(need, err.train_ranks_needed)
        if problems:
            if int(os.environ.get("RANK", "0")) != 0:
                raise SystemExit(2)  # rank 0 says why, once
            script = os.path.relpath(sys.argv[0]) if sys.argv[0].endswith(".py") else parser.prog
            fix = (f"\nrun with {need} train ranks: --sim.train_ranks {need}" if cfg.sim.enabled else
                   f"\nrun with {need} train ranks: torchrun --nproc_per_node={need} {' '.join([script] + argv)}"
                   ) if need > world else ""
            parser.error(f"this run has {world} train rank{'s' * (world != 1)} and {cfg.rollout.servers} rollout "
                         f"server{'s' * (cfg.rollout.servers != 1)}; its faults cannot run as written:\n"
                         + "\n".join(problems) + fix)
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            parser.error(f"fault names must be unique across --faults files; repeated: {', '.join(dup)}")
        cfg.faults = list(cfg.faults) + [s.to_dict() for s in specs]
    if args.print_config:
        print(cfg.to_yaml(), end="")
        raise SystemExit(0)
    return cfg, args


def _flatten(section: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def config_summary(cfg: Config) -> dict[str, Any]:
    return cfg.to_dict()
