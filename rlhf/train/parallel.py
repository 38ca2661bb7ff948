"""Train layouts on a DeviceMesh: replicated data parallel, FSDP2, tensor parallel, and FSDP x TP (as torchtitan).

    parallel.layout dp     every rank holds the whole model and AdamW state; gradients summed in one flat
                          all-reduce over the data-parallel group (the tiny default; no mesh is made)
    parallel.layout fsdp   FSDP2 (`fully_shard`) on every decoder layer and on the root: parameters, gradients
                          and AdamW state sharded over the `dp` mesh dimension; all-gather before a layer's
                          forward and backward, reduce-scatter of its gradients after
    parallel.tp_size N       DTensor tensor parallel inside each decoder layer over the `tp` dimension: q/k/v and
                          gate/up column-wise (attention heads and MLP columns split), o and down row-wise
                          (their outputs all-reduced). The embedding, the norms and the LM head stay replicated
                          on each TP rank (logits and the loss are computed whole on every rank of a TP group).

The world is a (dp, tp) mesh, ranks row-major: train rank r is in data-parallel group r // tp and is rank r % tp
of its TP group. The ranks of one TP group train on the same data. The engine's math (losses, logprobs,
micro-batching) is the same in every layout; this module only lays the model out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.sections import PARALLEL_LAYOUTS as PARALLEL
from rlhf.train.collectives import fsdp_comms, watch_tp
from rlhf.weights import is_dtensor

TP_PLAN = {  # HF Llama / Mistral / Qwen2 decoder layer
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


@dataclass(frozen=True)
class Layout:
    """How the train world holds the model: `parallel` (dp or fsdp) over `dp` ranks, times `tp` tensor-parallel
    ranks (world = dp x tp)."""

    parallel: str = "dp"
    dp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True  # fsdp: a layer's parameters freed after its forward (False: at its backward)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def fsdp(self) -> bool:
        return self.parallel == "fsdp"

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (any layout but plain replicated data parallel)."""
        return self.fsdp or self.tp > 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel group (the batch shard) of train rank `rank`."""
        return rank // self.tp

    def describe(self) -> str:
        if not self.sharded:
            return f"dp x{self.dp} (replicated)"
        return f"{self.parallel} x{self.dp}" + (f" x tp {self.tp}" if self.tp > 1 else "") + \
            (" (gathered forward to backward)" if self.fsdp and not self.reshard_after_forward else "")


def layout_problems(parallel: str, tp: int, world: int, model_config: Any) -> list[str]:
    """Why the world cannot hold this layout (each with the valid choices), or []."""
    problems = []
    if parallel not in PARALLEL:
        problems.append(f"parallel.layout {parallel!r} is not a layout; choose one of: {', '.join(PARALLEL)}")
    if tp < 1:
        problems.append(f"parallel.tp_size {tp} must be at least 1")
        return problems
    if world % tp:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        problems.append(f"parallel.tp_size {tp} does not divide the {world} train ranks (world = dp x tp); "
                        f"valid tp sizes here: {', '.join(map(str, valid))}")
    if model_config is not None and tp > 1:
        heads = model_config.num_attention_heads
        kv = getattr(model_config, "num_key_value_heads", None) or heads
        ffn = model_config.intermediate_size
        for what, n in (("attention heads", heads), ("key/value heads", kv), ("MLP columns", ffn)):
            if n % tp:
                valid = [d for d in range(1, max(heads, 1) + 1) if heads % d == 0 and kv % d == 0 and ffn % d == 0]
                problems.append(f"parallel.tp_size {tp} does not divide the model's {n} {what}; tensor parallel splits "
                                f"them evenly (tp sizes this model takes: {', '.join(map(str, valid))})")
    return problems


def make_layout(parallel: str, tp: int, world: int, model_config: Any = None,
                reshard_after_forward: bool = True) -> Layout:
    problems = layout_problems(parallel, tp, world, model_config)
    if problems:
        raise ValueError("; ".join(problems))
    return Layout(parallel, world // tp, tp, reshard_after_forward)


def build_mesh(layout: Layout, device_type: str) -> Any:
    """The (dp, tp) DeviceMesh of the world; None for plain replicated data parallel (no subgroups made)."""
    if not layout.sharded:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def parallelize(model: torch.nn.Module, layout: Layout, mesh: Any, param_dtype: torch.dtype | None = None,
                train: bool = True, tracker: Any = None) -> torch.nn.Module:
    """Lay `model` (an HF causal LM with model.model.layers) out in place: tensor parallel first, then FSDP.

    param_dtype (fsdp): bf16/fp16 compute with fp32 master weights, gradients reduced in fp32 (FSDP2's
    MixedPrecisionPolicy). train=False (the frozen reference): the same layout, no gradient reduction. The layout's
    collectives pass fault points and mark the heartbeat (rlhf.train.collectives; tracker: the rank's dp hooks)."""
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], tracker)
    if layout.fsdp:  # a frozen model never runs a backward that would free what a forward kept gathered
        apply_fsdp(model, mesh["dp"], param_dtype, tracker, layout.reshard_after_forward or not train)
    if not train:
        model.requires_grad_(False)
    return model


def laid_out_model(model_cfg: Any, seed: int, layout: Layout, mesh: Any, param_dtype: torch.dtype | None = None,
                   tracker: Any = None, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """(the policy built straight into its layout, its tokenizer): a meta-device skeleton is laid out, given memory
    for this rank's pieces only, and filled one whole parameter at a time (the seeded init, or a model directory's
    safetensors), so no rank ever holds the whole model. The same weights as building it whole and laying it out."""
    from rlhf.models import fill_weights, model_skeleton

    model, tokenizer = model_skeleton(model_cfg)
    parallelize(model, layout, mesh, param_dtype, tracker=tracker)
    model.to_empty(device=device)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty gives the tied LM head a tensor of its own: one parameter again
    fill_weights(model, model_cfg, seed)
    return model.eval(), tokenizer


def reshard_all(model: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered parameters. FSDP2 keeps the root unit (the embedding, the final norm, the LM
    head), and every layer under parallel.fsdp_reshard_after_forward false, gathered after a forward for the backward
    that follows; after a no-grad forward (logprobs, the reference) none follows, and they would stay gathered until
    the next step's backward (the reference's: for the whole run)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_laid_out(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are already DTensors (built by laid_out_model)."""
    return any(is_dtensor(p) for p in model.parameters())


@torch.no_grad()
def frozen_copy(model: torch.nn.Module, layout: Layout, mesh: Any, param_dtype: torch.dtype | None = None,
                tracker: Any = None) -> torch.nn.Module:
    """A frozen copy of a laid-out model, in the same layout, made without a whole copy on any rank: the skeleton is
    built on the meta device and laid out, then each rank fills in its own pieces (and the buffers) from `model`."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    if layout.fsdp and param_dtype is not None:
        # FSDP computes the frozen copy in param_dtype only (its MixedPrecisionPolicy casts every gathered
        # parameter): kept in that dtype, it gives the same logprobs and holds half the memory of fp32 copies
        cast: dict[int, torch.nn.Parameter] = {}  # a tied parameter (embedding and LM head) stays one parameter
        for module in twin.modules():
            for key, p in module._parameters.items():
                if p is not None and p.is_floating_point():
                    if id(p) not in cast:
                        cast[id(p)] = torch.nn.Parameter(p.to(param_dtype), requires_grad=False)
                    module._parameters[key] = cast[id(p)]
    parallelize(twin, layout, mesh, param_dtype, train=False, tracker=tracker)
    twin.to_empty(device=local(next(model.parameters())).device)
    if getattr(model.config, "tie_word_embeddings", False):
        twin.tie_weights()  # to_empty gives the tied LM head a tensor of its own: one parameter again, as in `model`
    ours, theirs = list(model.named_parameters()), list(twin.named_parameters())
    if len(ours) != len(theirs):
        raise RuntimeError(f"frozen_copy: the copy has {len(theirs)} parameters, the model {len(ours)}")
    for (name, src), (twin_name, dst) in zip(ours, theirs):
        if name != twin_name or tuple(src.shape) != tuple(dst.shape):
            raise RuntimeError(f"frozen_copy: {name} {tuple(src.shape)} has no twin ({twin_name} {tuple(dst.shape)})")
        local(dst).copy_(local(src))  # (cast to param_dtype under fsdp: FSDP's own cast of the gathered parameter)
    for (_, src), (_, dst) in zip(model.named_buffers(), twin.named_buffers()):
        dst.copy_(src)
    return twin.eval()


def apply_tp(model: torch.nn.Module, tp_mesh: Any, tracker: Any = None) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    rowwise = [name for name, style in TP_PLAN.items() if style == "rowwise"]
    for layer in model.model.layers:
        plan = {name: styles[style]() for name, style in TP_PLAN.items()}
        for style in plan.values():
            style.src_data_rank = None  # every rank built the same weights: each cuts its own piece, nothing is sent
        parallelize_module(layer, tp_mesh, plan)
        watch_tp(layer, rowwise, tracker)


def apply_fsdp(model: torch.nn.Module, dp_mesh: Any, param_dtype: torch.dtype | None, tracker: Any = None,
               reshard_after_forward: bool = True) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)  # the rest: embedding, final norm, LM head (tied or not)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # the loss is already normalised by the global token count: gradients are summed, not averaged;
            # as a plain SUM reduce-scatter (gloo has no PREMUL_SUM, the op a divide factor asks for otherwise)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            all_gather, reduce_scatter = fsdp_comms(tracker)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (itself for a plain tensor)."""
    return t.to_local() if is_dtensor(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter, gradient or norm whole on every rank of its mesh (DTensor.full_tensor; a plain tensor as it is).

    Ranks that share one GPU reduce over gloo, whose functional all-gather of a CUDA tensor crashes the process
    (SIGSEGV in torch 2.11 on an H200: benchmarks/gloo_cuda.py): there the gather runs on host copies of the pieces,
    over the same process groups, and the whole tensor goes back to the GPU."""
    if not is_dtensor(t):
        return t.detach()
    if t.device.type == "cpu" or not _on_gloo(t.device_mesh):
        return t.full_tensor()
    return via_host(t).to(t.device)


def via_host(t: Any) -> torch.Tensor:
    """DTensor `t` gathered whole on the host: its piece copied there, gathered over its mesh's own groups."""
    from torch.distributed.tensor import DTensor

    piece = t.to_local().detach().cpu()
    host = DTensor.from_local(piece, _host_mesh(t.device_mesh), t.placements, shape=t.shape, stride=t.stride())
    return host.full_tensor()


_HOST_MESHES: dict[int, Any] = {}


def _host_mesh(mesh: Any) -> Any:
    """The CPU twin of a DeviceMesh: the same ranks and process groups (no new group is made)."""
    from torch.distributed.device_mesh import DeviceMesh

    if id(mesh) not in _HOST_MESHES:
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        _HOST_MESHES[id(mesh)] = (mesh, DeviceMesh.from_group(groups if mesh.ndim > 1 else groups[0], "cpu",
                                                              mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names))
    return _HOST_MESHES[id(mesh)][1]


def _on_gloo(mesh: Any) -> bool:
    import torch.distributed as dist

    return dist.get_backend(mesh.get_group(0)) == "gloo"


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The global gradient norm over every layout's pieces, and clipping to max_norm (> 0).

    Sharded gradients (DTensors) give their whole norm through DTensor's own reduction; replicated ones
    (norms and embeddings under tensor parallel) count once, as each TP rank holds the same copy."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}  # by mesh: FSDP x TP holds 2-D (dp, tp) and 1-D (dp) DTensors
    for g in grads:
        groups.setdefault(g.device_mesh if is_dtensor(g) else None, []).append(g)
    squares = torch.zeros((), dtype=torch.float64)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = full(norm)
        squares = squares + norm.detach().double().cpu() ** 2
    total = math.sqrt(float(squares))
    if max_norm > 0:
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in grads:
                local(g).mul_(coef)
    return total


class Gathered(Mapping):
    """Every parameter whole, by name (shared parameters once), cast to `dtype` when given, gathered when it is read:
    one collective a read in a sharded layout (DTensor.full_tensor), so every rank of the world reads the same names
    in the same order, and a rank that keeps only some of them (its share of a weights upload) never holds the
    whole model. Iterates in name order."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self.params = dict(sorted(model.named_parameters()))
        self.dtype = dtype

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        p = self.params[name]
        whole = full(p)
        return whole.to(self.dtype) if self.dtype is not None else whole

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def only(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of `names`, after reading every parameter in order (this rank's part of every collective)."""
        keep = set(names)
        out = {}
        for name in self:
            whole = self[name]
            if name in keep:
                out[name] = whole
        return out


def full_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name: in a sharded layout gathered, every rank of the world taking part."""
    state = Gathered(model, dtype)
    return state.only(state)
