"""The one start-up of a service process (rollout server, reward server, scheduler): its flags, and what it does
before it serves, in this order.

    parser = service_parser(__doc__, rank=True, config=True)
    args = parser.parse_args(argv)
    token, cfg = boot(parser, args, role="rollout", rank=args.rank)
    ...
    serve_forever(service, args.host, args.port, announce(args.ready_file, args.host, "rollout server 0"))

1. die with the process that started it (PR_SET_PDEATHSIG: SIGKILL, or SIGTERM for one that must clean up first);
2. the run token from RLHF_TOKEN (never a flag: it would show in `ps`);
3. its log file (logs/<role>-<rank>.log) and its start record (exits.jsonl; whoever started it records its end);
4. one OpenMP pool: the process's other threads run torch ops serially (rlhf.procs.own_threads);
5. the run's config, the heap bound (runtime.heap_mmap_threshold_mb), telemetry (spans and the 1 Hz sampler);
6. the faults of the run's fault files that target it, armed.

The ready file is written once the port is bound, with the URL; the starter waits for that file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any, Callable

from rlhf import exits, faults
from rlhf.procs import bound_heap, own_threads, set_pdeathsig, write_atomic
from rlhf.run_dir import setup_logging
from rlhf.tracing.setup import start_process_telemetry, tracing_config_of_run
from rlhf.transport.http import DEFAULT_HOST

log = logging.getLogger("rlhf.services")


def service_parser(doc: str, rank: bool = True, config: bool = True) -> argparse.ArgumentParser:
    """The flags of every service: --run-dir, --ready-file, --host, --port, and --rank and --config when asked."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    if rank:
        parser.add_argument("--rank", type=int, required=True)
    if config:
        parser.add_argument("--config", required=True, help="resolved run config YAML")
    parser.add_argument("--ready-file", required=True, help="written with the URL once listening")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0)
    return parser


def boot(parser: argparse.ArgumentParser, args: argparse.Namespace, role: str, rank: int,
         load_config: Callable[[], Any] | None = None, deathsig: int = signal.SIGKILL,
         compute: bool = True) -> tuple[str, Any]:
    """Steps 1–6 of the module docstring; returns (token, the run's config or None). load_config: how this service
    reads the run's config (default: --config); compute: a process that runs torch (one OpenMP pool, the heap
    bound), not one that only routes JSON (the scheduler)."""
    set_pdeathsig(deathsig)
    token = os.environ.get("RLHF_TOKEN")
    if not token:
        parser.error("RLHF_TOKEN is not set (the run token is passed in the environment)")
    setup_logging(args.run_dir, role, rank, console=False)
    exits.record_start(args.run_dir, f"{role}-{rank}")
    if compute:
        own_threads(1)  # the service computes on its own thread with its threads; the rest stays serial
    if load_config is None:
        from rlhf.config import build_config

        cfg = build_config(config_file=args.config)
    else:
        cfg = load_config()
    if cfg is not None and compute:
        bound_heap(cfg.runtime.heap_mmap_threshold_mb)
    # telemetry as the run's tracing section says (its defaults for a service started on its own, with no config)
    start_process_telemetry(args.run_dir, role, rank, cfg.tracing if cfg is not None else
                            tracing_config_of_run(args.run_dir))
    if cfg is not None and cfg.faults:
        faults.arm(args.run_dir, cfg.faults)
    return token, cfg


def announce(ready_file: str, host: str, what: str, logger: logging.Logger = log,
             detail: str = "") -> Callable[[int], None]:
    """The ready callback of serve_forever: the URL into the ready file (atomically), and one line in `logger`."""

    def ready(port: int) -> None:
        url = f"http://{host}:{port}"
        write_atomic(ready_file, url)
        logger.info("%s listening on %s (pid %d%s)", what, url, os.getpid(), detail)

    return ready
