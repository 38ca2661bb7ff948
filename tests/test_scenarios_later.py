"""Scenarios 4 and 6–9 (and 2 and 7 hardened), run with 2 train ranks and 2 rollout servers: each checks, from the
run directory only (logs, markers, traces, metrics), that the fault in one stage surfaces where the scenario says —
and that no process of the run is left. The helpers are test_scenarios.py's."""

import json
import re

import pytest

from rlhf.analysis import measure_run
from rlhf.diagnosis import diagnose
from tests.test_scenarios import assert_diagnosed, log_lines, markers, run_scenario, stamp, steps_rows


def metrics_rows(run_dir, name):
    import csv

    with open(run_dir / "metrics" / f"{name}.csv") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario4_lost_colocation_event_leaves_device0_idle_then_fails_three_stages_later(tmp_path):
    run_dir, out = run_scenario(tmp_path, 4)
    assert out.returncode != 0
    controller = log_lines(run_dir, "controller-0")
    lost = [line for line in controller if " WARNING " in line and "event rollout_start to" in line
            and "not delivered" in line]
    assert sorted(re.search(r"to (\w+-0) not", line).group(1) for line in lost) == ["rollout-0", "train-0"]
    assert all("step 3:" in line for line in lost)
    timed_out = next(line for line in controller if "rollout-0 timed out" in line)
    t_lost, t_timeout = stamp(lost[0]), stamp(timed_out)
    assert 8.0 <= t_timeout - t_lost <= 13.0  # the rollout stage ran its whole (scaled) timeout
    oom = [line for line in log_lines(run_dir, "rollout-0", "ERROR")
           if "out of memory" in line and "held by train-0" in line and t_lost <= stamp(line) <= t_timeout]
    assert len(oom) >= 5  # rollout-0 kept retrying on a device train-0 never released
    for who in ("train-0", "rollout-0"):  # nobody computes on device 0 meanwhile
        window = [float(r["cpu_percent"]) for r in metrics_rows(run_dir, who)
                  if t_lost + 1.5 <= float(r["time"]) <= t_timeout - 0.5]
        assert len(window) >= 5 and sum(window) / len(window) < 20.0, (who, window)
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage reference: InvalidTensorShape" in first
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("events", "controller-0", "reference")
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("events", "controller-0", "reference")
    assert_diagnosed(run_dir, "controller-0", "events", "timeout")  # the events never reached train-0 or rollout-0


def test_scenario6_rollout_side_device_leak_fails_the_train_sides_next_upload(tmp_path):
    run_dir, out = run_scenario(tmp_path, 6)
    assert out.returncode != 0
    leak = next(m for m in markers(run_dir) if m["event"] == "inject")
    assert (leak["role"], leak["rank"], leak["peer"], leak["step"]) == ("rollout", 0, "rollout_end", 3)
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 4, stage weights_update" in first and "HTTP 500 from train-0" in first  # names the train side
    errors = sorted((stamp(line), name, line) for name in ("train-0", "train-1", "rollout-0", "rollout-1")
                    for line in log_lines(run_dir, name, "ERROR"))
    t, who, line = errors[0]  # the first error anywhere: train-0's upload, a step after the leak
    assert who == "train-0" and "upload_weights" in line and "CUDA out of memory" in line
    assert "reserved by another process" in line
    assert not [e for e in errors if e[1].startswith("rollout") and e[0] <= t]  # the rollout side noticed nothing
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("events", "rollout-0", "weights_update")
    assert not list((run_dir / "devices").glob("*.leak.json"))  # the ledger entry went with the run
    assert not list((run_dir / "devices").glob("*.leak.json"))  # the ledger entry went with the run
    assert_diagnosed(run_dir, "rollout-0", "events", "oom_device")  # the holder, from its heartbeat


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario7_rollout_timeout_keeps_aborted_samples_and_reference_fails_on_their_shape(tmp_path):
    run_dir, out = run_scenario(tmp_path, 7)
    assert out.returncode != 0
    controller = log_lines(run_dir, "controller-0")
    kept = next(line for line in controller if "rollout-1 timed out" in line)
    assert "step 3:" in kept and "as aborted (no tokens)" in kept
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage reference: InvalidTensorShape" in first and "has shape [0]" in first
    assert "rollout-1" not in first  # the error does not name the slow server
    delayed = next(m for m in markers(run_dir) if m["event"] == "inject")
    assert (delayed["role"], delayed["rank"], delayed["peer"], delayed["step"]) == ("rollout", 1, "/generate", 3)
    assert 5.0 <= stamp(first) - delayed["time"] <= 9.0  # about rollout_timeout_s (6 s) after the delay began
    assert log_lines(run_dir, "rollout-1", "ERROR") == []  # the slow server itself never failed
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("rollout", "rollout-1", "reference")
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("rollout", "rollout-1", "reference")
    assert_diagnosed(run_dir, "rollout-1", "rollout", "timeout")  # still inside /generate


@pytest.mark.slow
@pytest.mark.parametrize("n, cause, category", [(2, "RpcConnectionError", "process_death"), (7, "RpcTimeout", "timeout")])
def test_scenarios_2_and_7_hardened_migrate_the_failed_servers_groups_and_finish(tmp_path, n, cause, category):
    """migrate_requests: rollout-1 SIGKILLed mid-rollout (2) or not answering within rollout_timeout_s (7): its
    groups are generated on rollout-0, the step keeps its full batch, and the run finishes every step."""
    import csv

    run_dir, out = run_scenario(tmp_path, n, "--resilience", "hardened")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == summary["steps"] == (5 if n == 2 else 4)
    assert [int(r["rollout_migrated"]) for r in rows][2] == 128 and sum(int(r["rollout_migrated"]) for r in rows) == 128
    assert {int(r["batch_size"]) for r in rows} == {256}  # the full batch every step
    moved = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "migrating" in line]
    assert len(moved) == 1 and "step 3:" in moved[0] and f"of rollout-1 ({cause}" in moved[0] and "to rollout-0" in moved[0]
    if n == 2:  # the dead server is started again before step 4
        assert [int(r["rollout_restarts"]) for r in rows] == [0, 0, 0, 1, 0]
    d = diagnose(str(run_dir))  # survived, and still on record
    assert d.verdict == "finished with errors"
    assert (d.root.process, d.root.stage, d.root.step, d.root.category) == ("rollout-1", "rollout", 3, category)


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario8_truncated_reference_reply_fails_train_in_the_kl_term(tmp_path):
    run_dir, out = run_scenario(tmp_path, 8)
    assert out.returncode != 0
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3, stage train" in first and "HTTP 500 from train-1" in first
    shape = [line for line in log_lines(run_dir, "train-1", "ERROR") if "must match the size of tensor" in line]
    assert shape and "/train_step" in shape[0]
    row = measure_run(str(run_dir), out.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("reference", "train-1", "train")
    assert_diagnosed(run_dir, "train-1", "reference", "data_mismatch")  # sent and received shapes differ


def test_scenario8_hardened_checksums_reject_the_reply_where_it_arrives_and_the_retry_survives(tmp_path):
    run_dir, out = run_scenario(tmp_path, 8, "--resilience", "hardened")
    assert out.returncode == 0, out.stderr[-2000:]  # /compute_logprobs is idempotent: sent again, the run finishes
    retry = [line for line in log_lines(run_dir, "controller-0", "WARNING") if "retrying POST /compute_logprobs" in line]
    assert len(retry) == 1 and "to train-1" in retry[0] and "CorruptPayload" in retry[0] and "checksum" in retry[0]
    assert "attempt 2 of 3" in retry[0]
    assert not any("must match the size" in line for line in log_lines(run_dir, "train-1"))  # train never ran on it
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 4
    d = diagnose(str(run_dir))  # survived, and still on record: what was retried, where, and why
    assert d.verdict == "finished with errors"
    assert (d.root.process, d.root.stage, d.root.step, d.root.category) == ("train-1", "reference", 3, "data_mismatch")


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario9_io_hang_in_a_periodic_save_breaks_the_restart_after_a_crash(tmp_path):
    run_dir, first_run = run_scenario(tmp_path, 9)
    assert first_run.returncode != 0
    assert not any("run failed" in line for line in log_lines(run_dir, "controller-0"))  # a crash, no diagnosis
    hang = next(m for m in markers(run_dir) if m["fault"] == "io-hang-in-periodic-save" and m["event"] == "inject")
    assert hang["step"] == 2 and hang["context"]["written"] < hang["context"]["size"]
    slot = run_dir / "checkpoints" / "periodic" / "step_2"
    assert json.loads((slot / "meta.json").read_text())["complete"] is True  # it claims to be whole ...
    assert (slot / "model.safetensors").stat().st_size == hang["context"]["written"]  # ... at half its size
    _, restart = run_scenario(tmp_path, 9)  # the same command again: resume
    assert restart.returncode != 0
    failed = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "run failed: resume: " in failed
    assert any("SafetensorError" in line for line in log_lines(run_dir, "train-0", "ERROR"))
    assert stamp(failed) - hang["time"] > 5.0  # found a crash and a restart after the cause (two steps, a restart)
    row = measure_run(str(run_dir), restart.returncode)
    assert (row["fault_stage"], row["target"], row["error_stage"]) == ("periodic_recover_save", "train-0", "resume")
    assert_diagnosed(run_dir, "train-0", "periodic_recover_save", "hang")  # the save that never finished


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_scenario9_hardened_abandons_the_stuck_save_and_a_restarted_world_finishes(tmp_path):
    """abandon_stuck_saves + torchrun --max-restarts 1: train-0's periodic save at step 2 stops half-way; the rank
    answers CheckpointWriteStalled after checkpoint.write_stall_s and the step goes on; the SIGKILL of train-0 at
    step 4 ends that world, torchrun starts another, which finds no valid checkpoint (step 2's was discarded),
    starts over in the same run directory and finishes, its faults not firing again at the steps they hit."""
    from rlhf.checkpoint import slots as ckpt

    run_dir, out = run_scenario(tmp_path, 9, "--resilience", "hardened", torchrun_args=("--max-restarts=1",))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = steps_rows(run_dir)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 1, 2, 3, 4, 5, 6]  # the first world died in step 4
    assert [int(r["saves_failed"]) for r in rows] == [0, 1, 0, 0, 0, 0, 0, 0, 0]
    warned = log_lines(run_dir, "controller-0", "WARNING")
    stalled = [line for line in warned if "CheckpointWriteStalled" in line]
    assert len(stalled) == 1 and "step 2: periodic_recover_save" in stalled[0] and "no progress for 4 s" in stalled[0]
    assert sum("torchrun restarted this run's workers (restart 1 of 1" in line for line in warned) == 1
    injected = [m["fault"] for m in markers(run_dir) if m["event"] == "inject"]
    assert sorted(injected) == ["crash-two-steps-later", "io-hang-in-periodic-save"]  # once each in the run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_restarts"] == 1 and summary["steps"] == 6
    for step in (2, 4, 6):  # written by the second world, checksums intact
        assert ckpt.verify_slot(str(run_dir / "checkpoints" / "periodic" / f"step_{step}"), check_sums=True)
    assert not list((run_dir / "checkpoints").glob(".staging-*"))
