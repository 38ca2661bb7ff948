"""`rlhf faults`: list every kind and point, validate fault files.

    rlhf faults list                    every fault kind and every point, one line each
    rlhf faults validate FILE [FILE…] [--world-size N] [--rollout-servers M]
                                        parse and check (every problem, with its line); with the world
                                        given, also faults that target ranks or peers it lacks;
                                        exit 0 if every file is valid, 2 if not
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import yaml

from rlhf.faults.kinds import KINDS, REQUIRED
from rlhf.faults.parse import bundled_fault_files, load_fault_config, load_fault_file, resolve_fault_file
from rlhf.faults.points import POINTS
from rlhf.faults.spec import FaultSpecError


def list_text() -> str:
    out = ["Fault kinds (kind: what it does; parameters):", ""]
    for name in sorted(KINDS):
        cls = KINDS[name]
        flags = " [background: lasts duration_s]" if cls.BACKGROUND else ""
        out.append(f"  {name}{flags}")
        out += ["      " + line for line in textwrap.wrap(cls.DOC, 96)]
        for key, (types, default, doc) in cls.PARAMS.items():
            d = "required" if default is REQUIRED else f"default {default!r}"
            out.append(f"      params.{key} ({'/'.join(t.__name__ for t in types)}, {d}): {doc}")
    out += ["", "Fault points (point: where it is checked):", ""]
    width = max(map(len, POINTS))
    out += [f"  {name:<{width}}  {doc}" for name, doc in POINTS.items()]
    out += ["", "A fault: name, kind, point (glob), target {role, rank|ranks, peer}, "
            "when {step|steps, after_s, probability, seed, max_hits}, duration_s, params."]
    bundled = bundled_fault_files()
    if bundled:
        out += ["", "Bundled fault files (examples/faults; --faults NAME finds them):", ""]
        width = max(map(len, bundled))
        out += [f"  {name:<{width}}  {first}" for name, first in bundled.items()]
    return "\n".join(out)


def _config_count(path: str, section: str, key: str) -> int:
    """A count a scenario file's config section sets (rollout.servers, sim.train_ranks; 0 when it says nothing or
    cannot be read: the file's own problems are reported by its validation)."""
    try:
        part = load_fault_config(path).get(section)
    except (FaultSpecError, OSError, yaml.YAMLError):
        return 0
    count = part.get(key, 0) if isinstance(part, dict) else 0
    return count if isinstance(count, int) and count > 0 else 0


def faults_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "list":
        print(list_text())
        return 0
    if argv[0] == "validate":
        if len(argv) < 2:
            print("rlhf faults validate: give one or more fault files", file=sys.stderr)
            return 2
        parser = argparse.ArgumentParser(prog="rlhf faults validate")
        parser.add_argument("files", nargs="+", metavar="FILE")
        parser.add_argument("--world-size", type=int, default=0,
                            help="train ranks (torchrun --nproc_per_node; a file whose config sets sim.train_ranks is "
                                 "checked against that simulated world)")
        parser.add_argument("--rollout-servers", type=int, default=0,
                            help="rollout servers (default: the file's config, else 1)")
        args = parser.parse_args(argv[1:])
        bad = 0
        for path in args.files:
            try:
                path = resolve_fault_file(path)
                world = None
                simulated = _config_count(path, "sim", "train_ranks")  # a simulated world's size is its own
                if args.world_size or simulated:
                    servers = args.rollout_servers or _config_count(path, "rollout", "servers") or 1
                    world = (simulated or args.world_size, int(servers))
                specs = load_fault_file(path, world)  # schema and world problems together, in file order
            except FaultSpecError as err:
                print(f"invalid: {err}", file=sys.stderr)
                bad += 1
                continue
            print(f"ok: {path}: {len(specs)} fault{'s' * (len(specs) != 1)}")
            for s in specs:
                when = ", ".join(f"{k}={v}" for k, v in s.to_dict()["when"].items()) or "every hit"
                print(f"  - {s.name}: {s.kind} at {s.point} on {s.target.describe()} ({when})")
        return 2 if bad else 0
    print(f"rlhf faults: unknown subcommand {argv[0]!r}; choose list or validate", file=sys.stderr)
    return 2
