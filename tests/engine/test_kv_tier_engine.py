"""KV tiers in the engine, on the default model with a pool too small for two prompts: a prompt's pages
evicted by another one come back from the host and disk tiers, and the output is exactly what
recomputing them gives (also with 8-bit pages); a damaged page is recomputed; a session turn whose pin expired during a
pause resumes from the tiers; a full disk fails no request."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.hashing import block_hashes

P = 16
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["auto", "int8"])
def engine(tmp_path_factory, request):
    # 4 usable pages (64 tokens): one ~40-token prompt at a time. Host tier 1 page, disk tier 128.
    # Every test runs with the activation dtype's pages and with 8-bit pages (their scales travel along).
    path = str(tmp_path_factory.mktemp("kv") / "tier")
    llm = LLMEngine(EngineConfig(kv_cache_tokens=5 * P, max_batched_tokens=32, kv_host_tokens=1 * P,
                                 kv_disk_tokens=128 * P, kv_disk_path=path, kv_cache_dtype=request.param))
    assert llm.kv.quantized == (request.param == "int8") and llm.tiers.disk.dtype == llm.kv.page_dtype
    yield llm
    llm.close()
    assert not os.path.exists(path)   # the tier's directory is gone at shutdown (it created it)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    a = tok.encode("An agent reads the repository, runs the test suite and waits for the results. " * 4)[:40]
    b = tok.encode("Meanwhile another session summarises a long design document about caching. " * 4)[:40]
    return a, b, a + tok.encode(" Tool: 3 failed.")


@pytest.fixture(scope="module")
def recomputed(engine, prompts):
    """The continuation computed from scratch (tiers and cache flushed): the reference."""
    engine.flush_cache()
    [r] = engine.generate([prompts[2]], GREEDY)
    assert r.cached_tokens == 0
    return r


def settle(engine: LLMEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.tiers.disk._staged:
        assert time.monotonic() < deadline, "the disk tier's writer did not catch up"
        time.sleep(0.01)


def evict_a_with_b(engine: LLMEngine, prompts) -> None:
    engine.flush_cache()
    a, b, _ = prompts
    assert engine.generate([a], GREEDY)[0].finish_reason == "length"
    assert engine.generate([b], GREEDY)[0].finish_reason == "length"   # needs the pool: a's pages leave it


def same_output(r, ref) -> None:
    assert r.token_ids == ref.token_ids
    assert max(abs(x.logprob - y.logprob) for x, y in zip(r.logprobs, ref.logprobs)) <= 1e-5


@pytest.mark.slow
def test_restored_pages_give_the_recomputed_output(engine, prompts, recomputed):
    evict_a_with_b(engine, prompts)
    before = engine.stats().kv_tiers
    [r] = engine.generate([prompts[2]], GREEDY)
    tiers = r.cached_tokens_by_tier
    # 32 of a's 40 tokens are full pages: the host tier kept the last one evicted, the other went one tier down
    assert tiers == {"device": 0, "host": P, "disk": P} and r.cached_tokens == 2 * P
    same_output(r, recomputed)
    after = engine.stats().kv_tiers
    assert after["disk"]["hit_tokens"] - before["disk"]["hit_tokens"] == P
    assert after["host"]["loads"] - before["host"]["loads"] == 1
    assert after["disk"]["bytes_written"] > 0 and after["disk"]["bytes_read"] > before["disk"]["bytes_read"]


@pytest.mark.slow
def test_a_damaged_disk_page_is_recomputed_not_served(engine, prompts, recomputed):
    evict_a_with_b(engine, prompts)
    settle(engine)
    hashes = block_hashes(prompts[0][:2 * P], P, engine.cache.seed_fn(""))
    disk = engine.tiers.disk
    media = [engine.tiers.holds(h) for h in hashes]
    assert sorted(media) == ["disk", "host"]
    k = media.index("disk")
    with open(disk._file(hashes[k]), "r+b") as f:   # flip a byte of a disk page's payload
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
    corrupt = disk.stats.corrupt
    [r] = engine.generate([prompts[2]], GREEDY)
    assert disk.stats.corrupt == corrupt + 1
    assert r.cached_tokens == k * P and r.cached_tokens_by_tier["device"] == 0   # the pages before it only
    same_output(r, recomputed)


@pytest.mark.slow
def test_a_turn_whose_pin_expired_resumes_from_the_tiers(engine, prompts, recomputed):
    engine.flush_cache()
    engine.step()
    a, b, a2 = prompts
    rid = engine.add_request(a, GREEDY, pin_ttl_s=0.05)   # a session turn: pinned when it ends
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_pins == 1
    time.sleep(0.1)   # the tool runs longer than the pin
    engine.step()
    assert engine.stats().num_pins == 0 and not engine.pin_active(rid)
    assert engine.generate([b], GREEDY)[0].finish_reason == "length"   # memory pressure meanwhile
    [r] = engine.generate([a2], GREEDY)   # the agent's next turn
    assert r.cached_tokens == 2 * P and r.cached_tokens_by_tier["device"] == 0
    assert r.cached_tokens_by_tier["host"] + r.cached_tokens_by_tier["disk"] == 2 * P
    same_output(r, recomputed)


@pytest.mark.slow
def test_a_turn_waits_for_room_to_load_its_tier_pages_instead_of_recomputing(engine, prompts, recomputed):
    """The pool has room for a's continuation's first chunk computed from scratch (2 pages) but not for its
    2 tier pages and the chunk after them (3 pages) while another request runs: the turn waits for that
    request to finish, then loads from the tiers. Admitting it at once would recompute all 45 tokens."""
    evict_a_with_b(engine, prompts)   # b's 2 full pages are cached on the device, a's are in the tiers
    tok = engine.tokenizer
    other = tok.encode("A third session lists the files of a small project directory, one per line. " * 2)[:20]
    busy = engine.add_request(other, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()   # `other` runs: 2 of the 4 usable pages, b's 2 evictable
    rid = engine.add_request(prompts[2], GREEDY)
    order, results, ids = [], {}, {busy: [], rid: []}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in order:
                order.append(out.request_id)
            ids[out.request_id] += out.token_ids
            if out.finished:
                results[out.request_id] = out
                order.append(("finished", out.request_id))
    assert order.index(("finished", busy)) < order.index(rid)   # it waited for the running request
    r = results[rid]
    assert r.cached_tokens == 2 * P and r.cached_tokens_by_tier["device"] == 0
    assert r.cached_tokens_by_tier["host"] + r.cached_tokens_by_tier["disk"] == 2 * P
    assert ids[rid] == recomputed.token_ids


@pytest.mark.slow
def test_a_demoted_pin_is_in_the_tiers_at_once_and_a_prefetch_reads_it_back_before_the_turn(
        engine, prompts, recomputed):
    """A long pause ahead (agentrt/core/leases.py's plan): ``demote`` copies the pinned prefix into the tiers
    and releases the pin, so another prompt takes its pool pages with nothing left to write; ``prefetch``
    starts the disk reads before the session's next turn arrives, which then loads every page from the
    tiers and continues exactly as recomputing would. A second prefetch, or one of a pin never demoted,
    does nothing."""
    a, b, c = prompts
    engine.flush_cache()
    assert engine.generate([a], GREEDY)[0].finish_reason == "length"
    engine.pin("pause", a, 600.0)
    engine.step()
    assert "pause" in engine.scheduler.pins
    hashes = block_hashes(a[:len(a) // P * P], P, engine.cache.seed_fn(""))
    assert not any(engine.tiers.holds(h) for h in hashes)   # nothing evicted yet: nothing in a tier
    demotions, prefetches = engine.kv_control.demotions, engine.kv_control.prefetches
    engine.demote("pause")
    engine.step()
    assert "pause" not in engine.scheduler.pins and engine.kv_control.demotions == demotions + 1
    assert all(engine.tiers.holds(h) for h in hashes)       # copied at the demotion, not at an eviction
    settle(engine)
    assert engine.generate([b], GREEDY)[0].finish_reason == "length"   # b takes a's pool pages
    assert engine.cache.match_prefix(a, "")[0] == []
    on_disk = [h for h in hashes if engine.tiers.holds(h) == "disk"]
    assert on_disk   # the host tier holds one page: the rest went on to disk
    engine.prefetch("never demoted")
    engine.prefetch("pause")
    engine.step()
    assert engine.kv_control.prefetches == prefetches + 1
    with engine.tiers._loads_lock:
        assert all(h in engine.tiers._loads for h in on_disk)   # read before any request asked for them
    engine.prefetch("pause")   # read back once: the demotion is forgotten
    engine.step()
    assert engine.kv_control.prefetches == prefetches + 1
    deadline = time.monotonic() + 20
    while engine.tiers.loading():
        assert time.monotonic() < deadline, "the prefetch's reads did not finish"
        time.sleep(0.01)
    [r] = engine.generate([c], GREEDY)
    assert r.cached_tokens == len(hashes) * P and r.cached_tokens_by_tier["device"] == 0
    same_output(r, recomputed)


@pytest.mark.slow
def test_a_full_disk_turns_the_tier_off_and_fails_no_request(engine, prompts, recomputed):
    """Last in this module: the disk tier stays off. RLIMIT_FSIZE stands in for a full filesystem."""
    engine.flush_cache()
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))   # less than one page's file
    try:
        a, b, a2 = prompts
        results = engine.generate([a], GREEDY) + engine.generate([b], GREEDY)
        deadline = time.monotonic() + 20
        while engine.tiers.disk.enabled:
            assert time.monotonic() < deadline, "the failed write did not turn the tier off"
            time.sleep(0.01)
        results += engine.generate([a2], GREEDY)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert [r.finish_reason for r in results] == ["length"] * 3 and not any(r.error for r in results)
    stats = engine.stats().kv_tiers["disk"]
    assert stats["enabled"] is False and stats["errors"] == 1 and stats["pages"] == 0
    assert results[2].cached_tokens_by_tier["disk"] == 0
    same_output(results[2], recomputed)

