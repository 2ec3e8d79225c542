"""What one server measures of its requests: Prometheus metrics, in its own registry (no module-level
globals), and the timeline the dashboard charts.

Request counts and latency histograms are recorded as requests run; engine gauges
(running, waiting requests and tokens, KV pages, cached and pinned pages, prefix-cache hit tokens, speculative
decoding's draft and accepted tokens) are read from
``engine.stats()`` at scrape time, so they are never stale. The same observations of TTFT and
of each finished request's prompt and cached tokens also feed ``timeline`` (:class:`Timeline`, below),
the last minutes per time slice that the dashboard charts.

A model server (``agentrt serve``, ``agentrt worker``) also exposes the gauges of the Gateway API
Inference Extension's model server protocol, under the names its endpoint picker reads by default
(``PROTOCOL_METRICS``; docs/deploy.md, "Model server protocol"), so an InferencePool's picker
scores our workers with no flags. The router's own metrics are in ``router/metrics.py``.

Every HELP line says what the series counts and in which unit: the dashboards and the docs'
metric table are written from them.

The timeline: a short server-side history of TTFT, prefix-cache hit rate and the latency SLO. Prometheus histograms and counters say everything since the process started; a chart of the
last minutes needs the values per time slice, kept on the server so that a page reload (or a
second viewer) sees the same history. :class:`Timeline` keeps one bucket per ``interval_s``
seconds for the last ``window_s`` seconds (a bounded ring: older buckets are dropped) and is
fed on requests: every first token adds a TTFT, every finished request its prompt and cached
tokens, every ended generation and session whether it met the latency SLO. Each bucket keeps the
TTFT count, sum and maximum exactly and a uniform sample of at most ``sample_size`` values (reservoir sampling, seeded) for the median and the 95th percentile;
the hit rate of a bucket is its cached tokens over its prompt tokens, as the engine counts them.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# No `*_created` series: each would be one more family per counter and histogram, a start timestamp whose
# HELP repeats its parent's (what it counts would be wrong), and Prometheus reads counter resets anyway.
# (A process-wide switch of prometheus_client; agentrt's registries are all built here and in router/metrics.py.)
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_SESSION_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)

# The model server protocol (gateway-api-inference-extension, docs/proposals/003-model-server-protocol):
# its metric -> the name we expose it under, which is vLLM's, the endpoint picker's default
# (--total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric,
# --cache-info-metric). No LoRA adapters are served, so vllm:lora_requests_info is not exposed.
PROTOCOL_METRICS = {
    "TotalQueuedRequests": "vllm:num_requests_waiting",
    "TotalRunningRequests": "vllm:num_requests_running",
    "KVCacheUtilization": "vllm:kv_cache_usage_perc",
    "BlockSize, NumGPUBlocks": "vllm:cache_config_info",
}


def kv_utilization(s: Any) -> float:
    """The fraction (0..1) of KV pages that cannot be reclaimed: held by running requests or pins.
    Cached prefixes no request holds are evicted on demand, so they count as free (as vLLM's
    ``kv_cache_usage_perc`` and SGLang's ``token_usage`` count them); 0 for an empty pool."""
    if s.pages_total <= 0:
        return 0.0
    return min(1.0, max(0.0, (s.pages_used - s.pages_evictable) / s.pages_total))


def _attr(name: str) -> Callable[[Any], Any]:
    return lambda stats: getattr(stats, name)


# (name, help, value from EngineStats) of the engine's gauges; ``{page_size}`` in a help: the pool's page size
_ENGINE_GAUGES = (
    ("agentrt_engine_running",
     "Requests in the engine's running batch (decoding or prefilling), now", _attr("running")),
    ("agentrt_engine_waiting",
     "Requests queued for admission to the engine's batch, now", _attr("waiting")),
    ("agentrt_engine_waiting_tokens",
     "Tokens (prompt tokens not yet cached) of the requests queued for admission, now: the KV "
     "demand admission control bounds", _attr("waiting_tokens")),
    ("agentrt_engine_waiting_tokens_limit",
     "Queued tokens past which a new request gets 429 (--max-waiting-tokens), in tokens",
     _attr("waiting_tokens_limit")),
    ("agentrt_kv_pages_capacity",
     "KV cache pages in the pool that requests can use (one page holds {page_size} tokens)", _attr("pages_total")),
    ("agentrt_kv_cache_bytes_per_token",
     "Bytes of K and V one token takes in the KV pool over every layer (--kv-cache-dtype: int8 "
     "pages hold values and a float32 scale per KV head)", _attr("kv_cache_bytes_per_token")),
    ("agentrt_kv_pages_used",
     "KV cache pages allocated, now: running requests' pages and cached prefixes (evictable or "
     "not)", _attr("pages_used")),
    ("agentrt_kv_pages_cached",
     "KV cache pages held by the prefix cache, now: full blocks, each one a block hash of the KV "
     "events", _attr("pages_cached")),
    ("agentrt_kv_pages_evictable",
     "KV cache pages of cached prefixes that no request or pin holds, now (reclaimed on demand)",
     _attr("pages_evictable")),
    ("agentrt_kv_window_pages_capacity",
     "Pages of the sliding-window layers' own pool, where the model's layers slide (0 otherwise): "
     "those layers keep only their window's K/V (docs/models.md)", _attr("window_pages_total")),
    ("agentrt_kv_window_pages_used",
     "Pages of the sliding-window layers' pool in use, now (0 where no layer slides)", _attr("window_pages_used")),
    ("agentrt_kv_pages_pinned",
     "KV cache pages held by session pins between turns, now", _attr("pages_pinned")),
    ("agentrt_kv_pins",
     "Session pins the engine holds, now", _attr("num_pins")),
    ("agentrt_spec_acceptance_rate",
     "Speculative decoding: accepted draft tokens over drafted ones since start (ratio 0..1)",
     _attr("spec_acceptance_rate")),
    ("agentrt_spec_mean_accepted_length",
     "Speculative decoding: tokens committed per verification since start (accepted draft tokens "
     "plus one; 0 before any)", _attr("spec_mean_accepted_length")),
    # the model server protocol's gauges (PROTOCOL_METRICS)
    ("vllm:num_requests_waiting",
     "Model server protocol TotalQueuedRequests: requests queued for admission, now (as "
     "agentrt_engine_waiting)", _attr("waiting")),
    ("vllm:num_requests_running",
     "Model server protocol TotalRunningRequests: requests in the running batch, now (as "
     "agentrt_engine_running)", _attr("running")),
    ("vllm:kv_cache_usage_perc",
     "Model server protocol KVCacheUtilization: fraction 0..1 of KV cache pages held by running "
     "requests and pins, now (evictable cached prefixes count as free)", kv_utilization),
)

# (name, help, value from EngineStats) of the engine's counters
_ENGINE_COUNTERS = (
    ("agentrt_prompt_tokens",
     "Prompt tokens submitted to the engine since start, in tokens", _attr("prompt_tokens_total")),
    ("agentrt_prefix_cache_hit_tokens",
     "Prompt tokens served from the prefix cache (not recomputed) since start, in tokens",
     _attr("cached_tokens_total")),
    ("agentrt_generation_tokens",
     "Tokens generated since start, in tokens", _attr("generation_tokens_total")),
    ("agentrt_engine_preemptions",
     "Running requests preempted (KV pages taken back, recomputed later) since start", _attr("num_preemptions")),
    ("agentrt_spec_draft_tokens",
     "Speculative decoding: draft tokens proposed and verified since start, in tokens",
     _attr("spec_draft_tokens_total")),
    ("agentrt_spec_accepted_tokens",
     "Speculative decoding: draft tokens the model accepted since start, in tokens",
     _attr("spec_accepted_tokens_total")),
    ("agentrt_spec_verifications",
     "Speculative decoding: drafts verified since start (one per request and step)", _attr("spec_verifications_total")),
)


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
        for name, doc, value in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc.format(page_size=s.page_size), value=value(s))
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Model server protocol BlockSize and NumGPUBlocks: the KV cache's block size in "
                                 "tokens and its number of blocks, as labels (value always 1)",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(s.page_size), str(s.pages_total)], 1.0)
        yield info
        for name, doc, value in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=value(s))
        queue = GaugeMetricFamily("agentrt_engine_waiting_by_priority",
                                  "Requests queued for admission, now, by priority class (high: priority < 0, "
                                  "normal: 0, low: > 0) and session (started: a later turn of a session that ran "
                                  "a turn; new: a first turn or no session)", labels=["priority", "session"])
        by_class = getattr(s, "waiting_by_priority", None) or {}
        for priority in ("high", "normal", "low"):
            for session in ("new", "started"):
                queue.add_metric([priority, session], float(by_class.get(f"{priority}/{session}", 0)))
        yield queue
        yield from _tier_metrics(getattr(s, "kv_tiers", None) or {})
        kernels = getattr(s, "cpu_kernels", None) or {}
        if kernels:
            family = GaugeMetricFamily("agentrt_cpu_kernel_active",
                                       "1 where the engine runs the CPU kernel (a C library of engine/cpu_build.py, "
                                       "or oneDNN's packed float32 linear where measured faster), 0 where it "
                                       "runs torch's plain path (no compiler, a failed build, a dtype it lacks, "
                                       "or slower here)",
                                       labels=["kernel"])
            for name, on in kernels.items():
                family.add_metric([name], 1.0 if on else 0.0)
            yield family


# KV tiers (engine/kv_tier.py): one series per tier ("host", "disk") of each
_TIER_GAUGES = (("pages", "agentrt_kv_tier_pages", "KV pages the tier holds"),
                ("capacity_pages", "agentrt_kv_tier_capacity_pages", "KV pages the tier may hold"),
                ("enabled", "agentrt_kv_tier_enabled", "1 while the tier is on (a disk error turns it off)"))
_TIER_COUNTERS = (("hit_tokens", "agentrt_kv_tier_hit_tokens", "Prompt tokens loaded back from the tier"),
                  ("loads", "agentrt_kv_tier_loads", "KV pages loaded back from the tier into the pool"),
                  ("load_time_s", "agentrt_kv_tier_load_seconds", "Time spent reading and checking tier pages"),
                  ("bytes_written", "agentrt_kv_tier_written_bytes", "Bytes written to the tier"),
                  ("bytes_read", "agentrt_kv_tier_read_bytes", "Bytes read from the tier"),
                  ("corrupt", "agentrt_kv_tier_corrupt_pages",
                   "Tier pages found missing, stale or failing their checksum (recomputed instead)"),
                  ("dropped", "agentrt_kv_tier_dropped_pages", "Evicted pages the tier could not take"),
                  ("errors", "agentrt_kv_tier_errors", "I/O errors of the tier (each turns a disk tier off)"))


def _tier_metrics(tiers: dict) -> Iterable[Any]:
    if not tiers:
        return
    for key, name, doc in _TIER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["tier"])
        for medium, t in tiers.items():
            family.add_metric([medium], float(t[key]))
        yield family
    for key, name, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for medium, t in tiers.items():
            family.add_metric([medium], float(t[key]))
        yield family


class Metrics:
    def __init__(self, timeline: Timeline | None = None) -> None:
        self.registry = CollectorRegistry()
        self.timeline = timeline if timeline is not None else Timeline()
        self.requests = Counter("agentrt_http_requests",
                                "HTTP requests answered, by route template and status code", ["route", "status"],
                                registry=self.registry)
        self.ttft = Histogram("agentrt_time_to_first_token_seconds",
                              "Time to first token: from the moment this server began a generation (its request "
                              "parsed) to its first output token, in seconds",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("agentrt_time_per_output_token_seconds",
                              "Time per output token: a generation's mean time between output tokens after the "
                              "first, in seconds (one observation per generation)",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("agentrt_requests_in_flight",
                               "Generations the HTTP layer admitted and has not finished, now", registry=self.registry)
        self.finished = Counter("agentrt_requests_finished", "Generations finished, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.closed = Counter("agentrt_requests_closed_by_budget",
                              "Constrained generations closed early (the shortest valid completion forced) "
                              "to fit max_tokens", registry=self.registry)
        self.sessions = Gauge("agentrt_sessions", "Sessions this server holds (created and not yet expired or "
                              "deleted), now", registry=self.registry)
        self.session_completion = Histogram(
            "agentrt_session_completion_seconds",
            "Sessions that ended (deleted or expired) with at least one turn: from creation to the end of "
            "their last turn, in seconds", buckets=_SESSION_BUCKETS, registry=self.registry)
        self.slo = Counter("agentrt_requests_slo",
                           "Generations that ended, by whether they met the latency SLO (first token within "
                           "slo_ttft_s and time per output token within slo_tpot_s; a failed one missed it)",
                           ["outcome"], registry=self.registry)
        self.sessions_ended = Counter(
            "agentrt_sessions_ended",
            "Sessions that ended (deleted or expired) with at least one turn, by whether every turn met the "
            "latency SLO; the rate of slo=\"met\" is the goodput in sessions", ["slo"], registry=self.registry)
        self.session_turns_in_slo = Histogram(
            "agentrt_session_turns_in_slo_ratio",
            "Sessions that ended with at least one turn: the share of their turns that met the latency SLO",
            buckets=_RATIO_BUCKETS, registry=self.registry)
        self.kv_demotions = Counter(
            "agentrt_session_kv_demotions",
            "Session turns whose KV was sent to the KV tiers and unpinned for the pause after them (a pause "
            "expected_pause_s announced, or the cost model found too long to pin through)", registry=self.registry)
        self.kv_prefetches = Counter(
            "agentrt_session_kv_prefetches",
            "Demoted session prefixes read back from the KV tiers ahead of the session's next turn",
            registry=self.registry)
        self.turns = Counter("agentrt_session_turns",
                             "Session turns, by outcome: new (generated) or replayed (a turn_id seen before)",
                             ["outcome"], registry=self.registry)

    def attach_engine(self, stats: Callable[[], Any]) -> None:
        """A model server's engine gauges and counters, and the model server protocol's gauges."""
        self.registry.register(_EngineCollector(stats))

    def attach(self, collector: Any) -> None:
        """Another collector read at scrape time (the router's, ``router/metrics.py``)."""
        self.registry.register(collector)

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

    def observe_slo(self, met: bool) -> None:
        """A generation ended: whether it met the latency SLO."""
        self.slo.labels("met" if met else "missed").inc()
        self.timeline.observe_slo(met)

    def observe_session_end(self, seconds: float, turns_in_slo: list[bool]) -> None:
        """A session with turns ended: its completion time (creation to the end of its last turn) and,
        per turn whose outcome was recorded, whether it met the SLO (the session meets it when all did)."""
        self.session_completion.observe(max(0.0, seconds))
        if not turns_in_slo:  # turns recorded before outcomes were: neither met nor missed
            return
        met = all(turns_in_slo)
        self.session_turns_in_slo.observe(sum(turns_in_slo) / len(turns_in_slo))
        self.sessions_ended.labels("met" if met else "missed").inc()
        self.timeline.observe_session_end(met)

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ------------------------------------------------------------ the timeline (the dashboard's charts)


@dataclass
class _Bucket:
    start: float  # epoch seconds, a multiple of the interval
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    sample: list[float] = field(default_factory=list)
    requests: int = 0  # finished requests (those that count prompt and cached tokens)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    slo_met: int = 0  # generations that ended meeting the latency SLO
    slo_missed: int = 0
    sessions_met: int = 0  # sessions that ended with every turn within the SLO
    sessions_missed: int = 0


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank: the smallest value with at least ``q`` of them at or
    below it); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Timeline:
    """Bucketed TTFT and hit-rate samples over the last ``window_s`` seconds. Safe to feed from any
    thread. ``clock`` (epoch seconds) is for tests."""

    def __init__(self, interval_s: float = 5.0, window_s: float = 600.0, sample_size: int = 256,
                 clock: Callable[[], float] = time.time, seed: int = 0) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s} and {window_s}")
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        self.interval_s = interval_s
        self.window_s = window_s
        self.sample_size = sample_size
        self._clock = clock
        self._rng = random.Random(seed)
        self._buckets: deque[_Bucket] = deque(maxlen=math.ceil(window_s / interval_s))
        self._lock = threading.Lock()

    def _current(self) -> _Bucket:
        start = math.floor(self._clock() / self.interval_s) * self.interval_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        return self._buckets[-1]

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            b = self._current()
            b.ttft_count += 1
            b.ttft_sum += seconds
            b.ttft_max = max(b.ttft_max, seconds)
            if len(b.sample) < self.sample_size:
                b.sample.append(seconds)
            else:  # reservoir: each of the bucket's values stays in the sample with equal chance
                j = self._rng.randrange(b.ttft_count)
                if j < self.sample_size:
                    b.sample[j] = seconds

    def observe_request(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            b = self._current()
            b.requests += 1
            b.prompt_tokens += prompt_tokens
            b.cached_tokens += cached_tokens

    def observe_slo(self, met: bool) -> None:
        with self._lock:
            b = self._current()
            if met:
                b.slo_met += 1
            else:
                b.slo_missed += 1

    def observe_session_end(self, met: bool) -> None:
        with self._lock:
            b = self._current()
            if met:
                b.sessions_met += 1
            else:
                b.sessions_missed += 1

    def points(self) -> list[dict]:
        """One point per interval of the window up to now, oldest first (intervals without requests
        included, with zero counts and null values, so a chart shows the gap)."""
        with self._lock:
            now = self._clock()
            last = math.floor(now / self.interval_s) * self.interval_s
            n = self._buckets.maxlen or 1
            first = last - (n - 1) * self.interval_s
            held = {round(b.start / self.interval_s): b for b in self._buckets if b.start >= first - 1e-9}
            out = []
            for i in range(n):
                start = first + i * self.interval_s
                b = held.get(round(start / self.interval_s))
                out.append(_point(start, b, self.interval_s))
            return out

    def slo_summary(self, seconds: float = 60.0) -> dict:
        """The latency SLO over the intervals that began in the last ``seconds`` (the current one
        included): generations that met it and ended, sessions that ended within it and ended, and the
        goodput, sessions ended within the SLO per minute over that span (None before any ended)."""
        with self._lock:
            since = math.floor(self._clock() / self.interval_s) * self.interval_s - seconds + self.interval_s
            recent = [b for b in self._buckets if b.start >= since - 1e-9]
            met = sum(b.slo_met for b in recent)
            ended = met + sum(b.slo_missed for b in recent)
            s_met = sum(b.sessions_met for b in recent)
            s_ended = s_met + sum(b.sessions_missed for b in recent)
            return {"seconds": seconds, "requests": ended, "requests_in_slo": met,
                    "requests_in_slo_ratio": met / ended if ended else None,
                    "sessions_ended": s_ended, "sessions_in_slo": s_met,
                    "goodput_sessions_per_min": s_met * 60.0 / seconds if s_ended else None}

    def as_json(self) -> dict:
        return {"interval_s": self.interval_s, "window_s": self.window_s, "points": self.points()}


def _point(start: float, b: _Bucket | None, interval_s: float) -> dict:
    if b is None:
        return {"t": start, "ttft_count": 0, "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p95_s": None,
                "ttft_max_s": None, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": None,
                "slo_met": 0, "slo_missed": 0, "slo_ratio": None, "sessions_met": 0, "sessions_missed": 0,
                "goodput_sessions_per_min": None}
    slo_ended, sessions_ended = b.slo_met + b.slo_missed, b.sessions_met + b.sessions_missed
    return {"t": start, "ttft_count": b.ttft_count,
            "ttft_mean_s": b.ttft_sum / b.ttft_count if b.ttft_count else None,
            "ttft_p50_s": quantile(b.sample, 0.5), "ttft_p95_s": quantile(b.sample, 0.95),
            "ttft_max_s": b.ttft_max if b.ttft_count else None,
            "requests": b.requests, "prompt_tokens": b.prompt_tokens, "cached_tokens": b.cached_tokens,
            "hit_rate": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None,
            "slo_met": b.slo_met, "slo_missed": b.slo_missed,
            "slo_ratio": b.slo_met / slo_ended if slo_ended else None,
            "sessions_met": b.sessions_met, "sessions_missed": b.sessions_missed,
            "goodput_sessions_per_min": b.sessions_met * 60.0 / interval_s if sessions_ended else None}
