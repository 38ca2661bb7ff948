"""Faults that could never fire are refused before the run, with every problem at once; those that did not fire
in a run are named at its end."""

import json
import os
import subprocess
import sys

import pytest

from rlhf.config import HARDENED, Config
from rlhf.faults import never_fired
from rlhf.faults.cli import faults_main
from rlhf.faults.parse import parse_faults_text
from rlhf.faults.points import POINT_ROLES, POINTS, ROUTES
from rlhf.faults.spec import FaultSpecError, check_world
from tests.conftest import ROOT


def test_every_problem_of_a_file_is_listed_with_its_line():
    text = """faults:
  - name: a
    kind: network_delya
    point: train.step
  - name: b
    kind: hang
    point: train.stpe
    target: {role: trian}
  - name: c
    kind: network_delay
    point: rpc.server.handle
    params: {delay_ms: -1, jiter_ms: 3}
"""
    with pytest.raises(FaultSpecError) as err:
        parse_faults_text(text, "f.yaml")
    msg = str(err.value)
    assert msg.startswith("5 problems:")
    for expected in ("f.yaml:3: faults[0].kind: 'network_delya' is not a fault kind (did you mean 'network_delay'?)",
                     "f.yaml:7: faults[1].point: 'train.stpe' matches no fault point (did you mean 'train.step'?)",
                     "f.yaml:8: faults[1].target.role: 'trian' is not a role (did you mean 'train'?)",
                     "f.yaml:12: faults[2].params.jiter_ms: network_delay has no parameter 'jiter_ms'",
                     "f.yaml:12: faults[2].params.delay_ms: must be >= 0"):
        assert expected in msg, msg


def test_a_role_that_never_passes_the_point_is_refused_with_the_roles_that_do():
    with pytest.raises(FaultSpecError, match=r"role rollout never passes train.step, so this fault could never fire; "
                                             r"roles that pass it: train"):
        parse_faults_text("- {kind: hang, point: train.step, target: {role: rollout}}", "f.yaml")
    assert set(POINT_ROLES) == set(POINTS)  # every point declares who passes it


@pytest.mark.parametrize("peer, hint", [
    ("compute_logprobs", "did you mean '/compute_logprobs'?"),
    ("/train_stpe", "did you mean '/train_step'?"),
])
def test_a_peer_that_is_not_a_route_is_refused_with_a_hint(peer, hint):
    text = f"- {{kind: network_delay, point: rpc.server.handle, target: {{role: train, peer: {peer}}}}}"
    with pytest.raises(FaultSpecError, match="is never a peer at rpc.server.handle") as err:
        parse_faults_text(text, "f.yaml")
    assert hint in str(err.value) and "/train_step" in str(err.value)  # the valid routes are listed


def test_valid_peers_pass():
    for text in ("- {kind: network_delay, point: rpc.client.send, target: {role: train, peer: metaserver}, params: {delay_ms: 1}}",
                 "- {kind: network_delay, point: rpc.server.handle, target: {role: metaserver, peer: '/weights/*'}, params: {delay_ms: 1}}",
                 "- {kind: network_delay, point: events.notify, target: {peer: rollout-1}, params: {delay_ms: 1}}",
                 "- {kind: network_delay, point: scheduler.stop_job, target: {role: controller, peer: scheduler}, params: {delay_ms: 1}}"):
        assert len(parse_faults_text(text, "f.yaml")) == 1
    with pytest.raises(FaultSpecError, match="has no peer"):
        parse_faults_text("- {kind: hang, point: train.step, target: {peer: train-1}}", "f.yaml")


def test_world_checks_name_ranks_and_peers_the_run_lacks():
    specs = parse_faults_text("""faults:
  - {name: r1, kind: hang, point: train.step, target: {role: train, rank: 1}}
  - {name: s3, kind: hang, point: rollout.generate, target: {role: rollout, rank: 3}}
  - {name: p2, kind: network_delay, point: events.notify, target: {peer: rollout-2}, params: {delay_ms: 1}}
""", "f.yaml")
    problems = check_world(specs, train_ranks=1, rollout_servers=2)
    assert len(problems) == 3
    assert "fault 'r1' targets train rank 1, but this run has 1 train rank (valid: 0..0)" in problems[0]
    assert "fault 's3' targets rollout rank 3, but this run has 2 rollout servers (valid: 0..1)" in problems[1]
    assert "'rollout-2' is never a peer at events.notify" in problems[2]
    assert check_world(specs, train_ranks=2, rollout_servers=4) == []


def test_a_run_too_small_for_its_scenario_refuses_with_the_command_to_use():
    out = subprocess.run([sys.executable, "examples/grpo_trainer.py", "--faults", "scenario3.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "1"})
    assert out.returncode == 2
    assert "fault 'device-memory-growth-rank1' targets train rank 1, but this run has 1 train rank" in out.stderr
    assert "torchrun --nproc_per_node=2 examples/grpo_trainer.py --faults scenario3.yaml" in out.stderr


def test_faults_validate_checks_the_world_when_given(capsys):
    assert faults_main(["validate", "scenario3.yaml", "--world-size", "2"]) == 0
    assert faults_main(["validate", "scenario3.yaml", "--world-size", "1"]) == 2
    assert "targets train rank 1, but this run has 1 train rank" in capsys.readouterr().err
    for name in sorted(os.listdir(os.path.join(ROOT, "examples", "faults"))):  # every bundled file fits 2 ranks
        assert faults_main(["validate", name, "--world-size", "2"]) == 0, name


def test_never_fired_faults_are_named_with_the_reason(tmp_path):
    faults = [
        {"name": "fired", "kind": "hang", "point": "train.step", "target": {"role": "train", "ranks": [1]}},
        {"name": "late", "kind": "hang", "point": "train.step", "when": {"steps": [12]}},
        {"name": "rl-only", "kind": "hang", "point": "rollout.generate"},
        {"name": "events", "kind": "network_delay", "point": "events.notify", "params": {"delay_ms": 1}},
        {"name": "quiet", "kind": "hang", "point": "checkpoint.load", "target": {"role": "train", "ranks": [0]}},
    ]
    os.makedirs(tmp_path / "faults")
    with open(tmp_path / "faults" / "markers.jsonl", "w") as fh:
        fh.write(json.dumps({"event": "inject", "fault": "fired"}) + "\n" + '{"event": "inj')  # a cut last line
    why = {f["name"]: f["why"] for f in never_fired(str(tmp_path), faults, last_step=6, rl=False)}
    assert set(why) == {"late", "rl-only", "events", "quiet"}
    assert why["late"] == "its step(s) 12 come after the last step the run reached (6)"
    assert why["rl-only"] == "the SFT baseline never passes rollout.generate (RL only)"
    assert "colocated runs" in never_fired(str(tmp_path), faults, last_step=6, rl=True)[2]["why"]
    assert why["quiet"] == "no process matching train rank 0 passed checkpoint.load"


def test_the_route_table_is_what_the_services_serve(tmp_path):
    from rlhf.services.env_server import EnvServer
    from rlhf.services.metaserver import MetaServer
    from rlhf.services.rollout_server import RolloutServer
    from rlhf.services.scheduler import Scheduler
    from rlhf.services.train_worker import TrainWorker

    def routes(service):
        return {r.resource.canonical for r in service.app.router.routes()}

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        train = TrainWorker(Config(), str(tmp_path), 0, 1, "t")
    finally:
        dist.destroy_process_group()
    services = {"train": train.service, "rollout": RolloutServer(None, 0, "t").service,
                "metaserver": MetaServer("t", transport="http").service,
                "scheduler": Scheduler(str(tmp_path), "t", 5.0).service,
                "env": EnvServer("tool_calls", {"tools": f"{ROOT}/examples/envs/calculator.py"}, "t", HARDENED).service}
    for role, service in services.items():
        assert routes(service) == set(ROUTES[role]), role


def test_schema_and_world_problems_are_listed_together_in_file_order(tmp_path, capsys):
    """A schema problem in one fault and an out-of-range rank in another (and a rank past the world in a fault
    that also has a schema problem): every one, in the order of the file's lines, and exit 2."""
    path = tmp_path / "mixed.yaml"
    path.write_text("""faults:
  - name: far-rank
    kind: hang
    point: train.step
    target: {role: train, rank: 5}
  - name: bad-kind
    kind: netwrk_delay
    point: rpc.client.send
  - name: both
    kind: hang
    point: train.step
    target: {role: train, rank: 3}
    when: {step: -x}
""")
    assert faults_main(["validate", str(path), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith(str(path))]
    assert len(lines) == 4, err
    assert ":5: fault 'far-rank' targets train rank 5, but this run has 2 train ranks" in lines[0]
    assert ":7: faults[1].kind: 'netwrk_delay' is not a fault kind (did you mean 'network_delay'?)" in lines[1]
    assert ":12: fault 'both' targets train rank 3" in lines[2]
    assert ":13: faults[2].when.step" in lines[3]
    out = subprocess.run([sys.executable, "examples/grpo_trainer.py", "--faults", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "1"})
    assert out.returncode == 2
    assert out.stderr.index("'far-rank' targets train rank 5") < out.stderr.index("netwrk_delay") \
        < out.stderr.index("'both' targets train rank 3")
    assert "torchrun --nproc_per_node=6" in out.stderr  # the world its faults need, from every fault that parsed
