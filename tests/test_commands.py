"""Every command the README shows runs, at its smallest size: its five-minute tour (scenario 2, then `rlhf trace`,
`rlhf diagnose`, `rlhf report`, `rlhf faults`), the scenario and diagnosis benchmarks on that run, and each script in
benchmarks/ with the fewest steps, rows and repeats that still go through all of its code.

A benchmark that crashes after its first row (as `benchmarks/rollout.py` once did in its warm-up, unnoticed) fails
here. Real processes, real runs; each asserts on what the command printed or wrote.
"""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_runtime import assert_none_left
from tests.test_scenarios import log_lines, markers


def command(args, timeout=300, ok=(0,), env=None):
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode in ok, f"{' '.join(map(str, args))} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout


def rlhf(*args, ok=(0,)):
    return command([sys.executable, "-m", "rlhf.cli", *map(str, args)], ok=ok)


def benchmark(name, *args, timeout=300):
    return command([sys.executable, f"benchmarks/{name}", *map(str, args)], timeout=timeout)


def test_the_readme_tour_scenario2_then_its_trace_diagnosis_report_and_benchmarks(tmp_path):
    """The tour's scenario 2 run, through `benchmarks/scenarios.py` (the same torchrun command, faithful, as the
    README's table row): the rollout fault surfaces in train; then each command of the tour on that run."""
    out = tmp_path / "scenarios"
    table = benchmark("scenarios.py", "--scenarios", "2", "--modes", "rl", "--resilience", "faithful", "--out", out)
    run_dir = out / "scenario2-rl-faithful"
    assert_none_left(run_dir)
    with open(out / "scenarios.csv", encoding="utf-8") as fh:
        (row,) = list(csv.DictReader(fh))
    assert (row["fault_stage"], row["error_stage"]) == ("rollout", "train") and "| 2 |" in table
    kill = next(m for m in markers(run_dir) if m["fault"] == "oom-kill-rollout1" and m["event"] == "inject")
    assert (kill["role"], kill["rank"], kill["point"], kill["step"]) == ("rollout", 1, "rollout.generate", 3)
    burn = next(m for m in markers(run_dir) if m["fault"] == "cpu-contention-rollout1" and m["event"] == "verify")
    assert burn["details"]["burner_cpu_percent"] > 50
    controller = log_lines(run_dir, "controller-0")
    assert any("WARNING" in line and "rollout-1" in line and "continuing" in line for line in controller)
    first = next(line for line in log_lines(run_dir, "controller-0", "ERROR") if "run failed" in line)
    assert "step 3" in first and "stage train" in first  # the fault was in rollout
    train_errors = [line for r in (0, 1) for line in log_lines(run_dir, f"train-{r}", "ERROR")]
    assert any("BatchSizeMismatch" in line for line in train_errors)

    # 3. the trace: step 3's tree holds the lost rollout server and the train ranks' error
    tree = rlhf("trace", run_dir, "--step", "3")
    assert "POST /generate → rollout-1" in tree and "RpcConnectionError" in tree and "BatchSizeMismatch" in tree
    jaeger = tmp_path / "jaeger.json"
    rlhf("trace", run_dir, "--format", "jaeger", "-o", jaeger)
    assert json.loads(jaeger.read_text())["data"]
    # 4. the diagnosis: exit 1, the killed server named with its evidence
    said = rlhf("diagnose", run_dir, ok=(1,))
    assert "root cause: rollout-1" in said and "process_death" in said and "propagation" in said
    assert json.loads((run_dir / "diagnosis.json").read_text())["root_cause"]["process"] == "rollout-1"
    # 5. the report's figures
    rlhf("report", run_dir)
    assert (run_dir / "report" / "propagation.png").stat().st_size > 10_000
    # the fault file as the tour shows it, and every kind and point
    assert "2 faults" in rlhf("faults", "validate", "scenario2.yaml")
    listed = rlhf("faults", "list")
    assert "process_kill" in listed and "rollout.generate" in listed
    # benchmarks/diagnosis.py scores that run against its markers (--rescore: the runs already there)
    scored = tmp_path / "diagnosis"
    scored.mkdir()
    os.symlink(run_dir, scored / "scenario2-faithful")
    table = benchmark("diagnosis.py", "--rescore", scored, "--scenarios", "2", "--resilience", "faithful",
                      "--random", "0", "--sharded")
    assert "| scenarios, faithful | 1 | 100% |" in table
    # benchmarks/runtime.py's stage table of that run (--from-run: read a run instead of starting two)
    stages = benchmark("runtime.py", "--part", "stages", "--from-run", run_dir, "--skip", "0")
    assert "| weights_update |" in stages and "| step (median) |" in stages


def test_rollout_benchmark_runs_every_workload_and_its_warm_up(tmp_path):
    table = benchmark("rollout.py", "--batches", "8", "--repeats", "1", "--warm-steps", "2", "--warm-batch", "8",
                      "--new-tokens", "4", "--grpo-new-tokens", "4")
    assert "| equal-work (4 tok) | 8 |" in table and "| grpo (n=8, T=1, EOS, 4 max) | 8 |" in table
    assert "warm model: SFT stopped at step 2" in table


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_gpu_grpo_benchmark_on_the_cpu_prints_its_stage_table_and_leaves_nothing(tmp_path):
    before = {p for p in os.listdir("/tmp") if p.startswith("rlhf-gpu-grpo-")}
    table = benchmark("gpu_grpo.py", "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1")
    assert "| train |" in table and "| **step** |" in table and "runtime's own cost per step" in table
    assert {p for p in os.listdir("/tmp") if p.startswith("rlhf-gpu-grpo-")} == before  # its temporary run removed


def test_gloo_cuda_benchmark_probes_on_host_tensors():
    assert "all_reduce               ok" in benchmark("gloo_cuda.py", "--device", "cpu", "--ranks", "2",
                                                      "--ops", "all_reduce")


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_learning_benchmark_runs_a_seed_and_scores_it(tmp_path):
    table = benchmark("learning.py", "--setups", "async-k1", "--seeds", "1", "--", "--steps", "2",
                      "--sft.max_steps", "10", "--sft.eval_every", "10")
    assert "| async-k1 | 1 |" in table and "≥ +0.15" in table and "failed" not in table


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_async_benchmark_compares_sync_and_async_and_draws_the_figure(tmp_path):
    fig = tmp_path / "async.png"
    table = benchmark("async.py", "--steps", "2", "--modes", "sync,async-k1", "--eval-every", "1", "--figure", fig,
                      "--", "--preset", "smoke")
    assert "| 1+1 | sync |" in table and "| 1+1 | async-k1 |" in table and "failed" not in table
    assert "| 1.00x |" in table and fig.stat().st_size > 10_000


SLOW = "suite time: its smallest run still starts a process per weights mode or a whole run; -m slow runs it"


@pytest.mark.slow(reason=SLOW)
def test_sharding_benchmark_layouts_at_the_smallest_size():
    table = benchmark("sharding.py", "--part", "layouts", "--model", "tiny-llama", "--worlds", "2",
                      "--layouts", "dp,fsdp", "--steps", "1", "--rows", "4", "--tokens", "16")
    assert "| fsdp" in table and "| dp" in table


@pytest.mark.slow(reason=SLOW)
def test_runtime_benchmark_moves_the_weights_every_way():
    table = benchmark("runtime.py", "--part", "bandwidth", "--model", "tiny-llama", "--repeats", "1", "--warmup", "0",
                      "--ranks", "1", "--servers", "1")
    for mode in ("meta (shm)", "meta (http)", "distributed (gloo broadcast)", "disk"):
        assert f"| {mode} |" in table


@pytest.mark.slow(reason=SLOW)
def test_overhead_benchmark_counts_and_times_the_disarmed_fault_points():
    table = benchmark("overhead.py", "--part", "points")
    assert "| one disarmed point, sync |" in table and "| points hit per step" in table
