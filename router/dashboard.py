"""The router's dashboard status: the whole fleet, as this replica sees it and as each worker reports.

``RouterStatus`` is ``app.state.dashboard`` on ``agentrt router`` (``agentrt/dashboard.py`` serves the
page and the JSON). For each worker registered in Redis (contract 3):

* ``state``: ``up`` (live in this replica's routing table), ``draining`` (the worker says so),
  ``down`` (registered, heartbeat expired or marked dead after a failed connection) or
  ``unreachable`` (live, but its ``/internal/status`` did not answer within ``timeout_s``);
* the worker's own numbers from ``GET /internal/status`` (``router/worker_api.py``): load, KV use per
  tier, ``cached_blocks`` (its prefix cache's blocks), prompt and cached token totals and hit rate;
* this replica's view: ``indexed_blocks`` (blocks the global prefix index holds for it, from its KV
  events: equal to ``cached_blocks`` once events are applied), ``in_flight`` (requests this replica
  sent it) and the age of its last load report.

``routing`` is the replica's ``DecisionLog`` (``router/decisions.py``), ``sessions`` the Redis store's,
``series`` the replica's own TTFT and hit rate (what its clients saw, every worker together). The fleet
part is read at most once per ``cache_s`` whoever asks, so many open dashboards cost the workers one
poll each per interval.

The same per-worker figures are on the router's ``/metrics`` (``router/metrics.py``):
``agentrt_router_worker_indexed_blocks{worker}`` and ``agentrt_router_worker_in_flight{worker}``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import redis.asyncio as aioredis

from agentrt.dashboard import session_summary, sees_all, status_body
from agentrt.core.tenants import Tenant
from router.core import RouterCore
from router.decisions import KINDS

RECENT = 50  # decisions the JSON carries


class RouterStatus:
    def __init__(self, state: Any, core: RouterCore, timeout_s: float = 2.0, cache_s: float = 1.0) -> None:
        self.state = state  # the app's Services (agentrt/server.py): sessions, tenants, metrics, generator
        self.core = core
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._workers: list[dict[str, Any]] = []
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()

    async def workers(self) -> list[dict[str, Any]]:
        async with self._lock:
            if time.monotonic() - self._read_at >= self.cache_s:
                self._workers = await self._read_workers()
                self._read_at = time.monotonic()
            return [dict(w) for w in self._workers]

    async def _read_workers(self) -> list[dict[str, Any]]:
        core, cfg = self.core, self.core.config
        live = dict(core.workers)
        try:
            registered = {m.decode() for m in await core.redis.smembers(cfg.workers_set_key)}
            urls = {}
            for wid in sorted(registered - set(live)):
                raw = await core.redis.hget(cfg.worker_key(wid), "url")
                urls[wid] = raw.decode() if raw else None
        except (aioredis.RedisError, OSError):  # Redis away: the live workers this replica routes to
            registered, urls = set(), {}
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            answers = await asyncio.gather(*(self._ask(http, w.url) for w in live.values()))
        by_id = dict(zip(live, answers))
        out = []
        now_ms = int(time.time() * 1000)
        for wid in sorted(registered | set(live)):
            if wid in live:
                info = by_id[wid]
                w = info if info is not None else {"id": wid, "state": "unreachable", "url": live[wid].url}
                w["id"], w["url"] = wid, live[wid].url
                load = core.loads.get(wid)
                w["load_report_age_ms"] = max(0, now_ms - load.ts_ms) if load is not None and load.ts_ms else None
            else:
                w = {"id": wid, "state": "down", "url": urls.get(wid), "load_report_age_ms": None}
            w.setdefault("load", None)
            w.setdefault("kv", {})
            for key in ("cached_blocks", "pins", "prompt_tokens_total", "cached_tokens_total", "hit_rate"):
                w.setdefault(key, None)
            w["indexed_blocks"] = core.index.blocks_of(wid)
            w["router_in_flight"] = core.inflight.count(wid)
            out.append(w)
        return out

    @staticmethod
    async def _ask(http: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
        try:
            resp = await http.get(url + "/internal/status")
            resp.raise_for_status()
            body = resp.json()
            return body if isinstance(body, dict) else None
        except (httpx.HTTPError, ValueError):
            return None

    def routing(self, caller: Tenant) -> dict[str, Any]:
        log = self.core.decision_log
        salts = None if sees_all(self.state.tenants) else frozenset({caller.cache_salt})
        recent = log.recent(RECENT, cache_salts=salts)
        return {"policy": self.core.policy.name, "kinds": list(KINDS), "counts": dict(log.counts),
                "recent": [r.as_json() for r in recent]}

    async def status(self, tenant: Tenant) -> dict[str, Any]:
        s = self.state
        workers = await self.workers()
        sessions = await session_summary(s.sessions.store, s.tenants, tenant)
        return status_body("router", s.generator.model_name, tenant, s.tenants, workers, sessions,
                           self.routing(tenant), s.metrics.timeline, s.generator.config)
