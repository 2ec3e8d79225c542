"""Radix prefix cache: split, match, insert, evict, lock, events."""

import pytest

from engine.hashing import block_hashes, make_seed
from engine.kv_pool import PagePool
from engine.radix_cache import RadixCache

P = 4


def make(num_pages=64):
    pool = PagePool(num_pages)
    events = []
    cache = RadixCache(pool, P, lambda salt: make_seed("m", salt),
                       on_event=lambda kind, hashes, parent: events.append((kind, list(hashes), parent)))
    return pool, cache, events


def put(cache, pool, tokens, salt=""):
    pages = pool.alloc(len(tokens) // P)
    node, dups = cache.insert(tokens, pages, salt)
    pool.free(dups)
    return pages, node


def test_match_empty_and_partial_pages():
    pool, cache, _ = make()
    assert cache.match_prefix(list(range(10)))[0] == []
    pages, _ = put(cache, pool, list(range(8)))
    # 7 tokens: only one whole page matches; a partial page never does
    assert cache.match_prefix(list(range(7)))[0] == pages[:1]
    assert cache.match_prefix(list(range(12)))[0] == pages


def test_insert_splits_edge_and_shares_prefix():
    pool, cache, events = make()
    a = list(range(12))
    b = list(range(8)) + [99, 98, 97, 96]
    pa, _ = put(cache, pool, a)
    free_before = pool.num_free
    pb = pool.alloc(3)
    node, dups = cache.insert(b, pb)
    # the first two pages of b were already cached under other page ids
    assert dups == pb[:2]
    pool.free(dups)
    matched, _ = cache.match_prefix(b)
    assert matched == pa[:2] + pb[2:]
    assert cache.match_prefix(a)[0] == pa
    assert cache.cached_pages == 4
    assert pool.num_free == free_before - 1
    # the split produced a node with two children
    root = cache.root()
    (upper,) = root.children.values()
    assert len(upper.key) == 8 and len(upper.children) == 2
    # events: a stored all 3 blocks; b stored only its new block, parented on block 2
    ha = block_hashes(a, P, make_seed("m", ""))
    hb = block_hashes(b, P, make_seed("m", ""))
    assert events[0] == ("stored", ha, None)
    assert events[1] == ("stored", hb[2:], ha[1])


def test_lock_prevents_eviction_and_lru_order():
    pool, cache, events = make()
    old, old_node = put(cache, pool, [1] * 8)
    new, new_node = put(cache, pool, [2] * 8)
    cache.match_prefix([2] * 8)  # touch: [2]*8 is now most recently used
    cache.lock(new_node)
    assert cache.evictable_pages == 2
    freed = cache.evict(100)
    assert freed == 2
    assert cache.match_prefix([1] * 8)[0] == []
    assert cache.match_prefix([2] * 8)[0] == new
    assert events[-1][0] == "removed"
    cache.unlock(new_node)
    assert cache.evict(1) == 2  # a whole leaf goes at once
    assert cache.cached_pages == 0 and pool.num_free == pool.capacity


def test_evict_prefers_least_recently_used_leaf():
    pool, cache, _ = make()
    put(cache, pool, [1] * 4)
    put(cache, pool, [2] * 4)
    cache.match_prefix([1] * 4)
    cache.evict(1)
    assert cache.match_prefix([1] * 4)[0] != []
    assert cache.match_prefix([2] * 4)[0] == []


def test_evicting_child_makes_parent_evictable():
    pool, cache, _ = make()
    put(cache, pool, list(range(8)))
    put(cache, pool, list(range(4)) + [50] * 4)   # splits after page 1
    assert cache.evict(10) == 3
    assert cache.cached_pages == 0


def test_unlock_without_lock_is_an_error():
    pool, cache, _ = make()
    _, node = put(cache, pool, [3] * 4)
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_salts_do_not_share():
    pool, cache, _ = make()
    put(cache, pool, [7] * 8, salt="tenant-a")
    assert cache.match_prefix([7] * 8, "tenant-b")[0] == []
    assert len(cache.match_prefix([7] * 8, "tenant-a")[0]) == 2


def test_all_hashes_is_the_snapshot():
    pool, cache, _ = make()
    put(cache, pool, list(range(8)))
    put(cache, pool, list(range(4)) + [9] * 4)
    expected = set(block_hashes(list(range(8)), P, make_seed("m", ""))) | set(
        block_hashes(list(range(4)) + [9] * 4, P, make_seed("m", "")))
    assert set(cache.all_hashes()) == expected
