"""Tracing through the OpenTelemetry API (docs/tracing.md).

Core code calls only the helpers here, which call the OpenTelemetry *API*; it never asks
"is tracing on". `setup_tracing()` is the one place that touches the SDK: until it runs (or
with `tracing.enabled: false`) every span is the API's no-op span.

    from rlhf import tracing

    with tracing.span("rollout", stage="rollout", step=3):      # context manager
        ...

    @tracing.span("checkpoint.write")                             # or decorator
    def write(...): ...

One process can play several roles (rank 0 is the controller, train worker 0 and the
MetaServer), and each role is its own OpenTelemetry service (`service.name = rlhf.<role>`,
`service.instance.id = <role>-<rank>`), so each role gets its own TracerProvider and file.
`use_role(role, rank)` makes a role current for the code below it (a contextvar, so it
follows asyncio tasks and the worker threads we hand contexts to); an RPC server sets it
for every request it handles.

Context crosses every HTTP hop as W3C `traceparent` (`inject_headers` / `extract_context`).
Span and trace ids come from os.urandom: training code reseeds `random`, which would
otherwise make the SDK's ids repeat across processes.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from rlhf.tracing.exporters import FailedTracesOnly, FileSpanExporter, UrandomIdGenerator

log = logging.getLogger("rlhf.tracing")

ATTR_PREFIX = "rlhf."
_current_tracer: contextvars.ContextVar[Any] = contextvars.ContextVar("rlhf_tracer", default=None)
_current_identity: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("rlhf_identity", default=None)
_current_step: contextvars.ContextVar[int] = contextvars.ContextVar("rlhf_step", default=-1)
_current_stage: contextvars.ContextVar[str] = contextvars.ContextVar("rlhf_stage", default="")


class _State:
    def __init__(self) -> None:
        self.settings: dict[str, Any] | None = None  # run_dir, config; None = tracing off
        self.providers: dict[tuple[str, int], Any] = {}
        self.tracers: dict[tuple[str, int], Any] = {}
        self.primary: tuple[str, int] | None = None
        self.lock = threading.Lock()


_state = _State()


# ---------------------------------------------------------------------------- setup (SDK)


def setup_tracing(run_dir: str, role: str, rank: int, cfg: Any) -> None:
    """Configure the SDK for this process, with `role`-`rank` as its primary role.

    cfg is a `rlhf.config.TracingConfig`. Safe to call again (later calls only change the primary role).
    """
    _state.primary = (role, rank)  # who this process is, also when tracing is off (fault targets use it)
    if not cfg.enabled:
        _state.settings = None
        return
    endpoint = cfg.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    with _state.lock:
        first = _state.settings is None
        _state.settings = {"run_dir": run_dir, "file": cfg.file, "otlp_endpoint": endpoint.rstrip("/"),
                           "export_delay_ms": cfg.export_delay_ms,
                           "rank_sample": max(1, int(getattr(cfg, "rank_sample", 1) or 1))}
        _state.primary = (role, rank)
    provider = _provider(role, rank)
    if first:
        trace.set_tracer_provider(provider)
        atexit.register(shutdown_tracing)


def _provider(role: str, rank: int) -> Any:

    key = (role, rank)
    with _state.lock:
        if key in _state.providers:
            return _state.providers[key]
        settings = _state.settings
        assert settings is not None
        resource = Resource.create({"service.name": f"rlhf.{role}", "service.instance.id": f"{role}-{rank}",
                                    "rlhf.role": role, "rlhf.rank": rank, "process.pid": os.getpid(),
                                    "host.name": os.uname().nodename})
        provider = TracerProvider(resource=resource, id_generator=UrandomIdGenerator())
        delay = settings["export_delay_ms"]
        sample = settings["rank_sample"]
        kept = sample == 1 or role not in ("train", "rollout") or rank % sample == 0  # tracing.rank_sample
        if settings["file"]:
            path = os.path.join(settings["run_dir"], "traces", f"{role}-{rank}.jsonl")
            processor = BatchSpanProcessor(FileSpanExporter(path), schedule_delay_millis=delay)
            provider.add_span_processor(processor if kept else FailedTracesOnly(processor))
        if settings["otlp_endpoint"]:
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=settings["otlp_endpoint"] + "/v1/traces",
                                                            timeout=5), schedule_delay_millis=delay)
            provider.add_span_processor(processor if kept else FailedTracesOnly(processor))
        _state.providers[key] = provider
        return provider


def shutdown_tracing() -> None:
    """Flush and close every exporter of this process (at exit, and before a process ends on failure).

    Tracing is off afterwards (spans are no-ops) until `setup_tracing` runs again.
    """
    with _state.lock:
        providers = list(_state.providers.values())
        _state.providers.clear()
        _state.tracers.clear()
        _state.settings = None
    for provider in providers:
        try:
            provider.shutdown()
        except Exception as exc:  # an exporter failing at exit must not hide the run's own error
            log.warning("tracing shutdown: %s: %s", type(exc).__name__, exc)


def flush() -> None:
    for provider in list(_state.providers.values()):
        provider.force_flush(5000)


class _Flusher(threading.Thread):
    """Exports this process's ended spans on its own thread as soon as asked (bursts coalesce into one flush),
    so a SIGKILL loses at most the spans of the stage or request that was running, not an export period."""

    def __init__(self) -> None:
        super().__init__(name="span-flush", daemon=True)
        self.wanted = threading.Event()

    def run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            try:
                flush()
            except Exception as exc:  # noqa: BLE001 — a failed export is the exporter's to report; keep going
                log.debug("span flush: %s: %s", type(exc).__name__, exc)


_FLUSHER: list[_Flusher] = []


def flush_soon() -> None:
    """Export the spans ended so far, in the background (at every stage boundary and after every request)."""
    if not _state.providers:
        return
    if not _FLUSHER:
        with _state.lock:
            if not _FLUSHER:
                _FLUSHER.append(_Flusher())
                _FLUSHER[0].start()
    _FLUSHER[0].wanted.set()


# ---------------------------------------------------------------------------- API helpers


_NOOP = trace.NoOpTracer()


def tracer_for(role: str, rank: int) -> trace.Tracer:
    """The tracer of role-rank (its own service in traces); the no-op tracer when tracing is off."""
    if _state.settings is None:
        return _NOOP
    tracer = _state.tracers.get((role, rank))
    if tracer is None:  # SDK get_tracer builds a new scope and tracer each call: make it once per role
        tracer = _state.tracers[(role, rank)] = _provider(role, rank).get_tracer("rlhf")
    return tracer


def current_tracer() -> trace.Tracer:
    t = _current_tracer.get()
    if t is not None:
        return t
    if _state.settings is not None and _state.primary is not None:
        return tracer_for(*_state.primary)
    return trace.NoOpTracer()


@contextmanager
def use_role(role: str, rank: int, step: int | None = None) -> Iterator[None]:
    """Code below (also in tasks and handed-over threads) runs as role-rank: its spans, its fault targets."""
    token = _current_tracer.set(tracer_for(role, rank))
    ident = _current_identity.set((role, rank))
    step_token = _current_step.set(step) if step is not None else None
    try:
        yield
    finally:
        if step_token is not None:
            _current_step.reset(step_token)
        _current_identity.reset(ident)
        _current_tracer.reset(token)


def whoami() -> tuple[str, int]:
    """(role, rank) of the code running now: the role in use, else this process's primary role."""
    return _current_identity.get() or _state.primary or ("", -1)


def current_step() -> int:
    return _current_step.get()


@contextmanager
def _holding(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def at_step(step: int) -> Any:
    """The step of the code run inside (what spans and fault points record)."""
    return _holding(_current_step, step)


def current_stage() -> str:
    """The stage of the request this code serves ('' outside one): what a fault point deep inside it (a collective)
    records as where it fired."""
    return _current_stage.get()


def at_stage(stage: str) -> Any:
    return _holding(_current_stage, stage)


def attributes(stage: str | None = None, step: int | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if stage:
        out["rlhf.stage"] = stage
    if step is not None and step >= 0:
        out["rlhf.step"] = int(step)
    for k, v in extra.items():
        if v is None:
            continue
        out[k if "." in k else ATTR_PREFIX + k] = v if isinstance(v, (str, bool, int, float)) else str(v)
    return out


class span:
    """A span as context manager or decorator: `with span("train.step", step=3): ...`.

    Exceptions are recorded on the span (with the typed error's fields when it has them) and
    re-raised. `new_trace=True` starts a new trace (the controller's root span of a step).
    """

    def __init__(self, name: str, stage: str | None = None, step: int | None = None, kind: SpanKind = SpanKind.INTERNAL,
                 new_trace: bool = False, **attrs: Any) -> None:
        self.name, self.kind, self.new_trace = name, kind, new_trace
        self.attrs = attributes(stage, step, **attrs)
        self._cm: Any = None

    def __enter__(self) -> Span:
        ctx = otel_context.Context() if self.new_trace else None
        self._cm = current_tracer().start_as_current_span(self.name, context=ctx, kind=self.kind,
                                                          attributes=self.attrs, record_exception=False,
                                                          set_status_on_exception=False)
        return self._cm.__enter__()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool | None:
        if exc is not None:
            record_error(trace.get_current_span(), exc)
        return self._cm.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(self.name, kind=self.kind, new_trace=self.new_trace, **self._raw_attrs()):
                return fn(*args, **kwargs)

        return wrapper

    def _raw_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in self.attrs.items()}


def record_error(s: Span, exc: BaseException, info: Any = None) -> None:
    """Error status + an `exception` event carrying who/where/what when the error is typed.

    `info` (an ErrorInfo) is taken from `exc.info` (RemoteError) when not given.
    """
    attrs: dict[str, Any] = {"exception.type": type(exc).__name__, "exception.message": str(exc)[:2000]}
    info = info if info is not None else getattr(exc, "info", None)
    if info is not None and hasattr(info, "to_dict"):
        for k, v in info.to_dict().items():
            if v not in (None, "") and k != "traceback":
                attrs[f"rlhf.error.{k}"] = v if isinstance(v, (str, int, float, bool)) else str(v)
        if getattr(info, "traceback", ""):
            attrs["exception.stacktrace"] = info.traceback[-4000:]
    for k in ("status", "url"):
        if hasattr(exc, k):
            attrs[f"rlhf.error.{k}"] = str(getattr(exc, k))
    s.add_event("exception", attrs)
    s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {str(exc)[:200]}"))


def add_event(name: str, **attrs: Any) -> None:
    """An event on the current span (fault injections use this)."""
    trace.get_current_span().add_event(name, attributes(**attrs))


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """Add W3C traceparent (and tracestate) of the current span to outgoing HTTP headers."""
    propagate.inject(headers)
    return headers


def extract_context(headers: Any) -> otel_context.Context:
    return propagate.extract(headers)


def trace_id_hex() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


__all__ = [
    "at_step", "current_step", "whoami", "Status", "StatusCode", "SpanKind", "otel_context", "trace", "add_event", "attributes", "current_tracer", "extract_context", "flush", "inject_headers",
    "record_error", "setup_tracing", "shutdown_tracing", "span", "trace_id_hex", "tracer_for", "use_role",
]
