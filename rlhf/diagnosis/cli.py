"""`rlhf diagnose RUN_DIR`: print the diagnosis, write RUN_DIR/diagnosis.json."""

from __future__ import annotations

import json
import os

from rlhf.diagnosis.rank import diagnose
from rlhf.diagnosis.report import Diagnosis


def write(diag: Diagnosis) -> str:
    path = os.path.join(diag.run_dir, "diagnosis.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(diag.to_json(), fh, indent=2, default=str)
    os.replace(tmp, path)
    return path


def diagnose_main(argv: list[str] | None = None, prog: str = "rlhf diagnose") -> int:
    """`rlhf diagnose RUN_DIR [--json]`: exit 0 when the run had no failure, 1 when it names a root cause."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=(
        "Name the root cause of a failed run from its run directory alone: logs, exit records (exits.jsonl), "
        "heartbeats (metrics/*.csv) and traces; never the fault markers. Prints the root cause (process, pid, "
        "stage, step, category, evidence with file:line), the propagation chain, masked later errors, stalled "
        "requests and a runner-up; writes RUN_DIR/diagnosis.json."))
    parser.add_argument("run_dir", help="a run directory (runs/<time> or --run-dir of the run)")
    parser.add_argument("--json", action="store_true", help="print diagnosis.json instead of the text")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.run_dir, "logs")):
        parser.error(f"{args.run_dir} is not a run directory (it has no logs/ folder)")
    diag = diagnose(args.run_dir)
    path = write(diag)
    print(json.dumps(diag.to_json(), indent=2, default=str) if args.json else diag.render())
    if not args.json:
        print(f"(written to {path})")
    return 1 if diag.root is not None and diag.verdict != "finished with errors" else 0
