"""Weights & Biases (`--logger wandb`): wandb's own run at <run-dir>/wandb.

Without WANDB_API_KEY (and WANDB_MODE unset) the run is offline: everything stays under <run-dir>/wandb, and
`wandb sync <run-dir>/wandb/offline-run-*` uploads it later. The config is the run's config; each step's metrics are
one `log` at that step; the events are a table ("events": step, kind, what) and the run summary's `events` and
`diagnosis`; `rlhf report`'s figures are images at the end. wandb's own console capture and system sampling are off
(the run's log and its metrics/ CSVs already hold them), and its service process is stopped at the end.
"""

from __future__ import annotations

import os
from typing import Any


class WandbRun:
    name = "wandb"

    def __init__(self, directory: str, project: str, name: str, params: dict[str, Any]) -> None:
        import wandb

        os.makedirs(directory, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=os.path.dirname(directory), config=params, mode=mode,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.where = f"{mode}, {self.run.dir}"
        self.last = -1

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.last = max(self.last, step)
        self.run.log(values, step=self.last)  # wandb's steps only go up: a later call at an earlier step joins the last

    def log_events(self, step: int, events: list[dict[str, Any]]) -> None:
        pass  # the table at the end holds each at its own step (a log at an earlier step would be dropped)

    def end(self, step: int, summary: dict[str, Any], events: list[dict[str, Any]], images: list[str]) -> None:
        wandb = self.wandb
        self.last = max(self.last, step)
        rows = [[e["step"], e["kind"], e["what"]] for e in events]
        payload: dict[str, Any] = {"events": wandb.Table(columns=["step", "kind", "what"], data=rows)}
        payload.update({f"figures/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p) for p in images})
        self.run.log(payload, step=self.last)
        self.run.summary["events"] = [f"step {s}: {what}" for s, _kind, what in rows]
        verdicts = [e["what"] for e in events if e["kind"] == "diagnosis"]
        if verdicts:
            self.run.summary["diagnosis"] = verdicts[-1]
        for key, value in summary.items():
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                self.run.summary[key] = value
        self.failed = not summary

    def close(self) -> None:
        self.run.finish(exit_code=1 if getattr(self, "failed", False) else 0)
        self.wandb.teardown()  # its service process ends with the run, not at this process's exit
