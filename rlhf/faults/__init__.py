"""Fault points and their lifecycle: arm → trigger → verify → record → restore (docs/faults.md).

Call sites are one line:

    fault_point("train.step", step=step)                       # synchronous code
    await afault_point("rpc.client.send", peer=self.peer)      # on an event loop (delays await)

Disarmed (no fault file, or none for this process) that line is a global read and a compare.
Each process arms the run's faults once at start (`arm`); a fault fires where its point glob,
target (role/rank/peer) and `when` match. Every injection is recorded three ways: a span event
(`fault.inject` with rlhf.fault.*), a line in <run-dir>/faults/markers.jsonl, and a WARNING in
the process log. Restore happens at the end of `duration_s`, at process exit, and, for what a
dead process leaves behind (fill files, writer processes), in the survivor's leftover `audit`.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from rlhf import tracing
from rlhf.faults.kinds import KINDS, FaultKind, Hit
from rlhf.faults.parse import load_fault_file, parse_fault_dicts, parse_faults_text
from rlhf.faults.points import POINTS
from rlhf.faults.spec import FaultSpec, FaultSpecError, peer_matches

log = logging.getLogger("rlhf.faults")

__all__ = ["FaultSpec", "FaultSpecError", "KINDS", "POINTS", "afault_effects", "afault_point", "arm", "audit", "disarm",
           "fault_point", "load_fault_file", "parse_fault_dicts", "parse_faults_text", "restore_all"]


@dataclass
class Armed:
    spec: FaultSpec
    kind: FaultKind
    armed_at: float = field(default_factory=time.monotonic)
    triggers: int = 0
    rng: random.Random = field(default_factory=random.Random)
    lock: threading.Lock = field(default_factory=threading.Lock)
    timer: threading.Timer | None = None
    # hits of this fault in earlier processes of the run (a restarted or resumed world, a restarted rollout
    # server): (role, rank) -> the steps they fired at. A step replayed after a restart runs clean, and
    # max_hits counts the run's hits, not the process's.
    earlier: dict[tuple[str, int], list[int | None]] = field(default_factory=dict)


_ARMED: dict[str, list[Armed]] | None = None  # point → faults armed there; None = nothing armed
_ALL: list[Armed] = []
_RUN_DIR = ""


# ---------------------------------------------------------------------------- the hot path


_NONE: tuple = ()


def fault_point(point: str, step: int | None = None, peer: str = "", **context: Any) -> tuple | list:
    """Synchronous fault point. Costs a global read when nothing is armed.

    Returns the fired faults' directives (e.g. a server told to reset the connection); usually ignored.
    """
    if _ARMED is None:
        return _NONE
    faults = _ARMED.get(point)
    if not faults:
        return _NONE
    return [_fire(armed, hit) for armed, hit in _due(point, faults, step, peer, context)]


async def afault_point(point: str, step: int | None = None, peer: str = "", **context: Any) -> tuple | list:
    """Fault point on an event loop: delays and hangs await instead of blocking the loop."""
    if _ARMED is None:
        return _NONE
    faults = _ARMED.get(point)
    if not faults:
        return _NONE
    return [await _afire(armed, hit) for armed, hit in _due(point, faults, step, peer, context)]


async def afault_effects(point: str, step: int | None = None, peer: str = "", **context: Any) -> list:
    """afault_point for the transport: fire, then return the TransportEffects of the faults that fired."""
    if _ARMED is None:
        return []
    faults = _ARMED.get(point)
    if not faults:
        return []
    effects = []
    for armed, hit in _due(point, faults, step, peer, context):
        await _afire(armed, hit)
        effect = armed.kind.transport_effect(hit)
        if effect is not None:
            effects.append(effect)
    return effects


def _due(point: str, faults: list[Armed], step: int | None, peer: str, context: dict) -> list[tuple[Armed, Hit]]:
    role, rank = tracing.whoami()
    if step is None:
        step = tracing.current_step()
    due = []
    for armed in faults:
        spec, when = armed.spec, armed.spec.when
        if not spec.target.matches(role, rank) or not peer_matches(spec.target.peer, peer):
            continue
        if when.steps and step not in when.steps:
            continue
        if when.after_s and time.monotonic() - armed.armed_at < when.after_s:
            continue
        before = armed.earlier.get((role, rank), ())
        if before and step in before:
            continue  # this step's fault already happened in this run, before a restart
        with armed.lock:
            if when.max_hits and armed.triggers + len(before) >= when.max_hits:
                continue
            if armed.kind.BACKGROUND and armed.kind.active:
                continue
            if when.probability < 1.0 and armed.rng.random() >= when.probability:
                continue
            armed.triggers += 1
        due.append((armed, Hit(point, role, rank, step, peer, context)))
    return due


# ---------------------------------------------------------------------------- firing


def _fire(armed: Armed, hit: Hit) -> dict[str, Any]:
    _record("inject", armed, hit, {})
    details = armed.kind.inject(hit)  # may sleep, raise, hang or kill: the marker is already written
    _after(armed, hit, details)
    return details


async def _afire(armed: Armed, hit: Hit) -> dict[str, Any]:
    _record("inject", armed, hit, {})
    details = await armed.kind.ainject(hit)
    _after(armed, hit, details)
    return details


def _after(armed: Armed, hit: Hit, details: dict[str, Any]) -> None:
    if armed.kind.BACKGROUND:  # measuring a background effect takes a moment: not on the faulted path
        ctx = contextvars.copy_context()
        threading.Thread(target=ctx.run, args=(_verify, armed, hit, details), name="fault-verify", daemon=True).start()
    else:
        _verify(armed, hit, details)
    if armed.kind.BACKGROUND and armed.spec.duration_s > 0:
        armed.timer = threading.Timer(armed.spec.duration_s, _restore, args=(armed, "duration ended"))
        armed.timer.daemon = True
        armed.timer.start()


def _verify(armed: Armed, hit: Hit, details: dict[str, Any]) -> None:
    evidence = {**(details or {}), **armed.kind.verify()}
    _record("verify", armed, hit, {**evidence, **armed.kind.resources()})


def _restore(armed: Armed, reason: str) -> None:
    with armed.lock:
        if not armed.kind.active:
            return
        if armed.timer is not None:
            armed.timer.cancel()
        details = armed.kind.restore()
    role, rank = tracing.whoami()
    _record("restore", armed, Hit(armed.spec.point, role, rank), {"reason": reason, **(details or {})})


def _record(event: str, armed: Armed, hit: Hit, details: dict[str, Any]) -> None:
    spec = armed.spec
    marker = {"time": time.time(), "event": event, "fault": spec.name, "kind": spec.kind, "point": hit.point,
              "spec_point": spec.point, "target": spec.target.describe(), "role": hit.role, "rank": hit.rank,
              "peer": hit.peer, "step": hit.step, "pid": os.getpid(), "emulated": armed.kind.EMULATED,
              "details": details}
    context = {k: v for k, v in hit.context.items() if isinstance(v, (str, int, float, bool))}
    if context:
        marker["context"] = context  # e.g. the file being written, the stage a request belongs to
    if _RUN_DIR:
        path = os.path.join(_RUN_DIR, "faults", "markers.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        line = json.dumps(marker, default=str) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write per line: lines from several processes never interleave
        finally:
            os.close(fd)
    attrs = {"rlhf.fault.name": spec.name, "rlhf.fault.kind": spec.kind, "rlhf.fault.point": hit.point,
             "rlhf.fault.target": spec.target.describe(), "rlhf.fault.emulated": armed.kind.EMULATED}
    for k, v in (details or {}).items():
        if isinstance(v, (str, int, float, bool)):
            attrs[f"rlhf.fault.{k}"] = v
    tracing.add_event(f"fault.{event}", **attrs)
    if event == "inject":
        log.warning("fault %s (%s%s) injected at %s on %s-%d, step %d", spec.name, spec.kind,
                    ", emulated" if armed.kind.EMULATED else "", hit.point, hit.role, hit.rank, hit.step)
    elif event == "restore":
        log.info("fault %s restored (%s)", spec.name, details.get("reason", ""))


# ---------------------------------------------------------------------------- lifecycle


def arm(run_dir: str, faults: list[dict[str, Any]] | list[FaultSpec], source: str = "config.yaml") -> int:
    """Arm a run's faults in this process (validated again here). Returns how many are armed."""
    global _ARMED, _RUN_DIR
    specs = [f for f in faults if isinstance(f, FaultSpec)] or parse_fault_dicts(list(faults), source)  # type: ignore[arg-type]
    disarm()
    _RUN_DIR = run_dir
    table: dict[str, list[Armed]] = {}
    earlier = _earlier_hits(run_dir)
    for spec in specs:
        armed = Armed(spec, KINDS[spec.kind](spec, run_dir), rng=random.Random(spec.when.seed),
                      earlier=earlier.get(spec.name, {}))
        _ALL.append(armed)
        for point in spec.points:
            table.setdefault(point, []).append(armed)
    _ARMED = table or None
    if specs:
        atexit.register(restore_all, "process exit")
    return len(specs)


def _earlier_hits(run_dir: str) -> dict[str, dict[tuple[str, int], list[int | None]]]:
    """Injections other processes of this run recorded before this one armed: fault -> (role, rank) -> steps."""
    hits: dict[str, dict[tuple[str, int], list[int | None]]] = {}
    try:
        with open(os.path.join(run_dir, "faults", "markers.jsonl"), encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError:
        return hits
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if m.get("event") == "inject" and m.get("pid") != os.getpid():
            hits.setdefault(m["fault"], {}).setdefault((m["role"], int(m["rank"])), []).append(m.get("step"))
    return hits


def restore_all(reason: str = "run end", keep: tuple[str, ...] = ()) -> None:
    """Restore every fault of this process that still holds something (but those of the kinds in `keep`)."""
    for armed in list(_ALL):
        if armed.spec.kind in keep:
            continue
        try:
            _restore(armed, reason)
        except Exception as exc:  # restoring one fault must not stop the others; recorded, not swallowed
            log.error("restoring fault %s failed: %s: %s", armed.spec.name, type(exc).__name__, exc)


def disarm() -> None:
    global _ARMED
    restore_all("disarmed")
    _ARMED = None
    _ALL.clear()


RL_ONLY = ("weights_update.", "rollout.", "events.", "metaserver.", "scheduler.", "data.split", "reference.",
           "reward.", "buffer.", "env.", "tool.", "sandbox.")


def never_fired(run_dir: str, faults: list[dict[str, Any]], last_step: int, rl: bool = True, colocate: bool = False,
                weights_mode: str = "meta", parallel: str = "dp") -> list[dict[str, str]]:
    """The run's armed faults that no process injected (from the run's own fault markers), each with the likeliest
    reason: a fault that never fired means the experiment did not happen, which a run must say out loud."""
    fired = set()
    try:
        with open(os.path.join(run_dir, "faults", "markers.jsonl"), encoding="utf-8") as fh:
            for line in fh:
                try:
                    marker = json.loads(line)
                except ValueError:
                    continue  # a line cut by a killed writer
                if marker.get("event") == "inject":
                    fired.add(marker.get("fault"))
    except OSError:
        pass
    out = []
    for spec in parse_fault_dicts(list(faults)):
        if spec.name not in fired:
            out.append({"name": spec.name, "why": _why_not(spec, last_step, rl, colocate, weights_mode, parallel)})
    return out


def _why_not(spec: FaultSpec, last_step: int, rl: bool, colocate: bool, weights_mode: str, parallel: str = "dp") -> str:
    points = spec.points
    fsdp_only = ("collective.all_gather", "collective.reduce_scatter")
    if all(p in fsdp_only for p in points) and parallel != "fsdp":
        return f"{', '.join(points)} is passed only with parallel.layout fsdp (this run: {parallel})"
    if not rl and all(p.startswith(RL_ONLY) for p in points):
        return f"the SFT baseline never passes {', '.join(points)} (RL only)"
    if all(p.startswith("events.") for p in points) and not colocate:
        return "colocation events are sent only in colocated runs (--colocate)"
    meta_only = ("weights_update.upload", "metaserver.put", "metaserver.get")
    if all(p in meta_only for p in points) and weights_mode != "meta":
        return f"{', '.join(points)} is passed only with weights.mode meta (this run: {weights_mode})"
    if all(p == "weights_update.broadcast" for p in points) and weights_mode != "distributed":
        return f"weights_update.broadcast is passed only with weights.mode distributed (this run: {weights_mode})"
    if all(p == "weights_update.save_dir" for p in points) and weights_mode != "disk":
        return f"weights_update.save_dir is passed only with weights.mode disk (this run: {weights_mode})"
    if spec.when.steps and min(spec.when.steps) > last_step:
        return (f"its step(s) {', '.join(map(str, spec.when.steps))} come after the last step the run reached "
                f"({last_step if last_step >= 0 else 'none'})")
    if spec.when.probability < 1.0:
        return f"probability {spec.when.probability:g}: no draw fired"
    who = spec.target.describe()
    return f"no process matching {who} passed {', '.join(points)}" + (
        f" at step(s) {', '.join(map(str, spec.when.steps))}" if spec.when.steps else "") + (
        f" after {spec.when.after_s:g} s" if spec.when.after_s else "")


def audit(run_dir: str) -> dict[str, Any]:
    """Leftover audit (run end, by the survivor): every injection without a restore is checked and cleaned.

    Reads faults/markers.jsonl; kills recorded helper processes still alive, removes recorded
    files still present, writes faults/audit.json and returns it.
    """
    path = os.path.join(run_dir, "faults", "markers.jsonl")
    report: dict[str, Any] = {"unrestored": [], "cleaned": [], "ok": True}
    if not os.path.exists(path):
        return report
    injected: dict[tuple[str, int], dict] = {}
    restored: set[tuple[str, int]] = set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                m = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (m["fault"], m["pid"])
            if m["event"] == "verify":
                injected[key] = m
            elif m["event"] == "restore":
                restored.add(key)
    for key, m in injected.items():
        if key in restored:
            continue
        pids, paths = m["details"].get("pids", []), m["details"].get("paths", [])
        if not pids and not paths:
            continue
        report["unrestored"].append({"fault": m["fault"], "kind": m["kind"], "pid": m["pid"],
                                     "owner_alive": _alive(m["pid"])})
        for pid in pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    report["cleaned"].append(f"killed {m['kind']} helper pid {pid} of {m['fault']}")
                except ProcessLookupError:
                    pass
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
                report["cleaned"].append(f"removed {p} left by {m['fault']}")
    report["ok"] = not report["cleaned"]
    with open(os.path.join(run_dir, "faults", "audit.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    for line in report["cleaned"]:
        log.error("leftover audit: %s", line)
    return report


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # psutil.NoSuchProcess between the two checks
        return False
