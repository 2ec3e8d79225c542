"""Counters scraped from a server's Prometheus ``/metrics`` before and after a run.

agentrt servers and workers export ``agentrt_prompt_tokens_total``,
``agentrt_prefix_cache_hit_tokens_total``, ``agentrt_generation_tokens_total`` and
``agentrt_http_requests_total{route, status}``. A server without them (a peer) yields
``None`` for what it lacks; the bench reports that as "not reported", never as zero.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "prompt_tokens": "agentrt_prompt_tokens_total",
    "cached_tokens": "agentrt_prefix_cache_hit_tokens_total",
    "completion_tokens": "agentrt_generation_tokens_total",
}


def parse_counters(text: str, route: str = "/v1/chat/completions") -> dict[str, float | None]:
    """The counters above plus ``requests_ok``: ``agentrt_http_requests_total{route, status="200"}``."""
    values: dict[str, float | None] = {k: None for k in (*COUNTERS, "requests_ok")}
    names = {v: k for k, v in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        if family.name == "agentrt_http_requests" and values["requests_ok"] is None:
            values["requests_ok"] = 0.0  # the server counts requests, none on this route yet
        for sample in family.samples:
            if sample.name in names:
                values[names[sample.name]] = sample.value
            elif (sample.name == "agentrt_http_requests_total" and sample.labels.get("route") == route
                  and sample.labels.get("status") == "200"):
                values["requests_ok"] = (values["requests_ok"] or 0.0) + sample.value
    return values


def scrape(url: str, route: str = "/v1/chat/completions", timeout_s: float = 10.0) -> dict[str, float | None] | None:
    """``url``'s ``/metrics`` counters, or ``None`` when it has no Prometheus endpoint."""
    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return parse_counters(resp.text, route)
    except (httpx.HTTPError, ValueError):
        return None


def delta(before: dict | None, after: dict | None) -> dict[str, float | None] | None:
    if before is None or after is None:
        return None
    return {k: (after[k] - (before[k] or 0.0)) if after.get(k) is not None else None for k in after}
