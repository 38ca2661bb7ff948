#!/usr/bin/env python
"""Run the fault scenarios and measure, from each run directory, where the fault surfaced.

For every scenario file (examples/faults/scenarioN.yaml) it starts a fresh 2-rank, 2-server
run (`torchrun --nproc_per_node=2 examples/grpo_trainer.py --faults …`), then measures the run
directory with rlhf.analysis.measure_run (logs, fault markers, exit status; nothing is taken
from the YAML). Writes scenarios.csv and scenarios.md into --out and prints the table.

    python benchmarks/scenarios.py                          # scenarios 1-19, rl and sft, faithful
    python benchmarks/scenarios.py --scenarios 3 --resilience faithful hardened
    python benchmarks/scenarios.py --resilience hardened --modes rl --fault-free   # the survival matrix
    python benchmarks/scenarios.py --scenarios 1_sim --modes rl --resilience faithful hardened
        # scenario 1 at the seed plan's size (32 train ranks, 16 rollout servers) in a simulated world
    python benchmarks/scenarios.py --scenarios scale_straggler scale_host_lost scale_server_hung scale_clock_ahead \
        --modes rl --resilience faithful hardened
        # the faults of a big world (examples/faults/scale_*.yaml: 1,024 simulated train ranks, 256 servers)

Each row counts what the run survived: steps done, requests sent again (retries), samples migrated
to another rollout server, rollout servers restarted, weights updates done through disk when the
MetaServer path failed (fallbacks), checkpoint saves that failed while the run went on, and the eval accuracy after the last step;
--fault-free also runs each scenario's config with no faults (rl), for the eval accuracy to compare.

Scenarios 9 and 12 are run twice when faithful (a crash, then the same command resumes; hardened, torchrun restarts
the world once); their rows measure both.
Beside scenarios 1-5 the table puts the seed plan's expected result (seeds/000, "expected results").

SFT rows run the same fault file on the SFT baseline (examples/sft_trainer.py, same train workers):
faults at points only RL has (weights_update.*, rollout.*, scheduler.stop_job) are never reached there.
"""

import argparse
import csv
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from rlhf.analysis import measure_run, survival_counts  # noqa: E402

COLUMNS = ["scenario", "mode", "resilience", "fault_stage", "fault_point", "target", "error_stage",
           "first_error_time_s", "surfaced_error_time_s", "gap_s", "hops", "processes_with_errors",
           "log_files_to_read", "last_error_line", "run_outcome", "steps_done", "retries", "migrated", "restarts",
           "fallbacks", "saves_failed", "stragglers", "rebalanced", "world_restarts", "staleness_max", "eval_after",
           "eval_fault_free", "named_s", "diagnosis", "wall_s", "seed_expected"]

RESTART = {"9", "12"}  # scenarios whose effect shows only when the same command is run again (resume)

# The seed plan's expected values (seeds/000, its "expected results" table and each scenario's timeline),
# with the seed's timeouts; the scenario files scale them down (their header comments say how).
SEED_EXPECTED = {
    "1": "error in weights_update on the rollout side; 2 hops (train -> MetaServer -> rollout); upload of the slow rank "
         "runs to its 600 s timeout",
    "1_sim": "as scenario 1, at its own size: train worker 5 of 32, 16 rollout workers",
    "2": "rollout fault -> error in train (batch size mismatch), one stage later",
    "3": "OOM in train; last controller error a stop-job timeout ~30 s after it; OOM only in the faulty rank's log "
         "(33 log files to search, MTTD > 10 min)",
    "4": "events fault -> rollout waits its full timeout (7200 s) with GPU 0 idle: a colocation-only deadlock",
    "5": "save fault at step N -> corrupted-checkpoint error in weights_update at step N+1 (detection 1 step late)",
}


def seed_expected(n: str) -> str:
    """The seed plan's expected result for scenario n; a simulated copy of a seed scenario (2_sim) expects the same."""
    if n in SEED_EXPECTED or not n.endswith("_sim"):
        return SEED_EXPECTED.get(n, "")
    base = SEED_EXPECTED.get(n.removesuffix("_sim"), "")
    return f"as scenario {n.removesuffix('_sim')}, at its own size (32 train ranks, 16 rollout servers)" + \
        (f": {base}" if base else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fault_free_eval(n: str, out_dir: str) -> float | str:
    """The eval accuracy of scenario n's config (its steps, timeouts, warm start) with its faults removed."""
    import yaml

    with open(fault_file(n), encoding="utf-8") as fh:
        spec = yaml.safe_load(fh)
    spec["faults"] = []
    path = os.path.join(out_dir, f"scenario{n}-fault-free.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(spec, fh)
    run_dir = os.path.join(out_dir, f"scenario{n}-fault-free")
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"[scenarios] scenario {n} with no faults → {run_dir}", file=sys.stderr, flush=True)
    launch = [sys.executable] if simulated(n) else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                                     "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    subprocess.run([*launch, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--run-dir", run_dir, "--faults", path],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, timeout=600)
    return survival_counts(run_dir)["eval_after"]


def simulated(n: str) -> bool:
    """A simulated world's scenario (docs/scale.md): its size is in the file, one process starts it."""
    return n.endswith("_sim") or n.startswith("scale_")


def fault_file(n: str) -> str:
    """examples/faults/scenarioN.yaml, or the file named (scale_straggler: examples/faults/scale_straggler.yaml)."""
    return os.path.join(ROOT, "examples", "faults", f"{n}.yaml" if n.startswith("scale_") else f"scenario{n}.yaml")


def named(run_dir: str) -> dict:
    """How soon the run named what happened (the first WARNING or ERROR of the controller after the first injection,
    seconds after it: a stall watchdog's finding, a straggler, a clock, a migration, the run's failure) and what
    `rlhf diagnose` names (process/category/stage/step)."""
    from rlhf.analysis import injections
    from rlhf.diagnosis import diagnose

    out = {"named_s": "", "diagnosis": ""}
    injects = injections(run_dir)
    path = os.path.join(run_dir, "logs", "controller-0.log")
    if injects and os.path.exists(path):
        onset = injects[0]["time"]
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(" ", 3)
                if len(parts) == 4 and parts[2] in ("WARNING", "ERROR") and "rlhf.faults:" not in line:
                    t = time.mktime(time.strptime(parts[0][:19], "%Y-%m-%dT%H:%M:%S")) + float(parts[0][19:] or 0)
                    if t >= onset - 1.0:
                        out["named_s"] = round(t - onset, 2)
                        break
    try:
        root = diagnose(run_dir).root
    except Exception as exc:  # noqa: BLE001 — a diagnosis that fails is this row's answer, not the benchmark's end
        return {**out, "diagnosis": f"failed: {type(exc).__name__}: {exc}"}
    if root is not None:
        out["diagnosis"] = f"{root.process}/{root.category}/{root.stage}/{root.step}"
    return out


def run_one(n: str, mode: str, resilience: str, out_dir: str) -> dict:
    run_dir = os.path.join(out_dir, f"scenario{n}-{mode}-{resilience}")
    script = "grpo_trainer.py" if mode == "rl" else "sft_trainer.py"
    # hardened: torchrun restarts a world that lost a process once (--max-restarts 1), resuming from the newest
    # valid checkpoint; faithful: as the seeds ran it, a crash ends the run (the restart is a second command)
    restarts = ["--max-restarts=1"] if resilience == "hardened" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           "--master_port=PORT", *restarts, os.path.join(ROOT, "examples", script), "--run-dir", run_dir,
           "--faults", fault_file(n), "--resilience", resilience]
    if simulated(n):  # a simulated world (docs/scale.md): its size is in the file, one process starts it
        cmd = [sys.executable, os.path.join(ROOT, "examples", script), *cmd[cmd.index("--run-dir"):]]
    print(f"[scenarios] scenario {n} {mode} {resilience} → {run_dir}", file=sys.stderr, flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a kept one would resume, and mix old logs in
    t0 = time.perf_counter()
    codes = []
    for _ in range(2 if n.removesuffix("_sim") in RESTART and mode == "rl" and resilience == "faithful" else 1):
        if codes and codes[-1] == 0:
            break  # nothing crashed: no restart to make
        if codes:
            time.sleep(15)  # what a crashed run leaves stops when the scheduler's lease lapses
        run = [f"--master_port={free_port()}" if a == "--master_port=PORT" else a for a in cmd]
        codes.append(subprocess.run(run, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                    timeout=600).returncode)
    row = {"scenario": n, "mode": mode, "resilience": resilience, **measure_run(run_dir, codes[-1]),
           "wall_s": round(time.perf_counter() - t0, 1), "seed_expected": seed_expected(n), **named(run_dir)}
    if len(codes) == 2:
        row["run_outcome"] = f"crashed (exit {codes[0]}); restart {row['run_outcome']}"
    print(f"[scenarios]   fault in {row['fault_stage']}, surfaced in {row['error_stage'] or '-'} after "
          f"{row['surfaced_error_time_s']} s ({row['run_outcome']})", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=[*map(str, range(1, 20))],
                    help="scenario numbers (default 1-19; 20 and 21 need two hosts: rlhf hosts run, docs/hosts.md)")
    ap.add_argument("--resilience", nargs="+", default=["faithful"], choices=["faithful", "hardened"])
    ap.add_argument("--modes", nargs="+", default=["rl", "sft"], choices=["rl", "sft"],
                    help="rl: examples/grpo_trainer.py; sft: the SFT baseline on the same train workers")
    ap.add_argument("--fault-free", action="store_true",
                    help="also run each scenario's config without its faults (rl) for the eval accuracy to compare")
    ap.add_argument("--out", default="", help="directory for the runs and the tables (default: a temp dir)")
    args = ap.parse_args()
    out_dir = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rlhf-scenarios-"))
    os.makedirs(out_dir, exist_ok=True)
    rows = [run_one(n, m, r, out_dir) for n in args.scenarios for m in args.modes for r in args.resilience
            if m == "rl" or not simulated(n)]  # a simulated world runs GRPO only
    baseline = {n: fault_free_eval(n, out_dir) for n in args.scenarios} if args.fault_free else {}
    for r in rows:
        r["eval_fault_free"] = baseline.get(r["scenario"], "") if r["mode"] == "rl" else ""
    with open(os.path.join(out_dir, "scenarios.csv"), "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    shown = ["scenario", "mode", "resilience", "fault_stage", "fault_point", "target", "error_stage",
             "first_error_time_s", "surfaced_error_time_s", "gap_s", "hops", "log_files_to_read", "run_outcome",
             "steps_done", "retries", "migrated", "restarts", "fallbacks", "saves_failed", "stragglers", "rebalanced",
             "world_restarts", "staleness_max", "eval_after", "eval_fault_free", "named_s", "diagnosis"]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(r[c]) for c in shown) + " |" for r in rows]
    lines += ["", "The seed plan's expected result (seeds/000; its timeouts, not the scaled ones):", ""]
    lines += [f"- scenario {n}: {seed_expected(n)}" for n in args.scenarios if seed_expected(n)]
    lines += ["", "Last error line of the controller's log:", ""]
    lines += [f"- scenario {r['scenario']} {r['mode']} ({r['resilience']}): `{r['last_error_line'] or '(no error)'}`"
              for r in rows]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "scenarios.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    print(text)
    print(f"\n(wrote {out_dir}/scenarios.csv and scenarios.md)", file=sys.stderr)


if __name__ == "__main__":
    main()
