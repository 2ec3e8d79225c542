"""Worker registry in Redis (contract 3).

Keys (``config`` names them): ``worker:<id>`` is the registration hash (url, model,
capacity, ...), ``worker:<id>:hb`` the heartbeat key, set with a TTL of
``heartbeat_ttl_s`` and refreshed every ``heartbeat_interval_s``; ``worker:<id>:load`` the
last load report (msgpack, with its own TTL); ``workers:<deployment>`` the set of
registered ids. A worker is *live* exactly while its heartbeat key exists; a worker
whose heartbeat expired, or that a router marked dead after a failed connection, is not
routed to until it heartbeats again (a worker that comes back re-registers, and its
publisher's ``cleared`` event drops its stale index entries).

Both sides use ``redis.asyncio``: the worker runs ``register`` then ``heartbeat_loop`` as
a task; routers call ``live_workers``/``loads``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Annotated

import msgspec
import redis.asyncio as aioredis
from msgspec import Meta

from router.config import RouterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker registers. ``capacity``: the most requests it runs at once;
    ``kv_pages``: its KV pool size in pages of ``block_size`` tokens."""

    worker_id: str
    url: str
    model: str
    capacity: int = 1
    kv_pages: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.worker_id or ":" in self.worker_id or len(self.worker_id) > 256:
            raise ValueError(f"worker_id must be 1..256 characters without ':', got {self.worker_id!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker url must be http(s)://..., got {self.url!r}")
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.capacity < 1 or self.kv_pages < 0 or self.block_size < 1:
            raise ValueError("capacity and block_size must be >= 1 and kv_pages >= 0")


Count = Annotated[int, Meta(ge=0)]
Rate = Annotated[float, Meta(ge=0)]  # NaN refused too


class LoadReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker's load: requests running and waiting, KV pages used and free, and the tokens of
    the waiting requests (the KV demand its admission control bounds); of the waiting requests,
    ``waiting_new`` are a new session's first turn (what ``--scheduling-policy session`` refuses first)
    and ``waiting_high`` have a priority below 0 (engine/session_priority.py).

    On the wire (``encode_load``/``decode_load``) a msgpack map of these fields, no others; the field
    types (a bool is no count, NaN no rate) are checked when a router decodes it, not when a worker
    builds it from its engine's counters."""

    running: Count = 0
    waiting: Count = 0
    pages_used: Count = 0
    pages_free: Count = 0
    ts_ms: Count = 0
    waiting_tokens: Count = 0
    waiting_new: Count = 0
    waiting_high: Count = 0
    # what a router weighs a KV move with (router/move_cost.py); 0: not measured yet
    prefill_tokens_per_s: Rate = 0.0   # the worker's measured prefill throughput
    kv_bytes_per_token: Count = 0      # bytes of K and V a token takes in its pool
    kv_pull_bytes_per_s: Rate = 0.0    # the bandwidth its KV pulls measured


_encode_load = msgspec.msgpack.Encoder().encode
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode


def encode_load(load: LoadReport) -> bytes:
    return _encode_load(load)


def decode_load(blob: bytes) -> LoadReport:
    """The report in ``blob``; ``ValueError`` naming the field and what it must be otherwise."""
    try:
        return _decode_load(blob)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed load report: {e}") from None


def _text(d: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in d.items()}


class WorkerRegistry:
    def __init__(self, client: aioredis.Redis, config: RouterConfig) -> None:
        self._redis = client
        self.config = config

    # worker side
    async def register(self, info: WorkerInfo) -> None:
        """Write the registration record and a fresh heartbeat (idempotent)."""
        if info.block_size != self.config.block_size:
            raise ValueError(f"worker block_size {info.block_size} differs from the deployment's "
                             f"{self.config.block_size} (contract 1)")
        cfg = self.config
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(cfg.worker_key(info.worker_id),
                  mapping={k: str(v) for k, v in asdict(info).items()})
        pipe.sadd(cfg.workers_set_key, info.worker_id)
        pipe.set(cfg.heartbeat_key(info.worker_id), int(time.time() * 1000),
                 px=int(cfg.heartbeat_ttl_s * 1000))
        await pipe.execute()

    async def heartbeat(self, worker_id: str, load: LoadReport | None = None) -> None:
        """Refresh the heartbeat (and publish ``load`` if given)."""
        cfg = self.config
        ttl_ms = int(cfg.heartbeat_ttl_s * 1000)
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(cfg.heartbeat_key(worker_id), int(time.time() * 1000), px=ttl_ms)
        if load is not None:
            pipe.set(cfg.load_key(worker_id), encode_load(load), px=ttl_ms)
        await pipe.execute()

    async def heartbeat_loop(self, worker_id: str, load_fn=None) -> None:
        """Heartbeat forever every ``heartbeat_interval_s``; ``load_fn()`` returns a
        ``LoadReport`` (or None). Redis errors are logged and retried on the next beat."""
        while True:
            try:
                await self.heartbeat(worker_id, load_fn() if load_fn else None)
            except aioredis.RedisError:
                log.exception("heartbeat of %s failed", worker_id)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def unregister(self, worker_id: str) -> None:
        """Clean shutdown: remove every key of the worker."""
        cfg = self.config
        await self._redis.delete(cfg.worker_key(worker_id), cfg.heartbeat_key(worker_id),
                                 cfg.load_key(worker_id), cfg.snapshot_key(worker_id),
                                 cfg.snapshot_seq_key(worker_id))
        await self._redis.srem(cfg.workers_set_key, worker_id)

    # router side
    async def live_workers(self) -> list[WorkerInfo]:
        """Registered workers whose heartbeat key exists, sorted by id."""
        cfg = self.config
        ids = sorted(m.decode() for m in await self._redis.smembers(cfg.workers_set_key))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for wid in ids:
            pipe.exists(cfg.heartbeat_key(wid))
            pipe.hgetall(cfg.worker_key(wid))
        replies = await pipe.execute()
        live = []
        for wid, alive, record in zip(ids, replies[::2], replies[1::2]):
            if not (alive and record):
                continue
            try:
                live.append(self._info(wid, _text(record)))
            except (KeyError, ValueError, UnicodeDecodeError) as e:
                log.warning("ignoring malformed registration of %s: %s", wid, e)
        return live

    async def loads(self, worker_ids: list[str]) -> dict[str, LoadReport]:
        """Last load report of each worker that has an unexpired one."""
        if not worker_ids:
            return {}
        raw = await self._redis.mget([self.config.load_key(w) for w in worker_ids])
        out = {}
        for wid, blob in zip(worker_ids, raw):
            if blob is None:
                continue
            try:
                out[wid] = decode_load(blob)
            except ValueError as e:
                log.warning("ignoring the load report of %s: %s", wid, e)
        return out

    async def mark_dead(self, worker_id: str) -> None:
        """A connection to the worker failed: stop routing to it until it heartbeats again."""
        await self._redis.delete(self.config.heartbeat_key(worker_id),
                                 self.config.load_key(worker_id))

    @staticmethod
    def _info(worker_id: str, record: dict[str, str]) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, url=record["url"], model=record["model"],
                          capacity=int(record["capacity"]), kv_pages=int(record["kv_pages"]),
                          block_size=int(record["block_size"]))
