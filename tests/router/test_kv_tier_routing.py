"""KV tiers on the router side: contract 2's optional ``medium`` on the wire, the prefix index keeping
each block's media, a snapshot carrying the tiers, and the agentrt policy pricing a tier hit as a
load (cheaper than recomputing, dearer than a device hit)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.event_consumer import KVEventConsumer
from router.events import KVEvent, KVEventPublisher, decode_event, encode_event
from router.index import PrefixIndex
from router.policies.agentrt import AgentrtPolicy
from router.policy import RouteRequest, WorkerState


def test_medium_on_the_wire_absent_means_device():
    dev = KVEvent("w", 1, "stored", (5,), None, 0)
    assert "medium" not in msgpack.unpackb(encode_event(dev))   # a worker without tiers sends what it sent
    assert decode_event(encode_event(dev)).medium == "device"
    disk = KVEvent("w", 2, "removed", (5,), None, 0, "disk")
    assert decode_event(encode_event(disk)) == disk


def test_index_keeps_each_blocks_media():
    index = PrefixIndex()
    index.stored("a", [1, 2, 3])
    index.stored("a", [1, 2], medium="disk")       # evicted pages reach the disk tier ...
    index.removed("a", [1, 2])                     # ... and leave the device
    index.stored("a", [4], medium="host")
    assert index.match([1, 2, 3, 4]) == {"a": 4}   # every medium holds the prefix
    assert [index.medium_of("a", h) for h in (1, 2, 3, 4, 5)] == ["disk", "disk", "device", "host", None]
    assert index.tier_blocks("a", [1, 2, 3, 4]) == {"disk": 2, "host": 1}
    assert index.blocks_by_medium("a") == {"device": 1, "host": 1, "disk": 2}
    index.stored("a", [1])                         # loaded back into the pool
    assert index.medium_of("a", 1) == "device" and index.tier_blocks("a", [1, 2]) == {"disk": 1}
    index.removed("a", [2], medium="disk")         # gone from its only medium: gone
    index.removed("a", [3], medium="disk")         # not in that medium: stays on the device
    assert index.match([1, 2]) == {"a": 1} and index.medium_of("a", 3) == "device"
    index.clear_worker("a")
    assert index.match([1]) == {} and index.blocks_by_medium("a") == {"device": 0, "host": 0, "disk": 0}


def test_publisher_snapshot_carries_tiers_and_resync_restores_them(redis_url):
    cfg = RouterConfig(redis_url=redis_url, deployment="tiers")
    pub = KVEventPublisher(cfg, "w1", redis.Redis.from_url(redis_url))
    pub.start()
    pub.publish("stored", [10, 11, 12], None)
    pub.publish("stored", [10, 11], None, medium="disk")
    pub.publish("removed", [10, 11], None)
    pub.flush()
    pub.close()

    async def body():
        client = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex()
        consumer = KVEventConsumer(client, cfg, index)
        await consumer.bootstrap(["w1"])   # from the snapshot only
        await client.aclose()
        return index
    index = asyncio.run(body())
    assert index.match([10, 11, 12]) == {"w1": 3}
    assert index.blocks_by_medium("w1") == {"device": 1, "host": 0, "disk": 2}


def _req(blocks: int) -> RouteRequest:
    return RouteRequest("r", tuple(range(blocks)), blocks * 16, 16)


def test_a_tier_hit_costs_between_a_device_hit_and_a_recompute():
    policy = AgentrtPolicy()
    req = _req(64)
    # only a's disk tier holds the prompt: it wins over recomputing on b
    d = policy.select(req, [WorkerState("a", 64, disk_blocks=64), WorkerState("b", 0)])
    assert d.worker_id == "a" and d.reason == "prefix"
    # the same prefix on b's device beats a's disk copy at equal load (c holds nothing)
    d = policy.select(req, [WorkerState("a", 64, disk_blocks=64), WorkerState("b", 64), WorkerState("c", 0)])
    assert d.worker_id == "b"
    # and a host copy beats a disk copy
    d = policy.select(req, [WorkerState("a", 64, disk_blocks=64), WorkerState("b", 64, host_blocks=64),
                            WorkerState("c", 0)])
    assert d.worker_id == "b"
    # a whole prefix on disk beats most of it on a device: loading 64 blocks costs less than computing 24
    d = policy.select(req, [WorkerState("a", 64, disk_blocks=64), WorkerState("b", 40), WorkerState("c", 0)])
    assert d.worker_id == "a"
    with pytest.raises(ValueError, match="host_load_weight"):
        AgentrtPolicy(host_load_weight=0.5, disk_load_weight=0.1)


def test_status_shows_each_workers_tiers():
    from router.status import format_status

    tier = {"capacity_pages": 4096, "pages": 12, "hit_tokens": 480, "loads": 30, "load_time_s": 0.05,
            "bytes_written": 8_847_360, "bytes_read": 22_118_400, "corrupt": 1, "dropped": 0, "errors": 0,
            "enabled": True}
    status = {"redis": "redis://x", "deployment": "default", "sessions": 0, "events_in_stream": 3, "hit_rate": 0.5,
              "workers": [{"id": "w0", "alive": True, "url": "http://w0", "running": 0, "waiting": 0,
                           "pages_used": 1, "pages_free": 9, "cached_blocks": 4, "hit_rate": 0.5,
                           "kv_tiers": {"disk": tier}}]}
    text = format_status(status)
    assert "KV tiers" in text
    row = next(line for line in text.splitlines() if line.startswith("w0") and "disk" in line).split()
    assert row == ["w0", "disk", "yes", "12/4096", "480", "30", "0.050", "8.8", "22.1", "1", "0"]
