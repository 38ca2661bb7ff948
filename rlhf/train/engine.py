"""The train engine: micro-batched forward/backward, AdamW, gradient clipping, logprobs.

It owns the policy (trainable), optionally a frozen reference copy, and the optimizer. Batches
are dicts of tensors with right padding (see rlhf.data):

    input_ids (B, L)  attention_mask (B, L)  response_mask (B, L)
    old_logprobs (B, L)  ref_logprobs (B, L)  advantages (B,)

where per-token tensors hold, at position t, the quantity for token t (position 0 is never a
response token). Gradient accumulation is exact: each micro-batch's loss is normalised by the
whole mini-batch's token (or sequence) count, and with data parallelism by the global count
(`dp.all_reduce_sum`), so the result does not depend on how the batch was cut.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from rlhf import tracing
from rlhf.algorithms import LOSSES
from rlhf.algorithms.sft import nll_loss
from rlhf.faults.kinds import compute_slowdown
from rlhf.train.parallel import Layout, clip_grad_norm, frozen_copy, is_laid_out, parallelize, reshard_all
from rlhf.weights import is_dtensor


class DataParallel(Protocol):
    """What the engine needs from a data-parallel group (the runtime provides a gloo/nccl one)."""

    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None: ...


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    loss_mask: torch.Tensor | None = None,
    whole: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of every token under `model`, aligned to the token. Returns (B, L) [, (B, L)].

    Position 0 gets 0 (nothing predicts it). `temperature` scales the logits as the rollout
    engine did when it sampled (0 = greedy, treated as 1). With `loss_mask` (B, L) (1 on the
    tokens the loss reads: the response), the LM head runs only on the positions that predict
    those tokens and every other entry is 0 — a real model's vocabulary is 32 k–150 k wide, and
    the prompt positions would otherwise cost most of the logits' memory and time. `whole`: run the model's
    own forward (FSDP gathers the root's parameters in it; its decoder and head called apart would not) and
    pick the loss positions' logits after it.
    """
    positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, L)
    targets = input_ids[:, 1:]  # (B, L-1): position t predicts token t+1
    head = model.get_output_embeddings() if loss_mask is not None and not whole else None
    if head is None:  # the model's own forward (or a model without a separate output head)
        # whole with a loss mask: the head runs from the first column any row's loss reads on (HF's logits_to_keep:
        # the last `keep` positions), the prompt columns before it are skipped as in the head-only path
        first = 0
        if loss_mask is not None and bool((loss_mask[:, 1:] > 0).any()):
            first = int((loss_mask[:, 1:] > 0).any(0).nonzero()[0])
        keep = {"logits_to_keep": input_ids.shape[1] - first} if first else {}
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **keep).logits
        logits = logits[:, :-1].float()  # (B, L-1-first, V)
        if temperature and temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)  # (B, L-1-first, V)
        logprobs = F.pad(logp_all.gather(-1, targets[:, first:, None]).squeeze(-1), (first, 0))  # (B, L-1)
        if loss_mask is not None:  # the same zeros as the head-only path off the loss positions
            logprobs = logprobs.masked_fill(loss_mask[:, 1:] <= 0, 0.0)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = F.pad(-(logp_all.exp() * logp_all).sum(-1), (1 + first, 0))  # (B, L)
                if loss_mask is not None:
                    entropy = entropy.masked_fill(F.pad(loss_mask[:, 1:], (1, 0)) <= 0, 0.0)
        return F.pad(logprobs, (1, 0)), entropy  # (B, L)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=positions).last_hidden_state  # (B, L, C)
    where = loss_mask[:, 1:] > 0  # (B, L-1)
    logits = head(hidden[:, :-1][where]).float()  # (N, V): only the N positions the loss reads
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
    picked = logp_all.gather(-1, targets[where][:, None]).squeeze(-1)  # (N,)
    logprobs = torch.zeros(where.shape, dtype=picked.dtype, device=picked.device).masked_scatter(where, picked)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
            entropy = F.pad(torch.zeros(where.shape, dtype=ent.dtype, device=ent.device).masked_scatter(where, ent),
                            (1, 0))  # (B, L)
    return F.pad(logprobs, (1, 0)), entropy  # (B, L)


def _trim(batch: dict[str, torch.Tensor], rows: slice | torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of a batch, with trailing all-padding columns cut off (right padding)."""
    part = {k: v[rows] for k, v in batch.items()}
    width = int(part["attention_mask"].sum(1).max().item())
    return {k: (v[:, :width] if v.dim() == 2 else v) for k, v in part.items()}


class TrainEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        optim_cfg: Any,
        algorithm_cfg: Any = None,
        temperature: float = 1.0,
        keep_reference: bool = True,
        dp: DataParallel | None = None,
        lr: float | None = None,
        compute_dtype: torch.dtype = torch.float32,
        layout: Layout | None = None,
        mesh: Any = None,
    ) -> None:
        """layout/mesh (rlhf.train.parallel): a sharded layout lays the policy out here (and the reference the
        same way); dp then reduces over the data-parallel group only. None: replicated, as given."""
        self.layout = layout if layout is not None and layout.sharded else None
        self.mesh = mesh
        self.model = model
        # bf16/fp16: parameters and AdamW state stay fp32 (master weights); forward/backward run under
        # autocast in compute_dtype; logits, logprobs and the loss are fp32 (token_logprobs upcasts)
        self.compute_dtype = compute_dtype
        self.cfg = optim_cfg
        self.algorithm = algorithm_cfg
        self.temperature = temperature
        self.dp = dp
        self.device = next(model.parameters()).device
        self.reference: torch.nn.Module | None = None
        if self.layout is not None and not is_laid_out(model):  # laid_out_model built it in its layout already
            parallelize(model, self.layout, mesh, self._fsdp_dtype(), tracker=dp)
        if keep_reference:
            self.reset_reference()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base_lr = lr if lr is not None else optim_cfg.lr
        # tensor parallel alone leaves the embedding, the norms and the LM head plain tensors beside DTensors: a
        # foreach kernel (AdamW's default on CUDA) takes them in one list and DTensor refuses the mix, so each
        # parameter is updated on its own there (on a CPU AdamW does that already)
        mixed = len({is_dtensor(p) for p in self.params}) > 1
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.base_lr,
            betas=(optim_cfg.beta1, optim_cfg.beta2),
            weight_decay=optim_cfg.weight_decay,
            **({"foreach": False} if mixed else {}),
        )
        self.optimizer_steps = 0

    def reset_reference(self) -> None:
        """Freeze a copy of the current policy as the reference model (KL anchor). In a sharded layout the copy is
        laid out the same way, each rank copying only its own pieces (no whole copy is made)."""
        if self.layout is not None:
            self.reference = frozen_copy(self.model, self.layout, self.mesh, self._fsdp_dtype(), tracker=self.dp)
            return
        self.reference = copy.deepcopy(self.model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)

    def _fsdp_dtype(self) -> torch.dtype | None:
        """FSDP's compute dtype (its MixedPrecisionPolicy casts the gathered parameters): bf16/fp16 runs."""
        return self.compute_dtype if self.compute_dtype != torch.float32 else None

    def _autocast(self):
        fsdp_casts = self.layout is not None and self.layout.fsdp  # FSDP computes in param_dtype itself
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32 and not fsdp_casts)

    @property
    def _whole(self) -> bool:
        return self.layout is not None and self.layout.fsdp

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Batches arrive on the host (from the wire); the model may live on a GPU. The `mini_batch` column stays on
        the host: only its cut is read (a GPU copy would cost a sync to read it back)."""
        return {k: v if k == "mini_batch" else v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def current_lr(self) -> float:
        """Linear warmup over train.warmup_steps optimizer steps, then constant."""
        warmup = self.cfg.warmup_steps
        return self.base_lr * min(1.0, (self.optimizer_steps + 1) / warmup) if warmup else self.base_lr

    # ------------------------------------------------------------------ logprobs

    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, torch.Tensor], which: str = "policy") -> torch.Tensor:
        """Logprobs (B, L) of every token under the policy or the reference model."""
        model = {"policy": self.model, "reference": self.reference}.get(which)
        if model is None:
            raise ValueError(f"compute_logprobs: no {which!r} model (valid: policy, reference when kept)")
        was_training = model.training
        model.eval()
        batch = self._to_device(batch)
        out = torch.zeros_like(batch["attention_mask"], dtype=torch.float32)
        B = batch["input_ids"].shape[0]
        with tracing.span("forward", model=which, sequences=B):
            for start in range(0, B, self.cfg.micro_batch_size):
                part = _trim(batch, slice(start, start + self.cfg.micro_batch_size))
                with self._autocast():
                    lp, _ = token_logprobs(model, part["input_ids"], part["attention_mask"], self.temperature,
                                           loss_mask=part.get("response_mask"), whole=self._whole)
                out[start : start + lp.shape[0], : lp.shape[1]] = lp
            if self._whole:
                reshard_all(model)  # no backward follows this forward to free what FSDP kept gathered
            if out.is_cuda:  # the span ends with the work (the reply waits for it anyway)
                torch.cuda.synchronize(out.device)
        model.train(was_training)
        return out

    # ------------------------------------------------------------------ optimisation

    def _global(self, value: float) -> float:
        if self.dp is None or self.dp.world_size == 1:
            return value
        return float(self.dp.all_reduce_sum(torch.tensor([value], dtype=torch.float64)).item())  # dp moves it

    def _optimizer_step(self) -> float:
        if self.dp is not None and self.dp.world_size > 1 and not (self.layout is not None and self.layout.fsdp):
            self.dp.all_reduce_gradients(self.params)  # FSDP has reduce-scattered them over dp already
        if self.layout is not None:  # sharded gradients: their global norm through DTensor
            grad_norm = clip_grad_norm(self.params, self.cfg.grad_clip)
        elif self.cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return grad_norm

    def _accumulate(self, batch: dict[str, torch.Tensor], loss_of: Callable, with_entropy: bool) -> list[dict]:
        """Forward/backward over micro-batches of one mini-batch; returns per-micro-batch metrics."""
        metrics = []
        B = batch["input_ids"].shape[0]
        for start in range(0, B, self.cfg.micro_batch_size):
            part = _trim(batch, slice(start, start + self.cfg.micro_batch_size))
            with self._autocast():
                logprobs, entropy = token_logprobs(
                    self.model, part["input_ids"], part["attention_mask"], self.temperature, with_entropy,
                    loss_mask=part["response_mask"], whole=self._whole,
                )
            loss, m = loss_of(part, logprobs, entropy)
            loss.backward()
            m["loss"] = loss.item()
            metrics.append(m)
        return metrics

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One GRPO step: an optimizer step per mini-batch (the batch's `mini_batch` column, rlhf.batch: this rank's
        share of each global mini-batch; without it, `mini_batches` contiguous slices). Returns averaged metrics."""
        self.model.train()
        batch = self._to_device(batch)
        loss_fn = LOSSES[self.algorithm.loss]
        all_metrics: list[dict] = []
        grad_norms = []
        minis = _mini_batches(batch, self.cfg.mini_batches)
        compute_s = 0.0  # this rank's forward/backward seconds (resilience.rebalance_stragglers reads them)
        # |train - rollout| logprob of the first mini-batch's tokens, before its optimizer step: the same weights
        # (sync), so a difference beyond numerics is wrong weights on one side (sum, max, tokens)
        diff: list[torch.Tensor] | None = [] if self.algorithm.old_logprobs == "rollout" else None
        for i, mini in enumerate(minis):
            rows = int(mini["input_ids"].shape[0])
            num_tokens = self._global(float(mini["response_mask"].sum()))
            num_sequences = self._global(float(rows))

            def loss_of(part, logprobs, entropy, first=i == 0):
                if first and diff is not None:
                    mask = part["response_mask"]
                    d = (logprobs.detach() - part["old_logprobs"]).abs() * mask
                    diff.append(torch.stack([d.sum(), d.max(), mask.sum().to(d.dtype)]))  # read once, at the end
                return loss_fn(
                    logprobs, part["old_logprobs"], part.get("ref_logprobs"), off_policy_advantages(part, self.algorithm),
                    part["response_mask"], self.algorithm, num_tokens, num_sequences, entropy,
                )

            with tracing.span("forward_backward", sequences=rows):
                t0 = time.perf_counter()
                all_metrics += self._accumulate(mini, loss_of, with_entropy=True)
                compute_slowdown.stretch(*tracing.whoami(), time.perf_counter() - t0, self.device)  # a straggler fault
                compute_s += time.perf_counter() - t0
            with tracing.span("optimizer.step"):
                grad_norms.append(self._optimizer_step())
        out = _weighted_mean(all_metrics)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["loss"] = sum(m["loss"] for m in all_metrics) / len(minis)
        out["compute_s"] = compute_s
        if diff:
            parts = torch.stack(diff).float()
            out["lp_diff_sum"], out["lp_diff_max"], out["lp_diff_tokens"] = (
                parts[:, 0].sum().item(), parts[:, 1].max().item(), parts[:, 2].sum().item())
        return out

    def sft_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One supervised step: NLL on response tokens (the answer and EOS)."""
        self.model.train()
        batch = self._to_device(batch)
        num_tokens = self._global(float(batch["response_mask"].sum()))

        def loss_of(part, logprobs, entropy):
            return nll_loss(logprobs, part["response_mask"], num_tokens)

        metrics = self._accumulate(batch, loss_of, with_entropy=False)
        grad_norm = self._optimizer_step()
        return {"loss": sum(m["loss"] for m in metrics), "grad_norm": grad_norm, "tokens": num_tokens}


def off_policy_advantages(part: dict[str, torch.Tensor], algorithm: Any) -> torch.Tensor:
    """The advantages the loss sees: (B,) as they are, or with algorithm.off_policy each token's (B, T), weighted by
    w = pi_prox / pi_rollout (old_logprobs recomputed, rollout_logprobs the rollout's): tis min(w, is_cap);
    decoupled w, 0 where w passes is_cap. The weight is a constant of the gradient (both sides detached)."""
    if algorithm.off_policy == "none" or "rollout_logprobs" not in part:
        return part["advantages"]
    w = (part["old_logprobs"] - part["rollout_logprobs"]).detach().exp()
    w = w.clamp(max=algorithm.is_cap) if algorithm.off_policy == "tis" else w * (w <= algorithm.is_cap)
    return part["advantages"].unsqueeze(-1) * w


def _mini_batches(batch: dict[str, torch.Tensor], mini_batches: int) -> list[dict[str, torch.Tensor]]:
    """The batch's mini-batches in order: by its `mini_batch` column (rows of one mini-batch are adjacent, as
    rlhf.batch lays a share out), else `mini_batches` contiguous near-equal slices."""
    if "mini_batch" in batch:
        which = batch["mini_batch"].tolist()
        starts = [i for i in range(len(which)) if i == 0 or which[i] != which[i - 1]]
        if [which[s] for s in starts] != list(range(len(starts))):  # every rank takes the same optimizer steps
            raise ValueError("train batch: the mini_batch column must run 0, 1, … with each mini-batch's rows "
                             f"adjacent; got {which}")
        bounds = [*starts, len(which)]
        part = {k: v for k, v in batch.items() if k != "mini_batch"}
    else:
        rows = batch["input_ids"].shape[0]
        n = min(mini_batches, rows)
        bounds, part = [round(i * rows / n) for i in range(n + 1)], batch
    return [{k: v[lo:hi] for k, v in part.items()} for lo, hi in zip(bounds, bounds[1:])]


def _weighted_mean(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics (`tokens` is summed)."""
    total = sum(m["tokens"] for m in metrics) or 1.0
    out: dict[str, float] = {"tokens": total}
    for key in metrics[0]:
        if key in ("tokens", "loss"):
            continue
        out[key] = sum(m[key] * m["tokens"] for m in metrics) / total
    for key, value in out.items():
        if isinstance(value, float) and math.isnan(value):
            raise FloatingPointError(f"train metric {key} is NaN")
    return out
