"""The `rlhf` command and the trainers' entry points.

    rlhf grpo [flags]      GRPO: SFT warm start → eval → GRPO steps → eval (= examples/grpo_trainer.py)
    rlhf sft [flags]       the SFT baseline alone (= examples/sft_trainer.py)
    rlhf config [flags]    print the resolved config as YAML (--reference: every key, in Markdown)
    rlhf trace RUN_DIR     a run's traces: per-step trees, errors, fault events; Jaeger / Perfetto files
    rlhf faults list       every fault kind and point;  rlhf faults validate FILE  checks a fault file
    rlhf report RUN_DIR    figures of how a fault propagated (RUN_DIR/report/*.png)
    rlhf diagnose RUN_DIR  the root cause of a failed run from its evidence alone (RUN_DIR/diagnosis.json)
    rlhf export RUN_DIR OUT [--step N]  a Hugging Face model directory from a checkpoint (replicated or sharded)
    rlhf hosts run -- SCRIPT [ARGS]     a multi-host run on this machine (network namespaces, root); hosts clean
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rlhf.cli_args import make_parser, parse_config

GRPO_DESCRIPTION = """GRPO on the embedded default: tiny Llama (~0.8M params, random init), 2-operand addition,
CPU, no downloads. Under torchrun every rank is an SPMD train worker and rank 0 also runs the
controller; rollout servers run as jobs of a scheduler process. SFT warm start until held-out
accuracy enters sft.band_low..band_high, eval, GRPO steps, eval. Writes <run-dir>/steps.csv,
summary.json, config.yaml, logs/<role>-<rank>.log and checkpoints/; prints the summary JSON as
the last line. Run the same command again to resume from the newest checkpoint."""

SFT_DESCRIPTION = """The SFT baseline on the same runtime as GRPO: SPMD train workers (torchrun for N ranks),
one controller, parity checkpoints, tracing and fault points, but no rollout servers, MetaServer,
events or scheduler jobs. --steps SFT steps (sft.max_steps), greedy eval before and after.
Writes <run-dir>/steps.csv, summary.json and logs/<role>-<rank>.log; prints the summary JSON as
the last line. The same --faults files as grpo_trainer.py; RL-only points are never reached."""


def grpo_main(argv: list[str] | None = None, prog: str = "grpo_trainer.py") -> int:
    cfg, _ = parse_config(argv, make_parser(prog, GRPO_DESCRIPTION))
    from rlhf.control.launch import run  # per subcommand: `rlhf trace` never loads torch.distributed

    return _finish(lambda: run(cfg))


def sft_main(argv: list[str] | None = None, prog: str = "sft_trainer.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # For the baseline, --steps means SFT steps and the band rule is off.
    if "--steps" in argv:
        i = argv.index("--steps")
        argv[i : i + 2] = ["--sft.max_steps", argv[i + 1]] if i + 1 < len(argv) else argv[i : i + 1]
    argv = ["--sft.stop_in_band", "false"] + argv
    cfg, _ = parse_config(argv, make_parser(prog, SFT_DESCRIPTION))
    from rlhf.control.launch import run

    return _finish(lambda: run(cfg, mode="sft"))


def _finish(run: Any) -> int:
    """Print the summary; a failure the controller already reported (its log has the traceback, the console a
    short block ending with the root cause) exits 1 without a second traceback on the console."""
    from rlhf.control.launch import print_summary

    try:
        summary = run()
    except Exception as exc:
        if getattr(exc, "_rlhf_reported", False):
            return 1
        raise
    print_summary(summary)
    return 0


def config_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--reference" in argv:  # every key with its type, default and doc, as docs/configuration.md lists them
        from rlhf.config.parse import format_reference

        print(format_reference(), end="")
        return 0
    cfg, _ = parse_config(argv, make_parser("rlhf config", "Print the resolved config as YAML (--reference: every "
                                                            "key's type, default and doc in Markdown)."))
    print(cfg.to_yaml(), end="")
    return 0


def trace_main(argv: list[str] | None = None, prog: str = "rlhf trace") -> int:
    from rlhf.tracing.cli import trace_main as run

    return run(argv)


def faults_main(argv: list[str] | None = None, prog: str = "rlhf faults") -> int:
    from rlhf.faults.cli import faults_main as run

    return run(argv)


def report_main(argv: list[str] | None = None, prog: str = "rlhf report") -> int:
    from rlhf.report import report_main as run

    return run(argv)


def diagnose_main(argv: list[str] | None = None, prog: str = "rlhf diagnose") -> int:
    from rlhf.diagnosis import diagnose_main as run

    return run(argv, prog)


def export_main(argv: list[str] | None = None, prog: str = "rlhf export") -> int:
    from rlhf.checkpoint.export import export_main as run

    return run(argv, prog)


def hosts_main(argv: list[str] | None = None, prog: str = "rlhf hosts") -> int:
    from rlhf.hosts import hosts_main as run

    return run(argv, prog)


COMMANDS = {"hosts": hosts_main, "export": export_main, "diagnose": diagnose_main, "report": report_main, "grpo": grpo_main, "sft": sft_main, "config": config_main, "trace": trace_main, "faults": faults_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nrlhf: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    name = argv[0]
    try:
        if name == "config":
            return config_main(argv[1:])
        return COMMANDS[name](argv[1:], prog=f"rlhf {name}")
    except BrokenPipeError:  # `rlhf trace RUN | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
