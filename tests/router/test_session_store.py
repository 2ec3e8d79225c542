"""The session store: the ``SessionStore`` contract run against both implementations (in-memory and
Redis), then the Redis store's own: idempotent turns across two clients, bounded decoding, the
tenant limit across replicas."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from agentrt.core.store import (InMemorySessionStore, SessionDecodeError, SessionExists, SessionNotFound, SessionRecord,
                           SessionTooLarge, TenantSessionLimitReached, TurnRecord)
from router.config import RouterConfig
from router.redis_store import RedisSessionStore


def reply(turn_id: str, content: str = "ok", pin_id: str | None = None) -> TurnRecord:
    return TurnRecord(turn_id=turn_id, index=1, message={"role": "assistant", "content": content},
                      finish_reason="stop", prompt_tokens=3, completion_tokens=1, cached_tokens=0, created_at=1.0,
                      pin_id=pin_id)


async def _stores(url, n=2, worker_of=None, **cfg):
    config = RouterConfig(redis_url=url, **cfg)
    clients = [aioredis.Redis.from_url(url) for _ in range(n)]
    return clients, [RedisSessionStore(c, config, worker_of) for c in clients]


async def _close(clients):
    for c in clients:
        await c.aclose()


# ------------------------------------------------------------ the contract, on both stores

@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_store_contract(kind, request):
    async def body():
        if kind == "memory":
            clients, store = [], InMemorySessionStore()
        else:
            clients, (store,) = await _stores(request.getfixturevalue("redis_url"), n=1)
        try:
            rec = await store.create(SessionRecord(id="s1", model="m", tenant="acme", tools=[{"type": "function"}]))
            with pytest.raises(SessionExists):
                await store.create(SessionRecord(id="s1", model="m"))
            with pytest.raises(TenantSessionLimitReached):
                await store.create(SessionRecord(id="s2", model="m", tenant="acme"), max_tenant_sessions=1)
            with pytest.raises(ValueError):
                await store.create(SessionRecord(id="s2", model="m"), max_tenant_sessions=0)
            got = await store.get("s1")
            assert got == rec and await store.get("nope") is None
            got.messages.append({"role": "user", "content": "a copy"})
            user = [{"role": "user", "content": "hi"}]
            first = await store.append_turn_once("s1", "t1", user, reply("t1"))
            again = await store.append_turn_once("s1", "t1", user, reply("t1", "other"))
            assert first[1] and not again[1] and first[0] == again[0] == await store.get("s1")
            assert again[0].messages == user + [{"role": "assistant", "content": "ok"}]
            assert again[0].last_active_at >= rec.last_active_at and again[0].find_turn("t1") == reply("t1")
            with pytest.raises(ValueError, match="turn_id"):
                await store.append_turn_once("s1", "t2", user, reply("t3"))
            with pytest.raises(SessionNotFound):
                await store.append_turn_once("nope", "t1", user, reply("t1"))
            updated = await store.update_turn("s1", "t1", response={"id": "resp_1"}, pin_id=None)
            assert updated == await store.get("s1") and updated.find_turn("t1").response == {"id": "resp_1"}
            assert updated.messages == again[0].messages and updated.last_active_at == again[0].last_active_at
            assert await store.update_turn("s1", "nope", response=None) is None
            for bad in ({"turn_id": "t9"}, {"index": 0}, {"unknown": 1}):
                with pytest.raises(ValueError):
                    await store.update_turn("s1", "t1", **bad)
            with pytest.raises(SessionNotFound):
                await store.update_turn("nope", "t1", response=None)
            assert await store.update_turn("s1", "t1", response=None) == first[0]  # as it was
            await store.create(SessionRecord(id="s3", model="m"))
            assert [r.id for r in await store.list()] == ["s3", "s1"]  # most recently active first
            assert [r.id for r in await store.list(tenant="acme")] == ["s1"] and len(await store.list(limit=1)) == 1
            assert (await store.count("acme"), await store.count("default"), await store.count("none")) == (1, 1, 0)
            lock = await store.lock_turn("s1")
            assert lock is not None and await store.lock_turn("s1") is None and await store.turn_locked("s1")
            await lock.release()
            await lock.release()  # idempotent
            assert not await store.turn_locked("s1")
            assert (await store.delete("s1")) == first[0] and await store.delete("s1") is None
            assert await store.get("s1") is None and await store.count("acme") == 0
        finally:
            await _close(clients)
    asyncio.run(body())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_open_turn_and_the_append_that_releases_its_lock(kind, request):
    """A turn's two touches of the store: ``open_turn`` (the record, and the lock when free) and
    ``append_turn_once(lock=...)`` (the turn and the lock's release in one step). A release after it does
    nothing: it must not free the lock of the turn that took it since."""
    async def body():
        if kind == "memory":
            clients, store, other = [], InMemorySessionStore(), None
        else:
            clients, (store, other) = await _stores(request.getfixturevalue("redis_url"), n=2)
        other = other or store
        try:
            assert await store.open_turn("nope") == (None, None) and not await store.turn_locked("nope")
            rec = await store.create(SessionRecord(id="s1", model="m"))
            got, lock = await store.open_turn("s1")
            assert got == rec and lock is not None and await store.turn_locked("s1")
            again, none = await other.open_turn("s1")      # a second turn: the record, no lock
            assert again == rec and none is None
            user = [{"role": "user", "content": "hi"}]
            new, appended = await store.append_turn_once("s1", "t1", user, reply("t1"), lock=lock)
            assert appended and new == await store.get("s1") and not await store.turn_locked("s1")
            got, lock2 = await other.open_turn("s1")       # the next turn gets it at once
            assert got == new and lock2 is not None
            await lock.release()                           # the first turn's late release: nothing
            assert await store.turn_locked("s1")
            # a turn recorded already (a concurrent retry): nothing written, the lock released all the same
            same, appended = await other.append_turn_once("s1", "t1", user, reply("t1", "other"), lock=lock2)
            assert not appended and same == new and not await store.turn_locked("s1")
        finally:
            await _close(clients)
    asyncio.run(body())


def test_an_append_leaves_a_lock_it_no_longer_holds(redis_url):
    """The lock expired while the turn ran and another turn took it: the append records the turn and
    leaves the other turn's lock where it is (compare-and-delete under WATCH)."""
    async def body():
        clients, (store, other) = await _stores(redis_url)
        try:
            await store.create(SessionRecord(id="s1", model="m"))
            _, lock = await store.open_turn("s1")
            await clients[0].delete(store.config.turn_lock_key("s1"))   # as if it expired
            _, theirs = await other.open_turn("s1")
            assert theirs is not None
            _, appended = await store.append_turn_once("s1", "t1", [{"role": "user", "content": "hi"}],
                                                       reply("t1"), lock=lock)
            assert appended and await store.turn_locked("s1")
            assert await clients[0].get(store.config.turn_lock_key("s1")) == theirs.token.encode()
            await theirs.release()
            assert not await store.turn_locked("s1")
        finally:
            await _close(clients)
    asyncio.run(body())


# ------------------------------------------------------------ Redis

def test_create_get_list_delete(redis_url):
    async def body():
        clients, (store, _) = await _stores(redis_url)
        rec = await store.create(SessionRecord(id="s1", tenant="acme", model="m",
                                               messages=[{"role": "system", "content": "hi"}]))
        await store.create(SessionRecord(id="s2", model="m", tenant="other"))
        with pytest.raises(SessionExists):
            await store.create(SessionRecord(id="s1", model="m"))
        got = await store.get("s1")
        listed = [[r.id for r in records] for records in
                  (await store.list(), await store.list(tenant="acme"), await store.list(limit=1))]
        deleted = (await store.delete("s1"), await store.delete("s1"))
        gone = await store.get("s1")
        await _close(clients)
        return rec, got, listed, deleted, gone
    rec, got, listed, deleted, gone = asyncio.run(body())
    assert got == rec and got.created_at > 0
    assert sorted(listed[0]) == ["s1", "s2"] and listed[1] == ["s1"] and len(listed[2]) == 1
    assert deleted == (got, None) and gone is None


def test_same_turn_from_two_routers_appends_once(redis_url):
    user = [{"role": "user", "content": "what is 2+2?"}]

    async def body():
        clients, (a, b) = await _stores(redis_url, worker_of=lambda pin: "w" + pin.removeprefix("req-"))
        await a.create(SessionRecord(id="s1", model="m"))
        results = await asyncio.gather(
            *[store.append_turn_once("s1", "turn-1", user, reply("turn-1", f"4 ({i})", pin_id=f"req-{i}"))
              for i, store in enumerate([a, b] * 5)])
        final = await b.get("s1")
        await _close(clients)
        return results, final
    results, final = asyncio.run(body())
    assert sum(new for _, new in results) == 1
    winner = next(rec for rec, new in results if new)
    assert len(final.turns) == 1 and len(final.messages) == 2
    assert final.messages[1] == winner.find_turn("turn-1").message
    assert all(rec.find_turn("turn-1") == final.find_turn("turn-1") for rec, _ in results)
    assert final.last_worker == "w" + final.turns[0].pin_id.removeprefix("req-")  # where the winner ran


def test_distinct_turns_from_two_routers_all_land(redis_url):
    async def body():
        clients, (a, b) = await _stores(redis_url)
        await a.create(SessionRecord(id="s1", model="m"))
        await asyncio.gather(*[
            store.append_turn_once("s1", f"t{i}", [{"role": "user", "content": str(i)}], reply(f"t{i}", str(i)))
            for i, store in enumerate([a, b] * 6)])
        final = await a.get("s1")
        await _close(clients)
        return final
    final = asyncio.run(body())
    assert len(final.turns) == 12 and len(final.messages) == 24 and len({t.turn_id for t in final.turns}) == 12


def test_missing_corrupt_and_oversized(redis_url):
    async def body():
        clients, (store, _) = await _stores(redis_url, session_max_bytes=1024)
        with pytest.raises(SessionNotFound):
            await store.append_turn_once("nope", "t", [], reply("t"))
        await clients[0].set(store.config.session_key("bad"), b"\x81\xa1v\x02")
        with pytest.raises(SessionDecodeError):
            await store.get("bad")
        await clients[0].set(store.config.session_key("big"), b"\x00" * 2048)
        with pytest.raises(SessionDecodeError, match="exceeds"):
            await store.get("big")
        with pytest.raises(SessionTooLarge, match="limit"):
            await store.create(SessionRecord(id="s", model="m", messages=[{"content": "x" * 2000}]))
        await store.create(SessionRecord(id="s1", model="m"))
        with pytest.raises(ValueError, match="turn_id"):
            await store.append_turn_once("s1", "", [], reply(""))
        assert store.bad_records == 2
        await _close(clients)
    asyncio.run(body())


def test_tenant_session_limit_holds_across_replicas(redis_url):
    """Two replicas racing for a tenant's last sessions: check and create are one step, so exactly the
    limit is created; deleting one (whichever replica) frees its place."""
    config = RouterConfig(redis_url=redis_url)

    async def body():
        clients, (a, b) = await _stores(redis_url)
        results = await asyncio.gather(*[(a if i % 2 else b).create(SessionRecord(id=f"s{i}", model="m", tenant="acme"),
                                                                    max_tenant_sessions=3)
                                         for i in range(10)], return_exceptions=True)
        created = [r.id for r in results if isinstance(r, SessionRecord)]
        refused = [r for r in results if isinstance(r, TenantSessionLimitReached)]
        counts = (await a.count("acme"), await b.count("acme"))
        await a.create(SessionRecord(id="other-1", model="m", tenant="other"), max_tenant_sessions=3)  # its own count
        with pytest.raises(TenantSessionLimitReached):
            await a.create(SessionRecord(id="late", model="m", tenant="acme"), max_tenant_sessions=3)
        await b.create(SessionRecord(id="unlimited", model="m", tenant="acme"))  # no limit given: none applies
        await b.delete("unlimited")
        assert await b.delete(created[0])  # the owner is read from the record
        await a.create(SessionRecord(id="after-delete", model="m", tenant="acme"), max_tenant_sessions=3)
        # A record removed behind the store's back (an older router, a manual DEL) is pruned at the limit.
        await clients[0].delete(config.session_key(created[1]))
        await b.create(SessionRecord(id="after-prune", model="m", tenant="acme"), max_tenant_sessions=3)
        final = (await a.count("acme"), await a.count("other"))
        await _close(clients)
        return created, refused, counts, final

    created, refused, counts, final = asyncio.run(body())
    assert len(created) == 3 and len(refused) == 7 and counts == (3, 3)
    assert refused[0].limit == 3 and "acme" in str(refused[0])
    assert final == (3, 1)


def test_a_turns_slo_outcome_survives_the_record_and_older_records_read_as_not_recorded():
    """``in_slo`` is the one boolean field of a record: True/False/None round-trip; an integer there is
    refused as a bool would be anywhere else; a turn written before the field reads as None."""
    import msgpack

    from router.redis_store import decode_record, encode_record

    turns = [TurnRecord(f"t{i}", i, {"role": "assistant", "content": "ok"}, "stop", 10, 2, 0, 0.0, in_slo=v)
             for i, v in enumerate((True, False, None))]
    again = decode_record(encode_record(SessionRecord(id="s", model="m", turns=turns)), 1 << 20)
    assert [t.in_slo for t in again.turns] == [True, False, None]
    obj = msgpack.unpackb(encode_record(SessionRecord(id="s", model="m", turns=turns[:1])), raw=False)
    obj["turns"][0]["in_slo"] = 1
    with pytest.raises(SessionDecodeError, match=r"Expected `bool \| null`, got `int` - at `\$.turns\[0\].in_slo`"):
        decode_record(msgpack.packb(obj), 1 << 20)
    del obj["turns"][0]["in_slo"]
    assert decode_record(msgpack.packb(obj), 1 << 20).turns[0].in_slo is None
    obj["turns"][0]["prompt_tokens"] = True  # still no bool where the field is an int
    with pytest.raises(SessionDecodeError, match=r"Expected `int`, got `bool` - at `\$.turns\[0\].prompt_tokens`"):
        decode_record(msgpack.packb(obj), 1 << 20)
