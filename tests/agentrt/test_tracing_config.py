"""Tracing's switch (agentrt/tracing.py): ``--otlp-endpoint`` without the ``agentrt[otel]`` packages is a
clear error in every command, tracing off is a no-op (no provider set, no middleware, no context),
and the engine's phase spans follow the request's timestamps, however it ended.

The cluster test (tests/router/test_tracing_cluster.py) follows one routed turn through real
processes' spans; these need no model and no Redis, except the router app built without its
lifespan (its tokenizer only).
"""

from __future__ import annotations

import gzip
import http.server
import sys
import threading

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from agentrt import tracing
from agentrt_cli import main
from agentrt.config import ConfigError, ServerConfig
from engine.request import Request
from engine.types import SamplingParams

ENDPOINT = "http://127.0.0.1:4318"
# what `import opentelemetry.sdk.trace` and the exporter need; None in sys.modules makes the import fail
OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter")


@pytest.fixture
def without_otel(monkeypatch):
    """As if agentrt[otel] were not installed: importing the SDK or the exporter fails."""
    for name in OTEL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture(scope="module")
def tokenizer_side():
    """The router's model (its tokenizer, read once for the module: the slow part of building its app)."""
    from router.model_info import load_router_model

    return load_router_model(None)


@pytest.fixture
def router_app(tokenizer_side, monkeypatch):
    """``router_app()``: a real router app (``create_router_app``; not started), its model read once."""
    from router import model_info
    from router.app import create_router_app
    from router.config import RouterConfig

    monkeypatch.setattr(model_info, "load_router_model", lambda *args: tokenizer_side)
    return lambda: create_router_app(ServerConfig(), RouterConfig())


@pytest.fixture
def recorder():
    """Tracing on, into an in-memory exporter (off again afterwards)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.shutdown()
    provider.shutdown()


def test_the_endpoint_without_the_extra_says_what_to_install(without_otel, capsys):
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'agentrt\[otel\]'"):
        tracing.check_available()
    with pytest.raises(ConfigError, match=r"^--otlp-endpoint 'http://127.0.0.1:4318': tracing needs the "
                                          r"OpenTelemetry SDK .* pip install 'agentrt\[otel\]'"):
        ServerConfig.from_sources({"otlp_endpoint": ENDPOINT}, environ={})
    with pytest.raises(ConfigError, match=r"^AGENTRT_OTLP_ENDPOINT='http://127.0.0.1:4318': .*agentrt\[otel\]"):
        ServerConfig.from_sources(environ={"AGENTRT_OTLP_ENDPOINT": ENDPOINT})
    # every command that serves refuses to start, before loading anything
    for command in ("serve", "worker", "router", "up"):
        assert main([command, "--otlp-endpoint", ENDPOINT]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"agentrt {command}: ") and "pip install 'agentrt[otel]'" in err, err
    with pytest.raises(tracing.TracingUnavailable):
        tracing.setup(ENDPOINT, None, "agentrt")
    assert not tracing.enabled()
    # and without the flag the same settings are fine
    assert ServerConfig.from_sources(environ={}).otlp_endpoint is None


def test_the_endpoint_must_be_an_http_url():
    for bad in ("ftp://collector:4318", "localhost:4318", "collector"):
        with pytest.raises(ConfigError, match=r"--otlp-endpoint .*must be an http:// or https:// URL"):
            ServerConfig.from_sources({"otlp_endpoint": bad}, environ={})
    assert ServerConfig.from_sources({"otlp_endpoint": ENDPOINT}, environ={}).otlp_endpoint == ENDPOINT
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://collector:4318/") == "https://collector:4318/v1/traces"
    assert tracing.traces_url("http://gw/otlp/v1/traces") == "http://gw/otlp/v1/traces"


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's traces endpoint: keeps each decoded export request."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body)
        self.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_setup_sends_the_spans_to_the_collector_as_the_named_service(monkeypatch):
    """``setup`` exports over OTLP/HTTP to ``<endpoint>/v1/traces`` (a real local receiver here), as
    ``service.name`` the flag, else ``OTEL_SERVICE_NAME``, else the role's default; shutdown flushes."""
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    _Collector.received = []
    try:
        for env, given, expected in (("from-env", None, "from-env"), ("from-env", "edge-router", "edge-router"),
                                     (None, None, "agentrt-router")):
            if env is None:
                monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
            else:
                monkeypatch.setenv("OTEL_SERVICE_NAME", env)
            tracing.setup(endpoint, given, "agentrt-router")
            assert tracing.enabled() and tracing._active.owned
            tracing._active.tracer.start_span(f"span-of-{expected}").end()
            tracing.shutdown()  # flushes the batch
            assert not tracing.enabled()
            path, request = _Collector.received[-1]
            [resource_spans] = request.resource_spans
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            names = [span.name for scope in resource_spans.scope_spans for span in scope.spans]
            assert (path, service, names) == ("/v1/traces", expected, [f"span-of-{expected}"])
    finally:
        collector.shutdown()
        collector.server_close()


def test_tracing_off_is_a_no_op(router_app):
    """No tracer provider is set (OpenTelemetry's global one included, which FastAPI's own telemetry
    would follow), no span is current for agentrt even inside another library's span, nothing is
    injected, and an app gets no middleware."""
    assert not tracing.enabled()
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
    other = InMemorySpanExporter()
    foreign = TracerProvider()
    foreign.add_span_processor(SimpleSpanProcessor(other))
    with foreign.get_tracer("someone-else").start_as_current_span("theirs"):  # recording meanwhile
        assert tracing.current() is None
        ctx = trace.set_span_in_context(trace.get_current_span())
        assert tracing.inject(ctx) == {}
        tracing.annotate(ctx, {"agentrt.route.worker": "w"})
        tracing.add_event(ctx, "agentrt.route", {"agentrt.route.worker": "w"})
        tracing.record_engine_phases(_request(arrival=1.0, admitted=2.0, first_token=3.0, finished=4.0, trace=ctx))
    [theirs] = other.get_finished_spans()
    assert theirs.name == "theirs" and dict(theirs.attributes) == {} and not theirs.events
    app = router_app()
    assert [m.cls for m in app.user_middleware if m.cls is tracing.TracingMiddleware] == []
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"


def test_an_app_built_with_tracing_on_gets_the_middleware(recorder, router_app):
    app = router_app()
    [mw] = [m for m in app.user_middleware if m.cls is tracing.TracingMiddleware]
    assert mw.kwargs == {"role": "router"}
    assert app.user_middleware[0] is mw  # outermost: it times 413s and auth failures too
    assert [tracing.traced(p) for p in ("/v1/chat/completions", "/internal/generate", "/health", "/metrics",
                                        "/internal/lease/release", "/internal/kv_snapshot")] == \
        [True, True, False, False, False, False]
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"  # agentrt's provider is its own


def _request(arrival, admitted=None, first_token=None, finished=None, trace=None, reason="stop",
             error=None) -> Request:
    req = Request("req-1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), arrival=arrival)
    req.admitted_at, req.first_token_time, req.finished_at = admitted, first_token, finished
    req.cached_tokens = 0 if admitted is not None else None
    req.output_ids = [7, 8] if first_token is not None else []
    req.finish_reason, req.error, req.trace = reason, error, trace
    return req


def test_engine_phases_follow_the_request_timestamps(recorder):
    parent = trace.set_span_in_context(tracing._active.tracer.start_span("server"))
    span_id = trace.get_current_span(parent).get_span_context().span_id

    tracing.record_engine_phases(_request(10.0, 10.5, 11.0, 12.5, parent))
    spans = {s.name: s for s in recorder.get_finished_spans()}
    assert list(spans) == ["queue", "prefill", "decode"]
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert all(s.parent.span_id == span_id for s in (q, p, d))
    assert (q.end_time - q.start_time, p.end_time - p.start_time, d.end_time - d.start_time) == \
        (500_000_000, 500_000_000, 1_500_000_000)
    assert q.end_time == p.start_time and p.end_time == d.start_time
    assert d.attributes["agentrt.completion_tokens"] == 2 and d.attributes["agentrt.prompt_tokens"] == 5
    assert d.attributes["agentrt.finish_reason"] == "stop" and d.status.status_code is StatusCode.UNSET

    recorder.clear()  # aborted while queued: only the queue span, ending at the abort
    tracing.record_engine_phases(_request(20.0, finished=20.25, trace=parent, reason="abort"))
    [q] = recorder.get_finished_spans()
    assert q.name == "queue" and q.end_time - q.start_time == 250_000_000
    assert q.attributes["agentrt.finish_reason"] == "abort" and q.status.status_code is StatusCode.UNSET

    recorder.clear()  # failed during prefill: queue, then prefill marked as the error
    tracing.record_engine_phases(_request(30.0, 30.5, finished=31.0, trace=parent, reason="error",
                                          error="the request does not fit in the KV cache"))
    q, p = recorder.get_finished_spans()
    assert (q.name, p.name) == ("queue", "prefill") and p.end_time - p.start_time == 500_000_000
    assert p.status.status_code is StatusCode.ERROR and "does not fit" in p.status.description

    recorder.clear()  # no context on the request (not traced): nothing
    tracing.record_engine_phases(_request(40.0, 40.5, 41.0, 42.0, trace=None))
    assert recorder.get_finished_spans() == ()
