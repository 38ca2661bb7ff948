"""The decode attention's Triton kernel (rlhf/rollout/engine/decode_kernel.py) against the fused path.

It runs wherever Triton runs: on a GPU (tests/test_gpu.py runs it inside a captured graph) or in Triton's
interpreter on the CPU (`pip install triton` and TRITON_INTERPRET=1; the interpreter is slow, so the shapes are
small). Without Triton only the choice's error is checked here."""

import os

import pytest
import torch

from rlhf.data import encode_prompts
from rlhf.rollout.engine import RolloutEngine, SamplingParams, attention, decode_kernel
from tests.conftest import diverse_model

PROMPTS = ["1+2=", "33+44=", "98+99=", "7+8="]  # of different lengths: left pads


def test_triton_choice_without_triton_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(attention, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(decode_kernel, "triton", None)
    with pytest.raises(RuntimeError, match="RLHF_DECODE_ATTENTION=triton: needs the triton package"):
        attention.use_kernel(torch.device("cpu"), static=True)
    monkeypatch.setattr(attention, "DECODE_ATTENTION", "sdpa")
    assert not attention.use_kernel(torch.device("cpu"), static=True)  # the default: the fused path


@pytest.mark.skipif(not decode_kernel.available(torch.device("cpu")),
                    reason="needs triton and TRITON_INTERPRET=1 (the interpreter) on the CPU")
@pytest.mark.parametrize("layout", ["block", "grouped"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-gqa"])
def test_kernel_in_the_interpreter_samples_the_fused_paths_tokens(preset, layout, monkeypatch):
    """Static shapes (the CUDA-graph step) on the CPU: the kernel reads each row's real prompt columns and its own
    slots so far; the fused path reads every column, the rest masked. Same tokens, logprobs within fp32 rounding."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    model, tok = diverse_model(preset, seed=3)
    prompts = encode_prompts(tok, PROMPTS)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, n=2)
    got = {}
    for mode in ("sdpa", "triton"):
        monkeypatch.setattr(attention, "DECODE_ATTENTION", mode)
        engine = RolloutEngine(model, tok, seed=5)
        engine.layout = layout
        with torch.inference_mode():
            got[mode] = engine._decode(prompts, sp, static=True)
    assert got["triton"][0] == got["sdpa"][0]
    for a, b in zip(got["triton"][1], got["sdpa"][1]):
        assert a == pytest.approx(b, abs=1e-4)
    assert set(attention._KERNEL.values()) == {None}  # its check passed: the kernel ran


@pytest.mark.skipif(not decode_kernel.available(torch.device("cpu")),
                    reason="needs triton and TRITON_INTERPRET=1 (the interpreter) on the CPU")
@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 24)])  # plain; grouped-query, 24 padded to 32
def test_kernel_check_passes_in_the_interpreter(block, heads, kv_heads, head_dim):
    assert decode_kernel.check(block, heads, kv_heads, head_dim, torch.float32, torch.device("cpu")) is None


def test_a_kernel_that_fails_its_check_is_an_error_naming_the_configuration(monkeypatch):
    """The kernel's first use per configuration runs its check on random data on the device: a wrong result (here
    a stand-in that returns zeros) stops the call with the configuration and the error, before any step runs."""
    calls = []

    def wrong(q, *args):
        calls.append(1)
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)

    monkeypatch.setattr(attention, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(attention, "_KERNEL", {})
    monkeypatch.setattr(decode_kernel, "available", lambda device: True)
    monkeypatch.setattr(decode_kernel, "block_layout", wrong)
    model, tok = diverse_model("tiny-llama", seed=3)
    engine = RolloutEngine(model, tok, seed=5)
    engine.layout = "block"
    with torch.inference_mode(), pytest.raises(RuntimeError) as err:
        engine._decode(encode_prompts(tok, PROMPTS), SamplingParams(max_new_tokens=5, n=2), static=True)
    assert "the kernel's check failed for the block layout, 4/4 heads of" in str(err.value)
    assert "torch.float32 on cpu: max |kernel - reference| = " in str(err.value)
    assert calls == [1] and attention._KERNEL == {}


def test_the_checks_reference_is_the_fused_attention():
    """decode_kernel.reference (what the kernel must compute: each row its real prompt columns and its own slots up
    to t) equals the engine's fused block attention under the static mask of step t."""
    model, tok = diverse_model("tiny-llama-gqa", seed=3)
    engine = RolloutEngine(model, tok)
    H, Hkv, D, n, P, M, t = engine.num_heads, engine.num_kv_heads, engine.head_dim, 3, 7, 5, 2
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, Hkv, P + M * n, D, generator=gen)
    q = torch.randn(2 * n, H, D, generator=gen)
    start = torch.tensor([0, 4], dtype=torch.int32)
    pad = torch.zeros(2, 1, 1, P)
    pad[1, ..., :4] = float("-inf")
    bias = engine._block_bias(pad, n, P, M, static=True)
    own = engine._block_bias(None, n, 0, 1, static=False)
    for s in range(t + 1):
        bias.narrow(-1, P + s * n, n).copy_(own)
    state = {"Bp": 2, "n": n, "B": 2 * n, "width": (P + M * n, bias)}
    fused = engine._fused_block(q, kv, state)
    assert torch.allclose(decode_kernel.reference(q, kv, start, t, P, n), fused, atol=1e-5)
