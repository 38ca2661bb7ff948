"""Rollout server: the native engine behind the sglang-compatible HTTP API.

    python -m rlhf.runtime.rollout_server --run-dir D --rank R --config D/config.yaml --ready-file F
    (token in the RLHF_TOKEN environment variable, never on the command line)

sglang paths and fields: /generate, /update_weights_from_disk, /release_memory_occupation,
/resume_memory_occupation, /health, /health_generate, /abort_request, /model_info; our
extensions: /update_weights_from_meta (pull a version from the MetaServer), /events
(colocation), /weights_checksum. In colocated mode /generate needs the device lease.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

from rlhf import exits, faults, tracing
from rlhf.config import build_config
from rlhf.devices import relocate
from rlhf.faults import afault_point, fault_point
from rlhf.models import build_model_and_tokenizer
from rlhf.procs import set_pdeathsig, write_atomic
from rlhf.rollout.engine import RolloutEngine
from rlhf.run_dir import setup_logging
from rlhf.runtime.client import Client
from rlhf.runtime.colocation import DeviceBusy, DeviceLease, device_name, fresh_allocation, read_leak
from rlhf.runtime.http import DEFAULT_HOST, Service, serve_forever
from rlhf.runtime.metaserver import pull_weights
from rlhf.runtime.resilience import HARDENED, Policy
from rlhf.tracing.setup import start_process_telemetry, stop_process_telemetry

log = logging.getLogger("rlhf.rollout_server")


class DeviceMemoryNotReleased(RuntimeError):
    """verify_release: a release_memory_occupation left device memory allocated."""


class RolloutServer:
    def __init__(self, engine: Any, rank: int, token: str, policy: Policy = HARDENED,
                 lease: DeviceLease | None = None, lease_timeout_s: float = 30.0, run_dir: str = "",
                 verify_checksum: str = "sha256") -> None:
        self.engine, self.rank, self.token, self.run_dir = engine, rank, token, run_dir
        self.verify_checksum = verify_checksum  # algorithm of /weights_checksum (weights.verify)
        self.device = device_name("rollout", rank, lease is not None)
        self.lease, self.lease_timeout_s = lease, lease_timeout_s
        self.service = Service("rollout", rank, token, policy)
        self.policy = policy
        r = self.service.route
        r("/generate", self.generate)
        r("/update_weights_from_disk", self.update_weights_from_disk)
        r("/update_weights_from_meta", self.update_weights_from_meta)
        r("/release_memory_occupation", self.release_memory)
        r("/resume_memory_occupation", self.resume_memory)
        r("/events", self.events)
        r("/abort_request", lambda a, t: {"aborted": 0}, inline=True)
        r("/health", lambda a, t: {"ok": True, "weight_version": self.engine.weight_version}, method="GET", inline=True)
        r("/health_generate", self.health_generate, method="GET")
        r("/model_info", self.model_info, method="GET", inline=True)
        r("/weights_checksum", lambda a, t: {"checksum": self.engine.weights_checksum(self.verify_checksum),
                                             "weight_version": self.engine.weight_version}, method="GET")

    def generate(self, args: dict, tensors: dict) -> Any:
        if self.lease is not None and not self.lease.held:
            if not self.policy.device_busy_fails_fast:
                self._wait_for_device()
            else:
                raise DeviceBusy(f"rollout server {self.rank}: generate without the device lease (device "
                                 f"{self.lease.device} is held by {self.lease.current_holder() or 'the train side'}; "
                                 "was rollout_start delivered?)")
        input_ids = args["input_ids"]
        single = bool(input_ids) and isinstance(input_ids[0], int)
        params = args.get("sampling_params") or {}
        fault_point("rollout.generate")
        with tracing.span("generate", prompts=1 if single else len(input_ids), n=int(params.get("n", 1))) as sp:
            before = self.engine.tokens_generated
            out = self.engine.generate([input_ids] if single else input_ids, params,
                                       bool(args.get("return_logprob", False)))
            sp.set_attribute("rlhf.tokens", self.engine.tokens_generated - before)
        return out[0] if single and len(out) == 1 else out

    def _wait_for_device(self) -> None:
        """device_busy_fails_fast off: a generate that finds the device taken retries its allocation, as a CUDA caching allocator
        retry loop would, each failure an ERROR line, until lease_timeout_s."""
        assert self.lease is not None
        start = time.monotonic()
        deadline, attempt = start + self.lease_timeout_s, 0
        while True:
            attempt += 1
            try:
                self.lease.acquire(0)
                log.info("generate: device %d acquired after %d attempts", self.lease.device, attempt)
                return
            except DeviceBusy as exc:
                log.error("generate: allocating the KV cache failed (attempt %d, %.0f s): %s", attempt,
                          time.monotonic() - start, exc)
                if time.monotonic() >= deadline:
                    raise
            time.sleep(1.0)

    def update_weights_from_disk(self, args: dict, tensors: dict) -> dict:
        version = str(args.get("weight_version", self.engine.weight_version))
        fault_point("weights_update.update", path=args["model_path"])
        with tracing.span("weights.load", source="disk", weight_version=version):
            self.engine.update_weights_from_disk(args["model_path"], version)
        return {"success": True, "message": f"loaded {args['model_path']}", "weight_version": version}

    async def update_weights_from_meta(self, args: dict, tensors: dict) -> dict:
        version = str(args["weight_version"])
        await afault_point("weights_update.update", peer="metaserver-0")
        client = Client(args["metaserver_url"], self.token, peer="metaserver-0", retries=self.policy.retry_idempotent)
        try:
            weights = await pull_weights(client, version, float(args.get("wait_s", 60)), float(args.get("timeout_s", 600)))
        finally:
            await client.close()
        fresh_allocation(self.run_dir, self.device, sum(t.numel() * t.element_size() for t in weights.values()),
                         "the new weights")
        loop = asyncio.get_running_loop()
        with tracing.span("weights.load", source="metaserver", weight_version=version):
            await loop.run_in_executor(self.service.executor, self.engine.update_weights_from_tensors, weights, version)
        return {"success": True, "weight_version": version, "tensors": len(weights)}

    def release_memory(self, args: dict, tensors: dict) -> dict:
        """sglang's release: on a GPU the weights move to pinned host memory and the cache is emptied
        (the KV cache is per call here, so nothing else stays); the lease goes to the colocated train rank."""
        reply: dict[str, Any] = {"success": True}
        engine = self.engine
        if engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cuda":
            with engine.lock:
                engine._fused = None  # the fused copies hold device memory too
                reply.update(relocate([engine.model], None, torch.device("cpu"), engine.device))
        if self.lease is not None:
            self.lease.release()
        leak = read_leak(self.run_dir, self.device) if self.run_dir else None
        mine = bool(leak) and leak.get("pid") == os.getpid()  # type: ignore[union-attr]
        # what this process still holds after the release, on the request's span (evidence; no behaviour)
        held = float(leak["leaked_mb"]) if mine else float(reply.get("device_mb_after", 0.0))  # type: ignore[index]
        tracing.trace.get_current_span().set_attribute("rlhf.device_mb_held", held)
        if mine and self.policy.verify_release:
            # check that a release really freed the device, here, instead of at the peer's next allocation
            raise DeviceMemoryNotReleased(f"rollout-{self.rank} still holds {leak['leaked_mb']:g} MB of {self.device} "
                                          "after releasing it; its colocated train rank cannot allocate")
        return reply

    def resume_memory(self, args: dict, tensors: dict) -> dict:
        reply: dict[str, Any] = {"success": True}
        if self.lease is not None:
            self.lease.acquire(float(args.get("timeout_s", self.lease_timeout_s)))
            fresh_allocation(self.run_dir, self.device, 1 << 30, "the KV cache")
        engine = self.engine
        if engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cpu":
            with engine.lock:
                reply.update(relocate([engine.model], None, engine.device, engine.device))
        return reply

    def events(self, args: dict, tensors: dict) -> dict:
        event = args.get("event")
        fault_point("events.handle", peer=str(event), device=self.device)
        reply: dict[str, Any] = {}
        if event == "rollout_start":
            reply = self.resume_memory(args, tensors)
        elif event == "rollout_end":
            reply = self.release_memory(args, tensors)
        elif event not in ("train_start", "train_end"):
            raise ValueError(f"unknown event {event!r}; valid: rollout_start, rollout_end, train_start, train_end")
        memory = {k: v for k, v in reply.items() if k.startswith("device_mb")}  # what the event freed or took
        return {**memory, "event": event, "ack": True, "step": args.get("step")}

    def health_generate(self, args: dict, tensors: dict) -> dict:
        if self.lease is not None and not self.lease.held:
            return {"ok": True, "skipped": "device lease held by the train side"}
        self.engine.generate([[self.engine.eos_token_id or 1]], {"max_new_tokens": 1})
        return {"ok": True}

    def model_info(self, args: dict, tensors: dict) -> dict:
        cfg = self.engine.model.config
        return {"model_path": getattr(cfg, "_name_or_path", ""), "is_generation": True,
                "model_type": cfg.model_type, "weight_version": self.engine.weight_version}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="resolved run config YAML")
    parser.add_argument("--ready-file", required=True, help="written with the URL once listening")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--colocate", action="store_true", help="generate only while holding device <rank>'s lease")
    parser.add_argument("--device", default="", help="torch device of this server (default: from model.device)")
    args = parser.parse_args(argv)
    set_pdeathsig()
    token = os.environ.get("RLHF_TOKEN")
    if not token:
        parser.error("RLHF_TOKEN is not set (the run token is passed in the environment)")
    setup_logging(args.run_dir, "rollout", args.rank, console=False)
    exits.record_start(args.run_dir, f"rollout-{args.rank}")  # its end: the scheduler records its exit status
    torch.set_num_threads(int(os.environ.get("RLHF_ROLLOUT_THREADS", "1")))
    cfg = build_config(config_file=args.config)
    start_process_telemetry(args.run_dir, "rollout", args.rank, cfg.tracing)
    if cfg.faults:
        faults.arm(args.run_dir, cfg.faults)
    model, tok = build_model_and_tokenizer(cfg.model, seed=cfg.seed, device=args.device or None)
    log.info("rollout server %d: %s on %s", args.rank, cfg.model.dtype, next(model.parameters()).device)
    seed = (cfg.rollout.seed if cfg.rollout.seed >= 0 else cfg.seed + 17) + 1000 * args.rank
    engine = RolloutEngine(model, tok, seed=seed)
    lease = DeviceLease(args.run_dir, args.rank, f"rollout-{args.rank}") if args.colocate else None
    server = RolloutServer(engine, args.rank, token, cfg.resilience, lease, cfg.runtime.lease_timeout_s,
                           args.run_dir, cfg.weights.verify_checksum)

    def ready(port: int) -> None:
        url = f"http://{args.host}:{port}"
        write_atomic(args.ready_file, url)
        log.info("rollout server %d listening on %s (pid %d, colocate=%s)", args.rank, url, os.getpid(), args.colocate)

    signal.signal(signal.SIGTERM, _exit_on_signal)  # SystemExit unwinds the loop; atexit flushes the spans
    try:
        asyncio.run(serve_forever(server.service, args.host, args.port, ready))
    except KeyboardInterrupt:
        pass
    finally:
        stop_process_telemetry()
    return 0


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
