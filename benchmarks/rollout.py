#!/usr/bin/env python
"""Rollout throughput: the native engine vs HF generate() on the default model.

Two workloads, same model, same prompts, runs interleaved, median of --repeats:

  equal-work   greedy, exactly --new-tokens tokens per sample, EOS ignored: both engines do
               the same arithmetic, so this measures the decode loop itself.
  grpo         the GRPO rollout of the default config on the SFT-warmed model: n=8 samples per
               prompt, temperature 1, stop at EOS, max_new_tokens 6 (--grpo-new-tokens).
               tokens = generated tokens up to and including EOS.

batch = samples per call (prompts x n for grpo). The native engine computes the samples of a prompt that drew
the same tokens once, and a prefix common to several prompts once in the prefill; RLHF_ROLLOUT_SHARE=0 python
benchmarks/rollout.py measures it computing every row.

    python benchmarks/rollout.py                       # batches 64, 256, 512
    python benchmarks/rollout.py --batches 256 --new-tokens 32
    python benchmarks/rollout.py --model llama-110m --batches 64 --new-tokens 32 --grpo-new-tokens 32 \
        --warm-steps 30 --warm-batch 32 --warm-lr 3e-4 --repeats 3     # the ~110 M model, batch 64 x 32
    python benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 \
        --new-tokens 128 --warm-steps 0 --repeats 3 --profile       # + where one native call's time goes

--profile: one more native equal-work call of the last batch under torch.profiler; prints the call's wall time, its
operators by self device (or CPU) time, and the share of the wall time the device was busy.
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


def _device(model):
    return next(model.parameters()).device


def hf_generate(model, prompt_ids, new_tokens, pad_id):
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=_device(model))
    mask = (ids != pad_id).long()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    if out.is_cuda:
        torch.cuda.synchronize()
    return (out.shape[1] - width) * out.shape[0]


def hf_rollout(model, prompt_ids, n, max_new, pad_id, eos_id):
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=_device(model))
    mask = (ids != pad_id).long()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                             pad_token_id=pad_id, eos_token_id=eos_id)
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += (row.index(eos_id) + 1) if eos_id in row else len(row)
    return tokens


def native_rollout(engine, prompt_ids, n, max_new):
    # token ids and logprobs, no text: HF generate returns ids only (the rollout server decodes in its reply)
    res = engine.generate(prompt_ids, {"max_new_tokens": max_new, "temperature": 1.0, "n": n}, return_logprob=True,
                          detokenize=False)
    return sum(len(r["output_ids"]) for r in res)


def warm_model(model, tok, steps, batch_size=256, lr=1e-3):
    """SFT the model as the default run's warm start does, so it stops at EOS like a real policy."""
    import logging

    from rlhf.config import Config
    from rlhf.tasks import build_task
    from rlhf.tasks.scoring import scorer_of
    from rlhf.trainers.sft import run_sft

    logging.getLogger("rlhf").setLevel(logging.ERROR)  # the warm model's own line below says where SFT stopped
    cfg = Config()
    cfg.sft.max_steps = steps
    cfg.sft.batch_size = batch_size
    cfg.sft.lr = lr
    result = run_sft(cfg, model, tok, build_task(cfg.task), scorer_of(cfg.reward))
    return result


def native_generate(engine, prompt_ids, new_tokens):
    res = engine.generate(prompt_ids, {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
                          return_logprob=True, detokenize=False)  # ids and logprobs, as native_rollout
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
    timed_pair.last_tokens = (tokens_a, tokens_b)  # the last run's tokens, for the workload's lengths
    return tokens_a / statistics.median(times_a), tokens_b / statistics.median(times_b), statistics.median(ratios)


def profile_call(engine, prompt_ids, new_tokens) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = _device(engine.model).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    native_generate(engine, prompt_ids, new_tokens)  # warm
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        native_generate(engine, prompt_ids, new_tokens)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e6  # us -> s
    print(f"\nprofile of one native call ({len(prompt_ids)} x {new_tokens} tokens): {wall:.3f} s wall (profiled), "
          f"{'device' if cuda else 'CPU'} busy {busy:.3f} s ({busy / wall:.0%})")
    print(events.table(sort_by=key, row_limit=18, max_name_column_width=60))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="tiny-llama", help="model preset (llama-110m: the ~110 M-param one)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="the native engine's dtype (float32, bfloat16)")
    parser.add_argument("--hf-dtype", default="float32", help="HF generate's dtype (the peer)")
    parser.add_argument("--warm-steps", type=int, default=600,
                        help="max SFT steps for the grpo workload's warm model (band stop as in the default run); 0 skips it")
    parser.add_argument("--warm-batch", type=int, default=256, help="SFT examples per warm-up step")
    parser.add_argument("--warm-lr", type=float, default=1e-3, help="SFT learning rate of the warm-up")
    parser.add_argument("--grpo-new-tokens", type=int, default=6,
                        help="max_new_tokens of the grpo workload (the default config's is 6)")
    parser.add_argument("--profile", action="store_true", help="profile one native call of the last batch")
    args = parser.parse_args()
    model, tok = build_model_and_tokenizer(ModelConfig(name=args.model, device=args.device, dtype=args.hf_dtype), seed=0)
    ours = model if args.dtype == args.hf_dtype else \
        build_model_and_tokenizer(ModelConfig(name=args.model, device=args.device, dtype=args.dtype), seed=0)[0]
    engine = RolloutEngine(ours, tok, seed=0)
    problems = build_task(TaskConfig()).split("train")
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    print(f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params), native "
          f"{args.dtype} vs HF generate {args.hf_dtype}, torch {torch.__version__}, {where}, "
          f"median of {args.repeats} interleaved runs; speedup = median of per-pair ratios\n")
    print("| workload | batch | native tokens/s | HF generate tokens/s | speedup |")
    print("|---|---:|---:|---:|---:|")
    for batch in args.batches:
        prompt_ids = encode_prompts(tok, [p.prompt for p in problems[:batch]])
        native, hf, speedup = timed_pair(lambda: native_generate(engine, prompt_ids, args.new_tokens),
                                         lambda: hf_generate(model, prompt_ids, args.new_tokens, tok.pad_token_id),
                                         args.repeats)
        print(f"| equal-work ({args.new_tokens} tok) | {batch} | {native:,.0f} | {hf:,.0f} | {speedup:.2f}x |",
              flush=True)
    if args.profile:
        profile_call(engine, encode_prompts(tok, [p.prompt for p in problems[: args.batches[-1]]]), args.new_tokens)
    if args.warm_steps:
        warm = warm_model(model, tok, args.warm_steps, args.warm_batch, args.warm_lr)
        if ours is not model:
            ours.load_state_dict(model.state_dict())
        lengths = []
        for batch in args.batches:
            n = 8
            prompt_ids = encode_prompts(tok, [p.prompt for p in problems[: batch // n]])
            native, hf, speedup = timed_pair(
                lambda: native_rollout(engine, prompt_ids, n, args.grpo_new_tokens),
                lambda: hf_rollout(model, prompt_ids, n, args.grpo_new_tokens, tok.pad_token_id, tok.eos_token_id),
                args.repeats)
            print(f"| grpo (n=8, T=1, EOS, {args.grpo_new_tokens} max) | {batch} | {native:,.0f} | {hf:,.0f} | "
                  f"{speedup:.2f}x |", flush=True)
            lengths.append(f"batch {batch}: {timed_pair.last_tokens[0] / batch:.1f} native, "
                           f"{timed_pair.last_tokens[1] / batch:.1f} HF")
        print(f"\nwarm model: SFT stopped at step {warm['sft_steps']} ({warm['sft_stopped']}, "
              f"val accuracy {warm['sft_val_accuracy']:.2f}); grpo mean completion tokens (incl. EOS) "
              + "; ".join(lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
