"""The pre-flight straggler check (--preflight): the rule, and a live run whose rank 1 shares its core with
burner processes (a real cpu_contention fault at preflight.check; slow: `pytest -m slow tests/test_preflight.py`).
A fault-free 2-rank run with --preflight naming no straggler is in tests/test_runtime.py."""

import subprocess
import sys

import pytest

from rlhf.control.lifecycle import stragglers
from rlhf.diagnosis import diagnose
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port


def test_a_rank_twice_as_slow_as_the_median_of_the_others_is_a_straggler():
    [(rank, ratio, others)] = stragglers({0: 0.010, 1: 0.035}, 2.0)  # two ranks compare with each other
    assert (rank, others) == (1, 0.010) and ratio == pytest.approx(3.5)
    assert stragglers({0: 0.010, 1: 0.015}, 2.0) == []
    assert [r for r, _, _ in stragglers({0: 1.0, 1: 1.1, 2: 0.9, 3: 2.5}, 2.0)] == [3]
    assert stragglers({0: 1.0}, 2.0) == []  # nothing to compare with


@pytest.mark.slow
def test_preflight_exclude_refuses_to_start_with_a_starved_rank(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir),
           "--faults", "straggler.yaml", "--preflight", "--preflight.exclude"]  # the bundled file
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    assert out.returncode != 0
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "preflight: train-1 is a straggler" in log and "preflight: train-0 is a straggler" not in log
    failed = next(line for line in log.splitlines() if "run failed" in line)
    assert "startup: PreflightStraggler: train-1 is a straggler" in failed and "does not start" in failed
    assert not (run_dir / "steps.csv").exists() or len((run_dir / "steps.csv").read_text().splitlines()) <= 1
    assert diagnose(str(run_dir)).root.process == "train-1"
