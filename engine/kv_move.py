"""KV that moves between engines: the engine-thread half of a page transfer.

A worker that holds a prefix serves its pages to another worker, which inserts them in its own radix
cache and computes only the rest (router/kv_moves.py carries them over HTTP). Everything here runs in
the engine thread, as commands between steps (``LLMEngine.request_kv_*``), in bounded chunks so no
step waits long:

- ``describe``: what a page is here (model fingerprint, page dtype and shape, page size, layers, KV
  heads, head dim, layout). Two engines exchange pages only when their descriptions are equal.
- ``held``: how many of a prompt's full blocks the device pool holds, so a puller asks only for the
  blocks it lacks.
- ``export``: CPU copies of blocks ``start .. start + count`` of a prompt, from the device pool, then
  the host tier; a block only the disk tier holds comes back as ``ON_DISK`` (read off the engine
  thread, ``KVTiers.read_disk``). The run stops at the first block held nowhere.
- ``pinned``: the token sequences of the session pins, for a draining engine to hand them over.
- ``import_pages``: pages received for blocks ``start ..`` of a prompt, written into fresh pool pages
  and inserted in the radix cache as the tiers' loads are (``Scheduler._load_from_tiers``); their
  ``stored`` KV events go out like any stored block. Only unlocked cache is evicted to make room;
  never a pin, never a running request's pages.

Pages are in the pool's own layout (``KVCache.read_page``): the same bytes the tiers keep. A model whose
sliding layers keep only their window in the cache (engine/window_pool.py) has blocks without their
sliding part, which the wire's fixed-size pages (router/kv_wire.py) cannot carry and which an import
attached after the puller's device match would have to stop at a held window: ``held``, ``export`` and
``import_pages`` refuse it, and the transfer fails (the puller computes instead; docs/kv_tiers.md).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.hashing import block_hashes
from engine.kv_pool import KVCache, PagePool
from engine.kv_tier import KVTiers
from engine.radix_cache import RadixCache

ON_DISK = "disk"   # ``export``: this block is in the disk tier only; read it with ``KVTiers.read_disk``


@dataclass(frozen=True)
class KVLayout:
    """What one page of an engine's pool is: equal layouts exchange pages bit for bit."""

    model_fingerprint: str
    page_dtype: str
    page_shape: tuple[int, ...]
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str


def model_fingerprint(model_id: str, model_config, activation_dtype: str, quantization: str) -> str:
    """16 hex digits naming what computes the KV: the model's id and shape, the activations' dtype and
    the weights' quantization (KV computed with int4 weights is not float32 weights' KV)."""
    c = model_config
    text = "|".join(str(x) for x in (model_id, getattr(c, "architecture", ""), c.num_layers, c.num_kv_heads,
                                     c.head_dim, c.vocab_size, activation_dtype, quantization))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class KVMover:
    """The engine-thread operations of a page transfer over one engine's pool, cache and tiers."""

    def __init__(self, kv: KVCache, pool: PagePool, cache: RadixCache, page_size: int, layout: KVLayout,
                 tiers: KVTiers | None = None, write_page=None) -> None:
        self.kv, self.pool, self.cache, self.P = kv, pool, cache, page_size
        # how a page is written into the pool (the engine's waits for an overlapped forward to finish first)
        self.write_page = write_page or kv.write_page
        self.layout = layout
        self.tiers = tiers

    def _check_whole_pages(self) -> None:
        if self.kv.window_layers:
            raise ValueError("KV moves carry whole pages, and this model's sliding layers keep only their window "
                             "in the cache (their pages may be gone); start the engines with "
                             "sliding_window_cache=False to move KV between them")

    def hashes(self, tokens: Sequence[int], salt: str) -> list[int]:
        return block_hashes(tokens, self.P, self.cache.seed_fn(salt))

    def held(self, tokens: Sequence[int], salt: str) -> int:
        """Full blocks of ``tokens`` the device pool holds from the start (what a puller need not ask for;
        blocks in this engine's own tiers are pulled too: pulled pages attach only to the device match)."""
        self._check_whole_pages()
        pages, _ = self.cache.match_prefix(tokens, salt)
        return len(pages)

    def pinned(self, pins: dict) -> list[tuple[str, list[int], str, float]]:
        """(pin id, tokens, cache salt, seconds left) of every session pin (``Scheduler.pins``): what a
        draining engine hands over to other engines."""
        now = time.monotonic()
        return [(pin_id, *self.cache.sequence(pin.node), max(0.0, pin.expires_at - now))
                for pin_id, pin in pins.items()]

    def export(self, tokens: Sequence[int], salt: str, start: int, count: int) -> list[tuple[int, object]]:
        """(block hash, page) for blocks ``start .. start + count`` of ``tokens`` held here, in order:
        a CPU tensor shaped ``kv.page_shape``, or ``ON_DISK``. Stops at the first block held nowhere."""
        self._check_whole_pages()
        end = min(start + count, len(tokens) // self.P)
        if end <= start:
            return []
        hashes = self.hashes(tokens[:end * self.P], salt)
        pages, _ = self.cache.match_prefix(tokens[:end * self.P], salt)
        out: list[tuple[int, object]] = []
        for i in range(start, end):
            if i < len(pages):
                out.append((hashes[i], self.kv.read_page(pages[i])))
                continue
            page = self.tiers.copy_out(hashes[i]) if self.tiers is not None else None
            if page is None:
                break
            out.append((hashes[i], page))
        return out

    def import_pages(self, tokens: Sequence[int], salt: str, start: int, pages: list[torch.Tensor]) -> int:
        """Insert ``pages`` as blocks ``start ..`` of ``tokens``; returns how many blocks the cache now
        holds from the start (0 when blocks before ``start`` are gone: the rest would not attach)."""
        self._check_whole_pages()
        P = self.P
        held, node = self.cache.match_prefix(tokens[:(start + len(pages)) * P], salt)
        if len(held) < start:
            return 0
        pages = pages[len(held) - start:]            # blocks the cache got meanwhile are not written twice
        if not pages:
            return len(held)
        self.cache.lock(node)                         # the prefix they attach to must survive the eviction
        try:
            short = len(pages) - self.pool.num_free
            if short > 0:
                self.cache.evict(short)
            n = min(len(pages), self.pool.num_free)
            new = self.pool.alloc(n)
            for page, data in zip(new, pages[:n]):
                self.write_page(page, data)
            first = len(held)
            _, dups = self.cache.insert(tokens[:(first + n) * P], held + new, salt)
            if dups:
                self.pool.free(dups)
        finally:
            self.cache.unlock(node)
        return first + n


__all__ = ["KVLayout", "KVMover", "ON_DISK", "model_fingerprint"]
