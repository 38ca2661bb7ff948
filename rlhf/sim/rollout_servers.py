"""Simulated rollout servers: sim.servers_per_process of them in one OS process, each the real RolloutServer (sglang's
routes, our extensions, its fault points, spans, pause and abort) on its own port, over an engine whose generation is
EMULATED.

    python -m rlhf.sim.rollout_servers --run-dir D --config D/config.yaml --first R --count K --ready-dir D
    (token in RLHF_TOKEN; server r writes D/rollout-r.url once it listens, as a real one does)

SimEngine: random answer tokens (the task's digits; a stop token ends a sample before max_new_tokens), logprobs
that are the train ranks' EMULATED ones, and `sim.rollout_s_per_token` seconds per generated token (a wait). Weights
are real: a server pulls every piece of a version from the MetaServer, checks that they tile the model and keeps
only their checksum (no model memory), which weights.verify compares with the trainer's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import threading
from typing import Any

import torch

from rlhf import exits
from rlhf.models import build_model_and_tokenizer, stop_token_ids
from rlhf.pieces import assemble
from rlhf.procs import write_atomic
from rlhf.rollout.engine.sampling import SamplingParams
from rlhf.services.boot import boot
from rlhf.services.colocation import DeviceLease
from rlhf.services.rollout_server.rows import keep_rows_in, row_store
from rlhf.services.rollout_server.server import RolloutServer
from rlhf.sim import host_parser
from rlhf.sim.cost import EMULATED, CostModel
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.fanout import FanoutAgent
from rlhf.transport.http import exit_now, listen, run_process_loop
from rlhf.weights import checksum, export_state, load_model_dir

log = logging.getLogger("rlhf.sim")


class SimModel(torch.nn.Module):
    """What a server reads of its engine's model (config, a parameter's dtype); no weights are held."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.placeholder = torch.nn.Parameter(torch.zeros(0), requires_grad=False)


class SimEngine:
    """The rollout engine's interface with EMULATED generation and checksummed (not held) weights."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, seed: int, cost: CostModel, verify_checksum: str,
                 answer_tokens: list[int]) -> None:
        self.model, self.tokenizer = SimModel(model.config), tokenizer
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.cost, self.algorithm = cost, verify_checksum
        self.stop_ids = list(dict.fromkeys(stop_token_ids(model, tokenizer)))
        self.eos_token_id = self.stop_ids[0] if self.stop_ids else None
        self.answer_tokens = answer_tokens
        self.weight_version = "0"
        self.checksum = checksum(export_state(model), verify_checksum)  # the weights it starts from (seeded)
        self.tokens_generated = 0

    def drop_caches(self) -> None:
        """Nothing is cached."""

    def weights_checksum(self, algorithm: str = "crc32") -> str:
        return self.checksum

    def update_weights_from_pieces(self, shards: dict[str, tuple[dict, dict]], weight_version: str) -> None:
        with self.lock:
            whole = assemble(shards)  # every piece checked to tile its parameter; then only the digest is kept
            self.checksum, self.weight_version = checksum(whole, self.algorithm), str(weight_version)

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str) -> None:
        with self.lock:
            self.checksum, self.weight_version = checksum(tensors, self.algorithm), str(weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self.update_weights_from_tensors(load_model_dir(model_path), weight_version)

    def generate(self, input_ids: list[list[int]], sampling_params: Any = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, control: Any = None, detokenize: bool = True) -> list[dict[str, Any]]:
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params)
        if not input_ids or any(len(p) == 0 for p in input_ids):
            raise ValueError("generate: every prompt needs at least one token")
        stops = [] if sp.ignore_eos else self.stop_ids
        rows = []
        with self.lock:
            version = self.weight_version
            for prompt in input_ids:
                for _ in range(sp.n):
                    length = self.rng.randint(1, max(1, sp.max_new_tokens))
                    toks = [self.rng.choice(self.answer_tokens) for _ in range(length)]
                    stopped = bool(stops) and length < sp.max_new_tokens
                    if stopped:
                        toks[-1] = stops[0]
                    rows.append((prompt, toks, {"type": "stop", "matched": stops[0]} if stopped else
                                 {"type": "length", "length": length}))
            total = sum(len(t) for _, t, _ in rows)
            self.cost.spend(total)
            ended = control.step(max(len(t) for _, t, _ in rows), None, None) if control is not None else {}
        results = []
        for row, (prompt, toks, fin) in enumerate(rows):
            fin = ended.get(row, fin)
            meta: dict[str, Any] = {"finish_reason": fin, "prompt_tokens": len(prompt), "completion_tokens": len(toks),
                                    "cached_tokens": len(prompt) if row % sp.n else 0, "weight_version": version,
                                    "simulated": EMULATED}
            if return_logprob:
                meta["output_token_logprobs"] = [[0.0, t, None] for t in toks]  # EMULATED (the train side's too)
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if detokenize and self.tokenizer else ""
            results.append({"text": text, "output_ids": toks, "meta_info": meta})
        self.tokens_generated += total
        return results

    def prompt_logprobs(self, prompts: list[list[int]], start: int = 0, top: int = 0) -> list[dict[str, list]]:
        return [{"input_token_logprobs": [[None if i == 0 else 0.0, t, None] for i, t in enumerate(p)][start:]}
                for p in prompts]


async def _serve(servers: list[RolloutServer], host: str, ready_dir: str, ready_file: str, stop: asyncio.Event,
                 cfg: Any) -> None:
    runners = []
    for server in servers:
        runner, server.port = await listen(server.service, host)
        runners.append(runner)
        server.host = host
        write_atomic(os.path.join(ready_dir, f"rollout-{server.rank}.url"), f"http://{host}:{server.port}")
    # the host's agent: the controller's calls to these servers as one request per route (rlhf.transport.fanout)
    agent = FanoutAgent(servers[0].rank, servers[0].token, {s.rank: f"http://{host}:{s.port}" for s in servers},
                        cfg.resilience, cfg.timeouts.rollout_s, role="rollout")
    runner, port = await listen(agent.service, host)
    runners.append(runner)
    write_atomic(ready_file, json.dumps({"agent": f"http://{host}:{port}", "pid": os.getpid()}))
    log.info("simulated rollout servers %d-%d listening (pid %d, %s generation)", servers[0].rank, servers[-1].rank,
             os.getpid(), EMULATED)
    loop = asyncio.get_running_loop()

    async def drain_all() -> None:
        await asyncio.gather(*(s.drain(asyncio.Event(), cfg.timeouts.drain_s) for s in servers))
        stop.set()

    def on_term() -> None:  # as a real server's process (rollout_server.serve): drain, or exit at once
        if not cfg.resilience.graceful_drain or servers[0].draining:
            raise SystemExit(128 + signal.SIGTERM)
        loop.create_task(drain_all())

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        await stop.wait()
    finally:
        await agent.close()
        await asyncio.gather(*(runner.cleanup() for runner in runners))  # side by side: each waits for its connections


def main(argv: list[str] | None = None) -> int:
    parser = host_parser(__doc__, "rollout servers")
    parser.add_argument("--ready-dir", required=True, help="where server r writes rollout-r.url")
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, "rollout", args.first)
    model, tokenizer = build_model_and_tokenizer(cfg.model, seed=cfg.seed, device="cpu", dtype="float32")
    answer = [t for t in tokenizer.encode("0123456789", add_special_tokens=False)]
    servers, store = [], row_store(cfg)  # rollout.data_plane store: one store for the host's servers
    pulls: dict = {}  # and one MetaServer pull a weights version (WeightsAndMemory._pull)
    for r in range(args.first, args.first + args.count):
        if r != args.first:
            exits.record_start(args.run_dir, f"rollout-{r}", os.getpid())
        seed = (cfg.sampling.seed if cfg.sampling.seed >= 0 else cfg.seed + 17) + 1000 * r
        engine = SimEngine(model, tokenizer, seed, CostModel(cfg.sim.rollout_s_per_token, cfg.sim.jitter, seed),
                           cfg.weights.verify_checksum, answer)
        # runtime.colocate: server r shares device r with train rank r (the same flock lease as a real pair)
        lease = DeviceLease(args.run_dir, r, f"rollout-{r}") if cfg.runtime.colocate and r < cfg.sim.train_ranks \
            else None
        servers.append(RolloutServer(engine, r, token, cfg.resilience, lease, cfg.timeouts.lease_s, args.run_dir,
                                     cfg.weights.verify_checksum, model_path=cfg.model.name,
                                     max_queued=cfg.rollout.max_queued_requests))
        keep_rows_in(servers[-1], cfg, store)
        servers[-1].host_pulls = pulls
    del model  # each engine keeps its checksum, not the weights
    code, stopped = 1, False  # stopped: the loop ended on SIGTERM (at once, or drained), as its scheduler asked
    try:
        code = run_process_loop(lambda: _serve(servers, args.host, args.ready_dir, args.ready_file, asyncio.Event(),
                                               cfg), lambda: None)
        stopped = True
        code = code or int(any(s.drain_left for s in servers))
    finally:
        for server in servers[1:]:  # the first is the job itself: its scheduler records its end
            exits.record_exit(args.run_dir, f"rollout-{server.rank}", os.getpid(), code, by=f"rollout-{args.first}",
                              expected=stopped)
        stop_process_telemetry()
    if code:  # as the default disposition would: a call still on an engine thread is not waited for
        exit_now(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
