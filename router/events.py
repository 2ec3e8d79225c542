"""KV events (contract 2): the msgpack codec and the worker-side publisher.

An event is ``{"worker": id, "seq": n, "kind": "stored"|"removed"|"cleared",
"hashes": [...], "parent": hash|None, "ts": ms}``, plus the optional ``"medium":
"device"|"host"|"disk"`` (absent: device), the KV tier that now holds (``stored``) or no longer
holds (``removed``) the blocks (engine/kv_tier.py). ``seq`` is per worker and
monotonic. ``decode_event`` is the way a router reads one: bounded size, msgpack only (no
pickle, no ext types), strict types as ``KVEvent`` (a msgspec struct) declares them; anything else
raises ``EventDecodeError`` naming the field and what it must be, and the consumer counts, logs and
skips it. Unknown extra keys
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
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import redis
from msgspec import Meta
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from router.config import RouterConfig
from router.vllm_wire import unpack_bounded

log = logging.getLogger(__name__)

KINDS = ("stored", "removed", "cleared")
MEDIA = ("device", "host", "disk")  # engine.kv_tier.MEDIA; the router does not import the engine's torch
_U64 = 1 << 64
_MAX_WORKER_ID = 256
_INT_ONLY = {int}

# The wire types. msgspec checks them in C: an int is never a bool, a float or a string; msgpack carries
# no integer >= 2**64, so ``ge=0`` makes a decoded hash unsigned 64-bit (msgspec cannot state lt=2**64).
WorkerId = Annotated[str, Meta(min_length=1, max_length=_MAX_WORKER_ID)]
Count = Annotated[int, Meta(ge=0)]
Hash = Annotated[int, Meta(ge=0)]


class EventDecodeError(ValueError):
    """Bytes that are not a valid contract-2 KV event."""


class _Closing(Exception):
    """The publisher is closing while Redis fails: stop retrying, leave the batch unwritten."""


class _Dropped(Exception):
    """The backlog overflowed and was dropped: stop retrying the batch (it is gone)."""


class KVEvent(msgspec.Struct, frozen=True):
    """One event; its field types are the decoder's checks (``decode_event``). msgspec checks nothing when
    one is built in Python (the publisher, which checks ``kind``, ``medium`` and its worker id itself), so
    ``__post_init__`` refuses the hashes msgpack cannot carry: the caller of ``publish`` gets the error,
    not the writer thread."""

    worker: WorkerId
    seq: Count
    kind: Literal["stored", "removed", "cleared"]
    hashes: tuple[Hash, ...]
    parent: Hash | None
    ts: Count  # ms
    # a medium this router does not know (a newer worker's) decodes: the consumer skips the event
    medium: Annotated[str, Meta(min_length=1, max_length=32)] = "device"

    def __post_init__(self) -> None:
        hashes, parent = self.hashes, self.parent  # C-speed: this runs for every event a worker publishes
        if ((hashes and not (set(map(type, hashes)) == _INT_ONLY and min(hashes) >= 0 and max(hashes) < _U64))
                or (parent is not None and not (type(parent) is int and 0 <= parent < _U64))):
            raise EventDecodeError("hashes and parent must be unsigned 64-bit integers")


def encode_event(event: KVEvent) -> bytes:
    obj = {"worker": event.worker, "seq": event.seq, "kind": event.kind,
           "hashes": list(event.hashes), "parent": event.parent, "ts": event.ts}
    if event.medium != "device":   # absent means device: events of a worker without tiers are unchanged
        obj["medium"] = event.medium
    return msgpack.packb(obj)


def decode_event(data: bytes, max_bytes: int = 1 << 20, max_hashes: int = 65_536) -> KVEvent:
    """Decode and validate one event; raises ``EventDecodeError`` on anything unexpected: over
    ``max_bytes``, not one msgpack object within msgpack's limits below (no bin or ext values anywhere,
    at most ``max_hashes`` items in an array, 32 keys in a map), or a field missing or off its type."""
    obj = unpack_bounded(data, "event", EventDecodeError, max_bytes, payload="event payload",
                         max_array_len=max_hashes, max_map_len=32, max_bin_len=0)
    try:
        return msgspec.convert(obj, KVEvent)  # unknown keys are ignored: a newer worker may add fields
    except msgspec.ValidationError as e:
        raise EventDecodeError(f"invalid event: {e}") from None


class _Ordinary(msgspec.Struct, forbid_unknown_fields=True):
    """What ``EventReader`` takes: ``KVEvent``'s fields, narrowed to the kinds and media it applies."""

    worker: WorkerId
    seq: Count
    kind: Literal["stored", "removed"]
    hashes: tuple[Hash, ...]
    parent: Hash | None
    ts: Count
    medium: Literal["device", "host", "disk"] = "device"


class EventReader:
    """The consumer's batch decoder (``KVEventConsumer.apply_entries``): ``reader.ordinary(data)`` is
    ``(worker, seq, kind, hashes, medium)`` of an ordinary event, else None, with no ``KVEvent`` built
    and no exception raised.

    Ordinary: ``bytes`` within ``max_bytes`` that are exactly one msgpack map of ``KVEvent``'s fields and
    no others (so none of the values ``decode_event``'s msgpack limits refuse), of their types and
    ranges, with ``kind`` stored or removed, ``medium`` absent or one of ``MEDIA`` and at most
    ``max_hashes`` hashes. Whatever this accepts, ``decode_event`` accepts with the same fields (tested
    on random and hostile bytes in ``tests/router/test_event_batches.py``); None means "ask
    ``decode_event``", which then refuses the bytes with its reason, or decodes a ``cleared`` event,
    one of a medium this router does not know, or one with fields a newer worker added.

    One ``msgspec.msgpack.Decoder`` typed ``_Ordinary`` does the reading and the checks in C (2 to 4
    times faster than msgpack's ``Unpacker`` and checks in Python); it keeps nothing between payloads."""

    def __init__(self, max_bytes: int = 1 << 20, max_hashes: int = 65_536) -> None:
        self.max_bytes, self.max_hashes = max_bytes, max_hashes
        self._decode = msgspec.msgpack.Decoder(_Ordinary).decode

    def ordinary(self, data: object) -> tuple[str, int, str, tuple[int, ...], str] | None:
        if type(data) is not bytes or len(data) > self.max_bytes:
            return None
        try:
            e = self._decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if len(e.hashes) > self.max_hashes:
            return None
        return e.worker, e.seq, e.kind, e.hashes, e.medium


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
