"""TrainWorker: one per torchrun rank (SPMD), an RPC server the controller drives.

Endpoints, one per method: /health, /sft_warm_start, /begin_grpo, /compute_logprobs,
/train_step, /upload_weights, /save_weights_dir, /save, /load, /events, /weights_checksum,
/shutdown.
Every rank holds the full model (data parallel); gradients are summed with gloo (nccl on GPU)
inside /train_step, so the controller must call /train_step on every rank of a step — the SPMD
contract. Calls are served one at a time, in arrival order, on one worker thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import queue
import shutil
import threading
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhf import clock, tracing
from rlhf.config import Config
from rlhf.data import PromptSampler, build_sft_batch
from rlhf.devices import relocate
from rlhf.evaluation import evaluate
from rlhf.faults import afault_point, fault_point
from rlhf.models import build_model_and_tokenizer, stop_token_ids, torch_dtype
from rlhf.rollout.engine import RolloutEngine
from rlhf.runtime import checkpoint as ckpt
from rlhf.runtime.batch_memory import BatchSizeMismatch
from rlhf.runtime.client import Client, LoopThread
from rlhf.runtime.colocation import DeviceLease, device_name, fresh_allocation
from rlhf.runtime.dist import GlooDataParallel
from rlhf.runtime.http import Service
from rlhf.runtime.metaserver import push_shard
from rlhf.runtime.scheduler import SchedulerClient
from rlhf.tasks import build_task, reward_fn
from rlhf.tracing.metrics import ACTIVITY, disk_wait_threads
from rlhf.train.engine import TrainEngine
from rlhf.trainers.sft import run_sft
from rlhf.weights import checksum, encode_shard, export_state, import_state, save_state_dir, write_shard

log = logging.getLogger("rlhf.train_worker")


def shard_names(names: list[str], rank: int, world_size: int) -> list[str]:
    """Which parameters rank `rank` uploads: every world_size-th name (a stand-in for TP/PP shards)."""
    return sorted(names)[rank::world_size]


class TrainWorker:
    def __init__(self, cfg: Config, run_dir: str, rank: int, world_size: int, token: str,
                 device: str = "cpu", threads: int = 1) -> None:
        """threads: torch's intra-op threads on the service's thread, which builds the model and runs every
        handler (the rest of the process stays serial: rlhf.procs.own_threads).

        The model is built on that thread as its first job, while this returns: the rank serves at once, the
        controller starts the rollout side meanwhile (on a 2-core machine a tiny run's startup was 2.3 s of
        imports and init here, then 5 s of scheduler and rollout server start), and requests queue behind the
        build. A build that failed fails every request with its error (`built`)."""
        self.cfg, self.run_dir, self.rank, self.world_size, self.token = cfg, run_dir, rank, world_size, token
        self.service = Service("train", rank, token, cfg.resilience, threads=threads)
        self.dp = GlooDataParallel(device)
        self.wire_dtype = torch_dtype(cfg.model.dtype)
        self.gpu: torch.device | None = None  # set while the model is offloaded for a colocated rollout
        self.engine: TrainEngine | None = None
        self.shutdown = threading.Event()
        self.lease = DeviceLease(run_dir, rank, f"train-{rank}") if cfg.runtime.colocate else None
        self.device = device_name("train", rank, cfg.runtime.colocate)
        self.model: torch.nn.Module
        self.tokenizer: Any
        self.stop_id = -1  # what SFT appends to an answer: the first stop token, once the model is built
        self.built = self.service.executor.submit(self._build, device)
        for name in ("sft_warm_start", "begin_grpo", "compute_logprobs", "train_step", "upload_weights",
                     "save_weights_dir", "save", "load", "events", "sft_begin", "sft_step", "sft_eval",
                     "sft_run_for", "preflight", "weights_checksum"):
            self.service.route(f"/{name}", self._once_built(getattr(self, name)))
        self.service.route("/health", lambda a, t: {"ok": True, "rank": self.rank, "pid": os.getpid()},
                           method="GET", inline=True)
        self.loop_phase, self.loop_step = "idle", 0
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
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
        self.model, self.tokenizer = build_model_and_tokenizer(self.cfg.model, seed=self.cfg.seed, device=device,
                                                               dtype="float32")
        self.stop_id = stop_token_ids(self.model, self.tokenizer)[0]
        if self.lease is not None:
            self.lease.acquire(self.cfg.runtime.lease_timeout_s)
        log.info("train-%d: model built on %s", self.rank, device)

    def _once_built(self, handler: Any) -> Any:
        """handler, run only with the model built: a failed build is every request's error (its own exception)."""
        def run(args: dict, tensors: dict) -> Any:
            self.built.result()  # done before any request runs (the worker thread's first job): re-raises its error
            return handler(args, tensors)
        run.__name__ = getattr(handler, "__name__", "handler")
        return run

    def weights_checksum(self, args: dict, tensors: dict) -> dict:
        return {"checksum": checksum(export_state(self.model, self.wire_dtype), self.cfg.weights.verify_checksum)}

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
            self.lease.acquire(self.cfg.runtime.lease_timeout_s)  # waits for rollout_end's release
            log.info("train-%d: device lease reacquired for %s", self.rank, what)
            if self.gpu is not None and next(self.model.parameters()).device.type == "cpu":  # rollout_end was lost
                relocate(self._resident(), self.engine.optimizer if self.engine else None, self.gpu, self.gpu)

    def _engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError("train worker: GRPO engine not ready (call /begin_grpo first)")
        return self.engine

    # ------------------------------------------------------------------ endpoints

    def sft_warm_start(self, args: dict, tensors: dict) -> dict:
        self._require_device("sft")
        cfg = self.cfg
        per_rank = slice(self.rank, None, self.world_size)
        result = run_sft(cfg, self.model, self.tokenizer, build_task(cfg.task), reward_fn(cfg.task.reward),
                         dp=self.dp, examples_per_rank=per_rank, show_progress=self.rank == 0)
        return result

    def begin_grpo(self, args: dict, tensors: dict) -> dict:
        """GRPO engine with the current weights as KL reference; `reference` tensors override it (resume)."""
        cfg = self.cfg
        self.engine = TrainEngine(self.model, cfg.train, cfg.algorithm, temperature=cfg.rollout.temperature or 1.0,
                                  keep_reference=cfg.algorithm.kl_coef > 0, dp=self.dp, compute_dtype=self.wire_dtype)
        ref_path = os.path.join(self.run_dir, "checkpoints", "reference", "model.safetensors")
        if args.get("load_reference") and self.engine.reference is not None:
            import_state(self.engine.reference, load_file(ref_path))
        elif self.rank == 0 and self.engine.reference is not None and args.get("save_reference", True):
            os.makedirs(os.path.dirname(ref_path), exist_ok=True)
            tmp = ref_path + ".tmp"

            save_file({k: v.contiguous() for k, v in export_state(self.engine.reference).items()}, tmp)
            os.replace(tmp, ref_path)
        return {"ok": True}

    def compute_logprobs(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        self._require_device("compute_logprobs")
        which = args.get("which", "reference")
        fault_point("reference.compute")
        out = self._engine().compute_logprobs(tensors, which)
        return {"which": which, "rows": int(out.shape[0])}, {"logprobs": out}

    def train_step(self, args: dict, tensors: dict) -> dict:
        self._require_device("train_step")
        t0 = time.perf_counter()
        fault_point("train.step")
        self._check_global_batch(tensors)
        metrics = self._engine().train_step(tensors)
        metrics["train_seconds"] = time.perf_counter() - t0
        metrics["rank"] = self.rank
        return metrics

    # ------------------------------------------------------------------ the SFT baseline (SFTController)

    def sft_begin(self, args: dict, tensors: dict) -> dict:
        self._require_device("sft")
        cfg = self.cfg
        self.engine = TrainEngine(self.model, cfg.train, keep_reference=False, lr=cfg.sft.lr, dp=self.dp,
                                  compute_dtype=self.wire_dtype)
        self.task, self.reward = build_task(cfg.task), reward_fn(cfg.task.reward)
        self.sft_sampler = PromptSampler(self.task.split("train"), seed=cfg.seed)
        return {"rank": self.rank}

    def sft_step(self, args: dict, tensors: dict) -> dict:
        """One SFT step: every rank draws the same global batch and trains on its share (as the warm start)."""

        self._require_device("sft_step")
        fault_point("train.step")
        examples = self.sft_sampler.next(self.cfg.sft.batch_size)[self.rank::self.world_size]
        metrics = self._engine().sft_step(build_sft_batch(self.tokenizer, examples, self.cfg.task.chat_template, self.stop_id))
        return {**metrics, "rank": self.rank}

    def sft_run_for(self, args: dict, tensors: dict) -> dict:
        """per_rank_duration: train until THIS rank's clock says duration_s passed, then a final all_reduce.

        The seeds' stall: a rank whose clock runs ahead leaves first and waits in the final collective
        while the others start another step, so their next collective never completes.
        """

        start, step = clock.now(), 0
        self.loop_phase = "loop"
        while clock.now() - start < float(args["duration_s"]):
            step += 1
            self.loop_step = ACTIVITY.step = step  # the heartbeat row says which loop step a collective is in
            with tracing.at_step(step):
                fault_point("train.step", step=step)
                examples = self.sft_sampler.next(self.cfg.sft.batch_size)[self.rank::self.world_size]
                self._engine().sft_step(build_sft_batch(self.tokenizer, examples, self.cfg.task.chat_template, self.stop_id))
        self.loop_phase = "final_all_reduce"
        total = self.dp.all_reduce_sum(torch.tensor([float(step)], dtype=torch.float64))  # a step count, like the loop's
        self.loop_phase = "done"
        return {"rank": self.rank, "steps": step, "steps_all_ranks": float(total[0])}

    def preflight(self, args: dict, tensors: dict) -> dict:
        """DLRover's pre-flight check: time a square fp32 matmul on this rank's device (on the CPU pinned to one
        core of its own, as a rank has its own hardware on a real cluster), then an all_gather of every rank's
        time. The controller names a rank much slower than the others."""
        n, duration_s = int(args["size"]), float(args["duration_s"])
        device = torch.device(self.device) if str(self.device).startswith("cuda") else torch.device("cpu")
        pinned = previous = None
        if device.type == "cpu" and hasattr(os, "sched_setaffinity"):
            previous = sorted(os.sched_getaffinity(0))
            pinned = previous[int(os.environ.get("LOCAL_RANK", self.rank)) % len(previous)]
            os.sched_setaffinity(0, {pinned})  # this thread only: the matmul runs on it (one intra-op thread or more)
        try:
            fault_point("preflight.check")  # after pinning: a cpu_contention here burns this rank's core
            a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
            (a @ b).sum().item()  # warm-up; .item() waits for the device
            # the mean matmul time of each 100 ms window, many scheduler time slices each: a rank that gets only a
            # share of its CPU shows it (one short matmul mostly runs inside a single slice at full speed)
            times: list[float] = []
            end = time.perf_counter() + duration_s
            while len(times) < 5 or time.perf_counter() < end:
                start, count = time.perf_counter(), 0
                while time.perf_counter() - start < 0.1:
                    c = a @ b
                    count += 1
                c.sum().item()
                times.append((time.perf_counter() - start) / count)
            matmul_s = sorted(times)[len(times) // 2]
            start = time.perf_counter()
            gathered = self.dp.all_gather_values([matmul_s])
            gather_s = time.perf_counter() - start
        finally:
            if previous is not None:
                os.sched_setaffinity(0, previous)
        return {"rank": self.rank, "matmul_s": matmul_s, "all_gather_s": gather_s, "cpu": pinned,
                "matmul_s_all_ranks": gathered}

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

    def sft_eval(self, args: dict, tensors: dict) -> dict:
        if args.get("skip"):
            return {"accuracy": None}

        self.model.eval()
        engine = RolloutEngine(self.model, self.tokenizer)
        split = self.task.split(args.get("split", "eval"))
        return {"accuracy": evaluate(engine.generate, self.tokenizer, split, self.reward,
                                     self.cfg.rollout.max_new_tokens, self.cfg.task.chat_template)["accuracy"]}

    def _check_global_batch(self, tensors: dict) -> None:
        """The global batch must be rollout.prompts_per_step x group_size rows, as the engine is configured."""

        rows = int(tensors["input_ids"].shape[0])
        total = int(self.dp.all_reduce_sum(torch.tensor([float(rows)]))[0].item())
        expected = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        if total != expected:
            raise BatchSizeMismatch({"global_rows": total, "this_rank_rows": rows, "expected_global_batch": expected},
                                    "train step (rollout.prompts_per_step x rollout.group_size)")

    def upload_weights(self, args: dict, tensors: dict) -> dict:
        """Send this rank's shard of the weights to the MetaServer as version args['version'].

        args['shm_dir'] set (same host): write the shard as a file there and PUT its path; else PUT the bytes.
        """
        version, shard = str(args["version"]), f"rank{self.rank}"
        with tracing.span("weights.serialize"):
            state = export_state(self.model, self.wire_dtype)
            names = shard_names(list(state), self.rank, self.world_size)
            fresh_allocation(self.run_dir, self.device, sum(state[n].numel() * state[n].element_size() for n in names),
                             "the weights upload buffer")
            part = {n: state[n] for n in names}
            path, body = "", None
            if args.get("shm_dir"):
                path = os.path.join(args["shm_dir"], f"v{version}-{shard}.safetensors")
                size = write_shard(part, path, self.cfg.weights.checksum)
            else:
                body = encode_shard(part, self.cfg.weights.checksum)
                size = len(body)
        t0 = time.perf_counter()

        async def put() -> None:
            client = Client(args["metaserver_url"], self.token, peer="metaserver-0",
                            retries=self.cfg.resilience.retry_idempotent)
            try:
                await afault_point("weights_update.upload", peer="metaserver-0")
                await push_shard(client, version, shard, body, float(args.get("timeout_s", 600)), path=path)
            finally:
                await client.close()

        try:
            asyncio.run(put())
        except BaseException:
            if path and os.path.exists(path):
                os.unlink(path)  # never handed over: the MetaServer does not own it
            raise
        return {"rank": self.rank, "tensors": len(names), "bytes": size, "seconds": time.perf_counter() - t0}

    def save_weights_dir(self, args: dict, tensors: dict) -> dict:
        """Disk mode: rank `writer` (0 unless the weights fallback picks a rank that is free) writes an HF
        safetensors directory the rollout servers load."""
        fault_point("weights_update.save_dir")
        if self.rank == int(args.get("writer", 0)):
            path = args["path"]
            tmp = path + ".tmp"
            save_state_dir(self.model, tmp, self.tokenizer)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        return {"rank": self.rank, "path": args["path"]}

    def save(self, args: dict, tensors: dict) -> dict:
        """Write this rank's checkpoint files into args['directory'] (staging or the slot itself).

        background: snapshot now, write on this rank's writer thread, reply at once (files: {}); the writer
        is a daemon thread, so a write stuck in an IO hang never blocks the next step's calls.
        """
        engine = self._engine()
        t0 = time.perf_counter()
        if args.get("background"):
            items = ckpt.snapshot_rank_files(self.rank, self.model, engine.optimizer, copy=True)
            self._writes.put((args["directory"], items, bool(args.get("fsync", True)), tracing.current_step()))
            self._start_writer()
            return {"rank": self.rank, "files": {}, "pending": self._writes.qsize(), "seconds": time.perf_counter() - t0}
        if args.get("stall_s"):
            items = ckpt.snapshot_rank_files(self.rank, self.model, engine.optimizer)
            files = ckpt.write_bounded(args["directory"], items, bool(args.get("fsync", True)), float(args["stall_s"]),
                                       f"train-{self.rank}")
        else:
            files = ckpt.write_rank_files(args["directory"], self.rank, self.model, engine.optimizer,
                                          fsync=bool(args.get("fsync", True)))
        return {"rank": self.rank, "files": files, "seconds": time.perf_counter() - t0}

    def _start_writer(self) -> None:
        if self._writer is not None:
            return
        ctx = contextvars.copy_context()

        def run() -> None:
            while True:
                directory, items, fsync, step = self._writes.get()
                log.info("train-%d: background checkpoint write to %s started (step %d)", self.rank, directory, step)
                try:
                    with tracing.at_step(step), tracing.span("checkpoint.background_write", directory=directory):
                        ckpt.write_items(directory, items, fsync)
                    log.info("train-%d: background checkpoint write to %s done", self.rank, directory)
                except Exception as exc:  # nobody waits for this thread: the log is the only trace
                    log.error("train-%d: background checkpoint write to %s failed: %s: %s", self.rank, directory,
                              type(exc).__name__, exc)

        self._writer = threading.Thread(target=ctx.run, args=(run,), name=f"ckpt-writer-{self.rank}", daemon=True)
        self._writer.start()

    def load(self, args: dict, tensors: dict) -> dict:
        engine = self._engine()
        fault_point("checkpoint.load", path=args["path"])
        ckpt.load_rank_files(args["path"], self.rank, self.model, engine.optimizer)
        engine.optimizer_steps = int(args.get("optimizer_steps", engine.optimizer_steps))
        return {"rank": self.rank, "loaded": args["path"]}

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
                self.lease.acquire(self.cfg.runtime.lease_timeout_s)
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
        if self.lease is not None:
            self.lease.release()

