"""MLflow (`--logger mlflow`): a run in experiment `logger.project` through mlflow's MlflowClient.

The default store is a local file store at <run-dir>/mlruns (`mlflow ui --backend-store-uri <run-dir>/mlruns`);
MLflow 3 keeps that store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, which this module
sets for its own default store only. `--logger.mlflow_uri` names a server or a database instead. The config is the
run's params; each step's metrics one log_batch at that step; each event a tag (event.<step>.<n>: kind: what) and
all of them the artifact events.json; the summary the artifact summary.json and its numbers metrics
(summary/...); `rlhf report`'s figures artifacts under figures/. A failed run ends FAILED.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any


class MlflowRun:
    name = "mlflow"

    def __init__(self, uri: str, project: str, name: str, params: dict[str, Any]) -> None:
        if "://" not in uri and not uri.startswith("file:"):  # a directory: the local file store
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            os.makedirs(uri, exist_ok=True)
            uri = pathlib.Path(os.path.abspath(uri)).as_uri()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client, self.where = MlflowClient(tracking_uri=uri), uri
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        self.tags = 0
        self.failed = False

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_events(self, step: int, events: list[dict[str, Any]]) -> None:
        for e in events:
            self.tags += 1
            self.client.set_tag(self.run_id, f"event.{e['step']:05d}.{self.tags}", f"{e['kind']}: {e['what']}"[:5000])

    def end(self, step: int, summary: dict[str, Any], events: list[dict[str, Any]], images: list[str]) -> None:
        self.client.log_dict(self.run_id, events, "events.json")
        self.client.log_dict(self.run_id, summary, "summary.json")
        numbers = {f"summary/{k}": float(v) for k, v in summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self.scalars(step, numbers)
        for path in images:
            self.client.log_artifact(self.run_id, path, "figures")
        self.failed = not summary

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if self.failed else "FINISHED")
