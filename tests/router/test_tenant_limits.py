"""Tenant limits shared by router replicas: two ``RedisTenantLimits`` (as two replicas would hold)
on one real Redis agree on a tenant's concurrency and tokens per minute, reclaim the leases of a
replica that died, and fail closed (503) when Redis is gone."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from agentrt.core.errors import APIError
from agentrt.core.tenants import Tenant, TenantLimits
from router.config import RouterConfig
from router.core import redis_client
from router.tenant_limits import RedisTenantLimits
from tests.router.redis_proxy import RedisProxy, until


def replicas(url: str, scenario, n: int = 2, **options):
    """Run ``scenario(*limits)`` with ``n`` limiters, each on its own client (its own connections)."""
    async def body():
        clients = [aioredis.Redis.from_url(url, socket_connect_timeout=0.5) for _ in range(n)]
        limits = [RedisTenantLimits(c, RouterConfig(redis_url=url), **options) for c in clients]
        try:
            return await scenario(*limits)
        finally:
            for lim in limits:
                await lim.aclose()
            for c in clients:
                await c.aclose()
    return asyncio.run(body())


def test_concurrency_is_counted_across_replicas(redis_url):
    acme = Tenant("acme", max_concurrent_requests=2)

    async def scenario(a, b):
        first, _ = await a.admit(acme, 10)
        second, _ = await b.admit(acme, 10)
        assert first is not None and second is not None
        for replica in (a, b):  # the third is refused wherever it arrives
            refused, wait = await replica.admit(acme, 10)
            assert refused is None and wait == 1.0
        assert await a.in_flight("acme") == await b.in_flight("acme") == 2
        other = Tenant("other", max_concurrent_requests=1)
        theirs, _ = await b.admit(other, 10)
        assert theirs is not None  # another tenant's slots are its own
        await b.release(other, theirs, 10)
        await b.release(acme, second, 10)
        again, _ = await a.admit(acme, 10)  # the slot b freed is taken through a
        assert again is not None and (await b.admit(acme, 10))[0] is None
        await a.release(acme, first, 10)
        await a.release(acme, again, 10)
        assert await a.in_flight("acme") == 0
        # Twenty admissions racing through both replicas: exactly two pass.
        results = await asyncio.gather(*[(a if i % 2 else b).admit(acme, 1) for i in range(20)])
        assert sum(r is not None for r, _ in results) == 2
        assert a.held + b.held == 2

    replicas(redis_url, scenario)


@pytest.mark.parametrize("kind", ["in-process", "redis"])
def test_tokens_per_minute_window_is_shared_and_charged_what_was_used(redis_url, kind):
    """The same sequence as the in-process unit test, through two replicas: both implementations agree."""
    t = Tenant("metered", max_concurrent_requests=2, tokens_per_minute=100)
    t0 = time.time()

    async def scenario(a, b):
        x, _ = await a.admit(t, 30, now=t0)
        y, _ = await b.admit(t, 30, now=t0 + 1)
        refused, wait = await a.admit(t, 1, now=t0 + 2)
        assert x is not None and y is not None and refused is None and wait == 1.0  # concurrency
        await a.release(t, x, 10)  # used 10 of its 30
        z, _ = await b.admit(t, 50, now=t0 + 3)  # 10 + 30 + 50 = 90 <= 100
        assert z is not None
        await b.release(t, y, 30)
        await b.release(t, z, 50)
        for replica in (a, b):  # 90 + 20 > 100: wait until x's 10 tokens leave the window at t0 + 60
            refused, wait = await replica.admit(t, 20, now=t0 + 4)
            assert refused is None and wait == pytest.approx(56.0, abs=0.01)
        later, _ = await b.admit(t, 20, now=t0 + 60.5)
        assert later is not None and await a.in_flight("metered") == 1
        await b.release(t, later, None)  # None: keeps its 20 reserved: 30 + 50 + 20 = 100 in the window
        refused, wait = await a.admit(t, 1, now=t0 + 60.8)
        assert refused is None and wait == 1.0  # y's 30 leave at t0 + 61: 0.2 s, and Retry-After is >= 1 s
        assert (await a.admit(t, 1, now=t0 + 61))[0] is not None
        # A request bigger than the whole budget still runs when the window is empty (as in-process).
        alone = Tenant("alone", tokens_per_minute=10)
        big, _ = await a.admit(alone, 500, now=t0)
        assert big is not None and (await b.admit(alone, 1, now=t0 + 59))[0] is None

    if kind == "in-process":
        limits = TenantLimits()
        asyncio.run(scenario(limits, limits))
    else:
        replicas(redis_url, scenario)


def test_release_after_the_entry_left_the_window_changes_nothing(redis_url):
    t = Tenant("slow", tokens_per_minute=100)
    cfg = RouterConfig(redis_url=redis_url)
    t0 = time.time()

    async def scenario(a, b):
        old, _ = await a.admit(t, 90, now=t0 - 61)
        new, _ = await b.admit(t, 90, now=t0)  # the old entry left the window: admitted, and dropped
        await a.release(t, old, 95)  # ran for over a minute: its charge is no longer in the window
        return old, new

    old, new = replicas(redis_url, scenario)
    r = redis.Redis.from_url(redis_url)
    reserved = {k.decode(): int(v) for k, v in r.hgetall(cfg.tenant_reserved_key("slow")).items()}
    assert reserved == {new.id: 90}
    assert 0 < r.pttl(cfg.tenant_tokens_key("slow")) <= 60_000  # idle tenants' keys expire


def test_the_lease_of_a_replica_that_died_is_reclaimed(redis_url):
    one = Tenant("one", max_concurrent_requests=1)
    t0 = time.time()

    async def scenario(a, b):
        held, _ = await a.admit(one, 10, now=t0)
        assert (await b.admit(one, 10, now=t0 + 10))[0] is None
        taken, _ = await b.admit(one, 10, now=t0 + 31)  # a's 30 s lease ran out: a died
        assert taken is not None
        await a.release(one, held, 10)  # a late release of the expired lease frees nothing of b's
        assert await b.in_flight("one", now=t0 + 32) == 1
        assert (await a.admit(one, 10, now=t0 + 32))[0] is None

    replicas(redis_url, scenario, lease_s=30.0)


def test_leases_are_renewed_while_held_and_expire_when_the_holder_stops(redis_url):
    one = Tenant("renewed", max_concurrent_requests=1)

    async def scenario(a, b):
        held, _ = await a.admit(one, 10)
        await asyncio.sleep(3.5)  # over twice the lease: a's renewer keeps it
        assert (await b.admit(one, 10))[0] is None
        assert a.held == 1 and a.lost_leases == 0
        await a.aclose()  # a stops (as if killed): no release, no renewal
        await asyncio.sleep(2.0)
        taken, _ = await b.admit(one, 10)
        assert taken is not None
        await b.release(one, taken, 10)

    replicas(redis_url, scenario, lease_s=1.5)


def test_unlimited_tenants_never_touch_redis(redis_url):
    async def scenario(a, b):
        free = Tenant("free")
        reservation, wait = await a.admit(free, 10_000)
        assert reservation is not None and wait == 0.0
        await a.release(free, reservation, 5)
        assert a.held == 0

    replicas(redis_url, scenario)
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_redis_down_is_503_with_retry_after_and_release_does_not_raise(redis_server_factory):
    server = redis_server_factory()
    acme = Tenant("acme", max_concurrent_requests=4, tokens_per_minute=1000)

    async def scenario(a):
        held, _ = await a.admit(acme, 10)
        server.kill()
        with pytest.raises(APIError) as err:
            await a.admit(acme, 10)
        assert err.value.status == 503 and err.value.code == "store_unavailable"
        assert err.value.headers == {"Retry-After": "3"} and "tenant limits" in err.value.message
        with pytest.raises(APIError):
            await a.in_flight("acme")
        await a.release(acme, held, 10)  # logged and counted; the lease expires by itself
        assert a.release_errors == 1 and a.held == 0

    replicas(server.url, scenario, n=1, retry_after_s=3)


def test_a_request_cancelled_during_admission_gives_its_slot_back(redis_url):
    """A client that disconnects while its admission script runs holds no slot afterwards (not a
    lease-long 60 s), and is charged no tokens."""
    acme = Tenant("acme", max_concurrent_requests=1, tokens_per_minute=1000)

    async def scenario(a):
        for _ in range(5):  # the cancellation lands while the script is on its way or running
            task = asyncio.ensure_future(a.admit(acme, 400))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Wait for the state to be final: the cancelled admission's script and its withdrawal both
            # done. (Polling until Redis showed no lease could pass before the script even arrived.)
            assert await a.settle(timeout_s=10), "the admission or its withdrawal is still running after 10 s"
            assert await a.in_flight("acme") == 0
        # Nothing was charged: a request for 900 of the 1000 tokens a minute is admitted at once.
        held, wait = await a.admit(acme, 900)
        assert held is not None, wait
        await a.release(acme, held, 900)
    replicas(redis_url, scenario, n=1)


# The interleavings in which an admission's caller never learns what Redis did, made to happen
# on purpose with a proxy between the limiter and a real Redis (tests/router/redis_proxy.py).

def lost_admission(redis_server, scenario):
    """Run ``scenario(limiter, proxy, direct)``: the limiter talks to Redis through ``proxy``,
    ``direct`` is a client of its own that sees what Redis really holds."""
    async def body():
        proxy = await RedisProxy(redis_server.port).start()
        client = redis_client(proxy.url)  # the router's own client: it retries on a broken connection
        direct = aioredis.Redis.from_url(redis_server.url)
        limiter = RedisTenantLimits(client, RouterConfig(redis_url=proxy.url))
        try:
            # One pooled connection, open before the proxy holds anything on it, on which the
            # scripts are known (a NOSCRIPT reply held back would stall the test, not the race).
            warm = Tenant("warm-up", max_concurrent_requests=1, tokens_per_minute=10)
            reservation, _ = await limiter.admit(warm, 1)
            await limiter.release(warm, reservation, 1)
            return await scenario(limiter, proxy, direct)
        finally:
            await limiter.aclose()
            await client.aclose()
            await direct.aclose()
            await proxy.aclose()
    return asyncio.run(body())


LEASES = RouterConfig().tenant_leases_key("acme")
TOKENS = RouterConfig().tenant_tokens_key("acme")


async def nothing_held(direct) -> bool:
    return await direct.zcard(LEASES) == 0 and await direct.zcard(TOKENS) == 0


async def admitted_behind_held_reply(limits, proxy, direct, tenant: Tenant):
    """Start an admission whose script runs and reserves on the server while its reply is held in the
    proxy; returns (the held links, the admission task)."""
    held = proxy.hold_replies()
    task = asyncio.ensure_future(limits.admit(tenant, 400))

    async def reserved():
        return await direct.zcard(LEASES) == 1
    await until(reserved, "the admission script to reserve on the server")
    return held, task


def test_a_cancelled_admission_whose_reply_was_lost_gives_its_slot_back(redis_server, redis_url):
    """Redis ran the script and reserved, the client went away before the reply came, and the
    reply was lost with its connection: the slot and the tokens come back at once (they stayed
    held for a whole 60 s lease: the retried script found the tenant full and the give-back
    was skipped)."""
    acme = Tenant("acme", max_concurrent_requests=1, tokens_per_minute=1000)

    async def scenario(limits, proxy, direct):
        held, task = await admitted_behind_held_reply(limits, proxy, direct, acme)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.cut(held)  # the reply never arrives
        await until(lambda: nothing_held(direct), "the reservation to be given back")
        await until(lambda: withdrawn(limits), "the withdrawal to finish")
        assert limits.held == 0
        again, wait = await limits.admit(acme, 900)  # nothing was charged: 900 of 1000 fits now
        assert again is not None, wait
        await limits.release(acme, again, 900)

    lost_admission(redis_server, scenario)


def test_an_admission_whose_reply_was_lost_is_admitted_once_by_the_retry(redis_server, redis_url):
    """The script reserved, its reply was lost, redis-py ran it again on a new connection: the
    second run sees the id's own reservation and answers admitted (it found the tenant full and
    refused, 429, while the first run's lease stayed behind)."""
    acme = Tenant("acme", max_concurrent_requests=1, tokens_per_minute=1000)

    async def scenario(limits, proxy, direct):
        held, task = await admitted_behind_held_reply(limits, proxy, direct, acme)
        proxy.cut(held)
        reservation, wait = await task
        assert reservation is not None, f"refused, retry after {wait} s"
        assert await direct.zcard(LEASES) == 1 and int(await direct.hget(
            RouterConfig().tenant_reserved_key("acme"), reservation.id)) == 400  # reserved once
        await limits.release(acme, reservation, 10)
        assert await limits.in_flight("acme") == 0

    lost_admission(redis_server, scenario)


def test_an_admission_that_reaches_redis_after_its_withdrawal_reserves_nothing(redis_server, redis_url):
    """The client went away while its script was still on the network; the withdrawal went out on
    another connection and got there first. The late script must not reserve."""
    acme = Tenant("acme", max_concurrent_requests=1, tokens_per_minute=1000)

    async def scenario(limits, proxy, direct):
        held = proxy.hold_requests()
        replies_before = held[0].reply_chunks
        task = asyncio.ensure_future(limits.admit(acme, 400))
        await asyncio.sleep(0.2)  # the request now waits in the proxy
        assert held[0].reply_chunks == replies_before  # Redis has not seen the script
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: withdrawn(limits), "the withdrawal to finish")
        proxy.release(held)  # now the script reaches Redis and runs

        async def script_ran():
            return held[0].reply_chunks > replies_before
        await until(script_ran, "the late admission script to run")
        assert await nothing_held(direct)
        assert await limits.in_flight("acme") == 0

    lost_admission(redis_server, scenario)


async def withdrawn(limits) -> bool:
    return limits.withdrawals == 1
