"""The Redis turn lock's release never waits on its renewer for long."""

import asyncio
import threading

from router.redis_store import RedisTurnLock


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
