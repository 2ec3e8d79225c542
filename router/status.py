"""``agentrt status``: workers (alive, load, cached blocks, hit rate, KV tiers) and sessions.

Hit rates and KV tier metrics (engine/kv_tier.py: pages, hit tokens, loads, load time, bytes
written and read, per tier) come from each live worker's ``/get_load`` (totals since it
started); everything else from the Redis keys of contract 3.
"""

from __future__ import annotations

from typing import Any

import httpx
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.registry import WorkerRegistry


async def collect_status(config: RouterConfig) -> dict[str, Any]:
    client = aioredis.Redis.from_url(config.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0)
    try:
        registry = WorkerRegistry(client, config)
        registered = sorted(m.decode() for m in await client.smembers(config.workers_set_key))
        live = {w.worker_id: w for w in await registry.live_workers()}
        loads = await registry.loads(list(live))
        workers = []
        async with httpx.AsyncClient(timeout=3.0) as http:
            for wid in registered:
                info = live.get(wid)
                record = {k.decode(): v.decode() for k, v in (await client.hgetall(config.worker_key(wid))).items()}
                load = loads.get(wid)
                entry = {"id": wid, "alive": info is not None, "url": record.get("url"), "model": record.get("model"),
                         "cached_blocks": await client.scard(config.snapshot_key(wid)),
                         "running": load.running if load else None, "waiting": load.waiting if load else None,
                         "pages_used": load.pages_used if load else None,
                         "pages_free": load.pages_free if load else None, "hit_rate": None}
                if info is not None:
                    entry.update(await _totals(http, info.url))
                workers.append(entry)
        prompt = sum(w.get("prompt_tokens_total") or 0 for w in workers)
        cached = sum(w.get("cached_tokens_total") or 0 for w in workers)
        return {"redis": config.redis_url, "deployment": config.deployment, "workers": workers,
                "sessions": await client.zcard(config.sessions_set_key),
                "events_in_stream": await client.xlen(config.events_stream_key),
                "hit_rate": cached / prompt if prompt else None}
    finally:
        await client.aclose()


async def _totals(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        load = (await http.get(url + "/get_load")).json()[0]
        prompt, cached = int(load["prompt_tokens_total"]), int(load["cached_tokens_total"])
        tiers = load.get("kv_tiers") or {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return {"reachable": False}
    return {"reachable": True, "prompt_tokens_total": prompt, "cached_tokens_total": cached,
            "hit_rate": cached / prompt if prompt else None, "kv_tiers": tiers}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_status(status: dict[str, Any]) -> str:
    lines = [f"redis {status['redis']}  deployment {status['deployment']}  sessions {status['sessions']}  "
             f"events in stream {status['events_in_stream']}  hit rate {_fmt(status['hit_rate'])}", ""]
    header = ("worker", "alive", "url", "running", "waiting", "pages used/free", "cached blocks", "hit rate")
    rows = [header] + [(w["id"], "yes" if w["alive"] else "no", _fmt(w["url"]), _fmt(w["running"]),
                        _fmt(w["waiting"]), f"{_fmt(w['pages_used'])}/{_fmt(w['pages_free'])}",
                        _fmt(w["cached_blocks"]), _fmt(w["hit_rate"])) for w in status["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)) for r in rows]
    if not status["workers"]:
        lines.append("(no worker registered)")
    tiers = [(w["id"], medium, t) for w in status["workers"] for medium, t in (w.get("kv_tiers") or {}).items()]
    if tiers:
        header = ("worker", "tier", "on", "pages", "hit tokens", "loads", "load s", "written MB", "read MB",
                  "corrupt", "errors")
        rows = [header] + [(wid, medium, "yes" if t.get("enabled", True) else "OFF",
                            f"{t['pages']}/{t['capacity_pages']}", str(t["hit_tokens"]), str(t["loads"]),
                            f"{t['load_time_s']:.3f}", f"{t['bytes_written'] / 1e6:.1f}",
                            f"{t['bytes_read'] / 1e6:.1f}", str(t["corrupt"]), str(t["errors"]))
                           for wid, medium, t in tiers]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["", "KV tiers"] + ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)
