"""The native rollout engine (`RolloutEngine`): batched sampling over a static KV cache, groups sharing their prompt.

What is where (the engine's own docstring, in `engine.py`, says how one call runs):

    engine.py       RolloutEngine: the interface (generate, prompt_logprobs, weight updates, checksum)
    decode.py       the decode loop of one call: caches, prefill, sample, stop, cut and share rows
    forward.py      the prefill and one decode step through the layers
    attention.py    attention over the KV cache in the block and grouped layouts, the block mask, relayout
    decode_kernel.py  the decode attention as one Triton kernel (RLHF_DECODE_ATTENTION=triton), its check
    fused.py        the weights as the loop reads them (fused, paired for RoPE, norms folded), rotary tables
    kernels.py      norms, the residual matmul, the rotary multiply, the gated MLP
    layout.py       the prefix plan, the layouts' limits and knobs, StepControl (between-step hooks)
    sampling.py     SamplingParams (sglang's), sample_tokens, inverse_cdf
    cuda_graphs.py  one decode step captured as a CUDA graph
"""

from rlhf.rollout.engine.engine import SUPPORTED_MODEL_TYPES, RolloutEngine
from rlhf.rollout.engine.layout import (
    BLOCK_COLUMNS,
    LAYOUTS,
    PREFILL_SHARE_AT,
    RELAYOUT,
    SHARE_AT,
    StepControl,
    prefix_plan,
)
from rlhf.rollout.engine.sampling import CDF_BLOCK, SamplingParams, inverse_cdf, sample_tokens

__all__ = ["BLOCK_COLUMNS", "CDF_BLOCK", "LAYOUTS", "PREFILL_SHARE_AT", "RELAYOUT", "SHARE_AT", "SUPPORTED_MODEL_TYPES",
           "RolloutEngine", "SamplingParams", "StepControl", "inverse_cdf", "prefix_plan", "sample_tokens"]
