"""The Redis turn lock's release never waits on its renewer for long."""

import asyncio
import threading

import pytest
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.core import redis_client
from router.redis_store import RedisSessionStore, RedisTurnLock
from tests.router.redis_proxy import RedisProxy, until


class RacyStore:
    """Stands in for the session store at the moment a cancellation lands as a Redis command
    completes: the client loses the cancellation and returns normally (asyncio.wait_for on
    Python 3.11 can), so the renewer goes on as if nothing happened."""

    def __init__(self) -> None:
        self.renewing = asyncio.Event()
        self.unlocked: list[tuple[str, str]] = []
        self.renewals = 0

    async def renew_turn_lock(self, session_id: str, token: str, ttl_ms: int) -> bool:
        self.renewals += 1
        self.renewing.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass          # the lost cancellation
        return True

    async def unlock_turn(self, session_id: str, token: str) -> bool:
        self.unlocked.append((session_id, token))
        return True


def test_release_completes_although_the_renewer_lost_its_cancellation():
    async def run() -> tuple[RacyStore, RedisTurnLock, float]:
        store = RacyStore()
        lock = RedisTurnLock(store, "sess_1", "tok", ttl_ms=60)   # renews every 20 ms
        await asyncio.wait_for(store.renewing.wait(), 5)           # the renewer is mid-command
        loop = asyncio.get_running_loop()
        t = loop.time()
        await asyncio.wait_for(lock.release(), 5)                  # hung forever before the fix
        took = loop.time() - t
        await asyncio.sleep(0.3)                                   # the renewer notices and stops
        return store, lock, took

    result: list = []
    runner = threading.Thread(target=lambda: result.append(asyncio.run(run())), daemon=True)
    runner.start()
    runner.join(20)
    assert result, "release() never returned: it waited on a renewer that lost its cancellation"
    store, lock, took = result[0]
    assert store.unlocked == [("sess_1", "tok")]
    assert took <= 1.5
    assert lock._renewer.done()


# A turn lock whose answer the caller never read, against a real Redis behind a proxy that
# holds or loses the traffic on purpose (tests/router/redis_proxy.py).

def through_proxy(redis_server, scenario):
    """Run ``scenario(store, proxy, direct)``: ``store`` (the Redis session store, on the
    router's own client) talks through ``proxy``; ``direct`` sees what Redis really holds."""
    async def body():
        proxy = await RedisProxy(redis_server.port).start()
        client = redis_client(proxy.url)
        direct = aioredis.Redis.from_url(redis_server.url)
        store = RedisSessionStore(client, RouterConfig(redis_url=proxy.url))
        try:
            warm = await store.lock_turn("warm-up")  # a pooled connection on which the scripts are known
            await warm.release()
            return await scenario(store, proxy, direct)
        finally:
            await client.aclose()
            await direct.aclose()
            await proxy.aclose()
    return asyncio.run(body())


LOCK = RouterConfig().turn_lock_key("sess_1")


def test_a_turn_lock_taken_for_a_client_that_went_away_is_given_back(redis_server, redis_url):
    """The lock was set in Redis, the client disconnected before the reply came, the reply was lost:
    the session is free again at once (it stayed locked, 409 to every turn, for the lock's 60 s TTL)."""
    async def scenario(store, proxy, direct):
        held = proxy.hold_replies()
        task = asyncio.ensure_future(store.lock_turn("sess_1"))

        async def locked():
            return bool(await direct.exists(LOCK))
        await until(locked, "the lock to be set in Redis")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.cut(held)

        async def free():
            return not await direct.exists(LOCK)
        await until(free, "the lock to be given back")
        lock = await store.lock_turn("sess_1")  # the next turn gets it
        assert lock is not None
        await lock.release()

    through_proxy(redis_server, scenario)


def test_a_turn_lock_request_that_reaches_redis_after_its_withdrawal_takes_nothing(redis_server, redis_url):
    async def scenario(store, proxy, direct):
        held = proxy.hold_requests()
        replies_before = held[0].reply_chunks
        task = asyncio.ensure_future(store.lock_turn("sess_1"))
        await asyncio.sleep(0.2)  # the request waits in the proxy
        assert held[0].reply_chunks == replies_before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def withdrawn():
            return bool(await direct.keys("*turn-withdrawn*"))
        await until(withdrawn, "the withdrawal to reach Redis")
        proxy.release(held)

        async def script_ran():
            return held[0].reply_chunks > replies_before
        await until(script_ran, "the late lock request to run")
        assert not await direct.exists(LOCK)

    through_proxy(redis_server, scenario)


def test_release_completes_when_its_caller_is_cancelled(redis_server, redis_url):
    """A turn whose client disconnects while the lock is being released still frees the session."""
    async def scenario(store, proxy, direct):
        lock = await store.lock_turn("sess_1")
        assert lock is not None and await direct.exists(LOCK)
        held = proxy.hold_requests()  # the unlock waits in the proxy
        releasing = asyncio.ensure_future(lock.release())
        await asyncio.sleep(0.1)
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        proxy.cut(held)  # and is lost: only a release that goes on without its caller retries it

        async def free():
            return not await direct.exists(LOCK)
        await until(free, "the lock to be deleted")

    through_proxy(redis_server, scenario)
