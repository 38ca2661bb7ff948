"""Evidence from exit records and heartbeats: deaths (with their status, or vanished with none), requests and
collectives a process entered and never left, device memory a process held when another's allocation failed."""

from __future__ import annotations

import csv
import glob
import os
from typing import Any

import psutil

from rlhf import exits
from rlhf.diagnosis.report import Evidence, _clock
from rlhf.diagnosis.rules import _BUSY_MIN_S, _NOTICE_LAG_S, _STALE_ROW_S, stage_of_route
from rlhf.diagnosis.spans import _int
from rlhf.tracing.read import SpanRecord


def _read_metrics(run_dir: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics", "*.csv"))):
        name = os.path.basename(path)[:-4]
        rows = []
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh), 2):
                try:
                    row["_time"], row["_line"] = float(row["time"]), i
                except (TypeError, ValueError):
                    continue
                rows.append(row)
        out[name] = rows
    return out


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _last_spans(spans: list[SpanRecord]) -> dict[str, SpanRecord]:
    """The last span each process exported (any of its roles), by pid: a dead process was alive when it ended. One
    pass over the spans (a big world has thousands of processes)."""
    last: dict[str, SpanRecord] = {}
    for s in spans:
        pid = str(s.resource.get("process.pid"))
        if pid not in last or s.end_ns > last[pid].end_ns:
            last[pid] = s
    return last


def _life_evidence(lives: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]],
                   spans: list[SpanRecord]) -> list[Evidence]:
    """Deaths from exit statuses, and processes that vanished without one."""
    out = []
    last_spans = _last_spans(spans)
    for life in lives:
        name, pid = life["process"], life["pid"]
        rows = [r for r in metrics.get(name, []) if str(r.get("pid")) == str(pid)]
        last_row = rows[-1] if rows else None
        if life["end"] is None:
            if _pid_alive(pid):
                continue
            t = (last_row["_time"] if last_row else life["start"] or 0.0)
            what = f"{name} (pid {pid}) vanished with no exit record: killed by SIGKILL or the kernel's OOM killer"
            stage, step = _activity_stage(last_row), _activity_step(last_row)
            if last_row is not None:
                what += f"; last heartbeat {last_row.get('activity', '?')} at step {last_row.get('activity_step', '?')}"
            span = last_spans.get(str(pid)) if pid else None
            if span is not None and span.end_ns / 1e9 > t:  # spans go out at each stage's end, heartbeats every second
                t = span.end_ns / 1e9
                step = int(span.attributes.get("rlhf.step", step))
                what += (f"; its last span: {span.name} (step {step}, stage "
                         f"{span.attributes.get('rlhf.stage') or '?'})")
                # it died after that span, in a later stage: the stage comes from its peers' reports (a request
                # to it that failed), or the controller's stage at that moment
                stage = ""
            out.append(Evidence(t, t, name, name, "process_death", stage, step,
                                what, "exits.jsonl (no exit record)", "vanished", True, pid))
            out[-1].time = t + _NOTICE_LAG_S  # dead at most a heartbeat after its last row
            continue
        code, sig = life["exit_code"], life["signal"]
        reason = life.get("reason", "")
        unexpected = life["expected"] is False
        if not unexpected:
            continue
        if not sig and life["by"] == name and not reason.startswith("received SIGTERM"):
            continue  # a rank that failed with an exception: its log says why
        what = f"{name} (pid {pid}) {exits.describe(code)}" + (f" ({reason})" if reason else "") + f", seen by {life['by']}"
        category = "process_death"
        onset = min(life["end"], last_row["_time"] + _NOTICE_LAG_S) if last_row else life["end"]  # last seen alive
        stage = _activity_stage(last_row)
        span = last_spans.get(str(pid)) if pid else None
        if last_row is not None and span is not None and span.end_ns / 1e9 > last_row["_time"]:
            stage = ""  # its heartbeat's request had ended: it died in a later one, named by its peers' reports
        out.append(Evidence(life["end"], onset, life["by"], name, category, stage,
                            _activity_step(last_row), what, f"exits.jsonl ({name} pid {pid})", "exit", True, pid,
                            step_at_least=bool(last_row) and last_row.get("activity") == "idle"))
    return out


def _activity_stage(row: dict[str, Any] | None) -> str:
    return stage_of_route(row.get("activity", "")) if row else ""


def _activity_step(row: dict[str, Any] | None) -> int:
    try:
        return int(row["activity_step"]) if row else -1
    except (TypeError, ValueError):
        return -1


def _busy_evidence(metrics: dict[str, list[dict[str, Any]]], surfaced: Evidence, dead: set[str]) -> list[Evidence]:
    """Processes that were inside a request or collective long before the failure and had not left it.

    Only live ones with a heartbeat row from around the failure: a dead process's last row is stale."""
    out = []
    at = surfaced.time
    for name, rows in metrics.items():
        before = [r for r in rows if r["_time"] <= at + 0.5]
        if not before or name in dead or at - before[-1]["_time"] > _STALE_ROW_S:
            continue
        row = before[-1]
        activity = row.get("activity", "")
        if not (activity.startswith(("POST /", "GET /")) or "all_reduce" in activity or "broadcast" in activity):
            continue
        if activity.endswith("/manifest"):
            # the MetaServer's long poll for a version's shards waits on the uploaders by design (a victim, not a
            # stall). It no longer writes rank 0's heartbeat (Service.waits); runs recorded before that can show it
            # there, where it outranked the slow uploader it waits for
            continue
        try:
            age = float(row.get("activity_age_s") or 0.0) + max(0.0, at - row["_time"])
        except ValueError:
            continue
        if age < _BUSY_MIN_S:
            continue
        subject = "metaserver-0" if "/weights" in activity and name == "train-0" else name
        since = at - age
        kind_cat = "hang" if "all_reduce" in activity or "broadcast" in activity else "timeout"
        stage = stage_of_route(activity)
        if surfaced.subject == subject and surfaced.stage:
            stage = surfaced.stage  # the failure names this process: its stage is the caller's (a periodic save)
        out.append(Evidence(at, since, name, subject, kind_cat, stage, _activity_step(row),
                            f"{subject} was still in {activity} (step {_activity_step(row)}) {age:.1f} s after "
                            f"entering it when the run failed", f"metrics/{name}.csv:{row['_line']}", "busy", True))
    # ranks waiting inside a collective are its victims; a rank busy in the same step but not inside it is missing
    inside = [e for e in out if e.category == "hang" and e.reporter.startswith("train-")]
    for e in out:
        if inside and e.category != "hang" and e.reporter.startswith("train-") and e.step == inside[0].step:
            what = inside[0].message.split(" was still in ", 1)[1].split(" (step", 1)[0]
            e.category = "hang"
            e.message = (f"{e.subject} is missing from {what} (step {e.step}): "
                         f"{', '.join(i.subject for i in inside)} waited inside it; {e.subject} was still in "
                         f"{e.message.split(' was still in ', 1)[1]}")
            for i in inside:  # a victim: its evidence now points at the missing rank
                i.subject, i.local, i.onset = e.subject, False, max(i.onset, e.onset)
    return out


def _holder_evidence(evidence: list[Evidence], metrics: dict[str, list[dict[str, Any]]],
                     servers: list[SpanRecord]) -> list[Evidence]:
    """A device OOM "reserved by another process": the process whose heartbeat shows it holding device memory."""
    out: list[Evidence] = []
    ooms = [e for e in evidence if e.category == "oom_device" and "another process" in e.message]
    if not ooms:
        return out
    at = ooms[0].time
    held = [s for s in servers if float(s.attributes.get("rlhf.device_mb_held", 0) or 0) > 0
            and s.service != ooms[0].reporter and s.end_ns / 1e9 <= at]
    if held:  # a release whose process still held device memory after it (the release's own span says so)
        s = max(held, key=lambda x: (float(x.attributes["rlhf.device_mb_held"]), -x.end_ns))  # the biggest, first
        t, stage, step = s.end_ns / 1e9, str(s.attributes.get("rlhf.stage") or ""), int(s.attributes.get("rlhf.step", -1))
        return [Evidence(t, t, s.service, s.service, "oom_device", stage, step,
                         f"{s.service} still held {float(s.attributes['rlhf.device_mb_held']):.0f} MB of device memory "
                         f"after its {s.name} (step {step}, stage {stage}): the memory {ooms[0].reporter}'s allocation "
                         f"could not get", f"span {s.span_id} ({s.service})", "memory", True)]
    best: tuple[int, str, dict[str, Any] | None] = (0, "", None)
    for name, rows in metrics.items():
        if name == ooms[0].reporter:
            continue
        held = [r for r in rows if r["_time"] <= at + 0.5 and _int(r.get("device_mem_process_bytes")) > 0]
        if held and _int(held[-1].get("device_mem_process_bytes")) > best[0]:
            first = held[0]
            for r in reversed(held):  # the start of the run of rows that hold it
                first = r
                prev = [x for x in rows if x["_time"] < r["_time"]]
                if not prev or _int(prev[-1].get("device_mem_process_bytes")) == 0:
                    break
            best = (_int(held[-1].get("device_mem_process_bytes")), name, first)
    mb, name, row = best
    if row is None:
        return out
    since = row["_time"]
    before = [s for s in servers if s.service == name and s.start_ns / 1e9 <= since]
    last = max(before, key=lambda s: s.start_ns) if before else None
    stage = str(last.attributes.get("rlhf.stage") or "") if last else ""
    step = int(last.attributes.get("rlhf.step", -1)) if last else -1
    after = f" after its {last.name} (step {step}, stage {stage})" if last else ""
    out.append(Evidence(since, since - 1.0, name, name, "oom_device", stage, step,
                        f"{name} held {mb / 2**20:.0f} MB of device memory from {_clock(since)}{after}: the memory "
                        f"{ooms[0].reporter}'s allocation could not get", f"metrics/{name}.csv:{row['_line']}",
                        "memory", True))
    return out


def _pids(lives: list[dict[str, Any]]) -> dict[str, int]:
    pids = {life["process"]: life["pid"] for life in lives}
    if "train-0" in pids:  # rank 0's process is also the controller and hosts the MetaServer
        pids.setdefault("controller-0", pids["train-0"])
        pids.setdefault("metaserver-0", pids["train-0"])
    return pids
