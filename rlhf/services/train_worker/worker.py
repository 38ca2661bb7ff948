"""TrainWorker: one per torchrun rank (SPMD), an RPC server the controller drives.

Endpoints, one per method: /health, /sft_warm_start, /begin_grpo, /compute_logprobs,
/train_step, /upload_weights, /save_weights_dir, /save, /load, /events, /weights_checksum,
/shutdown.
Every rank holds the full model (data parallel); gradients are summed with gloo (nccl on GPU)
inside /train_step, so the controller must call /train_step on every rank of a step — the SPMD
contract. Calls are served one at a time, in arrival order, on one worker thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import torch

from rlhf.batch import BatchSizeMismatch
from rlhf.checkpoint import slots as ckpt
from rlhf.config import Config
from rlhf.devices import relocate
from rlhf.faults import fault_point
from rlhf.models import build_model_and_tokenizer, stop_token_ids, torch_dtype
from rlhf.procs import cpu_share, own_threads, release_freed_memory
from rlhf.services.colocation import DeviceLease, device_name
from rlhf.services.scheduler import SchedulerClient
from rlhf.services.train_worker.baseline import SftAndPreflight
from rlhf.services.train_worker.rows import KeptRows
from rlhf.services.train_worker.state import WeightsAndCheckpoints, load_reference, save_reference
from rlhf.tracing.metrics import disk_wait_threads
from rlhf.train.dist import GlooDataParallel
from rlhf.train.engine import TrainEngine
from rlhf.train.parallel import build_mesh, laid_out_model, make_layout
from rlhf.transport.client import LoopThread
from rlhf.transport.http import Service

log = logging.getLogger("rlhf.train_worker")


class TrainWorker(SftAndPreflight, WeightsAndCheckpoints, KeptRows):
    def __init__(self, cfg: Config, run_dir: str, rank: int, world_size: int, token: str,
                 device: str = "cpu", threads: int = 1, grpo: bool = True) -> None:
        """threads: torch's intra-op threads on the service's thread, which builds the model and runs every
        handler (the rest of the process stays serial: rlhf.procs.own_threads).

        The model is built on that thread as its first job, while this returns: the rank serves at once, the
        controller starts the rollout side meanwhile (on a 2-core machine a tiny run's startup was 2.3 s of
        imports and init here, then 5 s of scheduler and rollout server start), and requests queue behind the
        build. A build that failed fails every request with its error (`built`). grpo false: the SFT baseline's
        ranks (replicated; the whole model is built)."""
        self.cfg, self.run_dir, self.rank, self.world_size, self.token = cfg, run_dir, rank, world_size, token
        self.service = Service("train", rank, token, cfg.resilience, threads=threads)
        # the layout (rlhf.train.parallel; checked against the model at the CLI): GRPO steps run in it; the dp group
        # is the world, or with tensor parallel the ranks holding the same TP shard
        self.layout = make_layout(cfg.parallel.layout, cfg.parallel.tp_size, world_size,
                                  reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward)
        self.mesh = build_mesh(self.layout, torch.device(device).type)
        self.dp = GlooDataParallel(device, self.mesh["dp"].get_group() if self.mesh is not None else None)
        self.dp_rank = self.layout.dp_rank(rank)  # this rank's share of a batch, of layout.dp shares
        self.wire_dtype = torch_dtype(cfg.model.dtype)
        self.gpu: torch.device | None = None  # set while the model is offloaded for a colocated rollout
        self.engine: TrainEngine | None = None
        self.policy: Any = None  # train.engine megatron: the GPTModel the engine trains (self.model: its HF twin)
        self.shutdown = threading.Event()
        self.stopping = threading.Event()  # the process is ending (SIGTERM, the run failed): long loops end early
        self.lease = DeviceLease(run_dir, rank, f"train-{rank}") if cfg.runtime.colocate else None
        self.device = device_name("train", rank, cfg.runtime.colocate)
        self.model: torch.nn.Module
        self.tokenizer: Any
        self.stop_id = -1  # what SFT appends to an answer: the first stop token, once the model is built
        # a sharded GRPO run that starts without the (replicated) SFT warm start builds only its pieces
        self.pieces_only = grpo and self.layout.sharded and cfg.sft.max_steps == 0
        self.built = self.service.executor.submit(self._build, device)
        for name in ("sft_warm_start", "begin_grpo", "compute_logprobs", "train_step", "upload_weights",
                     "save_weights_dir", "save", "load", "events", "sft_begin", "sft_step", "sft_eval",
                     "sft_run_for", "preflight", "weights_checksum", "weights_group", "broadcast_weights",
                     "get_weights_by_name"):
            self.service.route(f"/{name}", self._once_built(getattr(self, name)))
        self.service.route("/health", lambda a, t: {"ok": True, "rank": self.rank, "pid": os.getpid()},
                           method="GET", inline=True)
        self.loop_phase, self.loop_step = "idle", 0
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self.own_files = ckpt.OwnFiles()  # this rank's files by slot: it removes them from a replaced slot
        self._weights_store: Any = None  # distributed weights mode, rank 0: the group's rendezvous store
        self._weights_group: Any = None  # and its member of the weights update group
        self._ipc_buffers: dict[str, torch.Tensor] = {}  # weights.transport cuda_ipc: the shards shared, by version
        self._weights_backend = "gloo"
        self._weights_buffers: Any = None  # the flat buffer the buckets are packed into, used again each bucket
        self.service.route("/heartbeat", self.heartbeat, method="GET", inline=True)
        self.service.untraced_paths.add("/heartbeat")  # the watchdog polls it: no span, and what this rank does stays
        self.shutdown_grace_s = 30.0  # how long a request still running at shutdown gets to finish (and log why)
        self.service.route("/shutdown", self._shutdown, inline=True)
        self.service.route("/start_scheduler", self.start_scheduler)
        self.node_scheduler: SchedulerClient | None = None  # this node's, on a node without the controller
        self._scheduler_loop: LoopThread | None = None

    def _build(self, device: str) -> None:
        # bf16/fp16 runs keep fp32 master weights and optimizer state here and compute in the low dtype
        # (autocast); what leaves for the rollout servers is cast to model.dtype
        if self.pieces_only:  # a sharded GRPO run without a warm start: straight into its layout, pieces only
            fsdp_dtype = self.wire_dtype if self.layout.fsdp and self.wire_dtype != torch.float32 else None
            self.model, self.tokenizer = laid_out_model(self.cfg.model, self.cfg.seed, self.layout, self.mesh,
                                                        fsdp_dtype, tracker=self.dp, device=device)
            log.info("train-%d: model built in its layout (%s), this rank's pieces only", self.rank,
                     self.layout.describe())
        else:
            self.model, self.tokenizer = build_model_and_tokenizer(self.cfg.model, seed=self.cfg.seed, device=device,
                                                                   dtype="float32")
        self.stop_id = stop_token_ids(self.model, self.tokenizer)[0]
        if self.lease is not None:
            self.lease.acquire(self.cfg.timeouts.lease_s)
        log.info("train-%d: model built on %s", self.rank, device)

    def _once_built(self, handler: Any) -> Any:
        """handler, run only with the model built: a failed build is every request's error (its own exception)."""
        def run(args: dict, tensors: dict) -> Any:
            self.built.result()  # done before any request runs (the worker thread's first job): re-raises its error
            return handler(args, tensors)
        run.__name__ = getattr(handler, "__name__", "handler")
        return run


    def start_scheduler(self, args: dict, tensors: dict) -> dict:
        """Multi-node: the first train rank of a node without the controller starts that node's scheduler (its
        rollout servers run on this host) and renews its lease; a rank that dies takes it along (PDEATHSIG)."""
        if self.node_scheduler is None:
            self._scheduler_loop = LoopThread(name=f"scheduler-lease-{self.rank}")
            self.node_scheduler = SchedulerClient(self.run_dir, self.token, float(args["lease_s"]),
                                                  float(args["startup_timeout_s"]), self._scheduler_loop,
                                                  rank=int(args["node"]), owner=f"train-{self.rank}")
        return {"url": self.node_scheduler.url, "pid": self.node_scheduler.proc.pid, "name": self.node_scheduler.name}

    def _shutdown(self, args: dict, tensors: dict) -> dict:
        """grace_s: what a request still running gets (the controller gives 1 s to ranks it found stalled)."""
        self.shutdown_grace_s = float(args.get("grace_s", self.shutdown_grace_s))
        self.shutdown.set()
        return {"ok": True}

    # ------------------------------------------------------------------ helpers

    def _require_device(self, what: str) -> None:
        if self.lease is not None and not self.lease.held:
            self.lease.acquire(self.cfg.timeouts.lease_s)  # waits for rollout_end's release
            log.info("train-%d: device lease reacquired for %s", self.rank, what)
            if self.gpu is not None and next(self.model.parameters()).device.type == "cpu":  # rollout_end was lost
                relocate(self._resident(), self.engine.optimizer if self.engine else None, self.gpu, self.gpu)

    def _engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError("train worker: GRPO engine not ready (call /begin_grpo first)")
        return self.engine

    # ------------------------------------------------------------------ endpoints


    def begin_grpo(self, args: dict, tensors: dict) -> dict:
        """GRPO engine with the current weights as KL reference; `reference` tensors override it (resume)."""
        cfg = self.cfg
        policy = self.model
        if cfg.rollout.overlaps:  # the rollout servers generate while this rank trains: share the CPUs
            own_threads(cpu_share(self.world_size, cfg.rollout.servers))
        if cfg.train.engine == "megatron":  # trains megatron-core's GPTModel; self.model stays the HF twin it syncs
            from rlhf.train.megatron import MegatronCausalLM, init_parallel

            init_parallel(seed=cfg.seed)
            policy = self.policy = MegatronCausalLM.from_hf(self.model)
            log.info("train-%d: megatron-core GPTModel engine (local layer spec), converted from the HF model",
                     self.rank)
        self.engine = TrainEngine(policy, cfg.train, cfg.algorithm, temperature=cfg.sampling.temperature or 1.0,
                                  keep_reference=cfg.algorithm.kl_coef > 0, dp=self.dp, compute_dtype=self.wire_dtype,
                                  layout=self.layout, mesh=self.mesh)
        if self.layout.sharded:
            release_freed_memory()  # the whole model each rank built is its pieces now
        if self.engine.reference is not None:
            ref_dir = os.path.join(self.run_dir, "checkpoints", "reference")
            if args.get("load_reference"):
                load_reference(ref_dir, self.engine.reference)
            elif args.get("save_reference", True):
                save_reference(ref_dir, self.engine.reference, self.rank, self.world_size, self.layout.sharded)
        return {"ok": True, "layout": self.layout.describe()}

    def compute_logprobs(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        """One batch's logprobs under the reference or the policy (`which`: "reference", "policy"), or under each of a
        list of them in one call (the batch sent once): the reply's tensors are then named after them."""
        self._require_device("compute_logprobs")
        which = args.get("which", "reference")
        batch = self.rows_batch(args, tensors, "reference", int(args.get("step", -1)))  # data_plane store: fetched
        outs = {}
        for model in which if isinstance(which, list) else [which]:
            fault_point("reference.compute")
            outs[model] = self._engine().compute_logprobs(batch, model)
        rows = int(next(iter(outs.values())).shape[0]) if outs else 0
        if "fetch" in args:  # kept here for the train step; the controller gets the rollout/train difference only
            return {"which": which, "rows": rows, **self.keep_logprobs(batch, outs, bool(args.get("keep_rollout")))}, {}
        return {"which": which, "rows": rows}, (outs if isinstance(which, list) else {"logprobs": outs[which]})

    def train_step(self, args: dict, tensors: dict) -> dict:
        self._require_device("train_step")
        t0 = time.perf_counter()
        fault_point("train.step")
        tensors = self.rows_batch(args, tensors, "train", int(args.get("step", -1)))  # data_plane store: kept
        self._check_global_batch(tensors, args.get("rows"))
        metrics = self._engine().train_step(tensors)
        self.drop_rows()
        self.sync_hf()
        metrics["train_seconds"] = time.perf_counter() - t0
        metrics["rank"] = self.rank
        return metrics

    @torch.no_grad()
    def sync_hf(self, into_policy: bool = False) -> None:
        """megatron engine: the HF twin (what weight sync, checkpoints and export read) takes the policy's weights;
        into_policy: the other way (after a checkpoint was loaded into the HF twin)."""
        if self.policy is None:
            return
        if into_policy:
            self.policy.load_hf_state_dict({n: p.detach() for n, p in self.model.named_parameters()})
            return
        params = dict(self.model.named_parameters())
        for name, tensor in self.policy.hf_state_dict().items():
            params[name].copy_(tensor)

    # ------------------------------------------------------------------ what the watchdog and colocation ask

    def heartbeat(self, args: dict, tensors: dict) -> dict:
        """What this rank is doing now: its SFT loop phase or the request it runs, at which step, the collective
        it is inside and for how long, and whether it works (CPU seconds, threads in disk wait): the stall
        watchdog tells a blocked rank from a busy one."""
        inside, running = self.dp.in_collective, self.service.running
        phase, step = (self.loop_phase, self.loop_step) if self.loop_phase != "idle" or running is None else \
            (running[0], running[1])
        return {"rank": self.rank, "phase": phase, "step": step,
                "collective": inside[0] if inside else "", "collective_s": time.monotonic() - inside[1] if inside else 0.0,
                "cpu_s": time.process_time(), "disk_wait_threads": disk_wait_threads()}


    def _check_global_batch(self, tensors: dict, rows_sent: int | None = None) -> None:
        """The global batch must be rollout.prompts_per_step x group_size rows, as the engine is configured, or the
        rows the controller says it sends (it took groups out on purpose: env.on_infra_error drop_group)."""

        rows = int(tensors["input_ids"].shape[0])
        total = int(self.dp.all_reduce_sum(torch.tensor([float(rows)]))[0].item())
        expected = int(rows_sent) if rows_sent else self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        if total != expected:
            raise BatchSizeMismatch({"global_rows": total, "this_rank_rows": rows, "expected_global_batch": expected},
                                    "train step (rollout.prompts_per_step x rollout.group_size)")


    def events(self, args: dict, tensors: dict) -> dict:
        """Colocation: rollout_start hands the device to the rollout server, rollout_end takes it back.

        On a GPU the train side's params, grads and optimizer state (and the reference model) move to
        pinned host memory and the cache is emptied; on CPU the lease alone stands for that.
        """
        event = args.get("event")
        fault_point("events.handle", peer=str(event), device=self.device)
        reply: dict[str, Any] = {"event": event, "ack": True, "rank": self.rank}
        if self.lease is not None:
            gpu = next(self.model.parameters()).device if event == "rollout_start" else self.gpu
            if event == "rollout_start":
                if gpu.type == "cuda":
                    self.gpu = gpu
                    reply.update(relocate(self._resident(), self.engine.optimizer if self.engine else None,
                                          torch.device("cpu"), gpu))
                self.lease.release()
            elif event == "rollout_end":
                self.lease.acquire(self.cfg.timeouts.lease_s)
                if gpu is not None and next(self.model.parameters()).device.type == "cpu":
                    reply.update(relocate(self._resident(), self.engine.optimizer if self.engine else None, gpu, gpu))
        return reply

    def _resident(self) -> list[torch.nn.Module]:
        """The models this rank keeps on its device: the policy and, when kept, the reference."""
        ref = self.engine.reference if self.engine is not None else None
        return [self.model] + ([ref] if ref is not None else [])

    def close(self) -> None:
        if self.node_scheduler is not None:  # its jobs stop with it (SIGTERM: the scheduler stops them first)
            self.node_scheduler.close()
            self.node_scheduler = None
        if self._scheduler_loop is not None:
            self._scheduler_loop.close()
        kept = getattr(self, "_metaserver", None)  # the uploads' loop and client (state._metaserver_client)
        if kept is not None:
            loop, client = kept
            try:
                loop.run(client.close(), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 — a loop stuck in an upload: the process is ending anyway
                log.debug("closing the MetaServer client: %s: %s", type(exc).__name__, exc)
            loop.close()
        if self.lease is not None:
            self.lease.release()

