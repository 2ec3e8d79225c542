"""State router replicas share through Redis: tentative prefix entries, the session turn lock, and
the workers of conversations named by an affinity key.

Real ``RouterCore`` replicas and real stores over a real ``redis-server``; the workers are
registered records (routing decisions need no worker process), KV events come from a real
``KVEventPublisher``.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.core import RouterCore
from router.events import KVEventPublisher
from router.redis_store import RedisSessionStore
from router.registry import WorkerInfo, WorkerRegistry

SYSTEM = list(range(1000, 1000 + 64 * 16))  # a 64-block agent prompt shared by two sessions


async def _replicas(cfg: RouterConfig, n: int = 2) -> list[RouterCore]:
    client = aioredis.Redis.from_url(cfg.redis_url)
    registry = WorkerRegistry(client, cfg)
    for wid in ("w0", "w1", "w2"):
        await registry.register(WorkerInfo(wid, f"http://127.0.0.1:9/{wid}", "m", 4, 512, cfg.block_size))
    await client.aclose()
    cores = [RouterCore(cfg, "m") for _ in range(n)]
    for core in cores:
        await core.start()
    return cores


@contextlib.asynccontextmanager
async def _one_replica(cfg: RouterConfig):
    """One started replica over w0-w2 and a Redis client; both closed at the end (a replica the test already
    stopped is stopped again: ``stop`` tolerates it)."""
    (a,) = await _replicas(cfg, 1)
    client = aioredis.Redis.from_url(cfg.redis_url)
    try:
        yield a, client
    finally:
        await client.aclose()
        await a.stop()


async def _settle(*cores: RouterCore) -> None:
    for core in cores:
        await asyncio.gather(*list(core._background))


def test_a_dispatched_prefix_steers_other_replicas_until_it_fails(redis_url):
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        a, b = await _replicas(cfg)
        try:
            first = await a.choose("req-1", SYSTEM + [1, 2, 3] * 20, 16)
            assert first.decision.reason == "fallback" and first.known_blocks == 0
            await a.dispatched(first)
            holder = first.worker.worker_id
            # Replica b never routed req-1 and no worker reported its prompt: the Redis entries place
            # a second session with the same agent prompt on the same worker.
            second = await b.choose("req-2", SYSTEM + [4, 5, 6] * 20, 16)
            assert second.worker.worker_id == holder and second.decision.cached_blocks == 64
            assert second.decision.reason != "fallback" and b.tentative_routes == 1
            # req-1 fails: its entries are dropped (compare-and-delete), so nothing steers to the holder.
            a.completed(first, ok=False)
            await _settle(a)
            r = redis.Redis.from_url(redis_url)
            assert not r.exists(cfg.tentative_key(first.request.hashes[0]))
            r.close()
            third = await b.choose("req-3", SYSTEM + [7, 8, 9] * 20, 16)
            assert third.decision.reason == "fallback" and third.decision.cached_blocks == 0
            assert a.tentative.stats.failed == 1 and len(a.tentative) == 0
        finally:
            for core in (a, b):
                await core.stop()

    asyncio.run(body())


def test_concurrent_decisions_see_each_other(redis_url):
    """Eight requests routed at once (4 agent prompts x 2) on one replica: each decision sees the
    ones before it, so sessions of one agent meet on one worker and new agents spread over all."""
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        (a,) = await _replicas(cfg, 1)
        try:
            async def route(i: int):
                agent = i % 4
                prompt = [5000 * (agent + 1) + t for t in range(64 * 16)] + [i] * 40
                r = await a.choose(f"req-{i}", prompt, 16)
                await a.dispatched(r)
                return agent, r.worker.worker_id
            placed = await asyncio.gather(*(route(i) for i in range(8)))
        finally:
            await a.stop()
        by_agent: dict[int, set[str]] = {}
        for agent, wid in placed:
            by_agent.setdefault(agent, set()).add(wid)
        assert all(len(w) == 1 for w in by_agent.values()), placed
        assert {wid for _, wid in placed} == {"w0", "w1", "w2"}, placed
        assert a.decisions.get("fallback") == 4 and a.tentative_routes == 4, a.decisions

    asyncio.run(body())


def test_stored_events_confirm_entries_and_completion_shortens_them(redis_url):
    cfg = RouterConfig(redis_url=redis_url, tentative_grace_s=0.3)

    async def body():
        (a,) = await _replicas(cfg, 1)
        pub = None
        try:
            route = await a.choose("req-1", SYSTEM + [1] * 40, 16)
            await a.dispatched(route)
            wid = route.worker.worker_id
            assert len(a.tentative) == len(route.tentative_hashes) == 66
            # In Redis for the other replicas: every block's key names the worker, with the entry's TTL.
            r = redis.Redis.from_url(redis_url)
            keys = [cfg.tentative_key(h) for h in route.tentative_hashes]
            assert r.mget(keys) == [wid.encode()] * 66
            assert all(cfg.tentative_ttl_s * 1000 - 5_000 < r.pttl(k) <= cfg.tentative_ttl_s * 1000 for k in keys)
            r.close()
            # The worker reports the first 64 blocks: they move from tentative to the real index.
            pub = KVEventPublisher(cfg, wid, redis.Redis.from_url(redis_url))
            pub.start()
            pub.publish("stored", list(route.request.hashes[:64]), None)
            pub.flush()
            for _ in range(100):
                if a.index.blocks_of(wid) == 64 and len(a.tentative) == 2:
                    break
                await asyncio.sleep(0.05)
            assert a.index.blocks_of(wid) == 64 and len(a.tentative) == 2
            assert a.tentative.stats.confirmed == 64
            # The request completes: its remaining keys live only for the grace period.
            a.completed(route, ok=True)
            await _settle(a)
            r = redis.Redis.from_url(redis_url)
            key = cfg.tentative_key(route.request.hashes[-1])
            assert 0 < r.pttl(key) <= 300
            await asyncio.sleep(0.4)
            assert not r.exists(key)
            r.close()
            again = await a.choose("req-2", SYSTEM + [1] * 40, 16)
            assert again.worker.worker_id == wid and again.known_blocks == 64 and again.decision.cached_blocks == 64
        finally:
            if pub is not None:
                pub.close()
            await a.stop()

    asyncio.run(body())


def test_turn_lock_is_exclusive_across_stores_renewed_and_released(redis_url):
    cfg = RouterConfig(redis_url=redis_url, turn_lock_ttl_s=0.3)

    async def body():
        c1, c2 = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
        s1 = RedisSessionStore(c1, cfg)
        s2 = RedisSessionStore(c2, cfg)
        try:
            lock = await s1.lock_turn("sess_a")
            assert lock is not None and await s2.lock_turn("sess_a") is None
            assert await s2.lock_turn("sess_b") is not None  # per session
            await asyncio.sleep(0.8)  # well past the TTL: renewal keeps it held
            assert await s2.turn_locked("sess_a") and await s2.lock_turn("sess_a") is None
            await lock.release()
            await lock.release()  # idempotent
            assert not await s2.turn_locked("sess_a")
            other = await s2.lock_turn("sess_a")
            assert other is not None
            # A stale holder cannot release someone else's lock (compare-and-delete on the token).
            assert not await s1.unlock_turn("sess_a", lock.token)
            assert await s1.turn_locked("sess_a")
            # A holder that dies (no renewal, no release) frees the session after the TTL.
            other._renewer.cancel()
            await asyncio.sleep(0.45)
            assert not await s1.turn_locked("sess_a")
        finally:
            await c1.aclose()
            await c2.aclose()

    asyncio.run(body())


def test_a_worker_back_from_a_hang_is_loaded_from_its_snapshot_at_once(redis_url):
    """A worker the router dropped (heartbeat expired while it hung) comes back with its cache
    intact and may publish no event for a long time: the router reloads its entries from the
    snapshot as soon as it is live again, so its sessions keep routing to it."""
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        (a,) = await _replicas(cfg, 1)
        pub = KVEventPublisher(cfg, "w1", redis.Redis.from_url(redis_url))
        client = aioredis.Redis.from_url(redis_url)
        try:
            pub.start()
            pub.publish("stored", a.hashes(SYSTEM), None)
            await asyncio.to_thread(pub.flush)
            for _ in range(200):
                if a.index.blocks_of("w1") == 64:
                    break
                await asyncio.sleep(0.01)
            assert a.index.blocks_of("w1") == 64
            await client.delete(cfg.heartbeat_key("w1"))  # the hang: its heartbeat expires
            await a.refresh()
            assert "w1" not in a.workers and a.index.blocks_of("w1") == 0
            await WorkerRegistry(client, cfg).heartbeat("w1")  # it resumes; no new KV event
            await a.refresh()
            assert "w1" in a.workers and a.index.blocks_of("w1") == 64
            route = await a.choose("req-back", SYSTEM + [1, 2, 3] * 20, 16)
            assert route.worker.worker_id == "w1" and route.decision.cached_blocks == 64
        finally:
            pub.close()
            await client.aclose()
            await a.stop()

    asyncio.run(body())


def test_a_conversations_worker_is_shared_by_replicas_and_its_ttl_refreshed(redis_url):
    """One replica records where an affinity-keyed conversation went; another reads it and routes the
    next request there as the conversation's last worker (soft affinity), also with no prefix known."""
    cfg = RouterConfig(redis_url=redis_url, affinity_ttl_s=30)

    async def body():
        a, b = await _replicas(cfg)
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await b.affinity.worker_of("aff_1") is None and b.affinity.stats.misses == 1
            await a.affinity.remember("aff_1", "w2")
            assert await b.affinity.worker_of("aff_1") == "w2" and b.affinity.stats.hits == 1
            await client.pexpire(cfg.affinity_key("aff_1"), 5_000)
            await b.affinity.remember("aff_1", "w2", previous="w2")  # each request refreshes the TTL
            assert 25_000 < await client.pttl(cfg.affinity_key("aff_1")) <= 30_000
            assert b.affinity.stats.moved == 0
            route = await b.choose("req-aff", SYSTEM + [4, 5, 6], 16, session_id="aff_1", last_worker="w2")
            assert route.worker.worker_id == "w2" and route.decision.reason == "affinity"
            # Its worker died: the policy goes elsewhere and the mapping follows, for every replica.
            await b.mark_dead("w2")
            moved = await b.choose("req-aff-2", SYSTEM + [4, 5, 6], 16, session_id="aff_1", last_worker="w2")
            assert moved.worker.worker_id != "w2"
            await b.affinity.remember("aff_1", moved.worker.worker_id, previous="w2")
            assert b.affinity.stats.moved == 1 and b.state()["affinity"]["moved"] == 1
            assert await a.affinity.worker_of("aff_1") == moved.worker.worker_id
            assert (await client.get(cfg.affinity_key("aff_1"))).decode() == moved.worker.worker_id
        finally:
            await client.aclose()
            for core in (a, b):
                await core.stop()

    asyncio.run(body())


def test_affinity_tolerates_redis_failures_and_can_be_turned_off(redis_url):
    from router.affinity import AffinityMap

    async def body():
        down = aioredis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)
        gone = AffinityMap(down, RouterConfig(redis_url=redis_url), redis_backoff_s=60)
        assert await gone.worker_of("aff_1") is None and gone.stats.redis_errors == 1
        await gone.remember("aff_1", "w0")  # within the back-off: not even tried
        assert await gone.worker_of("aff_1") is None and gone.stats.redis_errors == 1
        await down.aclose()
        client = aioredis.Redis.from_url(redis_url)
        off = AffinityMap(client, RouterConfig(redis_url=redis_url, affinity_ttl_s=0))
        assert not off.enabled
        await off.remember("aff_1", "w0")
        assert await off.worker_of("aff_1") is None and not await client.exists(off.config.affinity_key("aff_1"))
        await client.aclose()

    asyncio.run(body())


def test_a_refresh_in_flight_when_a_worker_is_marked_dead_does_not_bring_it_back(redis_url):
    """A refresh that read the live workers just before a request found one dead must not put it
    back: until the next refresh the router would send requests to a dead worker (each failing over
    and marking it dead again). It is live again once it heartbeats."""
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        async with _one_replica(cfg) as (a, client):
            real = a.registry.live_workers
            read, resume = asyncio.Event(), asyncio.Event()

            async def read_then_wait():
                live = await real()
                read.set()
                await resume.wait()
                return live
            try:
                a.registry.live_workers = read_then_wait
                refresh = asyncio.create_task(a.refresh())
                await read.wait()                       # the refresh found w1 live ...
                await a.mark_dead("w1")                 # ... then a request to it failed
                assert not await client.exists(cfg.heartbeat_key("w1"))
                resume.set()
                await refresh
                assert "w1" not in a.workers and {"w0", "w2"} <= set(a.workers)
                a.registry.live_workers = real
                await a.refresh()
                assert "w1" not in a.workers
                await WorkerRegistry(client, cfg).heartbeat("w1")  # it was only unreachable, and is back
                await a.refresh()
                assert "w1" in a.workers
            finally:
                resume.set()

    asyncio.run(body())


def test_a_request_failing_over_does_not_wait_for_the_dead_mark_to_reach_redis(redis_url):
    """``mark_dead(wait=False)`` (what a failing-over request calls) routes around the worker at once while the
    mark is still on its way to Redis (a slow or unreachable Redis would hold the request up); refreshes keep the
    worker out meanwhile, the mark lands in the background, and ``stop`` waits for a mark still on its way."""
    cfg = RouterConfig(redis_url=redis_url)
    started, release = asyncio.Event(), asyncio.Event()

    async def body():
        async with _one_replica(cfg) as (a, client):
            real = a.registry.mark_dead

            async def held_up(worker_id):
                started.set()
                await release.wait()
                await real(worker_id)
            try:   # a failed check must not leave stop waiting on the held-up mark
                a.registry.mark_dead = held_up
                await asyncio.wait_for(a.mark_dead("w1", wait=False), 5.0)   # returns with the mark held up
                assert "w1" not in a.workers and {"w0", "w2"} <= set(a.workers)
                await a.refresh()                                    # Redis still says live: kept out all the same
                assert await client.exists(cfg.heartbeat_key("w1")) and "w1" not in a.workers
                assert (await a.choose("req-1", SYSTEM + [1], 8)).worker.worker_id != "w1"
                release.set()
                for _ in range(200):                                 # the mark lands without anyone awaiting it
                    if not await client.exists(cfg.heartbeat_key("w1")):
                        break
                    await asyncio.sleep(0.01)
                assert not await client.exists(cfg.heartbeat_key("w1"))
                await a.refresh()
                assert "w1" not in a.workers
                release.clear()
                started.clear()
                await a.mark_dead("w2", wait=False)
                await started.wait()
                stopping = asyncio.create_task(a.stop())             # a mark on its way: stop waits for it
                await asyncio.sleep(0.05)
                assert not stopping.done()
                release.set()
                await stopping
                assert not await client.exists(cfg.heartbeat_key("w2"))
            finally:
                release.set()

    asyncio.run(body())


def test_a_worker_marked_dead_while_redis_refuses_the_mark_stays_out_until_its_heartbeat_expires(redis_url):
    """A request found a worker dead but the mark could not reach Redis: its heartbeat key is still there,
    and refreshes must not read it back into the live set (each request would fail over to it again)
    until that key has expired; a worker that heartbeats after that is live again."""
    cfg = RouterConfig(redis_url=redis_url, heartbeat_ttl_s=2.0, heartbeat_interval_s=0.5)

    async def body():
        async with _one_replica(cfg) as (a, client):
            async def refused(worker_id):
                raise aioredis.ConnectionError("Connection refused")
            for wid in ("w0", "w1", "w2"):
                await WorkerRegistry(client, cfg).heartbeat(wid)
            a.registry.mark_dead = refused
            await a.mark_dead("w1")
            assert await client.exists(cfg.heartbeat_key("w1"))   # the mark did not reach Redis
            await a.refresh()
            assert "w1" not in a.workers and {"w0", "w2"} <= set(a.workers)
            await asyncio.sleep(cfg.heartbeat_ttl_s + 0.2)        # its heartbeat key has expired by now
            await WorkerRegistry(client, cfg).heartbeat("w1")    # and it was only unreachable: back
            await a.refresh()
            assert "w1" in a.workers

    asyncio.run(body())


def test_a_started_core_stops(redis_url):
    """Stopping right after start: the event consumer's first cancel can land where redis-py swallows
    it (the loop then polled on and ``stop`` waited for ever); ``KVEventConsumer.stop`` cancels until
    the task ends. (The bound only tells a hang from a stop.)"""
    async def body():
        core = RouterCore(RouterConfig(redis_url=redis_url), "m")
        await core.start()
        await core.refresh()
        stop = asyncio.create_task(core.stop())
        done, _ = await asyncio.wait({stop}, timeout=20)
        assert stop in done and stop.exception() is None
        assert core.consumer._task is None
    asyncio.run(body())
