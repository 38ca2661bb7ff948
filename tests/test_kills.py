"""Live diagnosis: kill -9 of each process kind names the dead process and its signal; raised errors their category.

Real SIGKILLs through the process_kill fault (rank 1 at its train step, the scheduler while it serves a
lease renewal, a rollout server in generate); the root cause comes from exit records and heartbeats.
Marked slow (about 40 s each): `pytest -m slow tests/test_kills.py`. The hardened behaviours that would survive
these faults are switched off (the survival tests are in test_resilience.py, test_migration.py and test_chaos.py).
"""

import subprocess
import sys

import pytest

from rlhf.diagnosis import _spans, diagnose
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, free_port


def run_with_fault(tmp_path, steps, fault, config="  timeouts: {cleanup_s: 5}\n"):
    """A 2-rank, 2-server GRPO run (no warm start) with one fault that it must not survive; returns the run dir, the
    result, its last log line. Hardened, but without the two behaviours that would survive these faults (a lost or
    failing rollout server's prompts migrated, a lost server or scheduler started again): these tests are about
    naming the root cause of a run that fails.

    config: the rest of the file's config section (lines indented by two spaces; 2 rollout servers unless it
    has a rollout line)."""
    faults = tmp_path / "fault.yaml"
    rollout = "" if "rollout:" in config else "  rollout: {servers: 2, prompts_per_step: 32}\n"
    faults.write_text(f"config:\n  steps: {steps}\n{rollout}{config}"
                      f"faults:\n  - name: f\n{fault}")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir),
           "--faults", str(faults), "--sft.max_steps", "0", "--resilience.migrate_requests", "false",
           "--resilience.restart_rollout", "false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    assert out.returncode != 0, out.stderr[-3000:]
    return run_dir, out, (run_dir / "logs" / "controller-0.log").read_text().splitlines()[-1]


KILLS = {
    "rank 1": ("{role: train, rank: 1}", "train.step", "{step: 2}", "train-1"),
    "scheduler": ("{role: scheduler, peer: /lease}", "rpc.server.handle", "{after_s: 12}", "scheduler-0"),
    "rollout server": ("{role: rollout, rank: 0}", "rollout.generate", "{step: 2}", "rollout-0"),
}


def sigkill(target, point, when):
    """A fault file's entry that SIGKILLs `target` at `point` when `when` holds."""
    return (f"    kind: process_kill\n    point: {point}\n    target: {target}\n    when: {when}\n"
            "    params: {signal: KILL}\n")


@pytest.mark.slow
@pytest.mark.parametrize("who", sorted(KILLS))
def test_a_sigkilled_process_is_named_with_its_signal_as_the_root_cause(who, tmp_path):
    target, point, when, name = KILLS[who]
    # the scheduler is killed 12 s into its life, at a lease renewal: steps enough that the run is still going then
    run_dir, out, last = run_with_fault(tmp_path, 80 if who == "scheduler" else 30, sigkill(target, point, when))
    assert f"root cause: {name}" in last and "process_death" in last, last
    assert "SIGKILL" in last, last
    assert f"root cause: {name}" in out.stderr  # torchrun's closing block quotes it
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.category) == (name, "process_death"), d.render()
    if who == "rank 1":  # spans go out at every request's end: the killed rank's step-2 requests are in the trace
        spans = [s for s in _spans(str(run_dir)) if s.service == "train-1"]
        assert any(s.attributes.get("rlhf.step") == 2 and s.name == "POST /compute_logprobs" for s in spans)


@pytest.mark.slow
def test_a_sigkilled_rank_0_is_named_by_torchruns_block_and_by_rlhf_diagnose(tmp_path):
    """Rank 0 holds the controller and the MetaServer: nothing of ours is left to print. torchrun's closing block
    names rank 0 and SIGKILL, the scheduler and rollout servers go (PDEATHSIG, checked by run_with_fault), and the
    diagnosis names train-0 from its missing exit record."""
    run_dir, out, _ = run_with_fault(tmp_path, 30, sigkill("{role: train, rank: 0}", "train.step", "{step: 2}"))
    block = out.stderr[out.stderr.rindex("Root Cause (first observed failure)"):]
    assert "rank      : 0 (local_rank: 0)" in block and "Signal 9 (SIGKILL)" in block, block
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.category, d.root.step) == ("train-0", "process_death", 2), d.render()
    assert "vanished with no exit record" in d.root.summary


RAISES = {  # the categories the scenario tests do not reach live
    "exception": ("{role: train, rank: 1}", "reference.compute", "RuntimeError", ("train-1", "reference", "exception")),
    "oom_host": ("{role: rollout, rank: 0}", "rollout.generate", "MemoryError", ("rollout-0", "rollout", "oom_host")),
}


@pytest.mark.slow
@pytest.mark.parametrize("category", sorted(RAISES))
def test_a_raised_error_is_named_live_with_its_category(category, tmp_path):
    target, point, error, expected = RAISES[category]
    run_dir, _, last = run_with_fault(tmp_path, 5, f"    kind: exception\n    point: {point}\n    target: {target}\n"
                                                   f"    when: {{step: 2}}\n    params: {{error: {error}}}\n")
    process, stage, cat = expected
    assert f"root cause: {process}" in last and f"stage {stage}: {cat}:" in last, last
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.stage, d.root.category) == expected, d.render()


@pytest.mark.slow
def test_cpu_burnt_by_a_servers_children_is_named_as_cpu_starvation(tmp_path):
    """Real burner processes (cpu_contention) under rollout-0 slow both servers' generate past a 4 s timeout: the
    root cause is the process whose children burnt the CPU, not the first server that timed out."""
    config = ("  rollout: {servers: 2, prompts_per_step: 32}\n  sampling: {max_new_tokens: 96, ignore_eos: true}\n"
              "  timeouts: {rollout_s: 4, cleanup_s: 5}\n")
    run_dir, _, last = run_with_fault(tmp_path, 4, "    kind: cpu_contention\n    point: rollout.generate\n"
                                                   "    target: {role: rollout, rank: 0}\n    when: {step: 2, max_hits: 1}\n"
                                                   "    duration_s: 30\n    params: {burners: 8, load: 1.0}\n", config)
    assert "root cause: rollout-0" in last and "cpu_starvation" in last, last
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.stage, d.root.category) == ("rollout-0", "rollout", "cpu_starvation"), d.render()


@pytest.mark.slow
def test_a_rollout_server_killed_between_steps_is_started_again_and_the_run_finishes(tmp_path):
    """restart_rollout: rollout-1 is SIGKILLed as the controller probes its /health before step 3; it is started
    again, gets step 3's weights with the other server (verified), and every step runs."""
    import csv
    import json

    faults = tmp_path / "fault.yaml"
    faults.write_text("config:\n  steps: 4\n  rollout: {servers: 2, prompts_per_step: 32}\nfaults:\n  - name: f\n"
                      + sigkill("{role: rollout, rank: 1, peer: /health}", "rpc.server.handle", "{step: 3}"))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--run-dir",
                          str(run_dir), "--faults", str(faults), "--sft.max_steps", "0"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    with open(run_dir / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["rollout_restarts"] for r in rows] == ["0", "0", "1", "0"]
    assert all(r["weights_verified"] == "1" for r in rows)
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "step 3: rollout-1 is down (it does not answer /health" in log
    starts = [json.loads(line) for line in (run_dir / "exits.jsonl").read_text().splitlines()]
    assert len([s for s in starts if s.get("process") == "rollout-1" and s.get("event") == "start"]) == 2
