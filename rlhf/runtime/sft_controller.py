"""The SFT baseline on the same runtime: SPMD train workers, one controller, no rollout side.

    torchrun --nproc_per_node=2 examples/sft_trainer.py --steps 200 [--faults F]

Same train workers, RPC, collectives, parity checkpoints, tracing and fault points as GRPO, so a
fault file runs on both and the scenario benchmark compares where it surfaces. What SFT lacks is
exactly what RL adds: no rollout servers, no MetaServer, no colocation events, no scheduler jobs.
A point that only RL has (weights_update.*, rollout.*, scheduler.stop_job) is never reached.

One step: train (every rank: its share of the batch, all-reduced gradients) → latest_recover_save.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

from rlhf import faults, tracing
from rlhf.config import Config
from rlhf.run_dir import StepsWriter, write_json
from rlhf.runtime import checkpoint as ckpt
from rlhf.runtime.controller import WorkerGroup, _TrackedClock
from rlhf.runtime.http import LoopThread

log = logging.getLogger("rlhf.controller")

class SyncStall(RuntimeError):
    """Ranks are in different places and one waits in a collective the others will never join."""


SFT_COLUMNS = ["step", "seconds", "loss", "grad_norm", "tokens", "val_accuracy", "train_s", "latest_recover_save_s"]


class SFTController:
    def __init__(self, cfg: Config, run_dir: str, worker_urls: list[str], token: str) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.loop = LoopThread("sft-controller-rpc")
        self.workers = WorkerGroup(worker_urls, token, self.loop, cfg.runtime.rpc_timeout_s)
        self.where: dict[str, Any] = {"step": -1, "stage": "startup"}
        self.first_failure = ""

    def run(self) -> dict[str, Any]:
        cfg, start = self.cfg, time.perf_counter()
        try:
            with tracing.span("startup", new_trace=True, world_size=len(self.workers)):
                self.workers.call("sft_begin", stage="startup")
            before = self.evaluate()
            log.info("sft baseline: eval accuracy before %.3f (%d ranks)", before, len(self.workers))
            if cfg.sft.termination == "per_rank_duration":
                steps = self.run_per_rank()
                after = self.evaluate()
                summary = {"eval_accuracy_before": before, "eval_accuracy_after": after, "steps": steps,
                           "termination": "per_rank_duration", "seconds": time.perf_counter() - start,
                           "world_size": len(self.workers), "run_dir": self.run_dir}
                write_json(os.path.join(self.run_dir, "summary.json"), summary)
                return summary
            writer = StepsWriter(os.path.join(self.run_dir, "steps.csv"), SFT_COLUMNS)
            times = []
            try:
                for step in range(1, cfg.sft.max_steps + 1):
                    row = self.step(step)
                    if step % cfg.sft.eval_every == 0 and step < cfg.sft.max_steps:
                        row["val_accuracy"] = self.evaluate("val")
                        log.info("sft step %d loss %.4f val_accuracy %.3f", step, row["loss"], row["val_accuracy"])
                    writer.write(row)
                    times.append(row["seconds"])
            finally:
                writer.close()
            after = self.evaluate()
            log.info("sft baseline: eval accuracy %.3f -> %.3f after %d steps", before, after, cfg.sft.max_steps)
            summary = {"eval_accuracy_before": before, "eval_accuracy_after": after, "steps": cfg.sft.max_steps,
                       "sft_steps": cfg.sft.max_steps, "sft_stopped": "max_steps", "seconds": time.perf_counter() - start,
                       "step_time_median_s": statistics.median(times) if times else 0.0, "seed": cfg.seed,
                       "world_size": len(self.workers), "run_dir": self.run_dir}
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            return summary
        except BaseException as exc:
            step, stage = self.where["step"], self.where["stage"]
            self.first_failure = (f"step {step}, stage {stage}" if step >= 0 else stage) + f": {type(exc).__name__}: {exc}"
            log.error("run failed: %s", self.first_failure)
            raise
        finally:
            self.cleanup()
            if self.first_failure and cfg.runtime.resilience == "hardened":
                log.error("first failure of this run: %s", self.first_failure)

    def step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        with tracing.span("step", step=step, new_trace=True), tracing.at_step(step):
            faults.fault_point("step.begin", step=step)
            clock, t0 = _TrackedClock(step, self.where), time.perf_counter()
            with clock.stage("train"):
                metrics = [m for m, _ in self.workers.call("sft_step", {"step": step}, step=step, stage="train")]
            if cfg.checkpoint.latest_every and step % cfg.checkpoint.latest_every == 0:
                with clock.stage("latest_recover_save"):
                    self.save(ckpt.slot_for_step(step), step)
        return {"step": step, "seconds": time.perf_counter() - t0, "loss": sum(m["loss"] for m in metrics),
                "grad_norm": metrics[0]["grad_norm"], "tokens": metrics[0]["tokens"],
                **{f"{k}_s": v for k, v in clock.seconds.items()}}

    def run_per_rank(self) -> int:
        """Every rank trains on its own clock; a watchdog polls heartbeats and names a rank stuck in a collective."""
        cfg = self.cfg
        self.where.update(step=-1, stage="train")
        stall_s = cfg.runtime.watchdog_stall_s

        async def supervise() -> list:
            import asyncio

            calls = [asyncio.ensure_future(c.call("/sft_run_for", {"duration_s": cfg.sft.duration_s}, stage="train",
                                                  timeout_s=cfg.runtime.rpc_timeout_s)) for c in self.workers.clients]
            while True:
                done, pending = await asyncio.wait(calls, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                if not pending:
                    return [c.result()[0] for c in calls]
                for c in done:
                    if c.exception() is not None:
                        raise c.exception()
                if not stall_s:
                    continue
                beats = await asyncio.gather(*[c.call("/heartbeat", method="GET", timeout_s=5, traced=False)
                                               for c in self.workers.clients])
                beats = [b for b, _ in beats]
                stuck = [b for b in beats if b["collective"] and b["collective_s"] >= stall_s]
                elsewhere = [b for b in beats if b["phase"] != beats[0]["phase"] or b["step"] != beats[0]["step"]]
                if stuck and elsewhere:
                    s = stuck[0]
                    others = "; ".join(f"train-{b['rank']} is in {b['phase']} at its step {b['step']}"
                                       + (f" ({b['collective']} for {b['collective_s']:.1f} s)" if b["collective"] else "")
                                       for b in beats if b["rank"] != s["rank"])
                    for c in calls:
                        c.cancel()
                    raise SyncStall(f"train-{s['rank']} has been inside {s['collective']} for {s['collective_s']:.1f} s "
                                    f"at its step {s['step']} ({s['phase']}), while {others}: the ranks disagree about "
                                    "when to stop (each decides on its own clock)")

        replies = self.loop.run(supervise())
        steps = [r["steps"] for r in replies]
        log.info("per-rank duration: steps per rank %s", steps)
        return max(steps)

    def save(self, slot: str, step: int) -> None:
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        atomic = self.cfg.runtime.resilience == "hardened"
        directory = os.path.join(checkpoints, f".staging-{slot}") if atomic else os.path.join(checkpoints, slot)
        os.makedirs(directory, exist_ok=True)
        try:
            replies = self.workers.call("save", {"directory": directory, "fsync": True}, step=step,
                                        stage="latest_recover_save")
        except (RuntimeError, OSError, TimeoutError) as exc:
            if atomic:
                raise
            log.warning("step %d: latest_recover_save to %s failed (%s: %s); continuing", step, slot,
                        type(exc).__name__, exc)
            return
        files: dict[str, str] = {}
        for reply, _ in replies:
            files.update(reply["files"])
        meta = {"step": step, "complete": True, "files": files, "slot": slot, "controller": {"mode": "sft"}}
        ckpt.finish_slot(checkpoints, slot, directory, meta, atomic)

    def evaluate(self, split: str = "eval") -> float:
        self.where.update(step=-1, stage="evaluate")
        with tracing.span("evaluate", new_trace=True, split=split):
            return float(self.workers.call("sft_eval", [{"split": split}] + [{"skip": True}] * (len(self.workers) - 1),
                                           stage="evaluate")[0][0]["accuracy"])

    def cleanup(self) -> None:
        with tracing.span("cleanup", stage="cleanup", new_trace=True):
            try:
                self.workers.call("shutdown", timeout_s=10, stage="cleanup")
            except (RuntimeError, OSError, TimeoutError) as exc:
                log.error("cleanup: worker shutdown: %s: %s", type(exc).__name__, exc)
            faults.restore_all("run end")
            report = faults.audit(self.run_dir)
            if report["unrestored"]:
                log.warning("fault audit: %d injection(s) not restored by their process; cleaned: %s",
                            len(report["unrestored"]), "; ".join(report["cleaned"]) or "nothing left")
            self.loop.gather(*[c.close() for c in self.workers.clients], return_exceptions=True)
            self.loop.close()
