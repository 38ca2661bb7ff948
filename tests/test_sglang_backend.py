"""rollout.backend sglang: the controller drives its rollout servers through sglang's routes only.

On CPU the server is our engine behind exactly sglang's API (`rlhf.services.sglang_launch`, which has
none of our extensions); on a GPU machine with sglang installed the same run launches
`python -m sglang.launch_server` (README: "sglang")."""

import json
import subprocess
import sys

import psutil
import pytest

from rlhf.models.hf_dir import write_addition_jsonl, write_model_dir
from tests.conftest import ROOT


def _run(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_sglang_backend_without_the_sglang_server_fails_at_once_saying_how_to_install(tmp_path):
    run_dir = tmp_path / "run"
    out = _run(["--rollout.backend", "sglang", "--weights.mode", "disk", "--model.path", write_model_dir(str(tmp_path / "m")),
                "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 2
    assert "rollout.backend: 'sglang' needs the sglang server" in out.stderr and "pip install 'sglang[all]'" in out.stderr
    assert not run_dir.exists()  # refused before any process started
    # and what it needs besides, named with the way out
    out = _run(["--rollout.backend", "sglang", "--sglang.launcher", "rlhf.services.sglang_launch",
                "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 2 and "weights.mode: 'meta' needs rollout.backend native" in out.stderr


def _span_names(path):
    names = []
    with open(path) as fh:
        for line in fh:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    names += [s["name"] for s in ss["spans"]]
    return names


# disk in the slow set (suite time): the native disk path runs in test_runtime, sglang's routes in the distributed case
@pytest.mark.parametrize("mode", [pytest.param("disk", marks=pytest.mark.slow), "distributed"])
def test_grpo_through_sglang_routes_only_colocated(tmp_path, mode):
    """disk: an HF directory each step; distributed: sglang's weights update group, a broadcast each step."""
    run_dir = tmp_path / "run"
    out = _run(["--preset", "smoke", "--steps", "3", "--model.path", write_model_dir(str(tmp_path / "model")),
                "--task.name", "jsonl", "--task.path", write_addition_jsonl(str(tmp_path / "add.jsonl")),
                "--rollout.backend", "sglang", "--sglang.launcher", "rlhf.services.sglang_launch",
                "--weights.mode", mode, "--colocate", "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    rows = (run_dir / "steps.csv").read_text().splitlines()
    header = rows[0].split(",")
    verified = [r.split(",")[header.index("weights_verified")] for r in rows[1:]]
    assert verified == ["1", "1", "1"]  # each step's version, read back from /model_info
    served = set(_span_names(run_dir / "traces" / "rollout-0.jsonl"))
    update = {"disk": {"POST /update_weights_from_disk"},
              "distributed": {"POST /init_weights_update_group", "POST /update_weights_from_distributed"}}[mode]
    assert update | {"POST /generate", "GET /model_info", "POST /release_memory_occupation",
                     "POST /resume_memory_occupation"} <= served  # colocation through sglang's release/resume
    assert not any(name.split(" ")[-1] in ("/events", "/weights_checksum", "/update_weights_from_meta")
                   for name in served)
    assert not (run_dir / "rollout-0.sglang.yaml").exists()  # the launch file held the key; gone once it served
    weights = run_dir / "weights" / "latest"
    if mode == "disk":
        assert (weights / "config.json").exists() and (weights / "tokenizer.json").exists()  # a full HF directory
    else:
        assert not weights.exists()  # nothing went through disk
    with open(run_dir / "exits.jsonl") as fh:
        pids = [json.loads(line)["pid"] for line in fh if '"start"' in line]
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
