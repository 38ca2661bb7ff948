import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny():
    """A random-init tiny Llama and the char tokenizer (session-wide; tests must not mutate it)."""
    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer

    return build_model_and_tokenizer(ModelConfig(name="tiny-llama"), seed=0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def diverse_model(preset: str = "tiny-llama", seed: int = 0):
    """A random model with large weights, so greedy outputs differ between prompts and steps.

    The default init (std 0.02) gives a near-uniform model that repeats one token everywhere,
    which would make token-for-token comparisons trivially true.
    """
    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer(ModelConfig(name=preset), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model, tok


@pytest.fixture(scope="session")
def diverse():
    return diverse_model("tiny-llama", seed=0)
