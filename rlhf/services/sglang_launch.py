"""Our rollout server started as sglang starts its own: a drop-in for `python -m sglang.launch_server`.

    python -m rlhf.services.sglang_launch --model-path DIR --port 30000 [--api-key KEY] [--config FILE.yaml]

It takes the sglang launch flags that `rollout.backend: sglang` passes (and `--config`, a YAML file
of the same options keyed by their names with underscores, as sglang reads it; flags given on the
command line win) and serves only sglang's routes: none of our extensions (/events,
/update_weights_from_meta, /weights_checksum). So a run with `rollout.backend: sglang` and
`sglang.launcher: rlhf.services.sglang_launch` drives the native engine exactly as it would
drive a real sglang server; the tests and CPU machines use that.

With RLHF_RUN_DIR set (the scheduler sets it; sglang ignores it) the server also writes its log,
spans and fault points into that run directory as `rollout-<RLHF_RANK>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

log = logging.getLogger("rlhf.rollout_server")

FLAGS = {  # sglang flag -> (type, default, help)
    "model-path": (str, None, "a Hugging Face model directory (required)"),
    "host": (str, "127.0.0.1", "address to bind"),
    "port": (int, 30000, "port to bind"),
    "api-key": (str, None, "the Bearer token every route but /health* and /ready needs"),
    "dtype": (str, "auto", "auto, float32, bfloat16 or float16"),
    "device": (str, "", "cuda or cpu (default: cuda when there is one, else cpu)"),
    "base-gpu-id": (int, 0, "the CUDA device index to use"),
    "random-seed": (int, 0, "the sampling generator's seed"),
    "mem-fraction-static": (float, None, "accepted for sglang compatibility; the native engine allocates per call"),
    "tp-size": (int, 1, "tensor parallel size: the native engine serves 1 only"),
    "max-queued-requests": (int, None, "calls let wait; one more is answered 503 with Retry-After (default: no limit)"),
    "served-model-name": (str, None, "the model name /model_info reports"),
    "log-level": (str, "info", "log level"),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.services.sglang_launch", description=__doc__.split("\n\n")[0])
    for flag, (kind, default, text) in FLAGS.items():
        parser.add_argument(f"--{flag}", type=kind, default=default, help=text)
    parser.add_argument("--skip-server-warmup", action="store_true", help="accepted: the native engine has no warm-up")
    parser.add_argument("--config", help="a YAML file of these options (keys with underscores); flags win")
    args = parser.parse_args(argv)
    if args.config:
        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
        known = {flag.replace("-", "_") for flag in FLAGS} | {"skip_server_warmup"}
        unknown = sorted(set(data) - known)
        if unknown:
            parser.error(f"--config {args.config}: unknown option(s) {unknown}; valid: {sorted(known)}")
        given = {a.split("=", 1)[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
        for key, value in data.items():
            if key not in given:
                setattr(args, key, value)
    if not args.model_path:
        parser.error("--model-path is required (a Hugging Face model directory)")
    if args.tp_size != 1:
        parser.error(f"--tp-size {args.tp_size}: the native engine serves tensor parallel size 1 only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from rlhf import exits, faults
    from rlhf.config import ModelConfig, build_config
    from rlhf.config.resilience import HARDENED
    from rlhf.models import build_model_and_tokenizer
    from rlhf.procs import own_threads, set_pdeathsig
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.run_dir import setup_logging
    from rlhf.services.rollout_server import RolloutServer, serve
    from rlhf.tracing.setup import start_process_telemetry, stop_process_telemetry

    set_pdeathsig()
    run_dir, rank = os.environ.get("RLHF_RUN_DIR", ""), int(os.environ.get("RLHF_RANK", "0"))
    cfg = build_config(config_file=os.path.join(run_dir, "config.yaml")) if run_dir else None
    if run_dir:
        setup_logging(run_dir, "rollout", rank, console=False)
        exits.record_start(run_dir, f"rollout-{rank}")
        start_process_telemetry(run_dir, "rollout", rank, cfg.tracing)
        if cfg.faults:
            faults.arm(run_dir, cfg.faults)
    else:
        logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s")
    threads = int(os.environ.get("RLHF_ROLLOUT_THREADS") or torch.get_num_threads())
    own_threads(1)  # the engine computes on its service's thread with `threads`; the rest stays serial
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{args.base_gpu_id}"
    dtype = "float32" if args.dtype == "auto" and device == "cpu" else ("bfloat16" if args.dtype == "auto" else args.dtype)
    model, tok = build_model_and_tokenizer(ModelConfig(path=args.model_path, dtype=dtype, device=device),
                                           seed=args.random_seed)
    engine = RolloutEngine(model, tok, seed=args.random_seed)
    server = RolloutServer(engine, rank, args.api_key or "", cfg.resilience if cfg else HARDENED, run_dir=run_dir,
                           sglang_only=True, model_path=args.served_model_name or args.model_path,
                           max_queued=args.max_queued_requests or 0, threads=threads)
    if not args.api_key:
        server.service.open_paths = ("/",)  # sglang without --api-key: every route is open
    server.host = args.host

    def ready(port: int) -> None:
        server.port = port
        log.info("sglang-compatible rollout server on http://%s:%d (pid %d, %s on %s)", args.host, port, os.getpid(),
                 dtype, device)

    policy = cfg.resilience if cfg else HARDENED
    return serve(server, args.host, args.port, ready, policy.graceful_drain,
                 cfg.timeouts.drain_s if cfg else 4.0, stop_process_telemetry if run_dir else lambda: None)


if __name__ == "__main__":
    sys.exit(main())
