"""The single controller: it alone decides the step, what each stage does, and when the run ends.

    torchrun --nproc_per_node=N examples/grpo_trainer.py
    │
    ├─ rank 0 ─ Controller (this loop) ── MetaServer (HTTP, weight relay, in-process)
    │          └ TrainWorker 0 (RPC server thread)          ┐ SPMD: one torch.distributed
    ├─ rank 1 ─ TrainWorker 1 (RPC server)                  │ world (gloo on CPU, nccl on GPU),
    ├─ …                                                    ┘ data parallel
    │
    └─ Scheduler service (own process, HTTP; stops its jobs when our lease lapses)
        └─ RolloutServer 0 … M-1 (own processes, sglang-compatible HTTP API)

One step, top to bottom (DESIGN.md §2):

    weights_update → events(rollout_start) → rollout → events(rollout_end) → reward
    → data split → reference → advantage → train → latest_recover_save → periodic_recover_save

Fan-out is explicit: `self.workers.call("train_step", ...)` calls the method on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch

from rlhf import tracing
from rlhf.algorithms.grpo import group_advantages
from rlhf.devices import rollout_device
from rlhf.faults import fault_point
from rlhf.config import Config
from rlhf.data import PromptSampler, build_rl_batch, completion_text, encode_prompts
from rlhf.models import load_tokenizer, pad_token_id
from rlhf.models.tokenizer import CharTokenizer
from rlhf.run_dir import StepsWriter, write_json
from rlhf.runtime import checkpoint as ckpt
from rlhf.runtime.batch_memory import DistributedBatchMemory
from rlhf.runtime.errors import RpcConnectionError, RpcTimeout
from rlhf.runtime.http import Client, LoopThread
from rlhf.runtime.metaserver import MetaServer
from rlhf.runtime.procs import wait_for_file
from rlhf.runtime.scheduler import SchedulerClient
from rlhf.stages import StageClock
from rlhf.tasks import build_task, reward_fn

log = logging.getLogger("rlhf.controller")

STEP_COLUMNS = [
    "step", "seconds", "reward_mean", "reward_std", "equal_reward_groups", "kl", "clip_fraction", "entropy",
    "response_length", "loss", "grad_norm", "ratio_mean", "rollout_tokens", "rollout_tokens_per_s", "batch_size",
    "dp_imbalance", "weights_update_s", "events_s", "rollout_s", "reward_s", "reference_s", "advantage_s", "train_s",
    "latest_recover_save_s", "periodic_recover_save_s", "upload_s_max", "update_s_max", "weights_verified",
    "train_offload_mb", "rollout_release_mb", "eval_accuracy",
]


OUTER_MARGIN_S = 10.0  # a call that wraps a server-side wait gets this much longer than the wait


EVENT_ATTEMPTS = 3  # hardened: deliveries of one colocation event before the step fails


class EventNotDelivered(RuntimeError):
    """hardened: a colocation event was not acknowledged by its peer."""


class WeightsMismatch(RuntimeError):
    """A rollout server's weights or version differ from the trainer's after a weights update."""


class WorkerGroup:
    """RPC clients for every train rank; `call` runs a method on all of them concurrently."""

    def __init__(self, urls: list[str], token: str, loop: LoopThread, timeout_s: float) -> None:
        self.clients = [Client(u, token, timeout_s, peer=f"train-{r}") for r, u in enumerate(urls)]
        self.loop = loop

    def __len__(self) -> int:
        return len(self.clients)

    async def acall(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1,
                    stage: str = "", timeout_s: float | None = None) -> list[tuple[Any, dict]]:
        per_rank_args = args if isinstance(args, list) else [args or {}] * len(self.clients)
        per_rank_tensors = tensors or [None] * len(self.clients)
        return list(await asyncio.gather(*[
            c.call(f"/{method}", a, t, timeout_s=timeout_s, stage=stage, step=step)
            for c, a, t in zip(self.clients, per_rank_args, per_rank_tensors)
        ]))

    def call(self, method: str, args: Any = None, tensors: list[dict] | None = None, step: int = -1, stage: str = "",
             timeout_s: float | None = None) -> list[tuple[Any, dict]]:
        return self.loop.run(self.acall(method, args, tensors, step, stage, timeout_s))


class Controller:
    def __init__(self, cfg: Config, run_dir: str, worker_urls: list[str], token: str) -> None:
        self.cfg, self.run_dir, self.token = cfg, run_dir, token
        self.loop = LoopThread("controller-rpc")
        self.workers = WorkerGroup(worker_urls, token, self.loop, cfg.runtime.rpc_timeout_s)
        self.task = build_task(cfg.task)
        self.reward = reward_fn(cfg.task.reward)
        self.tokenizer = self._tokenizer()
        self.sampler = PromptSampler(self.task.split("train"), seed=cfg.seed)
        self.scheduler: SchedulerClient | None = None
        self.metaserver: MetaServer | None = None
        self.rollout: list[Client] = []
        self.version = "0"
        self.sft_result: dict[str, Any] = {}
        self.start_step = 0
        self.latest_slot = ""  # faithful disk mode reads weights from here
        self.where = {"step": -1, "stage": "startup"}  # what the controller is doing (for the first failure)
        self.first_failure = ""

    def _tokenizer(self) -> Any:
        """The controller needs only the tokenizer (prompts in, completions out), never the weights."""
        return load_tokenizer(self.cfg.model.path) if self.cfg.model.path else CharTokenizer()

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start = time.perf_counter()
        try:
            with tracing.span("startup", new_trace=True, world_size=len(self.workers),
                              rollout_servers=cfg.rollout.servers):
                self.start_services()
                resumed = self.resume_or_warm_start()
                self.weights_update(self.version, step=self.start_step)
            before = self.evaluate()
            log.info("eval accuracy %s: %.3f (%d problems, greedy)", "at resume" if resumed else "before GRPO",
                     before, len(self.task.split("eval")))
            writer = StepsWriter(os.path.join(self.run_dir, "steps.csv"), STEP_COLUMNS)
            step_times, tokens, rollout_s = [], 0, 0.0
            try:
                for step in range(self.start_step + 1, cfg.steps + 1):
                    row = self.step(step)
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                        row["eval_accuracy"] = self.evaluate()
                    writer.write(row)
                    step_times.append(row["seconds"])
                    tokens += row["rollout_tokens"]
                    rollout_s += row["rollout_s"]
                    log.info("step %d/%d reward %.3f kl %.4f clip %.3f len %.2f %.2fs", step, cfg.steps,
                             row["reward_mean"], row["kl"], row["clip_fraction"], row["response_length"],
                             row["seconds"])
            finally:
                writer.close()
            after = self.evaluate()
            log.info("eval accuracy after GRPO: %.3f (before %.3f, gain %+.3f)", after, before, after - before)
            summary = {
                "eval_accuracy_before": before,
                "eval_accuracy_after": after,
                "eval_problems": len(self.task.split("eval")),
                "steps": cfg.steps,
                "resumed_from_step": self.start_step if resumed else None,
                "seconds": time.perf_counter() - start,
                "step_time_median_s": statistics.median(step_times) if step_times else 0.0,
                "rollout_tokens_per_s": tokens / rollout_s if rollout_s else 0.0,
                "seed": cfg.seed,
                "world_size": len(self.workers),
                "rollout_servers": cfg.rollout.servers,
                "weights_mode": cfg.weights.mode,
                "colocate": cfg.runtime.colocate,
                **self.sft_result,
                "run_dir": self.run_dir,
            }
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            return summary
        except BaseException as exc:
            self.first_failure = self._describe(exc)
            log.error("run failed: %s", self.first_failure)
            raise
        finally:
            self.cleanup()
            if self.first_failure and self.cfg.runtime.resilience == "hardened":
                # first-failure ledger: whatever cleanup logged, the last error line names the first failure
                log.error("first failure of this run: %s", self.first_failure)

    def _describe(self, exc: BaseException) -> str:
        step, stage = self.where["step"], self.where["stage"]
        at = f"step {step}, stage {stage}" if step >= 0 else f"{stage}"
        return f"{at}: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ services

    def start_services(self) -> None:
        cfg = self.cfg
        self.metaserver = MetaServer(self.token, cfg.weights.max_versions, cfg.weights.max_bytes, cfg.runtime.resilience,
                                     cfg.weights.transport)
        self.metaserver_url = self.metaserver.start()
        self.scheduler = SchedulerClient(self.run_dir, self.token, cfg.runtime.scheduler_lease_s,
                                         cfg.runtime.startup_timeout_s, self.loop)
        threads = str(max(1, (os.cpu_count() or 2) // cfg.rollout.servers))
        ready_files = []
        for r in range(cfg.rollout.servers):
            ready = os.path.join(self.run_dir, f"rollout-{r}.url")
            if os.path.exists(ready):
                os.remove(ready)
            cmd = [sys.executable, "-m", "rlhf.runtime.rollout_server", "--run-dir", self.run_dir, "--rank", str(r),
                   "--config", os.path.join(self.run_dir, "config.yaml"), "--ready-file", ready]
            if cfg.runtime.colocate:
                cmd.append("--colocate")
            cmd += ["--device", str(rollout_device(cfg.model.device, r, len(self.workers), cfg.runtime.colocate))]
            env = {"RLHF_TOKEN": self.token, "RLHF_ROLLOUT_THREADS": threads, "PYTHONPATH": _pythonpath()}
            self.scheduler.submit(f"rollout-{r}", "rollout", cmd, env, colocate_with=f"train-{r}" if cfg.runtime.colocate else "")
            ready_files.append(ready)
        urls = [wait_for_file(f, cfg.runtime.startup_timeout_s) for f in ready_files]
        self.rollout = [Client(u, self.token, cfg.runtime.rollout_timeout_s, peer=f"rollout-{r}")
                        for r, u in enumerate(urls)]
        log.info("services up: metaserver %s, scheduler %s, %d rollout servers, %d train ranks",
                 self.metaserver_url, self.scheduler.url, len(urls), len(self.workers))

    def resume_or_warm_start(self) -> bool:
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        found = ckpt.newest_checkpoint(checkpoints, check_sums=self.cfg.runtime.resilience == "hardened") \
            if self.cfg.checkpoint.resume else None
        if found is not None:
            path, meta = found
            self.where.update(step=-1, stage="resume")
            state = meta["controller"]
            self.workers.call("begin_grpo", {"load_reference": True})
            self.workers.call("load", {"path": path, "optimizer_steps": state["optimizer_steps"]})
            self.sampler.load_state_dict(state["sampler"])
            self.sft_result = state["sft"]
            self.start_step = int(meta["step"])
            self.version = str(self.start_step)
            log.info("resumed from %s at step %d", path, self.start_step)
            self.where.update(step=-1, stage="startup")
            return True
        (result, _), *_ = self.workers.call("sft_warm_start", stage="sft")
        self.sft_result = result
        self.workers.call("begin_grpo", {"save_reference": True})
        if result["sft_stopped"] != "skipped":
            log.info("warm start: %s at sft step %d, val accuracy %.3f", result["sft_stopped"], result["sft_steps"],
                     result["sft_val_accuracy"])
        return False

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, Any]:
        with tracing.span("step", step=step, new_trace=True), tracing.at_step(step):
            fault_point("step.begin", step=step)
            return self._step(step)

    def _step(self, step: int) -> dict[str, Any]:
        clock, t0, cfg = _TrackedClock(step, self.where), time.perf_counter(), self.cfg
        row: dict[str, Any] = {"step": step}
        with clock.stage("weights_update"):
            row.update(self.weights_update(str(step), step))
            if cfg.weights.verify:
                row["weights_verified"] = self.verify_weights(str(step), step)
        with clock.stage("events"):
            row["train_offload_mb"] = _freed_mb(self.notify("rollout_start", step), "train")
        with clock.stage("rollout"):
            memory = self.generate(step)
        with clock.stage("events"):
            row["rollout_release_mb"] = _freed_mb(self.notify("rollout_end", step), "rollout")
        with clock.stage("reward"):
            memory["rewards"] = torch.tensor(self.reward(memory["completions"], memory["answers"], memory["prompts"]))
            fault_point("data.split", step=step)
            shards, split = memory.split(len(self.workers), tokens_key="num_tokens")
        with clock.stage("reference"):
            batches = [self.to_batch(s) for s in shards]  # tensors are built where they are first needed
            if cfg.algorithm.kl_coef > 0:
                for batch, (_, out) in zip(batches, self.workers.call("compute_logprobs", {"which": "reference"},
                                                                       batches, step, "reference")):
                    batch["ref_logprobs"] = out["logprobs"]
            if cfg.algorithm.old_logprobs == "recompute":
                for batch, (_, out) in zip(batches, self.workers.call("compute_logprobs", {"which": "policy"},
                                                                       batches, step, "reference")):
                    batch["old_logprobs"] = out["logprobs"]
        with clock.stage("advantage"):
            advantages, stats = group_advantages(memory["rewards"], cfg.rollout.group_size, cfg.algorithm.scale_by_std)
            for batch, shard in zip(batches, shards):
                batch["advantages"] = advantages[torch.tensor(shard["sample_index"])]
        with clock.stage("train"):
            metrics = [m for m, _ in self.workers.call("train_step", {"step": step}, batches, step, "train")]
        if cfg.checkpoint.latest_every and step % cfg.checkpoint.latest_every == 0:
            with clock.stage("latest_recover_save"):
                self._save_step(ckpt.slot_for_step(step), step)
        if cfg.checkpoint.periodic_every and step % cfg.checkpoint.periodic_every == 0:
            with clock.stage("periodic_recover_save"):
                self._save_step(os.path.join("periodic", f"step_{step}"), step)
        self.version = str(step)
        tokens = int(sum(memory["num_tokens"]))
        row.update(stats)
        row.update(_merge_metrics(metrics))
        row.update({
            "seconds": time.perf_counter() - t0,
            "rollout_tokens": tokens,
            "rollout_tokens_per_s": tokens / clock.seconds["rollout"],
            "batch_size": len(memory),
            "dp_imbalance": split["imbalance"],
            **{f"{k}_s": v for k, v in clock.seconds.items()},
        })
        return row

    # ------------------------------------------------------------------ stages

    def weights_update(self, version: str, step: int) -> dict[str, float]:
        """Push the train ranks' weights to every rollout server as `version`."""
        cfg = self.cfg
        if cfg.weights.mode == "meta":
            return self.loop.run(self._weights_update_meta(version, step))
        t0 = time.perf_counter()
        if cfg.runtime.resilience == "faithful" and self.latest_slot:
            # the seeds' disk mode: rollout servers load the newest parity checkpoint, written in place
            path = os.path.join(self.run_dir, "checkpoints", self.latest_slot)
        else:
            path = os.path.join(self.run_dir, "weights", "latest")
            self.workers.call("save_weights_dir", {"path": path}, step=step, stage="weights_update")
        upload = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.loop.gather(*[
            c.call("/update_weights_from_disk", {"model_path": path, "weight_version": version},
                   timeout_s=cfg.weights.update_timeout_s, stage="weights_update", step=step) for c in self.rollout])
        return {"upload_s_max": upload, "update_s_max": time.perf_counter() - t1}

    async def _weights_update_meta(self, version: str, step: int) -> dict[str, float]:
        cfg = self.cfg
        meta = Client(self.metaserver_url, self.token, peer="metaserver-0")
        try:
            await meta.call("/versions", {"version": version, "shards": len(self.workers)}, stage="weights_update",
                            step=step)
        finally:
            await meta.close()

        async def timed(coro: Any) -> float:
            t = time.perf_counter()
            await coro
            return time.perf_counter() - t

        uploads = [timed(c.call("/upload_weights", {"metaserver_url": self.metaserver_url, "version": version,
                                                    "timeout_s": cfg.weights.upload_timeout_s,
                                                    "shm_dir": self.metaserver.shm_dir if self.metaserver else ""},
                                timeout_s=cfg.weights.upload_timeout_s, stage="weights_update", step=step))
                   for c in self.workers.clients]
        updates = [timed(c.call("/update_weights_from_meta",
                                {"metaserver_url": self.metaserver_url, "weight_version": version,
                                 "wait_s": cfg.weights.update_timeout_s, "timeout_s": cfg.weights.update_timeout_s},
                                # the server's own wait ends first, so its error (not our timeout) comes back
                                timeout_s=cfg.weights.update_timeout_s + OUTER_MARGIN_S, stage="weights_update",
                                step=step))
                   for c in self.rollout]
        times = await asyncio.gather(*uploads, *updates)  # upload and update in parallel; wait for both sides
        n = len(uploads)
        return {"upload_s_max": max(times[:n]), "update_s_max": max(times[n:]) if times[n:] else 0.0}

    def verify_weights(self, version: str, step: int) -> int:
        """Every rollout server must report `version` and the trainer's checksum; returns 1 or raises."""
        trainer = self.workers.call("weights_checksum", step=step, stage="weights_update")[0][0]
        replies = self.loop.gather(*[c.call("/weights_checksum", method="GET", stage="weights_update", step=step)
                                     for c in self.rollout])
        wrong = [f"rollout-{r}: version {rep['weight_version']} checksum {rep['checksum'][:12]}"
                 for r, (rep, _) in enumerate(replies)
                 if rep["weight_version"] != version or rep["checksum"] != trainer["checksum"]]
        if wrong:
            raise WeightsMismatch(f"step {step}: trainer has version {version} checksum {trainer['checksum'][:12]}; "
                                  + "; ".join(wrong))
        return 1

    def notify(self, event: str, step: int) -> list[tuple[str, Any]]:
        """Colocation events to train rank r and rollout server r (only when colocated).

        faithful (the seeds): fire and forget — an event that is not delivered in time is a WARNING and the
        step goes on, so the pair may disagree about who owns the device. hardened: every event must be
        acknowledged; a lost one is retried (the handlers are idempotent) and then fails the step, naming the peer.
        """
        if not self.cfg.runtime.colocate:
            return []
        timeout = self.cfg.runtime.event_timeout_s
        pairs = min(len(self.workers), len(self.rollout))
        faithful = self.cfg.runtime.resilience == "faithful"
        attempts = 1 if faithful else EVENT_ATTEMPTS

        async def one(client: Client) -> Any:
            for attempt in range(1, attempts + 1):
                try:
                    return await client.call("/events", {"event": event, "step": step}, timeout_s=timeout,
                                             stage="events", step=step, points=("events.notify",))
                except (RpcTimeout, RpcConnectionError) as exc:
                    if faithful:
                        log.warning("step %d: event %s to %s not delivered (%s: %s); continuing (events are not "
                                    "acknowledged)", step, event, client.peer, type(exc).__name__, exc)
                        return None
                    if attempt == attempts:
                        raise EventNotDelivered(f"{event} to {client.peer} at step {step}: not acknowledged after "
                                                f"{attempts} attempts of {timeout:g} s ({exc})") from exc
                    log.warning("step %d: event %s to %s: attempt %d failed (%s); retrying", step, event,
                                client.peer, attempt, type(exc).__name__)

        clients = [c for r in range(pairs) for c in (self.workers.clients[r], self.rollout[r])]

        async def send() -> list[Any]:
            return list(await asyncio.gather(*[one(c) for c in clients]))

        return [(c.peer, reply) for c, reply in zip(clients, self.loop.run(send()))]

    def generate(self, step: int) -> DistributedBatchMemory:
        """rollout: prompts split across servers (whole groups), results concatenated."""
        cfg = self.cfg
        examples = self.sampler.next(cfg.rollout.prompts_per_step)
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.cfg.task.chat_template)
        params = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
                  "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k, "n": cfg.rollout.group_size,
                  "ignore_eos": cfg.rollout.ignore_eos}
        chunks = _chunks(list(range(len(examples))), len(self.rollout))

        async def one(client: Client, idx: list[int]) -> DistributedBatchMemory:
            if not idx:
                return DistributedBatchMemory({k: [] for k in _ROLLOUT_KEYS}, cfg.rollout.group_size)
            results, _ = await client.call("/generate", {"input_ids": [prompt_ids[i] for i in idx],
                                                         "sampling_params": params, "return_logprob": True},
                                           stage="rollout", step=step)
            g = cfg.rollout.group_size
            rep = [i for i in idx for _ in range(g)]
            return DistributedBatchMemory({
                "sample_index": [],  # filled after concat
                "prompt_ids": [prompt_ids[i] for i in rep],
                "output_ids": [r["output_ids"] for r in results],
                "logprobs": [[lp for lp, _t, _ in r["meta_info"]["output_token_logprobs"]] for r in results],
                "num_tokens": [len(prompt_ids[i]) + len(r["output_ids"]) for i, r in zip(rep, results)],
                "prompts": [examples[i].prompt for i in rep],
                "answers": [examples[i].answer for i in rep],
                "completions": [completion_text(self.tokenizer, r) for r in results],
                "weight_version": [r["meta_info"]["weight_version"] for r in results],
            }, g, strict=False)

        faithful = cfg.runtime.resilience == "faithful"
        results = self.loop.gather(*[one(c, idx) for c, idx in zip(self.rollout, chunks)], return_exceptions=faithful)
        parts = []
        for r, part in enumerate(results):
            if isinstance(part, RpcTimeout):  # faithful: in-flight requests are kept, aborted, with no tokens
                log.warning("step %d: rollout-%d timed out (%s); keeping its %d samples as aborted (no tokens)",
                            step, r, part, len(chunks[r]) * cfg.rollout.group_size)
                parts.append(self._aborted(chunks[r], examples, prompt_ids))
                continue
            if isinstance(part, BaseException):  # faithful only: the seeds' controller goes on with what it has
                log.warning("step %d: rollout-%d failed (%s: %s); continuing with the samples of the other servers",
                            step, r, type(part).__name__, part)
                continue
            parts.append(part)
        if not parts:
            raise RuntimeError(f"step {step}: every rollout server failed")
        for p in parts:
            p["sample_index"] = [0] * len(p["output_ids"])
        memory = DistributedBatchMemory.concat(parts, cfg.rollout.group_size)
        memory["sample_index"] = list(range(len(memory)))
        stale = {v for v in memory["weight_version"] if v not in (str(step), ABORTED)}
        if stale:
            log.warning("step %d: samples from stale weight versions %s", step, sorted(stale))
        return memory

    def _aborted(self, idx: list[int], examples: list[Any], prompt_ids: list[list[int]]) -> DistributedBatchMemory:
        """faithful: the samples of a server that timed out, as sglang reports aborted requests (no tokens yet)."""
        rep = [i for i in idx for _ in range(self.cfg.rollout.group_size)]
        return DistributedBatchMemory({
            "sample_index": [0] * len(rep), "prompt_ids": [prompt_ids[i] for i in rep], "output_ids": [[] for _ in rep],
            "logprobs": [[] for _ in rep], "num_tokens": [len(prompt_ids[i]) for i in rep],
            "prompts": [examples[i].prompt for i in rep], "answers": [examples[i].answer for i in rep],
            "completions": ["" for _ in rep], "weight_version": [ABORTED] * len(rep),
        }, self.cfg.rollout.group_size, strict=False)

    def to_batch(self, shard: DistributedBatchMemory) -> dict[str, torch.Tensor]:
        results = [{"output_ids": o, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(l, o)]}}
                   for o, l in zip(shard["output_ids"], shard["logprobs"])]
        return build_rl_batch(shard["prompt_ids"], results, pad_token_id(None, self.tokenizer))

    def _save_step(self, slot: str, step: int) -> None:
        """Hardened: a failed save fails the run here. Faithful (the seeds): a warning, and the run goes on."""
        stage = "latest_recover_save" if slot.startswith("latest") else "periodic_recover_save"
        if self.cfg.runtime.resilience == "hardened":
            self.save(slot, step)
            return
        try:
            self.save(slot, step, background=stage == "periodic_recover_save" and self.cfg.checkpoint.periodic_async)
            if stage == "latest_recover_save":
                self.latest_slot = slot
        except (RuntimeError, OSError, TimeoutError) as exc:
            if stage == "latest_recover_save":
                self.latest_slot = slot  # the slot was being written in place: it is what the next update reads
            log.warning("step %d: %s to %s failed (%s: %s); continuing", step, stage, slot, type(exc).__name__, exc)

    def save(self, slot: str, step: int, background: bool = False) -> None:
        """latest_recover_save / periodic_recover_save: every rank writes its files, then meta.json last.

        background (faithful, checkpoint.periodic_async): the ranks write on a writer thread and reply at once;
        meta.json is written without waiting for them, as the seeds' asynchronous periodic save did.
        """
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        atomic = self.cfg.runtime.resilience == "hardened"
        final = os.path.join(checkpoints, slot)
        directory = os.path.join(checkpoints, f".staging-{slot.replace(os.sep, '-')}") if atomic else final
        if atomic:
            shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, exist_ok=True)
        replies = self.workers.call("save", {"directory": directory, "fsync": True, "background": background},
                                    step=step,
                                    stage="latest_recover_save" if slot.startswith("latest") else "periodic_recover_save")
        files: dict[str, str] = {}
        for reply, _ in replies:
            files.update(reply["files"])
        optimizer_steps = step * self.cfg.train.mini_batches
        meta = {"step": step, "complete": True, "files": files, "slot": slot,
                "controller": {"sampler": self.sampler.state_dict(), "sft": self.sft_result,
                               "optimizer_steps": optimizer_steps}}
        ckpt.finish_slot(checkpoints, slot, directory, meta, atomic)

    def evaluate(self) -> float:
        """Greedy accuracy on the eval split, spread over the rollout servers."""
        self.where.update(step=-1, stage="evaluate")
        with tracing.span("evaluate", new_trace=True) as sp:
            accuracy = self._evaluate()
            sp.set_attribute("rlhf.eval_accuracy", accuracy)
            return accuracy

    def _evaluate(self) -> float:
        examples = self.task.split("eval")
        prompt_ids = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.cfg.task.chat_template)
        chunks = _chunks(list(range(len(examples))), len(self.rollout))
        params = {"max_new_tokens": self.cfg.rollout.max_new_tokens, "temperature": 0.0}
        self.notify("rollout_start", -1)

        async def one(client: Client, idx: list[int]) -> list[dict]:
            if not idx:
                return []
            return (await client.call("/generate", {"input_ids": [prompt_ids[i] for i in idx],
                                                    "sampling_params": params}, stage="rollout"))[0]

        try:
            parts = self.loop.gather(*[one(c, idx) for c, idx in zip(self.rollout, chunks)])
        finally:
            self.notify("rollout_end", -1)
        order = [i for idx in chunks for i in idx]
        results = [r for part in parts for r in part]
        completions = {i: completion_text(self.tokenizer, r) for i, r in zip(order, results)}
        rewards = self.reward([completions[i] for i in range(len(examples))], [e.answer for e in examples],
                              [e.prompt for e in examples])
        return sum(rewards) / len(rewards)

    # ------------------------------------------------------------------ cleanup

    def cleanup(self) -> None:
        """Stop every job through the scheduler, then the services. Errors here are logged, never raised over the first."""
        with tracing.span("cleanup", stage="cleanup", new_trace=True):
            self._cleanup()

    def _cleanup(self) -> None:
        errors: list[str] = []
        if self.scheduler is not None:
            async def stop_all() -> list[Any]:
                return await asyncio.gather(*[
                    self.scheduler.stop_job(j["name"], self.cfg.runtime.cleanup_timeout_s)  # type: ignore[union-attr]
                    for j in await _jobs(self.scheduler)], return_exceptions=True)

            try:
                for result in self.loop.run(stop_all()):
                    if isinstance(result, BaseException):
                        log.error("cleanup: stop job: %s: %s", type(result).__name__, result)  # as it happens
            except (RuntimeError, OSError, TimeoutError) as exc:
                log.error("cleanup: %s: %s", type(exc).__name__, exc)
            self.scheduler.close()
        if self.metaserver is not None:
            self.metaserver.stop()
        try:
            self.workers.call("shutdown", timeout_s=10, stage="cleanup")
        except (RuntimeError, OSError, TimeoutError) as exc:
            errors.append(f"worker shutdown: {type(exc).__name__}: {exc}")
        from rlhf import faults

        faults.restore_all("run end")
        report = faults.audit(self.run_dir)  # what dead processes left behind: helpers, fill files
        if report["unrestored"]:
            log.warning("fault audit: %d injection(s) not restored by their process; cleaned: %s",
                        len(report["unrestored"]), "; ".join(report["cleaned"]) or "nothing left")
        for e in errors:
            log.error("cleanup: %s", e)
        clients = self.workers.clients + self.rollout + ([self.scheduler.client] if self.scheduler else [])
        self.loop.gather(*[c.close() for c in clients], return_exceptions=True)
        self.loop.close()


async def _jobs(scheduler: SchedulerClient) -> list[dict]:
    return (await scheduler.client.call("/jobs", method="GET", stage="cleanup"))[0]


ABORTED = "aborted"  # weight_version of a sample whose request timed out (faithful)

_ROLLOUT_KEYS = ["sample_index", "prompt_ids", "output_ids", "logprobs", "num_tokens", "prompts", "answers",
                 "completions", "weight_version"]


class _TrackedClock(StageClock):
    """A StageClock that also tells the controller which stage is running (for the failure report)."""

    def __init__(self, step: int, where: dict[str, Any]) -> None:
        super().__init__(step)
        self.where = where
        where.update(step=step, stage="step")

    def stage(self, name: str):  # type: ignore[override]
        self.where["stage"] = name
        return super().stage(name)


def _freed_mb(replies: list[tuple[str, Any]], role: str) -> float | str:
    """Device memory (MB) the colocation event freed on the `role` side, summed over pairs ('' on CPU)."""
    freed = [r[0]["device_mb_before"] - r[0]["device_mb_after"] for peer, r in replies
             if peer.startswith(role) and r and isinstance(r[0], dict) and "device_mb_before" in r[0]]
    return round(sum(freed), 1) if freed else ""


def _chunks(items: list[int], n: int) -> list[list[int]]:
    """n contiguous, near-equal chunks."""
    bounds = [round(i * len(items) / n) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    total = sum(m["tokens"] for m in per_rank) or 1.0
    out = {}
    for key in ("kl", "clip_fraction", "entropy", "response_length", "ratio_mean"):
        out[key] = sum(m[key] * m["tokens"] for m in per_rank) / total
    out["loss"] = sum(m["loss"] for m in per_rank)  # each rank's part is normalised by the global count
    out["grad_norm"] = per_rank[0]["grad_norm"]
    return out


def _pythonpath() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
