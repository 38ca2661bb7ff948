"""The resilience policy: presets, one behaviour switched alone, recorded in config.yaml, seen by every process."""

import dataclasses
import json
import time

import pytest
import yaml

from rlhf.cli_args import make_parser, parse_config
from rlhf.config import ConfigError, build_config
from rlhf.config.resilience import FAITHFUL, HARDENED, Policy


def parse(*argv):
    return parse_config(list(argv), make_parser("t", "t"))[0]


def test_presets_set_every_behaviour_and_differ_in_all_of_them():
    behaviours = Policy.behaviours()
    assert len(behaviours) >= 8 and "preset" not in behaviours
    assert all(getattr(HARDENED, b) for b in behaviours) and not any(getattr(FAITHFUL, b) for b in behaviours)
    assert build_config().resilience == HARDENED  # the default run is hardened


def test_one_behaviour_switched_on_top_of_a_preset():
    cfg = parse("--resilience", "hardened", "--resilience.first_failure_ledger", "false")
    assert cfg.resilience == dataclasses.replace(HARDENED, first_failure_ledger=False)
    assert cfg.resilience.describe() == "hardened with first_failure_ledger off"
    cfg = parse("--resilience", "faithful", "--resilience.atomic_checkpoints")  # a bare flag means true
    assert cfg.resilience.changed() == {"atomic_checkpoints": True} and not cfg.resilience.typed_errors


def test_a_preset_resets_what_came_before_it_and_later_keys_win():
    # a scenario file picks faithful; the command line then picks hardened: every behaviour follows
    cfg = build_config(scenario=[("resilience.preset", "faithful")], dotted=[("resilience.preset", "hardened")])
    assert cfg.resilience == HARDENED
    cfg = build_config(scenario=[("resilience.preset", "faithful")], dotted=[("resilience.typed_errors", "true")])
    assert cfg.resilience.preset == "faithful" and cfg.resilience.changed() == {"typed_errors": True}


def test_config_yaml_records_the_resolved_policy_and_reads_back_the_same(tmp_path):
    cfg = parse("--resilience", "faithful", "--resilience.stage_checksums", "true")
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    written = yaml.safe_load(path.read_text())["resilience"]
    assert written["preset"] == "faithful" and written["stage_checksums"] is True and written["typed_errors"] is False
    assert set(written) == {"preset", *Policy.behaviours()}
    assert build_config(config_file=str(path)).resilience == cfg.resilience  # what every other process reads


@pytest.mark.parametrize("argv, message", [
    (["--resilience.preset", "strict"], "resilience.preset: 'strict' is not valid; choose one of: faithful, hardened"),
    (["--resilience.first_failure", "true"], "did you mean 'resilience.first_failure_ledger'"),
    (["--resilience.typed_errors", "maybe"], "resilience.typed_errors: expected a boolean"),
    (["--runtime.resilience", "faithful", "--resilience.preset", "hardened"],
     "'runtime.resilience' has moved to 'resilience.preset', and both are given"),
])
def test_bad_resilience_input_names_the_key_and_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_a_moved_key_still_works_with_one_deprecation_line(tmp_path, caplog):
    """An old name (flag or YAML) is read in its new place, saying so once; the file it came from is not changed."""
    with caplog.at_level("WARNING", logger="rlhf.config"):
        assert parse("--runtime.resilience", "faithful").resilience == FAITHFUL
    moved = [r.getMessage() for r in caplog.records if "has moved" in r.getMessage()]
    assert moved == ["config key runtime.resilience has moved to resilience.preset: read as resilience.preset "
                     "faithful (the old name will go)"]
    path = tmp_path / "old.yaml"
    path.write_text("runtime: {resilience: faithful, rpc_timeout_s: 7}\n")
    cfg = build_config(config_file=str(path))
    assert cfg.resilience == FAITHFUL and cfg.timeouts.rpc_s == 7
    assert "resilience: faithful" in path.read_text()


def test_help_lists_every_behaviour_with_its_doc(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for b in Policy.behaviours():
        assert f"--resilience.{b} BOOL" in out
    assert "first failure" in out


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HARDENED.typed_errors = False  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Policy(preset="nope")


def _smoke_run_survives(tmp_path, faults_yaml, steps):
    """A 2-server smoke run with these faults; it must finish (exit 0) and leave nothing behind. Returns
    (run_dir, the controller's log)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.test_runtime import assert_none_left

    spec = tmp_path / "faults.yaml"
    spec.write_text(faults_yaml)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps",
                          str(steps), "--rollout.servers", "2", "--sft.max_steps", "0", "--run-dir", str(run_dir),
                          "--faults", str(spec)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, (run_dir / "logs" / "controller-0.log").read_text()


@pytest.mark.slow  # 40 steps; a scheduler killed mid-rollout, restarted with both servers, is in the default suite
def test_a_killed_scheduler_is_started_again_with_its_rollout_servers_and_the_run_finishes(tmp_path):
    """restart_rollout: the scheduler is SIGKILLed while it answers the controller's GET /jobs at the start of a
    step (its rollout servers die with it, PDEATHSIG); the controller starts a new scheduler, which starts both
    servers again, they get that step's weights, and the run finishes. Faults fire once per run: the new scheduler
    is not killed again."""
    import csv

    run_dir, log = _smoke_run_survives(tmp_path, "faults:\n  - name: kill-scheduler\n    kind: process_kill\n"
                                       "    point: rpc.server.handle\n    target: {role: scheduler, peer: /jobs}\n"
                                       "    when: {after_s: 4, max_hits: 1}\n    params: {signal: KILL}\n", 40)
    gone = [line for line in log.splitlines() if "scheduler-0 (pid" in line and "is gone" in line]
    assert len(gone) == 1 and "SIGKILL" in gone[0] and " WARNING " in gone[0], log[-3000:]
    step = int(gone[0].split("step ")[1].split(":")[0])
    with open(run_dir / "steps.csv") as fh:
        rows = {int(r["step"]): r for r in csv.DictReader(fh)}
    assert int(rows[step]["rollout_restarts"]) == 2 and rows[step]["weights_verified"] in ("True", "1", "true")
    assert sum(int(r["rollout_restarts"]) for r in rows.values()) == 2 and len(rows) == 40
    assert " ERROR " not in log  # a death the run survived is a WARNING
    injected = [json.loads(line) for line in (run_dir / "faults" / "markers.jsonl").read_text().splitlines()]
    assert sum(m["event"] == "inject" for m in injected) == 1


def test_a_scheduler_killed_mid_rollout_takes_both_servers_and_the_step_is_generated_again(tmp_path):
    """restart_rollout: both rollout servers hang in step 3's /generate; the test SIGKILLs the scheduler then, so both
    die with it (PDEATHSIG) mid-rollout and no server is left to migrate to. The controller starts a new scheduler
    and both servers, gives them step 3's weights, generates the step's prompts again, and the run finishes with
    full batches and no world restart."""
    import csv
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT
    from tests.test_runtime import assert_none_left

    spec = tmp_path / "hang.yaml"
    spec.write_text("faults:\n  - name: hang-rollout\n    kind: hang\n    point: rollout.generate\n"
                    "    target: {role: rollout}\n    when: {step: 3}\n    duration_s: 60\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "5",
                             "--rollout.servers", "2", "--sft.max_steps", "0", "--run-dir", str(run_dir), "--faults",
                             str(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        markers = run_dir / "faults" / "markers.jsonl"
        deadline = time.monotonic() + 180
        while not (markers.exists() and markers.read_text().count('"event": "inject"') >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the rollout servers never hung in step 3"
            time.sleep(0.05)
        scheduler = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "rlhf.services.scheduler" in p.cmdline()]
        assert len(scheduler) == 1, scheduler
        scheduler[0].kill()
        _out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_none_left(run_dir)
    assert proc.returncode == 0, err[-3000:]
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "went down during the rollout" in log and "generating the step's prompts again" in log, log[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["rollout_restarts"]) for r in rows] == [0, 0, 2, 0, 0]
    assert len({r["batch_size"] for r in rows}) == 1 and all(r["weights_verified"] in ("True", "true", "1") for r in rows)
    assert " ERROR " not in log


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGKILL", marks=pytest.mark.slow)])  # SIGKILL: ~25 s
def test_sigterm_to_the_run_finishes_its_step_and_checkpoint_and_the_same_command_resumes(sig, tmp_path):
    """An operator's (or a cluster scheduler's) SIGTERM to torchrun reaches every rank: the controller finishes the
    running step and its checkpoint, rank 1 serves it until the controller shuts it down, every process stops, the
    run exits non-zero saying how to resume, and that command resumes after the drained step.

    SIGKILL to torchrun: the ranks get SIGTERM from the kernel (PDEATHSIG), once per thread of the dying torchrun
    that had adopted them; the repeats must not count as an operator's second SIGTERM (which stops at once)."""
    import signal
    import subprocess

    from rlhf.checkpoint import slots as ckpt
    from tests.conftest import ROOT
    from tests.test_runtime import assert_none_left, steps, torchrun, wait_for_rows

    run_dir = tmp_path / "run"
    cmd = torchrun(run_dir, "--steps", "15", "--sft.max_steps", "0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for_rows(run_dir, 3, proc)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_none_left(run_dir)
    assert proc.returncode != 0
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert " ERROR " not in log, log[-3000:]
    drained = [int(r["step"]) for r in steps(run_dir)][-1]
    assert 3 <= drained < 15
    assert f"received SIGTERM during step {drained}: finishing it and its checkpoint" in log
    assert f"stopped after step {drained} on SIGTERM, its checkpoint written; resume with: " in log
    assert ckpt.newest_checkpoint(str(run_dir / "checkpoints"))[1]["step"] == drained
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {drained}" in next(line for line in (run_dir / "logs" / "controller-0.log").read_text()
                                       .splitlines() if "resumed from" in line)
    assert [int(r["step"]) for r in steps(run_dir)] == list(range(1, 16))


@pytest.mark.slow(reason="suite time (55 s): scenario 9 hardened (tests/test_scenarios_later.py) runs a torchrun world "
                         "restart to its finish by default; the checkpoint's RNG round trip is tests/test_checkpoint.py's")
def test_a_world_torchrun_restarts_resumes_and_continues_the_uninterrupted_run_exactly(tmp_path):
    """torchrun --max-restarts 1: train-1 SIGKILLed in step 3 ends the world, torchrun starts another in the same run
    directory (its c10d keys under a new prefix), which resumes from step 2's checkpoint, the fault not firing again.
    The checkpoint keeps the rollout servers' sampling RNG: steps 3-6 equal those of a run that was never killed."""
    import csv
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.test_runtime import SMOKE, assert_none_left, free_port

    spec = tmp_path / "kill.yaml"
    spec.write_text("faults:\n  - name: kill-rank1\n    kind: process_kill\n    point: train.step\n"
                    "    target: {role: train, rank: 1}\n    when: {step: 3}\n    params: {signal: KILL}\n")

    def run(name, *extra):
        run_dir = tmp_path / name
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
                              "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                              f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir), *SMOKE, "--steps", "6",
                              *extra], capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert_none_left(run_dir)
        assert out.returncode == 0, out.stderr[-3000:]
        with open(run_dir / "steps.csv") as fh:
            return run_dir, {int(r["step"]): r for r in csv.DictReader(fh)}

    killed_dir, killed = run("killed", "--faults", str(spec))
    _, whole = run("whole")
    log = (killed_dir / "logs" / "controller-0.log").read_text()
    assert "torchrun restarted this run's workers (restart 1 of 1" in log and "at step 2" in log
    assert json.loads((killed_dir / "summary.json").read_text())["world_restarts"] == 1
    columns = ("response_length", "entropy", "loss", "kl", "rollout_tokens")
    assert [[killed[s][c] for c in columns] for s in range(3, 7)] == [[whole[s][c] for c in columns]
                                                                      for s in range(3, 7)]


@pytest.mark.slow(reason="suite time (23 s): tests/test_async.py's server killed as the step's weights update "
                         "pauses it runs the same restart inside weights_update by default")
def test_a_rollout_server_killed_during_the_weights_update_is_started_again_and_updated(tmp_path):
    """restart_rollout: rollout-1 is SIGKILLed while it serves step 3's /update_weights_from_meta (after that step's
    health check); the update fails on it, the controller starts it again and updates once more, and the run
    finishes with every step's weights verified."""
    import csv
    run_dir, log = _smoke_run_survives(tmp_path, "faults:\n  - name: kill-rollout1\n    kind: process_kill\n"
                                       "    point: rpc.server.handle\n    target: {role: rollout, rank: 1, peer: "
                                       "/update_weights_from_meta}\n    when: {step: 3}\n    params: {signal: KILL}\n", 5)
    assert "step 3: rollout-1 went down during the weights update" in log, log[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["rollout_restarts"]) for r in rows] == [0, 0, 1, 0, 0]
    assert all(r["weights_verified"] in ("True", "true", "1") for r in rows)


def test_a_warm_start_longer_than_the_rpc_timeout_goes_on_and_sigterm_ends_it_within_seconds(tmp_path):
    """timeouts.rpc_s 3 s: the SFT warm start (one long call on the rank) is judged by its progress, so it is still
    running 5 s in (before: RpcTimeout at 3 s); SIGTERM to torchrun then ends it before its next step and the run
    stops within seconds instead of waiting 30 s for the call. A warm start that stops moving fails with NoProgress:
    test_a_long_call_fails_once_no_rank_moves_for_its_progress_time."""
    import signal
    import subprocess

    from tests.conftest import ROOT
    from tests.test_runtime import assert_none_left, torchrun

    run_dir = tmp_path / "run"
    cmd = torchrun(run_dir, "--steps", "2", "--timeouts.rpc_s", "3", "--sft.max_steps", "100000",
                   "--sft.stop_in_band", "false", "--sft.eval_every", "100000", nproc=1)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics = run_dir / "metrics" / "train-0.csv"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and "sft_warm_start" in metrics.read_text()):  # the rank is in its warm start
            assert proc.poll() is None and time.monotonic() < deadline, "the warm start never began"
            time.sleep(0.1)
        began = time.monotonic()
        while time.monotonic() - began < 5.0:  # past rpc_s: the call goes on while it progresses
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        ended_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_none_left(run_dir)
    assert proc.returncode != 0
    assert ended_s < 15.0, (ended_s, err[-2000:])
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "warm start interrupted after sft step" in logs and "still running at shutdown" not in logs, logs[-3000:]
    assert "NoProgress" not in logs and "RpcTimeout" not in logs


def test_a_long_call_fails_once_no_rank_moves_for_its_progress_time():
    """WorkerGroup's progress-judged call: it lives while a rank's heartbeat moves (its step, or a quarter of a core
    of CPU between two reads), and fails with NoProgress naming the rank and its last heartbeat once none has for
    progress_s; a rank whose background threads use a little CPU is not moving."""
    import asyncio

    from rlhf.control.workers import WorkerGroup
    from rlhf.errors import NoProgress
    from rlhf.transport.client import LoopThread

    loop = LoopThread()
    group = WorkerGroup(["http://127.0.0.1:9", "http://127.0.0.1:10"], "tok", loop, 60.0)
    reads = []

    def beats(moving_reads):
        async def read(timeout_s=2.0):
            reads.append(None)
            n = len(reads)
            step = min(n, moving_reads)  # the step advances for the first reads, then stops
            return [{"phase": "sft warm start", "step": step, "cpu_s": 5.0 + 0.001 * n},
                    {"phase": "sft warm start", "step": step, "cpu_s": 5.0}]
        return read

    try:
        group.heartbeats = beats(20)
        t0 = time.monotonic()
        with pytest.raises(NoProgress, match=r"no progress from train-0 .* within 0.4 s \(its heartbeat unchanged: "
                                             r"sft warm start at step 20"):
            loop.run(group._progress([0, 1], "sft_warm_start", 0.4))
        assert len(reads) >= 20 and time.monotonic() - t0 >= 0.4  # alive while it stepped
        reads.clear()

        group.heartbeats = beats(10**6)  # always stepping: never NoProgress
        watch = asyncio.run_coroutine_threadsafe(group._progress([0, 1], "sft_warm_start", 0.2), loop.loop)
        time.sleep(0.6)
        assert not watch.done()
        watch.cancel()
    finally:
        loop.close()
