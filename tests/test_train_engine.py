"""The train engine: a GRPO step changes parameters, SFT learns, micro-batching is exact."""

import copy

import pytest
import torch

from rlhf.config import AlgorithmConfig, OptimConfig, TaskConfig
from rlhf.data import build_rl_batch, build_sft_batch, encode_prompts
from rlhf.rollout.engine import RolloutEngine
from rlhf.tasks import build_task
from rlhf.train.engine import TrainEngine
from rlhf.weights import checksum, export_state, from_safetensors_bytes, import_state, to_safetensors_bytes


def _rl_batch(model, tok, group=4):
    prompts = encode_prompts(tok, ["1+2=", "33+44=", "5+66=", "98+9="])
    results = RolloutEngine(model, tok, seed=0).generate(
        prompts, {"max_new_tokens": 5, "temperature": 1.0, "n": group}, return_logprob=True)
    batch = build_rl_batch([p for p in prompts for _ in range(group)], results, tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["input_ids"].shape[0], generator=gen)
    return batch


def test_parameters_change_after_one_grpo_step(diverse):
    model = copy.deepcopy(diverse[0])
    engine = TrainEngine(model, OptimConfig(warmup_steps=0), AlgorithmConfig(kl_coef=0.05))
    batch = _rl_batch(model, diverse[1])
    batch["ref_logprobs"] = engine.compute_logprobs(batch, "reference")
    before = {k: v.clone() for k, v in export_state(model).items()}
    metrics = engine.train_step(batch)
    changed = [k for k, v in export_state(model).items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"
    assert engine.optimizer_steps == 2  # mini_batches=2
    assert metrics["tokens"] == batch["response_mask"].sum().item()
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    # the reference model stayed frozen
    assert checksum(export_state(engine.reference)) == checksum(before)


def test_micro_batching_gives_the_same_gradient(diverse):
    model, tok = diverse
    batch = _rl_batch(model, tok)
    batch["ref_logprobs"] = batch["old_logprobs"] + 0.1 * batch["response_mask"]
    updates = []
    for micro in (16, 3):
        m = copy.deepcopy(model)
        engine = TrainEngine(m, OptimConfig(micro_batch_size=micro, mini_batches=1, grad_clip=0, warmup_steps=0),
                             AlgorithmConfig(kl_coef=0.1), keep_reference=False)
        engine.optimizer = torch.optim.SGD(engine.params, lr=1.0)  # update = -gradient
        before = {k: v.clone() for k, v in export_state(m).items()}
        engine.train_step(batch)
        updates.append({k: v - before[k] for k, v in export_state(m).items()})
    for name in updates[0]:
        assert torch.allclose(updates[0][name], updates[1][name], atol=1e-6), name
    assert any(u.abs().max() > 1e-4 for u in updates[0].values())


def test_sft_loss_decreases(tiny):
    model = copy.deepcopy(tiny[0])
    tok = tiny[1]
    task = build_task(TaskConfig())
    engine = TrainEngine(model, OptimConfig(warmup_steps=0), keep_reference=False, lr=3e-3)
    batch = build_sft_batch(tok, task.split("train")[:64])
    losses = [engine.sft_step(batch)["loss"] for _ in range(30)]
    assert losses[-1] < 0.6 * losses[0], losses


def test_warmup_ramps_the_learning_rate(tiny):
    engine = TrainEngine(copy.deepcopy(tiny[0]), OptimConfig(lr=1e-3, warmup_steps=4), keep_reference=False)
    seen = []
    for _ in range(6):
        seen.append(engine.current_lr())
        engine.optimizer_steps += 1
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_weights_roundtrip_through_safetensors_bytes(diverse, tiny):
    src = export_state(diverse[0])
    dst = copy.deepcopy(tiny[0])
    assert checksum(export_state(dst)) != checksum(src)
    import_state(dst, from_safetensors_bytes(to_safetensors_bytes(src)))
    assert checksum(export_state(dst)) == checksum(src)
    with pytest.raises(ValueError, match="missing"):
        import_state(dst, {k: v for k, v in src.items() if "layers.0." not in k})


def test_rl_batch_pads_each_row_and_masks_only_its_response():
    """The batch the train ranks get, against a row-by-row construction: prompt + response right-padded, the
    attention mask over both, the response mask and the rollout logprobs over the response only."""
    import random

    from rlhf.data import rl_batch

    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 9))] for _ in range(13)]
    outputs = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 7))] for _ in range(13)]
    logprobs = [[-rng.random() * 5 for _ in o] for o in outputs]
    batch = rl_batch(prompts, outputs, logprobs, pad_id=0)
    width = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    assert batch["input_ids"].shape == (13, width)
    for i, (p, o, lp) in enumerate(zip(prompts, outputs, logprobs)):
        a, b = len(p), len(p) + len(o)
        assert batch["input_ids"][i].tolist() == p + o + [0] * (width - b)
        assert batch["attention_mask"][i].tolist() == [1] * b + [0] * (width - b)
        assert batch["response_mask"][i].tolist() == [0.0] * a + [1.0] * len(o) + [0.0] * (width - b)
        assert batch["old_logprobs"][i].tolist() == [0.0] * a + torch.tensor(lp).tolist() + [0.0] * (width - b)
    with pytest.raises(ValueError, match="sample 2: rollout result has 3 tokens but 2 logprobs"):
        rl_batch(prompts[:3], outputs[:2] + [[1, 2, 3]], logprobs[:2] + [[-1.0, -2.0]], pad_id=0)
