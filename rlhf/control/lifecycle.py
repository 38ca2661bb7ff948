"""RunLifecycle: what the GRPO and SFT controllers share, written once.

    run():  startup → evaluate → step 1..N (steps.csv) → evaluate → summary.json
            any failure: recorded with the step and stage it happened in ("run failed: ...")
            always: cleanup; then, with the policy's first_failure_ledger, the first failure again
            as the last error line, whatever cleanup logged after it

A subclass gives the stages (`startup`, `step`, `evaluate`) and what only it has (`stop_services`,
`summary_extras`); checkpoints (`checkpoint`) follow the policy here: atomic_checkpoints stages
and renames a slot, fatal_save_errors decides whether a failed save stops the run.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import statistics
import sys
import threading
import time
import traceback
from typing import Any

from rlhf import clock, contain, faults, stacks, tracing
from rlhf.checkpoint import slots as ckpt
from rlhf.config import Config
from rlhf.control.reporting import FailureReports
from rlhf.control.saves import CheckpointSaves
from rlhf.control.watchdog import StallWatchdog
from rlhf.control.workers import WorkerGroup
from rlhf.errors import NoProgress, PreflightStraggler, SyncStall
from rlhf.procs import freeze_gc, second_sigterm_stops
from rlhf.run_dir import StepsWriter, write_json
from rlhf.stages import StageClock
from rlhf.train.dist import restart_count
from rlhf.train.parallel import make_layout
from rlhf.transport.client import Client, LoopThread

log = logging.getLogger("rlhf.controller")
TRACEBACK_LOG = logging.getLogger("rlhf.traceback")  # the controller's log file only, never the console


class Drained(Exception):
    """The run stopped after a step because it received SIGTERM; the step and its checkpoint are done."""


class RunLifecycle(FailureReports, CheckpointSaves):
    columns: list[str] = []  # steps.csv
    loop_name = "controller-rpc"
    label = "training"  # in the eval log lines: "eval accuracy before GRPO"
    rl = True  # passes the RL-only fault points (weights_update.*, rollout.*, events.*, ...)

    def __init__(self, cfg: Config, run_dir: str, worker_urls: list[str], token: str) -> None:
        self.cfg, self.run_dir, self.token, self.policy = cfg, run_dir, token, cfg.resilience
        self.loop = LoopThread(self.loop_name)
        clock.watch(cfg.runtime.clock_skew_s)  # every reply's clock against this process's: a host's wrong clock named
        self.workers = WorkerGroup(worker_urls, token, self.loop, cfg.timeouts.rpc_s,
                                   checksums=self.policy.stage_checksums, retries=self.policy.retry_idempotent)
        # the train layout (dp x tp over the ranks), built once: the batch's shares and the weights' paths read it
        self.workers.layout = make_layout(cfg.parallel.layout, cfg.parallel.tp_size, len(self.workers))
        self.workers.watchdog = StallWatchdog(self.workers.clients, cfg.runtime.watchdog_stall_s,
                                              self.policy.stall_stops_run, run_dir, on_report=self._stall_reported,
                                              partition_grace_s=cfg.runtime.partition_grace_s
                                              if self.policy.wait_out_partitions else 0.0,
                                              read_beats=self.workers.heartbeats)
        self.stragglers_seen = 0  # stragglers the watchdog had named by the end of the last step
        self.saves_failed = 0  # checkpoint saves that failed while the run went on (this step's: steps.csv saves_failed)
        self.failed_in_a_row = 0  # skip_failed_saves: consecutive failed saves, against checkpoint.max_failed_saves
        self.replaced_slots: dict[str, str] = {}  # slots replaced by the last saves: the next save's ranks remove theirs
        ckpt.remove_stale_replaced(os.path.join(run_dir, "checkpoints"))  # a killed run's, before a resume
        self.stalled = False  # the watchdog found a rank keeping the others waiting: cleanup does not wait for it
        self.where: dict[str, Any] = {"step": -1, "stage": "startup"}  # what runs now (for the first failure)
        self.first_failure = ""
        self.root_cause = ""  # the diagnosis's headline once the run has failed (the console's last line)
        self.start_step = 0
        self.resumed = False
        self.interrupted = False
        self.drain_requested = False  # SIGTERM during the steps: stop after the running one
        self.eval_before: float | None = None  # before any training; a resume restores it from its checkpoint

    # ------------------------------------------------------------------ what a controller provides

    def startup(self) -> None:
        raise NotImplementedError

    def step(self, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def evaluate(self) -> float:
        raise NotImplementedError

    def eval_note(self) -> str:
        return ""

    def total_steps(self) -> int:
        return self.cfg.steps

    def after_step(self, step: int, row: dict[str, Any]) -> None:
        """Periodic evaluation and the step's log line."""

    def train(self) -> list[dict[str, Any]]:
        """Steps start_step+1 .. total_steps, one steps.csv row each. A SIGTERM meanwhile (an operator, a cluster
        scheduler preempting the job, through torchrun) lets the running step and its checkpoint finish: Drained."""
        writer = StepsWriter(os.path.join(self.run_dir, "steps.csv"), self.columns)
        rows = []
        restore = self._drain_on_sigterm()
        try:
            for step in range(self.start_step + 1, self.total_steps() + 1):
                with tracing.span("step", step=step, new_trace=True), tracing.at_step(step):
                    faults.fault_point("step.begin", step=step)
                    row = self.step(step)
                self.after_step(step, row)
                writer.write(row)
                self.track_step(step, row)
                rows.append(row)
                if self.drain_requested and step < self.total_steps():
                    self._drain(step)
        finally:
            restore()
            writer.close()
        return rows

    def _drain_on_sigterm(self) -> Any:
        """While steps run: the first SIGTERM asks for a drain, a second one ends the process. Returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        before = signal.getsignal(signal.SIGTERM)

        def drain(signum: int, frame: Any) -> None:
            self.drain_requested = True
            second_sigterm_stops(time.monotonic())
            log.warning("received SIGTERM during step %d: finishing it and its checkpoint, then stopping every "
                        "process (a second SIGTERM stops at once)", self.where["step"])

        signal.signal(signal.SIGTERM, drain)
        return lambda: signal.signal(signal.SIGTERM, before) if signal.getsignal(signal.SIGTERM) is drain else None

    def _drain(self, step: int) -> None:
        """After a step on SIGTERM: make sure a checkpoint of it exists, then stop the run (exit 1, resumable)."""
        every = self.cfg.checkpoint.latest_every
        if not every or step % every:  # this step wrote no latest slot: the resume point must be this step
            self.where.update(step=step, stage="latest_recover_save")
            self.checkpoint(ckpt.slot_for_step(step), step)
        drained = Drained(f"stopped after step {step} on SIGTERM")
        drained._rlhf_reported = True  # type: ignore[attr-defined]  # the WARNING says it: exit 1, no traceback
        raise drained

    def summary_extras(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """The controller's part of a checkpoint's meta.json."""
        return {}

    def stop_services(self) -> None:
        """Stop what this controller started besides the train ranks."""

    def clients(self) -> list[Client]:
        return list(self.workers.clients) + [agent for agent, _ in self.workers.agents]

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        summary = None
        try:
            with tracing.span("startup", new_trace=True, world_size=len(self.workers)):
                self.startup()
                preflight = self.preflight()
            self.start_trackers()
            freeze_gc()  # the services, clients and the warm-started model stay for the run
            now = self.evaluate()
            log.info("eval accuracy %s: %.3f%s", "at resume" if self.resumed else f"before {self.label}", now,
                     self.eval_note())
            before = now if self.eval_before is None else self.eval_before
            self.eval_before = before
            self.track_eval(self.start_step, now)
            rows = self.train()
            after = self.evaluate()
            self.track_eval(self.total_steps(), after)
            log.info("eval accuracy after %s: %.3f (before %.3f, gain %+.3f)", self.label, after, before, after - before)
            times = [r["seconds"] for r in rows]
            unfired = self.report_unfired(self.total_steps())
            summary = {"eval_accuracy_before": before, "eval_accuracy_after": after,
                       **({"eval_accuracy_at_resume": now} if self.resumed else {}), "steps": self.total_steps(),
                       "seconds": time.perf_counter() - start,
                       "step_time_median_s": statistics.median(times) if times else 0.0, "seed": self.cfg.seed,
                       "world_size": len(self.workers), "world_restarts": restart_count(),
                       "resilience": self.policy.describe(),
                       **self.summary_extras(rows), **({"faults_never_fired": unfired} if self.cfg.faults else {}),
                       **({"preflight": preflight} if preflight else {}),
                       "run_dir": self.run_dir}
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            return summary
        except (KeyboardInterrupt, Drained):
            self.interrupted = True  # the user's decision, not a failure: no ERROR, no ledger
            raise
        except BaseException as exc:
            self.stalled = self.stalled or isinstance(exc, (SyncStall, NoProgress))  # its request will not end
            step, stage = self.where["step"], self.where["stage"]
            self.first_failure = (f"step {step}, stage {stage}" if step >= 0 else stage) + f": {type(exc).__name__}: {exc}"
            log.error("run failed: %s", self.first_failure)
            TRACEBACK_LOG.info("traceback of the failure (this file only):\n%s", traceback.format_exc())
            try:
                exc._rlhf_reported = True  # type: ignore[attr-defined]  # the entry point exits 1 without a traceback
            except AttributeError:
                pass
            self._defer_sigterm()  # torchrun's SIGTERM (another rank died) must not cut the diagnosis or cleanup short
            self.report_root_cause(early=True)  # at once; cleanup can take a while (its timeouts), then again
            raise
        finally:
            self._defer_sigterm()
            self.cleanup()
            if self.interrupted and self.drain_requested:
                log.warning("stopped after step %d on SIGTERM, its checkpoint written; resume with: %s",
                            self.where["step"], resume_command(self.run_dir))
            elif self.interrupted:
                step, stage = self.where["step"], self.where["stage"]
                log.warning("interrupted %s; resume with: %s", f"at step {step} ({stage})" if step >= 0 else
                            f"during {stage}", resume_command(self.run_dir))
            if self.first_failure:
                self.report_unfired(self.where["step"])
            if self.first_failure and self.policy.first_failure_ledger:
                # whatever cleanup logged, the last error line names the first failure
                log.error("first failure of this run: %s", self.first_failure)
            if self.first_failure and not self.interrupted:
                self.report_root_cause()
            self.finish_trackers(summary)

    def preflight(self) -> dict[str, Any] | None:
        """preflight.enabled: every rank times a matmul and an all_gather; a rank much slower than the others in two
        rounds in a row is named (a rank slow in the first round only, a passing burst of other work on its core, is
        not), and with preflight.exclude the run does not start."""
        pf = self.cfg.preflight
        if not pf.enabled:
            return None

        def measure() -> tuple[dict[int, float], list[dict[str, Any]]]:
            replies = [r for r, _ in self.workers.call("preflight", {"size": pf.matmul_size,
                                                                     "duration_s": pf.duration_s}, stage="startup")]
            times = {r["rank"]: r["matmul_s"] for r in replies}
            log.info("preflight: %dx%d matmul %s; all_gather %s", pf.matmul_size, pf.matmul_size,
                     ", ".join(f"train-{r} {t * 1e3:.2f} ms" for r, t in sorted(times.items())),
                     ", ".join(f"train-{r['rank']} {r['all_gather_s'] * 1e3:.1f} ms" for r in replies))
            return times, replies

        times, replies = measure()
        slow = stragglers(times, pf.threshold)
        rounds = 1
        if slow:
            log.info("preflight: %s slow in the first round; measuring again to confirm",
                     ", ".join(f"train-{rank} ({ratio:.1f}x)" for rank, ratio, _ in slow))
            first = {rank for rank, _, _ in slow}
            times, replies = measure()
            slow = [s for s in stragglers(times, pf.threshold) if s[0] in first]
            rounds = 2
        named = []
        for rank, ratio, others in slow:
            named.append(f"train-{rank} is a straggler: its matmul took {times[rank] * 1e3:.2f} ms, {ratio:.1f}x the "
                         f"median of the other ranks ({others * 1e3:.2f} ms; threshold {pf.threshold:g}x"
                         f"{', in both rounds' if rounds == 2 else ''})")
            log.warning("preflight: %s", named[-1])
        if named and pf.exclude:
            raise PreflightStraggler("; ".join(named) + " — preflight.exclude: the run does not start")
        return {"matmul_ms": {f"train-{r}": round(t * 1e3, 3) for r, t in sorted(times.items())},
                "all_gather_ms": {f"train-{r['rank']}": round(r["all_gather_s"] * 1e3, 3) for r in replies},
                "rounds": rounds, "stragglers": [f"train-{rank}" for rank, _, _ in slow]}

    def _defer_sigterm(self) -> None:
        """torchrun's SIGTERM during cleanup must not cut it short (processes, files and the diagnosis depend on it)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def note(signum: int, frame: Any) -> None:
            log.warning("received SIGTERM during cleanup; finishing cleanup first")
            second_sigterm_stops(time.monotonic())

        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signal.SIGTERM, note)

    # ------------------------------------------------------------------ checkpoints

    @property
    def cleanup_level(self) -> int:
        """Cleanup's errors are ERRORs, except after Ctrl-C: the user stopped the run, peers vanish on purpose."""
        return logging.WARNING if self.interrupted else logging.ERROR

    def cleanup(self) -> None:
        """Stop services, then the train ranks. Errors here are logged, never raised over the first."""
        with tracing.span("cleanup", stage="cleanup", new_trace=True):
            self.stop_services()
            errors = []
            try:
                # a stalled rank's request will not finish: it gets 1 s, not the usual 30 s, before its rank exits
                self.workers.call("shutdown", {"grace_s": 1.0} if self.stalled else None, timeout_s=10, stage="cleanup")
            except (RuntimeError, OSError, TimeoutError) as exc:
                errors.append(f"worker shutdown: {type(exc).__name__}: {exc}")
            ckpt.remove_later(*self.replaced_slots.values())  # the last saves' replaced slots: no save comes now
            faults.restore_all("run end")
            report = faults.audit(self.run_dir)  # what dead processes left behind: helpers, fill files
            left = contain.sweep(contain.run_prefix(self.run_dir))  # a killed scheduler's contained jobs' leftovers
            if left:
                log.warning("cleanup: killed %d process(es) left in this run's cgroups: %s", len(left),
                            ", ".join(left[:8]))
            if report["unrestored"] and report["cleaned"]:
                log.warning("fault audit: %d injection(s) not restored by their process; cleaned up after them: %s",
                            len(report["unrestored"]), "; ".join(report["cleaned"]))
            elif report["unrestored"]:  # good news: the process ended and took its fault's effects with it
                log.info("fault audit: nothing left behind (%d injection(s) ended with their process)",
                         len(report["unrestored"]))
            for e in errors:
                log.log(self.cleanup_level, "cleanup: %s", e)
            self.loop.gather(*[c.close() for c in self.clients()], return_exceptions=True)
            self.loop.close()
            stacks.tidy(self.run_dir)  # the stacks files no watchdog asked for


def stragglers(times: dict[int, float], threshold: float) -> list[tuple[int, float, float]]:
    """(rank, its time / the median of the others', that median) of every rank at least `threshold` times slower
    than the median of the other ranks (leave-one-out, so two ranks compare with each other)."""
    out = []
    for rank, t in sorted(times.items()):
        others = sorted(v for r, v in times.items() if r != rank)
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and t / median >= threshold:
            out.append((rank, t / median, median))
    return out


def resume_command(run_dir: str) -> str:
    """The command that resumes this run: the same arguments, the same world, this run directory."""
    argv, args, skip = sys.argv, [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg in ("--run-dir", "--run_dir"):
            skip = True
            continue
        if not arg.startswith(("--run-dir=", "--run_dir=")):
            args.append(arg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    script = os.path.relpath(argv[0]) if argv[0].endswith(".py") else os.path.basename(argv[0])
    head = [f"torchrun --nproc_per_node={world}"] if "TORCHELASTIC_RUN_ID" in os.environ else (
        ["python"] if script.endswith(".py") else [])
    return " ".join(head + [shlex.quote(a) for a in [script, *args, "--run-dir", run_dir]])


class TrackedClock(StageClock):
    """A StageClock that also tells the controller which stage is running (for the failure report)."""

    def __init__(self, step: int, where: dict[str, Any]) -> None:
        super().__init__(step)
        self.where = where
        where.update(step=step, stage="step")

    def stage(self, name: str):  # type: ignore[override]
        self.where["stage"] = name
        return super().stage(name)
