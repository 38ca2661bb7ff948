"""The ranking: evidence grouped by the process it is about, the earliest hypothesis is the root cause (a hard
local cause noticed just after still wins), starvation refines it; the chain, the masked errors, the runner-up."""

from __future__ import annotations

import os
import re
import statistics
from typing import Any

from rlhf import exits
from rlhf.diagnosis.clocks import clock_offsets, on_one_clock
from rlhf.diagnosis.logs import (
    _drift_evidence,
    _log_evidence,
    _starved_evidence,
    _tool_infra_evidence,
    _unfinished_writes,
)
from rlhf.diagnosis.processes import _busy_evidence, _holder_evidence, _life_evidence, _pids, _read_metrics
from rlhf.diagnosis.report import Diagnosis, Evidence, Hypothesis
from rlhf.diagnosis.rules import _NOTICE_LAG_S, _PROC, HARD, PARENT, SOFT, STARVED_CPU_WAIT, STARVED_IO_PRESSURE
from rlhf.diagnosis.spans import (
    _controller_stage_at,
    _never_arrived,
    _peer_of_network_error,
    _refine_stage,
    _route,
    _spans,
    _transit_evidence,
)
from rlhf.tracing.read import SpanRecord


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
    offsets = clock_offsets(logs)
    if offsets:  # a process whose clock is off: what it stamped, read on the controller's clock
        on_one_clock(offsets, logs, metrics, lives, _pids(lives))
    evidence = logs + _life_evidence(lives, metrics, spans)
    evidence += _holder_evidence(evidence, metrics, servers) + _transit_evidence(spans)
    evidence += _unfinished_writes(run_dir, evidence) + _drift_evidence(run_dir, logs) + _starved_evidence(run_dir,
                                                                                                           servers)
    evidence += _tool_infra_evidence(run_dir, logs)
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
    # a process that died, vanished or was killed (SIGKILL at the run's end too) took the spans it had not written
    # yet: their absence there says nothing
    gone = {x.subject for x in evidence if x.kind in ("exit", "vanished")} | {
        life["process"] for life in lives if life["signal"] == "SIGKILL"}
    for e in evidence:
        if e.subject not in gone and _never_arrived(e, servers, metrics):
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
    ranked = [_starvation(_hypothesis(name, evs, pids, spans, window), metrics, surfaced)
              for name, evs in hyps.items()]
    ranked = _cpu_hog(ranked, metrics, surfaced, pids)
    for h in ranked:
        _life_of(h, lives)
    ranked.sort(key=lambda h: (h.category in SOFT, h.time))  # a straggler only when nothing else went wrong
    if not ranked:  # every piece of evidence was a consequence (of a death, of the end): no cause of its own
        return diag
    root = ranked[0]
    for h in ranked[1:]:  # a hard cause noticed just after a softer report about something else still wins
        if h.category in HARD and root.category not in HARD and h.time - root.time <= _NOTICE_LAG_S:
            root = h
            break
    _slow_path(root, logs, pids)
    _unreachable_host(root, logs, lives)
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


def _slow_path(root: Hypothesis, logs: list[Evidence], pids: dict[str, int]) -> None:
    """A timeout that one process reported about a service which answered the others meanwhile (an HTTP status from
    it, in their logs): the reporter's path to it was slow (its own link, as a capped host's), not the service. The
    root becomes the reporter."""
    first = root.evidence[0] if root.evidence else None
    if root.category != "timeout" or first is None or first.reporter == root.process or first.local:
        return
    answered = sorted({e.reporter for e in logs if e.reporter not in (first.reporter, root.process)
                       and re.search(rf"HTTP \d{{3}} from {re.escape(root.process)}\b", e.message)
                       and abs(e.time - first.time) < 60.0})
    if not answered:
        return
    service = root.process
    root.process, root.pid = first.reporter, pids.get(first.reporter)
    root.summary = (f"{first.reporter}'s calls to {service} timed out while {service} answered "
                    f"{', '.join(answered)} meanwhile: {first.reporter}'s path to it was slow (its own link), not "
                    f"{service}. {root.summary}")[:600]


def _unreachable_host(root: Hypothesis, logs: list[Evidence], lives: list[dict[str, Any]]) -> None:
    """A process that hung or did not answer, alive all along, on another host than the controller's, which the
    controller could not reach: the host lost its network (a partition), not the process. The root becomes that
    host, category network, naming every process on it."""
    if root.category not in ("hang", "timeout", "network") or root.exit:
        return
    host_of = {life["process"]: (life.get("host", ""), life.get("host_name", "")) for life in lives}
    here, name = host_of.get(root.process, ("", ""))
    controller = host_of.get("train-0", ("", ""))[0]
    if not here or not controller or here == controller:
        return
    on_it = sorted(p for p, (h, _n) in host_of.items() if h == here)
    silent = [e for e in logs if e.reporter == "controller-0" and any(re.search(
        rf"(?:cannot reach|no reply from) {p}\b(?!-)|\b{p} is in an unknown place|\b{p} \(http[^)]*\) is alive[^;]*"
        r"does not answer", e.message) for p in on_it)]
    if not silent:
        return
    label = f"host {name} ({here})" if name else f"host {here}"
    root.category = "network"
    root.summary = (f"{label} became unreachable: {root.process} kept running there but did not answer the "
                    f"controller on {controller} (a partition, not a dead process; on the host: {', '.join(on_it)}). "
                    f"{root.summary}")[:600]


def _told_to_stop(e: Evidence) -> bool:
    return "received SIG" in e.message


def _hypothesis(name: str, evs: list[Evidence], pids: dict[str, int], spans: list[SpanRecord],
                around: list[Evidence] = ()) -> Hypothesis:
    """`around`: every process's evidence in the window (a dead process's stage from what its peers reported)."""
    if len(evs) > 1 and evs[0].category in SOFT:  # named slow first, then it failed: the failure is what it is about
        evs = [*[e for e in evs if e.category not in SOFT], *[e for e in evs if e.category in SOFT]]
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
    step = next((e.step for e in [decisive, *evs] if e.step >= 0), -1)
    # the stage of the decisive evidence's step: an earlier step's report (a save that failed and was skipped two
    # steps before the process was killed) says nothing of where it is now
    stage = next((e.stage for e in [decisive, *evs] if e.stage and e.stage != "cleanup" and e.step in (step, -1)), "")
    if not stage and decisive.kind in ("exit", "vanished"):  # it died between spans: where its peers noticed
        stage = next((e.stage for e in sorted(around, key=lambda e: e.time) if e.subject != name and e.step == step
                      and e.stage and e.stage != "cleanup" and 0 <= e.time - decisive.onset <= _NOTICE_LAG_S), "")
    if decisive.step_at_least:  # it died idle after its last heartbeat: the peers that noticed at once say which step
        noticed = [e.step for e in evs if e.kind in ("error", "warning") and abs(e.time - decisive.onset) <= _NOTICE_LAG_S]
        step = max([step, *noticed])
    if not stage or step < 0:
        c_stage, c_step = _controller_stage_at(first.onset, spans)
        stage, step = stage or c_stage, step if step >= 0 else c_step
    if death is not None and decisive.category == "process_death" and not name.startswith("train-"):
        # a service's death (env, reward, rollout, scheduler) comes when the run is where the controller is, which
        # its own last heartbeat (an earlier step's work) does not say; in async, the producer's stage is the later
        c_stage, c_step = _controller_stage_at(death.onset, spans)
        if c_step > step and c_stage not in ("", "cleanup"):
            stage, step = c_stage, c_step
    pid = decisive.pid or (death.pid if death is not None else None) or pids.get(name)
    return Hypothesis(name, pid, stage or "?", step, first.onset, decisive.category, decisive.message[:300],
                      decisive.source, evs)


def _life_of(h: Hypothesis, lives: list[dict[str, Any]]) -> None:
    """How the hypothesis's process (its pid) ended, and the pid that took its place when one was started after it
    (a restarted rollout server): the headline names the process that failed, not its successor."""
    mine = [life for life in lives if life["process"] == h.process]
    life = next((life for life in mine if life["pid"] == h.pid), None)
    if life is None:
        return
    if life["end"] is not None and life["exit_code"] not in (None, 0) and life["expected"] is not True:
        h.exit = exits.describe(life["exit_code"])  # it died (a clean exit at the run's end is not news)
    elif life["end"] is None and any(e.kind == "vanished" and e.pid == h.pid for e in h.evidence):
        h.exit = "vanished"
    later = [other for other in mine if other is not life and (other["start"] or 0.0) > (life["start"] or 0.0)]
    if later:
        h.replaced_by = later[0]["pid"]
