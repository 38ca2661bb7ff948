"""One call per process: spans and the resource sampler for this process's primary role."""

from __future__ import annotations

import os
from typing import Any

from rlhf import tracing
from rlhf.config import TracingConfig, build_config
from rlhf.tracing import metrics


def start_process_telemetry(run_dir: str, role: str, rank: int, cfg: Any) -> None:
    """cfg: rlhf.config.TracingConfig. Tracing and the sampler are both per process."""
    tracing.setup_tracing(run_dir, role, rank, cfg)
    metrics.start_sampler(run_dir, role, rank, cfg.metrics_interval_s)


def stop_process_telemetry() -> None:
    """Flush spans and stop the sampler (normal exit, failure, or a terminating signal)."""
    metrics.stop_sampler()
    tracing.shutdown_tracing()


def tracing_config_of_run(run_dir: str) -> Any:
    """The tracing section of <run-dir>/config.yaml (defaults when there is none)."""

    path = os.path.join(run_dir, "config.yaml")
    return build_config(config_file=path).tracing if os.path.exists(path) else TracingConfig()
