"""Router side of contract 2: read the KV event stream into the ``PrefixIndex``.

One ``KVEventConsumer`` per router replica, on the router's event loop. It reads the
deployment's stream with blocking ``XREAD``, decodes each entry with the bounded
``decode_event`` (undecodable entries are counted in ``stats.malformed``, logged and
skipped), and applies it; ``apply_entries`` does so for a whole batch, ordinary events
without a ``KVEvent`` or an await each (same effects, tested against the per-event path). Per worker it remembers the next expected ``seq``; a gap, a
``cleared`` event or a worker it has no baseline for triggers ``resync(worker)``: the
worker's entries are replaced by its snapshot (``SnapshotSource``) and events already
reflected in the snapshot (``seq <= snapshot.seq``) are skipped.

The snapshot source is injectable: ``RedisSnapshotSource`` reads the set the worker's
``KVEventPublisher`` maintains; phase 2 may pass one that asks the worker over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import redis.asyncio as aioredis

from agentrt.core.tasks import cancel_and_wait
from router.config import RouterConfig
from router.events import MEDIA, EventDecodeError, EventReader, KVEvent, decode_event, unpack_hash
from router.index import PrefixIndex

log = logging.getLogger(__name__)

TIER_MEDIA = MEDIA[1:]   # the KV tiers below a worker's device pool


@dataclass(frozen=True)
class Snapshot:
    """A worker's cached block hashes as of event ``seq`` (-1: before any event): on its device, and
    per KV tier below it (``tiers``: medium -> hashes)."""

    seq: int
    hashes: tuple[int, ...]
    tiers: dict[str, tuple[int, ...]] = field(default_factory=dict)


SnapshotSource = Callable[[str], Awaitable[Snapshot]]


class RedisSnapshotSource:
    """Reads the snapshot set and its seq, atomically, from Redis."""

    def __init__(self, client: aioredis.Redis, config: RouterConfig) -> None:
        self._redis, self._config = client, config

    async def __call__(self, worker_id: str) -> Snapshot:
        pipe = self._redis.pipeline(transaction=True)
        pipe.smembers(self._config.snapshot_key(worker_id))
        pipe.get(self._config.snapshot_seq_key(worker_id))
        for medium in TIER_MEDIA:
            pipe.smembers(self._config.snapshot_tier_key(worker_id, medium))
        members, seq, *tiers = await pipe.execute()
        return Snapshot(-1 if seq is None else int(seq),
                        tuple(sorted(unpack_hash(m) for m in members)),
                        {medium: tuple(sorted(unpack_hash(m) for m in held))
                         for medium, held in zip(TIER_MEDIA, tiers) if held})


@dataclass
class ConsumerStats:
    applied: int = 0
    malformed: int = 0
    skipped: int = 0  # already reflected in a snapshot, or out of order
    gaps: int = 0
    resyncs: int = 0
    per_kind: dict = field(default_factory=dict)
    last_id: str = "0-0"   # the stream entry read last


def _add_kinds(per_kind: dict, stored: int, removed: int) -> None:
    """Add a batch's counts to ``ConsumerStats.per_kind`` (a kind appears once it has been counted)."""
    if stored:
        per_kind["stored"] = per_kind.get("stored", 0) + stored
    if removed:
        per_kind["removed"] = per_kind.get("removed", 0) + removed


class KVEventConsumer:
    def __init__(self, client: aioredis.Redis, config: RouterConfig, index: PrefixIndex,
                 snapshot_source: SnapshotSource | None = None,
                 on_blocks: Callable[[str, tuple[int, ...]], None] | None = None) -> None:
        self._redis = client
        self.on_blocks = on_blocks  # called with (worker, hashes) of each stored/removed event and snapshot applied
        self.config = config
        self.index = index
        self.snapshot_source = snapshot_source or RedisSnapshotSource(client, config)
        self.stats = ConsumerStats()
        self._next_seq: dict[str, int] = {}
        self._reader = EventReader(config.event_max_bytes, config.event_max_hashes)
        self._last_id = "0-0"
        self._task: asyncio.Task | None = None

    async def bootstrap(self, worker_ids: list[str]) -> None:
        """Start from now: note the stream's tail, then load every worker's snapshot.

        Events written between the two are read afterwards and skipped by seq."""
        tail = await self._redis.xrevrange(self.config.events_stream_key, count=1)
        self._last_id = tail[0][0].decode() if tail else "0-0"
        for wid in worker_ids:
            await self.resync(wid)

    async def resync(self, worker_id: str, min_next_seq: int = 0) -> None:
        """Replace ``worker_id``'s index entries with its snapshot; events before
        ``max(snapshot.seq + 1, min_next_seq)`` are skipped from now on."""
        snap = await self.snapshot_source(worker_id)
        self.index.replace_worker(worker_id, snap.hashes)
        for medium, held in snap.tiers.items():
            self.index.stored(worker_id, held, medium=medium)
        if self.on_blocks is not None:
            self.on_blocks(worker_id, snap.hashes)
        self._next_seq[worker_id] = max(snap.seq + 1, min_next_seq)
        self.stats.resyncs += 1
        log.info("resynced %s from snapshot at seq %d (%d blocks)", worker_id, snap.seq,
                 len(snap.hashes))

    def has_baseline(self, worker_id: str) -> bool:
        """Whether this consumer follows ``worker_id``'s events (False after ``forget_worker``)."""
        return worker_id in self._next_seq

    def forget_worker(self, worker_id: str) -> None:
        """The worker is dead: drop its entries; its next event triggers a resync."""
        self.index.clear_worker(worker_id)
        self._next_seq.pop(worker_id, None)

    async def poll(self, block_ms: int = 1000, count: int = 1000) -> int:
        """Read and apply one batch (waiting up to ``block_ms``); returns entries read."""
        reply = await self._redis.xread({self.config.events_stream_key: self._last_id},
                                        count=count, block=block_ms)
        n = 0
        for _stream, entries in reply or ():
            n += await self.apply_entries(entries)
        return n

    async def apply_entries(self, entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]]) -> int:
        """Apply a batch of stream entries as ``XREAD`` returns them (``(id, fields)``, the event
        in field ``e``); returns how many. The production path, and the same as
        ``apply_entries_reference`` (each entry through ``_handle``: ``decode_event`` then ``apply``)
        in every effect on the index, ``stats``, the seqs and the resyncs; ``tests/router/
        test_event_batches.py`` drives both with the same random streams and compares.

        Per entry, an ordinary event (``stored``/``removed`` of a known medium, every field of the
        type and range ``decode_event`` demands, see ``router.events.EventReader``) at the expected
        seq, or below it (already applied), is handled here in one pass and without a coroutine or
        a ``KVEvent``; anything else (a gap, ``cleared``, a worker without a baseline, an unknown
        medium, a malformed entry) goes through ``_handle``, which decodes it again and says why it
        is refused. Counters are flushed into ``stats`` before each of those (it may await a
        resync) and when the batch ends or fails; ``last_id`` is the id of the last entry handled,
        as in the reference (an entry whose resync raised is not read again)."""
        ordinary = self._reader.ordinary
        next_seq, get_next = self._next_seq, self._next_seq.get
        index_stored, index_removed, on_blocks = self.index.stored, self.index.removed, self.on_blocks
        stats = self.stats
        n_stored = n_removed = n_skipped = 0
        entry_id = None
        try:
            for entry_id, fields in entries:
                payload = fields.get(b"e")
                event = ordinary(payload)
                if event is not None:
                    worker, seq, kind, hashes, medium = event
                    expected = get_next(worker)
                    if seq == expected:
                        if kind == "stored":
                            index_stored(worker, hashes, medium)
                            n_stored += 1
                        else:
                            index_removed(worker, hashes, medium)
                            n_removed += 1
                        if on_blocks is not None:
                            on_blocks(worker, hashes)
                        next_seq[worker] = seq + 1
                        continue
                    if expected is not None and seq < expected:
                        n_skipped += 1
                        continue
                # the reference path: a gap, ``cleared``, no baseline, or anything it must refuse
                stats.applied += n_stored + n_removed
                stats.skipped += n_skipped
                _add_kinds(stats.per_kind, n_stored, n_removed)
                n_stored = n_removed = n_skipped = 0
                self._last_id = stats.last_id = entry_id.decode()
                await self._handle(payload)
        finally:
            stats.applied += n_stored + n_removed
            stats.skipped += n_skipped
            _add_kinds(stats.per_kind, n_stored, n_removed)
            if entry_id is not None:
                self._last_id = stats.last_id = entry_id.decode()
        return len(entries)

    async def apply_entries_reference(self, entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]]) -> int:
        """``apply_entries`` one entry at a time, each decoded into a ``KVEvent`` and awaited through
        ``apply`` (what ``poll`` did before the batch path): the oracle its tests compare against."""
        n = 0
        for entry_id, fields in entries:
            self._last_id = self.stats.last_id = entry_id.decode()
            n += 1
            await self._handle(fields.get(b"e"))
        return n

    async def _handle(self, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise EventDecodeError("stream entry has no 'e' field")
            event = decode_event(payload, self.config.event_max_bytes,
                                 self.config.event_max_hashes)
        except EventDecodeError as e:
            self.stats.malformed += 1
            log.warning("skipping undecodable KV event on %s: %s",
                        self.config.events_stream_key, e)
            return
        await self.apply(event)

    async def apply(self, event: KVEvent) -> None:
        expected = self._next_seq.get(event.worker)
        if event.kind == "cleared":
            self.index.clear_worker(event.worker)
            await self.resync(event.worker, min_next_seq=event.seq + 1)
            self._count(event)
            return
        if expected is not None and event.seq < expected:
            self.stats.skipped += 1
            return
        if expected is None or event.seq > expected:
            self.stats.gaps += 1
            log.info("KV event gap for %s: expected seq %s, got %d", event.worker, expected,
                     event.seq)
            await self.resync(event.worker)
            if event.seq < self._next_seq[event.worker]:
                self.stats.skipped += 1
                return
        if event.medium not in MEDIA:   # a tier this router does not know: its blocks are not counted
            self.stats.skipped += 1
        elif event.kind == "stored":
            self.index.stored(event.worker, event.hashes, medium=event.medium)
        else:
            self.index.removed(event.worker, event.hashes, medium=event.medium)
        if self.on_blocks is not None:
            self.on_blocks(event.worker, tuple(event.hashes))
        self._next_seq[event.worker] = event.seq + 1
        self._count(event)

    def _count(self, event: KVEvent) -> None:
        self.stats.applied += 1
        self.stats.per_kind[event.kind] = self.stats.per_kind.get(event.kind, 0) + 1

    async def run(self, block_ms: int = 1000) -> None:
        """Poll forever. A failed read or resync is logged and retried after a second:
        the consumer must outlive a Redis restart or a worker that cannot serve a snapshot."""
        while True:
            try:
                await self.poll(block_ms)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading KV events failed; retrying in 1 s")
                await asyncio.sleep(1.0)

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kv-events")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)   # a cancel redis-py swallowed would leave it polling on
