"""KV events (contract 2): the msgpack codec and the worker-side publisher.

An event is ``{"worker": id, "seq": n, "kind": "stored"|"removed"|"cleared",
"hashes": [...], "parent": hash|None, "ts": ms}``, plus the optional ``"medium":
"device"|"host"|"disk"`` (absent: device), the KV tier that now holds (``stored``) or no longer
holds (``removed``) the blocks (engine/kv_tier.py). ``seq`` is per worker and
monotonic. ``decode_event`` is the way a router reads one: bounded size, strict
types, msgpack only (no pickle, no ext types); anything else raises
``EventDecodeError`` and the consumer counts, logs and skips it. Unknown extra keys
are ignored so a newer worker can add fields without blinding older routers. The consumer's
batch path reads the common case with ``EventReader``, which accepts only what ``decode_event``
accepts (and leaves everything else to it).

Snapshot (for resynchronisation): in the same Redis transaction as each event, the
publisher keeps the set of the worker's cached block hashes (8-byte little-endian
members) at ``config.snapshot_key(worker)`` (device) and ``config.snapshot_tier_key(worker,
medium)`` (each tier below it) and the seq it reflects at
``config.snapshot_seq_key(worker)``. A router that sees a gap reads
both atomically (``router.event_consumer.RedisSnapshotSource``) and skips events with
``seq <= snapshot seq``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from router.config import RouterConfig

log = logging.getLogger(__name__)

KINDS = ("stored", "removed", "cleared")
MEDIA = ("device", "host", "disk")  # engine.kv_tier.MEDIA; the router does not import the engine's torch
_U64 = 1 << 64
_MAX_WORKER_ID = 256
_INT_ONLY = {int}


class EventDecodeError(ValueError):
    """Bytes that are not a valid contract-2 KV event."""


class _Closing(Exception):
    """The publisher is closing while Redis fails: stop retrying, leave the batch unwritten."""


class _Dropped(Exception):
    """The backlog overflowed and was dropped: stop retrying the batch (it is gone)."""


@dataclass(frozen=True)
class KVEvent:
    worker: str
    seq: int
    kind: str
    hashes: tuple[int, ...]
    parent: int | None
    ts: int
    medium: str = "device"

    def __post_init__(self) -> None:
        _check_event(self.worker, self.seq, self.kind, self.hashes, self.parent, self.ts)
        if not isinstance(self.medium, str) or not 0 < len(self.medium) <= 32:
            # a medium this router does not know (a newer worker's) decodes: the consumer skips the event
            raise EventDecodeError(f"medium must be a short string ({', '.join(MEDIA)}), got {self.medium!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_event(worker, seq, kind, hashes, parent, ts) -> None:
    if not isinstance(worker, str) or not 0 < len(worker) <= _MAX_WORKER_ID:
        raise EventDecodeError(f"worker must be a non-empty string of <= {_MAX_WORKER_ID} chars")
    if not _is_int(seq) or seq < 0:
        raise EventDecodeError(f"seq must be an integer >= 0, got {seq!r}")
    if kind not in KINDS:
        raise EventDecodeError(f"kind must be one of {KINDS}, got {kind!r}")
    # C-speed form of "every h is an int (not a bool) with 0 <= h < 2**64": a router absorbs
    # hundreds of thousands of hashes a second (benchmarks/router_scale.py).
    if hashes and not (set(map(type, hashes)) == _INT_ONLY and min(hashes) >= 0 and max(hashes) < _U64):
        raise EventDecodeError("hashes must be unsigned 64-bit integers")
    if parent is not None and not (_is_int(parent) and 0 <= parent < _U64):
        raise EventDecodeError(f"parent must be None or an unsigned 64-bit integer, got {parent!r}")
    if not _is_int(ts) or ts < 0:
        raise EventDecodeError(f"ts must be an integer >= 0 (ms), got {ts!r}")


def encode_event(event: KVEvent) -> bytes:
    obj = {"worker": event.worker, "seq": event.seq, "kind": event.kind,
           "hashes": list(event.hashes), "parent": event.parent, "ts": event.ts}
    if event.medium != "device":   # absent means device: events of a worker without tiers are unchanged
        obj["medium"] = event.medium
    return msgpack.packb(obj)


def decode_event(data: bytes, max_bytes: int = 1 << 20, max_hashes: int = 65_536) -> KVEvent:
    """Decode and validate one event; raises ``EventDecodeError`` on anything unexpected."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EventDecodeError(f"event payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise EventDecodeError(f"event of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              max_array_len=max_hashes, max_map_len=32, max_str_len=4096,
                              max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise EventDecodeError(f"not a msgpack event: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise EventDecodeError(f"event must be a map, got {type(obj).__name__}")
    missing = {"worker", "seq", "kind", "hashes", "parent", "ts"} - obj.keys()
    if missing:
        raise EventDecodeError(f"event lacks {sorted(missing)}")
    hashes = obj["hashes"]
    if not isinstance(hashes, list):
        raise EventDecodeError(f"hashes must be a list, got {type(hashes).__name__}")
    # KVEvent's own check (``__post_init__``) validates every field once.
    return KVEvent(obj["worker"], obj["seq"], obj["kind"], tuple(hashes), obj["parent"], obj["ts"],
                   obj.get("medium", "device"))


_ORDINARY_KINDS = ("stored", "removed")


class EventReader:
    """The consumer's batch decoder (``KVEventConsumer.apply_entries``): ``reader.ordinary(data)`` is
    ``(worker, seq, kind, hashes, medium)`` of an ordinary event, else None, with no ``KVEvent`` built
    and no exception raised.

    Ordinary: bytes within ``max_bytes`` that are exactly one msgpack object under ``decode_event``'s
    limits, a map whose fields have the types and ranges ``decode_event`` checks, ``kind`` stored or
    removed, ``medium`` absent or one of ``MEDIA``. Whatever this accepts, ``decode_event`` accepts
    with the same fields (tested on random and hostile bytes in ``tests/router/test_event_batches.py``);
    None means "ask ``decode_event``", which then refuses the bytes with its reason, or decodes a
    ``cleared`` event or one of a medium this router does not know.

    One ``msgpack.Unpacker`` is reused (the unpack alone ~30% cheaper than ``unpackb``, which parses
    its keyword arguments on every call). Its buffer is empty before each payload; a payload that is
    not one whole object (truncated, trailing bytes, invalid) makes a new one, so nothing of it
    reaches the next."""

    def __init__(self, max_bytes: int = 1 << 20, max_hashes: int = 65_536) -> None:
        self.max_bytes, self.max_hashes = max_bytes, max_hashes
        self._reset()

    def _reset(self) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=False,
                                    max_array_len=self.max_hashes, max_map_len=32, max_str_len=4096,
                                    max_bin_len=0, max_ext_len=0, max_buffer_size=self.max_bytes)
        self._feed, self._unpack, self._tell = unpacker.feed, unpacker.unpack, unpacker.tell
        self._end = 0  # offset where the next payload starts in the unpacker's stream

    def ordinary(self, data: object) -> tuple[str, int, str, tuple[int, ...], str] | None:
        if type(data) is not bytes or len(data) > self.max_bytes:
            return None
        try:
            self._feed(data)
            obj = self._unpack()
            self._end = end = self._end + len(data)
            if self._tell() != end:  # trailing bytes (unpackb: ExtraData)
                raise ValueError("not one msgpack object")
        except Exception:  # OutOfData (truncated), invalid, over a limit: start clean
            self._reset()
            return None
        try:
            if type(obj) is not dict:
                return None
            worker, seq, kind, hashes, parent, ts = (obj["worker"], obj["seq"], obj["kind"], obj["hashes"],
                                                     obj["parent"], obj["ts"])
            medium = obj.get("medium", "device")
        except KeyError:  # a field missing: decode_event says which
            return None
        if not (type(worker) is str and 0 < len(worker) <= _MAX_WORKER_ID and type(seq) is int and seq >= 0
                and type(ts) is int and ts >= 0 and kind in _ORDINARY_KINDS and type(hashes) is tuple
                and (parent is None or (type(parent) is int and 0 <= parent < _U64)) and medium in MEDIA):
            return None  # (``in`` a tuple compares with ==: true for those strings only, whatever the type)
        if hashes:
            if len(hashes) == 1:
                h = hashes[0]
                if not (type(h) is int and 0 <= h < _U64):
                    return None
            elif not (set(map(type, hashes)) == _INT_ONLY and min(hashes) >= 0 and max(hashes) < _U64):
                return None
        return worker, seq, kind, hashes, medium


def ordinary_event(data: object, max_bytes: int = 1 << 20,
                   max_hashes: int = 65_536) -> tuple[str, int, str, tuple[int, ...], str] | None:
    """``EventReader(max_bytes, max_hashes).ordinary(data)``, on a reader of its own."""
    return EventReader(max_bytes, max_hashes).ordinary(data)


def pack_hash(h: int) -> bytes:
    return h.to_bytes(8, "little")


def unpack_hash(b: bytes) -> int:
    if len(b) != 8:
        raise EventDecodeError(f"snapshot member must be 8 bytes, got {len(b)}")
    return int.from_bytes(b, "little")


class KVEventPublisher:
    """Worker side: turns radix-cache callbacks into stream entries, off the engine thread.

    ``publish(kind, hashes, parent)`` matches the cache's ``on_event`` callback; it only
    assigns the next seq and enqueues (never blocks on Redis). A daemon thread writes
    batches: per event one ``XADD`` (``MAXLEN ~ config.events_maxlen``) plus the matching
    snapshot update, in one ``MULTI`` transaction. ``start`` publishes a ``cleared``
    event first, so a worker that comes back wipes its stale entries in every router.

    While Redis is unreachable the writer keeps the unwritten events, in order, and retries
    them without limit (redis-py's ``Retry`` with exponential backoff, 0.1 s doubling to 2 s),
    so a Redis restart costs the routers no event and no resync: seqs stay contiguous and
    the snapshot set stays exact. A batch may be written twice (the reply of a committed
    ``EXEC`` lost); routers skip the repeated seqs and the set updates are idempotent. If
    more than ``max_backlog`` events pile up, the backlog is dropped and ``lost`` is set: the
    snapshot is then stale, and the owner must republish the whole cache (``cleared`` then
    ``stored``) and call ``clear_lost`` (``router.worker.WorkerRuntime`` does, on its next
    good heartbeat).
    """

    def __init__(self, config: RouterConfig, worker_id: str,
                 client: redis.Redis | None = None, max_backlog: int = 200_000) -> None:
        if not worker_id or len(worker_id) > _MAX_WORKER_ID:
            raise ValueError(f"worker_id must be 1..{_MAX_WORKER_ID} characters")
        self.config = config
        self.worker_id = worker_id
        self._redis = client or redis.Redis.from_url(config.redis_url)
        self._retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=-1, supported_errors=(redis.RedisError,))
        self._queue: queue.Queue[KVEvent | None] = queue.Queue()
        self._lock = threading.Lock()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._started = False
        self.max_backlog = max_backlog
        self.written = 0        # events written to Redis
        self.retries = 0        # failed writes retried
        self.dropped = 0        # events dropped on backlog overflow
        self._lost = threading.Event()
        self._closing = threading.Event()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("publisher already started")
        self._started = True
        self.publish("cleared", [], None)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.worker_id}",
                                        daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """Seq of the last event published (-1: none yet)."""
        with self._lock:
            return self._seq - 1

    def publish(self, kind: str, hashes: list[int], parent: int | None, medium: str = "device") -> None:
        if not self._started:
            raise RuntimeError("call start() before publishing (it announces `cleared` first)")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if medium not in MEDIA:
            raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
        with self._lock:
            event = KVEvent(self.worker_id, self._seq, kind, tuple(hashes), parent,
                            int(time.time() * 1000), medium)
            self._seq += 1
            self._queue.put(event)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every event published so far is in Redis."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._queue.unfinished_tasks} KV events not yet written")
            time.sleep(0.002)

    @property
    def lost(self) -> bool:
        """Events were dropped (backlog overflow): the snapshot in Redis is stale."""
        return self._lost.is_set()

    def clear_lost(self) -> None:
        self._lost.clear()

    def close(self) -> None:
        if self._thread is not None:
            self._closing.set()  # a retry loop gives up at once instead of waiting for Redis
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def _take(self, batch: list[KVEvent], block: bool) -> bool:
        """Move queued events into ``batch`` (up to 512), waiting for the first one if ``block``;
        False once the close sentinel has been taken."""
        while len(batch) < 512:
            try:
                item = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item is None:
                self._queue.task_done()
                return False
            batch.append(item)
        return True

    def _run(self) -> None:
        pending: list[KVEvent] = []   # taken from the queue, not yet written (in seq order)
        open_ = True
        while pending or open_:
            if not pending:
                open_ = self._take(pending, block=True)
                continue
            try:
                failures = self._write_retrying(pending, open_)
            except _Closing:
                log.warning("closing with %d KV events of %s unwritten", len(pending), self.worker_id)
                self._done(pending)
                return
            except _Dropped:
                continue
            if failures:
                log.warning("KV events of %s written again after %d failed tries", self.worker_id, failures)
            self.written += len(pending)
            self._done(pending)
            if open_:  # whatever queued meanwhile goes out next, without waiting
                open_ = self._take(pending, block=False)

    def _write_retrying(self, pending: list[KVEvent], open_: bool) -> int:
        """Write ``pending``, retried by ``self._retry`` while Redis fails; returns the failed tries.
        Gives up with ``_Closing`` once ``close`` was called, and with ``_Dropped`` when the backlog
        overflows (``_drop`` has emptied ``pending``)."""
        failures = 0

        def failed(exc: Exception) -> None:
            nonlocal failures
            if self._closing.is_set():
                raise _Closing from exc
            failures += 1
            self.retries += 1
            if failures == 1 or failures % 30 == 0:
                log.warning("writing KV events %d..%d of %s failed (%s); retrying",
                            pending[0].seq, pending[-1].seq, self.worker_id, exc)
            if open_ and self._queue.qsize() + len(pending) > self.max_backlog:
                self._drop(pending)
                raise _Dropped from exc

        self._retry.call_with_retry(lambda: self._write(pending), failed)
        return failures

    def _done(self, events: list[KVEvent]) -> None:
        for _ in events:
            self._queue.task_done()
        events.clear()

    def _drop(self, pending: list[KVEvent]) -> None:
        """Backlog overflow: drop every unwritten event and flag the snapshot as stale."""
        dropped = len(pending)
        self._done(pending)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # keep the close request
                self._queue.task_done()
                self._queue.put(None)
                break
            dropped += 1
            self._queue.task_done()
        self.dropped += dropped
        self._lost.set()
        log.error("dropped %d unwritten KV events of %s (backlog over %d); the whole cache will be "
                  "republished when Redis is back", dropped, self.worker_id, self.max_backlog)

    def _write(self, events: list[KVEvent]) -> None:
        cfg, snap = self.config, self.config.snapshot_key(self.worker_id)
        pipe = self._redis.pipeline(transaction=True)
        for e in events:
            key = snap if e.medium == "device" else cfg.snapshot_tier_key(self.worker_id, e.medium)
            if e.kind == "cleared":
                pipe.delete(snap, *(cfg.snapshot_tier_key(self.worker_id, m) for m in MEDIA[1:]))
            elif e.kind == "stored" and e.hashes:
                pipe.sadd(key, *map(pack_hash, e.hashes))
            elif e.kind == "removed" and e.hashes:
                pipe.srem(key, *map(pack_hash, e.hashes))
            pipe.xadd(cfg.events_stream_key, {"e": encode_event(e)},
                      maxlen=cfg.events_maxlen, approximate=True)
        pipe.set(cfg.snapshot_seq_key(self.worker_id), events[-1].seq)
        pipe.execute()


async def cache_snapshot(llm: Any, publisher: KVEventPublisher) -> tuple[list[int], int]:
    """Every block hash in the engine's radix cache and the last KV-event seq, read together
    by the engine thread between steps (events are published from that thread too)."""
    return await asyncio.wrap_future(llm.request_cache_snapshot(lambda: publisher.last_seq))
