"""The resilience policy: every behaviour that separates the seeds' system from ours, by name.

    --resilience faithful|hardened                 pick a preset (all behaviours at once)
    --resilience.first_failure_ledger false        then switch one behaviour on or off

Code asks the behaviour, never the preset's name (`policy.atomic_checkpoints`). Every process
gets the same `Policy` from the run's config.yaml, which records the resolved values, so a
researcher can measure what one behaviour buys on a scenario: run it twice, flipping only that.

FAITHFUL reproduces the system the seeds describe (bare 500s, fire-and-forget events, in-place
checkpoints, cleanup errors last); HARDENED is what we recommend and the default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlhf.config.checks import ConfigError


@dataclass(frozen=True)
class Policy:
    preset: str = "hardened"
    """Preset the behaviours start from: faithful (the seeds' system) or hardened (recommended); setting it resets every behaviour below to the preset's value."""
    typed_errors: bool = True
    """A failed request answers with a typed JSON body (class, message, role, rank, stage, step); off: aiohttp's bare '500 Internal Server Error'."""
    stage_checksums: bool = True
    """Tensors crossing processes carry per-tensor sha256 digests checked where they arrive (names the sender); off: changed data surfaces stages later."""
    acked_events: bool = True
    """Colocation events must be acknowledged: a lost one is sent again, 3 attempts in all, then EventNotDelivered names the peer; off: fire and forget (a WARNING)."""
    atomic_checkpoints: bool = True
    """Checkpoint slots are written to a staging folder, fsynced and renamed into place, and resume checks their checksums; off: written in place."""
    fatal_save_errors: bool = True
    """A failed checkpoint save fails the step where it happened; off: a WARNING and the run goes on (checkpoint.periodic_async is allowed)."""
    skip_failed_saves: bool = True
    """With atomic_checkpoints: a save that a rank answers with an error (disk full, an IO error) is discarded and the run goes on from the newest valid slot, a WARNING naming it and the steps.csv count `saves_failed`; checkpoint.max_failed_saves in a row fail the run; a rank that does not answer (a hung write) still fails it; off: fatal_save_errors decides."""
    abandon_stuck_saves: bool = True
    """With skip_failed_saves: a rank writes its checkpoint files on a writer thread and, when the write makes no progress (the thread neither uses CPU nor waits on the disk) for checkpoint.write_stall_s, answers CheckpointWriteStalled and leaves the thread behind, so the save is skipped like a failed one and the step goes on; off: a hung write holds the rank's call until the stall watchdog or the call's timeout ends the run."""
    first_failure_ledger: bool = True
    """The controller's last error line repeats the run's first failure, whatever cleanup logs after it."""
    strict_rollout: bool = True
    """A rollout server that fails or times out fails the step in rollout; off: a dead server's samples are dropped and a timed-out one's kept as aborted (no tokens)."""
    migrate_requests: bool = True
    """The groups of a rollout server that fails or times out mid-rollout are generated again on the servers that answered, and samples returned aborted with tokens continue from those tokens on another server; the step keeps its full batch and group structure, a WARNING, a `rollout.migrate` span and the steps.csv count `rollout_migrated`; off: strict_rollout decides."""
    weights_fallback: bool = True
    """A meta-mode weights update that fails (an upload, the MetaServer, a rollout server's pull) is done again through disk: a train rank whose upload ended writes weights/latest and every rollout server loads it; a WARNING, a `weights.fallback` span and the steps.csv column `weights_fallback`; off: the step fails in weights_update."""
    private_weights_dir: bool = True
    """Disk-mode weights go to their own folder (weights/latest); off: rollout servers load the newest parity checkpoint, written in place."""
    device_busy_fails_fast: bool = True
    """A colocated rollout server that finds the device taken answers DeviceBusy naming the holder at once; off: it retries its allocation every second until lease_timeout_s."""
    retry_idempotent: bool = True
    """An idempotent request (GETs, DELETEs, /compute_logprobs) that fails in transit (connection reset or refused, a corrupt reply, HTTP 502-504) is sent again, 3 attempts within its timeout, exponential back-off with jitter, each retry a WARNING and a span event; off: the first failure is the call's."""
    stall_stops_run: bool = True
    """When the stall watchdog (runtime.watchdog_stall_s) finds a rank keeping the others waiting, the call fails at once with SyncStall naming it; off: the stall and the live diagnosis are logged and the run waits for the call's timeout, as the seeds' system did."""
    rebalance_stragglers: bool = True
    """A data-parallel rank whose compute (the train step's own seconds per token, without its collectives) is twice the median rank's or more gets a share of the next steps' batches cut in proportion, so the ranks finish together (a WARNING naming it and the factor, the steps.csv count `rebalanced`); the shares go back as it recovers; the gradient is the same (the loss is normalised by the global counts); off: equal token shares, and the world waits for it every step."""
    wait_out_partitions: bool = True
    """When the stall watchdog's missing rank is alive (its heartbeat file in the run directory is fresh) and yet does not answer over the network, its host is behind a partition: the call waits up to runtime.partition_grace_s for the network to come back (a WARNING naming the rank and its host) and goes on if it does (a partition shorter than that is survived); then the finding stands (stall_stops_run); off: the finding at once, as for a stuck rank."""
    restart_rollout: bool = True
    """Before each step the controller asks the scheduler whether every rollout server's job still runs and each running one whether it answers GET /health; one that died or does not answer is (stopped and) started again, a WARNING and a steps.csv count, and gets the step's weights with the others (native backend, not colocated). A server lost during the step (in the weights update, or every server in the rollout, as when their scheduler is killed) is started again the same way, and that update or the step's generation is done once more. The environment server (env-0) and the reward model's (reward-0) too: dead or silent before a step, or lost during the step's episodes or its scores, it starts again and the episodes run again from their reset (the batch is scored again); a scheduler that died is started again with every job it owned (rollout servers, env-0, reward-0). In async mode the producer starts env-0 or reward-0 again itself; a loss it cannot survive (no server left to migrate to, their scheduler gone) is survived by the step that takes the batch: the services start again, get the step's weights, and the producer makes the batch again. Off: the step fails on it."""
    shed_load: bool = True
    """A rollout server with rollout.max_queued_requests calls already waiting answers another one 503 with Retry-After, and the client waits that long and sends it again (none of it ran, so any request may be) within its timeout, a WARNING and a span event each time; off: every call queues, however many wait."""
    graceful_drain: bool = True
    """SIGTERM to a rollout server (the scheduler stopping its job, an operator): it stops taking calls (/generate answers 503 with Retry-After, /ready 503), finishes the running and queued ones, and exits 0 — within timeouts.drain_s, else exits 1 naming what was left; off: it exits at once and in-flight calls lose their replies."""
    verify_release: bool = True
    """After release_memory_occupation the rollout server checks the device memory was freed (DeviceMemoryNotReleased); off: a leak shows at the peer's next allocation."""
    detect_weights_drift: bool = True
    """When a step's rollout_train_logprob_diff (the rollout's and the trainer's logprobs of the same tokens under the same weights version) passes weights.drift_threshold, the controller compares every rollout server's weights checksum with the trainer's and names the servers whose weights differ, a WARNING each time and the steps.csv column `weights_drift` (sync, and async at K = 0: with K >= 1 the difference includes the policy's change); the next weights update replaces them; off: only the column shows it. With weights.verify off (a real sglang server has no checksum route), every weights update ends in a spot check instead, in every mode (async's overlapping rollouts too): each rollout server's /get_weights_by_name of 4 parameters against the trainer's; a server that reports the version and holds other values is named in a WARNING, steps.csv weights_stale counts them."""
    infra_errors_fail: bool = True
    """With env.on_infra_error auto: a tool whose infrastructure failed (InfraError, an OSError: its service unreachable, a sandbox killed from outside or starved of CPU past its time limit) fails the step naming the tool, and the model never reads it; off: the model reads the error as the tool's answer (verl's behaviour) and steps.csv `infra_errors` counts it."""
    retry_infra_errors: bool = True
    """With infra_errors_fail and env.on_infra_error auto: the tool is called again first, env.infra_retries times with a growing wait between (a WARNING each, steps.csv `infra_retries`), and fails the step only when none succeeds (a load that passes, a service that comes back: survived); off: its first failure fails the step."""

    def __post_init__(self) -> None:
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"resilience.preset: {self.preset!r} is not valid; choose one of: "
                              + ", ".join(PRESET_NAMES))

    @classmethod
    def from_preset(cls, name: str) -> Policy:
        """The named preset; a wrong name fails with the valid choices."""
        cls(preset=name)  # validates the name
        return PRESETS[name]

    @classmethod
    def behaviours(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "preset"]

    def changed(self) -> dict[str, bool]:
        """Behaviours that differ from this policy's preset."""
        base = PRESETS[self.preset]
        return {b: getattr(self, b) for b in self.behaviours() if getattr(self, b) != getattr(base, b)}

    def describe(self) -> str:
        """'hardened', or 'hardened with first_failure_ledger off' when behaviours were switched."""
        changed = self.changed()
        if not changed:
            return self.preset
        return self.preset + " with " + ", ".join(f"{b} {'on' if v else 'off'}" for b, v in changed.items())


PRESET_NAMES = ("faithful", "hardened")
HARDENED = Policy()
FAITHFUL = Policy(preset="faithful", **{b: False for b in Policy.behaviours()})
PRESETS = {"faithful": FAITHFUL, "hardened": HARDENED}
