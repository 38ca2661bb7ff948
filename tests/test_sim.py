"""A simulated world (rlhf.sim): the real controller, MetaServer, scheduler, watchdog, tracing, faults and diagnosis
over train ranks and rollout servers whose compute is EMULATED, several of them per OS process."""

import csv
import json
import subprocess
import sys

import psutil
import pytest
import yaml

from rlhf.config import build_config
from rlhf.config.checks import ConfigError
from rlhf.sim.cost import CostModel
from tests.conftest import ROOT

WORLD = ["--sim.train_ranks", "8", "--sim.ranks_per_process", "4", "--rollout.servers", "4",
         "--sim.servers_per_process", "4", "--rollout.prompts_per_step", "8", "--train.mini_batches", "1",
         "--algorithm.resample_rounds", "0"]


def _run(tmp_path, *args, timeout=240):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", *WORLD, "--run-dir", str(run_dir),
                          *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    left = [p for p in psutil.process_iter(["cmdline"]) if any(str(run_dir) in part for part in p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"
    return run_dir, out


def test_a_simulated_world_runs_the_real_controller_its_faults_fire_and_the_diagnosis_names_the_rank(tmp_path):
    """One run: step 1 runs the big world's control plane (4 of the 8 ranks upload, weights.uploaders; the MetaServer
    merges their shards, weights.merge_shards; each train rank process's agent fans the calls out, sim.fanout; the
    rows stay in the rollout servers, rollout.data_plane store) and every rollout server ends its update with the
    trainer's checksum; at step 2 train rank 6's step raises (a fault
    point of a simulated rank), the run fails, the console's last line and `rlhf diagnose` name train-6 in train,
    and nothing is left running."""
    faults = tmp_path / "faults.yaml"
    faults.write_text(yaml.safe_dump({"faults": [{
        "name": "rank6-fails", "kind": "exception", "point": "train.step", "target": {"role": "train", "rank": 6},
        "when": {"step": 2}, "params": {"error": "RuntimeError", "message": "the train step failed (injected)"}}]}))
    run_dir, out = _run(tmp_path, "--steps", "3", "--faults", str(faults), "--weights.uploaders", "4",
                        "--weights.merge_shards", "2")
    assert out.returncode != 0
    assert "train-6" in out.stderr.strip().splitlines()[-1]  # the console's last line is the root cause
    diagnosis = json.loads((run_dir / "diagnosis.json").read_text())
    root = diagnosis["root_cause"]
    assert root["process"] == "train-6" and root["stage"] == "train" and root["step"] == 2, root
    [row] = list(csv.DictReader((run_dir / "steps.csv").open()))
    assert row["simulated"] == "EMULATED" and row["weights_verified"] == "1"
    assert int(row["batch_size"]) == 64 and int(row["controller_requests"]) > 4
    assert int(row["controller_batch_bytes"]) > 0 and int(row["metaserver_bytes"]) > 0
    # the data plane (rollout.data_plane auto: store in a simulated world): no rollout token through the controller;
    # the servers kept and scored the rows, each rank fetched its own
    assert int(row["controller_tokens"]) == 0
    assert "rows.keep" in _span_names(run_dir / "traces" / "rollout-1.jsonl")
    assert "batch.fetch" in _span_names(run_dir / "traces" / "train-5.jsonl")
    # each rank and server is a service of its own: its own spans, start record and log lines
    traces = {p.name for p in (run_dir / "traces").iterdir()}
    assert {f"train-{r}.jsonl" for r in range(8)} | {f"rollout-{r}.jsonl" for r in range(4)} <= traces
    exits = [json.loads(line) for line in (run_dir / "exits.jsonl").read_text().splitlines()]
    assert {f"train-{r}" for r in range(8)} <= {e["process"] for e in exits if e["event"] == "start"}
    assert "EMULATED" in (run_dir / "logs" / "train-4.log").read_text()
    calls = _span_names(run_dir / "traces" / "controller-0.jsonl")
    assert calls.count("POST /fanout") >= 2 * 3 and "POST /train_step" not in calls  # one request per process
    assert _span_names(run_dir / "traces" / "train-5.jsonl").count("POST /train_step") == 2  # each rank still runs it
    assert _span_names(run_dir / "traces" / "metaserver-0.jsonl").count("metaserver.merge") >= 2


def _span_names(path):
    names = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                names += [s["name"] for s in scope["spans"]]
    return names


def test_a_rank_failure_relayed_by_its_host_agent_is_the_rank_own():
    from rlhf.errors import ErrorInfo, RemoteError, RpcConnectionError, RpcTimeout
    from rlhf.transport.fanout import by_rank, describe_failure, failure_of, for_ranks

    info = ErrorInfo("RuntimeError", "boom", "train", 6, stage="train", step=2)
    back = failure_of(describe_failure(RemoteError(info, "http://127.0.0.1:1")))
    assert isinstance(back, RemoteError) and back.info.rank == 6 and back.info.stage == "train" and "boom" in str(back)
    timeout = failure_of(describe_failure(RpcTimeout("http://h:1/train_step", 3.0, "train-6")))
    assert isinstance(timeout, RpcTimeout) and timeout.timeout_s == 3.0 and "train-6" in str(timeout)
    lost = failure_of(describe_failure(RpcConnectionError("http://h:1", OSError("refused"), "train-7")))
    assert isinstance(lost, RpcConnectionError) and "train-7" in str(lost)
    assert by_rank(for_ranks({3: {"input_ids": 1, "mask": 2}, 4: None, 5: {"x": 3}})) == \
        {3: {"input_ids": 1, "mask": 2}, 5: {"x": 3}}


def test_the_cost_model_and_the_config_checks():
    assert CostModel(0.0).spend(1000) == 0.0
    assert CostModel(0.5).seconds(4) == 2.0
    jittered = CostModel(1.0, jitter=0.5, seed=3)
    draws = [jittered.seconds(1) for _ in range(200)]
    assert min(draws) < 1.0 < max(draws)
    with pytest.raises(ConfigError, match="sim.train_ranks"):
        build_config(["--sim.train_ranks", "4", "--weights.mode", "disk"])
    with pytest.raises(ConfigError, match="sim.jitter"):
        build_config(["--sim.jitter", "-1"])
