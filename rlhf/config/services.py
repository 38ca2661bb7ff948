"""The sections of how the processes run: weights (sync between trainer and rollout servers), runtime, timeouts,
checkpoint, preflight, tracing. Each field's docstring (the string after it) is what `--help` prints, with units; each section
validates itself in __post_init__."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlhf.config.checks import ConfigError, _choice, _positive


@dataclass
class WeightsConfig:
    mode: str = "meta"
    """weights_update path: 'meta' (train ranks upload to the MetaServer while rollout servers pull, in parallel), 'disk' (HF safetensors directory, then /update_weights_from_disk) or 'distributed' (train rank 0 and every rollout server in one process group, the weights broadcast bucket by bucket: sglang's /update_weights_from_distributed; any host, real sglang servers too)."""
    max_versions: int = 2
    """MetaServer keeps at most this many weight versions in memory."""
    max_bytes: int = 4 << 30
    """MetaServer memory bound in bytes; a shard beyond it is refused (HTTP 507)."""
    upload_timeout_s: float = 600.0
    """Timeout of one train rank's upload of its shard, seconds."""
    update_timeout_s: float = 600.0
    """Timeout of one rollout server's weights update (waiting for all shards included), seconds."""
    verify: bool = True
    """After each weights update, check every rollout server's weight_version and weights checksum against the trainer's."""
    transport: str = "shm"
    """meta mode: how shard bytes travel. shm: as files in the MetaServer's shared-memory folder, by the processes that see it (its host), over HTTP by the others (control stays HTTP); http: in the HTTP bodies (any host); cuda_ipc: they stay in each train rank's GPU memory and the rollout servers on the same GPU copy them device to device (CUDA IPC handles in the control messages; one host, model.device cuda)."""
    checksum: str = "none"
    """Per-tensor digest in each meta-mode shard, written by the uploader and checked by every rollout server (names the corrupt tensor): none, crc32 (about halves the relay's speed), sha256. weights.verify already checks the whole model end to end."""
    bucket_mb: float = 256.0
    """distributed mode: the most MB of tensors one broadcast carries (a flat buffer per bucket; a larger tensor is a bucket of its own)."""
    drift_threshold: float = -1.0
    """Mean |rollout - train| logprob above which a step's weights count as drifted (resilience.detect_weights_drift; `rlhf diagnose` reads it too); 0: off; -1: 1e-3 with model.dtype float32 (both sides stay near 1e-7 there, a rollout server one optimizer step behind is about 1e-2 on the default run) and off otherwise (bf16's own rollout-train difference is not measured yet: set it)."""
    uploaders: int = 16
    """meta mode, a replicated layout (every rank holds the whole model): at most this many train ranks upload (0 .. N-1), each 1/N of the weights, instead of every rank 1/world of them: N uploads, files and PUTs a weights update in a big world instead of one per rank; 0: every rank. Sharded layouts always upload from every rank (each holds its own pieces)."""
    merge_shards: int = 8
    """meta mode: a version uploaded in more shards than this (one per train rank) is merged by the MetaServer into one shard of whole tensors before the rollout servers pull it: each server's manifest lists the model's tensors instead of every rank's piece of each, and it reads one file instead of one per rank (a big world's weights update); 0: never. cuda_ipc shards are never merged."""
    verify_checksum: str = "crc32"
    """Digest of the whole model for weights.verify (trainer vs every rollout server, each step): crc32 (3.7 GB/s here) or sha256 (1.6 GB/s)."""

    def __post_init__(self) -> None:
        _choice("weights.mode", self.mode, ["meta", "disk", "distributed"])
        _choice("weights.checksum", self.checksum, ["crc32", "sha256", "none"])
        _choice("weights.transport", self.transport, ["shm", "http", "cuda_ipc"])
        if self.transport == "cuda_ipc" and self.checksum != "none":
            raise ConfigError(f"weights.checksum: {self.checksum!r} digests bytes in transit, and with weights.transport "
                              "cuda_ipc none leave the GPU; use weights.checksum none (weights.verify still checks the "
                              "whole model) or weights.transport shm")
        _choice("weights.verify_checksum", self.verify_checksum, ["sha256", "crc32"])
        _positive("weights.max_versions", self.max_versions)
        _positive("weights.merge_shards", self.merge_shards, allow_zero=True)
        _positive("weights.uploaders", self.uploaders, allow_zero=True)
        if self.drift_threshold < 0 and self.drift_threshold != -1:
            raise ConfigError(f"weights.drift_threshold: must be >= 0, or -1 (auto), got {self.drift_threshold!r}")
        _positive("weights.bucket_mb", self.bucket_mb)
        _positive("weights.max_bytes", self.max_bytes)
        _positive("weights.upload_timeout_s", self.upload_timeout_s)
        _positive("weights.update_timeout_s", self.update_timeout_s)


@dataclass
class RuntimeConfig:
    """How the processes share the machine: colocation, the heap, the stall watchdog."""

    colocate: bool = False
    """Train rank r and rollout server r share device r, guarded by a cross-process lease."""
    heap_mmap_threshold_mb: float = 4.0
    """glibc: every allocation of at least this many MB gets pages of its own that go back to the system when it is freed (a train step's transient tensors then leave the process's resident memory); glibc's own threshold grows as large blocks are freed and keeps them in its heap (about 1 GB a rank in the 0.54 B fsdp run). 0: glibc's default. Train ranks and the rollout and reward servers."""
    watchdog_stall_s: float = 5.0
    """Stall watchdog: a train rank inside one collective this long while another rank is blocked elsewhere (no CPU use, no disk wait), or a rank blocked in a call 2x this long after the others answered, is named in seconds (resilience.stall_stops_run: and the run stopped); 0 disables."""

    partition_grace_s: float = 60.0
    """With resilience.wait_out_partitions: a rank the stall watchdog finds missing that is alive (its heartbeat file
    in the run directory fresh) but does not answer over the network is behind a partition; the call waits this long
    for the network to come back (a WARNING naming the rank and its host) before the watchdog's finding stands."""

    clock_skew_s: float = 2.0
    """The controller reads each peer's wall clock off every reply it gets (NTP's way, from the control plane's own traffic) and names, in a WARNING, a process whose clock is off by more than this beyond half the round trip; `rlhf diagnose` then reads that process's log lines, heartbeat rows and exit records on the controller's clock. 0 disables."""

    def __post_init__(self) -> None:
        _positive("runtime.watchdog_stall_s", self.watchdog_stall_s, allow_zero=True)
        _positive("runtime.clock_skew_s", self.clock_skew_s, allow_zero=True)
        _positive("runtime.partition_grace_s", self.partition_grace_s, allow_zero=True)
        _positive("runtime.heap_mmap_threshold_mb", self.heap_mmap_threshold_mb, allow_zero=True)


@dataclass
class TimeoutsConfig:
    """How long the runtime waits for each of its calls and processes, seconds (the weights' and the reward
    model's own timeouts are in their sections)."""

    rpc_s: float = 600.0
    """Default timeout of one controller → train worker call. The SFT warm start is judged by its progress instead: it runs as long as a rank's heartbeat moves (its SFT step, its CPU time) and fails (NoProgress, naming the rank) once none has for this long."""
    rollout_s: float = 600.0
    """Timeout of one /generate call."""
    event_s: float = 30.0
    """Timeout of one colocation event delivery."""
    lease_s: float = 60.0
    """How long a colocated side waits for the device lease."""
    cleanup_s: float = 30.0
    """Timeout of one stop-job call to the scheduler during cleanup."""
    drain_s: float = 4.0
    """A rollout server's graceful drain (policy graceful_drain) gives its running and queued calls this long after
    SIGTERM; under the scheduler's 5 s grace before SIGKILL."""
    scheduler_lease_s: float = 10.0
    """The scheduler stops every job it started when the controller has not renewed its lease for this long."""
    startup_s: float = 120.0
    """How long to wait for a rollout server or the scheduler to come up."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _positive(f"timeouts.{f.name}", getattr(self, f.name))


@dataclass
class CheckpointConfig:
    latest_every: int = 1
    """latest_recover_save every this many steps into the alternating latest_odd/latest_even slots; 0 disables."""
    periodic_every: int = 0
    """periodic_recover_save every this many steps into periodic/step_<N>; 0 disables."""
    periodic_async: bool = False
    """With resilience.fatal_save_errors off: periodic_recover_save writes its files on each rank's writer thread and the step goes on; meta.json does not wait for them (the seeds' asynchronous save). Otherwise the save always waits."""
    resume: bool = True
    """On start, resume from the newest valid checkpoint in <run-dir>/checkpoints."""
    max_failed_saves: int = 3
    """With resilience.skip_failed_saves: this many failed saves in a row fail the run (the newest valid checkpoint would fall too far behind)."""
    write_stall_s: float = 4.0
    """With resilience.abandon_stuck_saves: a rank's checkpoint write whose writer thread has neither used CPU nor waited on the disk for this long is abandoned (CheckpointWriteStalled) and the save skipped; keep it under 2 x runtime.watchdog_stall_s, where the stall watchdog names the rank."""

    def __post_init__(self) -> None:
        _positive("checkpoint.latest_every", self.latest_every, allow_zero=True)
        _positive("checkpoint.periodic_every", self.periodic_every, allow_zero=True)
        _positive("checkpoint.max_failed_saves", self.max_failed_saves)
        _positive("checkpoint.write_stall_s", self.write_stall_s)


@dataclass
class PreflightConfig:
    enabled: bool = False
    """Before step 1 every train rank, pinned to its own CPU (or on its GPU), times a square matmul and an all_gather (DLRover's pre-flight check); a rank `threshold` times slower than the median of the others is named a straggler (log, summary.json)."""
    exclude: bool = False
    """A straggler stops the run before step 1 (PreflightStraggler naming it), like DLRover's --exclude-straggler."""
    threshold: float = 2.0
    """A rank whose matmul takes this many times the median of the other ranks', in two rounds in a row, is a straggler."""
    matmul_size: int = 256
    """Side of the square fp32 matmul each rank times on its device."""
    duration_s: float = 2.0
    """Each rank times matmuls for this long (at least 10); the median counts, so a slowdown for most of it shows."""

    def __post_init__(self) -> None:
        _positive("preflight.threshold", self.threshold)
        _positive("preflight.matmul_size", self.matmul_size)
        _positive("preflight.duration_s", self.duration_s)


@dataclass
class TracingConfig:
    enabled: bool = True
    """OpenTelemetry spans in every process (off: the API's no-op tracer, nothing written)."""
    file: bool = True
    """Write spans as OTLP JSON lines to <run-dir>/traces/<role>-<rank>.jsonl (needs no server)."""
    otlp_endpoint: str = ""
    """Also send spans with OTLP over HTTP to this base URL (Jaeger: http://127.0.0.1:4318); empty = $OTEL_EXPORTER_OTLP_ENDPOINT if set."""
    export_delay_ms: int = 500
    """Batch span processor delay between exports, milliseconds; spans also go out at every stage boundary and request end."""
    metrics_interval_s: float = 1.0
    """Resource sampler period (CPU, RSS, threads, fds, IO, GPU) into <run-dir>/metrics/<role>-<rank>.csv; 0 disables."""
    rank_sample: int = 0
    """Spans at scale: every span of one train rank and one rollout server in N (those whose rank is a multiple of
    N); the others keep only the traces in which one of their spans failed, whole (every error's evidence, no
    success twice over). 1: every rank's spans; 0 (auto): 1, and in a simulated world one in sim.train_ranks / 64
    (16 at 1,024 ranks)."""

    def __post_init__(self) -> None:
        _positive("tracing.rank_sample", self.rank_sample, allow_zero=True)
        _positive("tracing.export_delay_ms", self.export_delay_ms)
        _positive("tracing.metrics_interval_s", self.metrics_interval_s, allow_zero=True)
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"tracing.otlp_endpoint: {self.otlp_endpoint!r} must start with http:// or https://")


LOGGER_BACKENDS = ("console", "tensorboard", "wandb", "mlflow")


@dataclass
class LoggerConfig:
    backends: str = "console"
    """Where each step's metrics go (--logger for short): comma-separated, of console (the log and steps.csv, always on), tensorboard (<run-dir>/tensorboard), wandb (offline under <run-dir>/wandb without WANDB_API_KEY), mlflow (a local store under <run-dir>/mlruns); faults, restarts and the diagnosis go with them as events. Only rank 0's controller logs; a tracker that fails mid-run warns once and is dropped, never failing a step."""
    mlflow_uri: str = ""
    """MLflow tracking URI (http://host:5000, sqlite:///mlflow.db); empty: a file store at <run-dir>/mlruns."""
    project: str = "rlhf"
    """The W&B project and the MLflow experiment the run goes to."""

    def __post_init__(self) -> None:
        names = self.names
        unknown = [n for n in names if n not in LOGGER_BACKENDS]
        if unknown or not names:
            raise ConfigError(f"logger.backends: {', '.join(unknown) or repr(self.backends)} not known; choose any of: "
                              f"{', '.join(LOGGER_BACKENDS)} (comma-separated)")

    @property
    def names(self) -> list[str]:
        raw = self.backends if isinstance(self.backends, str) else ",".join(self.backends)
        return list(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))


@dataclass
class SimConfig:
    """A simulated world (EMULATED compute): the real controller, MetaServer, scheduler, watchdog, tracing and faults
    drive train ranks and rollout servers that are the project's own services with a cost model for compute, many
    of them in one process (docs/scale.md)."""

    train_ranks: int = 0
    """Simulated train ranks (0: the real ones, torchrun's); with it rollout.servers are simulated too."""
    ranks_per_process: int = 64
    """Simulated train ranks served by one OS process (each rank its own port)."""
    servers_per_process: int = 64
    """Simulated rollout servers served by one OS process (each server its own port)."""
    train_s_per_token: float = 0.0
    """EMULATED compute of a train rank: seconds per token of its share (forward + backward); 0 measures the control plane alone."""
    reference_s_per_token: float = 0.0
    """EMULATED compute of a train rank's reference pass: seconds per token of its share."""
    rollout_s_per_token: float = 0.0
    """EMULATED compute of a rollout server: seconds per generated token of a /generate call."""
    jitter: float = 0.0
    """Each emulated compute time is multiplied by a lognormal draw of this sigma (0: none): stragglers by chance."""
    fanout: bool = True
    """A call on the train ranks goes as one request to each train rank process's agent, which fans it out to its ranks (the control plane of a big world); false: one request per rank from the controller."""

    def __post_init__(self) -> None:
        _positive("sim.train_ranks", self.train_ranks, allow_zero=True)
        _positive("sim.ranks_per_process", self.ranks_per_process)
        _positive("sim.servers_per_process", self.servers_per_process)
        for name in ("train_s_per_token", "reference_s_per_token", "rollout_s_per_token", "jitter"):
            _positive(f"sim.{name}", getattr(self, name), allow_zero=True)

    @property
    def enabled(self) -> bool:
        return self.train_ranks > 0
