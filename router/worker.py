"""Worker mode: the engine behind agentrt's HTTP API, registered in Redis for routers.

``create_worker_app`` builds the usual app (``agentrt.server.create_app``) around an engine
whose radix cache reports to a ``KVEventPublisher`` (contract 2), and adds:

* registration and a heartbeat with the worker's load (``WorkerRuntime``; contract 3). If
  the registration record disappears (Redis restarted without persistence) the next
  heartbeat registers again and re-announces the cache: ``cleared``, then ``stored`` with
  every cached block, so routers rebuild this worker's index entries.
* the internal endpoints a router uses (``router/worker_api.py``): generate from token ids,
  pin/unpin, the cache snapshot; and the page transfers between workers (``router/kv_moves.py``:
  ``/internal/kv/blocks`` serves cached pages, a turn with a ``kv_source`` pulls them; ``--kv-moves
  false`` turns both off);
* the endpoints SGLang's router expects of a worker (``router/sglang_api.py``);
* with ``--kv-events zmq://...``, the same KV events in vLLM's wire format on ZMQ
  (``router/vllm_publisher.py``), for Dynamo, llm-d or an agentrt router's ``--vllm-worker``.

Draining (SIGTERM, ``serve_worker``; or ``POST /internal/drain``, which drains the same way and leaves
the process up until it is stopped, for a k8s preStop hook or a scale-in script): the worker stops
heartbeating and unregisters at once (routers drop it at their next refresh), answers new generate requests with 503
``worker_draining`` (a router sends such a request to another worker; the public endpoints,
``/v1/chat/completions``, ``/v1/completions``, session turns and ``/generate``, answer the same,
with ``Retry-After``), lets the requests in flight finish (up to ``shutdown_timeout_s``), hands its
pinned sessions' KV to the other live workers (KV moves on: ``KVMoves.hand_over``), then
shuts down. A second SIGTERM, or SIGINT, stops at once. A killed worker simply stops
heartbeating and expires after ``heartbeat_ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any, AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI

from agentrt.config import KEEP_ALIVE_S, ServerConfig
from agentrt.core.tasks import cancel_and_wait
from router.config import RouterConfig, WorkerSettings
from router.core import redis_client
from router.events import KVEventPublisher, cache_snapshot
from router.registry import LoadReport, WorkerInfo, WorkerRegistry

log = logging.getLogger("router.worker")


class WorkerRuntime:
    """Registration, heartbeat and KV events of one worker process (``settings`` resolved: id and URL set)."""

    def __init__(self, rconfig: RouterConfig, settings: WorkerSettings, llm: Any,
                 publisher: KVEventPublisher, zmq_publisher: Any = None) -> None:
        self.config = rconfig
        self.settings = settings
        self.llm = llm
        self.publisher = publisher
        self.zmq_publisher = zmq_publisher  # router/vllm_publisher.py (--kv-events), or None
        self._redis = redis_client(rconfig.redis_url)
        self.registry = WorkerRegistry(self._redis, rconfig)
        self._task: asyncio.Task | None = None
        self._drain: asyncio.Future | None = None   # the one drain (SIGTERM or POST /internal/drain)
        self.moves: Any = None   # router/kv_moves.py KVMoves, when moves are on: its measured pull bandwidth

    @property
    def info(self) -> WorkerInfo:
        engine_cfg = self.llm.config
        return WorkerInfo(worker_id=self.settings.worker_id, url=self.settings.advertise_url, model=self.llm.model_id,
                          capacity=engine_cfg.max_num_seqs, kv_pages=engine_cfg.num_pages,
                          block_size=engine_cfg.page_size)

    def load(self) -> LoadReport:
        s = self.llm.stats()
        by_class = s.waiting_by_priority   # "<high|normal|low>/<new|started>" -> requests
        return LoadReport(running=s.running, waiting=s.waiting, pages_used=s.pages_used,
                          pages_free=s.pages_free, waiting_tokens=s.waiting_tokens, ts_ms=int(time.time() * 1000),
                          waiting_new=sum(n for label, n in by_class.items() if label.endswith("/new")),
                          waiting_high=sum(n for label, n in by_class.items() if label.startswith("high/")),
                          prefill_tokens_per_s=float(s.prefill_tokens_per_s),
                          kv_bytes_per_token=s.kv_cache_bytes_per_token,
                          kv_pull_bytes_per_s=self.moves.stats.bytes_per_s if self.moves is not None else 0.0)

    async def start(self) -> None:
        self.publisher.start()  # announces `cleared`: a returning worker's stale entries vanish
        await self._publish_tiers()  # a kept disk tier's pages (kv_disk_keep) are there from the start
        if self.zmq_publisher is not None:
            self.zmq_publisher.start()  # AllBlocksCleared at seq 0, the same for vLLM-format consumers
        await self.registry.register(self.info)
        await self.registry.heartbeat(self.settings.worker_id, self.load())
        self._task = asyncio.create_task(self._beat_forever(), name="worker-heartbeat")
        log.info("worker %s registered at %s", self.settings.worker_id, self.settings.advertise_url)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.beat()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("heartbeat of %s failed (%s); retrying", self.settings.worker_id, exc)

    async def beat(self) -> None:
        """One heartbeat; first repairs what an outage broke (our keys gone, KV events dropped)."""
        wid = self.settings.worker_id
        if not await self._redis.exists(self.config.worker_key(wid)):
            await self._reannounce()
        elif self.publisher.lost:  # KV events were dropped in an outage: the snapshot is stale
            await self._republish_cache()
        await self.registry.heartbeat(wid, self.load())

    async def _reannounce(self) -> None:
        """Redis lost our keys: register again and republish the whole cache."""
        log.warning("registration of %s is gone from Redis; registering again", self.settings.worker_id)
        await self.registry.register(self.info)
        await self._republish_cache()

    async def _republish_cache(self) -> None:
        """``cleared`` then one ``stored`` with every cached block: every router resyncs to the truth."""
        self.publisher.clear_lost()
        self.publisher.publish("cleared", [], None)
        hashes, _ = await cache_snapshot(self.llm, self.publisher)
        if hashes:
            self.publisher.publish("stored", hashes, None)
        await self._publish_tiers()
        log.warning("republished the KV cache of %s (%d blocks)", self.settings.worker_id, len(hashes))

    async def _publish_tiers(self) -> None:
        """``stored`` with its medium for every block in the engine's KV tiers (engine/kv_tier.py)."""
        if getattr(self.llm, "tiers", None) is None:
            return
        for medium, hashes in (await asyncio.wrap_future(self.llm.request_tier_snapshot())).items():
            if hashes:
                self.publisher.publish("stored", hashes, None, medium=medium)

    async def drain(self, app: FastAPI, timeout_s: float) -> dict:
        """Accept nothing new, leave the routing table, wait for requests in flight, hand the pinned
        sessions over. Returns ``requests_left`` (still running when ``timeout_s`` ran out: the shutdown
        that follows aborts them) and ``handover`` (``KVMoves.hand_over``'s counts; None when moves are
        off or Redis was unreachable). A worker drains once: a later call (the SIGTERM after a
        ``POST /internal/drain``) waits for the first and returns its result."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_once(app, timeout_s))
        return await asyncio.shield(self._drain)

    async def _drain_once(self, app: FastAPI, timeout_s: float) -> dict:
        parts = app.state.services
        parts.stopping = True  # /health 503, /internal/generate 503 worker_draining
        parts.generator.draining = True  # and every public endpoint that generates
        log.warning("worker %s draining: %d requests in flight", self.settings.worker_id, parts.generator.in_flight)
        await self._stop_heartbeat()
        await self._unregister()
        deadline = time.monotonic() + timeout_s
        while parts.generator.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = parts.generator.in_flight
        log.warning("worker %s drained (%d requests still running)", self.settings.worker_id, left)
        handover = None
        if self.moves is not None:   # its pinned sessions' KV to other workers, before it goes
            handover = await self._hand_over(max(1.0, deadline - time.monotonic()))
        return {"worker_id": self.settings.worker_id, "requests_left": left, "handover": handover}

    async def _hand_over(self, timeout_s: float) -> dict | None:
        """Ask the other live workers of this model, least loaded first, to pull this worker's pinned
        sessions (router/kv_moves.py ``KVMoves.hand_over``): a router with no holder of a session's prefix
        sends its next turn to the least-loaded worker too, and once it knows the blocks, to their holder."""
        me = self.settings.worker_id
        try:
            live = [w for w in await self.registry.live_workers() if w.worker_id != me and w.model == self.llm.model_id]
            loads = await self.registry.loads([w.worker_id for w in live])
        except (aioredis.RedisError, OSError) as exc:
            log.warning("drain handover of %s skipped: Redis unreachable (%s)", me, exc)
            return None
        live.sort(key=lambda w: (loads[w.worker_id].running + loads[w.worker_id].waiting
                                 if w.worker_id in loads else 0, w.worker_id))
        return await self.moves.hand_over(self.settings.advertise_url, [w.url for w in live], timeout_s)

    async def _stop_heartbeat(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _unregister(self) -> None:
        try:
            await self.registry.unregister(self.settings.worker_id)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not unregister %s: %s", self.settings.worker_id, exc)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)   # the heartbeat
        try:
            await self.registry.unregister(self.settings.worker_id)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not unregister %s: %s", self.settings.worker_id, exc)
        await asyncio.to_thread(self.publisher.close)
        if self.zmq_publisher is not None:
            await asyncio.to_thread(self.zmq_publisher.close)
        await self._redis.aclose()


def _event_publishers(config: ServerConfig, rconfig: RouterConfig, settings: WorkerSettings) -> tuple[Any, Any, Any]:
    """The worker's KV event publishers (to Redis; with ``kv_events``, vLLM's ZMQ format as well) and the
    engine's hook that feeds them: both see the same events."""
    publisher = KVEventPublisher(rconfig, settings.worker_id)
    if settings.kv_events is None:
        return publisher, None, publisher.publish
    from router.vllm_publisher import ZmqKVEventPublisher

    zmq_publisher = ZmqKVEventPublisher(settings.kv_events, config.engine_config().page_size,
                                        settings.kv_events_replay, settings.kv_events_topic,
                                        settings.kv_events_encoding, settings.kv_events_buffer)

    def on_kv_event(kind: str, hashes: list[int], parent: int | None, tokens: Any = None, salt: str = "",
                    medium: str = "device") -> None:
        publisher.publish(kind, hashes, parent, medium=medium)
        if medium == "device":  # vLLM-format consumers follow the device pool only (its events carry tokens)
            zmq_publisher.publish(kind, hashes, parent, tokens, salt)

    return publisher, zmq_publisher, on_kv_event


def create_worker_app(config: ServerConfig, rconfig: RouterConfig, settings: WorkerSettings) -> FastAPI:
    """agentrt's app around an engine that publishes KV events, plus worker and SGLang endpoints
    (``settings`` as routers see this worker; unset id or URL from ``config``'s listen address)."""
    from engine import LLMEngine

    from agentrt.server import create_app
    from router.kv_moves import KVMoveCollector, KVMoves, kv_routes
    from router.sglang_api import sglang_routes
    from router.worker_api import worker_routes

    settings = settings.resolve(config)
    publisher, zmq_publisher, on_kv_event = _event_publishers(config, rconfig, settings)
    llm = LLMEngine(config.engine_config(), on_kv_event=on_kv_event, kv_event_tokens=zmq_publisher is not None)
    if llm.config.page_size != rconfig.block_size:
        raise ValueError(f"the engine's page size {llm.config.page_size} must equal the deployment's block "
                         f"size {rconfig.block_size} (contract 1)")
    app = create_app(config, engine=llm, role="worker")
    runtime = WorkerRuntime(rconfig, settings, llm, publisher, zmq_publisher)
    moves = KVMoves(llm, settings.kv_pull_timeout_s) if rconfig.kv_moves else None
    runtime.moves = moves
    if moves is not None:
        app.state.services.metrics.attach(KVMoveCollector(moves))
    app.state.llm = llm
    app.state.worker = runtime
    app.state.kv_moves = moves
    app.include_router(worker_routes)
    app.include_router(kv_routes)
    app.include_router(sglang_routes)
    app.add_middleware(NameWorker, worker_id=settings.worker_id)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with inner(app):
            app.state.loop = asyncio.get_running_loop()
            await runtime.start()
            try:
                yield
            finally:
                await runtime.stop()
                if moves is not None:
                    await moves.close()

    app.router.lifespan_context = lifespan
    return app


class NameWorker:
    """ASGI middleware: every HTTP response carries ``x-agentrt-worker: <id>``, as a router's responses
    name the worker that served them, so a client behind any front (a peer router that passes response
    headers on) can tell where its request ran."""

    def __init__(self, app: Any, worker_id: str) -> None:
        self.app, self.header = app, (b"x-agentrt-worker", worker_id.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)
        await self.app(scope, receive, named)


def serve_worker(app: FastAPI, config: ServerConfig) -> None:
    """Run the worker under uvicorn; the first SIGTERM drains it before the usual shutdown."""
    import uvicorn

    from agentrt.server import freeze_startup_heap

    freeze_startup_heap()

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = getattr(app.state, "loop", None)
            if sig != signal.SIGTERM or self.draining or loop is None:
                return super().handle_exit(sig, frame)
            self.draining = True
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit(sig)))

        async def _drain_then_exit(self, sig: int) -> None:
            try:
                await app.state.worker.drain(app, config.shutdown_timeout_s)
            finally:
                super().handle_exit(sig, None)

    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           timeout_graceful_shutdown=int(config.shutdown_timeout_s) or 1,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    server.run()
