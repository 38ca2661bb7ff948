"""The diagnosis on run directories written here: log lines, exit records and heartbeats as a run leaves them.

Each case is a small incident in the run directory's own formats; the live runs (tests/test_scenarios.py)
check the same analysis on what real faulted runs leave.
"""

import datetime as dt
import json
import subprocess
import sys

from rlhf import exits
from rlhf.diagnosis import categorize, diagnose, write
from rlhf.tracing.metrics import COLUMNS
from tests.conftest import ROOT

T0 = dt.datetime(2026, 11, 23, 12, 0, 0).timestamp()
DEAD_PID = 2**22 + 12345  # above pid_max on this kernel's default: never a live process


def line(t, proc, level, logger, msg):
    stamp = dt.datetime.fromtimestamp(T0 + t).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    return f"{stamp} {proc} {level} {logger}: {msg}\n"


def make_run(tmp_path, logs, lives=(), metrics=None, finished=False):
    """logs: {proc: [(t, level, logger, msg)]}; lives: [(proc, pid, t_start, t_end|None, code, by, expected)]."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics").mkdir()
    for proc, entries in logs.items():
        (run / "logs" / f"{proc}.log").write_text("".join(line(t, proc, *rest) for t, *rest in entries))
    with open(run / "exits.jsonl", "w") as fh:
        for proc, pid, start, end, code, by, expected in lives:
            fh.write(json.dumps({"event": "start", "process": proc, "pid": pid, "time": T0 + start}) + "\n")
            if end is not None:
                fh.write(json.dumps({"event": "exit", "process": proc, "pid": pid, "time": T0 + end, "exit_code": code,
                                     "signal": exits.signal_name(code), "by": by, "expected": expected}) + "\n")
    for proc, rows in (metrics or {}).items():
        with open(run / "metrics" / f"{proc}.csv", "w") as fh:
            fh.write(",".join(COLUMNS) + "\n")
            for row in rows:
                full = {c: "" for c in COLUMNS}
                full.update(row, time=T0 + row["time"])
                fh.write(",".join(str(full[c]) for c in COLUMNS) + "\n")
    if finished:
        (run / "summary.json").write_text("{}")
    return run


FAILED_TRAIN = "run failed: step 3, stage train: HTTPStatusError: HTTP 500 from train-0 (http://x/train_step): 500"


def test_a_killed_server_is_the_root_not_the_batch_mismatch_it_causes_one_stage_later(tmp_path):
    run = make_run(tmp_path, {
        "controller-0": [(10.00, "WARNING", "rlhf.controller", "step 3: rollout-1 failed (RpcConnectionError: cannot "
                                                               "reach rollout-1 (http://x/generate): Server disconnected); "
                                                               "continuing with the samples of the other servers"),
                         (10.05, "ERROR", "rlhf.controller", FAILED_TRAIN),
                         (12.00, "ERROR", "rlhf.controller", "cleanup: stop job: RpcTimeout: no reply from scheduler-0 "
                                                             "(http://x/jobs/rollout-0) within 5 s")],
        "train-0": [(10.04, "ERROR", "rlhf.http", "train-0: POST /train_step failed at step 3: BatchSizeMismatch: "
                                                  "global_rows=128 expected 256")],
        "rollout-1": [(9.90, "WARNING", "rlhf.faults", "fault kill (process_kill) injected at rollout.generate")],
    }, lives=[("rollout-1", DEAD_PID, 1.0, 10.2, -9, "scheduler-0", False),
              ("train-0", DEAD_PID + 1, 0.0, 12.5, 1, "train-0", False)])
    d = diagnose(str(run))
    assert d.verdict == "failed"
    assert (d.root.process, d.root.stage, d.root.step, d.root.category) == ("rollout-1", "rollout", 3, "process_death")
    assert "SIGKILL" in d.root.summary and d.root.source.startswith("exits.jsonl")
    assert d.chain[-1].message.startswith("run failed") and d.chain[0].subject == "rollout-1"
    masked = {m["process"]: m["why"] for m in d.masked}
    assert "after the run had already failed" in masked["controller-0"]  # the cleanup timeout ranks below
    assert "train-0" in masked  # the mismatch is a consequence
    assert all("fault" not in e.message for e in d.root.evidence)  # the injector's own lines are never evidence


def test_the_oom_outranks_the_cleanup_timeout_that_is_the_last_error_line(tmp_path):
    run = make_run(tmp_path, {
        "controller-0": [(5.001, "ERROR", "rlhf.controller", "run failed: step 5, stage train: HTTPStatusError: "
                                                             "HTTP 500 from train-1 (http://x/train_step): 500"),
                         (10.0, "ERROR", "rlhf.controller", "cleanup: stop job: RpcTimeout: no reply from scheduler-0 "
                                                            "(http://x/jobs/rollout-1) within 5 s")],
        "train-1": [(5.0, "ERROR", "rlhf.http", "train-1: POST /train_step failed at step 5: OutOfMemoryError: CUDA out "
                                                "of memory. Tried to allocate 1.50 GiB")],
    })
    d = diagnose(str(run))
    assert (d.root.process, d.root.stage, d.root.step, d.root.category) == ("train-1", "train", 5, "oom_device")
    assert d.root.source.endswith("train-1.log:1")
    assert any(m["process"] == "controller-0" and "scheduler-0" in m["message"] for m in d.masked)
    assert d.headline().startswith("root cause: train-1") and "oom_device" in d.headline()


def test_a_timeout_whose_request_never_arrived_blames_the_sender(tmp_path):
    logs = {"controller-0": [(12.0, "WARNING", "rlhf.controller", "step 3: event rollout_start to train-0 not "
                                                                  "delivered (RpcTimeout: no reply from train-0 "
                                                                  "(http://x/events) within 2 s); continuing"),
                             (30.0, "ERROR", "rlhf.controller", "run failed: step 3, stage reference: "
                                                                "InvalidTensorShape: sample 0 has shape [0]")],
            "rollout-0": [(12.1, "ERROR", "rlhf.rollout_server", "generate: allocating the KV cache failed: device 0: "
                                                                 "out of memory — held by train-0 pid 1")]}
    idle = {"train-0": [{"time": t, "pid": 1, "activity": "idle", "activity_step": 3, "activity_age_s": 1}
                        for t in range(5, 31)]}
    d = diagnose(str(make_run(tmp_path, logs, metrics=idle)))
    assert (d.root.process, d.root.stage, d.root.category) == ("controller-0", "events", "timeout")
    assert abs(d.root.time - (T0 + 10.0)) < 0.01  # the onset: the deadline minus the wait
    assert "never arrived" in d.root.summary
    # the same report, but train-0's heartbeat shows it inside /events: then train-0 is the one that hung
    busy = {"train-0": [{"time": t, "pid": 1, "activity": "POST /events", "activity_step": 3,
                         "activity_age_s": t - 10} for t in range(10, 31)]}
    d = diagnose(str(make_run(tmp_path / "b", logs, metrics=busy)))
    assert (d.root.process, d.root.category) == ("train-0", "timeout")


def _update_failed(body):
    """rollout-0's weights update fails at step 3 on the MetaServer's 504 (`body`), and the run with it."""
    return {"rollout-0": [(8.0, "ERROR", "rlhf.http", "rollout-0: POST /update_weights_from_meta failed at step 3: "
                                                      "HTTPStatusError: HTTP 504 from metaserver-0 (http://x/weights/3/"
                                                      f"manifest): {body}")],
            "controller-0": [(8.01, "ERROR", "rlhf.controller", "run failed: step 3, stage weights_update: "
                                                                "HTTPStatusError: HTTP 500 from rollout-0 (http://x/"
                                                                "update_weights_from_meta): 500")]}


def test_a_straggler_still_inside_its_request_is_named_from_its_heartbeat(tmp_path):
    logs = _update_failed('{"error": "incomplete", "have": ["rank0"], "expected": 2}')
    metrics = {"train-1": [{"time": t, "pid": 7, "activity": "POST /upload_weights", "activity_step": 3,
                            "activity_age_s": t - 0.2} for t in range(1, 9)]}
    d = diagnose(str(make_run(tmp_path, logs, metrics=metrics)))
    assert (d.root.process, d.root.stage, d.root.step) == ("train-1", "weights_update", 3)
    assert d.root.category == "timeout" and "POST /upload_weights" in d.root.summary
    assert d.stalls and "train-1" in d.stalls[0]
    # rank 0's heartbeat may show the MetaServer's long poll for the shards (it shares that process), entered a
    # moment before the upload: a wait the slow uploader causes, never its root
    metrics["train-0"] = [{"time": t, "pid": 6, "activity": "GET /weights/{version}/manifest", "activity_step": 3,
                           "activity_age_s": t - 0.1} for t in range(1, 9)]
    d = diagnose(str(make_run(tmp_path / "with-poll", logs, metrics=metrics)))
    assert (d.root.process, d.root.stage, d.root.step) == ("train-1", "weights_update", 3), d.render()


def test_a_process_that_vanished_without_an_exit_record_was_killed(tmp_path):
    logs = {"train-1": [(4.0, "ERROR", "rlhf.http", "train-1: POST /train_step failed at step 4: RuntimeError: [gloo] "
                                                    "Connection closed by peer [127.0.0.1]:9135")]}
    metrics = {"train-0": [{"time": t, "pid": DEAD_PID, "activity": "POST /train_step", "activity_step": 4,
                            "activity_age_s": 0.1} for t in (1, 2, 3)]}
    run = make_run(tmp_path, logs, lives=[("train-0", DEAD_PID, 0.0, None, None, "", None),
                                          ("train-1", DEAD_PID + 1, 0.0, 4.5, 0, "train-1", False)], metrics=metrics)
    d = diagnose(str(run))
    assert (d.root.process, d.root.category, d.root.step) == ("train-0", "process_death", 4)
    assert "no exit record" in d.root.summary and d.root.pid == DEAD_PID


def test_a_clean_run_has_no_root_cause_and_the_command_exits_zero(tmp_path):
    run = make_run(tmp_path, {"controller-0": [(1.0, "INFO", "rlhf.controller", "step 1 done"),
                                               (2.0, "WARNING", "rlhf.faults", "fault x injected at train.step; failed")]},
                   lives=[("train-0", DEAD_PID, 0.0, 3.0, 0, "train-0", True)], finished=True)
    d = diagnose(str(run))
    assert d.verdict == "no failure" and d.root is None and "no failure" in d.headline()
    out = subprocess.run([sys.executable, "-m", "rlhf.cli", "diagnose", str(run)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "no failure" in out.stdout and (run / "diagnosis.json").exists()


def test_diagnosis_json_and_the_command_on_a_failed_run(tmp_path):
    run = make_run(tmp_path, {"train-0": [(3.0, "ERROR", "rlhf.http", "train-0: POST /save failed at step 3: OSError: "
                                                                      "[Errno 28] No space left on device")],
                              "controller-0": [(3.01, "ERROR", "rlhf.controller", "run failed: step 3, stage "
                                                                                  "latest_recover_save: HTTPStatusError:"
                                                                                  " HTTP 500 from train-0 (http://x/save)")]})
    data = json.loads(open(write(diagnose(str(run)))).read())
    assert data["root_cause"]["process"] == "train-0" and data["root_cause"]["category"] == "disk"
    assert data["root_cause"]["stage"] == "latest_recover_save" and data["verdict"] == "failed"
    assert data["propagation"][0]["source"].endswith("train-0.log:1")
    out = subprocess.run([sys.executable, "-m", "rlhf.cli", "diagnose", str(run)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 1 and "root cause: train-0" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "rlhf.cli", "diagnose", str(tmp_path / "nope")], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


def test_categories_of_typical_messages():
    assert categorize("OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == "oom_device"
    assert categorize("MemoryError: cannot allocate") == "oom_host"
    assert categorize("OSError: [Errno 28] No space left on device") == "disk"
    assert categorize("SafetensorError: incomplete metadata, file not fully covered") == "disk"
    assert categorize("SyncStall: train-0 has been inside all_reduce(gradients) for 5.4 s") == "hang"
    assert categorize("RpcTimeout: no reply from rollout-1 (http://x/generate) within 6 s") == "timeout"
    assert categorize("cannot reach metaserver-0: ServerDisconnectedError: Server disconnected") == "network"
    assert categorize("BatchSizeMismatch: global_rows=128") == "data_mismatch"
    assert categorize("job rollout-1 (role rollout, pid 4) died: killed by SIGKILL") == "process_death"
    assert categorize("ValueError: bad value") == "exception"


def test_servers_that_died_with_their_killed_scheduler_are_consequences(tmp_path):
    logs = {"controller-0": [(5.2, "ERROR", "rlhf.controller", "run failed: step 4, stage rollout: RpcConnectionError: "
                                                              "cannot reach rollout-0 (http://x/generate): Connect call "
                                                              "failed"),
                             (6.5, "ERROR", "rlhf.controller", "scheduler-0 (pid 9) died: killed by SIGKILL")]}
    heartbeat = {name: [{"time": t, "pid": DEAD_PID + i, "activity": "idle", "activity_step": 4, "activity_age_s": 1}
                        for t in (1, 2, 3, 4)] for i, name in enumerate(("scheduler-0", "rollout-0", "rollout-1"))}
    lives = [("scheduler-0", DEAD_PID, 0.0, 6.5, -9, "controller-0", False),
             ("rollout-0", DEAD_PID + 1, 1.0, None, None, "", None),
             ("rollout-1", DEAD_PID + 2, 1.0, None, None, "", None)]
    d = diagnose(str(make_run(tmp_path, logs, lives=lives, metrics=heartbeat)))
    assert (d.root.process, d.root.category) == ("scheduler-0", "process_death"), d.render()
    assert "SIGKILL" in d.root.summary
    assert {m["process"] for m in d.masked if "with its parent scheduler-0" in m["why"]} == {"rollout-0", "rollout-1"}


def test_rlhf_trace_lists_the_processes_that_did_not_end_normally(tmp_path):
    from rlhf.tracing.cli import process_ends
    from rlhf.tracing.read import TraceSet

    run = make_run(tmp_path, {}, lives=[("rollout-1", DEAD_PID, 0.0, 5.0, -9, "scheduler-0", False),
                                        ("train-1", DEAD_PID + 1, 0.0, None, None, "", None),
                                        ("train-0", DEAD_PID + 2, 0.0, 6.0, 0, "train-0", True)])
    lines = process_ends(str(run), TraceSet([]))
    text = "\n".join(lines)
    assert "rollout-1 (pid" in text and "killed by SIGKILL, seen by scheduler-0" in text
    assert "train-1 (pid" in text and "no exit record" in text
    assert "train-0" not in text  # a normal end is not listed


def test_the_rank_missing_from_a_collective_is_named_not_the_one_waiting_in_it(tmp_path):
    logs = {"controller-0": [(40.0, "ERROR", "rlhf.controller", "run failed: step 3, stage train: RpcTimeout: no reply "
                                                               "from train-0 (http://x/train_step) within 30 s")]}
    metrics = {"train-0": [{"time": t, "pid": 1, "activity": "all_reduce(gradients)", "activity_step": 3,
                            "activity_age_s": t - 10.5} for t in range(11, 41)],
               "train-1": [{"time": t, "pid": 2, "activity": "POST /train_step", "activity_step": 3,
                            "activity_age_s": t - 10.0} for t in range(11, 41)]}
    d = diagnose(str(make_run(tmp_path, logs, metrics=metrics)))
    assert (d.root.process, d.root.stage, d.root.category) == ("train-1", "train", "hang"), d.render()
    assert "missing from all_reduce(gradients)" in d.root.summary and "train-0 waited inside it" in d.root.summary


def test_the_stall_watchdog_names_the_rank_the_waiter_waits_for(tmp_path):
    logs = {"controller-0": [(20.0, "ERROR", "rlhf.controller", "run failed: train: SyncStall: train-0 has been inside "
                                                               "all_reduce(gradients) for 5.4 s at its step 27 (loop), "
                                                               "while train-1 is in done at its step 26")]}
    metrics = {"train-0": [{"time": t, "pid": 1, "activity": "all_reduce(gradients)", "activity_step": 27,
                            "activity_age_s": t - 14.6} for t in range(15, 21)]}
    d = diagnose(str(make_run(tmp_path, logs, metrics=metrics)))
    assert (d.root.process, d.root.stage, d.root.category) == ("train-1", "train", "hang"), d.render()
    assert abs(d.root.time - (T0 + 14.6)) < 0.05  # missing since the waiter entered the collective


def test_a_process_that_logged_its_request_failing_is_not_still_inside_it(tmp_path):
    """Its last heartbeat row (1 Hz) predates its error reply: the straggler is the one that never answered."""
    logs = _update_failed("incomplete")
    metrics = {"rollout-0": [{"time": t, "pid": 5, "activity": "POST /update_weights_from_meta", "activity_step": 3,
                              "activity_age_s": t - 0.1} for t in range(1, 9)],
               "train-1": [{"time": t, "pid": 7, "activity": "POST /upload_weights", "activity_step": 3,
                            "activity_age_s": t - 0.1} for t in range(1, 9)]}
    d = diagnose(str(make_run(tmp_path, logs, metrics=metrics)))
    assert d.root.process == "train-1", d.render()
    assert all("rollout-0" not in s for s in d.stalls)


ROLLOUT_TIMEOUT = "run failed: step 2, stage rollout: RpcTimeout: no reply from rollout-0 (http://x/generate) within 4 s"


def _beats(t0, n, **values):
    return [{"time": t0 + i, "activity": "POST /generate", "activity_step": 2, **values} for i in range(n)]


def test_a_timeout_whose_process_waited_for_a_cpu_is_cpu_starvation(tmp_path):
    run = make_run(tmp_path, {"controller-0": [(14.0, "ERROR", "rlhf.controller", ROLLOUT_TIMEOUT)]},
                   metrics={"rollout-0": _beats(10.5, 4, cpu_wait_percent=85.0, system_cpu_percent=100.0)})
    d = diagnose(str(run))
    assert (d.root.process, d.root.stage, d.root.category) == ("rollout-0", "rollout", "cpu_starvation"), d.render()
    assert "waited for a CPU 85% of the time" in d.root.summary and d.root.source.startswith("metrics/rollout-0.csv")
    run = make_run(tmp_path / "calm", {"controller-0": [(14.0, "ERROR", "rlhf.controller", ROLLOUT_TIMEOUT)]},
                   metrics={"rollout-0": _beats(10.5, 4, cpu_wait_percent=5.0, system_cpu_percent=100.0)})
    assert diagnose(str(run)).root.category == "timeout"  # busy, not starved: a plain timeout


def test_the_process_whose_children_burnt_the_cpu_is_the_root_of_the_starvation(tmp_path):
    run = make_run(tmp_path, {"controller-0": [(14.0, "ERROR", "rlhf.controller", ROLLOUT_TIMEOUT.replace(
        "rollout-0", "rollout-1"))]},
        metrics={"rollout-1": _beats(10.5, 4, cpu_wait_percent=85.0),
                 "rollout-0": [{"time": 9.8 + i, "activity": "idle", "children_cpu_percent": 160.0} for i in range(5)],
                 "train-1": [{"time": 9.9 + i, "activity": "idle", "children_cpu_percent": 0.0} for i in range(5)]})
    d = diagnose(str(run))
    assert (d.root.process, d.root.category) == ("rollout-0", "cpu_starvation"), d.render()
    assert "child processes of rollout-0 used 160% CPU" in d.root.summary and "rollout-1" in d.root.summary


def test_a_timeout_in_disk_wait_under_io_pressure_is_io_starvation(tmp_path):
    run = make_run(tmp_path, {"controller-0": [(14.0, "ERROR", "rlhf.controller", ROLLOUT_TIMEOUT)]},
                   metrics={"rollout-0": _beats(10.5, 4, disk_wait_threads=1, io_pressure_percent=45.0)})
    d = diagnose(str(run))
    assert d.root.category == "io_starvation" and "waited for IO 45%" in d.root.summary, d.render()


def test_the_headline_names_the_killed_process_and_the_one_restarted_in_its_place(tmp_path):
    """A rollout server killed mid-step and restarted (hardened): the headline's pid is the dead one's, with how it
    ended, and it says which pid took its place; the evidence names the same pid."""
    run = make_run(tmp_path, {
        "controller-0": [(10.00, "WARNING", "rlhf.controller", "step 3: rollout-1 failed (RpcConnectionError: cannot "
                                                               "reach rollout-1 (http://x/generate): Server disconnected)"),
                         (10.05, "ERROR", "rlhf.controller", FAILED_TRAIN)],
    }, lives=[("rollout-1", DEAD_PID, 1.0, 10.2, -9, "scheduler-0", False),
              ("rollout-1", DEAD_PID + 7, 10.5, None, None, "", None)])
    d = diagnose(str(run))
    assert (d.root.process, d.root.pid, d.root.exit, d.root.replaced_by) == \
        ("rollout-1", DEAD_PID, "killed by SIGKILL", DEAD_PID + 7)
    assert f"rollout-1 (pid {DEAD_PID}, killed by SIGKILL; restarted as pid {DEAD_PID + 7})" in d.headline()
    assert any(e.pid == DEAD_PID for e in d.root.evidence)


def test_a_name_that_does_not_resolve_is_the_callers_failure_not_the_peers(tmp_path):
    """train-1's upload fails because metaserver-0's name does not resolve on train-1 (a dns_failure): the root cause
    is train-1 (its resolver), not metaserver-0, which was healthy and answered everyone else."""
    run = make_run(tmp_path, {
        "controller-0": [(10.00, "ERROR", "rlhf.controller", "run failed: step 2, stage weights_update: HTTPStatusError: "
                                                             "HTTP 500 from train-1 (http://x/upload_weights): 500")],
        "train-1": [(9.99, "ERROR", "rlhf.http", "train-1: POST /upload_weights failed at step 2: RpcConnectionError: "
                                                 "cannot reach metaserver-0 (http://x/weights/2/rank1): gaierror: [Errno "
                                                 "-2] Name or service not known (metaserver-0.invalid; dns_failure)")],
        "rollout-0": [(10.01, "ERROR", "rlhf.http", "rollout-0: POST /update_weights_from_meta failed at step 2: "
                                                    "HTTPStatusError: HTTP 504 from metaserver-0 (http://x/weights/2/"
                                                    "manifest): incomplete")],
    }, lives=[("train-1", DEAD_PID, 0.0, 10.5, 1, "train-1", False)])
    d = diagnose(str(run))
    assert (d.root.process, d.root.stage, d.root.category) == ("train-1", "weights_update", "network"), d.render()
    assert "Name or service not known" in d.root.summary


def test_a_process_killed_two_steps_after_a_skipped_save_dies_in_the_stage_its_peers_noticed(tmp_path):
    """Scenario 9 hardened: train-0's periodic save stalled at step 2 and was skipped (the run went on); at step 4 the
    process was killed between two of its requests (its last heartbeat idle). The root cause is the death, at step 4
    in the stage where train-1 noticed it (train), not the skipped save's stage of two steps before."""
    logs = {"train-0": [(3.60, "ERROR", "rlhf.http", "train-0: POST /save failed at step 2: CheckpointWriteStalled: "
                                                     "train-0: checkpoint write made no progress for 4 s")],
            "controller-0": [(3.61, "WARNING", "rlhf.controller", "step 2: periodic_recover_save to periodic/step_2 "
                                                                  "failed (RemoteError: CheckpointWriteStalled in "
                                                                  "train-0); skipped")],
            "train-1": [(4.30, "ERROR", "rlhf.http", "train-1: POST /train_step failed at step 4: RuntimeError: [gloo] "
                                                     "Connection reset by peer [127.0.0.1]:9135")]}
    metrics = {"train-0": [{"time": t, "pid": DEAD_PID, "activity": "idle", "activity_step": 4, "activity_age_s": 0.1}
                           for t in (3.0, 3.9)]}
    run = make_run(tmp_path, logs, lives=[("train-0", DEAD_PID, 0.0, None, None, "", None),
                                          ("train-1", DEAD_PID + 1, 0.0, 4.5, 0, "train-1", False)], metrics=metrics)
    d = diagnose(str(run))
    assert (d.root.process, d.root.category, d.root.step, d.root.stage) == ("train-0", "process_death", 4, "train")


CLOCK = ("clock: agent-1 (pid {pid}) is 60.0 s ahead of controller-0's clock (its reply to /fanout?to=train_step at "
         "step 2, stage train, +/- 0.004 s): its log lines, heartbeat rows and exit records are stamped as much off "
         "(rlhf diagnose reads them on this clock)")


def test_a_host_whose_clock_is_ahead_is_read_on_the_controllers_clock(tmp_path):
    """Ranks 4-7 share a process whose clock is 60 s ahead. Its rank 5 fails first (stamped a minute late), the
    controller's calls then fail. Read as stamped, train-5's error comes after the run failed (masked) and the
    controller's report is the root; on the controller's clock (its `clock:` line) train-5 is the root cause."""
    pid = DEAD_PID + 40
    logs = {"controller-0": [(5.0, "ERROR", "rlhf.controller", "run failed: step 2, stage train: RpcConnectionError: "
                                                               "cannot reach train-6 (http://x/fanout): Server "
                                                               "disconnected")],
            "train-4": [(64.9, "ERROR", "rlhf.http", "train-5: POST /train_step failed at step 2: RuntimeError: the "
                                                     "optimizer state is corrupt")]}
    lives = [("controller-0", DEAD_PID, 0.0, 6.0, 1, "controller-0", False),
             *[(f"train-{r}", pid, 0.0, 66.0, 1, f"train-{r}", False) for r in range(4, 8)]]
    as_stamped = diagnose(str(make_run(tmp_path / "a", logs, lives=lives)))
    assert as_stamped.root.process != "train-5", as_stamped.render()
    logs["controller-0"].insert(0, (2.0, "WARNING", "rlhf.client", CLOCK.format(pid=pid)))
    d = diagnose(str(make_run(tmp_path / "b", logs, lives=lives)))
    assert (d.root.process, d.root.category, d.root.step, d.root.stage) == ("train-5", "exception", 2, "train"), \
        d.render()
    assert abs(d.root.time - (T0 + 4.9)) < 0.01
    clock = next(m for m in d.masked if m["category"] == "clock_skew")
    assert clock["process"] == "train-4" and "(pid %d: train-4 to train-7, 4 processes)" % pid in clock["message"]


def test_a_clock_or_a_straggler_alone_is_the_root_of_a_run_that_finished(tmp_path):
    pid = DEAD_PID + 40
    lives = [(f"train-{r}", pid, 0.0, 70.0, 0, f"train-{r}", True) for r in range(4, 8)]
    d = diagnose(str(make_run(tmp_path / "a", {"controller-0": [(2.0, "WARNING", "rlhf.client", CLOCK.format(pid=pid))]},
                              lives=lives, finished=True)))
    assert d.verdict == "finished with errors"
    assert (d.root.process, d.root.category, d.root.step, d.root.stage) == ("train-4", "clock_skew", 2, "train")
    slow = ("stall watchdog (step 3, stage train, /train_step): train-517 is a straggler: 1023 of 1024 ranks have "
            "waited in all_reduce(grads) for up to 3.4 s at step 3, while train-517 is in POST /train_step at its step "
            "3 (computing); the run goes on")
    d = diagnose(str(make_run(tmp_path / "b", {"controller-0": [(2.0, "WARNING", "rlhf.controller", slow)]},
                              finished=True)))
    assert (d.root.process, d.root.category, d.root.step, d.root.stage) == ("train-517", "straggler", 3, "train")
