"""Worker registry against a real redis-server: registration, heartbeat expiry, loads."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack
import pytest
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.registry import LoadReport, WorkerInfo, WorkerRegistry, decode_load, encode_load


@dataclasses.dataclass
class OldLoad:
    """``LoadReport`` as a dataclass, before it was a msgspec struct: its wire was ``asdict``'s map."""

    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    ts_ms: int = 0
    waiting_tokens: int = 0
    waiting_new: int = 0
    waiting_high: int = 0
    prefill_tokens_per_s: float = 0.0
    kv_bytes_per_token: int = 0
    kv_pull_bytes_per_s: float = 0.0


def run(coro):
    return asyncio.run(coro)


async def _with_registry(url, body, **cfg):
    client = aioredis.Redis.from_url(url)
    try:
        return await body(WorkerRegistry(client, RouterConfig(redis_url=url, **cfg)), client)
    finally:
        await client.aclose()


def info(wid="w1", **kw):
    return WorkerInfo(wid, f"http://127.0.0.1:9{wid[-1]}00", "smollm2", capacity=8, kv_pages=1024, **kw)


def test_register_then_live(redis_url):
    async def body(reg, _):
        await reg.register(info("w1"))
        await reg.register(info("w2"))
        return await reg.live_workers()
    live = run(_with_registry(redis_url, body))
    assert [w.worker_id for w in live] == ["w1", "w2"]
    assert live[0] == info("w1")


def test_heartbeat_expiry_and_return(redis_url):
    async def body(reg, _):
        await reg.register(info("w1"))
        await reg.register(info("w2"))
        deadline = time.monotonic() + 10
        while len(await reg.live_workers()) == 2:  # w1 stops beating, w2 keeps going
            await reg.heartbeat("w2")
            if time.monotonic() > deadline:
                raise AssertionError("heartbeat never expired")
            await asyncio.sleep(0.05)
        after_expiry = [w.worker_id for w in await reg.live_workers()]
        await reg.register(info("w1"))  # the worker comes back
        return after_expiry, [w.worker_id for w in await reg.live_workers()]
    after_expiry, back = run(_with_registry(redis_url, body, heartbeat_ttl_s=0.3,
                                            heartbeat_interval_s=0.1))
    assert after_expiry == ["w2"]
    assert back == ["w1", "w2"]


def test_heartbeat_loop_keeps_worker_live(redis_url):
    async def body(reg, _):
        await reg.register(info("w1"))
        task = asyncio.create_task(reg.heartbeat_loop("w1", lambda: LoadReport(running=2)))
        await asyncio.sleep(0.6)  # two TTLs: only the loop keeps it alive
        live = [w.worker_id for w in await reg.live_workers()]
        task.cancel()
        return live, await reg.loads(["w1"])
    live, loads = run(_with_registry(redis_url, body, heartbeat_ttl_s=0.3, heartbeat_interval_s=0.05))
    assert live == ["w1"]
    assert loads["w1"].running == 2


def test_loads_and_mark_dead(redis_url):
    async def body(reg, client):
        await reg.register(info("w1"))
        await reg.register(info("w2"))
        await reg.heartbeat("w1", LoadReport(running=3, waiting=1, pages_used=10, pages_free=90, waiting_tokens=40))
        await client.set(reg.config.load_key("w2"), b"\xc1garbage")
        loads = await reg.loads(["w1", "w2", "w3"])
        await reg.mark_dead("w1")
        return loads, [w.worker_id for w in await reg.live_workers()]
    loads, live = run(_with_registry(redis_url, body))
    assert loads == {"w1": LoadReport(running=3, waiting=1, pages_used=10, pages_free=90,
                                      ts_ms=0, waiting_tokens=40)}
    assert live == ["w2"]


def test_unregister_and_malformed_registration(redis_url):
    async def body(reg, client):
        await reg.register(info("w1"))
        await reg.register(info("w2"))
        await client.hdel(reg.config.worker_key("w2"), "url")
        await reg.unregister("w1")
        return [w.worker_id for w in await reg.live_workers()]
    assert run(_with_registry(redis_url, body)) == []


def test_bad_input_is_rejected(redis_url):
    with pytest.raises(ValueError, match="url"):
        WorkerInfo("w1", "ftp://x", "m")
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo("a:b", "http://x", "m")
    for bad, why in (({"running": -1}, r"`int` >= 0 - at `\$.running`"),
                     ({"waiting": True}, r"got `bool` - at `\$.waiting`"),
                     ({"kv_pull_bytes_per_s": float("nan")}, r"`float` >= 0.0 - at `\$.kv_pull_bytes_per_s`"),
                     ({"ts_ms": 1.5}, r"got `float` - at `\$.ts_ms`"), ({"newer": 1}, "unknown field `newer`"),
                     ([1, 2], "Expected `object`, got `array`")):
        with pytest.raises(ValueError, match=why):
            decode_load(msgpack.packb(bad))
    old_wire = msgpack.packb(dataclasses.asdict(OldLoad(running=2, prefill_tokens_per_s=3, ts_ms=5)))
    assert decode_load(old_wire) == LoadReport(running=2, prefill_tokens_per_s=3.0, ts_ms=5)
    assert msgpack.unpackb(encode_load(LoadReport(waiting=4))) == dataclasses.asdict(OldLoad(waiting=4))
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        RouterConfig(heartbeat_ttl_s=1, heartbeat_interval_s=2)

    async def body(reg, _):
        await reg.register(info("w1", block_size=32))
    with pytest.raises(ValueError, match="contract 1"):
        run(_with_registry(redis_url, body))
