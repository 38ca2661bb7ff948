"""kill -9 chaos: GRPO runs (hardened by default) in each mode, one process SIGKILLed from outside at a random step
and moment, the way an operator or the kernel's OOM killer would. Does the run survive it in place, or end within
seconds and resume; does anything hang or stay behind; does `rlhf diagnose` name the victim?

    python benchmarks/chaos.py --runs 40 --seed 1
    python benchmarks/chaos.py --runs 8 --modes async_env --victims env scheduler --json chaos.json

Modes: sync, async (rollout.mode async, K = 1), env (the calculator's tools through env-0), async_env (both). Every
run has 1 train rank, 2 rollout servers and a tiny reward model (reward-0, built here, no download), so every victim
exists in every mode but env-0 (env modes only). Victims: a rollout server (either), env-0, reward-0, the
scheduler (its jobs die with it: PDEATHSIG) and the train rank.

A run: the victim and its step are drawn from --seed; once steps.csv has the step before it, the victim is killed
a random fraction of the previous step's seconds later (inside the step, in any stage); a kill that would land
after the last step (in the run's cleanup) is not made ("no kill"). Its pid is read where the
run writes it (the scheduler's log: its own and its jobs'; train-0's log). What is read afterwards:
    outcome    survived (every step, exit 0), or ended (exit != 0) then resumed (the same command again finishes:
               checkpoint.resume), or hang (no exit within --timeout; killed)
    ended_s    seconds from the kill to the run's exit, when it ended
    left       the run's processes still alive 15 s after it exited (command lines naming its directory), and
               cgroups left under /sys/fs/cgroup
    named      `rlhf diagnose` names the victim's process (the verdict's root cause)
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
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = {"sync": [], "async": ["--rollout.mode", "async", "--rollout.max_staleness", "1"],
         "env": ["--env.path", "tool_calls", "--env.tools", "examples/envs/calculator.py"]}
MODES["async_env"] = MODES["async"] + MODES["env"]
VICTIMS = ("rollout", "env", "reward", "scheduler", "train")
SURVIVABLE = ("rollout", "env", "reward", "scheduler")  # hardened survives these in place; a train rank's loss ends it


def trainer(run_dir: str, mode: str, steps: int, rm_dir: str, preset: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "examples", "grpo_trainer.py"), "--preset", "smoke", "--steps",
            str(steps), "--sft.max_steps", "0", "--rollout.servers", "2", "--rollout.prompts_per_step", "16",
            "--reward_model.path", rm_dir,
            "--reward_model.weight", "0.5", "--resilience.preset", preset, "--run-dir", run_dir, *MODES[mode]]


def rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "steps.csv")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def victim_pid(run_dir: str, victim: str, rng: random.Random) -> tuple[str, int | None]:
    """The victim's process name and its current pid, read from the run's logs (the newest start of it)."""
    logs = os.path.join(run_dir, "logs")
    if victim == "train":
        name, path, pattern = "train-0", "train-0.log", r"serving on \S+ \(pid (\d+)\)"
    elif victim == "scheduler":
        name, path, pattern = "scheduler-0", "scheduler-0.log", r"scheduler listening on \S+ \(pid (\d+)"
    else:
        name = {"rollout": f"rollout-{rng.randrange(2)}", "env": "env-0", "reward": "reward-0"}[victim]
        path, pattern = "scheduler-0.log", rf"started job {name} \(role \w+\) pid (\d+)"
    try:
        with open(os.path.join(logs, path), encoding="utf-8", errors="replace") as fh:
            found = re.findall(pattern, fh.read())
    except FileNotFoundError:
        found = []
    return name, int(found[-1]) if found else None


def left_behind(run_dir: str) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and run_dir in " ".join(p.info["cmdline"] or []):
                left.append(f"pid {p.info['pid']}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def stop_all(run_dir: str) -> None:
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if run_dir in " ".join(p.info["cmdline"] or []):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def one_run(n: int, mode: str, victim: str, step: int, fraction: float, args: argparse.Namespace, rm_dir: str,
            base: str, rng: random.Random) -> dict:
    run_dir = os.path.join(base, f"run-{n:03d}-{mode}-{victim}")
    cmd = trainer(run_dir, mode, args.steps, rm_dir, args.preset)
    record = {"run": n, "mode": mode, "victim": victim, "step": step, "process": "", "outcome": "", "ended_s": "",
              "left": "", "named": False, "diagnosis": ""}
    log = open(os.path.join(base, f"run-{n:03d}.out"), "w", encoding="utf-8")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline, killed_at = time.monotonic() + args.timeout, None
    try:
        while proc.poll() is None and time.monotonic() < deadline and killed_at is None:
            done = rows(run_dir)
            if len(done) >= step - 1:
                last_s = float(done[-1]["seconds"]) if done else 10.0
                target = time.monotonic() + fraction * last_s
                while proc.poll() is None and time.monotonic() < target:
                    time.sleep(0.05)  # the moment inside the step drawn for the kill
                name, pid = victim_pid(run_dir, victim, rng)
                record["process"] = name
                if pid is None or proc.poll() is not None or len(rows(run_dir)) >= args.steps:
                    break  # nothing to kill, or the run is past its last step (its cleanup): not a kill mid-run
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                except ProcessLookupError:
                    break
            time.sleep(0.1)  # polling steps.csv: the condition is its row count
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            record["outcome"] = "hang"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        log.close()
    if killed_at is None and not record["outcome"]:
        record["outcome"] = "no kill"  # the run ended (or failed) before the kill's moment
    elif not record["outcome"]:
        if proc.returncode == 0 and len(rows(run_dir)) == args.steps:
            record["outcome"] = "survived"
        else:
            record["ended_s"] = round(time.monotonic() - killed_at, 1)
            resumed = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                     timeout=args.timeout)
            record["outcome"] = "resumed" if resumed.returncode == 0 and len(rows(run_dir)) == args.steps \
                else f"ended (exit {proc.returncode}), resume failed (exit {resumed.returncode})"
    time_left = time.monotonic() + 15
    while left_behind(run_dir) and time.monotonic() < time_left:
        time.sleep(0.2)  # the condition is the run's processes gone
    left = left_behind(run_dir) + glob.glob(f"/sys/fs/cgroup/rlhf-*{os.path.basename(run_dir)}*")
    record["left"] = ", ".join(left)
    stop_all(run_dir)
    if killed_at is not None:
        try:
            from rlhf.diagnosis import diagnose

            root = diagnose(run_dir).root
            record["named"] = root is not None and root.process == record["process"]
            record["diagnosis"] = f"{root.process}/{root.category}/{root.stage}/{root.step}" if root else "none"
        except Exception as exc:  # noqa: BLE001 — a diagnosis that fails is this run's answer
            record["diagnosis"] = f"failed: {type(exc).__name__}: {exc}"
    return record


def table(records: list[dict]) -> str:
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        cells.setdefault((r["mode"], r["victim"]), []).append(r)
    lines = ["| mode | victim | runs | survived | ended, resumed | hang | other | left behind | named | ended within |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (mode, victim), rs in sorted(cells.items()):
        ended = [r["ended_s"] for r in rs if r["outcome"] == "resumed"]
        other = [r for r in rs if r["outcome"] not in ("survived", "resumed", "hang")]
        lines.append(f"| {mode} | {victim} | {len(rs)} | {sum(r['outcome'] == 'survived' for r in rs)} | "
                     f"{len(ended)} | {sum(r['outcome'] == 'hang' for r in rs)} | {len(other)} | "
                     f"{sum(bool(r['left']) for r in rs)} | {sum(r['named'] for r in rs)}/{len(rs)} | "
                     f"{f'{max(ended):.1f} s' if ended else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs in all, spread over the modes and victims")
    parser.add_argument("--seed", type=int, default=1, help="draws each run's mode, victim, step and moment")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--victims", nargs="+", default=list(VICTIMS), choices=VICTIMS)
    parser.add_argument("--steps", type=int, default=5,
                        help="GRPO steps a run (the kill lands in steps 2..steps-1, and the run has a step after it)")
    parser.add_argument("--preset", default="hardened", choices=["hardened", "faithful"])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as a hang")
    parser.add_argument("--json", help="write every run's record to this file")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.steps < 3:
        parser.error("--runs: at least 1; --steps: at least 3 (the kill lands after step 1, before the last)")
    pairs = [(m, v) for m in args.modes for v in args.victims if v != "env" or "env" in m]
    if not pairs:
        parser.error(f"no victim of {args.victims} runs in modes {args.modes} (env-0 only in env modes)")
    rng = random.Random(args.seed)
    plan = [pairs[i % len(pairs)] for i in range(args.runs)]  # every pair as evenly as the runs allow
    rng.shuffle(plan)
    base = tempfile.mkdtemp(prefix="rlhf-chaos-")
    from rlhf.models.reward_model import write_reward_model_dir

    rm_dir = write_reward_model_dir(os.path.join(base, "rm"))
    records = []
    try:
        for n, (mode, victim) in enumerate(plan, 1):
            step, fraction = rng.randint(2, args.steps - 1), rng.random()
            print(f"[chaos] run {n}/{len(plan)}: {mode}, kill {victim} in step {step} at {fraction:.2f} of a step",
                  file=sys.stderr, flush=True)
            record = one_run(n, mode, victim, step, fraction, args, rm_dir, base, rng)
            print(f"[chaos]   {record['outcome']}{' ' + str(record['ended_s']) + ' s' if record['ended_s'] else ''}"
                  f"; left: {record['left'] or 'nothing'}; diagnosis {record['diagnosis']}", file=sys.stderr,
                  flush=True)
            records.append(record)
            if args.json:
                with open(args.json, "w", encoding="utf-8") as fh:
                    json.dump(records, fh, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"run directories: {base}", file=sys.stderr)
    print(table(records))
    bad = [r for r in records if r["outcome"] not in ("survived", "resumed", "no kill") or r["left"]
           or (r["victim"] in SURVIVABLE and args.preset == "hardened" and r["outcome"] == "resumed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
