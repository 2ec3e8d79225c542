"""KV tiers below the device pool: a paused agent's context survives memory pressure.

When the radix cache evicts a full cached page (LRU, or after a session pin expired or gave way
to memory pressure), the engine copies the page's K/V out of the pool into a tier instead of
dropping it; a later request whose prefix continues past the device match into the tier loads
those pages back into fresh device pages instead of recomputing them. Two tiers, tried in order:

- :class:`HostTier` (``host``): a preallocated slab of CPU memory (pinned when the pool is on a
  GPU, so copies back are plain DMA), LRU, bounded in pages. A page it evicts goes one tier
  down, to the disk tier, if there is one.
- :class:`DiskTier` (``disk``): one file per page under a directory the user can see, bounded in
  pages (and at most half the free space of its filesystem at start), LRU. Files are written by
  a writer thread: the engine thread only snapshots the page into CPU memory (one memcpy) and
  enqueues it; until written, a page is served from that snapshot. Each file starts with a
  header naming its block hash, dtype and shape and a CRC-32 of the payload; a file that is
  missing, truncated, for another block or fails its checksum is recomputed, never served.
  A write error (disk full, I/O error) turns the tier off with one log line and a metric;
  serving goes on without it. The directory is emptied at shutdown unless ``keep`` is set
  (then the next start indexes the files it finds and checks each when it is loaded).

Pages are named by their contract-1 block hash (engine/hashing.py): the hash names the whole
prefix, so a page found under a hash is the K/V of exactly that prefix's last block. For a pool whose
sliding layers keep only their window (``partial_shape`` given) a block is whole (every layer) or
partial (the full-attention layers only: its sliding page had been dropped); each tier records which
(``is_partial``), and the scheduler ends a read-back hit only where the window before it is whole
(docs/kv_tiers.md, "Blocks of a model with sliding windows").

:class:`KVTiers` ties the tiers together for the engine: ``offload`` on eviction, ``match`` for
the contiguous run of a request's next block hashes the tiers hold (memory only, no I/O),
``prefetch`` to start reading disk pages on the loader thread as soon as a request arrives, and
``take`` to get a page for loading (or ``PENDING`` while it is still being read: the scheduler
admits other requests meanwhile). Tier changes are reported through ``on_event(kind, hashes,
medium)`` (contract 2's optional ``medium`` field).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

log = logging.getLogger("engine.kv_tier")

MEDIA = ("device", "host", "disk")
PENDING = object()  # ``KVTiers.take``: the page is still being read from disk

TierEvent = Callable[[str, list[int], str], None]   # (kind "stored"|"removed", hashes, medium)

_MAGIC = b"AGKVPG01"
# magic, block hash, payload crc32, dtype code, ndim, 6 dims, payload bytes
_HEADER = struct.Struct("<8sQIII6IQ")
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.uint8: 4}   # uint8: int8 pages + scales
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
SUFFIX = ".kvpage"


@dataclass
class TierStats:
    """Counters of one tier (read by other threads as a copy: ``KVTiers.stats``)."""

    capacity_pages: int = 0
    pages: int = 0              # pages the tier holds now
    hit_tokens: int = 0         # prompt tokens served from this tier (loaded into the pool)
    loads: int = 0              # pages loaded back into the device pool
    load_time_s: float = 0.0    # time spent reading and checking them (disk: on the loader thread)
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0            # pages found missing, stale or failing their checksum (recomputed)
    dropped: int = 0            # pages not kept: write queue full or tier off
    errors: int = 0             # I/O errors (each turns a disk tier off)
    enabled: bool = True

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def page_bytes(page: torch.Tensor) -> int:
    return page.numel() * page.element_size()


def _checksum(page: torch.Tensor) -> int:
    return zlib.crc32(page.reshape(-1).view(torch.uint8).numpy())


def _shape_kind(page: torch.Tensor, shapes: tuple) -> bool:
    """Whether ``page`` is a partial block (``shapes[1]``) rather than a whole one; any other shape is refused."""
    shape = tuple(page.shape)
    if shape not in shapes:
        raise ValueError(f"a KV tier keeps blocks shaped {' or '.join(map(str, shapes))}, not {shape}")
    return shape != shapes[0]


def _check_shapes(page_shape: Sequence[int], partial_shape: Sequence[int] | None) -> tuple:
    """The block shapes a tier takes: whole, and partial (no sliding layers' K/V) if the pool has one."""
    whole = tuple(page_shape)
    if partial_shape is None:
        return (whole,)
    partial = tuple(partial_shape)
    if len(partial) != len(whole) or partial[0] != whole[0] or partial[2:] != whole[2:] or partial[1] >= whole[1]:
        raise ValueError(f"a partial block {partial} must be a whole block {whole} with fewer layers")
    return whole, partial


class HostTier:
    """Pages in a preallocated CPU slab (pinned for a GPU pool), LRU over ``capacity`` slots.

    Each slot keeps the block hash it holds and the payload's CRC-32, checked when the page is
    taken back: a page whose bytes changed is dropped and recomputed. With ``partial_shape`` (a pool
    whose sliding layers keep only their window) a slot may hold a partial block, in its first bytes."""

    medium = "host"

    def __init__(self, capacity: int, page_shape: Sequence[int], dtype: torch.dtype, pin: bool,
                 partial_shape: Sequence[int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a host tier needs at least 1 page, got {capacity}")
        self.shapes = _check_shapes(page_shape, partial_shape)
        self.slab = torch.empty((capacity, *page_shape), dtype=dtype, pin_memory=pin)
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()  # hash -> slot, crc
        self._partial: set[int] = set()   # hashes whose block is partial
        self.stats = TierStats(capacity_pages=capacity)

    def _view(self, slot: int, partial: bool) -> torch.Tensor:
        if not partial:
            return self.slab[slot]
        shape = self.shapes[1]
        return self.slab[slot].view(-1)[:torch.Size(shape).numel()].view(shape)

    def is_partial(self, block_hash: int) -> bool:
        return block_hash in self._partial

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[int]:
        return list(self._slots)

    def touch(self, block_hash: int) -> None:
        self._slots.move_to_end(block_hash)

    def put(self, block_hash: int, page: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store a copy of ``page``; returns the (hash, page copy) pairs evicted to make room."""
        partial = _shape_kind(page, self.shapes)
        evicted = []
        if not self._free:
            old, (slot, _) = self._slots.popitem(last=False)
            evicted.append((old, self._view(slot, old in self._partial).clone()))
            self._partial.discard(old)
            self._free.append(slot)
        slot = self._free.pop()
        self._view(slot, partial).copy_(page)
        if partial:
            self._partial.add(block_hash)
        self._slots[block_hash] = (slot, _checksum(self._view(slot, partial)))
        self.stats.bytes_written += page_bytes(page)
        self.stats.pages = len(self._slots)
        return evicted

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The page (a view of its slot: copy it before the next ``put``), or None if it failed its check."""
        slot, crc = self._slots[block_hash]
        page = self._view(slot, block_hash in self._partial)
        if _checksum(page) != crc:
            self.stats.corrupt += 1
            self.remove(block_hash)
            return None
        self._slots.move_to_end(block_hash)
        self.stats.bytes_read += page_bytes(page)
        return page

    def remove(self, block_hash: int) -> None:
        slot, _ = self._slots.pop(block_hash)
        self._partial.discard(block_hash)
        self._free.append(slot)
        self.stats.pages = len(self._slots)

    def clear(self) -> list[int]:
        gone = list(self._slots)
        self._free.extend(slot for slot, _ in self._slots.values())
        self._slots.clear()
        self._partial.clear()
        self.stats.pages = 0
        return gone


class DiskTier:
    """One file per page under ``path``, LRU over ``capacity`` pages, written by a writer thread.

    Thread model: ``put``/``touch``/``clear`` run on the engine thread, ``read`` on the loader
    thread, file writes and deletes on the writer thread; ``_lock`` guards the index. ``put``
    never blocks: with ``max_pending`` pages already waiting to be written, the page is dropped.
    """

    medium = "disk"

    def __init__(self, path: str | None, capacity: int, page_shape: Sequence[int], dtype: torch.dtype,
                 keep: bool = False, on_event: TierEvent | None = None, max_pending: int = 256,
                 drop_page_cache: bool = False, partial_shape: Sequence[int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a disk tier needs at least 1 page, got {capacity}")
        self.shapes = _check_shapes(page_shape, partial_shape)   # a partial block's file is smaller
        self.page_shape = self.shapes[0]
        self.dtype = dtype
        self.keep = keep
        self.on_event = on_event
        self.max_pending = max_pending
        # after each write: fsync the file and drop it from the OS page cache, so reads come from the
        # device (benchmarks measure the tier cold; otherwise recent pages are read back from memory)
        self.drop_page_cache = drop_page_cache
        self._created_dir = path is None or not os.path.isdir(path)
        if path is None:
            path = tempfile.mkdtemp(prefix="agentrt-kv-tier-")
        os.makedirs(path, exist_ok=True)
        self.path = os.path.abspath(path)
        one = int(torch.Size(self.page_shape).numel()) * torch.empty((), dtype=dtype).element_size() + _HEADER.size
        room = shutil.disk_usage(self.path).free // 2 // one
        if room < capacity:
            log.warning("KV disk tier: %d pages asked for but %s has room for %d (half its free space); "
                        "capping the tier there", capacity, self.path, room)
            capacity = max(1, room)
        self.capacity = capacity
        self.stats = TierStats(capacity_pages=capacity)
        self._index: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._staged: dict[int, torch.Tensor] = {}   # written soon: served from memory until then
        self._partial: set[int] = set()               # hashes whose block is partial
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        if keep:
            self._adopt_files()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        log.info("KV disk tier: %d pages in %s (%s at shutdown)", capacity, self.path,
                 "kept" if keep else "deleted")

    # -- engine thread ----------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index)

    @property
    def enabled(self) -> bool:
        return self.stats.enabled

    def is_partial(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._partial

    def forget(self, block_hash: int) -> None:
        """Drop a block (its file is deleted by the writer unless the block is stored again first)."""
        with self._lock:
            if self._index.pop(block_hash, "absent") is not None:
                return
            self._staged.pop(block_hash, None)
            self._partial.discard(block_hash)
            self.stats.pages = len(self._index)
        self._jobs.put(("delete", block_hash))

    def touch(self, block_hash: int) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def put(self, block_hash: int, page: torch.Tensor) -> bool:
        """Keep ``page`` (a CPU tensor the caller no longer writes to); False if not kept."""
        if not self.stats.enabled:
            self.stats.dropped += 1
            return False
        partial = _shape_kind(page, self.shapes)
        evicted = []
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if len(self._staged) >= self.max_pending:
                self.stats.dropped += 1
                return False
            while len(self._index) >= self.capacity:
                old, _ = self._index.popitem(last=False)
                self._staged.pop(old, None)
                self._partial.discard(old)
                evicted.append(old)
            self._index[block_hash] = None
            self._staged[block_hash] = page
            if partial:
                self._partial.add(block_hash)
            self.stats.pages = len(self._index)
        for old in evicted:
            self._jobs.put(("delete", old))
        self._jobs.put(("write", block_hash))
        if evicted:
            self._emit("removed", evicted)
        self._emit("stored", [block_hash])
        return True

    def clear(self) -> list[int]:
        with self._lock:
            gone = list(self._index)
            self._index.clear()
            self._staged.clear()
            self._partial.clear()
            self.stats.pages = 0
        for h in gone:
            self._jobs.put(("delete", h))
        return gone

    # -- loader thread ------------------------------------------------------------
    def read(self, block_hash: int) -> torch.Tensor | None:
        """The page, checked; None (and the page forgotten) if it is missing, stale or corrupt."""
        with self._lock:
            if block_hash not in self._index:
                return None
            staged = self._staged.get(block_hash)
        if staged is not None:
            return staged
        started = time.perf_counter()
        try:
            with open(self._file(block_hash), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return self._bad(block_hash, "its file is missing")
        except OSError as exc:
            return self._bad(block_hash, f"reading it failed ({exc})")
        page = self._decode(block_hash, data)
        if isinstance(page, str):
            return self._bad(block_hash, page)
        self.stats.bytes_read += len(data)
        self.stats.load_time_s += time.perf_counter() - started
        return page

    def _decode(self, block_hash: int, data: bytes) -> torch.Tensor | str:
        if len(data) < _HEADER.size:
            return "its file is truncated"
        magic, h, crc, dtype_code, ndim, *rest = _HEADER.unpack_from(data)
        dims, nbytes = rest[:6], rest[6]
        if magic != _MAGIC:
            return "its header is not a KV page's"
        if h != block_hash:
            return f"its file holds block {h:016x}"
        shape = tuple(dims[:ndim])
        if _DTYPE_OF.get(dtype_code) != self.dtype or shape not in self.shapes:
            return (f"its page is {_DTYPE_OF.get(dtype_code)} {shape}, the pool's {self.dtype} "
                    f"{' or '.join(map(str, self.shapes))}")
        with self._lock:
            indexed_partial = block_hash in self._partial
        if indexed_partial != (shape != self.page_shape):
            return f"its block is {'whole' if indexed_partial else 'partial'}, the index says otherwise"
        payload = memoryview(data)[_HEADER.size:]
        if len(payload) != nbytes:
            return f"its file is truncated ({len(payload)} of {nbytes} payload bytes)"
        if zlib.crc32(payload) != crc:
            return "its checksum does not match"
        if not nbytes:   # a partial block of a model whose every layer slides holds nothing
            return torch.empty(shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).reshape(shape)

    def _bad(self, block_hash: int, why: str) -> None:
        log.warning("KV disk tier: page %016x not served, %s; it is recomputed", block_hash, why)
        self.stats.corrupt += 1
        with self._lock:
            had = self._index.pop(block_hash, "absent") is None
            self._partial.discard(block_hash)
            self.stats.pages = len(self._index)
        if had:
            self._jobs.put(("delete", block_hash))
            self._emit("removed", [block_hash])
        return None

    # -- writer thread -------------------------------------------------------------
    def _file(self, block_hash: int) -> str:
        return os.path.join(self.path, f"{block_hash:016x}{SUFFIX}")

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, h = job
            if kind == "delete":
                with self._lock:
                    back = h in self._index   # evicted, then stored again: its write is queued after this
                if not back:
                    try:
                        os.unlink(self._file(h))
                    except OSError:
                        pass
                continue
            with self._lock:
                page = self._staged.get(h)
            if page is None:   # evicted or cleared before it was written
                continue
            try:
                written = self._write(h, page)
            except OSError as exc:
                self._disable(exc)
                continue
            self.stats.bytes_written += written
            with self._lock:
                if self._staged.get(h) is page:
                    del self._staged[h]

    def _write(self, block_hash: int, page: torch.Tensor) -> int:
        raw = page.reshape(-1).view(torch.uint8).numpy()
        dims = list(page.shape) + [0] * (6 - page.dim())
        header = _HEADER.pack(_MAGIC, block_hash, zlib.crc32(raw), _DTYPES[page.dtype], page.dim(), *dims,
                              raw.nbytes)
        final = self._file(block_hash)
        tmp = final + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(raw.data)
                if self.drop_page_cache:
                    f.flush()
                    os.fsync(f.fileno())   # dirty pages stay cached: written first, then dropped
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.replace(tmp, final)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return len(header) + raw.nbytes

    def _disable(self, exc: OSError) -> None:
        """A write failed: turn the tier off (once), forget and delete what it held."""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        with self._lock:
            if not self.stats.enabled:
                return
            self.stats.enabled = False
            self.stats.errors += 1
            gone = list(self._index)
            self._index.clear()
            self._staged.clear()
            self._partial.clear()
            self.stats.pages = 0
        log.error("KV disk tier in %s turned off: %s (%s); serving goes on without it", self.path,
                  "the disk is full" if full else "an I/O error", exc)
        for h in gone:
            try:
                os.unlink(self._file(h))
            except OSError:
                pass
        if gone:
            self._emit("removed", gone)

    # -- start and shutdown ----------------------------------------------------------
    def _adopt_files(self) -> None:
        """Index the pages a kept tier left here (each is checked when loaded)."""
        found = []
        for name in sorted(os.listdir(self.path)):
            if not name.endswith(SUFFIX):
                continue
            try:
                h = int(name[:-len(SUFFIX)], 16)
            except ValueError:
                continue
            if len(found) < self.capacity:
                found.append(h)
        for h in found:
            self._index[h] = None
            if len(self.shapes) > 1 and self._file_shape(h) != self.page_shape:
                self._partial.add(h)   # partial, or unreadable: never counted whole (checked when loaded)
        self.stats.pages = len(self._index)
        if found:
            log.info("KV disk tier: %d kept pages found in %s", len(found), self.path)

    def _file_shape(self, block_hash: int) -> tuple | None:
        """The block shape a kept file's header names (None if it cannot be read)."""
        try:
            with open(self._file(block_hash), "rb") as f:
                head = f.read(_HEADER.size)
            _, _, _, _, ndim, *rest = _HEADER.unpack(head)
        except (OSError, struct.error):
            return None
        return tuple(rest[:6][:ndim])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._writer.join(timeout=30)
        if self.keep:
            return
        for name in os.listdir(self.path):
            if name.endswith(SUFFIX) or name.endswith(SUFFIX + ".tmp"):
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        if self._created_dir:
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    def _emit(self, kind: str, hashes: list[int]) -> None:
        if self.on_event is not None:
            self.on_event(kind, hashes, self.medium)


@dataclass
class _Load:
    page: torch.Tensor | None = None
    done: bool = False


class KVTiers:
    """The tiers below one engine's pool (either may be absent), and the loader thread."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, on_event: TierEvent | None = None) -> None:
        self.host, self.disk = host, disk
        self.on_event = on_event
        self._loads: dict[int, _Load] = {}      # disk pages asked for, by hash
        self._loads_lock = threading.Lock()
        self._loaded = threading.Event()        # set whenever a read finishes
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._loader: threading.Thread | None = None
        if disk is not None:
            self._loader = threading.Thread(target=self._load_loop, name="kv-disk-loader", daemon=True)
            self._loader.start()

    @property
    def tiers(self) -> list:
        return [t for t in (self.host, self.disk) if t is not None]

    def holds(self, block_hash: int) -> str | None:
        if self.host is not None and block_hash in self.host:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def is_partial(self, block_hash: int) -> bool:
        """Whether the block the tiers hold under ``block_hash`` lacks the sliding layers' K/V."""
        medium = self.holds(block_hash)
        return medium is not None and (self.host if medium == "host" else self.disk).is_partial(block_hash)

    def is_partial_block(self, page: torch.Tensor) -> bool:
        """Whether ``page`` (as ``take`` returned it) is a partial block, not a whole one."""
        return tuple(page.shape) != self.tiers[0].shapes[0]

    def needs(self, block_hash: int, partial: bool) -> bool:
        """Whether an evicted device block (partial or whole) should be copied here: the tiers hold no
        copy, or only a partial one and the device's is whole."""
        return self.holds(block_hash) is None or (self.is_partial(block_hash) and not partial)

    # -- engine thread ------------------------------------------------------------------
    def offload(self, block_hash: int, page: torch.Tensor | None) -> None:
        """An evicted device page: keep it (host first, else disk). ``page`` is a CPU copy; it may be None
        when the tiers already hold the block (only its LRU position moves). A whole block replaces a
        partial copy of the same block."""
        medium = self.holds(block_hash)
        if medium is not None and page is not None and self.is_partial(block_hash) \
                and not self.is_partial_block(page):
            self._forget(block_hash, medium)
            medium = None
        if medium == "host":
            self.host.touch(block_hash)
            return
        if medium == "disk":
            self.disk.touch(block_hash)
            return
        if self.host is not None:
            for old, old_page in self.host.put(block_hash, page):
                if self.disk is not None and old not in self.disk:
                    self.disk.put(old, old_page)   # stored on disk before it leaves the host: never unindexed
                self._emit("removed", [old], "host")
            self._emit("stored", [block_hash], "host")
        elif self.disk is not None:
            self.disk.put(block_hash, page)

    def _forget(self, block_hash: int, medium: str) -> None:
        if medium == "host":
            self.host.remove(block_hash)
        else:
            self.disk.forget(block_hash)
        with self._loads_lock:
            load = self._loads.get(block_hash)
            if load is not None and load.done:
                del self._loads[block_hash]   # the old copy, already read: never served in place of the new one
        self._emit("removed", [block_hash], medium)

    def match(self, hashes: Sequence[int]) -> list[str]:
        """The media of the longest run of ``hashes`` (from the first) that the tiers hold."""
        out = []
        for h in hashes:
            medium = self.holds(h)
            if medium is None:
                break
            out.append(medium)
        return out

    def prefetch(self, hashes: Iterable[int]) -> int:
        """Start reading the disk pages among ``hashes``; returns how many reads started."""
        if self.disk is None:
            return 0
        started = 0
        with self._loads_lock:
            for h in hashes:
                if h in self.disk and (self.host is None or h not in self.host) and h not in self._loads:
                    self._loads[h] = _Load()
                    self._reads.put(h)
                    started += 1
        return started

    def ready(self, hashes: Sequence[int]) -> bool:
        """Whether every disk page among ``hashes`` has been read (reads not started yet start now)."""
        self.prefetch(hashes)
        with self._loads_lock:
            return not any((load := self._loads.get(h)) is not None and not load.done for h in hashes)

    def take(self, block_hash: int):
        """A page to load into the pool: the tensor, ``PENDING`` while it is read from disk (the read
        is started if it was not), or None if the tier no longer has a good copy."""
        if self.host is not None and block_hash in self.host:
            started = time.perf_counter()
            page = self.host.get(block_hash)
            if page is not None:
                page = page.clone()   # its slot may be reused before the copy into the pool
            if page is None:
                self._emit("removed", [block_hash], "host")
            else:
                self.host.stats.load_time_s += time.perf_counter() - started
            return page
        with self._loads_lock:
            load = self._loads.get(block_hash)
            if load is not None and load.done:
                del self._loads[block_hash]
                return load.page
        if load is None:
            return PENDING if self.prefetch([block_hash]) else None
        return PENDING

    def copy_out(self, block_hash: int):
        """For another engine (engine/kv_move.py), on the engine thread: a checked copy of a host-tier
        page, ``"disk"`` for a page only the disk tier holds (``read_disk`` it off this thread), None if
        neither has it. Nothing moves between tiers and no hit is counted."""
        if self.host is not None and block_hash in self.host:
            page = self.host.get(block_hash)
            if page is None:
                self._emit("removed", [block_hash], "host")
                return None
            return page.clone()
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def read_disk(self, block_hash: int) -> torch.Tensor | None:
        """A disk-tier page read and checked on the calling thread (not the engine's), or None."""
        if self.disk is None:
            return None
        return self.disk.read(block_hash)

    def loading(self) -> bool:
        with self._loads_lock:
            return any(not load.done for load in self._loads.values())

    def wait_for_load(self, timeout_s: float) -> None:
        """Block until a disk read finishes (or ``timeout_s``): for an engine with nothing else to run."""
        self._loaded.wait(timeout_s)
        self._loaded.clear()

    def count_hit(self, medium: str, pages: int, tokens: int) -> None:
        stats = self.host.stats if medium == "host" else self.disk.stats
        stats.loads += pages
        stats.hit_tokens += tokens

    def clear(self) -> None:
        if self.host is not None:
            gone = self.host.clear()
            if gone:
                self._emit("removed", gone, "host")
        if self.disk is not None:
            gone = self.disk.clear()
            if gone:
                self._emit("removed", gone, "disk")
        with self._loads_lock:
            self._loads = {h: load for h, load in self._loads.items() if not load.done}

    def snapshot(self) -> dict[str, list[int]]:
        """Hashes each tier holds (for a worker republishing its cache)."""
        return {t.medium: t.hashes() for t in self.tiers}

    def stats(self) -> dict[str, dict]:
        return {t.medium: t.stats.as_dict() for t in self.tiers}

    def close(self) -> None:
        if self._loader is not None:
            self._reads.put(None)
            self._loader.join(timeout=10)
            self._loader = None
        if self.disk is not None:
            self.disk.close()

    # -- loader thread -----------------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            h = self._reads.get()
            if h is None:
                return
            try:
                page = self.disk.read(h)
            except Exception:   # never let a bad page stop the loader: that page is recomputed
                log.exception("KV disk tier: reading page %016x failed", h)
                page = None
            with self._loads_lock:
                load = self._loads.get(h)
                if load is not None:
                    load.page, load.done = page, True
            self._loaded.set()

    def _emit(self, kind: str, hashes: list[int], medium: str) -> None:
        if self.on_event is not None and hashes:
            self.on_event(kind, hashes, medium)


__all__ = ["MEDIA", "PENDING", "DiskTier", "HostTier", "KVTiers", "TierStats"]
