"""The SFT baseline run: SFT for sft.max_steps steps, greedy eval before and after."""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

from rlhf.config import Config
from rlhf.evaluation import evaluate
from rlhf.models import build_model_and_tokenizer
from rlhf.rollout.engine import RolloutEngine
from rlhf.run_dir import StepsWriter
from rlhf.tasks import build_task, reward_fn
from rlhf.trainers.sft import run_sft

log = logging.getLogger("rlhf.sft")

def seed_everything(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


SFT_COLUMNS = ["step", "seconds", "loss", "grad_norm", "tokens", "val_accuracy"]


def run_sft_baseline(cfg: Config, run_dir: str) -> dict[str, Any]:
    start = time.perf_counter()
    seed_everything(cfg.seed)
    model, tokenizer = build_model_and_tokenizer(cfg.model, seed=cfg.seed)
    task, reward = build_task(cfg.task), reward_fn(cfg.task.reward)

    def accuracy() -> float:
        engine = RolloutEngine(model, tokenizer)
        return evaluate(engine.generate, tokenizer, task.split("eval"), reward, cfg.rollout.max_new_tokens)["accuracy"]

    before = accuracy()
    writer = StepsWriter(os.path.join(run_dir, "steps.csv"), SFT_COLUMNS)
    step_times: list[float] = []

    def on_step(row: dict[str, Any]) -> None:
        writer.write(row)
        step_times.append(row["seconds"])

    try:
        result = run_sft(cfg, model, tokenizer, task, reward, on_step=on_step)
    finally:
        writer.close()
    after = accuracy()
    log.info("sft baseline: eval accuracy %.3f -> %.3f after %d steps", before, after, result["sft_steps"])
    return {
        "eval_accuracy_before": before,
        "eval_accuracy_after": after,
        "eval_problems": len(task.split("eval")),
        "steps": result["sft_steps"],
        "seconds": time.perf_counter() - start,
        "step_time_median_s": statistics.median(step_times) if step_times else 0.0,
        "seed": cfg.seed,
        **result,
        "run_dir": run_dir,
    }
