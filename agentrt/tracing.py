"""OpenTelemetry request tracing: the optional ``agentrt[otel]`` extra, switched on by ``--otlp-endpoint``.

A trace follows one request across the processes that serve it (router, worker, the worker's
engine thread), which is what a question about one slow turn needs; ``/metrics``
(agentrt/metrics.py) answers the questions about all of them. The spans:

* one SERVER span per HTTP request (:class:`TracingMiddleware`, named ``METHOD route``, e.g.
  ``POST /v1/sessions/{session_id}/turns``): the root of its trace, or the child of the client's W3C
  ``traceparent`` when one came. On a router it carries the routing decision (``agentrt.route.*``,
  set by ``router/remote.py``); a worker's ``POST /internal/generate`` span is the child of the
  router's, whose context ``RemoteEngine`` sends in the ``traceparent`` header.
* the engine's ``queue`` (arrival to first admission), ``prefill`` (admission to first token) and
  ``decode`` (first token to finish) spans of each request, children of the server span of the process
  that runs the engine. The engine runs in its own thread, so no span is held open there: the request
  carries its server span's context (``Generator.start`` → ``EngineClient.submit(trace=)``), the engine
  stamps its phases on it, and :func:`record_engine_phases` (``LLMEngine.on_finished``) emits the three
  spans with explicit start and end times once it finished.

Off (the default), nothing is set up: no tracer provider, no middleware, no engine hook;
:func:`current` returns None, so requests carry no context and every function here returns at
once. OpenTelemetry is imported only when tracing is switched on, so agentrt runs without it.
The provider is agentrt's own, never OpenTelemetry's global one: FastAPI's built-in telemetry, which
follows the global provider, stays off, and each request gets exactly one server span.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger("agentrt.tracing")

INSTALL_HINT = "pip install 'agentrt[otel]'"
TRACES_PATH = "/v1/traces"  # where an OTLP/HTTP collector takes spans
# Probes, scrapes and the state page are not requests anyone traces; of the worker endpoints routers
# call, only generate belongs to a request's trace (pins and snapshots happen beside it).
UNTRACED = frozenset({"/health", "/metrics", "/router/state"})
TRACED_INTERNAL = frozenset({"/internal/generate"})
ENGINE_PHASES = ("queue", "prefill", "decode")


class TracingUnavailable(ValueError):
    """Tracing was asked for but the ``agentrt[otel]`` packages are not installed."""


def check_available() -> None:
    """:class:`TracingUnavailable`, saying what to install, unless the OpenTelemetry SDK and its
    OTLP/HTTP exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(f"tracing needs the OpenTelemetry SDK and its OTLP/HTTP exporter, which are not "
                                 f"installed ({exc}); install them with {INSTALL_HINT}") from None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a collector's base URL (``http://127.0.0.1:4318``) gets
    ``/v1/traces``, a URL with a path is taken as it is; ``ValueError`` unless it is an http(s) URL."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the OTLP endpoint must be an http:// or https:// URL such as http://127.0.0.1:4318, "
                         f"got {endpoint!r}")
    return endpoint.rstrip("/") + TRACES_PATH if parts.path in ("", "/") else endpoint


@dataclass(frozen=True)
class _Tracing:
    """What the functions here use while tracing is on (the OpenTelemetry modules, imported then)."""

    provider: Any
    tracer: Any
    owned: bool  # built by setup(): shutdown() flushes and stops it
    propagator: Any  # W3C trace context
    context: Any  # opentelemetry.context
    trace: Any  # opentelemetry.trace


_active: _Tracing | None = None


def enabled() -> bool:
    return _active is not None


def install(provider: Any, *, owned: bool = False) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``): :func:`setup` installs its OTLP one, tests
    one with an in-memory exporter. Apps built afterwards get the middleware and the engine hook;
    ``owned``: :func:`shutdown` shuts the provider down too."""
    global _active
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _active = _Tracing(provider, provider.get_tracer("agentrt"), owned, TraceContextTextMapPropagator(), context,
                       trace)


def setup(endpoint: str, service_name: str | None, default_service: str) -> None:
    """Export this process's spans to the OTLP/HTTP collector at ``endpoint`` (batched, in the
    background), as ``service.name`` ``service_name`` (else ``OTEL_SERVICE_NAME``, else
    ``default_service``). :class:`TracingUnavailable` without the ``agentrt[otel]`` packages."""
    check_available()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or default_service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    install(provider, owned=True)
    log.info("tracing to %s as service %r", traces_url(endpoint), name)


def shutdown() -> None:
    """Stop tracing; a provider :func:`setup` built sends its last spans first."""
    global _active
    active, _active = _active, None
    if active is not None and active.owned:
        active.provider.shutdown()


# ------------------------------------------------------------ context: capture, annotate, forward


def current() -> Any:
    """The current trace context (the request's server span), for ``EngineClient.submit(trace=)``;
    None when tracing is off or no span is current."""
    t = _active
    if t is None:
        return None
    ctx = t.context.get_current()
    return ctx if t.trace.get_current_span(ctx).get_span_context().is_valid else None


def annotate(ctx: Any, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` (None values left out) on the span of ``ctx``."""
    if ctx is None or _active is None:
        return
    span = _active.trace.get_current_span(ctx)
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def add_event(ctx: Any, name: str, attributes: Mapping[str, Any]) -> None:
    """Record the event ``name`` with ``attributes`` (None values left out) on the span of ``ctx``."""
    if ctx is None or _active is None:
        return
    span = _active.trace.get_current_span(ctx)
    if span.is_recording():
        span.add_event(name, {k: v for k, v in attributes.items() if v is not None})


def inject(ctx: Any) -> dict[str, str]:
    """HTTP headers that carry ``ctx`` downstream (W3C ``traceparent``, ``tracestate``); none without it."""
    headers: dict[str, str] = {}
    if ctx is not None and _active is not None:
        _active.propagator.inject(headers, context=ctx)
    return headers


# ------------------------------------------------------------ server spans


def traced(path: str) -> bool:
    """Whether requests to ``path`` get a server span."""
    if path in UNTRACED:
        return False
    return not path.startswith("/internal/") or path in TRACED_INTERNAL


class TracingMiddleware:
    """One SERVER span per traced HTTP request, current while the app handles it (streaming included),
    the child of the request's ``traceparent`` when it has one. ``role`` (serve, worker, router) is
    the ``agentrt.role`` attribute. The span is named ``METHOD route`` once the route is known, and
    marked as an error for a 5xx answer or an exception. Tracing switched off after the app was
    built: requests pass straight through."""

    def __init__(self, app: Any, role: str) -> None:
        self.app = app
        self.role = role

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        t = _active
        if t is None or scope["type"] != "http" or not traced(scope.get("path", "")):
            return await self.app(scope, receive, send)
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())}
        parent = t.propagator.extract(carrier)
        method = scope.get("method", "GET")
        span = t.tracer.start_span(method, context=parent, kind=t.trace.SpanKind.SERVER, attributes={
            "http.request.method": method, "url.path": scope.get("path", ""), "url.scheme": scope.get("scheme", "http"),
            "agentrt.role": self.role})
        status: list[int] = []

        async def traced_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        token = t.context.attach(t.trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, traced_send)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(t.trace.Status(t.trace.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            t.context.detach(token)
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            if status:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(t.trace.Status(t.trace.StatusCode.ERROR))
            span.end()


# ------------------------------------------------------------ engine phases


def record_engine_phases(req: "Request") -> None:
    """``LLMEngine.on_finished`` (the engine thread): the finished request's ``queue``, ``prefill`` and
    ``decode`` spans, children of the context it carries, with the times the engine stamped. Phases it
    never reached are left out (a request aborted while queued has only ``queue``, ending then); the
    last one is an error when the request failed. Never raises: tracing must not fail a request."""
    t = _active
    if t is None or req.trace is None or req.finished_at is None:
        return
    try:
        _emit_phases(t, req)
    except Exception:
        log.exception("could not record the engine spans of %s", req.request_id)


def _emit_phases(t: _Tracing, req: "Request") -> None:
    offset_ns = time.time_ns() - time.monotonic_ns()  # the engine stamps time.monotonic()
    attributes = {"agentrt.request_id": req.request_id, "agentrt.prompt_tokens": len(req.prompt_ids),
                  "agentrt.cached_tokens": req.cached_tokens or 0, "agentrt.completion_tokens": len(req.output_ids),
                  "agentrt.finish_reason": req.finish_reason or "", "agentrt.preemptions": req.num_preemptions}
    bounds = (req.arrival, req.admitted_at, req.first_token_time, req.finished_at)
    for i, name in enumerate(ENGINE_PHASES):
        start, end = bounds[i], bounds[i + 1]
        if start is None:
            return
        last = end is None or i == len(ENGINE_PHASES) - 1
        span = t.tracer.start_span(name, context=req.trace, kind=t.trace.SpanKind.INTERNAL,
                                   start_time=offset_ns + int(start * 1e9), attributes=attributes)
        if last and req.finish_reason == "error":
            span.set_status(t.trace.Status(t.trace.StatusCode.ERROR, req.error or "the request failed"))
        span.end(end_time=offset_ns + int((req.finished_at if end is None else end) * 1e9))
        if last:
            return
