"""The SFT warm start, the SFT baseline's steps (SFTController, and the sync stall's per-rank clock loop), its eval,
and the pre-flight straggler check."""

from __future__ import annotations

import os
import time

import torch

from rlhf import clock, tracing
from rlhf.data import PromptSampler, build_sft_batch
from rlhf.evaluation import evaluate
from rlhf.faults import fault_point
from rlhf.rollout.engine import RolloutEngine
from rlhf.tasks import build_task
from rlhf.tasks.scoring import scorer_of
from rlhf.tracing.metrics import ACTIVITY
from rlhf.train.engine import TrainEngine
from rlhf.trainers.sft import run_sft


class SftAndPreflight:
    """A train rank's SFT and pre-flight endpoints (a part of TrainWorker)."""

    def sft_warm_start(self, args: dict, tensors: dict) -> dict:
        self._require_device("sft")
        cfg = self.cfg
        per_rank = slice(self.dp_rank, None, self.layout.dp)  # a TP group's ranks take the same examples

        def progressed(row: dict) -> None:  # the heartbeat shows the step: the controller judges the call by it
            self.loop_step = row["step"]

        self.loop_phase, self.loop_step = "sft warm start", 0
        try:
            return run_sft(cfg, self.model, self.tokenizer, build_task(cfg.task), scorer_of(cfg.reward),
                           on_step=progressed, dp=self.dp, examples_per_rank=per_rank, show_progress=self.rank == 0,
                           stop=self.stopping)
        finally:
            self.loop_phase = "idle"

    def sft_begin(self, args: dict, tensors: dict) -> dict:
        self._require_device("sft")
        cfg = self.cfg
        self.engine = TrainEngine(self.model, cfg.train, keep_reference=False, lr=cfg.sft.lr, dp=self.dp,
                                  compute_dtype=self.wire_dtype)
        self.task, self.reward = build_task(cfg.task), scorer_of(cfg.reward)
        self.sft_sampler = PromptSampler(self.task.split("train"), seed=cfg.seed)
        return {"rank": self.rank}

    def sft_step(self, args: dict, tensors: dict) -> dict:
        """One SFT step: every rank draws the same global batch and trains on its share (as the warm start)."""

        self._require_device("sft_step")
        fault_point("train.step")
        examples = self.sft_sampler.next(self.cfg.sft.batch_size)[self.dp_rank::self.layout.dp]
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
                examples = self.sft_sampler.next(self.cfg.sft.batch_size)[self.dp_rank::self.layout.dp]
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

    def sft_eval(self, args: dict, tensors: dict) -> dict:
        if args.get("skip"):
            return {"accuracy": None}

        self.model.eval()
        engine = RolloutEngine(self.model, self.tokenizer)
        split = self.task.split(args.get("split", "eval"))
        return {"accuracy": evaluate(engine.generate, self.tokenizer, split, self.reward,
                                     self.cfg.sampling.max_new_tokens, self.cfg.task.chat_template)["accuracy"]}
