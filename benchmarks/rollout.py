#!/usr/bin/env python
"""Rollout throughput: the native engine vs HF generate() on the default model.

Both decode the same prompts greedily for exactly --new-tokens tokens (EOS ignored, so both
do the same work), median of --repeats runs. Prints a table of tokens/s.

    python benchmarks/rollout.py                       # batches 64, 256, 512
    python benchmarks/rollout.py --batches 256 --new-tokens 32
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from rlhf.config import ModelConfig, TaskConfig  # noqa: E402
from rlhf.data import encode_prompts  # noqa: E402
from rlhf.models import build_model_and_tokenizer  # noqa: E402
from rlhf.rollout.engine import RolloutEngine  # noqa: E402
from rlhf.tasks import build_task  # noqa: E402


def hf_generate(model, prompt_ids, new_tokens, pad_id):
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    mask = (ids != pad_id).long()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    return (out.shape[1] - width) * out.shape[0]


def native_generate(engine, prompt_ids, new_tokens):
    res = engine.generate(prompt_ids, {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
                          return_logprob=True)
    return sum(len(r["output_ids"]) for r in res)


def timed_pair(fn_a, fn_b, repeats):
    """Tokens/s of two functions, runs interleaved (a, b, a, b, ...) so machine-speed drift hits both alike."""
    fn_a(), fn_b()  # warm-up
    times_a, times_b, tokens_a, tokens_b = [], [], 0, 0
    for _ in range(repeats):
        t = time.perf_counter()
        tokens_a = fn_a()
        times_a.append(time.perf_counter() - t)
        t = time.perf_counter()
        tokens_b = fn_b()
        times_b.append(time.perf_counter() - t)
    ratios = sorted(tb / ta for ta, tb in zip(times_a, times_b))
    return tokens_a / statistics.median(times_a), tokens_b / statistics.median(times_b), statistics.median(ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()
    model, tok = build_model_and_tokenizer(ModelConfig(name=args.model), seed=0)
    engine = RolloutEngine(model, tok)
    problems = build_task(TaskConfig()).split("train")
    print(f"model {args.model}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.new_tokens} new tokens per sample, greedy, median of {args.repeats} interleaved runs; speedup = median of per-pair ratios")
    print(f"| batch | native tokens/s | HF generate tokens/s | speedup |")
    print(f"|---:|---:|---:|---:|")
    for batch in args.batches:
        prompt_ids = encode_prompts(tok, [p.prompt for p in problems[:batch]])
        native, hf, speedup = timed_pair(lambda: native_generate(engine, prompt_ids, args.new_tokens),
                                         lambda: hf_generate(model, prompt_ids, args.new_tokens, tok.pad_token_id),
                                         args.repeats)
        print(f"| {batch} | {native:,.0f} | {hf:,.0f} | {speedup:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
