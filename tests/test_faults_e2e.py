"""Faults in a real 2-rank run: CPU contention on rollout server 1, a network delay on train rank 1's upload."""

import csv
import json
import statistics
import subprocess

import pytest

from rlhf.tracing.read import load_spans
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, steps, torchrun

FAULTS = """
faults:
  - name: slow-upload-rank1
    kind: network_delay
    point: weights_update.upload
    target: {role: train, rank: 1, peer: metaserver}
    when: {step: 2}
    params: {delay_ms: 600}
  - name: burn-rollout1
    kind: cpu_contention
    point: rollout.generate
    target: {role: rollout, rank: 1}
    when: {step: 5}
    duration_s: 3
    params: {load: 0.95}
"""


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("faulted")
    spec = base / "faults.yaml"
    spec.write_text(FAULTS)
    run_dir = base / "run"
    # samples at 5 Hz: the burn ends when the run does, ~1.5 s after it starts on this machine
    out = subprocess.run(torchrun(run_dir, "--steps", "10", "--faults", str(spec), "--tracing.metrics_interval_s", "0.2"),
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_none_left(run_dir)
    return run_dir


def test_network_delay_lengthens_only_the_target_ranks_upload_span(faulted_run):
    ts = load_spans(str(faulted_run))
    root = ts.step_roots()[2]
    uploads = {s.service: s.duration_s for s, _ in root.walk() if s.kind == "server" and s.name == "POST /upload_weights"}
    assert set(uploads) == {"train-0", "train-1"}
    assert uploads["train-1"] - uploads["train-0"] == pytest.approx(0.6, abs=0.2)
    other = ts.step_roots()[3]
    later = {s.service: s.duration_s for s, _ in other.walk() if s.kind == "server" and s.name == "POST /upload_weights"}
    assert later["train-1"] < 0.3  # only step 2 was delayed
    events = [e for s, _ in root.walk() for e in s.events if e["name"] == "fault.verify"]
    assert events and events[0]["attributes"]["rlhf.fault.name"] == "slow-upload-rank1"


def test_cpu_contention_slows_that_steps_rollout_and_shows_in_the_servers_cpu(faulted_run):
    rows = {int(r["step"]): float(r["rollout_s"]) for r in steps(faulted_run)}
    before = statistics.median(rows[s] for s in (1, 2, 3, 4))
    assert rows[5] > 1.5 * before, rows
    with open(faulted_run / "faults" / "markers.jsonl") as fh:
        marks = [json.loads(line) for line in fh if '"burn-rollout1"' in line]
    inject = next(m for m in marks if m["event"] == "inject")
    verify = next(m for m in marks if m["event"] == "verify")
    restore = next(m for m in marks if m["event"] == "restore")
    assert inject["role"] == "rollout" and inject["rank"] == 1 and inject["step"] == 5
    assert verify["details"]["burner_cpu_percent"] > 60 and len(verify["details"]["pids"]) == 2
    with open(faulted_run / "metrics" / "rollout-1.csv") as fh:
        samples = list(csv.DictReader(fh))
    during = [float(r["children_cpu_percent"]) for r in samples
              if inject["time"] <= float(r["time"]) <= restore["time"] + 0.5]
    assert during and max(during) > 50, during  # the server's own CPU samples show the burners
    with open(faulted_run / "metrics" / "rollout-0.csv") as fh:
        assert max(float(r["children_cpu_percent"]) for r in csv.DictReader(fh)) == 0.0
    audit = json.loads((faulted_run / "faults" / "audit.json").read_text())
    assert audit["cleaned"] == []  # restored by its process; nothing left for the survivor


HOPS = """
faults:
  - name: train1-to-metaserver
    kind: dns_failure
    point: rpc.client.send
    target: {role: train, rank: 1, peer: metaserver}
    when: {step: 2, max_hits: 1}
  - name: rollout0-to-metaserver
    kind: network_delay
    point: rpc.client.send
    target: {role: rollout, rank: 0, peer: metaserver}
    when: {step: 2, max_hits: 1}
    params: {delay_ms: 40}
  - name: controller-to-train1
    kind: network_delay
    point: rpc.client.send
    target: {role: controller, peer: train-1}
    when: {step: 2, max_hits: 1}
    params: {delay_ms: 40}
  - name: controller-to-rollout1
    kind: network_delay
    point: rpc.client.send
    target: {role: controller, peer: rollout-1}
    when: {step: 2, max_hits: 1}
    params: {delay_ms: 40}
  - name: controller-to-scheduler
    kind: network_delay
    point: rpc.client.send
    target: {role: controller, peer: scheduler}
    when: {max_hits: 1}
    params: {delay_ms: 40}
"""


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_a_network_fault_fires_on_every_client_hop_of_a_two_rank_run(tmp_path):
    """Every HTTP hop goes through the client: a fault at rpc.client.send fires on train → MetaServer (the shard
    upload), rollout → MetaServer (the pull), and controller → train rank, rollout server and scheduler (the
    MetaServer lives in the controller's process, which opens each version by a direct call: no hop). The DNS failure
    of train rank 1's shard PUT is retried (an idempotent PUT) and the run finishes."""
    spec = tmp_path / "hops.yaml"
    spec.write_text(HOPS)
    run_dir = tmp_path / "run"
    out = subprocess.run(torchrun(run_dir, "--steps", "2", "--faults", str(spec)), capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_none_left(run_dir)
    with open(run_dir / "faults" / "markers.jsonl") as fh:
        marks = [json.loads(line) for line in fh]
    fired = {m["fault"]: m for m in marks if m["event"] == "inject"}
    expected = {"train1-to-metaserver": ("train", 1), "rollout0-to-metaserver": ("rollout", 0),
                "controller-to-train1": ("controller", 0), "controller-to-rollout1": ("controller", 0),
                "controller-to-scheduler": ("controller", 0)}
    assert set(fired) == set(expected), sorted(fired)
    for name, (role, rank) in expected.items():
        assert (fired[name]["role"], fired[name]["rank"]) == (role, rank), fired[name]
    assert fired["train1-to-metaserver"]["step"] == 2
    train1 = (run_dir / "logs" / "train-1.log").read_text()
    assert "retrying PUT /weights/2/rank1 to metaserver-0 (attempt 2" in train1 and "dns_failure" in train1
    assert "never fired" not in out.stderr
