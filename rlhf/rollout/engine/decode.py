"""The decode loop of one generate call: layout and caches, the prefill, then sample, stop, cut finished rows,
share distinct sequences, step again; one host transfer at the end."""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhf.rollout.engine.attention import use_kernel
from rlhf.rollout.engine.layout import BLOCK_COLUMNS, PREFILL_SHARE_AT, RELAYOUT, SHARE_AT, StepControl, prefix_plan
from rlhf.rollout.engine.sampling import SamplingParams, sample_tokens


class DecodeLoop:
    """The generate call's loop (a part of RolloutEngine)."""

    def _decode(self, prompts: list[list[int]], sp: SamplingParams, static: bool | None = None, top: int = 0,
                control: StepControl | None = None):
        device, dtype = self.device, self.dtype
        if static is None:  # CUDA: static shapes and a captured decode step (RLHF_CUDA_GRAPHS=0 turns it off)
            static = device.type == "cuda" and os.environ.get("RLHF_CUDA_GRAPHS", "1") != "0"
        Bp, n, M = len(prompts), sp.n, sp.max_new_tokens
        lengths = [len(p) for p in prompts]
        B, P = Bp * n, max(lengths)
        if min(lengths) == P:  # no pads: no masks anywhere
            ids, valid = torch.tensor(prompts, device=device), None
        else:
            ids = torch.full((Bp, P), self.pad_token_id, dtype=torch.long)
            valid = torch.zeros((Bp, P), dtype=torch.bool)
            for i, p in enumerate(prompts):  # left padding: every prompt ends at column P-1
                ids[i, P - len(p):] = torch.tensor(p)
                valid[i, P - len(p):] = True
            ids, valid = ids.to(device), valid.to(device)
        fused = self._fused_layers()
        version = self.weight_version  # weights loaded while a pause holds the call change it (see below)
        scales = {f["scale"] for f in fused[:-1]}
        if len(scales) != 1:
            raise NotImplementedError(f"native rollout engine: attention scale differs between layers ({sorted(scales)})")
        rope = self._rope_tables(P + M, dtype, scales.pop())  # (P + M, H + 2Hkv, D/2)
        Hkv, D = self.num_kv_heads, self.head_dim
        # the block layout while a group's generated columns are few (every query scores all of them: one
        # matmul, one softmax); the grouped layout for long generations (a query reads only its own sample's)
        block = self.layout == "block" or self.layout == "auto" and (n == 1 or n * M <= BLOCK_COLUMNS)
        # eager decode writes slot t of every row it reads before reading it (a row cut from the hidden path
        # reads its unwritten slot, but its output is dropped): no zero fill; static mode masks unwritten slots
        # with -inf, which needs finite memory behind them
        alloc = torch.zeros if static else torch.empty
        pad_bias = None  # (Bp, 1, 1, P): the prompt's pads -inf
        if valid is not None:
            pad_bias = torch.zeros(Bp, 1, 1, P, device=device, dtype=dtype)
            pad_bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
        cache: list[Any] = []
        if block:
            cache = [alloc(2, Bp, Hkv, P + M * n, D, device=device, dtype=dtype) for _ in fused[:-1]]

            def store(layer: int, kv: torch.Tensor) -> None:  # kv (Bp, P, 2Hkv, D)
                cache[layer].narrow(3, 0, P).copy_(kv.view(Bp, P, 2, Hkv, D).permute(2, 0, 3, 1, 4))

            if pad_bias is None and not static:  # read-only: kept for the next call of the same shape
                if self._bias is None or self._bias[0] != (n, P, M):
                    self._bias = ((n, P, M), self._block_bias(None, n, P, M, static=False))
                bias = self._bias[1]
            else:
                bias = self._block_bias(pad_bias, n, P, M, static)
        else:
            def store(layer: int, kv: torch.Tensor) -> None:  # keys as (Bp, Hkv, D, P): the scores' matmul reads
                # them contiguous
                cache.append((kv[:, :, :Hkv].permute(0, 2, 3, 1).contiguous(), kv[:, :, Hkv:].transpose(1, 2).contiguous(),
                              alloc(2, Bp, Hkv, n, M, D, device=device, dtype=dtype)))

            bias = torch.full((1, 1, M), float("-inf"), device=device, dtype=dtype) if static else None
        # per original row, a label of its sequence so far: rows with one label (the same prompt, the same tokens)
        # hold the same state. Labels compare only among the rows computed together at a step
        seq, plan = None, None
        cached = [0] * Bp  # each prompt's tokens whose prefill an earlier prompt of the call computed
        if self.share and not static:
            firsts, expand, shared = prefix_plan(prompts, P)
            if len(firsts) <= PREFILL_SHARE_AT * Bp * P:  # the prefill runs each distinct prefix once
                plan = (torch.tensor(firsts, device=device), torch.tensor(expand, device=device))
                cached = shared
            same = expand[P - 1::P]  # each prompt's state at its last token: equal for equal prompts
            if n > 1 or len(set(same)) < Bp:  # else no two rows can share
                seq = torch.tensor(same, device=device).repeat_interleave(n)
        logits = self._prefill(ids, valid, fused, rope, store, plan)  # (Bp, V)
        state = {"fused": fused, "rope": rope, "cache": cache, "block": block, "Bp": Bp, "n": n, "B": B, "P": P,
                 "M": M, "static": static, "pad_bias": pad_bias, "bias": bias, "share": None,
                 "slot_base": P + torch.arange(n, device=device),
                 "kernel": use_kernel(device, static, block, self.num_heads, Hkv, D, dtype),  # RLHF_DECODE_ATTENTION
                 "start": (torch.zeros(Bp, dtype=torch.int32, device=device) if valid is None else
                           (P - valid.sum(1)).to(torch.int32))}  # each prompt's first real column
        replay = self._capture(state) if static and device.type == "cuda" and M > 1 else None
        if static and block:  # what slot t's n columns get once written: each query row its own sample's
            own = self._block_bias(None, n, 0, 1, static=False)  # (1, 1, n, n)
        positions = (torch.full((B,), P, device=device) if valid is None else
                     valid.sum(1).repeat_interleave(n))  # (B,) position of each row's first generated token
        logits = logits.repeat_interleave(n, 0)  # (B, V): the n samples of a prompt start from its logits
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.stop_ids))
        # is_stop[token]: one gather a step (torch.isin sorts and searches); an id past the vocabulary is never drawn
        is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        is_stop[[i for i in stops if i < logits.shape[-1]]] = True
        tracking = bool(stops)  # rows can end before max_new_tokens: look for the end
        out_tokens = torch.zeros(B, M, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(B, M, dtype=torch.float32, device=device)
        stop_at = torch.full((B,), M + 1, dtype=torch.long, device=device)  # length incl. the stop token; M+1: running
        rows: torch.Tensor | None = None  # original rows being computed (None: all)
        idx: torch.Tensor | None = None  # their places in the cache layout (None: all of it)
        layout_pos = torch.arange(B, device=device)  # place of each original row in the cache layout
        generator = self.generator if sp.sampling_seed is None else \
            torch.Generator(device=device).manual_seed(int(sp.sampling_seed))
        out_top = (torch.zeros(B, M, top, dtype=torch.float32, device=device),
                   torch.zeros(B, M, top, dtype=torch.long, device=device)) if top > 0 else None
        reasons: dict[int, dict[str, Any]] = {}  # rows the control finished, with its finish reason
        for t in range(M):
            if stops and t < sp.min_new_tokens:
                logits = logits.masked_fill(is_stop, float("-inf"))  # no stop before min_new_tokens
            drawn = sample_tokens(logits, sp, generator, top)
            tokens, logprobs = drawn[0], drawn[1]  # (b,), (b,)
            if rows is None:
                out_tokens[:, t], out_logprobs[:, t] = tokens, logprobs
            else:
                out_tokens[rows, t], out_logprobs[rows, t] = tokens, logprobs
            if out_top is not None:
                where = slice(None) if rows is None else rows
                out_top[0][where, t], out_top[1][where, t] = drawn[2], drawn[3]
            if stops:
                sub = stop_at if rows is None else stop_at[rows]  # rows: a copy
                sub.masked_fill_(is_stop.index_select(0, tokens) & (sub > M), t + 1)
                if rows is not None:
                    stop_at[rows] = sub
            if control is not None:
                listed = (list(range(B)) if rows is None else rows.tolist()) if control.wants_tokens else None
                finished = control.step(t, listed, tokens.tolist() if control.wants_tokens else None)
                running_host = (stop_at > M).tolist() if finished else []
                ended = [r for r in finished if running_host[r]]
                if ended:
                    reasons.update((r, finished[r]) for r in ended)
                    stop_at[torch.tensor(ended, device=device)] = t + 1
                    tracking = True
                if self.weight_version != version:  # loaded while /pause_generation in_place held the call: the
                    # next tokens come from the new weights, on the cache the old ones computed (sglang's in_place)
                    _copy_into(state["fused"], self._fused_layers())
                    version = self.weight_version
                    control.switches = (*control.switches, (t + 1, version))
            if t == M - 1:
                break
            if tracking and static and t % 16 == 15 and not bool((stop_at > M).any()):
                break  # static shapes: every row computes every step; look for the end only now and then
            if tracking and not static:
                running = stop_at > M  # (B,)
                alive = int(running.sum())
                if alive == 0:
                    break
                computed = B if rows is None else rows.shape[0]
                if self.compact and alive <= computed // 2:
                    rows = running.nonzero().squeeze(1)  # (b,)
                    idx = layout_pos[rows]
                    if alive * RELAYOUT <= state["B"]:  # few left: copy just their caches into a dense layout
                        self._relayout(state, idx)
                        positions = positions[idx]
                        layout_pos = torch.full((B,), -1, dtype=torch.long, device=device)
                        layout_pos[rows] = torch.arange(alive, device=device)
                        idx = None
                    else:  # cut only the hidden-state path; the caches keep their layout
                        state["g_idx"], state["j_idx"] = idx // state["n"], idx % state["n"]
                        if state["block"]:  # the rows left out no longer write their columns, which their
                            # group's other queries read (masked): from slot t on they must hold finite values
                            n_ = state["n"]
                            for kv in state["cache"]:
                                kv.narrow(3, P + t * n_, (M - t) * n_).zero_()
                    tokens = out_tokens[rows, t]
            if static:  # slot t holds a key from this step on
                if block:
                    state["bias"].narrow(-1, P + t * n, n).copy_(own)
                else:
                    state["bias"][..., t] = 0
            pos = (positions if idx is None else positions[idx]) + t
            expand = None
            if seq is not None:  # the distinct sequences among the rows computed: each once
                labels = seq if rows is None else seq[rows]  # (b,)
                key = tokens.add(labels, alpha=logits.shape[-1])  # label * V + token, >= 0
                if tracking:  # finished rows are never read again: all of them go with one sequence, -1
                    key = key.masked_fill_(~(running if rows is None else running[rows]), -1)
                distinct, label = torch.unique(key, return_inverse=True)
                if rows is None:
                    seq = label
                else:
                    seq[rows] = label
                b, u = label.shape[0], distinct.shape[0]
                state["share"] = None
                if u <= SHARE_AT * b:
                    first = torch.full((u,), b, device=device).scatter_reduce_(
                        0, label, torch.arange(b, device=device), "amin")  # (u,) a row of each sequence
                    expand = label
                    state["share"] = (label, first if idx is None else idx[first])
                    tokens, pos = tokens.index_select(0, first), pos.index_select(0, first)
            if replay is not None:
                logits = replay(tokens, pos, t)
            else:
                logits = self._decode_step(tokens, pos, t, idx, state)
            if expand is not None:
                logits = logits.index_select(0, expand)  # (b, V): each row its sequence's
        lengths = torch.minimum(stop_at, torch.full_like(stop_at, M))
        tokens_host, logprobs_host = out_tokens.tolist(), out_logprobs.tolist()  # one transfer at the end
        lengths_host, stopped = lengths.tolist(), (stop_at <= M).tolist()
        out_t, out_l, finish = [], [], []
        for r in range(B):
            L = lengths_host[r]
            out_t.append(tokens_host[r][:L])
            out_l.append(logprobs_host[r][:L])
            finish.append(reasons[r] if r in reasons else {"type": "stop", "matched": tokens_host[r][L - 1]}
                          if stopped[r] else {"type": "length", "length": M})
        tops = None
        if out_top is not None:
            values, ids = out_top[0].tolist(), out_top[1].tolist()
            tops = [list(zip(values[r][:lengths_host[r]], ids[r][:lengths_host[r]])) for r in range(B)]
        return out_t, out_l, finish, tops, cached


def _copy_into(old: Any, new: Any) -> None:
    """The fused weights rebuilt after a load, copied into the ones the call (and a captured CUDA graph) reads."""
    if isinstance(old, torch.Tensor):
        if old.data_ptr() != new.data_ptr():
            old.copy_(new)
    elif isinstance(old, (list, tuple)):
        for o, n in zip(old, new):
            _copy_into(o, n)
    elif isinstance(old, dict):
        for key, value in old.items():
            _copy_into(value, new[key])
