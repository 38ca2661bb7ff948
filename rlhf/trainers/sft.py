"""SFT on the train engine: the GRPO warm start and the baseline later benchmarks compare against.

Warm start (`sft.stop_in_band`): small models' accuracy on these tasks jumps sharply and at a
seed-dependent step, so a fixed step count gives GRPO very different starting points. Instead
we evaluate greedy accuracy on the val split every `sft.eval_every` steps and stop at the first
evaluation at or above `sft.band_low`, reporting whether it landed inside the band or jumped
past `sft.band_high`. Baseline mode runs `sft.max_steps` steps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rlhf.data import PromptSampler, build_sft_batch
from rlhf.envs import Env
from rlhf.evaluation import evaluate, evaluate_episodes
from rlhf.faults import fault_point
from rlhf.models import torch_dtype
from rlhf.progress import Progress
from rlhf.rollout.engine import RolloutEngine
from rlhf.tasks import RewardFn, Task
from rlhf.train.engine import TrainEngine

log = logging.getLogger("rlhf.sft")


def run_sft(
    cfg: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    reward: RewardFn,
    on_step: Any = None,
    dp: Any = None,
    examples_per_rank: slice | None = None,
    show_progress: bool = True,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Train `model` in place with SFT. Returns where it stopped and the last val accuracy.

    show_progress: a progress line on this process's terminal (only one rank should show it).
    stop: set when the process is ending (SIGTERM): the loop ends before its next step, sft_stopped "interrupted".
    """
    sft = cfg.sft
    if sft.max_steps == 0:  # a pretrained model that already answers: GRPO starts from it as it is
        log.info("warm start skipped (sft.max_steps=0)")
        return {"sft_steps": 0, "sft_val_accuracy": None, "sft_stopped": "skipped",
                "sft_band": [sft.band_low, sft.band_high], "sft_seconds": 0.0}

    engine = TrainEngine(model, cfg.train, keep_reference=False, lr=sft.lr, dp=dp,
                         compute_dtype=torch_dtype(cfg.model.dtype) if next(model.parameters()).is_cuda else torch.float32)
    evaluator = RolloutEngine(model, tokenizer)  # shares the weights: greedy eval only
    stop_id = evaluator.stop_ids[0]  # the same stop set the rollout uses; SFT teaches its first id
    sampler = PromptSampler(task.split("train"), seed=cfg.seed)
    max_new = cfg.sampling.max_new_tokens
    demonstrate, make_env = _demonstrations(cfg)  # an environment's worked episodes, in place of the bare answers
    if demonstrate is not None:
        log.info("warm start on %s's demonstrations (its texts trained on, its answers masked); val accuracy from "
                 "greedy episodes with the environment", cfg.sft.env_path or cfg.env.path)
    start = time.perf_counter()
    val_accuracy, step, stopped = float("nan"), 0, "max_steps"
    history = []
    progress = Progress("sft warm start", sft.max_steps, log, tty=None if show_progress else False)
    for step in range(1, sft.max_steps + 1):
        if stop is not None and stop.is_set():
            step, stopped = step - 1, "interrupted"
            log.warning("warm start interrupted after sft step %d: this process is ending", step)
            break
        t_step = time.perf_counter()
        fault_point("sft.step", step=step)
        examples = sampler.next(sft.batch_size)
        if examples_per_rank is not None:
            examples = examples[examples_per_rank]
        demos = demonstrate(examples) if demonstrate is not None else None
        metrics = engine.sft_step(build_sft_batch(tokenizer, examples, cfg.task.chat_template, stop_id, demos))
        row: dict[str, Any] = {"step": step, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                               "tokens": metrics["tokens"], "seconds": time.perf_counter() - t_step}
        if step % sft.eval_every == 0 or step == sft.max_steps:
            model.eval()
            if demonstrate is not None:
                val_accuracy = evaluate_episodes(evaluator, tokenizer, task.split("val"), reward, max_new, make_env,
                                                 cfg.env.max_turns, cfg.env.max_tool_output_tokens,
                                                 cfg.task.chat_template)["accuracy"]
            else:
                val_accuracy = evaluate(evaluator.generate, tokenizer, task.split("val"), reward, max_new,
                                        cfg.task.chat_template)["accuracy"]
            history.append((step, val_accuracy))
            row["val_accuracy"] = val_accuracy
            progress.close()
            log.info("sft step %d loss %.4f val_accuracy %.3f (%.1fs)", step, metrics["loss"], val_accuracy,
                     time.perf_counter() - start)
            if sft.stop_in_band and val_accuracy >= sft.band_low:
                stopped = "in_band" if val_accuracy <= sft.band_high else "past_band"
        if on_step is not None:
            on_step(row)
        progress.update(step, loss=metrics["loss"], val=None if val_accuracy != val_accuracy else val_accuracy)
        if stopped != "max_steps":
            break
    progress.close()
    model.eval()
    result = {
        "sft_steps": step,
        "sft_val_accuracy": val_accuracy,
        "sft_stopped": stopped,
        "sft_band": [sft.band_low, sft.band_high],
        "sft_seconds": time.perf_counter() - start,
    }
    if sft.stop_in_band:
        if stopped == "in_band":
            log.info("warm start stopped at sft step %d: val accuracy %.3f inside band [%.2f, %.2f]",
                     step, val_accuracy, sft.band_low, sft.band_high)
        elif stopped == "past_band":
            log.warning("warm start stopped at sft step %d: val accuracy %.3f jumped past the band [%.2f, %.2f]",
                        step, val_accuracy, sft.band_low, sft.band_high)
        else:
            log.warning("warm start reached sft.max_steps=%d with val accuracy %.3f below the band [%.2f, %.2f]",
                        step, val_accuracy, sft.band_low, sft.band_high)
    return result


def _demonstrations(cfg: Any) -> tuple[Any, Any]:
    """With env.path: a function from examples to the environment's demonstrations (Env.demonstration), and the
    environment's factory (the val episodes); (None, None) when it gives none (the warm start then trains on the
    answers, as without an environment)."""
    path = cfg.sft.env_path or cfg.env.path
    if not path:
        return None, None
    from rlhf.envs import build_env

    make = build_env(path, {"tools": cfg.env.tools} if cfg.env.tools else {})
    if getattr(type(make()), "demonstration", Env.demonstration) is Env.demonstration:
        return None, None

    def demonstrate(examples: list[Any]) -> list[Any]:
        out = []
        for e in examples:
            env, row = make(), {"prompt": e.prompt, "answer": e.answer, **e.fields}
            env.reset(row)
            out.append(env.demonstration(row))
        return out

    return demonstrate, make

