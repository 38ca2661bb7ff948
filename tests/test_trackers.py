"""--logger tensorboard,wandb,mlflow: a real 3-step run with a fault, read back by each library's own reader.

TensorBoard's EventAccumulator, MLflow's MlflowClient on the run's file store, and W&B's offline run (its
transaction log, each record decoded by wandb's own protobuf types) must give steps.csv's values at their steps, and the fault's
injection and restore as events at the step it fired.
"""

import csv
import glob
import json
import os
import subprocess
import sys

import pytest

from rlhf.trackers import metric_name, missing_packages, numbers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAULT = """faults:
  - name: skewed-clock
    kind: clock_skew
    point: rollout.generate
    target: {role: rollout, rank: 0}
    when: {step: 2}
    duration_s: 0.5
    params: {offset_s: 5}
"""


def test_columns_get_grouped_names_and_text_cells_are_left_out():
    assert metric_name("reward_mean") == "reward/mean" and metric_name("rollout_s") == "timing/rollout_s"
    assert metric_name("grad_norm") == "train/grad_norm" and metric_name("staleness_max") == "async/staleness_max"
    assert metric_name("eval_accuracy") == "eval/accuracy" and metric_name("weights_fallback") == "weights/fallback"
    assert numbers({"step": 3, "loss": "0.5", "eval_accuracy": "", "note": "x"}) == {"train/loss": 0.5}


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_packages(["console", "wandb"]) == [
        "--logger wandb: the wandb package is not installed: pip install 'rlhf[trackers]' (or pip install wandb)"]
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--logger", "console,tensorbord"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "tensorbord not known; choose any of: console, tensorboard, wandb, mlflow" in out.stderr


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_three_trackers_read_back_equal_steps_csv_and_carry_the_fault_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    fault = tmp_path / "skew.yaml"
    fault.write_text(FAULT)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "3",
                          "--logger", "tensorboard,mlflow,wandb", "--faults", str(fault), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    expected = {int(r["step"]): numbers(r) for r in rows}
    assert len(expected) == 3 and all("reward/mean" in v for v in expected.values())

    # TensorBoard: its own EventAccumulator over <run-dir>/tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    for name in ("reward/mean", "train/loss", "timing/step_s"):
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got == pytest.approx({s: v[name] for s, v in expected.items()}, rel=1e-5), name
    evals = {e.step: e.value for e in acc.Scalars("eval/accuracy")}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert evals == pytest.approx({0: summary["eval_accuracy_before"], 3: summary["eval_accuracy_after"]})
    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"] if tag.startswith("events/")}
    assert [s for s, t in texts["events/fault.inject/text_summary"] if "skewed-clock" in t] == [2]
    assert "figures/propagation" in acc.Tags()["images"]
    assert {e.step: e.value for e in acc.Scalars("events/faults_injected")} == {1: 0, 2: 1, 3: 0}

    # MLflow: MlflowClient on the run's file store
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["rollout.prompts_per_step"]
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/mean")}
    assert history == pytest.approx({s: v["reward/mean"] for s, v in expected.items()}, rel=1e-5)
    inject = [v for k, v in run.data.tags.items() if k.startswith("event.00002.") and "skewed-clock" in v]
    assert inject and any(v.startswith("fault.inject") for v in inject)
    events = json.loads(open(client.download_artifacts(run.info.run_id, "events.json", str(tmp_path))).read())
    assert {"step": 2, "kind": "fault.inject"} in [{k: e[k] for k in ("step", "kind")} for e in events]

    # W&B: the offline run's transaction log, each record decoded by wandb's own protobuf Record
    (wandb_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    from wandb.proto import wandb_internal_pb2

    logged, summary_items = {}, {}
    for data in wandb_records(wandb_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            logged[items["_step"]] = items
        elif record.WhichOneof("record_type") == "summary":
            summary_items.update({i.key or "/".join(i.nested_key): i.value_json for i in record.summary.update})
    for step, values in expected.items():
        assert logged[step]["reward/mean"] == pytest.approx(values["reward/mean"], rel=1e-5)
    assert "skewed-clock" in summary_items["events"] and "step 2" in summary_items["events"]


def wandb_records(path):
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks of records with a 7-byte header: CRC,
    length, type full/first/middle/last) after W&B's 7-byte file header. wandb 0.31 writes it from its Go core and
    no longer ships the Python reader (wandb.sdk.internal.datastore) that older versions had."""
    import struct

    with open(path, "rb") as fh:
        raw = fh.read()
    assert raw[:4] == b":W&B", raw[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        body, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield body
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            yield pending + body


def test_a_tracker_that_fails_mid_run_warns_once_and_the_others_go_on(tmp_path, caplog):
    """A backend whose call raises (a full disk, a server gone) is dropped with one WARNING; the step goes on and
    the other backends keep receiving; a fault marker written meanwhile is an event at its own step."""
    from rlhf.trackers import Trackers

    class Backend:
        def __init__(self, name, fail):
            self.name, self.where, self.fail, self.calls = name, "here", fail, []

        def scalars(self, step, values):
            if self.fail:
                raise OSError(28, "No space left on device")
            self.calls.append((step, values))

        def log_events(self, step, events):
            self.calls.append((step, events))

    trackers = Trackers(["console"], str(tmp_path), {"seed": 1})
    broken, fine = Backend("broken", True), Backend("fine", False)
    trackers.backends = [broken, fine]
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "markers.jsonl").write_text(json.dumps(
        {"event": "inject", "fault": "f", "kind": "exception", "point": "train.step", "role": "train", "rank": 1,
         "step": 2, "emulated": False}) + "\n")
    with caplog.at_level("WARNING", logger="rlhf.trackers"):
        trackers.step(2, {"step": 2, "reward_mean": "0.5", "rollout_restarts": "1"})
        trackers.step(3, {"step": 3, "reward_mean": "0.7"})
    assert trackers.backends == [fine]
    assert [r.getMessage() for r in caplog.records if "broken" in r.getMessage()] == [
        "tracker broken failed (scalars: OSError: [Errno 28] No space left on device); the run goes on without it"]
    assert fine.calls[0] == (2, {"reward/mean": 0.5, "rollout/restarts": 1.0, "events/faults_injected": 1.0,
                                 "events/count": 2.0})
    events = fine.calls[1][1]
    assert [(e["step"], e["kind"]) for e in events] == [(2, "fault.inject"), (2, "rollout_restarts")]
    assert fine.calls[2] == (3, {"reward/mean": 0.7, "events/faults_injected": 0.0, "events/count": 0.0})
