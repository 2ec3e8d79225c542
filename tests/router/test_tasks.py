"""Stopping a background loop that lost a cancellation (agentrt/core/tasks.py).

On Python 3.11 redis-py can lose a cancellation (one landing while it sets up a connection, or as a command
completes inside ``asyncio.wait_for``); a loop that polls Redis then goes round again. A make test run with
three xdist processes on two cores hung for minutes in ``RouterCore.stop``, which cancelled its refresh loop
once and awaited it. The loops here lose their first cancellation on purpose, at a point the test chooses.
"""

from __future__ import annotations

import asyncio

from agentrt.core.tasks import cancel_and_wait
from router.config import RouterConfig
from router.core import RouterCore


def swallowing_loop(inside: asyncio.Event, lost: list[int]):
    """A loop that loses the first cancellation landing in its 'Redis call', as redis-py can."""
    async def loop():
        while True:
            await asyncio.sleep(0.01)
            try:
                inside.set()
                await asyncio.sleep(0.05)           # the call
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(1)                      # lost: the loop goes round again
            finally:
                inside.clear()
    return loop()


def test_a_cancelled_await_alone_waits_for_a_loop_that_lost_its_cancellation():
    """The scenario is real: cancel once and await, and the loop runs on (here past a 1 s bound)."""
    async def body():
        inside, lost = asyncio.Event(), []
        task = asyncio.create_task(swallowing_loop(inside, lost))
        await inside.wait()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        assert not done and lost == [1]
        await cancel_and_wait(task)
        assert task.done()
    asyncio.run(body())


def test_cancel_and_wait_ends_a_loop_that_lost_its_cancellation():
    async def body():
        inside, lost = asyncio.Event(), []
        task = asyncio.create_task(swallowing_loop(inside, lost))
        await inside.wait()
        stop = asyncio.create_task(cancel_and_wait(task))
        done, _ = await asyncio.wait({stop}, timeout=2.0)
        assert done and task.cancelled() and lost == [1]
        await cancel_and_wait(None)                  # nothing to stop: returns
        await cancel_and_wait(task)                  # already ended: returns
    asyncio.run(body())


def test_cancel_and_wait_logs_and_does_not_raise_what_the_task_ended_with(caplog):
    async def body():
        async def fails():
            raise RuntimeError("boom")
        task = asyncio.create_task(fails(), name="refresh")
        await asyncio.sleep(0)
        await cancel_and_wait(task)                  # stopping it: its error is not the caller's
        assert isinstance(task.exception(), RuntimeError)
    with caplog.at_level("WARNING", logger="agentrt.tasks"):
        asyncio.run(body())
    assert [r.getMessage() for r in caplog.records] == [
        "task refresh had ended with RuntimeError('boom') before it was stopped"]


def test_router_stop_ends_even_if_its_refresh_loop_lost_a_cancellation(redis_url):
    """A real RouterCore over a real redis-server; its refresh (every 0.1 s) loses the first cancellation
    that lands in it. Before cancel_and_wait, stop() waited for that loop forever."""
    async def body():
        core = RouterCore(RouterConfig(redis_url=redis_url, deployment="stop-swallow"), "m", refresh_interval_s=0.1)
        await core.start()
        inside, lost, real = asyncio.Event(), [], core.refresh

        async def refresh(resync_joined: bool = True) -> None:
            inside.set()
            try:
                await real(resync_joined)
                await asyncio.sleep(0.2)            # the call, long enough for stop() to land in it
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(1)
            finally:
                inside.clear()
        core.refresh = refresh
        await asyncio.wait_for(inside.wait(), 5.0)
        refresh_task, consumer_task = core._task, core.consumer._task
        assert not consumer_task.done()
        stop = asyncio.create_task(core.stop())
        done, _ = await asyncio.wait({stop}, timeout=5.0)   # not wait_for: its cancel would end the loop itself
        if not done:
            await cancel_and_wait(refresh_task)             # let the stuck stop() finish before failing
            await stop
        assert done, "RouterCore.stop() still waiting for its refresh loop after 5 s"
        assert lost == [1] and refresh_task.done()
        assert consumer_task.done() and core.consumer._task is None
    asyncio.run(body())
