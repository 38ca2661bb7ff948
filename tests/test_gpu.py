"""On a GPU (skipped without CUDA): the runtime end to end on one card, bf16, nvidia-ml-py samples,
the rollout engine matching HF generate on CUDA, and device faults with a real OutOfMemoryError."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def _run(*args, torchrun=False, timeout=600):
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node=2"] if torchrun else []) + \
          [f"{ROOT}/examples/grpo_trainer.py", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return out


def test_two_ranks_share_one_gpu_with_colocation_and_meta_weights(tmp_path):
    run = tmp_path / "run"
    out = _run("--preset", "smoke", "--steps", "3", "--run-dir", str(run), "--model.device", "cuda",
               "--colocate", "--rollout.servers", "2", "--weights.mode", "meta", torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["colocate"] and summary["steps"] == 3
    rows = list(csv.DictReader((run / "steps.csv").open()))
    assert [r["weights_verified"] for r in rows] == ["1", "1", "1"]
    # colocation frees memory for real: the train side's params + AdamW state leave the GPU at rollout_start,
    # the rollout servers' weights at rollout_end
    assert all(float(r["train_offload_mb"]) > 1.0 and float(r["rollout_release_mb"]) > 0.5 for r in rows), rows
    logs = (run / "logs" / "controller-0.log").read_text()
    assert "train-0 on cuda:0, gloo collectives" in logs  # NCCL refuses two ranks on one GPU: gloo carries CUDA tensors
    assert "on cuda:0" in (run / "logs" / "rollout-1.log").read_text()


def test_cuda_ipc_weights_reach_two_rollout_servers_device_to_device(tmp_path):
    """weights.transport cuda_ipc with 2 train ranks (each sends its share of the rows) and 2 rollout servers (each
    its own handle): every step's weights verified on both servers, mapped from the train ranks' GPU memory."""
    from rlhf.tracing.read import load_spans

    run = tmp_path / "run"
    out = _run("--preset", "smoke", "--steps", "3", "--run-dir", str(run), "--model.device", "cuda",
               "--model.dtype", "bfloat16", "--rollout.servers", "2", "--weights.transport", "cuda_ipc", torchrun=True)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = list(csv.DictReader((run / "steps.csv").open()))
    assert [r["weights_verified"] for r in rows] == ["1", "1", "1"]
    root = load_spans(str(run)).step_roots()[2]
    opened = sorted((s.service, s.attributes["rlhf.shard"]) for s, _ in root.walk() if s.name == "weights.cuda_ipc_open")
    assert opened == [(f"rollout-{r}", f"rank{t}") for r in (0, 1) for t in (0, 1)], opened
    pushed = [s for s, _ in root.walk() if s.name == "weights.push_shard"]
    assert len(pushed) == 2 and all(s.attributes["rlhf.bytes"] > 0 for s in pushed)


def test_bf16_run_trains_and_rolls_out(tmp_path):
    run = tmp_path / "run"
    out = _run("--preset", "smoke", "--steps", "3", "--run-dir", str(run), "--model.device", "cuda",
               "--model.dtype", "bfloat16")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = list(csv.DictReader((run / "steps.csv").open()))
    assert len(rows) == 3 and [r["weights_verified"] for r in rows] == ["1", "1", "1"]  # bf16 bytes match exactly
    assert all(abs(float(r["kl"])) < 1.0 and float(r["response_length"]) > 0 for r in rows)
    assert "bfloat16 on cuda:0" in (run / "logs" / "rollout-0.log").read_text()


def test_nvidia_ml_py_samples_land_in_metrics(tmp_path):
    run = tmp_path / "run"
    out = _run("--preset", "smoke", "--steps", "2", "--run-dir", str(run), "--model.device", "cuda")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = list(csv.DictReader((run / "metrics" / "train-0.csv").open()))
    sampled = [r for r in rows if r["gpu_mem_used_bytes"]]
    assert sampled and int(sampled[-1]["gpu_mem_used_bytes"]) > 0 and float(sampled[-1]["gpu_power_w"]) > 0


def test_rollout_engine_on_cuda_equals_hf_generate():
    from rlhf.data import encode_prompts
    from rlhf.rollout.engine import RolloutEngine
    from tests.conftest import diverse_model

    model, tok = diverse_model("tiny-llama-gqa", seed=3)
    model = model.cuda()
    prompt_ids = encode_prompts(tok, ["1+2=", "33+44=", "5+66=", "98+99="])
    ours = RolloutEngine(model, tok).generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids], device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    assert [r["output_ids"] for r in ours] == out[:, width:].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["block", "grouped"])
def test_decode_kernel_in_a_cuda_graph_samples_the_fused_paths_tokens(layout, dtype, monkeypatch):
    """The Triton decode attention inside the captured decode step (each row reads its real prompt columns and
    its slots so far) against the fused path's graph (every slot, the future masked): prompts with left pads,
    groups of 4, sampled; the kernel ran (its first use checked, not turned off)."""
    from rlhf.data import encode_prompts
    from rlhf.rollout.engine import RolloutEngine, attention, decode_kernel
    from tests.conftest import diverse_model

    assert decode_kernel.available(torch.device("cuda")), "triton does not import on this GPU machine"
    model, tok = diverse_model("tiny-llama-gqa", seed=3)
    model = model.to("cuda", dtype)
    prompt_ids = encode_prompts(tok, ["1+2=", "33+44=", "5+66=", "98+99=", "0+0=", "7+8="])
    got = {}
    for mode in ("sdpa", "triton"):
        monkeypatch.setattr(attention, "DECODE_ATTENTION", mode)
        monkeypatch.setattr(attention, "_KERNEL", {})
        engine = RolloutEngine(model, tok, seed=5)
        engine.layout = layout
        got[mode] = engine.generate(prompt_ids, {"max_new_tokens": 12, "temperature": 1.0, "n": 4,
                                                 "ignore_eos": True}, return_logprob=True)
        if mode == "triton":
            assert list(attention._KERNEL.values()) == [None]  # checked on the device, used
    lp = {m: [x[0] for r in got[m] for x in r["meta_info"]["output_token_logprobs"]] for m in got}
    if dtype == torch.float32:
        assert [r["output_ids"] for r in got["triton"]] == [r["output_ids"] for r in got["sdpa"]]
        assert lp["triton"] == pytest.approx(lp["sdpa"], abs=1e-3)
    else:  # bf16 rounding moves some draws: most tokens agree, and the first step's (same prefill) all do
        same = [a == b for ra, rb in zip(got["triton"], got["sdpa"]) for a, b in zip(ra["output_ids"], rb["output_ids"])]
        assert sum(same) >= 0.7 * len(same)
        assert [r["output_ids"][0] for r in got["triton"]] == [r["output_ids"][0] for r in got["sdpa"]]


def test_scenario3_oom_is_a_real_cuda_out_of_memory(tmp_path):
    """device_memory_pressure on a GPU takes real memory; the train step dies of the allocator's own error."""
    run = tmp_path / "run"
    out = _run("--faults", "examples/faults/scenario3.yaml", "--run-dir", str(run), "--model.device", "cuda",
               torchrun=True, timeout=300)
    assert out.returncode != 0
    train1 = (run / "logs" / "train-1.log").read_text()
    assert "CUDA out of memory" in train1 and "emulated" not in train1
    markers = [json.loads(line) for line in (run / "faults" / "markers.jsonl").read_text().splitlines()]
    # the first trigger already fails (all but capacity_mb - start_mb is taken, less than the probe): its inject
    # marker is the one written, and it says the effect was real
    fired = [m for m in markers if m.get("kind") == "device_memory_pressure" and m.get("event") == "inject"]
    assert fired and all(m["emulated"] is False for m in fired) and fired[0]["role"] == "train" and fired[0]["rank"] == 1
    free, _ = torch.cuda.mem_get_info()
    assert free > 8 << 30  # restored: the memory went back when the run ended


def test_sharded_layouts_on_one_gpu_take_the_steps_of_replicated_dp(tmp_path):
    """FSDP2 and tensor parallel on CUDA tensors, 2 ranks sharing the GPU (gloo: NCCL refuses two ranks of one
    communicator on one GPU), take replicated dp's steps; each rank holds its part."""
    from tests.test_runtime import free_port
    from tests.test_sharding import assert_same_steps

    out = tmp_path / "cuda.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", f"{ROOT}/tests/sharded_steps.py", "--model", "tiny-qwen2-gqa",
           "--layouts", "fsdp,tp2", "--steps", "3", "--out", str(out), "--device", "cuda"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps({k: {x: v[x] for x in ("max_weight_diff", "max_logprob_diff") if x in v}
                      for k, v in result.items()}))
    assert_same_steps(result, ["fsdp", "tp2"])
    assert result["fsdp"]["bf16_reference_exact"] and result["fsdp"]["root_sharded"]


def _scenario6(tmp_path, **params):
    import yaml

    spec = yaml.safe_load(open(f"{ROOT}/examples/faults/scenario6.yaml"))
    spec["faults"][0]["params"].update(params)
    path = tmp_path / "scenario6.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_scenario6_device_memory_leak_is_real_on_a_gpu(tmp_path):
    """The leak takes the card for real (the whole card: leak_mb = capacity_mb, since a tiny model fits in the
    2.9 GB the scenario's values leave); the next allocation that does not fit fails with CUDA's own OOM, in
    another process than the leaking rollout-0."""
    run = tmp_path / "run"
    out = _run("--faults", str(_scenario6(tmp_path, leak_mb=81920)), "--run-dir", str(run), "--model.device", "cuda",
               torchrun=True, timeout=300)
    assert out.returncode != 0
    markers = [json.loads(line) for line in (run / "faults" / "markers.jsonl").read_text().splitlines()]
    fired = [m for m in markers if m.get("kind") == "device_memory_leak" and m.get("event") == "inject"]
    assert fired and fired[0]["emulated"] is False and fired[0]["role"] == "rollout", fired
    logs = {p.stem: p.read_text() for p in (run / "logs").glob("*.log")}
    ooms = [name for name, text in logs.items() if "CUDA out of memory" in text and name != "rollout-0"]
    print("real OOM in:", ooms, "| last error:", out.stderr.strip().splitlines()[-1][:400])
    assert ooms and not any("emulated device ledger" in logs[n] for n in ooms), sorted(logs)
    free, _ = torch.cuda.mem_get_info()
    assert free > 8 << 30  # the card came back when the run ended


def test_scenario6_hardened_names_the_leaking_server_at_its_release(tmp_path):
    """verify_release on a GPU reads what the allocator still holds after the release: rollout-0 is named at once."""
    run = tmp_path / "run"
    out = _run("--faults", str(_scenario6(tmp_path, leak_mb=81920)), "--run-dir", str(run), "--model.device", "cuda",
               "--resilience", "hardened", torchrun=True, timeout=300)
    assert out.returncode != 0
    assert "DeviceMemoryNotReleased" in out.stderr and "rollout-0 still holds" in out.stderr, out.stderr[-3000:]


def test_megatron_engine_logprobs_and_steps_equal_the_native_engines(tmp_path, monkeypatch):
    """megatron-core's GPTModel (local spec) converted from the HF model: the same weights back by HF name, the same
    logprobs (fp32 tight, bf16 within its rounding), and the same 3 GRPO train steps as the native engine."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from rlhf.config import AlgorithmConfig, ModelConfig, OptimConfig
    from rlhf.models import build_model_and_tokenizer
    from rlhf.train.engine import TrainEngine, token_logprobs
    from rlhf.train.megatron import MegatronCausalLM, init_parallel
    from tests.sharded_steps import global_batch
    from tests.test_runtime import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        init_parallel(seed=0)
        hf, _ = build_model_and_tokenizer(ModelConfig(name="tiny-qwen2-gqa", dtype="float32"), seed=11, device="cuda")
        mc = MegatronCausalLM.from_hf(hf)
        back, params = mc.hf_state_dict(), dict(hf.named_parameters())
        assert sorted(back) == sorted(params) and all(torch.equal(back[n], p) for n, p in params.items())
        batch = {k: v.cuda() for k, v in global_batch(hf.config.vocab_size).items()}
        ids, mask, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        with torch.no_grad():
            a, _ = token_logprobs(hf, ids, mask, loss_mask=resp, whole=True)
            b, _ = token_logprobs(mc, ids, mask, loss_mask=resp, whole=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                a16, _ = token_logprobs(hf, ids, mask, loss_mask=resp, whole=True)
                b16, _ = token_logprobs(mc, ids, mask, loss_mask=resp, whole=True)
        fp32, bf16 = float((a - b).abs().max()), float((a16 - b16).abs().max())
        print(f"megatron vs native logprobs: fp32 max diff {fp32:.2e}, bf16 max diff {bf16:.2e}")
        assert fp32 < 1e-4 and bf16 < 0.1
        records = {}
        for name, model in (("native", hf), ("megatron", mc)):
            engine = TrainEngine(model, OptimConfig(micro_batch_size=4, warmup_steps=0), AlgorithmConfig(kl_coef=0.05))
            part = dict(batch)
            part["old_logprobs"] = engine.compute_logprobs(part, "policy")
            part["ref_logprobs"] = engine.compute_logprobs(part, "reference")
            records[name] = [engine.train_step(part)["loss"] for _ in range(3)]
        print("losses", records)
        assert records["megatron"] == pytest.approx(records["native"], rel=1e-3, abs=1e-5)
        after = mc.hf_state_dict()
        assert max(float((after[n] - p.detach()).abs().max()) for n, p in hf.named_parameters()) < 1e-4
    finally:
        dist.destroy_process_group()


def test_megatron_engine_runs_grpo_with_verified_weights_and_resumes(tmp_path):
    """--train.engine megatron end to end: 3 GRPO steps whose weights (HF names, from the GPTModel) the rollout
    server verifies every step, a checkpoint, and the same run resumed for 2 more."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    out = _run("--preset", "smoke", "--steps", "3", "--run-dir", str(run), "--model.device", "cuda",
               "--train.engine", "megatron", "--sft.max_steps", "0")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "megatron-core GPTModel engine" in (run / "logs" / "train-0.log").read_text()
    rows = list(csv.DictReader((run / "steps.csv").open()))
    assert [r["weights_verified"] for r in rows] == ["1", "1", "1"]
    again = _run("--preset", "smoke", "--steps", "5", "--run-dir", str(run), "--model.device", "cuda",
                 "--train.engine", "megatron", "--sft.max_steps", "0")
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 3
    rows = list(csv.DictReader((run / "steps.csv").open()))
    assert [int(r["step"]) for r in rows][-2:] == [4, 5] and all(r["weights_verified"] == "1" for r in rows)
