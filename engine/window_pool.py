"""Page ids for a model whose sliding layers keep only a window of the context.

A model with sliding-window layers (Gemma 3's local layers, gpt-oss's even layers, Mistral) keeps
two groups of KV tensors (engine/kv_pool.py ``KVCache``): the full-attention layers' pages, one per
page id of this pool, and the sliding layers' pages, from a second, smaller pool. Each page id
handed out comes with a sliding page; ``window_page(page)`` is that page (0: none). When the tokens of
a page fall out of every window that may still read them, its sliding page is *dropped* (given back
to the sliding pool) while the page id, and the full layers' K/V in it, stay: SGLang's "tombstone",
vLLM's per-group page tables in one map. The model runner translates each step's page tables and
slots through the map when it prepares the step (``BatchLayout.window_page_tables``,
``window_slot_mapping``), so a step launched ahead (overlap scheduling) reads the sliding pages it was
planned with; page 0 of both pools is scratch.

Who drops what (docs/architecture.md, "Sliding windows in the cache"):
- a running request drops the sliding pages of its own pages (not yet in the radix cache) that lie
  wholly before ``committed - window + 1``: no later query can see them (the windowed path reads keys
  ``p - window < j <= p``);
- the radix cache drops the sliding pages of its pages that lie in no window a hit may end at
  (engine/radix_cache.py), and counts a hit only up to where the window before it is held.

Only these two groups exist: every sliding layer shares the largest window (a layer with a smaller
window reads a subset of it).
"""

from __future__ import annotations

from typing import Sequence

from engine.kv_pool import OutOfPages, PagePool


class WindowedPagePool(PagePool):
    """Page ids of the full layers, each paired with a page of the sliding layers' pool until dropped.

    ``alloc`` hands out pages that have both; ``free`` gives back both (the sliding one if still
    held); ``drop_window`` gives back only the sliding one. ``num_free`` is how many pages ``alloc``
    can hand out now: the smaller of the two pools' free counts.
    """

    def __init__(self, num_pages: int, num_window_pages: int, window: int) -> None:
        super().__init__(num_pages)
        if window < 1:
            raise ValueError(f"a windowed page pool needs a window >= 1, got {window}")
        self.window = window
        self.window_pool = PagePool(num_window_pages)
        self.window_page = [0] * num_pages                     # page id -> sliding page (0: none)

    @property
    def num_free(self) -> int:
        return min(len(self._free), self.window_pool.num_free)

    @property
    def window_pages_used(self) -> int:
        return self.window_pool.capacity - self.window_pool.num_free

    def alloc(self, n: int) -> list[int]:
        if n > self.window_pool.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.window_pool.num_free} sliding-layer pages free")
        pages = self.alloc_ids(n)
        window_pages = self.window_pool.alloc(n)
        for p, w in zip(pages, window_pages):
            self.window_page[p] = w
        return pages

    def free(self, pages: list[int]) -> None:
        super().free(pages)
        self.drop_window(pages)

    def has_window(self, page: int) -> bool:
        return self.window_page[page] != 0

    def drop_window(self, pages) -> int:
        """Give back the sliding pages of ``pages`` that still have one; returns how many."""
        held = [p for p in pages if self.window_page[p]]
        if not held:
            return 0
        self.window_pool.free([self.window_page[p] for p in held])
        for p in held:
            self.window_page[p] = 0
        return len(held)

    def move_window(self, src: int, dst: int) -> None:
        """Page ``dst`` (without a sliding page) takes ``src``'s: the radix cache keeps its own page id for
        tokens a request computed again, and the request's copy still has the window the tree dropped."""
        if self.window_page[dst] or not self.window_page[src]:
            raise RuntimeError(f"move_window: page {dst} already has a sliding page or {src} has none")
        self.window_page[dst], self.window_page[src] = self.window_page[src], 0


def usable_pages(held: Sequence[bool], page_size: int, window: int, floor: int = 0) -> int:
    """The most leading pages of a prefix from the root (``held[i]``: page i still has its sliding K/V) whose
    end's window is held: every page holding one of positions ``end - window + 1 .. end - 1``, the keys the
    query at ``end`` reads. ``floor`` when no count above it is usable."""
    for n in range(len(held), floor, -1):
        if all(held[max(0, n * page_size - window + 1) // page_size:n]):
            return n
    return floor


def window_pool_pages(window: int, page_size: int, windows: int, max_batched_tokens: int) -> int:
    """Pages of the sliding layers' pool: ``windows`` windows (the pages before a page boundary that
    the next query sees, and the page it writes to) and one step's chunk, plus the scratch page."""
    per_window = -(-(window - 1) // page_size) + 2
    return 1 + windows * per_window + -(-max_batched_tokens // page_size)


def size_windowed_pools(config, window: int, full_bytes_per_token: int,
                        window_bytes_per_token: int) -> tuple[int, int]:
    """(page ids, sliding pages) for an ``EngineConfig``. The sliding pool holds
    ``sliding_window_pool_windows`` windows (default: two per sequence of a full batch), never more
    pages than there are page ids. With ``kv_cache_memory_bytes`` the full layers get what the sliding
    pool leaves; a model whose every layer slides (Mistral) takes ``kv_cache_tokens`` page ids (they
    hold no tensors) and gives the whole budget to the sliding pool."""
    P = config.page_size
    windows = config.sliding_window_pool_windows or 2 * config.max_num_seqs
    want = window_pool_pages(window, P, windows, config.max_batched_tokens)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        full = config.num_pages
    elif not full_bytes_per_token:
        full = config.num_pages
        want = max(4, budget // (P * window_bytes_per_token))
    else:
        full = (budget - want * P * window_bytes_per_token) // (P * full_bytes_per_token)
        if full < want:   # the window pool would not be smaller: pair every page
            full = want = budget // (P * (full_bytes_per_token + window_bytes_per_token))
        full = max(4, full)
    return full, max(4, min(want, full))
