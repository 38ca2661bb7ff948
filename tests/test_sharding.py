"""Sharded training is exact: FSDP2, tensor parallel and FSDP x TP take the same steps as replicated dp, and every
layout on every world takes the steps of one rank.

Each case runs tests/sharded_steps.py under torchrun (gloo, real torch.distributed on 127.0.0.1): 3 GRPO steps of
one global batch in fp32 (the default lr, clipping on, 2 optimizer steps a step, micro-batches of 2), first in
replicated dp on the world, then in each layout from the same weights on the same data. The batch is cut as the
controller cuts it (rlhf.batch: mini-batches first, then each over the data-parallel ranks), so dp on 1 rank, dp on 2,
fsdp on 2, tp 2 and fsdp x tp on 4 give the same loss, grad norm and weights.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from rlhf.train.parallel import Layout, layout_problems, make_layout
from tests.conftest import ROOT
from tests.test_runtime import free_port

TOLERANCE = 1e-5


def sharded_steps(tmp_path, nproc, model, layouts):
    out = tmp_path / f"{model}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/tests/sharded_steps.py", "--model", model, "--layouts",
           ",".join(layouts), "--steps", "3", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


_ONE_RANK: dict = {}


def one_rank(tmp_path, model):
    """dp on one rank: its records and trained weights (run once a model, for every world it is held against)."""
    if model not in _ONE_RANK:
        result = sharded_steps(tmp_path, 1, model, [])
        _ONE_RANK[model] = result["dp"]["records"], load_file(str(tmp_path / f"{model}-1.json.safetensors"))
    return _ONE_RANK[model]


def assert_steps_of_one_rank(tmp_path, model, nproc, layouts):
    """Every layout of this world (dp on it included) took one rank's steps: loss, grad norm, weights within 1e-5."""
    records, weights = one_rank(tmp_path, model)
    here = load_file(str(tmp_path / f"{model}-{nproc}.json.safetensors"))
    result = json.loads((tmp_path / f"{model}-{nproc}.json").read_text())
    for name in ["dp", *layouts]:
        for step, (a, b) in enumerate(zip(result[name]["records"], records), 1):
            assert a["loss"] == pytest.approx(b["loss"], rel=TOLERANCE, abs=TOLERANCE), (name, nproc, step)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOLERANCE), (name, nproc, step)
        diff = max(float((here[f"{name}/{n}"] - w).abs().max()) for n, w in
                   ((k.split("/", 1)[1], w) for k, w in weights.items()))
        assert diff <= TOLERANCE, (name, nproc, diff)


def assert_same_steps(result, layouts):
    base = result["dp"]
    assert base["max_update"] > 20 * TOLERANCE  # the steps moved the weights far more than the tolerance
    for name in ["dp", *layouts]:  # the weight upload: every rank sends only its pieces, which tile the model
        got, world = result[name], len(result[name]["piece_bytes"])
        assert got["pieces_exact"], name
        assert got["built_exact"], name  # built in the layout, pieces only: the same weights and buffers
        assert sum(got["piece_bytes"]) == got["model_bytes"], name  # every element sent once, by one rank
        assert max(got["piece_bytes"]) < 1.2 * got["model_bytes"] / world, (name, got["piece_bytes"])  # balanced
    for name in layouts:
        got = result[name]
        for step, (a, b) in enumerate(zip(got["records"], base["records"]), 1):
            assert a["loss"] == pytest.approx(b["loss"], rel=TOLERANCE, abs=TOLERANCE), (name, step)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOLERANCE), (name, step)
        assert got["max_weight_diff"] <= TOLERANCE, name
        assert got["max_logprob_diff"] <= TOLERANCE, name
        assert got["param_bytes_rank"] < 0.6 * base["param_bytes_rank"], name  # each rank holds part of it


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-qwen2-gqa", marks=pytest.mark.slow(
    reason="suite time: the layouts run by default on tiny-llama"))])
def test_fsdp_and_tensor_parallel_on_two_ranks_take_the_steps_of_replicated_dp(tmp_path, model):
    result = sharded_steps(tmp_path, 2, model, ["fsdp", "tp2"])
    assert result["fsdp"]["layout"] == "fsdp x2" and result["tp2"]["layout"] == "dp x1 x tp 2"
    assert_same_steps(result, ["fsdp", "tp2"])
    assert_steps_of_one_rank(tmp_path, model, 2, ["fsdp", "tp2"])
    fsdp = result["fsdp"]  # bf16 compute: the reference kept in bf16 gives the fp32-master policy's logprobs
    assert fsdp["reference_dtypes"] == ["torch.bfloat16"] and fsdp["policy_dtypes"] == ["torch.float32"]
    assert fsdp["bf16_reference_exact"] and fsdp["root_sharded"]  # and no root left gathered after a forward


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-qwen2-gqa", marks=pytest.mark.slow(
    reason="suite time: the 4-rank layout runs by default on tiny-llama; Qwen2's biases and GQA on 2 ranks"))])
@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_fsdp_times_tensor_parallel_on_four_ranks_takes_the_steps_of_replicated_dp(tmp_path, model):
    result = sharded_steps(tmp_path, 4, model, ["fsdp+tp2"])
    assert result["fsdp+tp2"]["layout"] == "fsdp x2 x tp 2"
    assert_same_steps(result, ["fsdp+tp2"])
    assert_steps_of_one_rank(tmp_path, model, 4, ["fsdp+tp2"])


def test_a_layout_the_world_or_the_model_cannot_hold_is_named_with_the_valid_choices():
    gqa = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    assert layout_problems("fsdp", 2, 4, gqa) == []
    assert make_layout("fsdp", 2, 4, gqa) == Layout("fsdp", 2, 2)
    (problem,) = layout_problems("dp", 3, 4, None)
    assert "parallel.tp_size 3 does not divide the 4 train ranks" in problem and "valid tp sizes here: 1, 2, 4" in problem
    problems = layout_problems("dp", 4, 4, gqa)
    assert any("does not divide the model's 2 key/value heads" in p and "tp sizes this model takes: 1, 2" in p
               for p in problems), problems
    (problem,) = layout_problems("zero3", 1, 2, None)
    assert "parallel.layout 'zero3' is not a layout; choose one of: dp, fsdp" in problem
    with pytest.raises(ValueError, match="does not divide"):
        make_layout("fsdp", 3, 4, gqa)
    assert Layout("dp", 2, 2).dp_rank(3) == 1 and not Layout("dp", 4, 1).sharded and Layout("fsdp", 4, 1).sharded


def torchrun_script(script, nproc, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/tests/{script}", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_checkpoints_are_written_by_shard_and_resume_into_another_layout_and_world(tmp_path):
    """fsdp on 4 ranks → fsdp on 2; fsdp → replicated dp; tp 2 → fsdp; a replicated slot → fsdp: each resumed
    step equals the step the writer took after its save, and what is read back equals what was written, bit for
    bit. Each rank wrote only its own pieces; a checkpoint of another model is refused with what differs."""
    from safetensors.torch import load_file

    torchrun_script("sharded_resume.py", 4, "--save", f"fsdp:{tmp_path / 'fsdp4'}", "--out", str(tmp_path / "a.json"),
                    "--weights-dir", str(tmp_path))
    torchrun_script("sharded_resume.py", 2, "--load", f"{tmp_path / 'fsdp4'}:fsdp", "--pairs", "fsdp>dp,tp2>fsdp,dp>fsdp",
                    "--foreign", f"{tmp_path / 'fsdp4'}:tiny-qwen2-gqa", "--out", str(tmp_path / "b.json"),
                    "--weights-dir", str(tmp_path))
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    resumed, writer = b["load:fsdp4:fsdp"], a["save:fsdp"]
    assert resumed["loss"] == pytest.approx(writer["loss"], rel=TOLERANCE)
    assert resumed["grad_norm"] == pytest.approx(writer["grad_norm"], rel=TOLERANCE)
    after_writer = load_file(tmp_path / "save-fsdp.safetensors")
    after_resumed = load_file(tmp_path / "load-fsdp4-fsdp.safetensors")
    assert max(float((after_writer[k] - after_resumed[k]).abs().max()) for k in after_writer) <= TOLERANCE
    from rlhf.checkpoint.export import whole_model

    exported, at_save = whole_model(str(tmp_path / "fsdp4")), load_file(tmp_path / "at-save-fsdp.safetensors")
    assert sorted(exported) == sorted(at_save) and all(torch.equal(exported[k], at_save[k]) for k in at_save)
    shards = sorted((tmp_path / "fsdp4" / "shards").glob("*.safetensors"))
    sizes = [f.stat().st_size for f in shards]
    assert len(shards) == 4 and max(sizes) < 0.4 * sum(sizes)  # every rank its own quarter, none the whole
    assert not (tmp_path / "fsdp4" / "model.safetensors").exists()
    for pair in ("fsdp>dp", "tp2>fsdp", "dp>fsdp"):
        got = b[f"pair:{pair}"]
        assert got["loaded"]["loss"] == pytest.approx(got["saved"]["loss"], rel=TOLERANCE), pair
        assert got["loaded"]["grad_norm"] == pytest.approx(got["saved"]["grad_norm"], rel=TOLERANCE), pair
        assert got["max_weight_diff"] <= TOLERANCE, pair
        assert got["read_back_model_diff"] == 0.0 and got["read_back_optimizer_diff"] == 0.0, pair
        assert got["optimizer_keys"], pair
    assert "model.safetensors" not in b["pair:fsdp>dp"]["files"]  # rank 0 of a sharded layout: its pieces only
    assert "model.safetensors" in b["pair:dp>fsdp"]["files"]  # the replicated format, read into fsdp
    assert "does not fit this model" in b["foreign"] and "shapes" in b["foreign"]
    assert "k_proj.bias" in b["foreign"]  # Qwen2's q/k/v biases are missing from a Llama checkpoint


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_a_grpo_run_trains_sharded_verifies_its_weights_and_resumes_into_another_layout(tmp_path):
    """The runtime end to end: 2 train ranks under --parallel.layout fsdp, no warm start (each rank builds only its
    pieces; checkpoints by shard every step, the weights sent by piece and verified every step), then the same run
    directory resumed into tensor parallel (--parallel.tp_size 2) for two more steps."""
    from tests.test_runtime import assert_none_left, steps, torchrun

    run_dir = tmp_path / "run"
    first = subprocess.run(torchrun(run_dir, "--steps", "2", "--parallel.layout", "fsdp", "--sft.max_steps", "0"),
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["train_layout"] == "fsdp x2" and summary["steps"] == 2
    for rank in (0, 1):  # no warm start: each rank built only its pieces, straight into the layout
        assert "model built in its layout (fsdp x2), this rank's pieces only" in \
            (run_dir / "logs" / f"train-{rank}.log").read_text()
    assert [int(r["weights_verified"]) for r in steps(run_dir)] == [1, 1]
    slot = run_dir / "checkpoints" / "latest_even"
    assert sorted(p.name for p in (slot / "shards").iterdir()) == ["rank00000.safetensors", "rank00001.safetensors"]
    meta = json.loads((slot / "meta.json").read_text())
    assert "shards/rank00001.safetensors" in meta["files"] and "model.safetensors" not in meta["files"]
    out = subprocess.run([sys.executable, "-m", "rlhf.cli", "export", str(run_dir), str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exported step 2 from" in out.stderr and "latest_even" in out.stderr
    from rlhf.models import load_model_dir

    model, _ = load_model_dir(str(tmp_path / "hf"), torch.float32, torch.device("cpu"))  # an HF directory
    assert sum(p.numel() for p in model.parameters()) > 0
    missing = subprocess.run([sys.executable, "-m", "rlhf.cli", "export", str(run_dir), str(tmp_path / "x"), "--step",
                              "7"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode != 0 and "no valid checkpoint of step 7" in missing.stderr and "[1, 2]" in missing.stderr
    second = subprocess.run(torchrun(run_dir, "--steps", "4", "--parallel.tp_size", "2", "--sft.max_steps", "0"),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["train_layout"] == "dp x1 x tp 2" and summary["resumed_from_step"] == 2
    rows = steps(run_dir)
    assert [int(r["step"]) for r in rows][-2:] == [3, 4] and all(int(r["weights_verified"]) == 1 for r in rows)
    assert_none_left(run_dir)


def test_a_layout_the_world_cannot_hold_is_one_error_before_anything_starts(tmp_path):
    import os

    out = subprocess.run([sys.executable, "examples/grpo_trainer.py", "--parallel.tp_size", "3", "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "WORLD_SIZE": "2"})
    assert out.returncode == 2
    assert "parallel.tp_size 3 does not divide the 2 train ranks" in out.stderr
    assert "does not divide the model's 4 attention heads" in out.stderr
    assert not (tmp_path / "run").exists()


def run_fault_file(tmp_path, name):
    from tests.test_runtime import assert_none_left

    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/examples/grpo_trainer.py", "--run-dir", str(run_dir), "--faults",
           name, "--sft.max_steps", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert_none_left(run_dir)
    markers = [json.loads(line) for line in (run_dir / "faults" / "markers.jsonl").read_text().splitlines()]
    return run_dir, out, markers


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_a_rank_that_never_joins_an_fsdp_all_gather_is_named_in_seconds(tmp_path):
    """fsdp_all_gather_hang.yaml: rank 1 hangs at collective.all_gather in step 2; rank 0's heartbeat is inside the
    all-gather; the watchdog names train-1 within runtime.watchdog_stall_s and stops the run; diagnosis agrees."""
    from rlhf.diagnosis import diagnose

    run_dir, out, markers = run_fault_file(tmp_path, "fsdp_all_gather_hang")
    assert out.returncode != 0
    hang = next(m for m in markers if m["event"] == "inject")
    assert (hang["point"], hang["rank"], hang["step"]) == ("collective.all_gather", 1, 2)
    assert hang["context"]["stage"] == "reference"  # the first all-gather of the step: the reference forward
    stall = next(line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
                 if "stall watchdog" in line and " ERROR " in line)
    assert "train-0 has been inside all_gather(fsdp parameters)" in stall and "train-1" in stall
    from rlhf.diagnosis import stamp

    assert stamp(stall.split(" ", 1)[0]) - hang["time"] < 10.0  # named in seconds, not after an RPC timeout
    stuck = run_dir / "stacks" / "train-1.txt"  # hang forensics: every live process dumped its threads' stacks
    failed = next(line for line in (run_dir / "logs" / "controller-0.log").read_text().splitlines()
                  if "run failed" in line)
    assert f"its stacks: {stuck}" in failed, failed
    assert "rlhf/faults/kinds/hang.py" in stuck.read_text()  # where rank 1 is blocked
    assert "all_gather" in (run_dir / "stacks" / "train-0.txt").read_text()  # rank 0 waits inside the collective
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.stage, d.root.step, d.root.category) == ("train-1", "reference", 2, "hang")


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_an_oom_inside_rank_1s_fsdp_all_gather_is_diagnosed_on_rank_1(tmp_path):
    from rlhf.diagnosis import diagnose

    run_dir, out, markers = run_fault_file(tmp_path, "fsdp_all_gather_oom")
    assert out.returncode != 0
    first = next(m for m in markers if m["event"] == "inject")
    assert (first["point"], first["rank"]) == ("collective.all_gather", 1)
    assert "OutOfMemoryError" in (run_dir / "logs" / "train-1.log").read_text()
    d = diagnose(str(run_dir))
    assert (d.root.process, d.root.category) == ("train-1", "oom_device")
    assert d.root.exit == ""  # it raised and was stopped at the run's end: no death in the headline
