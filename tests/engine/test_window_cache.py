"""Sliding windows in the paged radix cache (engine/window_pool.py): Gemma-3- and gpt-oss-shaped tiny
random checkpoints (tests/engine/test_families_windows.py writes them) generate transformers' greedy
tokens (fp32) over multi-turn prefix hits while their sliding layers keep only their window, and the
two pools account for every page.

Small pages (4 tokens) and a small sliding pool (two windows) make the windows matter: prompts of
70+ tokens span 18+ pages, the windows (12 and 8 tokens) three or four.
"""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.window_pool import WindowedPagePool
from tests.engine.test_families_windows import greedy_reference, write_checkpoint

transformers = pytest.importorskip("transformers")

P = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine_for(path, **overrides):
    cfg = dict(model=str(path), page_size=P, kv_cache_tokens=1024, max_batched_tokens=32, max_num_seqs=2,
               sliding_window_pool_windows=2)
    return LLMEngine(EngineConfig(**dict(cfg, **overrides)))


def random_ids(n, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def check_accounts(eng):
    """Every sliding page is paired with exactly one page id, and each pool's free + used is its capacity."""
    pool = eng.pool
    paired = [pool.window_page[p] for p in range(pool.num_pages) if pool.window_page[p]]
    assert len(paired) == len(set(paired)) == pool.window_pages_used
    assert all(not pool._is_free[p] for p in range(pool.num_pages) if pool.window_page[p])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "mistral"])
@pytest.mark.parametrize("overlap", [False, True])
def test_window_cache_multi_turn_matches_transformers(family, overlap, tmp_path, tokenizer):
    ref = write_checkpoint(family, tmp_path, tokenizer)
    eng = engine_for(tmp_path, overlap_schedule=overlap)
    assert isinstance(eng.pool, WindowedPagePool)
    assert eng.pool.window == {"gemma3": 12, "gpt_oss": 8, "mistral": 8}[family]
    assert eng.window_layers == {"gemma3": (0, 2), "gpt_oss": (0,), "mistral": (0, 1)}[family]
    ignored = engine_for(tmp_path, sliding_window_cache=False, overlap_schedule=overlap)
    assert not hasattr(ignored.pool, "window")

    turn1 = random_ids(70, 1)
    turn2_extra = random_ids(21, 2)
    cached = {}
    for name, e in (("honoured", eng), ("ignored", ignored)):
        r1 = e.generate([turn1], GREEDY)[0]
        assert r1.token_ids == greedy_reference(ref, turn1, 8)[0]
        turn2 = turn1 + r1.token_ids + turn2_extra
        r2 = e.generate([turn2], GREEDY)[0]
        assert r2.token_ids == greedy_reference(ref, turn2, 8)[0], name
        # turn 1 computed 70 + 7 tokens: its 19 full pages are a hit for turn 2
        cached[name] = r2.cached_tokens
        # turn 3 leaves turn 1 at token 58: the raw match is 14 pages, but with windows the sliding pages
        # before 58 were dropped (only the ends' windows are kept), so the hit is shortened
        turn3 = turn1[:58] + random_ids(30, 3)
        r3 = e.generate([turn3], GREEDY)[0]
        assert r3.token_ids == greedy_reference(ref, turn3, 8)[0], name
        cached[name + " turn 3"] = r3.cached_tokens
    assert cached["honoured"] == cached["ignored"] == 76
    assert cached["ignored turn 3"] == 56
    assert cached["honoured turn 3"] < 56 and cached["honoured turn 3"] % P == 0
    check_accounts(eng)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"speculative": "ngram"}], ids=["plain", "ngram"])
def test_window_cache_under_pressure_matches_transformers(extra, tmp_path, tokenizer):
    """Three sessions at once on a sliding pool of one window and a chunk: requests wait, evict and are
    preempted for sliding pages, and still generate transformers' tokens; the last one's next turn hits."""
    ref = write_checkpoint("gpt_oss", tmp_path, tokenizer)
    eng = engine_for(tmp_path, sliding_window_pool_windows=1, max_num_seqs=3, **extra)
    assert eng.pool.window_pool.capacity == 4 + 8      # a window of 8 (2 pages, +2) and a 32-token chunk
    prompts = [random_ids(n, 10 + n) for n in (61, 75, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = eng.generate(prompts, params)
    for p, r in zip(prompts, first):
        assert r.token_ids == greedy_reference(ref, p, 12)[0]
    assert eng.scheduler.num_preemptions > 0                 # the pressure was real
    again = [p + r.token_ids + random_ids(9, 7) for p, r in zip(prompts, first)]
    # the last session to finish keeps its context and the window before its end: a whole hit, alone
    last = again[2]
    usable = len(eng.cache.match_usable(last[:len(prompts[2]) + 11])[0]) * P
    assert usable == (90 + 11) // P * P
    [r] = eng.generate([last], params)
    assert r.cached_tokens == usable and r.token_ids == greedy_reference(ref, last, 12)[0]
    for p, r in zip(again[:2], eng.generate(again[:2], params)):
        assert r.token_ids == greedy_reference(ref, p, 12)[0]
    check_accounts(eng)
    eng.flush_cache()
    eng.step()
    assert eng.pool.window_pool.num_free == eng.pool.window_pool.capacity


def test_window_cache_int8_pages_same_tokens_as_windows_ignored(tmp_path, tokenizer):
    """int8 pages quantize each token alike however many layers keep it: windows honoured or ignored,
    the same greedy tokens, through the C RoPE + store into the sliding layers' own slots."""
    write_checkpoint("gpt_oss", tmp_path, tokenizer)
    prompts = [random_ids(83, 21), random_ids(50, 22)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = [[r.token_ids for r in engine_for(tmp_path, kv_cache_dtype="int8", sliding_window_cache=on)
            .generate(prompts, params)] for on in (True, False)]
    assert out[0] == out[1]


def test_window_cache_frees_sliding_pages_and_leaks_none(tmp_path, tokenizer):
    """A 200-token prompt and 40 decoded tokens hold 59 page ids but only a window's sliding pages: at
    every step a running request holds at most its window, one chunk and a partial page; finished, the
    tree keeps the leaf's window; flushed, both pools are whole again."""
    write_checkpoint("gemma3", tmp_path, tokenizer)
    eng = engine_for(tmp_path)
    pool = eng.pool
    window_pages = -(-(12 - 1) // P) + 1          # the pages holding the 11 keys before a query, and its own
    chunk_pages = 32 // P
    rid = eng.add_request(random_ids(200, 4), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    most = 0
    while eng.has_unfinished():
        eng.step()
        check_accounts(eng)
        ids_used = pool.capacity - pool.num_free_ids
        most = max(most, pool.window_pages_used)
        assert pool.window_pages_used <= window_pages + chunk_pages + 1, rid
    assert most > window_pages                    # a step's new pages held theirs until it was cached
    assert ids_used == 59                         # the full layers keep all 239 computed tokens
    assert eng.cache.cached_pages == (200 + 40 - 1) // P
    # the leaf's end (token 236) keeps the window before it, 11 tokens on 3 pages; nothing else
    assert pool.window_pages_used == 3
    stats = eng.stats()                            # what /metrics shows (agentrt_kv_window_pages_*)
    assert (stats.window_pages_total, stats.window_pages_used) == (pool.window_pool.capacity, 3)
    eng.flush_cache()
    eng.step()
    assert pool.num_free_ids == pool.capacity and pool.window_pool.num_free == pool.window_pool.capacity
    assert not any(pool.window_page)


def test_window_cache_sized_by_bytes(tmp_path, tokenizer):
    """kv_cache_memory_bytes buys the sliding pool's windows first, then page ids for the full layers:
    more tokens than the same bytes hold with windows ignored, and the bytes add up."""
    write_checkpoint("gemma3", tmp_path, tokenizer)
    budget = 1 << 20
    eng = engine_for(tmp_path, kv_cache_memory_bytes=budget)
    ignored = engine_for(tmp_path, kv_cache_memory_bytes=budget, sliding_window_cache=False)
    per_layer = 2 * 2 * 16 * 4                     # K and V, 2 KV heads, head dim 16, float32
    full_pages, window_pages = eng.pool.num_pages, eng.pool.window_pool.num_pages
    assert window_pages == 1 + 2 * (-(-11 // P) + 2) + 32 // P
    assert full_pages == (budget - window_pages * P * 2 * per_layer) // (P * 2 * per_layer)
    assert ignored.pool.num_pages == budget // (P * 4 * per_layer)
    assert full_pages > 1.9 * ignored.pool.num_pages
    tensors = sum(t.numel() * t.element_size() for t in eng.kv.k + eng.kv.v)
    assert tensors == (full_pages * 2 + window_pages * 2) * P * per_layer <= budget


def test_window_cache_takes_tiers_and_refuses_kv_moves(tmp_path, tokenizer):
    """KV tiers keep whole or partial blocks (tests/engine/test_window_tiers.py); moves between workers carry
    whole pages only, so they are refused, naming the setting (docs/kv_tiers.md)."""
    write_checkpoint("gpt_oss", tmp_path, tokenizer)
    tiered = engine_for(tmp_path, kv_host_tokens=256)
    assert tiered.tiers.host.shapes[1] == tiered.kv.partial_page_shape
    eng = engine_for(tmp_path)
    with pytest.raises(ValueError, match="KV moves.*sliding_window_cache=False"):
        eng.mover.held([1] * 8, "")


def test_window_cache_untouched_without_sliding_layers(default_engine):
    """The default model (SmolLM2, no sliding layers) keeps one plain pool."""
    assert default_engine.window_layers == ()
    assert type(default_engine.pool).__name__ == "PagePool"
    assert not default_engine.kv.window_layers
    stats = default_engine.stats()
    assert (stats.window_pages_total, stats.window_pages_used) == (0, 0)
