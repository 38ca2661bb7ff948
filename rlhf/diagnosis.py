"""Name the root cause of a failed run from what it left behind, never from its fault markers.

    from rlhf.diagnosis import diagnose
    d = diagnose("runs/scenario2")       # d.verdict, d.root, d.chain, d.masked, d.runner_up, d.confidence
    print(d.render())                    # `rlhf diagnose RUN_DIR` prints this and writes diagnosis.json

Evidence read (a real incident has these, and nothing else):

  logs/*.log      ERROR lines, and WARNING lines that report a failure (the fault injector's own
                  lines, logger rlhf.faults, are the answer key and are skipped, as are its end-of-run
                  "never fired" reports)
  exits.jsonl     who started, who ended and how: an exit status with its signal (the scheduler for its
                  jobs, the controller for the scheduler, each rank for itself); a process that started
                  and has no end died where nothing could record it (SIGKILL, the kernel's OOM killer)
  metrics/*.csv   each process's heartbeat: the request or collective it was in, and since when; the
                  last row a process wrote (when it was last alive)
  traces/*.jsonl  server spans: did a request reach its peer, in which stage, at which step

The analysis, in short. Every piece of evidence has a reporter (the process that wrote it) and a
subject (the process it is about: itself for a local cause such as an OOM, the peer it names for a
report such as "HTTP 500 from train-1", "cannot reach rollout-1", "held by train-0"). Evidence about
one subject forms a hypothesis whose onset is its earliest evidence (a timeout's onset is its
deadline minus its wait; a busy process's, when it entered the request it never left). The root
cause is the earliest hypothesis: causes come before their consequences. A hard local cause (a
death, an OOM, a full disk, a hang) noticed up to a second after a softer report still wins, since
the notice lags the event (a death is seen by its parent's next poll, after the peers' disconnects).
A timeout whose request never reached its peer (no server span there, no heartbeat in it) is the
sender's side. Errors after the run had failed (cleanup) are masked: listed, ranked below.
"""

from __future__ import annotations

import csv
import datetime as dt
import glob
import json
import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from rlhf import exits
from rlhf.tracing.read import SpanRecord, load_spans

# CPU or IO starvation refines a timeout or hang: the subject's heartbeat shows it starved meanwhile
CATEGORIES = ("process_death", "oom_device", "oom_host", "disk", "hang", "timeout", "network", "data_mismatch",
              "exception", "cpu_starvation", "io_starvation")
STARVED_CPU_WAIT = 60.0  # % of wall time a process's threads waited runnable for a CPU (run-queue wait)
STARVED_IO_PRESSURE = 10.0  # % of time some task waited for IO (PSI), with a thread of the subject in disk wait
HARD = {"process_death", "oom_device", "oom_host", "disk", "hang"}

_RULES = [  # first match wins; applied to the message and its traceback's last line
    ("process_death", r"killed by SIG|\bdied: |vanished|no exit record"),
    ("oom_device", r"CUDA out of memory|OutOfMemoryError|device[- ]\d+: out of memory|DeviceMemoryNotReleased"),
    ("oom_host", r"\bMemoryError|Cannot allocate memory|bad_alloc"),
    ("disk", r"No space left|ENOSPC|Errno 28|Disk quota|Read-only file system|Input/output error|SafetensorError|"
             r"incomplete metadata|not fully covered|IncompleteCheckpoint|never finished"),
    ("hang", r"SyncStall|has been inside|\bstuck\b|lease lapsed|never left"),
    ("data_mismatch", r"Mismatch|InvalidTensorShape|CorruptPayload|must match the size|has shape|checksum"),
    ("timeout", r"RpcTimeout|timed out|no reply from|within [\d.]+ ?s\b|TimeoutError|HTTP 504|\"incomplete\""),
    ("network", r"cannot reach|Connect call failed|Connection reset|[Ss]erver ?[Dd]isconnected|Connection refused|"
                r"Connection closed by peer|ClientConnector|gaierror|Name or service not known|name resolution|"
                r"RpcConnectionError|Broken pipe|ECONNRESET|ConnectionError"),
]
LOG_LINE = re.compile(  # one line of logs/<role>-<rank>.log
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}) (?P<proc>[a-z]+-\d+) (?P<level>[A-Z]+) "
    r"(?P<logger>[\w.]+): (?P<msg>.*)$")
_PROC = re.compile(r"\b(train|rollout|scheduler|metaserver|controller)-(\d+)\b")
_FAILURE_WARNING = re.compile(r"failed|timed out|not delivered|\bdied\b|lapsed|cannot reach|unreachable|[Ee]rror|^retrying |: migrating |falling back to disk")
_NOT_EVIDENCE = re.compile(r"^first failure of this run|^diagnosis failed|^fault \S+ never fired|^fault audit:|^stopping job|still running|^removed shared-memory|"
                           r"^interrupted ")
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<cls>[A-Z]\w*(?:Error|Exception|Mismatch|Timeout|Stall|Payload|Released|"
                       r"Shape|Exit|Interrupt))\b:? ?(?P<msg>.*)$")
_STAGES = ("weights_update", "events", "rollout", "reward", "reference", "train", "latest_recover_save",
           "periodic_recover_save", "evaluate", "startup", "resume", "cleanup")
_ROUTE_STAGE = [("/generate", "rollout"), ("/update_weights", "weights_update"), ("/upload_weights", "weights_update"),
                ("/weights", "weights_update"), ("/compute_logprobs", "reference"), ("/train_step", "train"),
                ("/save", "latest_recover_save"), ("/load", "resume"), ("/events", "events"),
                ("_memory_occupation", "events"), ("/jobs", "cleanup"), ("/evaluate", "evaluate")]
_STEP = re.compile(r"\b(?:at (?:its )?)?step (\d+)")
_WITHIN = re.compile(r"within ([\d.]+) ?s\b")
PARENT = {"rollout": "scheduler-0", "scheduler": "train-0"}  # a job dies with the scheduler, the scheduler with rank 0
_BUSY_MIN_S = 3.0
_STALE_ROW_S = 1.6  # a heartbeat row older than this (1 Hz sampler) no longer says what a process is doing  # a request or collective entered this long before the failure and never left
_NOTICE_LAG_S = 1.0  # how much later than a report a hard cause may be noticed and still be the cause


@dataclass
class Evidence:
    time: float  # when it was written (a log line's stamp)
    onset: float  # when what it reports began (a timeout: its deadline minus its wait)
    reporter: str  # the process that wrote it
    subject: str  # the process it is about (the reporter for a local cause)
    category: str
    stage: str
    step: int
    message: str
    source: str  # logs/train-1.log:123, exits.jsonl, metrics/train-1.csv:45, span <id>
    kind: str  # error, warning, exit, vanished, busy
    local: bool  # a cause in the subject itself, not a peer's report about it
    pid: int | None = None  # the subject's pid, where the evidence knows it (an exit record)
    step_at_least: bool = False  # step is the last one its heartbeat finished (idle then): a later one may have begun

    def brief(self, t0: float | None = None) -> str:
        at = f"+{self.time - t0:.3f}s" if t0 is not None else _clock(self.time)
        return f"{at} {self.reporter}: {self.message[:200]} [{self.source}]"


@dataclass
class Hypothesis:
    process: str
    pid: int | None
    stage: str
    step: int
    time: float
    category: str
    summary: str
    source: str = ""  # where the deciding evidence is: logs/scheduler-0.log:12, exits.jsonl, metrics/train-1.csv:40
    evidence: list[Evidence] = field(default_factory=list)

    def key(self) -> tuple[str, str, str]:
        return self.process, self.stage, self.category


@dataclass
class Diagnosis:
    run_dir: str
    verdict: str  # failed, finished with errors, no failure, running
    surfaced: Evidence | None = None
    root: Hypothesis | None = None
    runner_up: Hypothesis | None = None
    confidence: float = 0.0
    chain: list[Evidence] = field(default_factory=list)
    masked: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)

    def headline(self) -> str:
        """One line: the root cause (what the run's last console line says)."""
        if self.root is None:
            return f"diagnosis: {self.verdict}; no error in the logs, exit records or heartbeats"
        r = self.root
        where = f"step {r.step}, stage {r.stage}" if r.step >= 0 else f"stage {r.stage}"
        pid = f" (pid {r.pid})" if r.pid else ""
        return f"root cause: {r.process}{pid}, {where}: {r.category}: {r.summary}"

    def to_json(self) -> dict[str, Any]:
        def hyp(h: Hypothesis | None) -> dict[str, Any] | None:
            if h is None:
                return None
            d = asdict(h)
            d["evidence"] = [_ev_json(e) for e in h.evidence[:8]]
            return d

        return {"run_dir": self.run_dir, "verdict": self.verdict, "headline": self.headline(),
                "root_cause": hyp(self.root), "runner_up": hyp(self.runner_up), "confidence": self.confidence,
                "surfaced": _ev_json(self.surfaced) if self.surfaced else None,
                "propagation": [_ev_json(e) for e in self.chain], "masked": self.masked, "stalls": self.stalls}

    def render(self) -> str:
        lines = [f"run: {self.run_dir}", f"verdict: {self.verdict}", self.headline()]
        if self.root is None:
            return "\n".join(lines)
        t0 = self.root.time
        lines.append(f"confidence: {self.confidence:.2f}   deciding evidence: {self.root.source}")
        lines.append("evidence:")
        lines += [f"  {e.brief(t0)}" for e in self.root.evidence[:6]]
        if self.chain:
            lines.append("propagation (root cause → where the run surfaced it):")
            lines += [f"  {e.brief(t0)}  ({e.stage or '?'})" for e in self.chain]
        if self.stalls:
            lines.append("stalls:")
            lines += [f"  {s}" for s in self.stalls]
        if self.masked:
            lines.append("masked (later errors ranked below the root cause):")
            lines += [f"  {m['process']}: {m['message'][:160]} — {m['why']}" for m in self.masked[:8]]
            if len(self.masked) > 8:
                lines.append(f"  … {len(self.masked) - 8} more")
        if self.runner_up is not None:
            u = self.runner_up
            lines.append(f"runner-up: {u.process}, stage {u.stage}: {u.category}: {u.summary[:160]}")
        return "\n".join(lines)


def _ev_json(e: Evidence) -> dict[str, Any]:
    return asdict(e)


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def categorize(text: str) -> str:
    for name, pattern in _RULES:
        if re.search(pattern, text):
            return name
    return "exception"


def stage_of_route(path: str) -> str:
    for prefix, stage in _ROUTE_STAGE:
        if prefix in path:
            return stage
    return ""


def _stage_in(text: str) -> str:
    m = re.search(r"stage ([a-z_]+)", text)
    if m:
        return m.group(1)
    for m in re.finditer(r"(?:POST|GET|DELETE) (/\S+)|https?://[^/\s]+(/[\w/]+)", text):
        if stage_of_route(m.group(1) or m.group(2)):
            return stage_of_route(m.group(1) or m.group(2))
    for stage in _STAGES:
        if re.search(rf"\b{stage}\b(?!-\d)", text):
            return stage
    return ""


def _subject(reporter: str, msg: str) -> tuple[str, bool]:
    """The process a message is about, and whether it is the reporter's own (local) failure."""
    body = re.sub(rf"^{re.escape(reporter)}: ", "", msg)  # a handler's "train-1: POST /x failed" names itself
    m = re.search(r"'have': \[([^\]]*)\], 'expected': (\d+)|\"have\": \[([^\]]*)\], \"expected\": (\d+)", body)
    if m:  # the MetaServer's 504: a rank's shards never arrived
        have = set(re.findall(r"rank(\d+)", m.group(1) or m.group(3) or ""))
        missing = [r for r in range(int(m.group(2) or m.group(4))) if str(r) not in have]
        if missing:
            return f"train-{missing[0]}", False
    m = re.search(r"while ([a-z]+-\d+) is in ", body)  # the stall watchdog names the rank that is elsewhere
    if m:
        return m.group(1), False
    for m in _PROC.finditer(body):
        name = m.group(0)
        if name != reporter and not (reporter == "controller-0" and name == "train-0" and "held by" in body):
            return name, False
    return reporter, True


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


def _last_span(spans: list[SpanRecord], pid: int | None) -> SpanRecord | None:
    """The last span a process exported (any of its roles): a dead process was alive when it ended."""
    mine = [s for s in spans if pid and str(s.resource.get("process.pid")) == str(pid)]
    return max(mine, key=lambda s: s.end_ns) if mine else None


def _life_evidence(lives: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]],
                   spans: list[SpanRecord]) -> list[Evidence]:
    """Deaths from exit statuses, and processes that vanished without one."""
    out = []
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
            span = _last_span(spans, pid)
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
        out.append(Evidence(life["end"], onset, life["by"], name, category, _activity_stage(last_row),
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


def _transit_evidence(spans: list[SpanRecord]) -> list[Evidence]:
    """A reply whose tensors arrived in other shapes than its sender's span says they left: changed in transit."""
    sent = {s.parent_id: s for s in spans if s.kind == "server" and s.attributes.get("rlhf.reply_shapes")}
    out = []
    for c in spans:
        got = c.attributes.get("rlhf.reply_shapes")
        server = sent.get(c.span_id)
        if c.kind != "client" or not got or server is None or server.attributes["rlhf.reply_shapes"] == got:
            continue
        t = c.end_ns / 1e9
        step = int(c.attributes.get("rlhf.step", -1))
        out.append(Evidence(t, t, c.service, server.service, "data_mismatch", str(c.attributes.get("rlhf.stage") or ""),
                            step, f"the reply of {server.service} to {c.name} changed in transit: sent "
                            f"{server.attributes['rlhf.reply_shapes']}, arrived {got}",
                            f"span {c.span_id} ({c.service}) / {server.span_id} ({server.service})", "span", True))
    return out


def _route(message: str) -> str:
    m = re.search(r"(?:POST|GET|DELETE) (/\S+)", message)
    return m.group(0) if m else ""


def _int(value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0


def _spans(run_dir: str) -> list[SpanRecord]:
    try:
        return load_spans(run_dir).spans
    except FileNotFoundError:
        return []


def _never_arrived(e: Evidence, servers: list[SpanRecord], metrics: dict[str, list[dict[str, Any]]]) -> bool:
    """A timeout report whose request left no trace at its peer: no server span, no heartbeat in it."""
    m = re.search(r"\((?:https?://[^/\s]+)?(/[\w/]+)", e.message)
    if e.category != "timeout" or e.local or m is None or not re.search(
            rf"no reply from {re.escape(e.subject)}\b|{re.escape(e.subject)} timed out", e.message):
        return False  # only a request sent to the subject itself can have failed to reach it
    path = m.group(1)
    lo, hi = e.onset - 0.1, e.time - 0.01  # while the request was outstanding (a retry comes after it)
    for s in servers:
        if s.service == e.subject and s.attributes.get("url.path") == path and s.start_ns / 1e9 <= hi \
                and s.end_ns / 1e9 >= lo and (e.step < 0 or s.attributes.get("rlhf.step") in (None, e.step)):
            return False
    for row in metrics.get(e.subject, []):
        if lo <= row["_time"] <= hi and path in row.get("activity", ""):
            return False
    return bool(metrics.get(e.subject)) or any(s.service == e.subject for s in servers)


def _refine_stage(e: Evidence, servers: list[SpanRecord]) -> None:
    """A handler's error line: the server span of that request says the stage the caller was in."""
    m = re.search(r"(?:POST|GET|DELETE) (/\S+) failed", e.message)
    if m is None:
        return
    for s in servers:
        if s.service == e.reporter and s.attributes.get("url.path") == m.group(1) and \
                abs(s.end_ns / 1e9 - e.time) < 0.5 and s.attributes.get("rlhf.stage"):
            e.stage = str(s.attributes["rlhf.stage"])
            return


def _peer_of_network_error(e: Evidence, spans: list[SpanRecord]) -> None:
    """A connection error that names no peer ("Server disconnected"): the failed client span says which it was."""
    if e.category != "network" or not e.local:
        return
    for s in spans:
        peer = s.attributes.get("rlhf.peer")
        if s.kind == "client" and s.error and s.service == e.reporter and peer and peer != e.reporter \
                and abs(s.end_ns / 1e9 - e.time) < 0.5:
            e.subject, e.local = str(peer), False
            e.message += f" [its failed call: {s.name} → {peer}]"
            return


def _controller_stage_at(t: float, spans: list[SpanRecord]) -> tuple[str, int]:
    """The controller's stage and step at time t, from its stage spans."""
    best: tuple[float, str, int] = (0.0, "", -1)
    for s in spans:
        if s.service != "controller-0" or s.kind != "internal" or s.name not in _STAGES:
            continue
        start, end = s.start_ns / 1e9, s.end_ns / 1e9
        if start <= t <= end + 0.05 and start > best[0]:
            best = (start, s.name, int(s.attributes.get("rlhf.step", -1)))
    return best[1], best[2]


def _pids(lives: list[dict[str, Any]]) -> dict[str, int]:
    pids = {life["process"]: life["pid"] for life in lives}
    if "train-0" in pids:  # rank 0's process is also the controller and hosts the MetaServer
        pids.setdefault("controller-0", pids["train-0"])
        pids.setdefault("metaserver-0", pids["train-0"])
    return pids


def diagnose(run_dir: str) -> Diagnosis:
    run_dir = os.path.abspath(run_dir)
    logs = _log_evidence(run_dir)
    metrics = _read_metrics(run_dir)
    spans = _spans(run_dir)
    servers = [s for s in spans if s.kind == "server"]
    for e in logs:
        _refine_stage(e, servers)
        _peer_of_network_error(e, spans)
    failed = [e for e in logs if e.reporter == "controller-0" and e.message.startswith("run failed")]
    surfaced = failed[-1] if failed else None
    lives = exits.all_lives(run_dir)
    evidence = logs + _life_evidence(lives, metrics, spans)
    evidence += _holder_evidence(evidence, metrics, servers) + _transit_evidence(spans)
    evidence += _unfinished_writes(run_dir, evidence)
    finished = os.path.exists(os.path.join(run_dir, "summary.json"))
    if surfaced is None:
        deaths = [e for e in evidence if e.kind in ("exit", "vanished")]
        surfaced = deaths[-1] if deaths and not finished else None
    if surfaced is not None:
        dead = {e.subject for e in evidence if e.kind in ("exit", "vanished") and e.onset <= surfaced.time}
        busy = _busy_evidence(metrics, surfaced, dead)
        # a process that logged the failure of that request has left it: its heartbeat row is older than its error
        busy = [b for b in busy if not any(
            e.reporter == b.reporter and e.time >= b.onset and _route(b.message) and _route(b.message) in e.message
            for e in logs)]
        stall_reports = [e for e in logs if e.category == "hang" and not e.local]
        for b in busy:  # a watchdog named who the waiter in a collective waits for: the waiter is its victim
            for r in stall_reports:
                if b.category == "hang" and b.subject != r.subject and re.search(rf"\b{b.subject}\b(?!-)", r.message):
                    b.message = f"{r.subject} is missing from what {b.subject} waits in: {b.message}"
                    b.subject, b.local = r.subject, False
                elif b.subject == r.subject and b.category == "timeout":  # the watchdog saw it blocked: a hang
                    b.category = "hang"
        evidence += busy
    for e in evidence:
        if _never_arrived(e, servers, metrics):
            e.subject, e.local = e.reporter, True
            e.message += f" [the request left no trace at {_PROC.search(e.message).group(0) if _PROC.search(e.message) else 'its peer'}: it never arrived]"  # noqa: E501
    verdict = "failed" if surfaced is not None else ("finished with errors" if evidence and finished else
                                                        ("no failure" if not evidence else "failed"))
    diag = Diagnosis(run_dir, verdict, surfaced)
    if not evidence:
        return diag
    limit = surfaced.time + _NOTICE_LAG_S if surfaced is not None else float("inf")
    # what was written after the run had failed (its cleanup, consequences) is masked, however early its onset
    # a death counts from when it was last seen alive: its parent may notice it seconds later (a lease poll)
    window = [e for e in evidence if (e.onset if e.kind in ("exit", "vanished") else e.time) <= limit
              and not e.message.startswith("cleanup")]
    in_window = {id(e) for e in window}
    later = [e for e in evidence if id(e) not in in_window]
    dead = {e.subject for e in window if e.kind in ("exit", "vanished") and not _told_to_stop(e)}
    orphans = [e for e in window if e.kind in ("exit", "vanished") and PARENT.get(e.subject.split("-")[0]) in dead]
    orphan_ids = {id(e) for e in orphans}
    window = [e for e in window if id(e) not in orphan_ids]  # they died with their parent (PDEATHSIG): a consequence
    hyps: dict[str, list[Evidence]] = {}
    for e in sorted(window, key=lambda e: (e.onset, e.time, e.reporter != e.subject)):  # its own evidence first
        hyps.setdefault(e.subject, []).append(e)
    pids = _pids(lives)
    ranked = [_starvation(_hypothesis(name, evs, pids, spans), metrics, surfaced) for name, evs in hyps.items()]
    ranked = _cpu_hog(ranked, metrics, surfaced, pids)
    ranked.sort(key=lambda h: h.time)
    root = ranked[0]
    for h in ranked[1:]:  # a hard cause noticed just after a softer report about something else still wins
        if h.category in HARD and root.category not in HARD and h.time - root.time <= _NOTICE_LAG_S:
            root = h
            break
    others = [h for h in ranked if h is not root]
    diag.root = root
    diag.runner_up = others[0] if others else None
    gap = (diag.runner_up.time - root.time) if diag.runner_up else float("inf")
    local = any(e.local for e in root.evidence)
    diag.confidence = round(min(0.95, 0.5 + (0.25 if local else 0.0) + (0.2 if gap > 0.5 else 0.1 * gap / 0.5)
                                + (0.05 if root.category in HARD else 0.0)), 2)
    # propagation: the root's first evidence, each later process's first evidence, the surfaced error
    seen: set[str] = set()
    chain = [root.evidence[0]]
    for e in sorted(window, key=lambda e: e.time):
        if e is root.evidence[0] or e.reporter in seen or e.time < root.time or e is surfaced:
            continue
        if e.subject == root.process or e.reporter != root.process:
            chain.append(e)
            seen.add(e.reporter)
    if surfaced is not None and surfaced not in chain:
        chain.append(surfaced)
    diag.chain = chain[:10]
    for h in others:
        diag.masked.append({"process": h.process, "message": h.evidence[0].message, "time": h.time,
                            "category": h.category,
                            "why": f"{h.time - root.time:+.3f} s after the root cause"
                                   + (f"; it names {root.process}" if any(e.subject == root.process for e in h.evidence)
                                      else "")})
    for e in orphans:
        diag.masked.append({"process": e.subject, "message": e.message, "time": e.time, "category": e.category,
                            "why": f"it died with its parent {PARENT[e.subject.split('-')[0]]} (PDEATHSIG)"})
    for e in later:
        diag.masked.append({"process": e.reporter, "message": e.message, "time": e.time, "category": e.category,
                            "why": "after the run had already failed (cleanup or a consequence)"})
    diag.stalls = [e.message for e in evidence if e.kind == "busy"]
    return diag


def _num(row: dict[str, Any], key: str) -> float:
    try:
        return float(row.get(key) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _starvation(h: Hypothesis, metrics: dict[str, list[dict[str, Any]]], surfaced: Evidence | None) -> Hypothesis:
    """A timeout or hang whose process was starved meanwhile: its heartbeat rows from the onset to the failure
    show its threads waiting for a CPU most of the time, or for a disk under IO pressure."""
    if h.category not in ("timeout", "hang") or surfaced is None:
        return h
    rows = [r for r in metrics.get(h.process, []) if h.time <= r["_time"] <= surfaced.time + 1.0]
    if not rows:
        return h
    wait = statistics.median(_num(r, "cpu_wait_percent") for r in rows)
    io = statistics.median(_num(r, "io_pressure_percent") for r in rows)
    disk = statistics.median(_num(r, "disk_wait_threads") for r in rows)
    row = rows[len(rows) // 2]
    where = f"metrics/{h.process}.csv:{row['_line']}"
    if wait >= STARVED_CPU_WAIT:
        children = statistics.median(_num(r, "children_cpu_percent") for r in rows)
        h.category, h.source = "cpu_starvation", where
        h.summary = (f"{h.process} was starved of CPU: its threads waited for a CPU {wait:.0f}% of the time "
                     f"(run-queue wait, median of {len(rows)} heartbeats; system CPU "
                     f"{statistics.median(_num(r, 'system_cpu_percent') for r in rows):.0f}%"
                     + (f", its child processes {children:.0f}%" if children >= 50 else "") + f"): {h.summary}")[:300]
    elif disk >= 1 and io >= STARVED_IO_PRESSURE:
        h.category, h.source = "io_starvation", where
        h.summary = (f"{h.process} was starved of IO: a thread of it waited on the disk in most heartbeats while "
                     f"some task waited for IO {io:.0f}% of the time (PSI): {h.summary}")[:300]
    return h


def _cpu_hog(ranked: list[Hypothesis], metrics: dict[str, list[dict[str, Any]]], surfaced: Evidence | None,
             pids: dict[str, int]) -> list[Hypothesis]:
    """Processes starved of CPU are victims of the process whose children burnt the CPU meanwhile (a worker pool,
    a compiler, a burner): that process, when there is one, is the root cause."""
    starved = [h for h in ranked if h.category == "cpu_starvation"]
    if not starved or surfaced is None:
        return ranked
    start = min(h.time for h in starved)
    best: tuple[float, str, dict[str, Any] | None] = (0.0, "", None)
    for name, rows in metrics.items():
        window = [r for r in rows if start - 1.0 <= r["_time"] <= surfaced.time + 1.0]
        if window:
            burnt = statistics.median(_num(r, "children_cpu_percent") for r in window)
            if burnt > best[0]:
                best = (burnt, name, window[len(window) // 2])
    burnt, name, row = best
    if burnt < 50 or row is None:
        return ranked
    hog = next((h for h in ranked if h.process == name), None)
    if hog is None:
        hog = Hypothesis(name, pids.get(name), starved[0].stage, starved[0].step, start, "cpu_starvation", "")
        ranked.append(hog)
    victims = ", ".join(h.process for h in starved if h is not hog) or name
    hog.category, hog.time, hog.source = "cpu_starvation", min(hog.time, start) - 1e-3, f"metrics/{name}.csv:{row['_line']}"
    hog.summary = (f"the child processes of {name} used {burnt:.0f}% CPU (median of its heartbeats from the first "
                   f"starved request to the failure) while {victims} waited for a CPU: {name} starved them")[:300]
    hog.evidence.insert(0, Evidence(row["_time"], hog.time, name, name, "cpu_starvation", hog.stage, hog.step,
                                    hog.summary, hog.source, "metrics", True, hog.pid))
    return ranked


def _told_to_stop(e: Evidence) -> bool:
    return "received SIG" in e.message


def _hypothesis(name: str, evs: list[Evidence], pids: dict[str, int], spans: list[SpanRecord]) -> Hypothesis:
    first = evs[0]
    decisive = first
    for e in evs:  # a hard local cause noticed a little later is what the earlier reports were about
        if e.category in HARD and e.onset - first.onset <= _NOTICE_LAG_S and decisive.category not in HARD:
            decisive = e
    unfinished = next((e for e in evs if e.kind == "unfinished"), None)
    if unfinished is not None:  # the write that left the broken checkpoint is what the failure is about
        decisive = first = unfinished
    death = next((e for e in evs if e.kind in ("exit", "vanished")), None)
    if death is not None and decisive.category in ("network", "timeout") and not decisive.local:
        decisive = death  # peers could not reach a process that died: its death is what they saw
    stage = next((e.stage for e in [decisive, *evs] if e.stage and e.stage != "cleanup"), "")
    step = next((e.step for e in [decisive, *evs] if e.step >= 0), -1)
    if decisive.step_at_least:  # it died idle after its last heartbeat: the peers that noticed at once say which step
        noticed = [e.step for e in evs if e.kind in ("error", "warning") and abs(e.time - decisive.onset) <= _NOTICE_LAG_S]
        step = max([step, *noticed])
    if not stage or step < 0:
        c_stage, c_step = _controller_stage_at(first.onset, spans)
        stage, step = stage or c_stage, step if step >= 0 else c_step
    return Hypothesis(name, decisive.pid or pids.get(name), stage or "?", step, first.onset, decisive.category, decisive.message[:300],
                      decisive.source, evs)


def write(diag: Diagnosis) -> str:
    path = os.path.join(diag.run_dir, "diagnosis.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(diag.to_json(), fh, indent=2, default=str)
    os.replace(tmp, path)
    return path


def diagnose_main(argv: list[str] | None = None, prog: str = "rlhf diagnose") -> int:
    """`rlhf diagnose RUN_DIR [--json]`: exit 0 when the run had no failure, 1 when it names a root cause."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=(
        "Name the root cause of a failed run from its run directory alone: logs, exit records (exits.jsonl), "
        "heartbeats (metrics/*.csv) and traces; never the fault markers. Prints the root cause (process, pid, "
        "stage, step, category, evidence with file:line), the propagation chain, masked later errors, stalled "
        "requests and a runner-up; writes RUN_DIR/diagnosis.json."))
    parser.add_argument("run_dir", help="a run directory (runs/<time> or --run-dir of the run)")
    parser.add_argument("--json", action="store_true", help="print diagnosis.json instead of the text")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.run_dir, "logs")):
        parser.error(f"{args.run_dir} is not a run directory (it has no logs/ folder)")
    diag = diagnose(args.run_dir)
    path = write(diag)
    print(json.dumps(diag.to_json(), indent=2, default=str) if args.json else diag.render())
    if not args.json:
        print(f"(written to {path})")
    return 1 if diag.root is not None and diag.verdict != "finished with errors" else 0
