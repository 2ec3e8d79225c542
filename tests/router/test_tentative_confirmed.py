"""``TentativeIndex.confirmed`` (called for every KV event the consumer applies) against the plain loop
it replaced: random records and confirmations, duplicates within an event, blocks held for several
workers; the local map and the count must end the same."""

from __future__ import annotations

import random

import redis.asyncio as aioredis

from router.config import RouterConfig
from router.tentative import TentativeIndex


def confirmed_loop(t: TentativeIndex, worker_id: str, hashes) -> None:
    for h in hashes:
        entry = t._local.get(h)
        if entry is not None and entry.pop(worker_id, None) is not None:
            t.stats.confirmed += 1
            if not entry:
                del t._local[h]


def test_confirmed_matches_the_plain_loop():
    cfg = RouterConfig()
    rng = random.Random(5)
    a, b = TentativeIndex(aioredis.Redis(), cfg), TentativeIndex(aioredis.Redis(), cfg)
    workers = ["w0", "w1", "w2"]
    for step in range(3000):
        w = rng.choice(workers)
        hashes = tuple(rng.randrange(40) for _ in range(rng.choice((0, 1, 1, 2, 5, 30))))
        if rng.random() < 0.4:
            a.record_local(w, hashes)
            b._local = {h: dict(e) for h, e in a._local.items()}  # same expiries
            b.stats.recorded = a.stats.recorded
        else:
            a.confirmed(w, hashes)
            confirmed_loop(b, w, hashes)
        assert a._local == b._local and a.stats == b.stats, step
    assert a.stats.confirmed > 100
