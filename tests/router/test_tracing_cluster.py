"""OpenTelemetry tracing across a real router, a real worker and its engine, in this process.

The in-memory exporter needs every span in one process: the worker app (``create_worker_app``: the
model, its engine thread, registration in Redis) and the router app (``create_router_app``) run under
uvicorn in threads on real ports, over the session's real ``redis-server``, with one tracer provider.
A session turn sent to the router with the client's ``traceparent`` must come back as one trace:
the router's server span (the client's span its parent, the routing decision on it), the worker's
``/internal/generate`` span under it, and the engine's queue / prefill / decode spans under that.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import httpx
import pytest
import redis
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agentrt import tracing
from agentrt.config import ServerConfig
from agentrt.procs import free_port
from router.app import create_router_app
from router.config import RouterConfig, WorkerSettings
from router.worker import create_worker_app
from tests.router.cluster import wait_for

WORKER_ID = "w-traced"
TURN_ROUTE = "POST /v1/sessions/{session_id}/turns"


class ThreadServer:
    """One app under uvicorn in a daemon thread (uvicorn installs no signal handlers off the main thread)."""

    def __init__(self, app, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self) -> "ThreadServer":
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 180, what=f"{self.url} to start")
        assert self.server.started, f"{self.url} did not start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@dataclass
class Cluster:
    router: str
    worker: str
    exporter: InMemorySpanExporter
    model: str

    def chat(self, url: str, traceparent: str | None = None) -> httpx.Response:
        r = httpx.post(url + "/v1/chat/completions", headers={"traceparent": traceparent} if traceparent else {},
                       json={"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r


@pytest.fixture(scope="module")
def cluster(redis_server):
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)  # before the apps are built: they get the middleware and the engine hook
    servers: list[ThreadServer] = []
    try:
        rconfig = RouterConfig(redis_url=redis_server.url, heartbeat_ttl_s=3, heartbeat_interval_s=0.5)
        wport = free_port()
        wconfig = ServerConfig(port=wport, kv_cache_tokens=4096, default_max_tokens=8, log_level="warning")
        servers.append(ThreadServer(create_worker_app(wconfig, rconfig, WorkerSettings(worker_id=WORKER_ID)),
                                    wport).start())
        rport = free_port()
        rcfg = ServerConfig(port=rport, default_max_tokens=8, log_level="warning")
        servers.append(ThreadServer(create_router_app(rcfg, rconfig), rport).start())
        router = servers[-1].url
        wait_for(lambda: [w["id"] for w in httpx.get(router + "/router/state").json()["workers"]] == [WORKER_ID],
                 60, what="the router to see the worker")
        yield Cluster(router, servers[0].url, exporter, httpx.get(router + "/health").json()["model"])
    finally:
        for server in reversed(servers):
            server.stop()
        tracing.shutdown()
        provider.shutdown()


def _traceparent() -> tuple[int, int, str]:
    trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    return trace_id, span_id, f"00-{trace_id:032x}-{span_id:016x}-01"


def _spans_of(exporter: InMemorySpanExporter, trace_id: int, names: set[str]) -> dict[str, list[ReadableSpan]]:
    """The trace's finished spans by name, once every name in ``names`` has one (the server spans end
    just after their responses are sent)."""
    def ready():
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        by_name: dict[str, list[ReadableSpan]] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        return by_name if names <= set(by_name) else None

    return wait_for(ready, 30, what=f"spans {sorted(names)}")


def _turn(http: httpx.Client, session_id: str, text: str, traceparent: str) -> httpx.Response:
    r = http.post(f"/v1/sessions/{session_id}/turns", headers={"traceparent": traceparent},
                  json={"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_a_routed_turn_is_one_parent_linked_trace(cluster: Cluster):
    with httpx.Client(base_url=cluster.router, timeout=120) as http:
        sid = http.post("/v1/sessions", json={"system": "You are a terse assistant. Answer in one word."}).json()["id"]
        trace_ids = []
        for text in ("Name a colour.", "Name another one."):  # the second turn finds the first one's prefix
            trace_id, client_span, traceparent = _traceparent()
            r = _turn(http, sid, text, traceparent)
            trace_ids.append(trace_id)
            spans = _spans_of(cluster.exporter, trace_id,
                              {TURN_ROUTE, "POST /internal/generate", "queue", "prefill", "decode"})
            assert all(len(v) == 1 for v in spans.values()), {k: len(v) for k, v in spans.items()}
            router, worker = spans[TURN_ROUTE][0], spans["POST /internal/generate"][0]
            queue, prefill, decode = spans["queue"][0], spans["prefill"][0], spans["decode"][0]

            # the client's span is the root's parent; then router -> worker -> engine phases
            assert router.kind is SpanKind.SERVER and router.attributes["agentrt.role"] == "router"
            assert router.parent is not None and router.parent.is_remote
            assert (router.parent.trace_id, router.parent.span_id) == (trace_id, client_span)
            assert worker.kind is SpanKind.SERVER and worker.attributes["agentrt.role"] == "worker"
            assert worker.parent.span_id == router.context.span_id and worker.parent.is_remote
            for phase in (queue, prefill, decode):
                assert phase.kind is SpanKind.INTERNAL
                assert phase.parent.span_id == worker.context.span_id
            assert set(spans) == {TURN_ROUTE, "POST /internal/generate", "queue", "prefill", "decode"}

            # the routing decision, naming the worker that served the turn
            attrs = router.attributes
            assert attrs["agentrt.route.worker"] == WORKER_ID == r.headers["x-agentrt-worker"]
            assert worker.attributes["agentrt.worker.id"] == WORKER_ID
            assert attrs["agentrt.route.policy"] == "agentrt" and attrs["agentrt.route.reason"]
            assert tuple(attrs["agentrt.route.candidates"]) == (WORKER_ID,)
            assert attrs["agentrt.route.session_id"] == sid and attrs["agentrt.route.attempt"] == 1
            assert [e.name for e in router.events] == ["agentrt.route"]
            assert router.attributes["http.route"] == "/v1/sessions/{session_id}/turns"
            assert router.attributes["http.response.status_code"] == 200 == worker.attributes[
                "http.response.status_code"]
            assert router.status.status_code is StatusCode.UNSET

            # one request id through all of them; the engine's counts are the reply's usage
            rid = router.attributes["agentrt.request_id"]
            assert worker.attributes["agentrt.request_id"] == rid
            usage = r.json()["usage"]
            for phase in (queue, prefill, decode):
                assert phase.attributes["agentrt.request_id"] == rid
                assert phase.attributes["agentrt.prompt_tokens"] == usage["prompt_tokens"]
                assert phase.attributes["agentrt.cached_tokens"] == usage["cached_tokens"]
                assert phase.attributes["agentrt.completion_tokens"] == usage["completion_tokens"]
                assert phase.attributes["agentrt.finish_reason"] == r.json()["finish_reason"]
            # the phases tile the request's life in the engine: each ends where the next begins
            assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
            assert queue.start_time <= queue.end_time and prefill.start_time <= prefill.end_time <= decode.end_time
            assert attrs["agentrt.route.prompt_tokens"] == usage["prompt_tokens"]
            if text == "Name another one.":  # the session's history is cached: routed to it and reused
                assert attrs["agentrt.route.matched_tokens"] > 0 and usage["cached_tokens"] > 0
                assert attrs["agentrt.route.reason"] != ""
    assert trace_ids[0] != trace_ids[1]


def test_a_direct_request_roots_its_trace_and_parents_the_engine_spans(cluster: Cluster):
    """Without a router (the worker serves the public API as ``agentrt serve`` does) and without a
    ``traceparent``, the server span is the trace's root and the engine's phases are its children."""
    r = cluster.chat(cluster.worker)

    def server_span():
        found = [s for s in cluster.exporter.get_finished_spans() if s.name == "POST /v1/chat/completions"]
        return found[-1] if found else None

    root = wait_for(server_span, 30, what="the chat completion's span")
    assert root.parent is None and root.attributes["agentrt.role"] == "worker"
    spans = _spans_of(cluster.exporter, root.context.trace_id, {"queue", "prefill", "decode"})
    assert set(spans) == {"POST /v1/chat/completions", "queue", "prefill", "decode"}
    for name in ("queue", "prefill", "decode"):
        assert spans[name][0].parent.span_id == root.context.span_id
    assert spans["decode"][0].attributes["agentrt.completion_tokens"] == r.json()["usage"]["completion_tokens"]


def test_untraced_paths_and_tracing_switched_off_record_nothing(cluster: Cluster):
    """Probes get no span; with tracing off the same request records nothing, in any process part:
    the only new spans afterwards are those of a traced request sent once it is back on."""
    active = tracing._active
    before = len(cluster.exporter.get_finished_spans())
    assert httpx.get(cluster.router + "/health").status_code == 200
    tracing.shutdown()  # the test's provider is not owned: it stays up
    try:
        assert not tracing.enabled()
        cluster.chat(cluster.router, _traceparent()[2])
    finally:
        tracing.install(active.provider)
    trace_id, _, traceparent = _traceparent()
    cluster.chat(cluster.router, traceparent)
    _spans_of(cluster.exporter, trace_id, {"POST /v1/chat/completions", "POST /internal/generate", "decode"})
    new = cluster.exporter.get_finished_spans()[before:]
    assert new and {s.context.trace_id for s in new} == {trace_id}
