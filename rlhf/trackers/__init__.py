"""Experiment trackers (`--logger console,tensorboard,wandb,mlflow`): each step's steps.csv row as grouped metrics,
the evals, the resolved config as hyperparameters, and — beside the curves — the run's events: each fault's
injection and restore (faults/markers.jsonl), rollout-server restarts, migrations, weights fallbacks and drift, failed
saves, dropped groups, a world restart, and the diagnosis at the end.

    trackers = Trackers(cfg.logger, run_dir, config_dict)      # rank 0's controller only; console needs nothing
    trackers.step(step, row)                                   # after each steps.csv row
    trackers.finish(summary, verdict, images)                  # at the end, whatever happened

Each backend is one module using its own library (tensorboard.py: torch.utils.tensorboard's SummaryWriter;
wandb_run.py: wandb; mlflow_run.py: mlflow's MlflowClient), imported only when named. A backend whose call fails
(a full disk, a server that stops answering) logs one WARNING and is dropped: a tracker never fails a step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

log = logging.getLogger("rlhf.trackers")

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # backend -> the package it needs
INSTALL = "pip install 'rlhf[trackers]'"
# a steps.csv column > 0 at a step is an event beside the curves
EVENT_COLUMNS = ("rollout_restarts", "rollout_migrated", "weights_fallback", "weights_drift", "saves_failed",
                 "stragglers", "rebalanced", "dropped_groups", "infra_errors", "infra_retries")
_TRAIN = ("loss", "grad_norm", "kl", "clip_fraction", "entropy", "ratio_mean", "response_length")
_ASYNC = ("staleness_mean", "staleness_max", "off_policy_fraction", "buffer_groups")
_ENV = ("turns_mean", "tool_calls", "tool_errors", "infra_errors", "infra_retries", "dropped_groups")


def missing_packages(names: list[str]) -> list[str]:
    """One line for each named backend whose package is not installed."""
    return [f"--logger {name}: the {PACKAGES[name]} package is not installed: {INSTALL} (or pip install "
            f"{PACKAGES[name]})" for name in names if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None]


def metric_name(column: str) -> str:
    """A steps.csv column's tracker name, grouped: reward/mean, timing/rollout_s, train/grad_norm, ..."""
    if column == "seconds":
        return "timing/step_s"
    if column == "eval_accuracy":
        return "eval/accuracy"
    if column.startswith("reward_"):
        return "reward/" + column[len("reward_"):]
    if column in _TRAIN:
        return "train/" + column
    if column in _ASYNC or column.endswith("_idle_s"):
        return "async/" + column
    if column in _ENV or column in ("env_s", "reward_env"):
        return "env/" + column
    if column.endswith("_s") or column.endswith("_s_max"):
        return "timing/" + column
    for prefix in ("rollout", "weights", "agent"):
        if column.startswith(prefix + "_"):
            return f"{prefix}/{column[len(prefix) + 1:]}"
    return "run/" + column


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric cells under their tracker names (empty cells and text left out)."""
    out = {}
    for column, value in row.items():
        if column == "step" or value is None or value == "" or isinstance(value, bool):
            continue
        try:
            out[metric_name(column)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The resolved config as hyperparameters: dotted keys, lists as JSON."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = value
    return out


class MarkerReader:
    """faults/markers.jsonl as events: each call returns the lines written since the last one."""

    def __init__(self, run_dir: str) -> None:
        self.path, self.offset = os.path.join(run_dir, "faults", "markers.jsonl"), 0

    def new(self, step: int) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written stays for the next call
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            at = m.get("step") if isinstance(m.get("step"), int) and m.get("step") >= 0 else step
            where = f"{m.get('role')}-{m.get('rank')}" if m.get("role") else "?"
            events.append({"step": at, "kind": f"fault.{m.get('event')}",
                           "what": f"fault {m.get('fault')} ({m.get('kind')}{', emulated' if m.get('emulated') else ''}) "
                                   f"{m.get('event')} at {m.get('point')} on {where}"})
        return events


def row_events(step: int, row: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for column in EVENT_COLUMNS:
        try:
            value = float(row.get(column) or 0)
        except (TypeError, ValueError):
            continue
        if value > 0:
            out.append({"step": step, "kind": column, "what": f"{column} {value:g} at step {step}"})
    return out


class Trackers:
    """The named backends, fed together; each one's first failure is a WARNING and drops it."""

    def __init__(self, names: list[str], run_dir: str, config: dict[str, Any], project: str = "rlhf",
                 mlflow_uri: str = "") -> None:
        self.run_dir, self.backends, self.events = run_dir, [], []
        self.markers = MarkerReader(run_dir)
        name = os.path.basename(os.path.abspath(run_dir))
        params = flat_config(config)
        for backend in names:
            if backend == "console":
                continue  # the log lines and steps.csv: always written
            try:
                if backend == "tensorboard":
                    from rlhf.trackers.tensorboard import TensorBoardRun
                    self.backends.append(TensorBoardRun(os.path.join(run_dir, "tensorboard"), params))
                elif backend == "wandb":
                    from rlhf.trackers.wandb_run import WandbRun
                    self.backends.append(WandbRun(os.path.join(run_dir, "wandb"), project, name, params))
                elif backend == "mlflow":
                    from rlhf.trackers.mlflow_run import MlflowRun
                    self.backends.append(MlflowRun(mlflow_uri or os.path.join(run_dir, "mlruns"), project, name, params))
            except Exception as exc:  # noqa: BLE001 — a tracker never stops the run
                log.warning("tracker %s could not start: %s: %s (the run goes on without it)", backend,
                            type(exc).__name__, exc)
        if self.backends:
            log.info("trackers: %s", ", ".join(f"{b.name} ({b.where})" for b in self.backends))

    @property
    def active(self) -> bool:
        return bool(self.backends)

    def _each(self, what: str, *args: Any) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, what)(*args)
            except Exception as exc:  # noqa: BLE001 — warn once, drop it, never fail the step
                self.backends.remove(backend)
                log.warning("tracker %s failed (%s: %s: %s); the run goes on without it", backend.name, what,
                            type(exc).__name__, exc)

    def step(self, step: int, row: dict[str, Any], extra: list[dict[str, Any]] = ()) -> None:
        if not self.backends:
            return
        events = list(extra) + self.markers.new(step) + row_events(step, row)
        self.events += events
        # beside the curves: how many faults fired and how many events happened at this step (0 at quiet steps)
        counts = {"events/faults_injected": float(sum(e["kind"] == "fault.inject" for e in events)),
                  "events/count": float(len(events))}
        self._each("scalars", step, {**numbers(row), **counts})
        if events:
            self._each("log_events", step, events)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.backends:
            self._each("scalars", step, values)

    def finish(self, step: int, summary: dict[str, Any] | None, verdict: str, images: list[str]) -> None:
        """The end, whatever it was: the markers left (a restore at exit), the diagnosis as an event, the summary
        and the figures; then each backend closes."""
        if not self.backends:
            return
        events = self.markers.new(step)
        if verdict:
            events.append({"step": step, "kind": "diagnosis", "what": verdict})
        self.events += events
        if events:
            self._each("log_events", step, events)
        self._each("end", step, summary or {}, self.events, [p for p in images if os.path.exists(p)])
        for backend in list(self.backends):
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("tracker %s did not close cleanly: %s: %s", backend.name, type(exc).__name__, exc)
        self.backends = []
