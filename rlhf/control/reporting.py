"""What the controller says about a failure: the live diagnosis (its headline is the console's last line, and
torchrun's Root Cause), the stall watchdog's early report, and the faults that never fired."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from rlhf import diagnosis, faults, tracing

log = logging.getLogger("rlhf.controller")
DIAGNOSIS_LOG = logging.getLogger("rlhf.diagnosis")  # the console's last line: the root cause


class FailureReports:
    """The diagnosis and never-fired reports of a run (a part of RunLifecycle)."""

    def report_root_cause(self, early: bool = False) -> None:
        """The diagnosis of this run's evidence (ours in both modes; faithful still behaves as the seeds' system).

        early: right after the failure, before cleanup (the peers' span exporters get one export period);
        then after cleanup, with everything the run left: the console ends with where to look and, last,
        the root cause; torchrun's closing block quotes it too.
        """
        try:
            tracing.flush()  # this process's spans (controller, train-0, MetaServer) are evidence too
            if early and self.cfg.tracing.enabled:
                time.sleep(self.cfg.tracing.export_delay_ms / 1000 + 0.1)  # the other processes' next span export
            diag = diagnosis.diagnose(self.run_dir)
            diagnosis.write(diag)
        except Exception as exc:  # noqa: BLE001 — the diagnosis must never hide the failure it explains
            log.warning("diagnosis failed: %s: %s", type(exc).__name__, exc)
            return
        self.root_cause = diag.headline()
        if early:
            DIAGNOSIS_LOG.error("%s", diag.headline())
            return
        log.info("logs: %s  trace: rlhf trace %s  diagnosis: rlhf diagnose %s", os.path.join(self.run_dir, "logs"),
                 self.run_dir, self.run_dir)
        if diag.root is not None:
            log.info("evidence: %s (confidence %.2f%s)", diag.root.source, diag.confidence,
                     f"; runner-up: {diag.runner_up.process}, {diag.runner_up.category}" if diag.runner_up else "")
        DIAGNOSIS_LOG.error("%s", diag.headline())
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torchrun's "Root Cause" block prints this instead of "To enable traceback see ..."
            try:
                with open(error_file, "w", encoding="utf-8") as fh:
                    json.dump({"message": f"{diag.headline()} (run failed: {self.first_failure[:300]})",
                               "timestamp": int(time.time())}, fh)
            except OSError:
                pass

    def _stall_reported(self, found: str) -> None:
        """The watchdog found a stall and the policy lets the run wait: the live diagnosis, beside the run."""
        self.stalled = True
        threading.Thread(target=self.report_root_cause, kwargs={"early": True}, name="stall-diagnosis",
                         daemon=True).start()

    def report_unfired(self, last_step: int) -> list[dict[str, str]]:
        """Armed faults that never fired: a WARNING each (the experiment did not happen), with the likely reason."""
        if not self.cfg.faults:
            return []
        unfired = faults.never_fired(self.run_dir, self.cfg.faults, last_step, rl=self.rl,
                                     colocate=self.cfg.runtime.colocate, weights_mode=self.cfg.weights.mode,
                                     parallel=self.cfg.parallel.layout)
        for fault in unfired:
            log.warning("fault %s never fired: %s", fault["name"], fault["why"])
        return unfired

    # ------------------------------------------------------------------ experiment trackers (logger.backends)

    def start_trackers(self) -> None:
        """The trackers --logger names (rank 0's controller only), with the resolved config; a world restart is an
        event at the step it resumes at."""
        import dataclasses

        from rlhf.trackers import Trackers
        from rlhf.train.dist import restart_count

        lg = self.cfg.logger
        self.trackers = Trackers(lg.names, self.run_dir, dataclasses.asdict(self.cfg), lg.project, lg.mlflow_uri)
        self.tracker_events = []
        if restart_count():
            self.tracker_events.append({"step": self.start_step + 1, "kind": "world_restart",
                                        "what": f"world restart {restart_count()}: resumed after step {self.start_step}"})

    def track_step(self, step: int, row: dict) -> None:
        trackers = getattr(self, "trackers", None)
        if trackers is not None:
            trackers.step(step, row, self.tracker_events)
            self.tracker_events = []

    def track_eval(self, step: int, accuracy: float) -> None:
        trackers = getattr(self, "trackers", None)
        if trackers is not None:
            trackers.scalars(step, {"eval/accuracy": accuracy})

    def finish_trackers(self, summary: dict | None) -> None:
        """At the end, whatever happened: the diagnosis (the failure's root cause; a faulted run that finished is
        diagnosed too), the summary and `rlhf report`'s figures (draw_figures, set by the entry point)."""
        trackers = getattr(self, "trackers", None)
        if trackers is None or not trackers.active:
            return
        verdict = self.root_cause
        if not verdict and self.cfg.faults:
            try:
                verdict = diagnosis.diagnose(self.run_dir).headline()
            except Exception as exc:  # noqa: BLE001 — the trackers never fail the run
                log.warning("diagnosis for the trackers failed: %s: %s", type(exc).__name__, exc)
        images: list[str] = []
        draw = getattr(self, "draw_figures", None)
        if draw is not None:
            try:
                images = draw(self.run_dir)
            except Exception as exc:  # noqa: BLE001
                log.warning("figures for the trackers failed: %s: %s", type(exc).__name__, exc)
        trackers.finish(max(self.where["step"], 0), summary, verdict, images)
