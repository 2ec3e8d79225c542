"""A router with no live worker holds a request briefly for one to register (the registry comes back
empty from a Redis restart until the workers' next heartbeats) instead of failing it at once.

A real ``RouterCore`` and ``RemoteEngine`` over a real ``redis-server``; the worker is a registered
record (choosing a worker needs no worker process)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis.asyncio as aioredis

from agentrt.core.errors import APIError
from router.config import RouterConfig
from router.core import RouterCore
from router.registry import WorkerInfo, WorkerRegistry
from router.remote import RemoteEngine

PROMPT = list(range(100, 164))


async def _register(cfg: RouterConfig, wid: str) -> None:
    client = aioredis.Redis.from_url(cfg.redis_url)
    await WorkerRegistry(client, cfg).register(WorkerInfo(wid, f"http://127.0.0.1:9/{wid}", "m", 4, 512, cfg.block_size))
    await client.aclose()


@contextlib.asynccontextmanager
async def _router(cfg: RouterConfig, no_worker_wait_s: float):
    """A started ``RouterCore`` (refreshing every 0.1 s) and a ``RemoteEngine`` over it, stopped after."""
    core = RouterCore(cfg, "m", refresh_interval_s=0.1)
    await core.start()
    remote = RemoteEngine(core, 2048, no_worker_wait_s=no_worker_wait_s)
    try:
        yield core, remote
    finally:
        await remote.shutdown()
        await core.stop()


def test_a_request_waits_for_a_worker_to_register(redis_url):
    cfg = RouterConfig(redis_url=redis_url, deployment="nowait-1")

    async def body():
        async with _router(cfg, 5.0) as (core, remote):
            assert not core.workers
            route = asyncio.create_task(remote._route("req-1", PROMPT, 8, None, set(), ""))
            await asyncio.sleep(0.5)
            assert not route.done()  # held, not failed
            await _register(cfg, "w-late")
            chosen = await asyncio.wait_for(route, 5.0)
            assert chosen.worker.worker_id == "w-late"

    asyncio.run(body())


def test_without_a_worker_the_request_fails_after_the_wait_and_a_retry_fails_at_once(redis_url):
    cfg = RouterConfig(redis_url=redis_url, deployment="nowait-2")

    async def body():
        async with _router(cfg, 0.6) as (core, remote):
            t = time.monotonic()
            with pytest.raises(APIError) as err:
                await remote._route("req-1", PROMPT, 8, None, set(), "")
            assert err.value.status == 503 and err.value.code == "no_worker_available"
            assert time.monotonic() - t >= 0.6
            await _register(cfg, "w0")
            await asyncio.sleep(0.3)  # the refresh sees it
            remote.no_worker_wait_s = 60.0
            # w0 already failed for this request: the retry does not wait (it would take the 60 s)
            with pytest.raises(APIError) as err:
                await asyncio.wait_for(remote._route("req-2", PROMPT, 8, None, {"w0"}, ""), 30.0)
            assert err.value.code == "no_worker_available"

    asyncio.run(body())
