"""KV events: codec limits, publisher -> stream -> consumer -> index, gaps, cleared, garbage."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.event_consumer import KVEventConsumer, Snapshot
from router.events import (EventDecodeError, KVEvent, KVEventPublisher, decode_event,
                           encode_event)
from router.index import PrefixIndex


def test_codec_roundtrip():
    ev = KVEvent("w1", 7, "stored", (1, 2**64 - 1), None, 123)
    assert decode_event(encode_event(ev)) == ev
    extra = msgpack.packb({"worker": "w1", "seq": 0, "kind": "cleared", "hashes": [],
                           "parent": 5, "ts": 0, "medium": "gpu"})
    assert decode_event(extra).parent == 5


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not a msgpack"),
    (msgpack.packb([1, 2]), "Expected `object`, got `array`"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "stored", "hashes": []}), "missing required field `parent`"),
    (msgpack.packb({"worker": "w", "seq": -1, "kind": "stored", "hashes": [], "parent": None,
                    "ts": 0}), "seq"),
    (msgpack.packb({"worker": "w", "seq": True, "kind": "stored", "hashes": [], "parent": None,
                    "ts": 0}), "seq"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "evicted", "hashes": [], "parent": None,
                    "ts": 0}), "kind"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "stored", "hashes": ["1"], "parent": None,
                    "ts": 0}), "hashes"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "stored", "hashes": [-1], "parent": None,
                    "ts": 0}), "hashes"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "stored", "hashes": list(range(11)),
                    "parent": None, "ts": 0}), "not a msgpack"),
    (msgpack.packb({"worker": "w", "seq": 0, "kind": "stored", "hashes": [],
                    "parent": msgpack.ExtType(1, b"x"), "ts": 0}), "not a msgpack"),
    (pickle.dumps({"worker": "w"}), "not a msgpack"),
    (b"\x00" * 5000, "exceeds"),
])
def test_decode_rejects(payload, match):
    with pytest.raises(EventDecodeError, match=match):
        decode_event(payload, max_bytes=4096, max_hashes=10)


def _cfg(url):
    return RouterConfig(redis_url=url)


@contextlib.asynccontextmanager
async def _consumer(url, cfg=None, snapshot_source=None):
    """A ``KVEventConsumer`` of ``url``'s stream (``cfg``: default ``_cfg(url)``) into a fresh ``PrefixIndex``
    (``consumer.index``); its Redis client closes on exit."""
    client = aioredis.Redis.from_url(url)
    try:
        yield KVEventConsumer(client, cfg or _cfg(url), PrefixIndex(), snapshot_source=snapshot_source)
    finally:
        await client.aclose()


async def _drain(consumer):
    while await consumer.poll(block_ms=50):
        pass


def _publisher(url, wid="w1"):
    cfg = _cfg(url)
    pub = KVEventPublisher(cfg, wid, redis.Redis.from_url(url))
    pub.start()
    return pub


def test_events_reach_index(redis_url):
    pub = _publisher(redis_url)
    pub.publish("stored", [10, 11, 12], None)
    pub.publish("stored", [13], 12)
    pub.publish("removed", [13], None)
    pub.flush()

    async def body():
        async with _consumer(redis_url) as consumer:
            await _drain(consumer)
        return consumer.index, consumer.stats
    index, stats = asyncio.run(body())
    pub.close()
    assert index.match([10, 11, 12, 13]) == {"w1": 3}
    assert stats.malformed == 0 and stats.gaps == 0
    # `cleared` resyncs from the snapshot, which already reflects the later events.
    assert stats.per_kind == {"cleared": 1} and stats.skipped == 3


def test_events_apply_one_by_one_after_baseline(redis_url):
    cfg = _cfg(redis_url)
    sync = redis.Redis.from_url(redis_url)
    for ev in [KVEvent("w1", 0, "cleared", (), None, 0), KVEvent("w1", 1, "stored", (1, 2), None, 0),
               KVEvent("w2", 0, "cleared", (), None, 0), KVEvent("w2", 1, "stored", (1,), None, 0),
               KVEvent("w1", 2, "removed", (2,), None, 0)]:
        sync.xadd(cfg.events_stream_key, {"e": encode_event(ev)})
    sync.close()

    async def empty(wid):
        return Snapshot(-1, ())

    async def body():
        async with _consumer(redis_url, cfg, snapshot_source=empty) as consumer:
            await _drain(consumer)
        return consumer.index, consumer.stats
    index, stats = asyncio.run(body())
    assert index.match([1, 2]) == {"w1": 1, "w2": 1}
    assert stats.per_kind == {"cleared": 2, "stored": 2, "removed": 1} and stats.gaps == 0


def test_seq_gap_triggers_resync_from_snapshot(redis_url):
    cfg = _cfg(redis_url)
    pub = _publisher(redis_url)
    pub.publish("stored", [1, 2], None)
    pub.flush()

    async def body():
        async with _consumer(redis_url, cfg) as consumer:
            await _drain(consumer)
            # Lose one event on the wire: the snapshot has it, the stream does not.
            sync = redis.Redis.from_url(redis_url)
            sync.sadd(cfg.snapshot_key("w1"), (3).to_bytes(8, "little"))
            sync.set(cfg.snapshot_seq_key("w1"), 2)
            sync.xadd(cfg.events_stream_key,
                      {"e": encode_event(KVEvent("w1", 3, "stored", (4,), 3, 0))})
            sync.close()
            await _drain(consumer)
        return consumer.index, consumer.stats
    index, stats = asyncio.run(body())
    pub.close()
    assert stats.gaps == 1
    assert index.match([1, 2, 3]) == {"w1": 3}  # block 3 came from the snapshot
    assert index.holders(4) == {"w1"}            # the event after the gap still applied


def test_cleared_drops_stale_entries_of_returning_worker(redis_url):
    pub = _publisher(redis_url)
    pub.publish("stored", [1, 2, 3], None)
    pub.flush()
    pub.close()

    async def body():
        async with _consumer(redis_url) as consumer:
            await _drain(consumer)
            before = consumer.index.match([1, 2, 3])
            again = _publisher(redis_url)  # the worker restarts: seq starts over with `cleared`
            again.publish("stored", [7], None)
            again.flush()
            again.close()
            await _drain(consumer)
        return before, consumer.index, consumer.stats
    before, index, stats = asyncio.run(body())
    assert before == {"w1": 3}
    assert index.match([1, 2, 3]) == {}
    assert index.holders(7) == {"w1"}
    assert stats.gaps == 0


def test_malformed_events_counted_and_skipped(redis_url):
    cfg = _cfg(redis_url)
    sync = redis.Redis.from_url(redis_url)
    good = [KVEvent("w1", 0, "cleared", (), None, 0), KVEvent("w1", 1, "stored", (5, 6), None, 0)]
    sync.xadd(cfg.events_stream_key, {"e": encode_event(good[0])})
    sync.xadd(cfg.events_stream_key, {"e": b"\xc1\xc1"})
    sync.xadd(cfg.events_stream_key, {"e": pickle.dumps(["stored"])})
    sync.xadd(cfg.events_stream_key, {"other": b"x"})
    sync.xadd(cfg.events_stream_key, {"e": b"\x00" * (cfg.event_max_bytes + 1)})
    sync.xadd(cfg.events_stream_key, {"e": encode_event(good[1])})
    sync.close()

    resyncs = []

    async def snapshot(wid):
        resyncs.append(wid)
        return Snapshot(-1, ())

    async def body():
        async with _consumer(redis_url, cfg, snapshot_source=snapshot) as consumer:
            await _drain(consumer)
        return consumer.index, consumer.stats, resyncs
    index, stats, resyncs = asyncio.run(body())
    assert stats.malformed == 4
    assert stats.applied == 2
    assert index.match([5, 6]) == {"w1": 2}
    assert resyncs == ["w1"]  # the `cleared` only


def test_bootstrap_loads_snapshots_and_skips_older_events(redis_url):
    pub = _publisher(redis_url)
    pub.publish("stored", [1, 2], None)
    pub.publish("removed", [2], None)
    pub.flush()

    async def body():
        async with _consumer(redis_url) as consumer:
            await consumer.bootstrap(["w1"])
            pub.publish("stored", [9], None)
            pub.flush()
            await _drain(consumer)
            consumer.forget_worker("w1")
            forgotten = len(consumer.index)
        return consumer.index, consumer.stats, forgotten
    index, stats, forgotten = asyncio.run(body())
    pub.close()
    assert stats.resyncs == 1 and stats.gaps == 0
    assert stats.applied == 1  # only the event after the snapshot
    assert forgotten == 0


def test_consumer_task_runs_until_stopped(redis_url):
    pub = _publisher(redis_url)

    async def body():
        async with _consumer(redis_url) as consumer:
            consumer.start()
            pub.publish("stored", [42], None)
            pub.flush()
            for _ in range(200):
                if consumer.index.holders(42):
                    break
                await asyncio.sleep(0.02)
            await consumer.stop()
        return consumer.index
    index = asyncio.run(body())
    pub.close()
    assert index.holders(42) == {"w1"}


def _stream_events(url, cfg):
    client = redis.Redis.from_url(url)
    try:
        return [decode_event(f[b"e"]) for _id, f in client.xrange(cfg.events_stream_key)]
    finally:
        client.close()


def test_publisher_keeps_events_through_a_redis_restart(redis_server_factory):
    """Events published while Redis is down are written, in order, once it is back: the
    stream's seqs stay contiguous (no router resyncs) and the snapshot set is exact."""
    server = redis_server_factory(appendonly=True)
    cfg = _cfg(server.url)
    pub = KVEventPublisher(cfg, "w1", redis.Redis.from_url(server.url, socket_connect_timeout=0.5))
    pub.start()
    pub.publish("stored", [1, 2], None)
    pub.flush()
    server.stop()
    pub.publish("stored", [3, 4], 2)
    pub.publish("removed", [1], None)
    deadline = time.monotonic() + 10
    while pub.retries == 0 and time.monotonic() < deadline:  # the writer has met the outage
        time.sleep(0.02)
    assert pub.retries >= 1
    pub.publish("stored", [5], 4)
    server.start()
    pub.flush(timeout=15)
    pub.close()
    events = _stream_events(server.url, cfg)
    assert [(e.seq, e.kind, e.hashes) for e in events] == [
        (0, "cleared", ()), (1, "stored", (1, 2)), (2, "stored", (3, 4)), (3, "removed", (1,)), (4, "stored", (5,))]
    client = redis.Redis.from_url(server.url)
    assert {int.from_bytes(m, "little") for m in client.smembers(cfg.snapshot_key("w1"))} == {2, 3, 4, 5}
    assert int(client.get(cfg.snapshot_seq_key("w1"))) == 4
    client.close()
    assert pub.dropped == 0 and not pub.lost and pub.written == 5

    async def body():  # a consumer that started before the outage sees no gap
        async with _consumer(server.url, cfg) as consumer:
            await _drain(consumer)
        return consumer.index, consumer.stats
    index, stats = asyncio.run(body())
    assert stats.gaps == 0 and index.match([2, 3, 4, 5]) == {"w1": 4}


def test_publisher_backlog_overflow_drops_and_flags_lost(redis_server_factory):
    server = redis_server_factory()
    cfg = _cfg(server.url)
    pub = KVEventPublisher(cfg, "w1", redis.Redis.from_url(server.url, socket_connect_timeout=0.5), max_backlog=5)
    pub.start()
    pub.flush()
    server.kill()
    for i in range(20):
        pub.publish("stored", [100 + i], None)
    deadline = time.monotonic() + 10
    while not pub.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pub.lost and pub.dropped == 20
    server.start()
    pub.publish("stored", [7], None)
    pub.flush(timeout=15)
    events = _stream_events(server.url, cfg)
    assert [(e.seq, e.hashes) for e in events] == [(21, (7,))]  # seqs 1..20 are gone: routers see a gap
    assert pub.lost  # until the owner republishes the cache and clears it
    pub.clear_lost()
    assert not pub.lost
    pub.close()


def test_decode_rejects_hashes_that_are_not_u64():
    good = {"worker": "w", "seq": 0, "kind": "stored", "parent": None, "ts": 0}
    assert decode_event(msgpack.packb({**good, "hashes": [0, (1 << 64) - 1]})).hashes == (0, (1 << 64) - 1)
    assert decode_event(msgpack.packb({**good, "hashes": []})).hashes == ()
    for bad, why in (([1, -1], r"`int` >= 0 - at `\$.hashes\[1\]`"), ([True, 2], r"got `bool` - at `\$.hashes\[0\]`"),
                     ([1.0], "got `float`"), (["1"], "got `str`"), ([None], "got `null`"), ([-(1 << 63)], ">= 0")):
        with pytest.raises(EventDecodeError, match=why):
            decode_event(msgpack.packb({**good, "hashes": bad}))
    with pytest.raises(EventDecodeError, match="unsigned 64-bit"):  # msgpack cannot carry it; a publisher might try
        KVEvent("w", 0, "stored", (1, 1 << 64), None, 0)


@pytest.mark.parametrize("name, value, why", [
    ("seq", True, r"Expected `int`, got `bool` - at `\$.seq`"),
    ("ts", 1.5, r"Expected `int`, got `float` - at `\$.ts`"),
    ("ts", -1, r"Expected `int` >= 0 - at `\$.ts`"),
    ("parent", False, r"got `bool` - at `\$.parent`"),
    ("parent", -1, r">= 0 - at `\$.parent`"),
    ("worker", "", r"length >= 1 - at `\$.worker`"),
    ("worker", "w" * 257, r"length <= 256 - at `\$.worker`"),
    ("kind", "evicted", r"Invalid enum value 'evicted' - at `\$.kind`"),
    ("medium", "", r"length >= 1 - at `\$.medium`"),
    ("hashes", [1, False], r"got `bool` - at `\$.hashes\[1\]`"),
])
def test_decode_names_the_bad_field(name, value, why):
    """Each refusal says which field and what it must be; a bool is never an int."""
    good = {"worker": "w", "seq": 0, "kind": "stored", "hashes": [1], "parent": None, "ts": 0}
    with pytest.raises(EventDecodeError, match=why):
        decode_event(msgpack.packb({**good, name: value}))
    assert decode_event(msgpack.packb({**good, "newer_field": [1, {"x": "y"}]})).hashes == (1,)  # ignored


def test_a_published_event_refuses_hashes_msgpack_cannot_carry():
    """Built in Python (the publisher), a ``KVEvent`` refuses what its writer thread could not encode."""
    for hashes, parent in (((1, -1), None), ((True,), None), ((1.0,), None), (("1",), None), ((1,), 1 << 64),
                           ((1,), True), ((1,), -1)):
        with pytest.raises(EventDecodeError, match="unsigned 64-bit"):
            KVEvent("w", 0, "stored", hashes, parent, 0)
