"""``PrefixIndex`` (bitset layout) against ``ReferencePrefixIndex`` (the plain dict of sets).

Random event sequences over a small hash space (so blocks are shared, removed while held by
others, re-stored, workers cleared and their slots reused) drive both; after every step each
query must answer the same."""

from __future__ import annotations

import random

import pytest

import router.index as index_module
from router.index import PrefixIndex, ReferencePrefixIndex

WORKERS = [f"w{i}" for i in range(12)]


def chains(rng: random.Random, n: int) -> list[list[int]]:
    """Prefix chains sharing heads, like prompts that share a system prompt."""
    out = []
    for _ in range(n):
        head = rng.randrange(6)
        out.append([head * 1000 + j for j in range(rng.randrange(1, 4))]
                   + [rng.randrange(100, 160) for _ in range(rng.randrange(0, 6))])
    return out


def same(a: PrefixIndex, b: ReferencePrefixIndex, rng: random.Random, queries: list[list[int]]) -> None:
    assert len(a) == len(b)
    assert sorted(a.workers()) == sorted(b.workers())
    for w in WORKERS + ["nobody"]:
        assert a.blocks_of(w) == b.blocks_of(w)
        assert a.hashes_of(w) == b.hashes_of(w)
    for h in list(b._holders)[:50] + [999_999]:
        assert a.holders(h) == b.holders(h)
    for q in queries:
        want = b.match(q)
        assert a.match(q) == want
        levels = a.match_levels(q)
        assert [k for k, _ in levels] == sorted({k for k, _ in levels})  # ascending, one group per length
        assert {w: k for k, ws in levels for w in ws} == want and sum(len(ws) for _, ws in levels) == len(want)
        for w in WORKERS + ["nobody"]:
            assert a.prefix_len(w, q) == want.get(w, 0)
        extra = {h: set(rng.sample(WORKERS + ["tentative-only"], rng.randrange(0, 3)))
                 for h in q if rng.random() < 0.4}
        assert a.match(q, extra=extra) == b.match(q, extra=extra)


@pytest.mark.parametrize("few", [0, 1, 4, 100])  # when ``match`` leaves the fleet-wide map for workers' own sets
@pytest.mark.parametrize("seed", range(6))
def test_random_events_match_reference(seed, few, monkeypatch):
    monkeypatch.setattr(index_module, "_FEW", few)
    rng = random.Random(seed)
    a, b = PrefixIndex(), ReferencePrefixIndex()
    paths = chains(rng, 40)
    for step in range(400):
        w = rng.choice(WORKERS)
        if rng.random() < 0.3:  # a one-block event (a tuple, as the consumer passes it): held, shared or new
            h = (rng.choice(rng.choice(paths) + sorted(b.hashes_of(w))[:3] + [rng.randrange(10_000, 10_050)]),)
            kind = rng.choice(("stored", "removed"))
            getattr(a, kind)(w, h)
            getattr(b, kind)(w, h)
        op = rng.random()
        if op < 0.45:
            hs = rng.choice(paths) + [rng.randrange(10_000, 10_050) for _ in range(rng.randrange(3))]
            a.stored(w, hs)
            b.stored(w, hs)
        elif op < 0.8:
            held = sorted(b.hashes_of(w))
            hs = rng.sample(held, min(len(held), rng.randrange(1, 6))) + [rng.randrange(1 << 64)]
            a.removed(w, iter(hs))
            b.removed(w, iter(hs))
        elif op < 0.88:
            a.clear_worker(w)
            b.clear_worker(w)
        else:
            hs = rng.choice(paths) + sorted(b.hashes_of(w))[: rng.randrange(4)]
            a.replace_worker(w, hs)
            b.replace_worker(w, hs)
        if step % 10 == 0:
            same(a, b, rng, rng.sample(paths, 8) + [[], [123]])
    same(a, b, rng, paths)


def test_full_width_hashes_and_slot_reuse():
    """64-bit hashes, a worker cleared and its slot taken by another, holders narrowing to one."""
    a = PrefixIndex()
    top = (1 << 64) - 1
    a.stored("a", [top, 5])
    a.stored("b", [top, 5, 6])
    a.clear_worker("a")
    a.stored("c", [top])
    assert a.match([top, 5, 6]) == {"b": 3, "c": 1}
    a.removed("b", [top])
    assert a.holders(top) == {"c"} and a.match([top, 5]) == {"c": 1}
    # the mask of a block back to one holder is that worker's shared bit object
    assert a._holders[top] is a._bits[a._slot["c"]]
    a.replace_worker("b", [])
    assert a.workers() == ["c"] and len(a) == 1 and a.blocks_of("b") == 0


def test_match_with_tentative_worker_unknown_to_the_index():
    a = PrefixIndex()
    a.stored("a", [1, 2])
    extra = {1: {"new"}, 2: {"new"}, 3: {"new", "a"}}
    assert a.match([1, 2, 3], extra=extra) == {"a": 3, "new": 3}
    assert a.match([1, 2, 3]) == {"a": 2}
    assert a.workers() == ["a"]  # the tentative-only worker got no slot


@pytest.mark.parametrize("few", [0, 1, 2, 100])
def test_long_chains_leave_the_fleet_map_for_own_sets(few, monkeypatch):
    """Prompts of 300 blocks over a shared head: groups that drop at several lengths, workers that keep
    the whole prompt, and holes past the point where only a few workers are left."""
    monkeypatch.setattr(index_module, "_FEW", few)
    rng = random.Random(few)
    a, b = PrefixIndex(), ReferencePrefixIndex()
    head = list(range(40))
    prompts = [head + [1000 * p + j for j in range(260)] for p in range(4)]
    for i, w in enumerate(WORKERS):
        p = prompts[i % 4]
        held = p[: rng.choice([10, 40, 120, 300])]
        if rng.random() < 0.5:  # a hole further on
            held = [h for h in held if h != rng.choice(held)]
        a.stored(w, held)
        b.stored(w, held)
    for q in prompts + [p[:50] for p in prompts] + [head + [7]]:
        want = b.match(q)
        assert a.match(q) == want
        assert {w: k for k, ws in a.match_levels(q) for w in ws} == want
        assert all(a.prefix_len(w, q) == want.get(w, 0) for w in WORKERS)
