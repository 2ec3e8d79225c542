"""Prometheus metrics of one server, in its own registry (no module-level globals).

Request counts and latency histograms are recorded as requests run; engine gauges
(running, waiting requests and tokens, KV pages, cached and pinned pages, prefix-cache hit tokens,
speculative decoding's draft and accepted tokens) are read from
``engine.stats()`` at scrape time, so they are never stale. The same observations of TTFT and
of each finished request's prompt and cached tokens also feed ``timeline`` (``agentrt/timeline.py``),
the last minutes per time slice that the dashboard charts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentrt.timeline import Timeline

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class _EngineCollector:
    """Reads the engine's stats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def _read(self) -> Any:
        # stats() reads structures the engine thread mutates; a read that races a change
        # ("dictionary changed size during iteration") is simply taken again.
        for _ in range(9):
            try:
                return self._stats()
            except RuntimeError:
                continue
        return self._stats()

    def collect(self) -> Iterable[Any]:
        s = self._read()
        for name, doc, value in (
                ("agentrt_engine_running", "Requests in the engine's running batch", s.running),
                ("agentrt_engine_waiting", "Requests waiting for admission in the engine", s.waiting),
                ("agentrt_engine_waiting_tokens",
                 "Tokens of the requests waiting for admission (the KV demand admission control bounds)",
                 s.waiting_tokens),
                ("agentrt_engine_waiting_tokens_limit",
                 "Waiting tokens past which new requests get 429 (max_waiting_tokens)", s.waiting_tokens_limit),
                ("agentrt_kv_pages_total", "KV cache pages in the pool", s.pages_total),
                ("agentrt_kv_pages_used", "KV cache pages in use (running requests and cached prefixes)",
                 s.pages_used),
                ("agentrt_kv_pages_cached",
                 "KV cache pages held by the prefix cache: full blocks, each one a block hash of the KV events",
                 s.pages_cached),
                ("agentrt_kv_pages_pinned", "KV cache pages pinned for sessions between turns", s.pages_pinned),
                ("agentrt_kv_pins", "Session pins held by the engine", s.num_pins),
                ("agentrt_spec_acceptance_rate", "Speculative decoding: accepted over drafted tokens",
                 s.spec_acceptance_rate),
                ("agentrt_spec_mean_accepted_length",
                 "Speculative decoding: tokens committed per verification (accepted draft tokens plus one)",
                 s.spec_mean_accepted_length)):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("agentrt_prompt_tokens", "Prompt tokens submitted to the engine", s.prompt_tokens_total),
                ("agentrt_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                 s.cached_tokens_total),
                ("agentrt_generation_tokens", "Tokens generated", s.generation_tokens_total),
                ("agentrt_spec_draft_tokens", "Speculative decoding: draft tokens proposed and verified",
                 s.spec_draft_tokens_total),
                ("agentrt_spec_accepted_tokens", "Speculative decoding: draft tokens the model accepted",
                 s.spec_accepted_tokens_total),
                ("agentrt_spec_verifications", "Speculative decoding: drafts verified (one per request and step)",
                 s.spec_verifications_total)):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, timeline: Timeline | None = None) -> None:
        self.registry = CollectorRegistry()
        self.timeline = timeline if timeline is not None else Timeline()
        self.requests = Counter("agentrt_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.ttft = Histogram("agentrt_time_to_first_token_seconds", "Time from admission to the first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("agentrt_time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("agentrt_requests_in_flight", "Generations admitted by the HTTP layer",
                               registry=self.registry)
        self.finished = Counter("agentrt_requests_finished", "Finished generations by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.closed = Counter("agentrt_requests_closed_by_budget",
                              "Constrained generations closed early (the shortest valid completion forced) "
                              "to fit max_tokens", registry=self.registry)
        self.sessions = Gauge("agentrt_sessions", "Sessions held by this server", registry=self.registry)
        self.turns = Counter("agentrt_session_turns", "Session turns by outcome (new, replayed)",
                             ["outcome"], registry=self.registry)

    def attach_engine(self, stats: Callable[[], Any]) -> None:
        self.registry.register(_EngineCollector(stats))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.timeline.observe_ttft(seconds)

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request finished: its prompt tokens and those of them the prefix cache served."""
        self.timeline.observe_request(prompt_tokens, cached_tokens)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_finished(self, result: Any) -> None:
        self.finished.labels(result.finish_reason).inc()
        if result.closed_by_budget:
            self.closed.inc()

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
