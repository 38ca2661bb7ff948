"""Tracing: spans through real HTTP hops, typed errors on spans, the OTLP/JSON file format, the readers."""

import base64
import json
import random

import pytest

from rlhf import tracing
from rlhf.config import TracingConfig
from rlhf.errors import RemoteError
from rlhf.tracing.cli import render_text, to_jaeger, to_perfetto
from rlhf.tracing.read import load_spans
from rlhf.transport.client import Client, LoopThread
from rlhf.transport.http import Service, ServiceThread


@pytest.fixture()
def traced(tmp_path):
    run_dir = str(tmp_path)
    tracing.setup_tracing(run_dir, "controller", 0, TracingConfig(export_delay_ms=50))
    yield run_dir
    tracing.shutdown_tracing()


def _flush_and_load(run_dir):
    tracing.shutdown_tracing()  # flushes every provider; later spans would start new ones
    return load_spans(run_dir)


class OutOfMemoryError(RuntimeError):
    pass


def test_rpc_server_span_is_child_of_client_span_across_real_http(traced):
    svc = Service("train", 1, token="t")
    svc.route("/work", lambda a, t: tracing.span("forward_backward")(lambda: {"ok": a["x"]})())
    svc.route("/boom", lambda a, t: (_ for _ in ()).throw(OutOfMemoryError("CUDA out of memory on rank 1")))
    server = ServiceThread(svc)
    server.start()
    loop = LoopThread()
    try:
        with tracing.span("step", step=7, new_trace=True):
            with tracing.span("train", stage="train", step=7):
                client = Client(server.url, "t", peer="train-1")
                assert loop.run(client.call("/work", {"x": 3}, stage="train", step=7))[0] == {"ok": 3}
                with pytest.raises(RemoteError):
                    loop.run(client.call("/boom", {}, stage="train", step=7))
                loop.run(client.close())
    finally:
        loop.close()
        server.stop()
    ts = _flush_and_load(traced)
    by_name = {}
    for s in ts.spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["step"]
    (stage,) = by_name["train"]
    client_work, client_boom = by_name["POST /work"][0], by_name["POST /boom"][0]
    server_spans = {s.name: s for s in ts.spans if s.kind == "server"}
    assert {s.trace_id for s in ts.spans} == {root.trace_id}  # one trace across the hop
    assert stage.parent_id == root.span_id and client_work.parent_id == stage.span_id
    assert client_work.kind == "client" and client_work.service == "controller-0"
    assert client_work.attributes["rlhf.peer"] == "train-1"
    srv = [s for s in ts.spans if s.kind == "server" and s.parent_id == client_work.span_id]
    assert len(srv) == 1 and srv[0].service == "train-1" and srv[0].attributes["rlhf.step"] == 7
    (fb,) = by_name["forward_backward"]
    assert fb.parent_id == srv[0].span_id and fb.service == "train-1"  # followed the work onto the handler thread
    # the typed error is on the server span with who/where/what, and on the client span
    boom_srv = [s for s in server_spans.values() if s.parent_id == client_boom.span_id][0]
    assert boom_srv.error and client_boom.error
    event = [e for e in boom_srv.events if e["name"] == "exception"][0]["attributes"]
    assert event["rlhf.error.error_class"] == "OutOfMemoryError"
    assert event["rlhf.error.role"] == "train" and event["rlhf.error.rank"] == 1 and event["rlhf.error.step"] == 7
    assert "out of memory" in event["exception.message"]
    text = render_text(ts)
    assert "✗ OutOfMemoryError [train-1]" in text


def test_ids_do_not_repeat_when_training_code_reseeds_random(traced):
    ids = []
    for _ in range(2):
        random.seed(0)
        with tracing.span("step", new_trace=True):
            ids.append((tracing.trace_id_hex(), tracing.trace.get_current_span().get_span_context().span_id))
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]


def test_disabled_tracing_writes_nothing_and_spans_still_run(tmp_path):
    tracing.setup_tracing(str(tmp_path), "controller", 0, TracingConfig(enabled=False))
    try:
        with tracing.span("step", new_trace=True) as sp:
            assert not sp.get_span_context().is_valid
        assert not list((tmp_path / "traces").glob("*")) if (tmp_path / "traces").exists() else True
    finally:
        tracing.shutdown_tracing()


def test_file_format_is_otlp_json_equal_to_the_official_protobuf_encoding(tmp_path):
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rlhf.tracing.exporters import encode_otlp_json

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rlhf.test", "rlhf.rank": 2}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("rlhf")
    with tracer.start_as_current_span("outer", attributes={"rlhf.step": 3, "rlhf.stage": "train", "x": 0.5}):
        with tracer.start_as_current_span("inner", kind=tracing.SpanKind.CLIENT) as inner:
            inner.add_event("fault.inject", {"rlhf.fault.kind": "hang", "ok": True})
            inner.set_status(tracing.Status(tracing.StatusCode.ERROR, "boom"))
    spans = memory.get_finished_spans()
    ours = encode_otlp_json(spans)
    text = json.dumps(ours)
    assert '"traceId": "' in text and len(ours["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]) == 32

    # OTLP/JSON differs from protobuf's JSON mapping only in hex ids: convert and compare messages
    def hex_to_b64(obj):
        if isinstance(obj, dict):
            return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId") else
                        hex_to_b64(v)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [hex_to_b64(x) for x in obj]
        return obj

    parsed = json_format.ParseDict(hex_to_b64(ours), ExportTraceServiceRequest())
    official = encode_spans(spans)
    key = lambda s: s.span_id  # noqa: E731
    mine = sorted(parsed.resource_spans[0].scope_spans[0].spans, key=key)
    theirs = sorted(official.resource_spans[0].scope_spans[0].spans, key=key)
    for a, b in zip(mine, theirs):
        b.ClearField("flags")  # trace flags: the official encoder sets them, OTLP/JSON readers do not need them
        a.ClearField("flags")
        assert a == b
    assert len(mine) == len(theirs) == 2
    assert {a.key for a in parsed.resource_spans[0].resource.attributes} >= {"service.name", "rlhf.rank"}
    provider.shutdown()


def test_reader_skips_a_line_cut_short_by_a_killed_process(traced):
    with tracing.span("step", step=1, new_trace=True):
        pass
    tracing.shutdown_tracing()
    path = f"{traced}/traces/controller-0.jsonl"
    with open(path, "a") as fh:
        fh.write('{"resourceSpans": [{"resource": {"attr')
    ts = load_spans(traced)
    assert ts.bad_lines == 1 and [s.name for s in ts.spans] == ["step"]


def test_jaeger_and_perfetto_exports_are_structurally_valid(traced):
    svc = Service("rollout", 0, token="t")
    svc.route("/generate", lambda a, t: tracing.span("generate")(lambda: {"ok": True})())
    server = ServiceThread(svc)
    server.start()
    loop = LoopThread()
    try:
        for step in (1, 2):
            with tracing.span("step", step=step, new_trace=True):
                with tracing.span("rollout", stage="rollout", step=step):
                    c = Client(server.url, "t", peer="rollout-0")
                    loop.gather(c.call("/generate", {}), c.call("/generate", {}))  # overlapping client spans
                    loop.run(c.close())
    finally:
        loop.close()
        server.stop()
    ts = _flush_and_load(traced)
    jaeger = to_jaeger(ts)
    assert len(jaeger["data"]) == 2
    for tr in jaeger["data"]:
        ids = {s["spanID"] for s in tr["spans"]}
        assert all(len(s["spanID"]) == 16 and len(s["traceID"]) == 32 for s in tr["spans"])
        assert all(s["processID"] in tr["processes"] for s in tr["spans"])
        assert {p["serviceName"] for p in tr["processes"].values()} == {"rlhf.controller", "rlhf.rollout"}
        roots = [s for s in tr["spans"] if not s["references"]]
        assert len(roots) == 1 and roots[0]["operationName"] == "step"
        for s in tr["spans"]:
            for ref in s["references"]:
                assert ref["refType"] == "CHILD_OF" and ref["spanID"] in ids and ref["traceID"] == tr["traceID"]
            assert isinstance(s["startTime"], int) and isinstance(s["duration"], int)
            assert all({"key", "type", "value"} <= set(t) for t in s["tags"])
    perfetto = json.loads(json.dumps(to_perfetto(ts)))
    complete = [e for e in perfetto["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(ts.spans)
    names = {e["args"]["name"] for e in perfetto["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"controller-0", "rollout-0"}
    # within a lane, spans nest or are disjoint (the two concurrent generate calls need two lanes)
    lanes = {}
    for e in complete:
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in lanes.values():
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        stack = []
        for lo, hi in intervals:
            while stack and stack[-1][1] <= lo:
                stack.pop()
            assert not stack or hi <= stack[-1][1] + 1e-3, "overlapping spans share a lane"
            stack.append((lo, hi))
    assert len({tid for (pid, tid) in lanes if pid == 1}) >= 2


def test_trace_cli_step_view_and_unknown_step(traced, capsys):
    from rlhf.cli import main

    with tracing.span("step", step=4, new_trace=True):
        with tracing.span("train", stage="train", step=4):
            with tracing.span("optimizer.step"):
                pass
    tracing.shutdown_tracing()
    assert main(["trace", traced, "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "optimizer.step" in out  # the whole tree
    assert main(["trace", traced]) == 0
    out = capsys.readouterr().out
    assert "optimizer.step" not in out and "+1 below" in out  # depth 1 by default
    with pytest.raises(SystemExit, match="no trace for step 9; steps traced: 4"):
        main(["trace", traced, "--step", "9"])


def test_metrics_sampler_writes_rows_with_the_heartbeat(tmp_path):
    import csv
    import time

    from rlhf.tracing.metrics import ACTIVITY, ResourceSampler

    sampler = ResourceSampler(str(tmp_path), "rollout", 1, interval_s=0.05).start()
    ACTIVITY.set("rollout", 5)
    path = tmp_path / "metrics" / "rollout-1.csv"
    deadline = time.time() + 30
    while time.time() < deadline:  # real CPU work, so cpu_percent rises, until a few rows are written
        sum(i * i for i in range(1000))
        if path.exists() and len(path.read_text().splitlines()) >= 5:
            break
    alive = sampler._thread.is_alive()
    sampler.stop()
    rows = list(csv.DictReader(open(tmp_path / "metrics" / "rollout-1.csv")))
    assert len(rows) >= 3, f"{len(rows)} rows in 30 s; sampler thread alive: {alive}"
    assert max(float(r["cpu_percent"]) for r in rows) > 30
    assert all(int(r["rss_bytes"]) > 10_000_000 and int(r["threads"]) >= 2 for r in rows)
    assert rows[-1]["activity"] == "rollout" and rows[-1]["activity_step"] == "5"
    assert rows[-1]["gpu_util_percent"] == ""  # no GPU here: skipped, not failed


KILLED_AFTER_A_STAGE = """
import os, signal, sys, time
from rlhf import tracing
from rlhf.config import TracingConfig
from rlhf.stages import StageClock
tracing.setup_tracing(sys.argv[1], "controller", 0, TracingConfig(export_delay_ms=60000))
clock = StageClock(step=3)
with clock.stage("rollout"):
    pass
path = os.path.join(sys.argv[1], "traces", "controller-0.jsonl")
deadline = time.monotonic() + 5
while time.monotonic() < deadline and not (os.path.exists(path) and os.path.getsize(path)):
    time.sleep(0.01)  # the process under test waits for its own exporter, then dies without any cleanup
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_stage_span_is_exported_at_its_boundary_so_a_sigkill_cannot_lose_it(tmp_path):
    """The export period is 60 s here: only the flush at the stage boundary can have written the span."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_STAGE, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -9, out.stderr
    spans = load_spans(str(tmp_path)).spans
    assert [(s.name, s.attributes.get("rlhf.step")) for s in spans] == [("rollout", 3)]


def test_an_unsampled_rank_keeps_only_its_failed_traces_whole():
    """tracing.rank_sample: a rank that is not sampled passes on a trace's spans only once none of them is open and
    one of them failed (the failed request's whole local trace: its children that succeeded too)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rlhf.tracing.exporters import FailedTracesOnly

    exported = InMemorySpanExporter()
    gate = FailedTracesOnly(SimpleSpanProcessor(exported))
    provider = TracerProvider()
    provider.add_span_processor(gate)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("POST /train_step"):
        with tracer.start_as_current_span("sim.forward_backward"):
            pass
    assert exported.get_finished_spans() == () and gate.dropped == 2
    try:
        with tracer.start_as_current_span("POST /train_step"):
            with tracer.start_as_current_span("sim.forward_backward"):
                pass
            assert exported.get_finished_spans() == ()  # held while the request is open
            raise RuntimeError("the train step failed")
    except RuntimeError:
        pass
    assert [s.name for s in exported.get_finished_spans()] == ["sim.forward_backward", "POST /train_step"]
    provider.shutdown()
