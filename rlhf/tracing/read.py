"""Read a run directory's traces back: spans from every traces/*.jsonl, grouped into trees.

Used by `rlhf trace`, the scenario measurements and the tests. A line cut short by a killed
process is skipped (and counted), never fatal.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(v: dict[str, Any]) -> Any:
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    service: str  # service.instance.id, e.g. train-1
    service_name: str  # service.name, e.g. rlhf.train
    resource: dict[str, Any]
    children: list["SpanRecord"] = field(default_factory=list, repr=False)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def error(self) -> bool:
        return self.status_code == 2

    @property
    def step(self) -> int | None:
        return self.attributes.get("rlhf.step")

    def walk(self, depth: int = 0) -> Iterator[tuple["SpanRecord", int]]:
        yield self, depth
        for child in self.children:
            yield from child.walk(depth + 1)


@dataclass
class TraceSet:
    spans: list[SpanRecord]
    bad_lines: int = 0

    def by_trace(self) -> dict[str, list[SpanRecord]]:
        out: dict[str, list[SpanRecord]] = {}
        for s in self.spans:
            out.setdefault(s.trace_id, []).append(s)
        return out

    def trees(self) -> list[SpanRecord]:
        """Root spans (no parent in the data), children linked and sorted by start; roots by start."""
        by_id = {s.span_id: s for s in self.spans}
        for s in self.spans:
            s.children = []
        roots = []
        for s in self.spans:
            parent = by_id.get(s.parent_id) if s.parent_id else None
            if parent is not None and parent.trace_id == s.trace_id:
                parent.children.append(s)
            else:
                roots.append(s)
        for s in self.spans:
            s.children.sort(key=lambda c: c.start_ns)
        return sorted(roots, key=lambda r: r.start_ns)

    def step_roots(self) -> dict[int, SpanRecord]:
        """The controller's root span of every step (the last one wins if a step was retried after resume)."""
        return {r.step: r for r in self.trees() if r.name == "step" and r.step is not None}  # type: ignore[misc]


def load_spans(run_dir: str) -> TraceSet:
    files = sorted(glob.glob(os.path.join(run_dir, "traces", "*.jsonl")))
    if not files:
        raise FileNotFoundError(f"no traces in {os.path.join(run_dir, 'traces')} (was tracing.enabled false?)")
    spans: list[SpanRecord] = []
    bad = 0
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    request = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1  # the last line of a killed process may be cut short
                    continue
                spans.extend(_decode_request(request))
    return TraceSet(spans, bad)


def _decode_request(request: dict[str, Any]) -> Iterator[SpanRecord]:
    for rs in request.get("resourceSpans", []):
        resource = _attrs(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                status = s.get("status", {})
                yield SpanRecord(
                    trace_id=s["traceId"], span_id=s["spanId"], parent_id=s.get("parentSpanId", ""), name=s["name"],
                    kind=KINDS.get(int(s.get("kind", 1)), "internal"), start_ns=int(s["startTimeUnixNano"]),
                    end_ns=int(s["endTimeUnixNano"]), attributes=_attrs(s.get("attributes")),
                    events=[{"name": e["name"], "time_ns": int(e["timeUnixNano"]), "attributes": _attrs(e.get("attributes"))}
                            for e in s.get("events", [])],
                    status_code=int(status.get("code", 0)), status_message=status.get("message", ""),
                    service=str(resource.get("service.instance.id", "?")),
                    service_name=str(resource.get("service.name", "?")), resource=resource,
                )
