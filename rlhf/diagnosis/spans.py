"""Evidence from spans: requests that failed in transit, whether a request reached its peer, the stage a
report belongs to, and what the controller was doing at a moment."""

from __future__ import annotations

import re
from typing import Any

from rlhf.diagnosis.report import Evidence
from rlhf.diagnosis.rules import _STAGES, _UNRESOLVED
from rlhf.tracing.read import SpanRecord, load_spans


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
    if e.category != "network" or not e.local or _UNRESOLVED.search(e.message):  # a name that did not resolve: ours
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
