"""Redis session store: records, idempotent turns across two clients, bounded decoding."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.session_store import (RedisSessionStore, SessionDecodeError, SessionExists,
                                  SessionNotFound, SessionRecord, TooManySessions)


async def _stores(url, n=2, **cfg):
    config = RouterConfig(redis_url=url, **cfg)
    clients = [aioredis.Redis.from_url(url) for _ in range(n)]
    return clients, [RedisSessionStore(c, config) for c in clients]


async def _close(clients):
    for c in clients:
        await c.aclose()


def test_create_get_list_delete(redis_url):
    async def body():
        clients, (store, _) = await _stores(redis_url)
        rec = await store.create(SessionRecord("s1", tenant="acme", model="m",
                                               messages=[{"role": "system", "content": "hi"}]))
        await store.create(SessionRecord("s2", tenant="other"))
        with pytest.raises(SessionExists):
            await store.create(SessionRecord("s1"))
        got = await store.get("s1")
        listed = (await store.list(), await store.list(tenant="acme"), await store.list(limit=1))
        deleted = (await store.delete("s1"), await store.delete("s1"))
        with pytest.raises(SessionNotFound):
            await store.get("s1")
        await _close(clients)
        return rec, got, listed, deleted
    rec, got, listed, deleted = asyncio.run(body())
    assert got == rec and got.created_ms > 0
    assert sorted(listed[0]) == ["s1", "s2"] and listed[1] == ["s1"] and len(listed[2]) == 1
    assert deleted == (True, False)


def test_same_turn_from_two_routers_appends_once(redis_url):
    user = [{"role": "user", "content": "what is 2+2?"}]

    async def body():
        clients, (a, b) = await _stores(redis_url)
        await a.create(SessionRecord("s1"))
        results = await asyncio.gather(
            *[store.append_turn_once("s1", "turn-1", user, {"role": "assistant", "content": f"4 ({i})"},
                                     last_worker=f"w{i}")
              for i, store in enumerate([a, b] * 5)])
        final = await b.get("s1")
        await _close(clients)
        return results, final
    results, final = asyncio.run(body())
    assert sum(new for _, new in results) == 1
    winner = next(rec for rec, new in results if new)
    assert final.turn == 1 and len(final.messages) == 2
    assert final.messages[1] == winner.turns["turn-1"]
    assert all(rec.turns["turn-1"] == final.turns["turn-1"] for rec, _ in results)


def test_distinct_turns_from_two_routers_all_land(redis_url):
    async def body():
        clients, (a, b) = await _stores(redis_url)
        await a.create(SessionRecord("s1"))
        await asyncio.gather(*[
            store.append_turn_once("s1", f"t{i}", [{"role": "user", "content": str(i)}],
                                   {"role": "assistant", "content": str(i)})
            for i, store in enumerate([a, b] * 6)])
        final = await a.get("s1")
        await _close(clients)
        return final
    final = asyncio.run(body())
    assert final.turn == 12 and len(final.messages) == 24 and len(final.turns) == 12


def test_missing_corrupt_and_oversized(redis_url):
    async def body():
        clients, (store, _) = await _stores(redis_url, session_max_bytes=1024)
        with pytest.raises(SessionNotFound):
            await store.append_turn_once("nope", "t", [], {})
        await clients[0].set(store.config.session_key("bad"), b"\x81\xa1v\x02")
        with pytest.raises(SessionDecodeError):
            await store.get("bad")
        await clients[0].set(store.config.session_key("big"), b"\x00" * 2048)
        with pytest.raises(SessionDecodeError, match="exceeds"):
            await store.get("big")
        with pytest.raises(ValueError, match="limit"):
            await store.create(SessionRecord("s", messages=[{"content": "x" * 2000}]))
        await store.create(SessionRecord("s1"))
        with pytest.raises(ValueError, match="turn_id"):
            await store.append_turn_once("s1", "", [], {})
        await _close(clients)
    asyncio.run(body())


def test_tenant_session_limit_holds_across_replicas(redis_url):
    """Two replicas racing for a tenant's last sessions: check and create are one step, so exactly the
    limit is created; deleting one (whichever replica) frees its place."""
    config = RouterConfig(redis_url=redis_url)

    async def body():
        clients, (a, b) = await _stores(redis_url)
        results = await asyncio.gather(*[(a if i % 2 else b).create(SessionRecord(f"s{i}", tenant="acme"),
                                                                    max_per_tenant=3)
                                         for i in range(10)], return_exceptions=True)
        created = [r.session_id for r in results if isinstance(r, SessionRecord)]
        refused = [r for r in results if isinstance(r, TooManySessions)]
        counts = (await a.count("acme"), await b.count("acme"))
        await a.create(SessionRecord("other-1", tenant="other"), max_per_tenant=3)  # its own count
        with pytest.raises(TooManySessions):
            await a.create(SessionRecord("late", tenant="acme"), max_per_tenant=3)
        await b.create(SessionRecord("unlimited", tenant="acme"))  # no limit given: none applies
        await b.delete("unlimited")
        assert await b.delete(created[0])  # the owner is read from the record
        await a.create(SessionRecord("after-delete", tenant="acme"), max_per_tenant=3)
        # A record removed behind the store's back (an older router, a manual DEL) is pruned at the limit.
        await clients[0].delete(config.session_key(created[1]))
        await b.create(SessionRecord("after-prune", tenant="acme"), max_per_tenant=3)
        final = (await a.count("acme"), await a.count("other"))
        await _close(clients)
        return created, refused, counts, final

    created, refused, counts, final = asyncio.run(body())
    assert len(created) == 3 and len(refused) == 7 and counts == (3, 3)
    assert refused[0].limit == 3 and "acme" in str(refused[0])
    assert final == (3, 1)
