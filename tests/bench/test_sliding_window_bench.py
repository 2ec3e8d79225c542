"""benchmarks/sliding_window.py's arithmetic: the fixed pool's bytes, bytes per cached token, and what
counts as a session whose context is held."""

from benchmarks.sliding_window import PAGE, budget_for, bytes_per_cached_token, whole_context_held
from engine.hashing import make_seed
from engine.radix_cache import RadixCache
from engine.window_pool import WindowedPagePool


def test_budget_holds_the_contexts_and_a_chunk():
    # 2 contexts of 4096 tokens (256 pages each) and a 512-token chunk (32 pages), 6 layers of
    # 2 KV heads x 16 dims, K and V, float32: 6 x 256 bytes a token
    assert budget_for(2, 4096, 6) == (2 * 256 + 32) * 16 * 1536
    assert budget_for(1, 4097, 1) == (257 + 32) * 16 * 256      # a partial page is a whole page


def test_bytes_per_cached_token():
    # windows ignored: every layer's bytes on each page id, so exactly the per-token bytes
    assert bytes_per_cached_token(100, 0, 100, 1536, 0) == 1536.0
    # a Gemma-3 shape: 1 full layer (256 bytes a token) on 256 page ids, 5 sliding layers (1280) on the
    # 18 pages of one window: (256 * 256 + 18 * 1280) / 256
    assert bytes_per_cached_token(256, 18, 256, 256, 1280) == 346.0
    assert bytes_per_cached_token(0, 0, 0, 128, 640) == 0.0
    # pages in use that the cache does not hold yet (a running request's) count in the bytes
    assert bytes_per_cached_token(3, 0, 2, 10, 0) == 15.0


def test_whole_context_held_needs_the_window_before_its_end():
    pool = WindowedPagePool(64, 64, 20)
    cache = RadixCache(pool, PAGE, lambda salt: make_seed("m", salt))
    seq = list(range(100, 100 + 5 * PAGE + 3))         # 83 tokens: 82 computed, 5 full pages
    pages = pool.alloc(5)
    cache.insert(seq[:5 * PAGE], pages)
    assert whole_context_held(cache, seq, PAGE)
    pool.drop_window(pages[-1:])                       # the window before its end is gone
    assert not whole_context_held(cache, seq, PAGE)
    assert not whole_context_held(cache, list(range(7, 90)), PAGE)
