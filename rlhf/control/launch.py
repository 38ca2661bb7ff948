"""Per-rank entry of the distributed runtime (what examples/grpo_trainer.py runs on every rank).

Rank 0 makes the run token and the run directory, publishes them in the c10d store, starts its
TrainWorker's RPC server and then runs the Controller; every other rank starts its TrainWorker
and serves until the controller says /shutdown. torchrun (or, without it, a world of one)
provides the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any

import psutil

from rlhf import exits, faults, tracing
from rlhf.config import Config
from rlhf.control.controller import Controller
from rlhf.control.sft_controller import SFTController
from rlhf.inputs import check_inputs
from rlhf.procs import bound_heap, cpu_share, freeze_gc, own_threads, second_sigterm_stops, set_pdeathsig
from rlhf.report import run_figures
from rlhf.run_dir import CONTROLLER_LOGGERS, default_run_dir, make_run_dir, setup_logging
from rlhf.services.train_worker import TrainWorker
from rlhf.tracing import metrics
from rlhf.tracing.setup import stop_process_telemetry
from rlhf.train.dist import fetch, init_distributed, publish, restart_count, shutdown_distributed
from rlhf.transport.http import ServiceThread

log = logging.getLogger("rlhf.launch")



def _agent_started() -> float | None:
    """When this rank's torchrun agent started (the same for every restart of its workers); None without one."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return None


# root causes a new world can get past (a lost process, a stuck or unreachable one, a starved one); an OOM, a full
# disk, corrupt data or an exception in our code would come back the same way from the same checkpoint
RESTART_CURES = ("process_death", "hang", "timeout", "network", "cpu_starvation", "io_starvation")


class RestartRefused(RuntimeError):
    """torchrun restarted the workers after a failure that a restart repeats: this world does not resume."""


def _restart_refused(run_dir: str) -> str:
    """Why this restarted world must not resume ('' when it may): the previous world's diagnosis, written after this
    torchrun started, names a root cause a restart repeats."""
    path = os.path.join(run_dir, "diagnosis.json")
    started = _agent_started() or 0.0
    try:
        if os.path.getmtime(path) < started:
            return ""  # an earlier command's run, resumed since
        with open(path, encoding="utf-8") as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return ""  # nothing written: its controller was killed (rank 0 SIGKILLed), a lost process
    root = found.get("root_cause") or {}
    if found.get("verdict") != "failed" or not root or root.get("category") in RESTART_CURES:
        return ""
    return (f"the previous world failed with {root.get('category')} in {root.get('process')} at step {root.get('step')} "
            f"({str(root.get('summary', ''))[:200]}), which a restart from the same checkpoint repeats; not resuming "
            f"(fix the cause, then run the same command with --run-dir {run_dir})")


def run(cfg: Config, mode: str = "grpo") -> dict[str, Any] | None:
    """mode 'grpo': the GRPO controller; 'sft': the SFT baseline controller (no rollout side)."""
    check_inputs(cfg)  # the command lines checked them already; a caller of run() gets the same one error
    if cfg.sim.enabled:  # a simulated world: the real controller, train ranks and rollout servers EMULATED (rlhf.sim)
        if mode != "grpo" or "LOCAL_RANK" in os.environ:
            raise ValueError("sim.train_ranks: a simulated world runs GRPO from one process (no torchrun, not sft)")
        from rlhf.control.sim_launch import run_simulated

        return run_simulated(cfg)
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        # torchrun gone (killed, OOM-killed): SIGTERM drains the run as an operator's would (the controller finishes
        # its step and checkpoint), and the orphan guard ends this rank DRAIN_WAIT_S later whatever it is doing
        set_pdeathsig(signal.SIGTERM)
        _orphan_guard()
    info = init_distributed(cfg.model.device)
    rank, world = info.rank, info.world_size
    if rank == 0:
        token = secrets.token_hex(16)
        run_dir = os.path.abspath(cfg.run_dir or default_run_dir(_agent_started()))
        publish("token", token)
        publish("run_dir", run_dir)
        publish("pid/0", str(os.getpid()))
    else:
        token, run_dir = fetch("token"), fetch("run_dir")
    make_run_dir(run_dir)
    own_threads(1)  # the controller (rank 0) and every thread but the train worker's: serial (procs.own_threads)
    bound_heap(cfg.runtime.heap_mmap_threshold_mb)
    if rank == 0:
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as fh:
            fh.write(cfg.to_yaml())
        setup_logging(run_dir, "train", 0, routes={CONTROLLER_LOGGERS + ("rlhf.traceback",): ("controller", 0)},
                      console_prefixes=CONTROLLER_LOGGERS + ("rlhf.sft",))
    else:
        setup_logging(run_dir, "train", rank, console=False)
    # spans: rank 0's main thread is the controller (its train worker and MetaServer set their own role
    # per request); metrics: one file per process, named after its train rank
    tracing.setup_tracing(run_dir, "controller" if rank == 0 else "train", rank, cfg.tracing)
    metrics.start_sampler(run_dir, "train", rank, cfg.tracing.metrics_interval_s)
    if cfg.faults:
        faults.arm(run_dir, cfg.faults)
    exits.record_start(run_dir, f"train-{rank}")
    log.info("train-%d on %s, %s collectives (%s)", rank, info.device, info.backend, info.why)
    worker = TrainWorker(cfg, run_dir, rank, world, token, device=info.device,
                         threads=cpu_share(world), grpo=mode != "sft")
    server = ServiceThread(worker.service)
    server.start()
    freeze_gc()  # the model, the worker and the imports are never garbage
    publish(f"worker/{rank}", server.url)
    publish(f"node/{rank}", os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank (--nnodes)
    logging.getLogger("rlhf.train_worker").info("train worker %d/%d serving on %s (pid %d)", rank, world,
                                                server.url, os.getpid())
    summary = None
    controller: Any = None
    failed = True
    ended = {"reason": ""}
    if rank == 0:
        signal.signal(signal.SIGTERM, _terminated)  # torchrun stops the ranks when one of them died: fail, clean up
    try:
        if rank == 0:
            urls = [fetch(f"worker/{r}") for r in range(world)]
            log.info("run %s: %d train ranks (%s), %d rollout servers, weights %s, resilience %s%s", run_dir, world,
                     info.backend, cfg.rollout.servers, cfg.weights.mode, cfg.resilience.describe(),
                     ", colocated" if cfg.runtime.colocate else "")
            refused = _restart_refused(run_dir) if restart_count() else ""
            if refused:
                log.error("torchrun restarted this run's workers (restart %d of %s): %s", restart_count(),
                          os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), refused)
                refusal = RestartRefused(refused)
                refusal._rlhf_reported = True  # type: ignore[attr-defined]  # said above: exit 1, no traceback
                raise refusal
            if restart_count():
                log.warning("torchrun restarted this run's workers (restart %d of %s, --max-restarts): the previous "
                            "world ended with a failed process; this world resumes from the newest valid checkpoint "
                            "in %s", restart_count(), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), run_dir)
            nodes = [int(fetch(f"node/{r}")) for r in range(world)]
            controller = SFTController(cfg, run_dir, urls, token) if mode == "sft" else \
                Controller(cfg, run_dir, urls, token, nodes=nodes)
            controller.draw_figures = run_figures  # the trackers (--logger) log them at the end
            summary = controller.run()
        else:
            # SIGTERM (torchrun passes on an operator's or a cluster scheduler's): the controller finishes its step
            # with this rank and then shuts it down; this rank stops by itself once the controller's process is gone
            # (it failed, or torchrun stops every rank after one died) or after DRAIN_WAIT_S
            controller_pid = int(fetch("pid/0"))
            term_at: list[float] = []

            def on_term(signum: int, frame: Any) -> None:
                ended["reason"] = "received SIGTERM"
                term_at.append(time.monotonic())
                worker.stopping.set()  # a warm start in progress ends before its next step

            signal.signal(signal.SIGTERM, on_term)
            while not worker.shutdown.wait(0.2):
                if term_at and (not _alive(controller_pid) or time.monotonic() - term_at[0] > DRAIN_WAIT_S):
                    break
        failed = False
    except BaseException as exc:
        ended["reason"] = ended["reason"] or f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        # this rank's own end (torchrun is its parent and records nothing we can read); a SIGKILL leaves none
        exits.record_exit(run_dir, f"train-{rank}", os.getpid(), 1 if failed else 0, by=f"train-{rank}",
                          expected=not failed and not ended["reason"], reason=ended["reason"])
        busy = worker.service.inflight  # a handler still running: hung in a collective, a fault, a slow call
        # Ctrl-C: the user wants out, do not wait for a busy handler (an SFT warm start runs for minutes). Any
        # other end (a peer died, torchrun's SIGTERM) gives the handler time to fail and log why.
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        worker.stopping.set()  # a warm start still running ends before its next step: no 30 s wait for it
        server.stop(timeout_s=1.0 if busy and interrupted else worker.shutdown_grace_s)
        busy = worker.service.inflight  # what is still running now that the server gave it its time
        worker.close()
        if not busy:
            shutdown_distributed()

        faults.restore_all("run end")
        stop_process_telemetry()
        if busy:
            # Python would wait for that handler thread forever at exit; this rank's part is over
            log.warning("train rank %d: %d request(s) still running at shutdown; exiting without waiting", rank, busy)
            if controller is not None and controller.root_cause:  # the console's last line stays the root cause
                logging.getLogger("rlhf.diagnosis").error("%s", controller.root_cause)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1 if failed else 0)
    return summary


DRAIN_WAIT_S = 25.0  # under torchrun's 30 s between its SIGTERM and its SIGKILL


def _orphan_guard() -> None:
    """A rank never outlives its torchrun agent by more than DRAIN_WAIT_S + 5 s, however the agent ended."""
    parent, limit = os.getppid(), DRAIN_WAIT_S + 5
    tick = threading.Event()  # never set: its wait is the guard's clock

    def watch() -> None:
        while os.getppid() == parent:
            tick.wait(0.5)
        log.warning("torchrun (pid %d) is gone: this rank drains (SIGTERM) and ends within %.0f s", parent, limit)
        tick.wait(limit)
        log.error("torchrun (pid %d) is gone and this rank did not end within %.0f s: exiting", parent, limit)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="orphan-guard", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Terminated(Exception):
    """SIGTERM on the controller's rank: torchrun stops every rank once one of them has exited."""


def _terminated(signum: int, frame: Any) -> None:
    second_sigterm_stops(time.monotonic())
    raise Terminated("received SIGTERM (torchrun sends it to every rank once one rank has exited)")


def print_summary(summary: dict[str, Any] | None) -> None:
    if summary is not None:
        print(json.dumps(summary), flush=True)
