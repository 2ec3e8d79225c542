"""``RouterCore.freeze_index``: the index's per-worker sets (every (worker, block) pair) leave the
collector's generations once made, so a full collection does not walk them (benchmarks/router_scale.py
measures the stall it removes); it freezes again only when the index made a new set."""

from __future__ import annotations

import asyncio
import gc

from router.config import RouterConfig
from router.core import RouterCore


def _tracked(obj) -> bool:
    """Whether ``obj`` is in a generation the collector walks (frozen objects are not listed)."""
    return any(o is obj for o in gc.get_objects())


def test_index_sets_are_frozen_once_made(redis_url):
    asyncio.run(_frozen_once_made(redis_url))


async def _frozen_once_made(redis_url: str) -> None:
    core = RouterCore(RouterConfig(redis_url=redis_url), "m")
    try:
        await core.start()  # no worker yet: nothing to freeze
        frozen = gc.get_freeze_count()
        core.index.stored("w1", range(1000))
        first = core.index._by_worker[0]
        assert _tracked(first)
        core.freeze_index()
        assert not _tracked(first) and gc.get_freeze_count() > frozen
        first.add(10**9)  # it keeps working in the permanent generation
        assert core.index.blocks_of("w1") == 1001 and core.index.match([0, 1, 2]) == {"w1": 3}

        frozen = gc.get_freeze_count()
        core.index.stored("w1", range(1000, 2000))  # no new set: no collection, no freeze
        marker = [object()]  # made since: not frozen by a call that has nothing to do
        core.freeze_index()
        # no freeze: the marker is still tracked, and the permanent generation did not grow (it may shrink:
        # the router's own tasks free frozen objects meanwhile; a fresh-clone suite run saw 2 go)
        assert gc.get_freeze_count() <= frozen and _tracked(marker)

        core.index.stored("w2", [5])  # a new worker's set
        second = core.index._by_worker[1]
        assert _tracked(second)
        await core.refresh()  # the refresh freezes what the index made meanwhile
        assert not _tracked(second)
    finally:
        gc.unfreeze()
        await asyncio.wait_for(core.stop(), 30)
