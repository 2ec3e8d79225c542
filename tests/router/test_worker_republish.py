"""A worker whose KV events were dropped in a long Redis outage republishes its whole cache.

Real engine (the embedded default model), real Redis, the real publisher and ``WorkerRuntime``:
the publisher's backlog is tiny, so events generated while Redis is down overflow it; after
Redis is back, one heartbeat (``WorkerRuntime.beat``) must leave the snapshot set and every
router's index equal to what the engine's radix cache really holds.
"""

from __future__ import annotations

import asyncio
import threading
import time

import redis
import redis.asyncio as aioredis

from engine import EngineConfig, LLMEngine, SamplingParams
from router.config import RouterConfig, WorkerSettings
from router.event_consumer import KVEventConsumer
from router.events import KVEventPublisher, unpack_hash
from router.index import PrefixIndex
from router.worker import WorkerRuntime


def _run(engine: LLMEngine, prompt: list[int]) -> None:
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


def test_dropped_events_are_repaired_by_a_republish(redis_server_factory):
    server = redis_server_factory(appendonly=True)
    cfg = RouterConfig(redis_url=server.url)
    pub = KVEventPublisher(cfg, "w9", redis.Redis.from_url(server.url, socket_connect_timeout=0.5),
                           max_backlog=1)
    engine = LLMEngine(EngineConfig(kv_cache_tokens=4096, max_batched_tokens=256), on_kv_event=pub.publish)
    runtime = WorkerRuntime(cfg, WorkerSettings(worker_id="w9", advertise_url="http://127.0.0.1:1"), engine, pub)
    tok = engine.tokenizer

    async def body():
        pub.start()  # what runtime.start() does, without its background heartbeat: the test beats
        await runtime.registry.register(runtime.info)
        _run(engine, tok.encode("First prompt, cached before the outage. " * 8))
        await asyncio.to_thread(pub.flush)
        server.stop()
        for i in range(3):  # each fills new blocks; their events overflow the 1-event backlog
            _run(engine, tok.encode(f"Prompt {i} while Redis is down, about topic {i * 17}. " * 6))
        deadline = time.monotonic() + 10
        while not pub.lost and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert pub.lost and pub.dropped > 0
        server.start()
        await asyncio.to_thread(pub.flush, 15)

        stop = threading.Event()

        def step_engine():  # the cache snapshot is read by the engine thread between steps
            while not stop.is_set():
                engine.step()
                time.sleep(0.005)
        stepper = threading.Thread(target=step_engine)
        stepper.start()
        try:
            await runtime.beat()
            truth = set(await asyncio.wrap_future(engine.request_cache_snapshot()))
        finally:
            stop.set()
            stepper.join()
        await asyncio.to_thread(pub.flush, 15)
        assert not pub.lost and len(truth) > 8

        client = aioredis.Redis.from_url(server.url)
        snapshot = {unpack_hash(m) for m in await client.smembers(cfg.snapshot_key("w9"))}
        index = PrefixIndex()
        consumer = KVEventConsumer(client, cfg, index)  # reads the stream from its start
        while await consumer.poll(block_ms=50):
            pass
        await client.aclose()
        await runtime.stop()
        return truth, snapshot, index

    truth, snapshot, index = asyncio.run(body())
    engine.close()
    assert snapshot == truth
    assert index.blocks_of("w9") == len(truth) and all(index.holders(h) == {"w9"} for h in truth)
