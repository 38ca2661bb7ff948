"""--train.engine megatron off the GPU: the flag is one clear error on a CPU, and the HF <-> megatron-core weight
conversion (fused QKV per query group, fc1 = [gate; up]) names every GPTModel parameter and goes both ways exactly.
Its forward, logprobs, train steps and a GRPO run are GPU tests (tests/test_gpu.py): megatron-core's GPTModel
needs CUDA."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_the_megatron_engine_on_a_cpu_is_one_clear_error_before_anything_starts(tmp_path):
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--train.engine", "megatron",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "train.engine megatron needs CUDA" in out.stderr and "model.device is 'cpu'" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started
    from rlhf.cli_args import make_parser, parse_config  # the same parsing and checks, in this process

    with pytest.raises(SystemExit) as bad:
        parse_config(["--train.engine", "megatron", "--parallel.layout", "fsdp"], make_parser("grpo_trainer.py", "t"))
    assert bad.value.code == 2


CHECK = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
from rlhf.config import ModelConfig
from rlhf.models import build_model_and_tokenizer
from rlhf.train.megatron import MegatronCausalLM, hf_to_megatron
out = {{}}
for preset in ("tiny-llama-gqa", "tiny-qwen2-gqa"):
    hf, _ = build_model_and_tokenizer(ModelConfig(name=preset, dtype="float32"), seed=3, device="cpu")
    mc = MegatronCausalLM.from_hf(hf, cpu_init=True)  # construction runs on a CPU; the forward needs CUDA
    params, back = dict(hf.named_parameters()), mc.hf_state_dict()
    names = sorted(n for n, _ in mc.gpt.named_parameters())
    converted = hf_to_megatron(params, hf.config)
    c = hf.config
    H, G = c.num_attention_heads, c.num_key_value_heads
    D = c.hidden_size // H
    qkv = converted["decoder.layers.0.self_attention.linear_qkv.weight"].view(G, (H // G + 2) * D, -1)
    q = params["model.layers.0.self_attn.q_proj.weight"].view(G, H // G * D, -1)
    k = params["model.layers.0.self_attn.k_proj.weight"].view(G, D, -1)
    out[preset] = {{
        "names_match": sorted(converted) == names,
        "round_trip": sorted(back) == sorted(params) and all(torch.equal(back[n], p) for n, p in params.items()),
        "group_layout": bool(torch.equal(qkv[1, :H // G * D], q[1]) and torch.equal(qkv[1, H // G * D:H // G * D + D], k[1])),
        "biases": sorted(n for n in converted if n.endswith("bias")),
    }}
print(json.dumps(out))
"""


@pytest.mark.slow  # the suite's time (README: `pytest -m slow`)
def test_hf_and_megatron_weights_convert_both_ways_exactly():
    pytest.importorskip("megatron.core")
    from tests.test_runtime import free_port

    out = subprocess.run([sys.executable, "-c", CHECK.format(root=ROOT, port=free_port())], capture_output=True,
                         text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for preset, check in got.items():
        assert check["names_match"] and check["round_trip"] and check["group_layout"], (preset, check)
    assert got["tiny-llama-gqa"]["biases"] == []  # Llama: no biases; Qwen2: q/k/v biases, fused like the weights
    assert got["tiny-qwen2-gqa"]["biases"] == [f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in (0, 1)]
