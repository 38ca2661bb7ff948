"""Reward server: a reward model (rlhf.models.reward_model) behind HTTP, one process started by the scheduler as
job `reward-0` (role `reward`), like a rollout server: the run token on every route but /health, a span per request,
fault points, its own log (logs/reward-0.log), exit records and heartbeat, and stopped at cleanup.

    python -m rlhf.services.reward_server --run-dir D --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

    POST /score   {"prompts": [...], "completions": [...]}  ->  {"scores": [...], "model": path}
    GET  /health  {"ok": true, "model": path}

Fault point `reward_model.score`: before a /score batch runs on the model (a hang, a delay, an exception, a kill).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from typing import Any

import torch

from rlhf.errors import BadRequest
from rlhf.faults import fault_point
from rlhf.models.reward_model import RewardModel
from rlhf.procs import release_freed_memory
from rlhf.services.boot import announce, boot, service_parser
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.http import Service, exit_now, run_process_loop, serve_forever

log = logging.getLogger("rlhf.reward_server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardServer:
    def __init__(self, model: RewardModel, token: str, policy: Any, threads: int = 1) -> None:
        self.model = model
        self.service = Service("reward", 0, token, policy, threads=threads)
        self.service.open_paths = ("/health",)
        self.service.untraced_paths.add("/health")
        self.scored = 0
        self.service.route("/score", self.score)
        self.service.route("/health", lambda a, t: {"ok": True, "model": self.model.path, "scored": self.scored},
                           method="GET", inline=True)

    def score(self, args: dict, tensors: dict) -> dict:
        prompts, completions = args.get("prompts"), args.get("completions")
        if not isinstance(prompts, list) or not isinstance(completions, list) or len(prompts) != len(completions) \
                or not all(isinstance(s, str) for s in [*prompts, *completions]):
            raise BadRequest("/score takes {\"prompts\": [str], \"completions\": [str]} of the same length")
        fault_point("reward_model.score", sequences=len(prompts))
        start = time.perf_counter()
        scores = self.model.score(prompts, completions)
        bad = next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)
        if bad is not None:
            raise FloatingPointError(f"the reward model scored row {bad} {scores[bad]} (prompt {prompts[bad][:80]!r})")
        self.scored += len(scores)
        log.info("scored %d completions in %.3f s", len(scores), time.perf_counter() - start)
        return {"scores": scores, "model": self.model.path}


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(__doc__, rank=False, config=True)
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, "reward", 0)  # the scheduler records its exit status
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rc = cfg.reward_model
    model = RewardModel(rc.path, rc.device or cfg.model.device, DTYPES[rc.dtype], rc.chat_template,
                        rc.batch_size)
    release_freed_memory()
    log.info("reward server: %s (%s, %s on %s)", rc.path, type(model.model).__name__, rc.dtype, model.device)
    server = RewardServer(model, token, cfg.resilience, threads=int(os.environ.get("RLHF_REWARD_THREADS", "1")))

    ready = announce(args.ready_file, args.host, "reward server", log)

    def on_term() -> None:  # at once: a score call in flight is the controller's to retry or fail
        raise SystemExit(128 + signal.SIGTERM)

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
        await serve_forever(server.service, args.host, args.port, ready)

    code = run_process_loop(serve, stop_process_telemetry)
    if code:  # a score call still on the model's thread is not waited for
        exit_now(code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
