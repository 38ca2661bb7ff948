"""SDK pieces: the OTLP-JSON file exporter and an os.urandom id generator.

File format: one line per export batch, each an OTLP/JSON `ExportTraceServiceRequest`
(`{"resourceSpans": [{"resource": …, "scopeSpans": [{"scope": …, "spans": […]}]}]}`), with
trace and span ids as lowercase hex and enums as integers, as the OTLP/JSON encoding says.
An OTLP collector's file exporter writes the same shape, so other tools can read ours.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import StatusCode


class UrandomIdGenerator(IdGenerator):
    """Ids from os.urandom: unaffected by `random.seed()` in training code."""

    def generate_span_id(self) -> int:
        while True:
            v = int.from_bytes(os.urandom(8), "big")
            if v:
                return v

    def generate_trace_id(self) -> int:
        while True:
            v = int.from_bytes(os.urandom(16), "big")
            if v:
                return v


def _any_value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _attrs(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": _any_value(v)} for k, v in (attributes or {}).items()]


_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


def span_to_otlp(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
        "name": s.name,
        "kind": s.kind.value + 1,  # OTLP: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
        "startTimeUnixNano": str(s.start_time),
        "endTimeUnixNano": str(s.end_time),
        "attributes": _attrs(s.attributes),
        "status": {"code": _STATUS[s.status.status_code]},
    }
    if s.parent is not None:
        out["parentSpanId"] = format(s.parent.span_id, "016x")
    if s.status.description:
        out["status"]["message"] = s.status.description
    if s.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": _attrs(e.attributes)}
                         for e in s.events]
    if s.links:
        out["links"] = [{"traceId": format(link.context.trace_id, "032x"), "spanId": format(link.context.span_id, "016x"),
                         "attributes": _attrs(link.attributes)} for link in s.links]
    return out


def encode_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Group spans by resource and scope into one ExportTraceServiceRequest (OTLP/JSON)."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list]]] = {}
    for s in spans:
        res_key = id(s.resource)
        resource, scopes = by_resource.setdefault(res_key, (s.resource, {}))
        scope = s.instrumentation_scope
        scopes.setdefault((scope.name if scope else "", (scope.version or "") if scope else ""), []).append(s)
    resource_spans = []
    for resource, scopes in by_resource.values():
        resource_spans.append({
            "resource": {"attributes": _attrs(resource.attributes)},
            "scopeSpans": [{"scope": {"name": name, **({"version": version} if version else {})},
                            "spans": [span_to_otlp(s) for s in group]} for (name, version), group in scopes.items()],
        })
    return {"resourceSpans": resource_spans}


class FileSpanExporter(SpanExporter):
    """Append each batch as one OTLP/JSON line to `path`, flushed at once (a crash loses at most a batch)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(encode_otlp_json(spans), separators=(",", ":"))
        with self._lock:
            if self._fh.closed:
                return SpanExportResult.FAILURE
            self._fh.write(line + "\n")
            self._fh.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FailedTracesOnly(SpanProcessor):
    """An unsampled rank's spans (tracing.rank_sample): the spans of one trace in this process are held until none
    of them is open, then passed on whole when one of them failed, else dropped (counted in `dropped`)."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.open: dict[int, int] = {}  # trace id -> spans started and not ended
        self.held: dict[int, list[ReadableSpan]] = {}
        self.dropped = 0
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        with self._lock:
            tid = span.context.trace_id
            self.open[tid] = self.open.get(tid, 0) + 1
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        tid = span.context.trace_id
        with self._lock:
            self.held.setdefault(tid, []).append(span)
            self.open[tid] = self.open.get(tid, 1) - 1
            if self.open[tid] > 0:
                return
            del self.open[tid]
            spans = self.held.pop(tid)
        if any(s.status.status_code == StatusCode.ERROR for s in spans):
            for s in spans:
                self.inner.on_end(s)
        else:
            self.dropped += len(spans)

    def shutdown(self) -> None:
        with self._lock:  # what is still open at the end (a request cut off by the exit) is kept: it may be evidence
            spans = [s for held in self.held.values() for s in held]
            self.held.clear()
        for s in spans:
            self.inner.on_end(s)
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
