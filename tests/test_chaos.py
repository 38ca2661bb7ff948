"""Chaos: kill -9 of a random process of a 2-rank run at a random step, then (when the run did not survive) the same
command again. Every run finishes, at once or on the second command; nothing of it is left behind.

The run is hardened under `torchrun --max-restarts 1`: a lost train rank (the controller's included) costs a world
restart and a resume, a lost scheduler or rollout server is started again by the controller, and a lost torchrun
ends the run (its ranks get SIGTERM by PDEATHSIG and drain: the step and its checkpoint finish), so the second
command resumes it.

    RLHF_CHAOS_RUNS=20 RLHF_CHAOS_SEED=0 pytest -m slow tests/test_chaos.py   (the kill lands once steps.csv has N rows)
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlhf.services.metaserver import SHM_PREFIX, shm_root
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port, wait_for_rows

VICTIMS = ("torchrun", "train-0", "train-1", "scheduler", "rollout-0", "rollout-1")
STEPS = 10


def command(run_dir):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"{ROOT}/examples/grpo_trainer.py", "--preset",
            "smoke", "--rollout.servers", "2", "--steps", str(STEPS), "--sft.max_steps", "0", "--run-dir",
            str(run_dir)]


def find(victim, agent):
    """The live process playing `victim` under torchrun's agent, or None."""
    if victim == "torchrun":
        return agent
    for proc in agent.children(recursive=True):
        try:
            cmd = proc.cmdline()
            if victim.startswith("train-") and "examples/grpo_trainer.py" in " ".join(cmd) \
                    and proc.environ().get("RANK") == victim[-1]:
                return proc
            if victim == "scheduler" and "rlhf.services.scheduler" in cmd:
                return proc
            if victim.startswith("rollout-") and "rlhf.services.rollout_server" in cmd \
                    and cmd[cmd.index("--rank") + 1] == victim[-1]:
                return proc
        except (psutil.Error, ValueError, IndexError):
            continue
    return None


def dead_shm_folders():
    left = []
    for name in os.listdir(shm_root()):
        if name.startswith(SHM_PREFIX) and not psutil.pid_exists(int(name[len(SHM_PREFIX):].split("-", 1)[0])):
            left.append(name)
    return left


def says_why(run_dir):
    """The controller's last word: the first failure, or (torchrun killed: its ranks drain on PDEATHSIG's SIGTERM)
    the step it stopped after."""
    log = run_dir / "logs" / "controller-0.log"
    text = log.read_text() if log.exists() else ""
    return "first failure of this run" in text or "on SIGTERM, its checkpoint written; resume with" in text


@pytest.mark.slow
def test_kill_9_of_a_random_process_at_a_random_step_and_the_run_still_finishes(tmp_path):
    runs = int(os.environ.get("RLHF_CHAOS_RUNS", "20"))
    rng = random.Random(int(os.environ.get("RLHF_CHAOS_SEED", "0")))
    victims = [VICTIMS[i % len(VICTIMS)] for i in range(runs)]  # each kind at least once from 6 runs on
    rng.shuffle(victims)
    outcomes = []
    for i, victim in enumerate(victims):
        at = rng.randint(2, STEPS - 3)
        run_dir = tmp_path / f"run{i}-{victim}-step{at}"
        proc = subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            wait_for_rows(run_dir, at, proc)
            target = find(victim, psutil.Process(proc.pid))
            assert target is not None, f"run {i}: no live {victim} at step {at}"
            target.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            code = proc.wait(timeout=240)
            ended = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
        assert_none_left(run_dir)
        again = None
        if code != 0:
            # what did not survive ends fast, and says why where anything of ours outlived the kill
            assert ended <= 15, f"run {i} ({victim} at step {at}) took {ended:.1f} s to exit"
            if victim != "train-0":  # a SIGKILLed controller writes nothing; torchrun names it
                assert says_why(run_dir), f"run {i} ({victim} at step {at}): no first-failure line"
            again = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=240, cwd=ROOT)
            assert_none_left(run_dir)
            assert again.returncode == 0, f"run {i} ({victim} at step {at}) did not resume: {again.stderr[-2000:]}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS, (i, victim, at, summary)
        assert not dead_shm_folders()
        outcomes.append((victim, at, code, round(ended, 1), summary.get("world_restarts", 0), again is not None))
    print("\n".join(f"{v:10s} killed at step {a}: exit {c} after {e} s, world restarts {w}, second command {s}"
                    for v, a, c, e, w, s in outcomes))
