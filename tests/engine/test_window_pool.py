"""The sliding layers' pages (engine/window_pool.py) and the radix cache's windows: which pages keep
their sliding page, where a hit stops, and that both pools give back every page exactly once.

Pages of 2 tokens and a window of 6: the window before an end T is positions T - 5 .. T - 1, on the
three pages before T (T even)."""

import pytest

from engine.hashing import make_seed
from engine.kv_pool import OutOfPages
from engine.radix_cache import RadixCache
from engine.window_pool import WindowedPagePool, size_windowed_pools, usable_pages, window_pool_pages

P, W = 2, 6


def make(num_pages=64, window_pages=64):
    pool = WindowedPagePool(num_pages, window_pages, W)
    return pool, RadixCache(pool, P, lambda salt: make_seed("m", salt))


def windowed(pool, pages):
    """Positions (page index in ``pages``) whose page still has its sliding page."""
    return [i for i, p in enumerate(pages) if pool.has_window(p)]


def test_window_pool_pairs_and_frees_each_page_once():
    pool = WindowedPagePool(8, 4, W)
    pages = pool.alloc(3)
    assert pool.num_free == 0 and pool.num_free_ids == 4        # the sliding pool (3 usable) binds
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    assert sorted(pool.window_page[p] for p in pages) == [1, 2, 3]
    assert pool.drop_window(pages[:2]) == 2
    assert pool.drop_window(pages[:2]) == 0                     # dropping twice gives nothing back twice
    assert pool.num_free == 2 and pool.window_pages_used == 1
    pool.move_window(pages[2], pages[0])
    assert windowed(pool, pages) == [0]
    with pytest.raises(RuntimeError, match="move_window"):
        pool.move_window(pages[2], pages[1])                    # pages[2] has none left
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])
    assert pool.num_free_ids == 7 and pool.window_pool.num_free == 3 and not any(pool.window_page)


def test_window_cache_keeps_only_the_windows_before_ends():
    pool, cache = make()
    tokens = list(range(100, 120))                              # 10 pages
    pages = pool.alloc(10)
    leaf, dups = cache.insert(tokens, pages)
    assert not dups and leaf.end == 20
    assert windowed(pool, pages) == [7, 8, 9]                   # the window before 20: positions 15..19
    assert cache.match_usable(tokens)[0] == pages
    # the raw match to 12 holds every page id, but the window before 12 (7..11) was dropped: no hit
    assert len(cache.match_prefix(tokens[:12])[0]) == 6
    assert cache.match_usable(tokens[:12]) == ([], cache.root())

    # a request computed 12 tokens of the same prefix and 8 of its own: the tree keeps its page ids and
    # takes the request's windows where it had dropped its own; the branch at 12 is an end
    root = cache.root()
    cache.lock(root)                                            # it matched nothing usable
    mine = pool.alloc(10)
    new = tokens[:12] + list(range(500, 508))
    node, dups = cache.insert(new, mine)
    assert dups == mine[:6]
    assert windowed(pool, pages) == [0, 1, 2, 3, 4, 5, 7, 8, 9]   # until the request moves on
    cache.relock(root, node)
    pool.free(dups)
    path = pages[:6] + mine[6:]
    assert windowed(pool, pages) == [3, 4, 5, 7, 8, 9]         # the branch's window and the first leaf's
    assert windowed(pool, path) == [3, 4, 5, 7, 8, 9]          # the new leaf's window (15..19 again)
    assert pool.window_pages_used == 9
    assert cache.match_usable(new[:12] + [9, 9])[0] == pages[:6]
    cache.unlock(node)
    assert pool.window_pages_used == 9                          # a leaf's end stays an end
    cache.reset()
    assert pool.num_free_ids == pool.capacity and pool.window_pool.num_free == pool.window_pool.capacity


def test_window_cache_holder_keeps_its_window_until_it_moves_on():
    """A request holds its node's end (its next query reads the window before it); ``relock`` onto its
    next chunk drops the old end's window, and the pages that took a request's window on insert."""
    pool, cache = make()
    tokens = list(range(200, 216))
    first = pool.alloc(4)
    a, _ = cache.insert(tokens[:8], first)
    cache.lock(a)
    rest = pool.alloc(4)
    b, dups = cache.insert(tokens, first + rest)
    assert not dups
    pages = first + rest
    assert windowed(pool, pages) == [1, 2, 3, 5, 6, 7]         # a's end is held: its window stays
    cache.relock(a, b)
    assert windowed(pool, pages) == [5, 6, 7]
    # a hit that ends inside b (at 12): the window before it is gone, so it counts for nothing
    assert cache.match_usable(tokens[:12])[0] == []
    cache.unlock(b)
    assert windowed(pool, pages) == [5, 6, 7]


def test_window_cache_relock_drops_windows_taken_from_dups():
    pool, cache = make()
    tokens = list(range(300, 320))
    pages = pool.alloc(10)
    cache.insert(tokens, pages)
    # a request that matched nothing usable recomputes all 10 pages, then hands them over
    root = cache.root()
    cache.lock(root)
    mine = pool.alloc(10)
    node, dups = cache.insert(tokens, mine)
    assert dups == mine and windowed(pool, pages) == list(range(10))   # every tree page took a window
    pool.free(dups)
    cache.relock(root, node)
    assert windowed(pool, pages) == [7, 8, 9]
    assert pool.window_pages_used == 3


def test_window_pool_sizing():
    class Cfg:
        page_size, num_pages, max_num_seqs, max_batched_tokens = 16, 4096, 4, 512
        sliding_window_pool_windows = None
        kv_cache_memory_bytes = None
    # a window of 1024: 64 pages before a boundary, its own page and one of slack; 8 windows; a chunk
    assert window_pool_pages(1024, 16, 8, 512) == 1 + 8 * 66 + 32
    assert size_windowed_pools(Cfg, 1024, 100, 500) == (4096, 561)
    Cfg.kv_cache_memory_bytes = 16 * (4096 * 100 + 561 * 500)
    assert size_windowed_pools(Cfg, 1024, 100, 500) == (4096, 561)
    Cfg.kv_cache_memory_bytes = 16 * 600 * 300                      # too small to save anything: paired
    assert size_windowed_pools(Cfg, 1024, 100, 500) == (300, 300)
    assert size_windowed_pools(Cfg, 1024, 0, 500) == (4096, 360)    # every layer slides: ids cost nothing


def test_blocks_of_a_windowed_kv_cache_are_whole_or_partial():
    """``KVCache.read_page`` gives a whole block (every layer) for a page with its sliding page, a partial
    one (the full layers) without; ``write_page`` puts each back bit for bit, skips a whole block's sliding
    part for a page without a sliding page, and refuses to fill a sliding page from a partial block."""
    import torch

    from engine.kv_pool import KVCache
    kv = KVCache(3, 8, P, 2, 4, torch.float32, "cpu", layout="HSD", window_layers=(0, 2), window_pages=4)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape))
    assert kv.page_shape == (2, 3, 2, P, 4) and kv.partial_page_shape == (2, 1, 2, P, 4)
    whole, partial = kv.read_page(5, 3), kv.read_page(5)
    assert whole.shape == kv.page_shape and torch.equal(partial[:, 0], whole[:, 1])
    assert torch.equal(whole[0, 0], kv.k[0][:, 3 * P:4 * P]) and torch.equal(whole[1, 1], kv.v[1][:, 5 * P:6 * P])
    kv.write_page(6, whole, 1)
    assert torch.equal(kv.read_page(6, 1), whole)
    before = kv.k[0].clone()
    kv.write_page(7, whole)                        # no sliding page: the full layer only
    assert torch.equal(kv.read_page(7), partial) and torch.equal(kv.k[0], before)
    with pytest.raises(ValueError, match="cannot fill sliding page 2"):
        kv.write_page(7, partial, 2)
    with pytest.raises(ValueError, match="fits neither"):
        kv.write_page(7, torch.zeros(2, 2, 2, P, 4))
    assert usable_pages([True, False, True, True, True], P, W) == 5 and usable_pages([False, True], P, W) == 0
    assert usable_pages([True, True, False], P, W, floor=1) == 2
