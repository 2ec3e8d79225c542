"""The live dashboard: ``GET /dashboard`` (a static page), ``GET /dashboard/app.js`` (its script) and
``GET /dashboard/status`` (the JSON it polls every two seconds), on ``agentrt serve`` and ``agentrt router``.

The page and its script are files shipped in the package (``agentrt/static/``, package data): plain
HTML and hand-written JavaScript that draw tables and SVG charts, with nothing fetched from anywhere
but this server (the page's Content-Security-Policy forbids any other origin). They hold no data, so
they are served without a key; the JSON holds the data and sits behind the API's own key check. A
browser cannot put a bearer header on a URL typed into it, so the page asks for the key (or reads it
from the URL's fragment, ``/dashboard#key=...``, which browsers never send to a server) and sends it
as ``Authorization: Bearer`` on each poll, keeping it in the tab's ``sessionStorage`` only.

The JSON has one shape for both servers (docs/api.md, "Dashboard"): ``workers`` (one, the local
engine, on ``agentrt serve``; every registered worker behind a router), ``sessions``, ``routing``
(the router's last decisions; empty in one process) and ``series`` (``agentrt/metrics.py``). Each
worker's KV use is a ``kv`` object keyed by tier (``device`` today): a tier the engine adds to its
stats only adds a key, and the page draws whatever tiers it finds.

What a caller sees: with a tenants file, a tenant's key shows that tenant's sessions and the routing
decisions made in its cache (its cache salt; tenants that share the cache see each other's, as they
share the cache itself), next to the fleet-wide worker numbers and charts; with ``--api-key`` keys or
an open server there is one tenant, ``default``, and it sees everything.

``app.state.dashboard`` is the status source: :class:`LocalStatus` here, ``router.dashboard.RouterStatus``
behind a router; both build workers with :func:`engine_worker` and sessions with :func:`session_summary`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse

from agentrt.core.store import SessionStore
from agentrt.core.tenants import Tenant, TenantRegistry
from agentrt.metrics import Timeline

STATIC = Path(__file__).resolve().parent / "static"
REFRESH_S = 2.0
SESSION_SCAN = 1000  # most recently active sessions read to count pinned ones

# Nothing but this origin: no CDN script, style sheet, font or image can load, nor can the page be framed.
_CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
_STATIC_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                   "Referrer-Policy": "no-referrer"}


class StatusSource(Protocol):
    """What ``GET /dashboard/status`` returns for a caller (``tenant``, authenticated)."""

    async def status(self, tenant: Tenant) -> dict[str, Any]:
        ...


def kv_tiers(stats: Any) -> dict[str, dict[str, int]]:
    """A worker's KV use keyed by tier, from ``engine.stats()``: the device pool's pages (total, used,
    free, held by the prefix cache, pinned for sessions), the page size in tokens and the bytes a token
    takes (``--kv-cache-dtype``: int8 pages take about half the bytes of bfloat16)."""
    return {"device": {"pages_total": stats.pages_total, "pages_used": stats.pages_used,
                       "pages_free": stats.pages_free, "pages_cached": stats.pages_cached,
                       "pages_pinned": stats.pages_pinned, "page_size": stats.page_size,
                       "bytes_per_token": stats.kv_cache_bytes_per_token}}


def engine_worker(worker_id: str, state: str, stats: Any, url: str | None = None) -> dict[str, Any]:
    """One worker's block of the status from its engine's stats. ``cached_blocks``: blocks held by its
    prefix cache (each one a block hash of its KV events, ``agentrt_kv_pages_cached``); ``hit_rate``:
    prompt tokens served from the cache over prompt tokens since it started (``agentrt_prefix_cache_hit_tokens``
    over ``agentrt_prompt_tokens``; None before any prompt)."""
    prompt, cached = stats.prompt_tokens_total, stats.cached_tokens_total
    return {"id": worker_id, "state": state, "url": url,
            "load": {"running": stats.running, "waiting": stats.waiting, "waiting_tokens": stats.waiting_tokens,
                     "waiting_by_priority": dict(stats.waiting_by_priority or {})},
            "kv": kv_tiers(stats), "cached_blocks": stats.pages_cached, "pins": stats.num_pins,
            "prompt_tokens_total": prompt, "cached_tokens_total": cached,
            "hit_rate": cached / prompt if prompt else None}


def sees_all(tenants: TenantRegistry) -> bool:
    """Whether every caller sees every tenant's data: one tenant only (``--api-key`` keys, or open)."""
    return set(tenants.tenants) <= {"default"}


async def session_summary(store: SessionStore, tenants: TenantRegistry, caller: Tenant,
                          now: float | None = None, scan: int = SESSION_SCAN) -> dict[str, Any]:
    """Sessions held: ``count`` and per tenant (the store's own counts), and ``pinned``: those whose last
    turn's pin has not expired, counted among the ``scanned`` most recently active sessions (a pin lasts
    seconds to minutes after a turn, so the pinned sessions are among the most recent ones). A caller of
    a tenants file sees its own tenant only."""
    now = time.time() if now is None else now
    names = sorted(tenants.tenants) if sees_all(tenants) else [caller.name]
    records = await store.list(tenant=None if sees_all(tenants) else caller.name, limit=scan)
    by_tenant: dict[str, dict[str, int]] = {}
    for name in names:
        by_tenant[name] = {"count": await store.count(name), "pinned": 0}
    for r in records:
        if r.tenant not in by_tenant:  # a tenant no longer in the registry (open server: only default)
            by_tenant[r.tenant] = {"count": await store.count(r.tenant), "pinned": 0}
        turn = r.last_turn
        if turn is not None and turn.pin_id is not None and turn.pin_expires_at > now and r.expires_at > now:
            by_tenant[r.tenant]["pinned"] += 1
    return {"count": sum(t["count"] for t in by_tenant.values()),
            "pinned": sum(t["pinned"] for t in by_tenant.values()), "scanned": len(records),
            "by_tenant": [{"tenant": name, **v} for name, v in sorted(by_tenant.items())]}


def totals(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt and cached tokens over the workers that answered, and their hit rate."""
    prompt = sum(w.get("prompt_tokens_total") or 0 for w in workers)
    cached = sum(w.get("cached_tokens_total") or 0 for w in workers)
    return {"prompt_tokens_total": prompt, "cached_tokens_total": cached,
            "hit_rate": cached / prompt if prompt else None}


def slo_status(config: Any, timeline: Timeline) -> dict[str, Any]:
    """The latency SLO (``slo_ttft_s``, ``slo_tpot_s``) and the last minute against it: generations and
    sessions that ended within it, and the goodput (sessions ended within it per minute)."""
    return {"ttft_s": config.slo_ttft_s, "tpot_s": config.slo_tpot_s, "last_minute": timeline.slo_summary(60.0)}


def status_body(mode: str, model: str, caller: Tenant, tenants: TenantRegistry, workers: list[dict[str, Any]],
                sessions: dict[str, Any], routing: dict[str, Any], timeline: Timeline,
                config: Any) -> dict[str, Any]:
    return {"mode": mode, "model": model, "generated_at": time.time(), "refresh_s": REFRESH_S,
            "tenant": caller.name, "scope": "all" if sees_all(tenants) else "tenant",
            "workers": workers, "totals": totals(workers), "sessions": sessions, "routing": routing,
            "slo": slo_status(config, timeline), "series": timeline.as_json()}


class LocalStatus:
    """``agentrt serve``: one worker, the engine in this process (id ``local``); no routing."""

    def __init__(self, services: Any) -> None:
        self.state = services  # the app's Services (agentrt/server.py): engine, sessions, tenants, metrics...

    async def status(self, tenant: Tenant) -> dict[str, Any]:
        s = self.state
        worker = engine_worker("local", "draining" if s.stopping or s.generator.draining else "up",
                               s.engine.stats())
        worker["load"]["in_flight"] = s.generator.in_flight
        sessions = await session_summary(s.sessions.store, s.tenants, tenant)
        routing = {"policy": None, "counts": {}, "recent": []}
        return status_body("serve", s.generator.model_name, tenant, s.tenants, [worker], sessions, routing,
                           s.metrics.timeline, s.generator.config)


def dashboard_routes(auth: Callable[..., Tenant]) -> APIRouter:
    """The three routes; ``auth`` is the API's key check (a FastAPI dependency returning the tenant)."""
    routes = APIRouter()

    @routes.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html; charset=utf-8",
                            headers=_STATIC_HEADERS)

    @routes.get("/dashboard/app.js", include_in_schema=False)
    async def dashboard_script() -> FileResponse:
        return FileResponse(STATIC / "dashboard.js", media_type="text/javascript; charset=utf-8",
                            headers=_STATIC_HEADERS)

    @routes.get("/dashboard/status")
    async def dashboard_status(request: Request, tenant: Tenant = Depends(auth)) -> dict:
        """Workers, sessions, the last routing decisions and the last minutes' TTFT and hit rate, as the
        dashboard draws them (docs/api.md, "Dashboard")."""
        return await request.app.state.dashboard.status(tenant)

    return routes
