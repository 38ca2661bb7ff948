"""The SFT baseline on the same runtime: SPMD train workers, one controller, no rollout side.

    torchrun --nproc_per_node=2 examples/sft_trainer.py --steps 200 [--faults F]

Same train workers, RPC, collectives, parity checkpoints, tracing and fault points as GRPO, so a
fault file runs on both and the scenario benchmark compares where it surfaces. What SFT lacks is
exactly what RL adds: no rollout servers, no MetaServer, no colocation events, no scheduler jobs.
A point that only RL has (weights_update.*, rollout.*, scheduler.stop_job) is never reached.

One step: train (every rank: its share of the batch, all-reduced gradients) → latest_recover_save.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rlhf import tracing
from rlhf.runtime import checkpoint as ckpt
from rlhf.runtime.control.lifecycle import RunLifecycle, TrackedClock

log = logging.getLogger("rlhf.controller")


class SyncStall(RuntimeError):
    """Ranks are in different places and one waits in a collective the others will never join."""


SFT_COLUMNS = ["step", "seconds", "loss", "grad_norm", "tokens", "val_accuracy", "train_s", "latest_recover_save_s"]


class SFTController(RunLifecycle):
    columns = SFT_COLUMNS
    loop_name = "sft-controller-rpc"
    label = "SFT"
    rl = False

    def startup(self) -> None:
        self.workers.call("sft_begin", stage="startup")

    def total_steps(self) -> int:
        return self.cfg.sft.max_steps

    def train(self) -> list[dict[str, Any]]:
        if self.cfg.sft.termination == "per_rank_duration":
            self.steps_per_rank = self.run_per_rank()
            return []
        return super().train()

    def step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        clock, t0 = TrackedClock(step, self.where), time.perf_counter()
        with clock.stage("train"):
            metrics = [m for m, _ in self.workers.call("sft_step", {"step": step}, step=step, stage="train")]
        if cfg.checkpoint.latest_every and step % cfg.checkpoint.latest_every == 0:
            with clock.stage("latest_recover_save"):
                self.checkpoint(ckpt.slot_for_step(step), step)
        return {"step": step, "seconds": time.perf_counter() - t0, "loss": sum(m["loss"] for m in metrics),
                "grad_norm": metrics[0]["grad_norm"], "tokens": metrics[0]["tokens"],
                **{f"{k}_s": v for k, v in clock.seconds.items()}}

    def after_step(self, step: int, row: dict[str, Any]) -> None:
        if step % self.cfg.sft.eval_every == 0 and step < self.cfg.sft.max_steps:
            row["val_accuracy"] = self.evaluate("val")
            log.info("sft step %d loss %.4f val_accuracy %.3f", step, row["loss"], row["val_accuracy"])

    def summary_extras(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if self.cfg.sft.termination == "per_rank_duration":
            return {"steps": self.steps_per_rank, "termination": "per_rank_duration"}
        return {"sft_steps": self.cfg.sft.max_steps, "sft_stopped": "max_steps"}

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        return {"mode": "sft"}

    def run_per_rank(self) -> int:
        """Every rank trains on its own clock; a watchdog polls heartbeats and names a rank stuck in a collective."""
        cfg = self.cfg
        self.where.update(step=-1, stage="train")
        stall_s = cfg.runtime.watchdog_stall_s

        async def supervise() -> list:
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

    def evaluate(self, split: str = "eval") -> float:
        self.where.update(step=-1, stage="evaluate")
        with tracing.span("evaluate", new_trace=True, split=split):
            return float(self.workers.call("sft_eval", [{"split": split}] + [{"skip": True}] * (len(self.workers) - 1),
                                           stage="evaluate")[0][0]["accuracy"])
