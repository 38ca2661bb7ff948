"""Evidence from the logs: ERROR lines, WARNING lines that report a failure, the traceback's last exception;
background checkpoint writes that started and never finished."""

from __future__ import annotations

import csv
import glob
import os
import re

import yaml

from rlhf.config.sections import drift_threshold
from rlhf.diagnosis.report import Evidence, stamp
from rlhf.diagnosis.rules import (
    _EXC_LINE,
    _FAILURE_WARNING,
    _NOT_EVIDENCE,
    _STEP,
    _WITHIN,
    LOG_LINE,
    _stage_in,
    _subject,
    categorize,
)


def _log_evidence(run_dir: str) -> list[Evidence]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        rel = os.path.relpath(path, run_dir)
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        current: Evidence | None = None
        for i, line in enumerate(lines, 1):
            m = LOG_LINE.match(line)
            if m is None:
                exc = _EXC_LINE.match(line.strip())
                if current is not None and exc:  # a traceback under an ERROR line: its last exception refines it
                    cat = categorize(line)
                    if cat != "exception" and current.category in ("exception", "network", "timeout"):
                        current.category = cat
                continue
            current = None
            level, logger, msg, proc = m.group("level"), m.group("logger"), m.group("msg"), m.group("proc")
            if logger.startswith(("rlhf.faults", "rlhf.diagnosis")) or _NOT_EVIDENCE.search(msg):
                continue
            if level not in ("ERROR", "CRITICAL") and not (level == "WARNING" and _FAILURE_WARNING.search(msg)):
                continue
            t = stamp(m.group("ts"))
            subject, local = _subject(proc, msg)
            category = categorize(msg)
            onset = t
            w = _WITHIN.search(msg)
            if w and category in ("timeout", "hang"):
                onset = t - float(w.group(1))
            step_m = _STEP.search(msg)
            current = Evidence(t, onset, proc, subject, category, _stage_in(msg), int(step_m.group(1)) if step_m else -1,
                               msg, f"{rel}:{i}", "error" if level != "WARNING" else "warning", local)
            out.append(current)
    return out


_WRITE = re.compile(r"background checkpoint write to (?P<dir>\S+) (?P<what>started|done|failed)")


def _unfinished_writes(run_dir: str, evidence: list[Evidence]) -> list[Evidence]:
    """A background checkpoint write that started and never finished, when something later read a broken file."""
    broken = [e for e in evidence if e.category == "disk" and re.search(r"SafetensorError|incomplete|not fully", e.message)]
    if not broken:
        return []
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "train-*.log"))):
        open_writes: dict[str, tuple[float, int, int]] = {}
        with open(path, encoding="utf-8", errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                m, w = LOG_LINE.match(line.rstrip("\n")), _WRITE.search(line)
                if m is None or w is None:
                    continue
                if w.group("what") == "started":
                    step_m = _STEP.search(line)
                    open_writes[w.group("dir")] = (stamp(m.group("ts")), int(step_m.group(1)) if step_m else -1, i)
                else:
                    open_writes.pop(w.group("dir"), None)
        name = os.path.basename(path)[:-4]
        for directory, (t, step, line_no) in open_writes.items():
            if t >= broken[0].time:
                continue
            slot = directory.rsplit(os.sep + "checkpoints" + os.sep, 1)[-1]
            stage = "periodic_recover_save" if "periodic" in slot else "latest_recover_save"
            out.append(Evidence(t, t, name, name, "hang", stage, step,
                                f"{name}'s background checkpoint write to {slot} (step {step}) started and never "
                                f"finished; {broken[0].reporter} later read a broken checkpoint "
                                f"({broken[0].message[-90:]})", f"{os.path.relpath(path, run_dir)}:{line_no}",
                                "unfinished", True))
    return out


def _drift_evidence(run_dir: str, logs: list[Evidence]) -> list[Evidence]:
    """Weights that drifted silently: the first step whose rollout_train_logprob_diff (steps.csv) passed the run's
    weights.drift_threshold (config.yaml) under the same weights version, when no log line reported it (a run with
    no error at all). Not with async K >= 1, where the difference holds the policy's change too."""
    if any(e.category == "weights_drift" for e in logs):
        return []
    cfg, rows = _config_and_steps(run_dir)
    rollout = cfg.get("rollout") or {}
    threshold = drift_threshold(float((cfg.get("weights") or {}).get("drift_threshold") or 0),
                                str((cfg.get("model") or {}).get("dtype") or "float32"))
    if not threshold or (rollout.get("mode") == "async" and int(rollout.get("max_staleness") or 0) > 0):
        return []
    for line, row in enumerate(rows, 2):
        try:
            diff, top, step = float(row["rollout_train_logprob_diff"]), float(row.get("rollout_train_logprob_diff_max")
                                                                               or 0), int(row["step"])
        except (KeyError, TypeError, ValueError):
            continue
        if diff <= threshold:
            continue
        servers = int(rollout.get("servers") or 1)
        subject = "rollout-0" if servers == 1 else f"rollout-0..{servers - 1}"
        t = _step_end(run_dir, step)
        msg = (f"step {step}: rollout and train logprobs differ by {diff:.3g} on average (max {top:.3g}) under the "
               f"same weights version, past weights.drift_threshold {threshold:g}: the weights {subject} generated "
               "with are not the trainer's, and nothing reported it (stage weights_update)")
        return [Evidence(t, t, "controller-0", subject, "weights_drift", "weights_update", step, msg,
                         f"steps.csv:{line}", "warning", False)]
    return []


def _tool_infra_evidence(run_dir: str, logs: list[Evidence]) -> list[Evidence]:
    """Tool infrastructure failures handed to the model (env.on_infra_error model, faithful: verl's behaviour): the
    first step whose steps.csv infra_errors > 0, when no log line reported one (the run went on, silently)."""
    if any(e.category == "tool_infra" for e in logs):
        return []
    cfg, rows = _config_and_steps(run_dir)
    for line, row in enumerate(rows, 2):
        try:
            n, step = int(float(row.get("infra_errors") or 0)), int(row["step"])
        except (KeyError, TypeError, ValueError):
            continue
        if n <= 0:
            continue
        t = _step_end(run_dir, step)
        tools = (cfg.get("env") or {}).get("tools") or (cfg.get("env") or {}).get("path") or "?"
        msg = (f"step {step}: {n} tool infrastructure failures of env-0 ({tools}) were handed to the model as the "
               "tools' answers (env.on_infra_error model, steps.csv infra_errors), and nothing reported them "
               "(stage rollout)")
        return [Evidence(t, t, "controller-0", "env-0", "tool_infra", "rollout", step, msg, f"steps.csv:{line}",
                         "warning", False)]
    return []


def _step_end(run_dir: str, step: int) -> float:
    """When the controller logged the end of `step` (its "step N/M" line), else when steps.csv was last written."""
    pattern = re.compile(rf" step {step}/\d+ ")
    try:
        with open(os.path.join(run_dir, "logs", "controller-0.log"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = LOG_LINE.match(line.rstrip("\n"))
                if m and pattern.search(" " + m.group("msg") + " "):
                    return stamp(m.group("ts"))
        return os.path.getmtime(os.path.join(run_dir, "steps.csv"))
    except OSError:
        return 0.0


def _starved_evidence(run_dir: str, servers: list) -> list[Evidence]:
    """Asynchronous runs: the steps in which the train side waited for its batch most of the step (train_idle_s over
    half the step and over a second, steps.csv) and the rollout server whose /generate took longest for those
    batches (its server spans), when it took more than twice any other's: the trainer starved with no error."""
    cfg, rows = _config_and_steps(run_dir)
    if (cfg.get("rollout") or {}).get("mode") != "async":
        return []
    starved = []
    for r in rows:
        try:
            idle, seconds, step = float(r.get("train_idle_s") or 0), float(r["seconds"]), int(r["step"])
        except (KeyError, TypeError, ValueError):
            continue
        if idle > max(1.0, 0.5 * seconds):
            starved.append((step, idle, seconds))
    steps = {s for s, _, _ in starved}
    took: dict[str, list[float]] = {}
    for span in servers:
        if span.service.startswith("rollout-") and span.attributes.get("url.path") == "/generate" \
                and span.attributes.get("rlhf.step") in steps:
            took.setdefault(span.service, []).append(span.duration_s)
    if not took:
        return []
    mean = {name: sum(d) / len(d) for name, d in took.items()}
    slow = max(mean, key=lambda name: mean[name])
    others = {name: m for name, m in mean.items() if name != slow}
    if others and mean[slow] <= 2 * max(others.values()):
        return []
    first, last = min(steps), max(steps)
    idle = sorted(i for _, i, _ in starved)[len(starved) // 2]
    seconds = sorted(s for _, _, s in starved)[len(starved) // 2]
    beside = ", ".join(f"{m:.2f} s on {name}" for name, m in sorted(others.items())) or "no other server"
    t = _step_end(run_dir, first)
    msg = (f"steps {first}-{last}: the train side waited {idle:.2f} s of each {seconds:.2f} s step for its batch "
           f"(train_idle_s, {len(starved)} of {len(rows)} steps) while /generate took {mean[slow]:.2f} s on {slow} "
           f"against {beside}: {slow} is slow and the trainer starved, with no error (stage rollout)")
    return [Evidence(t, t, "controller-0", slow, "slow_rollout", "rollout", first, msg,
                     f"steps.csv, /generate spans of {slow}", "warning", False)]


def _config_and_steps(run_dir: str) -> tuple[dict, list[dict[str, str]]]:
    """The run's resolved config (config.yaml) and its steps.csv rows; empty when either is missing or unreadable."""
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh) or {}
        with open(os.path.join(run_dir, "steps.csv"), encoding="utf-8") as fh:
            return cfg, list(csv.DictReader(fh))
    except (OSError, yaml.YAMLError, csv.Error):
        return {}, []

