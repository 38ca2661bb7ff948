"""The seed plan's scenarios 1, 3, 5 and 10 and the sync stall (4 and 6–9: test_scenarios_later.py; 2: the README's
tour in test_commands.py, through benchmarks/scenarios.py), with 2 train ranks and 2 rollout servers.

Each test runs `torchrun ... --faults examples/faults/scenarioN.yaml` and checks, from the run
directory only (logs, markers, traces), that the fault in one stage surfaces where the scenario
says — and that no process of the run is left.
"""

import datetime as dt
import json
import re
import subprocess
import sys

import pytest

from rlhf.analysis import WATCHDOG_REPORT_ONLY, measure_run
from rlhf.diagnosis import diagnose
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port


def run_scenario(tmp_path, n, *extra, script="grpo_trainer.py", torchrun_args=()):
    """n: the scenario number, or the fault file's name (sync_stall).

    GRPO runs skip the SFT warm start (--sft.max_steps 0): no scenario's fault acts during it, and its 60
    steps end below the band on these few steps anyway; the files themselves keep it, as users run them."""
    name = f"scenario{n}" if str(n).isdigit() else str(n)
    run_dir = tmp_path / name
    warm = ["--sft.max_steps", "0"] if script == "grpo_trainer.py" and "--sft.max_steps" not in extra else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *torchrun_args, f"{ROOT}/examples/{script}", "--run-dir", str(run_dir),
           "--faults", f"{ROOT}/examples/faults/{name}.yaml", *warm, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    return run_dir, out


def log_lines(run_dir, name, level=None):
    """A process's log lines as the seeds' system would have written them: without our diagnosis (its root-cause
    lines and where-to-look block, which assert_diagnosed checks)."""
    lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
    ours = (" rlhf.diagnosis: ", " rlhf.controller: evidence: ", " rlhf.controller: logs: ", WATCHDOG_REPORT_ONLY)
    return [line for line in lines if (level is None or f" {level} " in line) and not any(o in line for o in ours)]


def stamp(line):
    return dt.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def markers(run_dir):
    with open(run_dir / "faults" / "markers.jsonl") as fh:
        return [json.loads(line) for line in fh]


def assert_diagnosed(run_dir, process, stage, category):
    """`rlhf diagnose` names the fault's process, stage and category from the evidence alone (the markers are not
    read), and the run itself printed the same root cause as its last log line."""
    d = diagnose(str(run_dir))
    assert d.root is not None, d.render()
    assert (d.root.process, d.root.stage, d.root.category) == (process, stage, category), d.render()
    last = (run_dir / "logs" / "controller-0.log").read_text().splitlines()[-1]
    assert " rlhf.diagnosis: root cause: " in last and f"root cause: {process}" in last, last
    return d


def test_scenario1_slow_upload_surfaces_as_rollout_update_failures(tmp_path):
    run_dir, out = run_scenario(tmp_path, 1)
    assert out.returncode != 0
    inject = next(m for m in markers(run_dir) if m["fault"] == "slow-path-rank1-to-metaserver" and m["event"] == "inject")
    assert (inject["role"], inject["rank"], inject["step"]) == ("train", 1, 3)
    errors = log_lines(run_dir, "controller-0", "ERROR")
    first = next(line for line in errors if "run failed" in line)
    assert "stage weights_update" in first and "rollout-" in first and "HTTP 500" in first  # names the rollout side
    assert "train-1" not in first
    for r in (0, 1):  # every rollout server's update failed, ~update_timeout_s after the upload began
        failed = [line for line in log_lines(run_dir, f"rollout-{r}", "ERROR") if "update_weights_from_meta" in line]
        assert failed, f"rollout-{r} did not fail its update"
        assert 6.0 <= stamp(failed[0]) - inject["time"] <= 14.0
        assert "incomplete" in failed[0] or "504" in failed[0]
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("weights_update", "train-1", "weights_update")
    assert row["processes_with_errors"].split()[0].startswith("rollout-")  # the first error is not at the cause
    assert 6.0 <= row["surfaced_error_time_s"] <= 14.0
    assert_diagnosed(run_dir, "train-1", "weights_update", "timeout")  # still inside its upload


def test_scenario3_oom_is_hidden_behind_the_last_error_a_stop_job_timeout(tmp_path):
    run_dir, out = run_scenario(tmp_path, 3)
    assert out.returncode != 0
    oom = [line for line in log_lines(run_dir, "train-1", "ERROR") if "out of memory" in line]
    assert oom, "the OOM must be in train rank 1's log"
    for other in ("controller-0", "train-0", "rollout-0", "rollout-1", "scheduler-0"):
        assert not any("out of memory" in line for line in log_lines(run_dir, other)), other
    errors = log_lines(run_dir, "controller-0", "ERROR")
    assert any("run failed" in line and "HTTP 500" in line and "train-1" in line for line in errors)
    last = errors[-1]
    assert re.search(r"stop job.*RpcTimeout|RpcTimeout.*jobs/rollout", last), last
    gap = stamp(last) - stamp(oom[0])
    assert 4.0 <= gap <= 12.0, gap  # about cleanup_timeout_s (5 s) after the OOM
    row = measure_run(str(run_dir), out.returncode)
    assert row["fault_stage"] == "train" and "stop job: RpcTimeout" in row["last_error_line"]
    from matplotlib import image

    from rlhf.report import report_main

    assert report_main([str(run_dir)]) == 0
    for name in ("propagation.png", "target_metrics.png"):
        img = image.imread(run_dir / "report" / name)
        assert img.shape[0] > 200 and img.shape[1] > 800 and img.std() > 0.05  # a real picture, not blank
    d = assert_diagnosed(run_dir, "train-1", "train", "oom_device")
    assert any("stop job" in m["message"] for m in d.masked)  # the last error line, ranked below the OOM


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario3_hardened_names_the_oom_first_and_last(tmp_path):
    # the warm start plays no part in this failure path (an OOM in a train step, then slow cleanup): skipped
    run_dir, out = run_scenario(tmp_path, 3, "--resilience", "hardened", "--sft.max_steps", "0")
    assert out.returncode != 0
    errors = log_lines(run_dir, "controller-0", "ERROR")
    first, last = errors[0], errors[-1]
    for line in (first, last):  # typed error: class, who, stage, step — and the ledger repeats it last
        assert "OutOfMemoryError in train-1" in line and "stage train" in line and "CUDA out of memory" in line
    assert "first failure of this run" in last
    assert any("stop job: RpcTimeout" in line for line in errors[1:-1])  # cleanup errors sit in between
    assert any("stop job: RpcTimeout" in line for line in errors[1:-1])  # cleanup errors sit in between
    assert_diagnosed(run_dir, "train-1", "train", "oom_device")


@pytest.mark.slow  # 25 s: the default suite keeps its 15-minute budget; the two presets' scenario 3 runs stay in it
def test_scenario3_hardened_without_the_ledger_ends_on_the_cleanup_timeout_again(tmp_path):
    """One behaviour switched off alone: typed errors still name the OOM first, but without the
    first-failure ledger the last error line is cleanup's again — what the ledger buys, measured."""
    run_dir, out = run_scenario(tmp_path, 3, "--resilience", "hardened", "--resilience.first_failure_ledger", "false",
                                "--sft.max_steps", "0")  # as above: the warm start plays no part here
    assert out.returncode != 0
    config = (run_dir / "config.yaml").read_text()
    assert "first_failure_ledger: false" in config and "typed_errors: true" in config  # the resolved policy
    errors = log_lines(run_dir, "controller-0", "ERROR")
    assert "OutOfMemoryError in train-1" in errors[0] and "stage train" in errors[0]
    assert not any("first failure of this run" in line for line in errors)
    assert re.search(r"stop job.*RpcTimeout", errors[-1]), errors[-1]
    assert "resilience hardened with first_failure_ledger off" in (run_dir / "logs" / "controller-0.log").read_text()


def test_scenario5_full_disk_at_a_save_surfaces_one_step_later_in_weights_update(tmp_path):
    run_dir, out = run_scenario(tmp_path, 5)
    assert out.returncode != 0
    marks = markers(run_dir)
    io = next(m for m in marks if m["fault"] == "heavy-io-on-checkpoint-path" and m["event"] == "verify")
    assert io["details"]["bytes_written"] > 0 and len(io["details"]["pids"]) == 2  # real writers
    full = next(m for m in marks if m["fault"] == "disk-full-during-save" and m["event"] == "inject")
    assert (full["role"], full["rank"], full["point"], full["step"]) == ("train", 0, "checkpoint.write", 3)
    controller = log_lines(run_dir, "controller-0")
    assert any(" WARNING " in line and "step 3: latest_recover_save" in line and "continuing" in line
               for line in controller)  # the save failure is only a warning
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 4, stage weights_update" in first and "rollout-" in first  # one step later, another stage
    corrupt = [line for r in (0, 1) for line in log_lines(run_dir, f"rollout-{r}", "ERROR")]
    assert any("SafetensorError" in line for line in corrupt)
    assert any("No space left on device" in line for line in log_lines(run_dir, "train-0", "ERROR"))
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["error_stage"]) == ("latest_recover_save", "weights_update")
    assert not list((run_dir / "checkpoints").glob(".rlhf-io-*"))  # the writers' files are gone
    assert not list((run_dir / "checkpoints").glob(".rlhf-io-*"))  # the writers' files are gone
    assert_diagnosed(run_dir, "train-0", "latest_recover_save", "disk")  # not the rollout side one step later


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario3_on_the_sft_baseline_surfaces_where_it_happened(tmp_path):
    """The same fault file on SFT (same train workers): no rollout, MetaServer, events or scheduler to hide it."""
    run_dir, out = run_scenario(tmp_path, 3, script="sft_trainer.py")
    assert out.returncode != 0
    assert sorted(p.name for p in (run_dir / "logs").glob("*.log")) == ["controller-0.log", "train-0.log", "train-1.log"]
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["error_stage"]) == ("train", "train")
    errors = log_lines(run_dir, "controller-0", "ERROR")
    assert "train-1" in errors[-1] and "stage train" in errors[-1]  # the last line still points at the faulty rank
    assert not any("stop job" in line for line in errors)  # the RL-only cleanup fault never fires
    assert any("out of memory" in line for line in log_lines(run_dir, "train-1", "ERROR"))
    assert any("out of memory" in line for line in log_lines(run_dir, "train-1", "ERROR"))
    assert_diagnosed(run_dir, "train-1", "train", "oom_device")


def _run_stall(tmp_path, *extra):
    return run_scenario(tmp_path, "sync_stall", *extra, script="sft_trainer.py")


def test_sync_stall_per_rank_clocks_stall_and_the_watchdog_names_the_stuck_rank(tmp_path):
    run_dir, out = _run_stall(tmp_path)
    assert out.returncode != 0
    skew = next(m for m in markers(run_dir) if m["event"] == "verify")
    assert skew["rank"] == 1 and skew["details"]["observed_skew_s"] == pytest.approx(4.0, abs=0.1)
    stall = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "SyncStall" in line)
    m = re.search(r"train-0 has been inside all_reduce\(gradients\) for ([\d.]+) s at its step (\d+) \(loop\), "
                  r"while train-1 is in done at its step (\d+)", stall)
    assert m, stall
    assert 5.0 <= float(m.group(1)) < 9.0  # named within seconds of the watchdog's threshold
    assert int(m.group(2)) == int(m.group(3)) + 1  # rank 0 started one more step than rank 1 finished
    assert_diagnosed(run_dir, "train-1", "train", "hang")  # the rank missing from the collective, not the waiter


@pytest.mark.slow  # a fault-free 12-step SFT run: kept out of the default suite for its time budget
def test_sync_stall_cannot_happen_when_the_controller_decides_the_steps(tmp_path):
    run_dir, out = _run_stall(tmp_path, "--sft.termination", "controller", "--steps", "12")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 12
    assert any(m["fault"] == "clock-ahead-on-rank1" and m["event"] == "verify" for m in markers(run_dir))


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario10_metaserver_failure_shows_on_both_sides_and_not_in_its_own_log(tmp_path):
    run_dir, out = run_scenario(tmp_path, 10)
    assert out.returncode != 0
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage weights_update" in first
    assert re.search(r"HTTP 500 from (rollout|train)-\d", first)  # names a train rank or rollout server, not the cause
    upload = [line for r in (0, 1) for line in log_lines(run_dir, f"train-{r}", "ERROR") if "upload_weights" in line]
    update = [line for r in (0, 1) for line in log_lines(run_dir, f"rollout-{r}", "ERROR")
              if "update_weights_from_meta" in line]
    assert upload and update  # both sides of the relay fail ...
    assert abs(stamp(upload[0]) - stamp(update[0])) < 2.0  # ... at once
    metaserver_errors = [line for line in log_lines(run_dir, "controller-0", "ERROR") if "rlhf.metaserver" in line]
    assert metaserver_errors == []  # the MetaServer itself left no error line
    grow = next(m for m in markers(run_dir) if m["fault"] == "metaserver-memory-growth" and m["event"] == "verify")
    assert grow["details"]["held_bytes"] >= 64 << 20  # real memory in the MetaServer's process
    assert grow["details"]["held_bytes"] >= 64 << 20  # real memory in the MetaServer's process
    assert_diagnosed(run_dir, "metaserver-0", "weights_update", "network")  # blamed by both sides


def steps_rows(run_dir):
    import csv

    with open(run_dir / "steps.csv") as fh:
        return list(csv.DictReader(fh))


def test_scenario10_hardened_falls_back_to_disk_while_the_metaserver_drops_connections(tmp_path):
    """weights_fallback: at steps 3 and 4 every MetaServer request has its connection reset; both updates go
    through disk (written by whichever train rank answered first, rank 1 included) and the run finishes."""
    run_dir, out = run_scenario(tmp_path, 10, "--resilience", "hardened")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = steps_rows(run_dir)
    assert [int(r["weights_fallback"]) for r in rows] == [0, 0, 1, 1]
    assert {int(r["weights_verified"]) for r in rows} == {1}  # every server holds the trainer's checksum
    warned = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "falling back to disk" in line]
    assert [w.split("step ", 1)[1][:2] for w in warned] == ["3:", "4:"]
    assert all("through the MetaServer failed (" in w and "written by train-" in w for w in warned)
    d = diagnose(str(run_dir))  # survived, and still on record
    assert d.verdict == "finished with errors"
    assert (d.root.process, d.root.stage, d.root.step) == ("metaserver-0", "weights_update", 3)


@pytest.mark.slow
def test_scenario1_hardened_slow_upload_falls_back_to_disk_and_finishes(tmp_path):
    """weights_fallback: train-1's upload is held 15 s; the servers' wait for the manifest ends (8 s), train-0
    writes the weights to disk, and train-1 rejoins for the next stage once its upload ends."""
    run_dir, out = run_scenario(tmp_path, 1, "--resilience", "hardened")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = steps_rows(run_dir)
    assert [int(r["weights_fallback"]) for r in rows] == [0, 0, 1, 0] and {r["batch_size"] for r in rows} == {"256"}
    warned = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "falling back to disk" in line]
    assert len(warned) == 1 and "step 3:" in warned[0] and "written by train-0" in warned[0]


@pytest.mark.slow
def test_scenario5_hardened_skips_the_failed_save_and_finishes(tmp_path):
    """skip_failed_saves: the save at step 3 fails with ENOSPC on train-0; its staging folder is removed, the
    newest valid slot stays step 2's, and every later save succeeds."""
    from rlhf.checkpoint import slots as ckpt

    run_dir, out = run_scenario(tmp_path, 5, "--resilience", "hardened")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = steps_rows(run_dir)
    assert [int(r["saves_failed"]) for r in rows] == [0, 0, 1, 0, 0, 0]
    warned = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "skipped, the newest valid" in line]
    assert len(warned) == 1 and "step 3: latest_recover_save to latest_odd failed" in warned[0]
    assert "No space left on device" in warned[0] and "stays latest_even (step 2)" in warned[0]
    assert not list((run_dir / "checkpoints").glob(".staging-*"))
    path, meta = ckpt.newest_checkpoint(str(run_dir / "checkpoints"), check_sums=True)
    assert meta["step"] == 6
