#!/usr/bin/env python
"""Score `rlhf diagnose` against the fault markers: the scenario matrix and seeded random single faults.

    python benchmarks/diagnosis.py                            # scenarios 1-10, 16-21 faithful + hardened, 30 random faults
    python benchmarks/diagnosis.py --random 0 --resilience faithful --scenarios 2 7
    python benchmarks/diagnosis.py --rescore OUT              # score the run directories already in OUT

Every run is a real 2-rank, 2-rollout-server GRPO run (torchrun). The diagnosis reads only the run
directory's logs, exit records, heartbeats and traces; this script alone reads faults/markers.jsonl, as
the answer key. The expected root cause is the first injected fault that can fail a run (CPU or IO
contention and memory pressure, capped at half the free memory, only slow one down): its process (role-rank), its stage (the point's, refined by the
marker's context) and the categories its kind produces (a hang may read as a timeout from outside).
A diagnosis is correct when all three match. Two baselines from the same run directory:
"last ERROR line of the controller log" and "earliest ERROR line across all logs", scored on the
process and stage they name. Time to diagnosis: from the fault's onset (its first marker) to the
moment the run's console printed the root cause (the controller's rlhf.diagnosis line).

Random faults are drawn (seeded) from kinds × points × targets × steps that `rlhf faults validate`
accepts for this world and that fail a run when they fire.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import yaml  # noqa: E402

from rlhf.analysis import injections, stage_of_point  # noqa: E402
from rlhf.diagnosis import LOG_LINE, diagnose, stage_of_route, stamp  # noqa: E402
from rlhf.faults.parse import parse_fault_dicts  # noqa: E402
from rlhf.faults.spec import FaultSpecError, check_world  # noqa: E402

# slow a run down, never fail it: contention, and memory pressure (capped at half the free memory)
BACKGROUND_SLOWDOWNS = {"cpu_contention", "io_contention", "memory_pressure"}
ACCUMULATING = {"device_memory_pressure"}  # each firing takes more of the device until an allocation fails
_PROC = re.compile(r"\b(train|rollout|reward|env|scheduler|metaserver|controller)-\d+\b")

# A 2-rank run with the scenario files' scaled-down timeouts and a short SFT warm start
BASE_CONFIG = {"steps": 5, "rollout": {"servers": 2}, "sft": {"max_steps": 60, "eval_every": 30},
               "timeouts": {"cleanup_s": 5, "rpc_s": 20, "rollout_s": 8},
               "checkpoint": {"periodic_every": 2}}

# (kind, params, [(role, rank, point, peer)]): what fails a run when it fires there
RANDOM_SPACE = [
    ("process_kill", {"signal": "KILL"}, [("rollout", 0, "rollout.generate", ""), ("rollout", 1, "rollout.generate", ""),
                                          ("train", 1, "train.step", ""), ("train", 1, "reference.compute", ""),
                                          ("rollout", 1, "weights_update.update", "")]),
    ("exception", {"error": "RuntimeError"}, [("train", 0, "train.step", ""), ("train", 1, "reference.compute", ""),
                                              ("rollout", 0, "rollout.generate", ""),
                                              ("train", 1, "weights_update.upload", ""),
                                              ("rollout", 1, "weights_update.update", "")]),
    ("exception", {"error": "OutOfMemoryError"}, [("train", 1, "train.step", ""), ("rollout", 1, "rollout.generate", ""),
                                                  ("train", 0, "reference.compute", "")]),
    ("exception", {"error": "MemoryError"}, [("train", 0, "train.step", ""), ("rollout", 0, "rollout.generate", "")]),
    ("disk_full", {"mode": "enospc"}, [("train", 0, "checkpoint.write", ""), ("train", 1, "checkpoint.write", "")]),
    ("hang", {"duration_s": 60}, [("rollout", 1, "rollout.generate", ""), ("train", 1, "weights_update.upload", ""),
                                  ("train", 1, "reference.compute", "")]),
    ("http_error", {"status": 500}, [("train", 1, "rpc.server.handle", "/compute_logprobs"),
                                     ("rollout", 0, "rpc.server.handle", "/generate"),
                                     ("metaserver", 0, "rpc.server.handle", "/weights")]),
    ("network_loss", {"mode": "reset"}, [("rollout", 1, "rpc.server.handle", "/generate"),
                                         ("train", 0, "rpc.server.handle", "/train_step")]),
]

SHARDED = ("fsdp_all_gather_hang", "fsdp_all_gather_oom")  # examples/faults, in the resilience each file sets

KIND_CATEGORIES = {
    "process_kill": {"process_death"}, "hang": {"hang", "timeout"}, "network_delay": {"timeout", "hang"},
    "network_loss": {"network", "data_mismatch"}, "http_error": {"exception", "network"}, "dns_failure": {"network"},
    "disk_full": {"disk"}, "device_memory_pressure": {"oom_device"}, "device_memory_leak": {"oom_device"},
    "memory_pressure": {"oom_host"}, "cpu_contention": {"cpu_starvation", "timeout"},
    "io_contention": {"io_starvation", "timeout"}, "clock_skew": {"hang", "timeout", "exception"},
    "network_partition": {"network"}, "bandwidth_cap": {"network", "timeout"},
}
HOST_SCENARIOS = {"20", "21"}  # two hosts of their own (network namespaces, root): run with `rlhf hosts run`
EXCEPTION_CATEGORIES = {"OutOfMemoryError": {"oom_device"}, "MemoryError": {"oom_host"},
                        "TimeoutError": {"timeout", "exception"}, "OSError": {"disk", "exception"},
                        "ConnectionError": {"network", "exception"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SURVIVED = ("saves_failed", "weights_fallback", "rollout_restarts", "rollout_migrated")  # steps.csv: what a step got past


def survived_steps(run_dir: str) -> set[int]:
    """The steps whose row counts a failure the run got past (a save skipped, weights through disk, a rollout server
    started again or its work moved)."""
    path = os.path.join(run_dir, "steps.csv")
    if not os.path.exists(path):
        return set()
    with open(path) as fh:
        return {int(r["step"]) for r in csv.DictReader(fh) if any(float(r.get(k) or 0) > 0 for k in SURVIVED)}


def expected(run_dir: str, faults: list[dict]) -> dict | None:
    """The answer key: the first injected fault that can fail a run (markers + the fault file's kinds); a fault that
    the run got past (its step's row counts it: SURVIVED) is not the cause of a failure a fault of a later step
    brought."""
    kinds = {f["name"]: f for f in faults}
    fired, survived = injections(run_dir), survived_steps(run_dir)
    for i, m in enumerate(fired):
        if m.get("step") in survived and any((later.get("step") or -1) > m["step"] for later in fired[i + 1:]):
            continue
        spec = kinds.get(m.get("fault", ""), {})
        kind = spec.get("kind") or m.get("kind", "")
        if kind in BACKGROUND_SLOWDOWNS and m["role"] != "env":  # env-0's load starves its sandboxes past their limit
            continue
        cats = KIND_CATEGORIES.get(kind, {"exception"})
        if kind == "exception":
            cats = EXCEPTION_CATEGORIES.get((spec.get("params") or {}).get("error", "RuntimeError"), {"exception"})
        if m["point"] in ("tool.call", "sandbox.exec") or kind in BACKGROUND_SLOWDOWNS:  # a tool's infrastructure
            cats = {"tool_infra", "hang" if kind == "hang" else "cpu_starvation" if kind in BACKGROUND_SLOWDOWNS
                    else "tool_infra"}
        if kind == "network_loss" and (spec.get("params") or {}).get("mode") == "truncate_tensor":
            cats = {"data_mismatch"}
        onset = m["time"]
        if kind in ACCUMULATING:  # the device fills a little at each firing: it runs out at the last one
            m = [x for x in fired if x.get("fault") == m.get("fault")][-1]
        return {"process": f"{m['role']}-{m['rank']}", "stage": stage_of_point(m["point"], m.get("context")),
                "categories": sorted(cats), "onset": onset, "kind": kind, "point": m["point"]}
    return None


def _errors(run_dir: str) -> list[tuple[float, str, str]]:
    out = []
    for path in glob.glob(os.path.join(run_dir, "logs", "*.log")):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = LOG_LINE.match(line.rstrip("\n"))
                if m and m.group("level") == "ERROR" and not m.group("logger").startswith(("rlhf.diagnosis",
                                                                                           "rlhf.faults")):
                    t = stamp(m.group("ts"))
                    out.append((t, m.group("proc"), m.group("msg")))
    return sorted(out)


def _named(proc: str, msg: str) -> tuple[str, str]:
    """What a person reading this one line would blame: the peer it names (else its writer), and a stage."""
    body = re.sub(rf"^{re.escape(proc)}: ", "", msg)
    peer = next((m.group(0) for m in _PROC.finditer(body) if m.group(0) != proc), proc)
    stage = re.search(r"stage ([a-z_]+)", body)
    route = re.search(r"(?:POST|GET) (/\S+)", body)
    return peer, stage.group(1) if stage else (stage_of_route(route.group(1)) if route else "")


def baselines(run_dir: str) -> dict[str, tuple[str, str]]:
    errors = _errors(run_dir)
    controller = [e for e in errors if e[1] == "controller-0"]
    return {"last_controller_error": _named(*controller[-1][1:]) if controller else ("", ""),
            "earliest_error": _named(*errors[0][1:]) if errors else ("", "")}


def diagnosis_time(run_dir: str) -> float | None:
    path = os.path.join(run_dir, "logs", "controller-0.log")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = LOG_LINE.match(line.rstrip("\n"))
            if m and m.group("logger") == "rlhf.diagnosis":
                return stamp(m.group("ts"))
    return None


def score(run_dir: str, faults: list[dict], label: str) -> dict:
    key = expected(run_dir, faults)
    row = {"run": label, "run_dir": run_dir}
    if key is None:
        return {**row, "expected": "(no fault fired)", "ours": "", "correct": None}
    d = diagnose(run_dir)
    r = d.root
    ours = (r.process, r.stage, r.category) if r else ("", "", "")
    row.update(expected=f"{key['process']} {key['stage']} {'/'.join(key['categories'])}",
               ours=" ".join(ours), confidence=d.confidence,
               correct=bool(r) and ours[0] == key["process"] and ours[1] == key["stage"]
               and ours[2] in key["categories"])
    for name, (proc, stage) in baselines(run_dir).items():
        row[name] = f"{proc} {stage}"
        row[f"{name}_correct"] = proc == key["process"] and stage == key["stage"]
    t = diagnosis_time(run_dir)
    row["time_to_diagnosis_s"] = round(t - key["onset"], 2) if t is not None else None
    return row


def run(run_dir: str, fault_file: str, resilience: str, restart: bool = False, on_hosts: bool = False) -> list[int]:
    """on_hosts: one launch on each of two hosts of their own (rlhf hosts run: network namespaces, root)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a kept one would resume, and mix old logs in
    codes = []
    for _ in range(2 if restart else 1):
        if codes and codes[-1] == 0:
            break
        if codes:
            time.sleep(15)  # a crashed run's leftovers stop when the scheduler's lease lapses
        script = [os.path.join(ROOT, "examples", "grpo_trainer.py"), "--run-dir", run_dir, "--faults", fault_file] + \
            (["--resilience", resilience] if resilience != "as written" else [])
        head = [sys.executable, "-m", "rlhf.cli", "hosts", "run", "--port", str(free_port()), "--"] if on_hosts else \
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             f"--master_port={free_port()}"]
        cmd = head + script
        try:
            codes.append(subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                        timeout=300).returncode)
        except subprocess.TimeoutExpired:
            codes.append(-1)
    return codes


def draw(rng: random.Random, n: int) -> list[dict]:
    out = []
    while len(out) < n:
        kind, params, targets = rng.choice(RANDOM_SPACE)
        role, rank, point, peer = rng.choice(targets)
        step = rng.choice([2, 3])
        if point == "checkpoint.write":
            step = rng.choice([1, 2, 3])
        fault = {"name": f"random-{len(out)}", "kind": kind, "point": point,
                 "target": {"role": role, "rank": rank, **({"peer": peer} if peer else {})},
                 "when": {"step": step}, "params": dict(params)}
        try:
            problems = check_world(parse_fault_dicts([fault], "random draw"), 2, 2)
        except FaultSpecError:
            continue
        if problems:
            continue
        out.append(fault)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="*", default=[*map(str, range(1, 11)), *map(str, range(16, 22))],
                    help="examples/faults/scenarioN.yaml (default: 1-10, the environments' 16-19 and the hosts' 20-21, "
                         "which needs network namespaces: root)")
    ap.add_argument("--resilience", nargs="+", default=["faithful", "hardened"], choices=["faithful", "hardened"])
    ap.add_argument("--random", type=int, default=30, help="seeded random single faults (faithful)")
    ap.add_argument("--sharded", nargs="*", default=list(SHARDED),
                    help="the sharded-training fault files (parallel.layout fsdp), each run with its own resilience")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="directory for the runs and the table (default: a temp dir)")
    ap.add_argument("--rescore", default="", help="score the run directories already in this folder; run nothing")
    args = ap.parse_args()
    out = args.rescore or args.out or tempfile.mkdtemp(prefix="rlhf-diagnosis-")
    os.makedirs(out, exist_ok=True)
    plan = []  # (label, run_dir, fault file, resilience, restart)
    from rlhf.hosts import unavailable

    no_hosts = unavailable()
    for n in args.scenarios:
        if n in HOST_SCENARIOS and no_hosts:
            print(f"[diagnosis] scenario {n} skipped: it needs two hosts ({no_hosts})", file=sys.stderr)
            continue
        for res in args.resilience:
            plan.append((f"scenario {n} {res}", os.path.join(out, f"scenario{n}-{res}"),
                         os.path.join(ROOT, "examples", "faults", f"scenario{n}.yaml"), res, n == "9" and res == "faithful"))
    for name in args.sharded:
        plan.append((f"sharded {name}", os.path.join(out, name), os.path.join(ROOT, "examples", "faults",
                                                                               f"{name}.yaml"), "as written", False))
    for i, fault in enumerate(draw(random.Random(args.seed), args.random)):
        path = os.path.join(out, f"random{i}.yaml")
        if not args.rescore:
            with open(path, "w", encoding="utf-8") as fh:
                yaml.safe_dump({"config": BASE_CONFIG, "faults": [fault]}, fh, sort_keys=False)
        t = fault["target"]
        plan.append((f"random {i}: {fault['kind']} {fault['point']} {t['role']}-{t['rank']} step {fault['when']['step']}",
                     os.path.join(out, f"random{i}"), path, "faithful", False))
    rows = []
    for label, run_dir, fault_file, res, restart in plan:
        if not args.rescore:
            print(f"[diagnosis] {label} → {run_dir}", file=sys.stderr, flush=True)
            run(run_dir, fault_file, res, restart, on_hosts=os.path.basename(fault_file) in
                {f"scenario{n}.yaml" for n in HOST_SCENARIOS})
        if not os.path.isdir(run_dir):
            continue
        with open(fault_file, encoding="utf-8") as fh:
            faults = yaml.safe_load(fh).get("faults", [])
        row = score(run_dir, faults, label)
        print(f"[diagnosis]   expected {row['expected']}; ours {row.get('ours')} "
              f"({'ok' if row['correct'] else 'WRONG' if row['correct'] is False else '-'})", file=sys.stderr, flush=True)
        rows.append(row)
    with open(os.path.join(out, "diagnosis.jsonl"), "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("| run | expected (process stage category) | rlhf diagnose | ok | last controller ERROR | ok | "
          "earliest ERROR | ok | onset → diagnosis (s) |")
    print("|---|---|---|---|---|---|---|---|---:|")
    mark = {True: "✓", False: "✗", None: "–"}
    for r in rows:
        print(f"| {r['run']} | {r['expected']} | {r.get('ours', '')} | {mark[r['correct']]} | "
              f"{r.get('last_controller_error', '')} | {mark[r.get('last_controller_error_correct')]} | "
              f"{r.get('earliest_error', '')} | {mark[r.get('earliest_error_correct')]} | "
              f"{r.get('time_to_diagnosis_s') if r.get('time_to_diagnosis_s') is not None else ''} |")
    print()
    print("| group | runs | rlhf diagnose | last controller ERROR | earliest ERROR | median onset → diagnosis (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    groups = {"scenarios, faithful": lambda r: r["run"].startswith("scenario") and r["run"].endswith("faithful"),
              "scenarios, hardened": lambda r: r["run"].startswith("scenario") and r["run"].endswith("hardened"),
              "sharded training (fsdp)": lambda r: r["run"].startswith("sharded"),
              "random single faults": lambda r: r["run"].startswith("random")}
    for name, pick in groups.items():
        scored = [r for r in rows if pick(r) and r["correct"] is not None]
        if not scored:
            continue
        times = [r["time_to_diagnosis_s"] for r in scored if r.get("time_to_diagnosis_s") is not None]

        def pct(key: str) -> str:
            return f"{sum(1 for r in scored if r.get(key)) / len(scored):.0%}"

        print(f"| {name} | {len(scored)} | {pct('correct')} | {pct('last_controller_error_correct')} | "
              f"{pct('earliest_error_correct')} | {round(statistics.median(times), 2) if times else ''} |")


if __name__ == "__main__":
    main()
