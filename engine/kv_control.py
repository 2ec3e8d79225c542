"""The KV control operations: the engine thread's handlers of the messages that move KV pages around
the pool, the radix cache and the KV tiers, between steps.

Pins (``Pin``, ``ExtendPin``, ``Unpin``) are the scheduler's; ``Demote`` copies a pin's pages into the
tiers and releases it, ``Prefetch`` starts reading a demoted pin's prefix back; ``FlushCache`` drops the
cache and the tiers' copies; ``KVTransfer`` runs a page transfer between engines (engine/kv_move.py);
``CacheSnapshot`` / ``TierSnapshot`` read the block hashes held. ``KVControl`` also holds the wiring the
tiers need from the pool: ``offload`` (the radix cache evicts a page: copy it down first) and
``write_page`` (a tier's block copied back into the pool). One object, owned by the engine core, built by
engine/builder.py.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch

from engine.commands import (CacheSnapshot, Demote, ExtendPin, FlushCache, KVTransfer, Pin, Prefetch,
                             TierSnapshot, Unpin)
from engine.hashing import block_hashes, make_seed
from engine.kv_move import KVMover
from engine.kv_pool import KVCache
from engine.kv_tier import KVTiers
from engine.overlap import ForwardWorker
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.scheduler import Scheduler

MAX_DEMOTED = 4096   # demoted pins whose prefix a prefetch may still ask for (oldest forgotten first)


class Seeds:
    """The block-hash seed of each cache salt (engine/hashing.py), made once per salt."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._seeds: dict[str, bytes] = {}

    def __call__(self, salt: str) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = make_seed(self.model_id, salt)
        return seed


class KVControl:
    def __init__(self, kv: KVCache, pool, cache: RadixCache, scheduler: Scheduler, tiers: KVTiers | None,
                 seeds: Seeds, page_size: int, window_layers: tuple[int, ...], worker: ForwardWorker | None
                 ) -> None:
        self.kv, self.pool, self.cache, self.scheduler, self.tiers = kv, pool, cache, scheduler, tiers
        self.seeds, self.P, self.window_layers, self.worker = seeds, page_size, window_layers, worker
        self.mover: KVMover | None = None   # set by the builder once the layout is known
        # demoted pins (``Demote``): pin id -> (tokens, cache salt) of the prefix ``Prefetch`` reads back
        self._demoted: collections.OrderedDict[str, tuple[list[int], str]] = collections.OrderedDict()
        self.demotions = self.prefetches = 0

    def handlers(self) -> dict[type, Callable]:
        """The handler of each KV control message (engine/commands.py); each returns None."""
        s = self.scheduler
        return {Pin: lambda m: void(s.pin(m.pin_id, m.token_ids, m.ttl_s, m.cache_salt)),
                ExtendPin: lambda m: void(s.extend_pin(m.pin_id, m.ttl_s)), Unpin: lambda m: s.unpin(m.pin_id),
                Demote: self.demote, Prefetch: self.prefetch, FlushCache: self.flush, KVTransfer: self.transfer,
                TierSnapshot: lambda m: m.future.set_result(self.tiers.snapshot() if self.tiers is not None else {}),
                CacheSnapshot: lambda m: m.future.set_result((self.cache.all_hashes(), m.extra()) if m.extra
                                                             else self.cache.all_hashes())}

    # -- pages between the pool and the tiers ---------------------------------
    def window_page(self, page: int) -> int:
        """The sliding page paired with ``page`` (0: none, or the model has no sliding layers in the cache)."""
        return self.pool.window_page[page] if self.window_layers else 0

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Copy a tier's block into the pool (its sliding part into the page's sliding page, if it has one);
        with overlap scheduling, once the forward thread is idle (a launched step may still write a row
        into this page, given back by a request it computes)."""
        if self.worker is not None:
            self.worker.wait_idle()
        self.kv.write_page(page, data, self.window_page(page))

    def offload(self, hashes: list[int], pages: list[int]) -> None:
        """The radix cache is evicting these pages: copy each one into the tiers first (whole where the page
        still has its sliding page, else partial)."""
        for h, page in zip(hashes, pages):
            window_page = self.window_page(page)
            if self.tiers.needs(h, partial=bool(self.window_layers) and not window_page):
                self.tiers.offload(h, self.kv.read_page(page, window_page))
            else:
                self.tiers.offload(h, None)   # already there: only its LRU position changes

    def prefetch_request(self, req: Request) -> None:
        """A request arrived: start reading its disk-tier pages past the device match now, so they are
        in memory by the time the scheduler reaches it (it admits other requests meanwhile)."""
        if self.tiers is not None:
            limit = ((req.num_tokens - 1) // self.P) * self.P
            self._prefetch_tokens(req.all_ids[:limit], req.cache_salt)

    def _prefetch_tokens(self, tokens: Sequence[int], salt: str) -> int:
        """Queue the disk reads of the tier pages that continue the device match of ``tokens`` (whole
        pages); returns how many pages the tiers hold there."""
        pages, node = self.cache.match_prefix(tokens, salt)
        hashes = block_hashes(tokens[len(pages) * self.P:], self.P, self.seeds(salt), parent=node.last_hash)
        held = hashes[:len(self.tiers.match(hashes))]
        self.tiers.prefetch(held)
        return len(held)

    # -- the messages ---------------------------------------------------------
    def demote(self, msg: Demote) -> None:
        pin = self.scheduler.pins.get(msg.pin_id)
        if pin is None:
            return
        if self.tiers is not None:
            hashes, pages, node = [], [], pin.node
            while node is not None:   # the pin's path, leaf first: the copies go in root-first order
                hashes[:0], pages[:0] = node.hashes, node.pages
                node = node.parent
            self.offload(hashes, pages)
            self._demoted[msg.pin_id] = self.cache.sequence(pin.node)
            while len(self._demoted) > MAX_DEMOTED:
                self._demoted.popitem(last=False)
        self.scheduler.unpin(msg.pin_id)
        self.demotions += 1

    def prefetch(self, msg: Prefetch) -> None:
        entry = self._demoted.pop(msg.pin_id, None)
        if entry is not None and self.tiers is not None:
            self._prefetch_tokens(*entry)
            self.prefetches += 1

    def flush(self, _: FlushCache) -> None:
        self.cache.on_evict = None   # a flush drops the tiers' copies too
        self.cache.reset()
        if self.tiers is not None:
            self.cache.on_evict = self.offload
            self.tiers.clear()

    def transfer(self, msg: KVTransfer) -> None:
        fn = {"held": self.mover.held, "export": self.mover.export, "import": self.mover.import_pages,
              "pinned": lambda: self.mover.pinned(self.scheduler.pins)}[msg.op]
        try:
            msg.future.set_result(fn(*msg.args))
        except Exception as exc:   # a bad page fails its transfer, never the engine
            msg.future.set_exception(exc)


def void(_) -> None:
    """Drop a value: a control message's handler that calls a method with a result returns None."""
    return None
