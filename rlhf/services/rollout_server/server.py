"""Rollout server: the native engine behind the sglang-compatible HTTP API.

    python -m rlhf.services.rollout_server --run-dir D --rank R --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

sglang paths and fields: /generate, /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (rollout_server.distributed), /release_memory_occupation,
/resume_memory_occupation, /health, /health_generate, /abort_request, /model_info, /get_weights_by_name, and OpenAI's
/v1/models, /v1/completions, /v1/chat/completions (openai_routes.py); our
extensions: /update_weights_from_meta (pull a version from the MetaServer), /events
(colocation), /weights_checksum. In colocated mode /generate needs the device lease.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import torch
from aiohttp import web

from rlhf.config.resilience import HARDENED, Policy
from rlhf.errors import BadRequest
from rlhf.models import build_model_and_tokenizer
from rlhf.pieces import slice_digests
from rlhf.procs import release_freed_memory
from rlhf.rollout.engine import RolloutEngine
from rlhf.rollout.sglang_api import SGLANG_VERSION, GenerateCall, RequestControl
from rlhf.services.boot import announce, boot, service_parser
from rlhf.services.colocation import DeviceLease, device_name
from rlhf.services.rollout_server.distributed import DistributedWeights
from rlhf.services.rollout_server.generate import GenerateRoutes
from rlhf.services.rollout_server.memory import WeightsAndMemory
from rlhf.services.rollout_server.openai_routes import OpenAIRoutes
from rlhf.services.rollout_server.rows import RowRoutes, keep_rows_in, row_store
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.transport.http import DEFAULT_HOST, Service, exit_now, run_process_loop, serve_forever
from rlhf.weights import weights_by_name

log = logging.getLogger("rlhf.rollout_server")


class RolloutServer(GenerateRoutes, RowRoutes, WeightsAndMemory, DistributedWeights, OpenAIRoutes):
    """sglang's native API over the native engine (`sglang_only`: none of our extensions, as a real sglang)."""

    def __init__(self, engine: Any, rank: int, token: str, policy: Policy = HARDENED,
                 lease: DeviceLease | None = None, lease_timeout_s: float = 30.0, run_dir: str = "",
                 verify_checksum: str = "sha256", sglang_only: bool = False, model_path: str = "",
                 max_queued: int = 0, threads: int = 1) -> None:
        """threads: torch's intra-op threads on the engine's thread (rlhf.procs.own_threads)."""
        self.engine, self.rank, self.token, self.run_dir = engine, rank, token, run_dir
        self.verify_checksum = verify_checksum  # algorithm of /weights_checksum (weights.verify)
        self.device = device_name("rollout", rank, lease is not None)
        self.lease, self.lease_timeout_s = lease, lease_timeout_s
        self.service = Service("rollout", rank, token, policy, threads=threads, parkable=True)
        self.service.open_paths = ("/health", "/ready")  # probes without the token, as sglang leaves them
        self.service.untraced_paths.update(("/health", "/ready"))  # the controller probes every step: no span each
        self.policy, self.sglang_only = policy, sglang_only
        self.model_path = model_path or (getattr(engine.model.config, "_name_or_path", "") if engine else "")
        self.host, self.port = DEFAULT_HOST, 0
        self.started = time.time()
        self.active: list[RequestControl] = []  # engine calls running now (abort, pause)
        self.queued: list[GenerateCall] = []  # calls waiting for the engine
        self.pending_aborts: set[str] = set()  # rids aborted before their call started
        self.unpaused = asyncio.Event()  # cleared while /pause_generation holds new calls
        self.unpaused.set()
        self.holding = False  # /pause_generation in_place: running calls wait at their next decode step
        self.draining = False  # SIGTERM with graceful_drain: no new calls, the others finish
        self.calls = 0  # /generate calls accepted and not yet answered (queued or running)
        self.drain_left = 0  # calls a drain that timed out left behind
        self.max_queued = max_queued  # calls let wait for the engine (policy shed_load; 0: no limit)
        self.shed = 0  # calls answered 503 (over max_queued)
        self.call_seconds = 1.0  # how long the last engine call took (Retry-After's estimate)
        self._state = threading.Lock()
        r = self.service.route
        self.service.raw_route("POST", "/generate", self.generate_http)
        self.service.raw_route("PUT", "/generate", self.generate_http)
        r("/update_weights_from_disk", self.update_weights_from_disk)
        self.groups: dict[str, Any] = {}  # weights update groups joined, by name (rollout_server.distributed)
        r("/init_weights_update_group", self.init_weights_update_group)
        r("/update_weights_from_distributed", self.update_weights_from_distributed)
        r("/destroy_weights_update_group", self.destroy_weights_update_group)
        r("/update_weight_version", self.update_weight_version, inline=True)
        r("/release_memory_occupation", self.release_memory, method=("GET", "POST"))
        r("/resume_memory_occupation", self.resume_memory, method=("GET", "POST"))
        r("/abort_request", self.abort_request, inline=True)
        r("/pause_generation", self.pause_generation)
        r("/continue_generation", self.continue_generation, inline=True)
        r("/flush_cache", lambda a, t: web.Response(text="Cache flushed.\nNo cache outlives a call in the native "
                                                         "engine, so there was nothing to flush.\n"),
          method=("GET", "POST"), inline=True)
        r("/health", lambda a, t: {"ok": True, "weight_version": self.engine.weight_version, **self.broadcast_health()},
          method="GET", inline=True)
        r("/health_generate", self.health_generate, method="GET")
        r("/ready", self.ready, method="GET", inline=True)
        r("/get_weights_by_name", self.get_weights_by_name)
        self.openai_routes()  # /v1/models, /v1/completions, /v1/chat/completions (sglang serves them too)
        for path in ("/model_info", "/get_model_info"):
            r(path, self.model_info, method="GET", inline=True)
        for path in ("/server_info", "/get_server_info"):
            r(path, self.server_info, method="GET", inline=True)
        if not sglang_only:  # our extensions (a real sglang server has none of them)
            r("/update_weights_from_meta", self.update_weights_from_meta)
            r("/events", self.events)
            r("/weights_checksum", self.weights_checksum, method=("GET", "POST"))
            r("/rng_state", self.rng_state, method=("GET", "POST"))
            r("/rows", self.rows_route)

    def weights_checksum(self, args: dict, tensors: dict) -> dict:
        """The weight version and the whole model's checksum (weights.verify); POST {"pieces": {key: {name, offset,
        shape}}}: a digest of each of those slices instead (a sharded trainer's pieces, compared piece by piece)."""
        if args.get("pieces"):
            return {"pieces": slice_digests(self.engine.model, args["pieces"], self.verify_checksum),
                    "weight_version": self.engine.weight_version}
        return {"checksum": self.engine.weights_checksum(self.verify_checksum),
                "weight_version": self.engine.weight_version}

    def rng_state(self, args: dict, tensors: dict) -> dict:
        """The sampling generator's state (GET), or set it (POST {"state": ...}): a checkpoint keeps it, so that a
        resumed run draws the samples the uninterrupted run would have. Base64 of its raw bytes, no pickle."""
        gen = self.engine.generator
        if args.get("state") is not None:
            try:
                raw = base64.b64decode(args["state"], validate=True)
                gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            except (ValueError, RuntimeError) as exc:
                raise BadRequest(f"/rng_state: 'state' is not this server's generator state ({exc})") from None
        return {"state": base64.b64encode(gen.get_state().numpy().tobytes()).decode(), "device": str(gen.device)}

    def ready(self, args: dict, tensors: dict) -> Any:
        """Readiness: 200 when the server takes calls (not draining) and, with ?weight_version=V, its weights are
        version V; else 503 with what it has (a probe after a restart waits for the step's weights)."""
        want, have = args.get("weight_version"), self.engine.weight_version
        if self.draining:
            return web.json_response({"ready": False, "why": "draining", "weight_version": have}, status=503)
        if want is not None and str(want) != have:
            return web.json_response({"ready": False, "why": f"weights are version {have}, not {want}",
                                      "weight_version": have}, status=503)
        return web.json_response({"ready": True, "weight_version": have})

    async def drain(self, stop: asyncio.Event, timeout_s: float) -> None:
        """graceful_drain: take no new calls, let the running and queued ones finish (a pause is lifted for
        them), then set `stop`; after timeout_s stop anyway, recording what was left."""
        self.draining = True
        self.unpaused.set()  # what is queued runs
        with self._state:
            log.info("rollout-%d: SIGTERM: draining %d call(s)", self.rank, self.calls)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._state:
                left = self.calls
            if not left or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        self.drain_left = left
        if left:
            log.warning("rollout-%d: drain timed out after %g s (timeouts.drain_s) with %d call(s) left",
                        self.rank, timeout_s, left)
        else:
            log.info("rollout-%d: drained; exiting 0", self.rank)
        stop.set()

    def health_generate(self, args: dict, tensors: dict) -> dict:
        if self.lease is not None and not self.lease.held:
            return {"ok": True, "skipped": "device lease held by the train side"}
        self.engine.generate([[self.engine.eos_token_id or 1]], {"max_new_tokens": 1})
        return {"ok": True}

    def get_weights_by_name(self, args: dict, tensors: dict) -> list:
        """sglang's /get_weights_by_name {"name", "truncate_size"}: a parameter's first entries as the engine holds
        them (what a spot check of the weights reads; a real sglang server answers it too)."""
        if not any(True for _ in self.engine.model.parameters()) or getattr(self.engine, "simulated", False):
            raise BadRequest(f"rollout-{self.rank} holds no weights to read (EMULATED: a simulated server)")
        return weights_by_name(self.engine.model, args)

    def model_info(self, args: dict, tensors: dict) -> dict:
        """sglang's /model_info (GetModelInfoResponse's fields, plus model_type and architectures as sglang adds)."""
        cfg = self.engine.model.config
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False, "model_type": cfg.model_type,
                "architectures": getattr(cfg, "architectures", None)}

    def server_info(self, args: dict, tensors: dict) -> dict:
        """sglang's /server_info (GetServerInfoResponse's fields); `version` names this server and the sglang API
        version it follows."""
        cfg = self.engine.model.config
        with self._state:
            running, queued = len(self.active), len(self.queued)
            steps = max((getattr(c, "decode_steps", 0) for c in self.active), default=0)
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
                "max_context_length": int(getattr(cfg, "max_position_embeddings", 0) or 0),
                "max_total_num_tokens": None, "version": f"rlhf-native (sglang API {SGLANG_VERSION})",
                "internal_states": [{"running_calls": running, "queued_calls": queued, "shed_calls": self.shed,
                                     "max_queued_requests": self.max_queued,
                                     "paused": not self.unpaused.is_set(), "weight_version": self.engine.weight_version,
                                     "running_decode_steps": steps, "held": self.service.executor.parked}],
                "host": self.host, "port": self.port, "incremental_streaming_output": False,
                "disaggregation_mode": "null", "startup_time": self.started, "frontend": "rlhf",
                "device": str(self.engine.device), "dtype": str(next(self.engine.model.parameters()).dtype)}


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(__doc__, rank=True, config=True)
    parser.add_argument("--colocate", action="store_true", help="generate only while holding device <rank>'s lease")
    parser.add_argument("--device", default="", help="torch device of this server (default: from model.device)")
    args = parser.parse_args(argv)
    # the engine computes on its service's thread with RLHF_ROLLOUT_THREADS; the scheduler records its exit status
    token, cfg = boot(parser, args, "rollout", args.rank)
    model, tok = build_model_and_tokenizer(cfg.model, seed=cfg.seed, device=args.device or None)
    release_freed_memory()  # a low-precision model is built in fp32 first: give those pages back
    log.info("rollout server %d: %s on %s", args.rank, cfg.model.dtype, next(model.parameters()).device)
    seed = (cfg.sampling.seed if cfg.sampling.seed >= 0 else cfg.seed + 17) + 1000 * args.rank
    engine = RolloutEngine(model, tok, seed=seed)
    lease = DeviceLease(args.run_dir, args.rank, f"rollout-{args.rank}") if args.colocate else None
    server = RolloutServer(engine, args.rank, token, cfg.resilience, lease, cfg.timeouts.lease_s,
                           args.run_dir, cfg.weights.verify_checksum, max_queued=cfg.rollout.max_queued_requests,
                           threads=int(os.environ.get("RLHF_ROLLOUT_THREADS", "1")))
    keep_rows_in(server, cfg, row_store(cfg))
    server.host = args.host

    announced = announce(args.ready_file, args.host, f"rollout server {args.rank}", log, f", colocate={args.colocate}")

    def ready(port: int) -> None:
        server.port = port
        announced(port)

    return serve(server, args.host, args.port, ready, cfg.resilience.graceful_drain, cfg.timeouts.drain_s,
                 stop_process_telemetry)


def serve(server: RolloutServer, host: str, port: int, ready: Callable[[int], None], drain: bool,
          drain_timeout_s: float, on_exit: Callable[[], None]) -> int:
    """A rollout server process's main loop; returns its exit code.

    drain (the policy's graceful_drain): SIGTERM starts `server.drain`, which ends the loop once the calls it had
    are answered (exit 0) or after drain_timeout_s (exit 1); a second SIGTERM exits at once. Off: SIGTERM exits at
    once (128 + SIGTERM; replies are lost). An exit other than 0 does not wait for a call still on the engine thread.
    SIGTERM goes through the loop's signal handler (a wakeup fd), so an idle loop blocked in select() wakes for it
    even when the kernel hands the signal to another thread (an engine or OpenMP thread).
    """
    async def main() -> None:
        stop, loop = asyncio.Event(), asyncio.get_running_loop()

        def on_term() -> None:
            if not drain or server.draining:
                raise SystemExit(128 + signal.SIGTERM)
            loop.create_task(server.drain(stop, drain_timeout_s))

        loop.add_signal_handler(signal.SIGTERM, on_term)
        await serve_forever(server.service, host, port, ready, stop)

    code = run_process_loop(main, on_exit)
    if server.drain_left and not code:
        code = 1
    if code:  # as the default disposition would: a call still on the engine thread is not waited for
        exit_now(code)
    return 0
