"""Tracing end to end: a 2-rank run with 2 rollout servers, file exporter and OTLP/HTTP at once.

The OTLP receiver is a real HTTP server on 127.0.0.1 in this test process; it decodes the
protobuf bodies with the official opentelemetry-proto package.
"""

import asyncio
import json
import subprocess
import threading

import pytest

from rlhf.tracing.cli import to_jaeger, to_perfetto
from rlhf.tracing.read import load_spans
from tests.conftest import ROOT
from tests.test_runtime import assert_none_left, torchrun


class OtlpReceiver:
    """POST /v1/traces (application/x-protobuf) on 127.0.0.1; keeps every span id it is sent."""

    def __init__(self) -> None:
        self.spans: dict[str, dict] = {}
        self.requests = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        async def traces(request):
            msg = ExportTraceServiceRequest.FromString(await request.read())
            self.requests += 1
            for rs in msg.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.instance.id")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans[s.span_id.hex()] = {"trace": s.trace_id.hex(), "name": s.name, "service": service}
            return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")

        async def start():
            app = web.Application(client_max_size=1 << 28)
            app.router.add_post("/v1/traces", traces)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced") / "run"
    with OtlpReceiver() as receiver:
        out = subprocess.run(torchrun(run_dir, "--steps", "2", "--tracing.otlp_endpoint",
                                      f"http://127.0.0.1:{receiver.port}"),
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        assert_none_left(run_dir)
        received = dict(receiver.spans)
    return run_dir, load_spans(str(run_dir)), received


def test_every_step_is_one_trace_across_every_process_correctly_parented(traced_run):
    run_dir, ts, _ = traced_run
    assert ts.bad_lines == 0
    step_roots = ts.step_roots()
    assert sorted(step_roots) == [1, 2]
    by_trace = ts.by_trace()
    for step, root in step_roots.items():
        spans = by_trace[root.trace_id]
        services = {s.service for s in spans}
        assert services >= {"controller-0", "train-0", "train-1", "rollout-0", "rollout-1", "metaserver-0"}, services
        by_id = {s.span_id: s for s in spans}
        for s in spans:
            if s is root:
                continue
            assert s.parent_id in by_id, f"{s.name} in {s.service} has no parent in step {step}'s trace"
            parent = by_id[s.parent_id]
            if s.kind == "server":  # an RPC server span is the child of its client span, in another role
                assert parent.kind == "client" and parent.service != s.service, (s.name, parent.name)
                assert parent.start_ns <= s.start_ns + 50_000_000  # same host clock, small skew allowed
        stages = [c.name for c in root.children if c.service == "controller-0" and c.kind == "internal"]
        assert stages[:3] == ["weights_update", "events", "rollout"] and "train" in stages
        work = {s.name for s in spans}
        assert {"generate", "forward_backward", "optimizer.step", "collective.all_reduce", "metaserver.put",
                "weights.load", "checkpoint.write", "checkpoint.fsync"} <= work
        # the train ranks' spans sit under the controller's train stage
        train_stage = next(c for c in root.children if c.name == "train")
        ranks = {s.service for s, _ in train_stage.walk() if s.kind == "server"}
        assert ranks == {"train-0", "train-1"}


def test_scheduler_spans_join_the_trace_that_calls_it(traced_run):
    _, ts, _ = traced_run
    cleanup = [r for r in ts.trees() if r.name == "cleanup"]
    assert len(cleanup) == 1
    spans = [s for s, _ in cleanup[0].walk()]
    stops = [s for s in spans if s.service == "scheduler-0" and s.name == "scheduler.stop_job"]
    assert {s.attributes["rlhf.job"] for s in stops} == {"rollout-0", "rollout-1"}
    assert all(s.attributes["rlhf.stage"] == "cleanup" for s in spans if s.kind == "client")


def test_otlp_receiver_got_the_same_spans_as_the_files(traced_run):
    _, ts, received = traced_run
    from_files = {s.span_id: (s.trace_id, s.name, s.service) for s in ts.spans}
    from_otlp = {k: (v["trace"], v["name"], v["service"]) for k, v in received.items()}
    assert len(from_files) > 200
    assert from_otlp == from_files


def test_trace_exports_of_a_real_run(traced_run, tmp_path):
    from rlhf.cli import main

    run_dir, ts, _ = traced_run
    out = tmp_path / "jaeger.json"
    assert main(["trace", str(run_dir), "--format", "jaeger", "-o", str(out)]) == 0
    jaeger = json.loads(out.read_text())
    assert len(jaeger["data"]) == len(ts.by_trace())
    assert sum(len(t["spans"]) for t in jaeger["data"]) == len(ts.spans)
    assert to_perfetto(ts)["traceEvents"] and to_jaeger(ts)["data"]
