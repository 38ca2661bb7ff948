"""weights.mode distributed: sglang's weights update group on our rollout server, checked against sglang's own request
and reply types, and the controller's broadcast in real runs (gloo on 127.0.0.1)."""

import ast
import concurrent.futures
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import requests
import torch

from rlhf.transport import weights_group as wg
from rlhf.weights import checksum, export_state
from tests.conftest import ROOT, diverse_model
from tests.test_rollout_server import TOKEN, rollout_server  # noqa: F401 (a fixture)
from tests.test_runtime import assert_none_left, steps, torchrun

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TYPES = ("InitWeightsUpdateGroupReqInput", "InitWeightsUpdateGroupReqOutput", "UpdateWeightsFromDistributedReqInput",
         "UpdateWeightsFromDistributedReqOutput", "DestroyWeightsUpdateGroupReqInput",
         "DestroyWeightsUpdateGroupReqOutput")


def sglang_types() -> dict[str, dict[str, bool]]:
    """type -> {field: required} of sglang's request and reply types for these routes, read from the pinned
    sglang's source (its io_struct module imports its GPU stack, so it is parsed, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed: pip install --no-deps -r tests/sglang-contract.txt")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "srt" / "managers" / "io_struct.py"
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in TYPES:
            out[node.name] = {n.target.id: n.value is None for n in node.body
                              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert sorted(out) == sorted(TYPES)
    return out


def post(url, path, body):
    reply = requests.post(url + path, json=body, headers=AUTH, timeout=60)
    return reply.status_code, reply.json()


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_the_weights_group_routes_take_sglangs_requests_and_give_its_replies(rollout_server):  # noqa: F811
    """Two rollout servers join a group the test process opens (as train rank 0 does), receive a model's weights in two
    flattened buckets by broadcast, and hold them bit for bit with the version of the last bucket. Every request
    carries exactly sglang's fields (the optional ones at sglang's defaults, but the backend: gloo on a CPU) and every
    reply is exactly sglang's {success, message}; what sglang refuses, we refuse with its words."""
    types = sglang_types()
    start, loop, _ = rollout_server
    urls = [start(rank=r)[0] for r in range(2)]
    model, _ = diverse_model("tiny-llama", seed=5)
    store = wg.open_store("127.0.0.1", 60)
    init = {"master_address": "127.0.0.1", "master_port": store.port, "world_size": 3, "group_name": wg.GROUP,
            "backend": "gloo"}
    assert set(init) | {"rank_offset"} == set(types["InitWeightsUpdateGroupReqInput"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        joining = pool.submit(wg.join, "127.0.0.1", store.port, 0, 3, "gloo", 60, wg.GROUP, store)
        replies = list(pool.map(lambda r: post(urls[r], "/init_weights_update_group", {**init, "rank_offset": 1 + r}),
                                range(2)))
        group = joining.result()
    assert replies == [(200, {"success": True, "message": "Succeeded to initialize custom process group."})] * 2
    assert all(set(body) == set(types["InitWeightsUpdateGroupReqOutput"]) for _, body in replies)

    buckets = wg.plan_buckets(wg.describe(model.named_parameters()), sum(p.numel() * 4 for p in model.parameters()) // 2)
    assert len(buckets) >= 2
    fields = types["UpdateWeightsFromDistributedReqInput"]
    params = dict(model.named_parameters())
    for i, b in enumerate(buckets):
        body = {"names": b["names"], "dtypes": b["dtypes"], "shapes": b["shapes"], "group_name": wg.GROUP,
                "flush_cache": True, "abort_all_requests": False, "load_format": "flattened_bucket",
                "weight_version": "7" if i == len(buckets) - 1 else None}
        assert set(body) <= set(fields) and {f for f, required in fields.items() if required} <= set(body)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            receiving = [pool.submit(post, u, "/update_weights_from_distributed", body) for u in urls]
            wg.broadcast(group, wg.pack([params[n] for n in b["names"]]))
            assert [r.result() for r in receiving] == \
                [(200, {"success": True, "message": "Succeeded to update parameter online."})] * 2
    for u in urls:
        got = requests.get(u + "/weights_checksum", headers=AUTH, timeout=30).json()
        assert got == {"checksum": checksum(export_state(model), "crc32"), "weight_version": "7"}

    status, body = post(urls[0], "/update_weights_from_distributed",
                        {"names": ["nope.weight"], "dtypes": ["float32"], "shapes": [[2]], "group_name": wg.GROUP})
    assert status == 400 and body["success"] is False and "nope.weight" in body["message"]
    status, body = post(urls[0], "/update_weights_from_distributed",
                        {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "other"})
    assert (status, body["success"]) == (400, False) and "init_weights_update_group" in body["message"]
    destroy = {"group_name": wg.GROUP}
    assert set(destroy) == set(types["DestroyWeightsUpdateGroupReqInput"])
    assert post(urls[0], "/destroy_weights_update_group", destroy) == \
        (200, {"success": True, "message": "Succeeded to destroy custom process group."})
    assert post(urls[0], "/destroy_weights_update_group", destroy) == \
        (400, {"success": False, "message": "The group to be destroyed does not exist."})
    status, body = post(urls[1], "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and body["success"] is False and "master_port" in body["message"]


def test_plan_buckets_keeps_the_order_and_bounds_each_bucket():
    tensors = [{"name": f"t{i}", "dtype": "bfloat16", "shape": [n]} for i, n in enumerate([10, 30, 200, 5, 5])]
    buckets = wg.plan_buckets(tensors, 100)  # bytes: 20, 60, 400, 10, 10
    assert [b["names"] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [b["bytes"] for b in buckets] == [80, 400, 20]
    flat = wg.pack([torch.arange(3.0), torch.ones(2, dtype=torch.bfloat16)])
    (_, a), (_, b) = wg.unpack(flat, ["a", "b"], ["float32", "bfloat16"], [[3], [2]])
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b, torch.ones(2, dtype=torch.bfloat16))


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_a_two_rank_run_broadcasts_survives_a_server_killed_mid_broadcast_and_names_a_hung_one_in_seconds(tmp_path):
    """2 train ranks, 2 rollout servers, --weights.mode distributed, hardened: every step's weights verified on both
    servers. At step 2 rollout-1 is SIGKILLed as it starts receiving: it is started again, the group is formed again
    with it, and the step's weights go through the new group. At step 3 rollout-0 hangs before its receive: the
    broadcast watchdog names it within seconds (not the group's 600 s timeout), the run stops, and `rlhf diagnose`
    puts the fault on rollout-0."""
    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n"
                      "  - name: kill-mid-broadcast\n    point: weights_update.broadcast\n    kind: process_kill\n"
                      "    target: {role: rollout, rank: 1}\n    when: {step: 2, max_hits: 1}\n"
                      "    params: {signal: KILL}\n"
                      "  - name: hang-before-receive\n    point: weights_update.broadcast\n    kind: hang\n"
                      "    target: {role: rollout, rank: 0}\n    when: {step: 3, max_hits: 1}\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(torchrun(run_dir, "--steps", "3", "--weights.mode", "distributed", "--weights.bucket_mb",
                                   "0.5", "--runtime.watchdog_stall_s", "3", "--faults", str(faults)),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "rollout-0 is missing from the weights broadcast" in proc.stderr, proc.stderr[-3000:]
    rows = steps(run_dir)
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(r["weights_verified"] in ("1", "True", "true") for r in rows)
    assert int(rows[1]["rollout_restarts"]) == 1
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert log.count("weights update group formed: train-0 and 2 rollout servers (gloo)") == 2
    assert "rollout-1 went down during the weights update" in log
    diagnose = subprocess.run([sys.executable, "-m", "rlhf.cli", "diagnose", str(run_dir)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
    assert "rollout-0" in diagnose.stdout.split("\n\n")[0], diagnose.stdout[-2000:]
    assert_none_left(run_dir)


@pytest.mark.slow(reason="suite time: the same kill runs by default in hardened mode (restarted, re-joined); "
                         "benchmarks/diagnosis.py scores naming a killed server")
def test_faithful_a_server_killed_mid_broadcast_fails_the_step_and_is_named_the_root_cause(tmp_path):
    """faithful (no restart): the kill at step 2 fails the weights update; `rlhf diagnose` names rollout-1, killed by
    SIGKILL, in the weights_update stage (not the rollout stage its role suggests)."""
    faults = tmp_path / "kill.yaml"
    faults.write_text("faults:\n  - name: kill-mid-broadcast\n    point: weights_update.broadcast\n"
                      "    kind: process_kill\n    target: {role: rollout, rank: 1}\n"
                      "    when: {step: 2, max_hits: 1}\n    params: {signal: KILL}\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(torchrun(run_dir, "--steps", "3", "--weights.mode", "distributed", "--resilience", "faithful",
                                   "--faults", str(faults)), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "step 2, stage weights_update" in proc.stderr, proc.stderr[-3000:]
    diagnose = subprocess.run([sys.executable, "-m", "rlhf.cli", "diagnose", str(run_dir)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
    headline = next(line for line in diagnose.stdout.splitlines() if line.startswith("root cause:"))
    assert "rollout-1" in headline and "SIGKILL" in headline and "stage weights_update" in headline, headline
    assert_none_left(run_dir)
