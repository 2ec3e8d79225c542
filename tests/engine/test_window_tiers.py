"""KV tiers for models whose sliding layers keep only their window in the cache (docs/kv_tiers.md, "Blocks
of a model with sliding windows"): Gemma-3-, gpt-oss- and Mistral-shaped tiny random checkpoints
(tests/engine/test_families_windows.py writes them) on a pool too small for two sessions, with a host and a
disk tier. A block reaches a tier whole (every layer's K/V) where its page still had its sliding page, and
partial (the full layers only) where that was dropped; read back, a hit is used only as far as the window
before its end is held, as the in-memory radix cache does. Greedy tokens are transformers'.

Small pages (4 tokens) and windows of 12 and 8 tokens: a 60-token prefix spans 15 pages, a window 3 or 4.
"""

import time

import pytest

from engine import SamplingParams
from engine.hashing import block_hashes
from engine.window_pool import usable_pages
from tests.engine.test_families_windows import greedy_reference, write_checkpoint
from tests.engine.test_window_cache import check_accounts, engine_for, random_ids

transformers = pytest.importorskip("transformers")

P = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
WINDOW = {"gemma3": 12, "gpt_oss": 8, "mistral": 8}


def tiered(path, tmp_path, host=True, **overrides):
    """An engine whose pool holds 96 tokens (one session and a bit), a host tier of 8 pages (or none) and a
    disk tier of 512 tokens in ``tmp_path``."""
    cfg = dict(kv_cache_tokens=96, kv_host_tokens=8 * P if host else 0, kv_disk_tokens=512,
               kv_disk_path=str(tmp_path / "tier"))
    return engine_for(path, **dict(cfg, **overrides))


def settle(eng, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while eng.tiers.disk._staged:
        assert time.monotonic() < deadline, "the disk tier's writer did not catch up"
        time.sleep(0.01)


def check_tiers(eng):
    """Pool and tier accounts agree: both pools as check_accounts says, every tier's page count is what it
    indexes, a partial block is one the tier holds, and nothing is held twice across the tiers."""
    check_accounts(eng)
    host, disk = eng.tiers.host, eng.tiers.disk
    if host is not None:
        assert host.stats.pages == len(host._slots) == host.capacity - len(host._free)
        assert host._partial <= set(host._slots)
    assert disk.stats.pages == len(disk._index) and disk._partial <= set(disk._index)
    if host is not None:
        assert not set(host._slots) & set(disk._index)


def window_pages(window):
    """Pages under the window before a page boundary: its ``window - 1`` keys."""
    return -(-(window - 1) // P)


def hashes_of(eng, tokens):
    return block_hashes(tokens[:len(tokens) // P * P], P, eng.cache.seed_fn(""))


@pytest.mark.parametrize("family,host", [("gemma3", True), ("gpt_oss", True), ("mistral", True),
                                         ("gemma3", False)], ids=["gemma3", "gpt_oss", "mistral", "gemma3-disk"])
def test_windowed_sessions_resume_from_the_tiers_as_transformers(family, host, tmp_path, tokenizer):
    """Two sessions of three turns take turns on a pool that holds one: each turn's prefix was evicted to
    the tiers by the other session's turn and is read back; each session's last context goes to the tiers
    whole (a leaf keeps the window before its end), so every later turn hits its whole previous context."""
    ref = write_checkpoint(family, tmp_path, tokenizer)
    eng = tiered(tmp_path, tmp_path, host=host)
    assert eng.pool.window == WINDOW[family] and eng.tiers is not None
    sessions = [random_ids(50, 1), random_ids(46, 2)]
    from_tiers = 0
    for turn in range(3):
        for s, context in enumerate(sessions):
            [r] = eng.generate([context], GREEDY)
            assert r.token_ids == greedy_reference(ref, context, 6)[0], (turn, s)
            if turn:
                # the previous turn cached its full pages (context and reply but the last token): all back
                assert r.cached_tokens == (len(context) - 8 - 1) // P * P, (turn, s)
                tiers = r.cached_tokens_by_tier
                assert tiers["host"] + tiers["disk"] > 0
                from_tiers += tiers["host"] + tiers["disk"]
            sessions[s] = context + r.token_ids + random_ids(8, 100 * turn + s)
            check_tiers(eng)
    stats = eng.tiers.stats()
    assert from_tiers == sum(t["hit_tokens"] for t in stats.values()) > 0
    settle(eng)
    check_tiers(eng)
    eng.flush_cache()
    eng.step()
    assert eng.pool.window_pool.num_free == eng.pool.window_pool.capacity
    assert eng.pool.num_free_ids == eng.pool.capacity
    eng.close()


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_a_tier_hit_whose_window_was_dropped_is_shortened(family, tmp_path, tokenizer):
    """Session A's context (64 cached tokens) is branched off at 32 by C (an end: the window before 32 is
    kept) and continued by B (64 is no end any more: the pages before it lose their sliding pages). After
    the pool's pressure the tiers hold every block of A's first 64 tokens, partial where the page had lost
    its sliding page when it left the pool: part of the window before 64 is missing, the one before 32 is
    whole. A request continuing A's first 64 tokens finds all 16 blocks in the tiers but may use them
    only up to 32; loading past that would read sliding K/V that no tier holds."""
    ref = write_checkpoint(family, tmp_path, tokenizer)
    eng = tiered(tmp_path, tmp_path)
    W = WINDOW[family]
    a = random_ids(60, 11)
    [ra] = eng.generate([a], GREEDY)
    seq_a = a + ra.token_ids                                   # 66 tokens: 16 full pages cached
    eng.generate([seq_a[:32] + random_ids(12, 12)], GREEDY)    # C: a branch at 32
    eng.generate([seq_a + random_ids(10, 13)], GREEDY)         # B continues A: 64 is no end any more
    eng.generate([random_ids(90, 14)], GREEDY)                 # pressure: the tree above goes to the tiers
    settle(eng)
    hashes = hashes_of(eng, seq_a[:64])
    assert eng.cache.match_prefix(seq_a[:64])[0] == []         # nothing of A left on the device
    assert all(eng.tiers.holds(h) for h in hashes)             # every block of A's 64 tokens is in a tier
    whole = [not eng.tiers.is_partial(h) for h in hashes]
    assert not all(whole[-window_pages(W):])                   # the window before 64 is not all there
    expected = usable_pages(whole, P, W) * P
    assert expected == 32                                      # the branch's end keeps the window before it
    check_tiers(eng)

    prompt = seq_a[:64] + random_ids(20, 15)
    [r] = eng.generate([prompt], GREEDY)
    assert r.token_ids == greedy_reference(ref, prompt, 6)[0]
    assert r.cached_tokens == expected and r.cached_tokens_by_tier["device"] == 0
    check_tiers(eng)
    eng.close()


def test_a_demoted_windowed_pin_reads_back_whole(tmp_path, tokenizer):
    """A demoted pin holds its end, so its window goes to the tiers whole: the session's next turn, after
    another session took the pool, hits its whole previous context from the tiers."""
    ref = write_checkpoint("gemma3", tmp_path, tokenizer)
    eng = tiered(tmp_path, tmp_path)
    a = random_ids(62, 21)
    [ra] = eng.generate([a], GREEDY)
    seq = a + ra.token_ids
    eng.pin("pause", seq, 600.0)
    eng.step()
    eng.demote("pause")
    eng.step()
    hashes = hashes_of(eng, seq[:(len(seq) - 1) // P * P])   # the pages the turn cached
    assert all(eng.tiers.holds(h) for h in hashes)
    assert not any(eng.tiers.is_partial(h) for h in hashes[-window_pages(12):])   # the end's window: whole
    eng.generate([random_ids(90, 22)], GREEDY)
    assert eng.cache.match_prefix(seq)[0] == []
    nxt = seq + random_ids(9, 23)
    [r] = eng.generate([nxt], GREEDY)
    assert r.cached_tokens == len(hashes) * P and r.cached_tokens_by_tier["device"] == 0
    assert r.token_ids == greedy_reference(ref, nxt, 6)[0]
    check_tiers(eng)
    eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("overlap,kv", [(True, "auto"), (False, "int8"), (True, "int8")],
                         ids=["overlap", "int8", "overlap-int8"])
def test_windowed_tiers_under_overlap_and_with_int8_pages(overlap, kv, tmp_path, tokenizer):
    """The two sessions of the first test with overlap scheduling and/or int8 pages (a block then travels as
    bytes with its scales): each turn's tokens are those of the same settings on a pool that never evicts
    (and transformers' with float pages), and later turns hit their previous context from the tiers."""
    ref = write_checkpoint("gemma3", tmp_path, tokenizer)
    eng = tiered(tmp_path, tmp_path, overlap_schedule=overlap, kv_cache_dtype=kv)
    roomy = engine_for(tmp_path, overlap_schedule=overlap, kv_cache_dtype=kv)
    sessions = [random_ids(50, 1), random_ids(46, 2)]
    for turn in range(3):
        for s, context in enumerate(sessions):
            [r] = eng.generate([context], GREEDY)
            [expect] = roomy.generate([context], GREEDY)
            assert r.token_ids == expect.token_ids, (turn, s)
            if kv == "auto":
                assert r.token_ids == greedy_reference(ref, context, 6)[0], (turn, s)
            if turn:
                assert r.cached_tokens == (len(context) - 8 - 1) // P * P, (turn, s)
                assert r.cached_tokens_by_tier["host"] + r.cached_tokens_by_tier["disk"] > 0
            sessions[s] = context + r.token_ids + random_ids(8, 100 * turn + s)
            check_tiers(eng)
    eng.close()
    roomy.close()
