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
import time
from typing import Any

from rlhf import tracing
from rlhf.checkpoint import slots as ckpt
from rlhf.control.lifecycle import RunLifecycle, TrackedClock

log = logging.getLogger("rlhf.controller")


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
        """Every rank trains on its own clock; the stall watchdog (runtime.watchdog_stall_s) reads the ranks'
        heartbeats meanwhile and names a rank that keeps another waiting in a collective."""
        self.where.update(step=-1, stage="train")
        replies = self.workers.call("sft_run_for", {"duration_s": self.cfg.sft.duration_s}, stage="train")
        steps = [r["steps"] for r, _ in replies]
        log.info("per-rank duration: steps per rank %s", steps)
        return max(steps)

    def evaluate(self, split: str = "eval") -> float:
        self.where.update(step=-1, stage="evaluate")
        with tracing.span("evaluate", new_trace=True, split=split):
            return float(self.workers.call("sft_eval", [{"split": split}] + [{"skip": True}] * (len(self.workers) - 1),
                                           stage="evaluate")[0][0]["accuracy"])
