"""Simulated train ranks: sim.ranks_per_process of them in one OS process, each the train worker's routes on its own
port (its own Service: run token, spans in its role, typed errors, fault points), with EMULATED compute.

    python -m rlhf.sim.train_ranks --run-dir D --config D/config.yaml --first R --count K --world N
        --processes P --store HOST:PORT --ready-file F
    (token in RLHF_TOKEN; the ready file gets {"urls": [...]} once every rank listens)

A rank answers what the controller asks of a real one (/health, /heartbeat, /sft_warm_start, /begin_grpo,
/compute_logprobs, /train_step, /upload_weights, /save_weights_dir, /weights_checksum, /save, /load, /events,
/shutdown) with the same reply shapes. Its forward and backward cost `sim.*_s_per_token` seconds per token of its share (a wait); each
mini-batch ends in the world's collective (rlhf.sim.cost.StoreBarrier), so one slow rank holds every other inside
it; the optimizer is one parameter nudged a step, so each weights version differs. The weights are the embedded
model's, one copy per process (every rank of replicated data parallel holds the same), uploaded piece by piece as
a real rank's (rlhf.pieces.own_pieces), through the real MetaServer. Heartbeats report EMULATED compute as CPU time,
so the stall watchdog tells a rank that computes from one that is blocked, as it does on a real one.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
from aiohttp import web

from rlhf import exits, faults
from rlhf.batch import BatchSizeMismatch
from rlhf.batch.client import RowFetcher
from rlhf.checkpoint import slots as ckpt
from rlhf.faults import fault_point
from rlhf.faults.kinds import compute_slowdown
from rlhf.models import build_model_and_tokenizer, torch_dtype
from rlhf.procs import write_atomic
from rlhf.services.boot import boot
from rlhf.services.colocation import DeviceLease, device_name
from rlhf.services.train_worker.rows import KeptRows
from rlhf.services.train_worker.state import WeightsAndCheckpoints
from rlhf.sim import host_parser
from rlhf.sim.cost import EMULATED, CostModel, StoreBarrier
from rlhf.tracing import span
from rlhf.tracing.metrics import disk_wait_threads
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.train.parallel import make_layout
from rlhf.transport.client import LoopThread
from rlhf.transport.fanout import FanoutAgent
from rlhf.transport.http import Service, listen
from rlhf.weights import export_state

log = logging.getLogger("rlhf.sim")


class SimTrainHost:
    """What the ranks of one process share: the config, the weights (one copy), the collective, the step count."""

    def __init__(self, cfg: Any, run_dir: str, token: str, model: torch.nn.Module, tokenizer: Any,
                 barrier: StoreBarrier) -> None:
        self.cfg, self.run_dir, self.token, self.model, self.barrier = cfg, run_dir, token, model, barrier
        self.tokenizer = tokenizer
        self.world = cfg.sim.train_ranks
        self.layout = make_layout(cfg.parallel.layout, cfg.parallel.tp_size, self.world)
        self.optimizer_steps = 0
        self.stopping = threading.Event()  # the process is ending: a rank inside the collective leaves it
        self.lock = threading.Lock()
        self._nudge = next(p for p in model.parameters() if p.dim() == 1)  # a norm's weight: the EMULATED optimizer
        self.fetcher: RowFetcher | None = None  # rollout.data_plane store: one loop and pool for the host's ranks

    def row_fetcher(self) -> RowFetcher:
        with self.lock:
            if self.fetcher is None:
                # the host's ranks fetch together: one POST /rows per rollout host and step (a 10 ms window)
                self.fetcher = RowFetcher(self.token, LoopThread("rows"), self.cfg.timeouts.rpc_s, self.cfg.resilience,
                                          window_s=0.01)
            return self.fetcher

    def optimizer_step(self, steps_done: int) -> None:
        """The weights after `steps_done` optimizer steps (every rank of the process reaches it; the first applies)."""
        with self.lock, torch.no_grad():
            while self.optimizer_steps < steps_done:
                self._nudge.add_(1e-3)
                self.optimizer_steps += 1


class SimTrainRank(WeightsAndCheckpoints, KeptRows):
    """One simulated train rank: a real Service with the train worker's routes, EMULATED compute."""

    def __init__(self, host: SimTrainHost, rank: int) -> None:
        cfg = host.cfg
        self.host, self.cfg, self.run_dir, self.token = host, cfg, host.run_dir, host.token
        self.rank, self.world_size, self.layout = rank, host.world, host.layout
        self.model, self.tokenizer, self.wire_dtype = host.model, host.tokenizer, torch_dtype(cfg.model.dtype)
        self.device = device_name("train", rank, cfg.runtime.colocate)
        # runtime.colocate: rank r shares device r with rollout server r (the same flock lease as a real pair), held
        # from the start as a real rank holds it once its model is built
        self.lease = DeviceLease(host.run_dir, rank, f"train-{rank}") \
            if cfg.runtime.colocate and rank < cfg.rollout.servers else None
        if self.lease is not None:
            self.lease.acquire(cfg.timeouts.lease_s)
        self._ipc_buffers: dict[str, torch.Tensor] = {}
        self.service = Service("train", rank, host.token, cfg.resilience)
        self.train_cost = CostModel(cfg.sim.train_s_per_token, cfg.sim.jitter, seed=cfg.seed * 100003 + rank)
        self.reference_cost = CostModel(cfg.sim.reference_s_per_token, cfg.sim.jitter, seed=cfg.seed * 100019 + rank)
        self.shutdown = threading.Event()
        self.inside: tuple[str, float] | None = None  # the collective this rank is in, since when
        self.busy_since: float | None = None  # EMULATED compute running now
        self.emulated_s = 0.0  # EMULATED compute done (reported as CPU seconds in the heartbeat)
        self.optimizer_steps = 0
        self.own_files = ckpt.OwnFiles()  # its files by slot: it removes them from a replaced slot
        for name in ("sft_warm_start", "begin_grpo", "compute_logprobs", "train_step", "upload_weights", "save",
                     "load", "events", "weights_checksum", "save_weights_dir"):
            self.service.route(f"/{name}", getattr(self, name))
        self.service.route("/health", lambda a, t: {"ok": True, "rank": rank, "pid": os.getpid(),
                                                    "simulated": EMULATED}, method="GET", inline=True)
        self.service.route("/heartbeat", self.heartbeat, method="GET", inline=True)
        self.service.untraced_paths.add("/heartbeat")
        self.service.route("/shutdown", self._shutdown, inline=True)

    # ------------------------------------------------------------------ EMULATED compute and collective

    def _compute(self, cost: CostModel, tokens: float, what: str) -> float:
        self.busy_since = time.monotonic()
        cost.slowdown = compute_slowdown.factor("train", self.rank)  # a straggler fault (compute_slowdown)
        try:
            with span(f"sim.{what}", **{"rlhf.simulated": EMULATED, "rlhf.tokens": int(tokens)}):
                seconds = cost.spend(tokens, self.shutdown)
                self.emulated_s += seconds
                return seconds
        finally:
            self.busy_since = None

    def _collective(self, what: str, value: int | None = None) -> int:
        def inside(name: str | None) -> None:
            self.inside = (name, time.monotonic()) if name else None

        fault_point("collective.all_reduce", peer=what)
        return self.host.barrier.wait(self.rank, what, inside, self.host.stopping, value)

    # ------------------------------------------------------------------ the train worker's routes

    def heartbeat(self, args: dict, tensors: dict) -> dict:
        running, inside, busy = self.service.running, self.inside, self.busy_since
        now = time.monotonic()
        return {"rank": self.rank, "phase": running[0] if running else "idle", "step": running[1] if running else 0,
                "collective": inside[0] if inside else "", "collective_s": now - inside[1] if inside else 0.0,
                "cpu_s": self.emulated_s + (now - busy if busy is not None else 0.0),
                "disk_wait_threads": disk_wait_threads(), "simulated": EMULATED}

    def sft_warm_start(self, args: dict, tensors: dict) -> dict:
        return {"sft_stopped": "skipped", "sft_steps": 0, "sft_val_accuracy": 0.0, "simulated": EMULATED}

    def begin_grpo(self, args: dict, tensors: dict) -> dict:
        return {"ok": True, "layout": self.layout.describe(), "simulated": EMULATED}

    def row_fetcher(self) -> RowFetcher:
        return self.host.row_fetcher()

    def _require_device(self, what: str) -> None:
        if self.lease is not None and not self.lease.held:
            self.lease.acquire(self.cfg.timeouts.lease_s)  # waits for rollout_end's release, as a real rank
            log.info("train-%d: device lease reacquired for %s", self.rank, what)

    def compute_logprobs(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        which = args.get("which", "reference")
        self._require_device("compute_logprobs")
        batch = self.rows_batch(args, tensors, "reference", int(args.get("step", -1)))  # data_plane store: fetched
        mask = batch["attention_mask"]
        outs = {}
        for model in which if isinstance(which, list) else [which]:
            fault_point("reference.compute")
            self._compute(self.reference_cost, float(mask.sum()), f"forward.{model}")
            outs[model] = torch.zeros(mask.shape, dtype=torch.float32)  # EMULATED: the rollout's own logprobs' zero
        rows = int(mask.shape[0])
        if "fetch" in args:
            return {"which": which, "rows": rows, **self.keep_logprobs(batch, outs, bool(args.get("keep_rollout")))}, {}
        return {"which": which, "rows": rows}, (outs if isinstance(which, list) else {"logprobs": outs[which]})

    def train_step(self, args: dict, tensors: dict) -> dict:
        t0 = time.perf_counter()
        self._require_device("train_step")
        fault_point("train.step")
        tensors = self.rows_batch(args, tensors, "train", int(args.get("step", -1)))
        self.drop_rows()
        response = tensors["response_mask"]
        self._check_global_batch(int(response.shape[0]), args.get("rows"))
        for key in ("old_logprobs", "ref_logprobs"):  # the loss's token-wise terms (EMULATED), on the real tensors
            if key in tensors:
                (tensors[key] * response).sum()  # a tensor that came short fails here as in the KL term
        minis = tensors.get("mini_batch")
        count = self.cfg.train.mini_batches
        tokens = float(response.sum())
        compute_s = 0.0
        for i in range(count):
            part = float(response[minis == i].sum()) if minis is not None else tokens / count
            compute_s += self._compute(self.train_cost, part, "forward_backward")
            self._collective("all_reduce(grads)")
        self.optimizer_steps += count
        self.host.optimizer_step(self.optimizer_steps)
        rows = int(response.shape[0]) or 1
        return {"kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "response_length": tokens / rows, "ratio_mean": 1.0,
                "loss": 0.0, "grad_norm": 0.0, "tokens": tokens, "lp_diff_sum": 0.0, "lp_diff_max": 0.0,
                "lp_diff_tokens": tokens, "train_seconds": time.perf_counter() - t0, "compute_s": compute_s,
                "rank": self.rank,
                "simulated": EMULATED}

    def _check_global_batch(self, rows: int, rows_sent: int | None) -> None:
        """As a real rank does (the train worker's): the world's rows, all-reduced, must be the configured global
        batch (or the rows the controller says it sends)."""
        total = self._collective("all_reduce(rows)", rows)
        expected = int(rows_sent) if rows_sent else self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        if total != expected:
            raise BatchSizeMismatch({"global_rows": total, "this_rank_rows": rows, "expected_global_batch": expected},
                                    "train step (rollout.prompts_per_step x rollout.group_size)")

    def save(self, args: dict, tensors: dict) -> dict:
        """A rank's checkpoint files, written in place and fsynced: its counters (EMULATED: no optimizer state), and
        on rank 0 the weights (model.safetensors, real bytes: what a disk-mode rollout server loads from the newest
        slot), with the checkpoint.write point half-way through it as on a real rank (a full disk truncates it).
        background (checkpoint.periodic_async), as a real rank: on a writer thread, the reply at once (files: {}), so
        a write that hangs blocks nothing and the slot's meta.json does not wait for it."""
        self.own_files.remove(args.get("remove"))  # its files of the slots the last saves replaced
        items: list[tuple[str, Any]] = [(f"rank{self.rank:05d}.sim.json", {
            "rank": self.rank, "optimizer_steps": self.optimizer_steps, "simulated": EMULATED})]
        if self.rank == 0:
            with self.host.lock:  # a copy: the host's next optimizer step must not reach a background write
                items.insert(0, ("model.safetensors", {k: v.clone() for k, v in export_state(self.model).items()}))
        self.own_files.wrote(args.get("slot"), (name for name, _ in items))

        def write() -> dict[str, str]:
            if self.rank != 0:  # rank 0's point is inside its tensor file's write
                fault_point("checkpoint.write", path=args["directory"])
            return ckpt.write_items(args["directory"], items, bool(args.get("fsync", True)))

        if args.get("background"):
            ctx = contextvars.copy_context()

            def run() -> None:
                try:
                    write()
                except Exception as exc:  # nobody waits for this thread: the log is the only trace
                    log.error("train-%d: background checkpoint write to %s failed: %s: %s", self.rank,
                              args["directory"], type(exc).__name__, exc)

            threading.Thread(target=ctx.run, args=(run,), name=f"ckpt-writer-{self.rank}", daemon=True).start()
            return {"rank": self.rank, "files": {}, "pending": 1, "seconds": 0.0}
        t0 = time.perf_counter()
        return {"rank": self.rank, "files": write(), "seconds": time.perf_counter() - t0}

    def load(self, args: dict, tensors: dict) -> dict:
        fault_point("checkpoint.load", path=args["path"])
        with open(os.path.join(args["path"], f"rank{self.rank:05d}.sim.json"), encoding="utf-8") as fh:
            self.optimizer_steps = int(json.load(fh)["optimizer_steps"])
        self.host.optimizer_step(self.optimizer_steps)
        return {"rank": self.rank, "loaded": args["path"]}

    def events(self, args: dict, tensors: dict) -> dict:
        """Colocation, as a real rank on CPU: rollout_start hands the device (its lease) to rollout server r,
        rollout_end takes it back (waiting up to timeouts.lease_s)."""
        event = args.get("event")
        fault_point("events.handle", peer=str(event), device=self.device)
        if self.lease is not None:
            if event == "rollout_start":
                self.lease.release()
            elif event == "rollout_end":
                self.lease.acquire(self.cfg.timeouts.lease_s)
        return {"event": event, "ack": True, "rank": self.rank}

    def _shutdown(self, args: dict, tensors: dict) -> dict:
        """The process's faults are restored before the reply (its helpers stopped, its files removed): the
        controller's leftover audit runs as soon as the ranks have answered, before this process has exited. A host's
        skewed clock stays until the process ends (its ranks' exit records are stamped by it)."""
        self.shutdown.set()
        faults.restore_all("run end", keep=("clock_skew",))
        return {"ok": True}


async def _listen(service: Service, host: str, runners: list[web.AppRunner]) -> str:
    runner, port = await listen(service, host)
    runners.append(runner)
    return f"http://{host}:{port}"


async def _serve(ranks: list[SimTrainRank], host: str, ready_file: str, stop: threading.Event) -> None:
    runners: list[web.AppRunner] = []
    urls = [await _listen(rank.service, host, runners) for rank in ranks]
    cfg = ranks[0].cfg
    agent = FanoutAgent(ranks[0].rank // cfg.sim.ranks_per_process, ranks[0].token,
                        {rank.rank: url for rank, url in zip(ranks, urls)}, cfg.resilience, cfg.timeouts.rpc_s)
    agent_url = await _listen(agent.service, host, runners)
    write_atomic(ready_file, json.dumps({"urls": urls, "agent": agent_url, "pid": os.getpid()}))
    log.info("simulated train ranks %d-%d listening (pid %d, %s compute)", ranks[0].rank, ranks[-1].rank,
             os.getpid(), EMULATED)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set() and not all(r.shutdown.is_set() for r in ranks):
        await asyncio.sleep(0.1)  # a poll of two conditions set on other threads
    ranks[0].host.stopping.set()
    for _ in range(40):  # the agent's answer to the /shutdown it relays goes out first (2 s at most)
        if not agent.running:
            break
        await asyncio.sleep(0.05)
    await agent.close()
    await asyncio.gather(*(runner.cleanup() for runner in runners))  # side by side: each waits for its connections


def main(argv: list[str] | None = None) -> int:
    parser = host_parser(__doc__, "train ranks")
    parser.add_argument("--processes", type=int, required=True, help="train rank processes in the world")
    parser.add_argument("--store", required=True, help="HOST:PORT of the world's c10d store (the collective)")
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, "train", args.first, deathsig=signal.SIGTERM)
    for r in range(args.first + 1, args.first + args.count):
        exits.record_start(args.run_dir, f"train-{r}", os.getpid())
    model, tokenizer = build_model_and_tokenizer(cfg.model, seed=cfg.seed, device="cpu", dtype="float32")
    store_host, _, port = args.store.rpartition(":")
    barrier = StoreBarrier(store_host, int(port), args.processes, args.count)
    host = SimTrainHost(cfg, args.run_dir, token, model, tokenizer, barrier)
    ranks = [SimTrainRank(host, r) for r in range(args.first, args.first + args.count)]
    stop = threading.Event()
    code = 0
    try:
        asyncio.run(_serve(ranks, args.host, args.ready_file, stop))
    except BaseException:
        code = 1
        raise
    finally:
        ended = "received SIGTERM" if stop.is_set() else ""
        for rank in ranks:
            exits.record_exit(args.run_dir, f"train-{rank.rank}", os.getpid(), code, by=f"train-{rank.rank}",
                              expected=not code and not ended, reason=ended)
        stop_process_telemetry()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
