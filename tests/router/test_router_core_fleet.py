"""``RouterCore.choose`` on its kept fleet view (``_choose_fleet``) against the path that builds a
``WorkerState`` per live worker (``_choose_all``): the same route (worker, decision, known blocks,
tentative count) while workers join, leave, die, report loads, get requests dispatched (repeated ids
included) and completed, hold tier blocks, and while tentative entries lengthen some matches.

No Redis: the core is never started and its tentative index is told Redis is down (local entries only)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from router.config import RouterConfig
from router.core import RouterCore
from router.registry import LoadReport, WorkerInfo


def _core(policy: str = "agentrt") -> RouterCore:
    core = RouterCore(RouterConfig(redis_url="redis://127.0.0.1:1/0", policy=policy), "m")
    core.tentative._redis_down_until = math.inf  # local entries only, no Redis call
    return core


def _refresh(core: RouterCore, live: list[str], rng: random.Random) -> None:
    """``refresh`` reading ``live`` and random load reports from a stand-in registry."""
    async def live_workers():
        return [WorkerInfo(wid, f"http://{wid}", "m") for wid in live]

    async def loads(ids):
        return {wid: LoadReport(rng.randrange(4), rng.randrange(3), rng.randrange(100), rng.randrange(100))
                for wid in ids if rng.random() < 0.8}
    core.registry.live_workers = live_workers
    core.registry.loads = loads
    asyncio.run(core.refresh(resync_joined=False))


async def _async(value):
    return value


def _same_route(a, b) -> None:
    assert (a.worker.worker_id, a.decision, a.known_blocks) == (b.worker.worker_id, b.decision, b.known_blocks)


@pytest.mark.parametrize("seed", range(8))
def test_fleet_view_routes_as_the_full_path(seed):
    rng = random.Random(seed)
    core = _core()
    assert core.fleet is not None
    names = [f"w{i}" for i in range(12)]
    bs = core.config.block_size
    system = [rng.randrange(50_000) for _ in range(bs * 6)]
    convs = [system + [rng.randrange(50_000) for _ in range(bs * rng.randrange(1, 12))] for _ in range(10)]
    _refresh(core, rng.sample(names, 8), rng)
    routes = []

    async def body():
        for step in range(250):
            op = rng.random()
            if op < 0.1:
                live = rng.sample(names, rng.randrange(1, len(names) + 1))
                core.registry.live_workers = lambda: _async([WorkerInfo(w, f"http://{w}", "m") for w in live])
                await core.refresh(resync_joined=False)
            elif op < 0.15 and len(core.workers) > 1:
                core._forget(rng.choice(list(core.workers)))  # a death (``mark_dead`` less Redis)
            elif op < 0.35:  # KV events: a worker stores (some of) a conversation, or drops some
                w = rng.choice(names)
                hs = core.hashes(rng.choice(convs))
                medium = rng.choice(["device", "device", "host", "disk"])
                if rng.random() < 0.7:
                    core.index.stored(w, hs[: rng.randrange(1, len(hs) + 1)], medium)
                else:
                    core.index.removed(w, rng.sample(hs, min(len(hs), 3)), medium)
            elif op < 0.5 and routes:
                route = routes.pop(rng.randrange(len(routes)))
                core.completed(route, ok=rng.random() < 0.8)
            prompt = rng.choice(convs)[: rng.randrange(1, 12 * bs)] + [rng.randrange(50_000)] * rng.randrange(40)
            last = rng.choice([None, rng.choice(names)])
            rid = f"r{step}" if rng.random() < 0.9 else "r-again"  # a repeated id moves its in-flight entry
            before = core.tentative_routes
            route = await core.choose(rid, prompt, rng.randrange(200), session_id=last and "s", last_worker=last)
            fast_count = core.tentative_routes - before
            tentative = core.tentative.holders(route.request.hashes)
            full = core._choose_all(route.request, list(core.workers.values()), tentative, frozenset(), "")
            _same_route(route, full)
            assert core.tentative_routes - before == 2 * fast_count  # both counted it, or neither
            assert route.worker.worker_id in {s.worker_id for s in route.candidates}
            if rng.random() < 0.8:
                await core.dispatched(route)
                routes.append(route)
            # the view holds what a WorkerState per worker would
            assert {w: core.fleet.state(w) for w in core.fleet} == {w: core._state(w) for w in core.workers}

    asyncio.run(body())


def test_a_retry_and_a_policy_without_a_view_take_the_full_path():
    rng = random.Random(1)
    core = _core("round_robin")
    assert core.fleet is None
    _refresh(core, ["a", "b"], rng)

    async def body():
        first = await core.choose("r1", [1] * 40, 8)
        again = await core.choose("r1", [1] * 40, 8, exclude=frozenset({first.worker.worker_id}))
        assert again.worker.worker_id != first.worker.worker_id

    asyncio.run(body())
    core = _core()
    _refresh(core, ["a", "b"], rng)
    route = asyncio.run(core.choose("r1", [1] * 40, 8, exclude=frozenset({"a"})))
    assert route.worker.worker_id == "b" and len(route.candidates) == 1  # the full path: one state per candidate


def test_tier_blocks_count_over_what_the_index_alone_says():
    """A tentative entry fills a hole in a worker's prefix: its tier blocks past the hole are not part of
    what the index knows it holds, so they are not priced as tier hits (as on the full path)."""
    core = _core()
    _refresh(core, ["a", "b"], random.Random(2))
    prompt = list(range(16 * 8))
    hs = core.hashes(prompt)
    core.index.stored("a", hs[:4])
    core.index.stored("a", hs[5:8], "disk")
    core.tentative.record_local("a", [hs[4]])
    route = asyncio.run(core.choose("r", prompt, 8))
    full = core._choose_all(route.request, list(core.workers.values()), core.tentative.holders(hs), frozenset(), "")
    _same_route(route, full)
    seen = {s.worker_id: s for s in route.candidates}
    assert seen["a"] == next(s for s in full.candidates if s.worker_id == "a")
    assert (seen["a"].cached_blocks, seen["a"].disk_blocks, route.known_blocks) == (8, 0, 4)


def test_a_replica_keeps_the_last_urls_of_workers_that_left_up_to_its_bound(monkeypatch):
    """``last_urls`` (where KV lease calls go, live or not): a worker that left or was marked dead keeps its URL;
    past ``LAST_URLS_KEPT`` the workers seen longest ago go first."""
    import router.core as core_module

    monkeypatch.setattr(core_module, "LAST_URLS_KEPT", 3)
    core, rng = _core(), random.Random(3)
    core.registry.mark_dead = lambda worker_id: _async(None)   # the mark reaches Redis (no retries to port 1)
    _refresh(core, ["a", "b"], rng)
    asyncio.run(core.mark_dead("a"))
    assert set(core.workers) == {"b"} and core.last_urls == {"a": "http://a", "b": "http://b"}
    _refresh(core, ["c", "d"], rng)   # a and b gone; a was seen longest ago
    assert set(core.workers) == {"c", "d"} and list(core.last_urls) == ["b", "c", "d"]
    _refresh(core, ["b", "d"], rng)   # b back: the most recently seen with d
    assert list(core.last_urls) == ["c", "b", "d"]
