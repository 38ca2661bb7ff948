"""Measure how a fault propagated, from a run directory alone (logs, fault markers, exit status).

    from rlhf.analysis import measure_run
    row = measure_run("runs/scenario2")      # fault_stage, error_stage, times, processes, last error …

Definitions (all times in seconds after the fault's onset = its first `inject` marker):

  fault_stage / fault_point / target   where the first injection happened (stage from the point name)
  error_stage             the stage the controller reports in "run failed: step N, stage X: …"
  first_error_time_s      the earliest ERROR line in any process's log
  surfaced_error_time_s   the controller's "run failed" line (what the user sees first)
  gap_s                   surfaced − first error: how long the first real error stayed hidden
  hops                    processes other than the controller that logged an ERROR before the surfaced error
  processes_with_errors   every process with an ERROR line, in order of its first one
  log_files_to_read       log files holding an ERROR or WARNING line (what a person reads to diagnose)
  last_error_line         the last ERROR line of the controller's log (where people start reading)

Our own root-cause line (logger rlhf.diagnosis, the run's last line) and the stall watchdog's report when
it only reports (resilience.stall_stops_run off) are not counted as errors here: these measures describe
how the failure propagated, as the seeds' system logged it.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import re
from typing import Any

POINT_STAGE = [
    ("weights_update.", "weights_update"), ("metaserver.", "weights_update"), ("rollout.pause", "weights_update"),
    ("rollout.continue", "weights_update"), ("rollout.", "rollout"),
    ("reference.", "reference"), ("train.", "train"), ("collective.", "train"), ("sft.", "train"),
    ("checkpoint.", "latest_recover_save"), ("events.", "events"), ("scheduler.", "cleanup"),
    ("data.split", "reward"), ("buffer.", "rollout"), ("env.", "rollout"), ("tool.", "rollout"), ("sandbox.", "rollout"), ("reward.", "reward"), ("reward_model.", "reward"), ("step.begin", "step"), ("rpc.", "rpc"),
]

DIAGNOSIS = " rlhf.diagnosis: "  # our root-cause line: not one of the errors the seeds' system would have logged
WATCHDOG_REPORT_ONLY = "the run goes on waiting (resilience.stall_stops_run off)"  # ends the watchdog's report


def ours(line: str) -> bool:
    """A line our diagnosis added beside the run (root cause, a watchdog that only reports)."""
    return DIAGNOSIS in line or WATCHDOG_REPORT_ONLY in line
_FAILED = re.compile(r"run failed: (?:step (?P<step>\d+), stage (?P<stage>[a-z_]+)|(?P<where>[a-z_]+)): (?P<what>.*)")


def stage_of_point(point: str, context: dict[str, Any] | None = None) -> str:
    """The step stage a fault point belongs to; the marker's context refines it (an RPC's stage, a periodic save)."""
    context = context or {}
    if context.get("stage") and point.startswith(("rpc.", "collective.")):  # the request it fired in
        return str(context["stage"])
    slot = str(context.get("path", "")).rsplit(f"{os.sep}checkpoints{os.sep}", 1)[-1]  # periodic/…, .staging-periodic-…
    if point.startswith("checkpoint.") and "periodic" in slot:
        return "periodic_recover_save"
    for prefix, stage in POINT_STAGE:
        if point.startswith(prefix):
            return stage
    return "?"


def _stamp(line: str) -> float | None:
    try:
        return dt.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def _logs(run_dir: str) -> dict[str, list[str]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        with open(path, encoding="utf-8", errors="replace") as fh:
            out[os.path.basename(path)[:-4]] = fh.read().splitlines()
    return out


def _message(line: str) -> str:
    return line.split(": ", 1)[1] if ": " in line else line


def read_markers(run_dir: str) -> list[dict[str, Any]]:
    """faults/markers.jsonl, oldest first ([] when the run had no faults)."""
    path = os.path.join(run_dir, "faults", "markers.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return sorted((json.loads(line) for line in fh if line.strip()), key=lambda m: m["time"])


def injections(run_dir: str) -> list[dict[str, Any]]:
    return [m for m in read_markers(run_dir) if m["event"] == "inject"]


def measure_run(run_dir: str, exit_code: int | None = None) -> dict[str, Any]:
    logs = _logs(run_dir)
    injects = injections(run_dir)
    onset = injects[0]["time"] if injects else None
    row: dict[str, Any] = {
        "fault_stage": stage_of_point(injects[0]["point"], injects[0].get("context")) if injects else "",
        "fault_point": injects[0]["point"] if injects else "",
        "target": f"{injects[0]['role']}-{injects[0]['rank']}" if injects else "",
    }
    errors = sorted(((t, proc, line) for proc, lines in logs.items() for line in lines
                     if " ERROR " in line and not ours(line) and (t := _stamp(line)) is not None),
                    key=lambda e: e[0])
    controller = logs.get("controller-0", []) or logs.get("trainer-0", [])
    failed = next(((_stamp(line), line) for line in controller if "run failed" in line), (None, ""))
    match = _FAILED.search(failed[1]) if failed[1] else None
    row["error_stage"] = (match.group("stage") or match.group("where")) if match else ""
    rel = (lambda t: round(t - onset, 3)) if onset is not None else (lambda t: round(t, 3))
    row["first_error_time_s"] = rel(errors[0][0]) if errors else ""
    row["surfaced_error_time_s"] = rel(failed[0]) if failed[0] is not None else ""
    row["gap_s"] = (round(failed[0] - errors[0][0], 3) if failed[0] is not None and errors else "")
    order: list[str] = []
    for _, proc, _line in errors:
        if proc not in order:
            order.append(proc)
    before = {proc for t, proc, _ in errors if failed[0] is None or t <= failed[0]}
    row["hops"] = len(before - {"controller-0", "trainer-0"})
    row["processes_with_errors"] = " ".join(order)
    row["log_files_to_read"] = sum(1 for lines in logs.values() if any(" ERROR " in x or " WARNING " in x for x in lines))
    ctrl_errors = [line for line in controller if " ERROR " in line and not ours(line)]
    row["last_error_line"] = _message(ctrl_errors[-1])[:240] if ctrl_errors else ""
    row.update(survival_counts(run_dir, logs))
    finished = os.path.exists(os.path.join(run_dir, "summary.json"))
    row["run_outcome"] = "finished" if finished and not failed[1] else (
        f"failed (exit {exit_code})" if exit_code is not None else "failed")
    return row


def survival_counts(run_dir: str, logs: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """What the run survived: steps done (steps.csv rows), requests sent again (every process's "retrying …"
    and "…; retrying" WARNINGs: idempotent calls, shed calls, colocation events), samples migrated, rollout servers restarted, weights updates done through disk instead of the MetaServer and
    checkpoint saves that failed while the run went on (steps.csv), worlds torchrun restarted (--max-restarts), the
    most versions a trained-on sample lagged (staleness_max, async runs), and the final eval accuracy."""
    import csv

    logs = _logs(run_dir) if logs is None else logs
    rows: list[dict[str, str]] = []
    if os.path.exists(os.path.join(run_dir, "steps.csv")):
        with open(os.path.join(run_dir, "steps.csv"), newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))

    def total(column: str) -> int:
        return sum(int(float(r.get(column) or 0)) for r in rows)

    eval_after: Any = ""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
            eval_after = round(float(json.load(fh).get("eval_accuracy_after")), 3)
    except (OSError, ValueError, TypeError):
        pass
    return {"steps_done": len({r.get("step") for r in rows}),  # a restarted world writes its replayed steps again
            "world_restarts": sum(1 for lines in logs.values() for line in lines
                                  if " WARNING " in line and "torchrun restarted this run's workers" in line),
            "retries": sum(1 for lines in logs.values() for line in lines if " WARNING " in line
                           and (_message(line).startswith("retrying ") or line.endswith("; retrying"))),
            "migrated": total("rollout_migrated"), "restarts": total("rollout_restarts"),
            "fallbacks": total("weights_fallback"), "saves_failed": total("saves_failed"),
            "stragglers": total("stragglers"), "rebalanced": total("rebalanced"),
            # asynchronous GRPO: the most weights versions a trained-on sample lagged its step (0 in sync runs)
            "staleness_max": max((int(float(r.get("staleness_max") or 0)) for r in rows), default=""),
            "eval_after": eval_after}
