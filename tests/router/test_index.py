"""``PrefixIndex`` (bitset layout) against ``ReferencePrefixIndex`` (the plain dict of sets).

Random event sequences over a small hash space (so blocks are shared, removed while held by
others, re-stored, workers cleared and their slots reused) drive both; after every step each
query must answer the same."""

from __future__ import annotations

import random

import pytest

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
        assert a.match(q) == b.match(q)
        extra = {h: set(rng.sample(WORKERS + ["tentative-only"], rng.randrange(0, 3)))
                 for h in q if rng.random() < 0.4}
        assert a.match(q, extra=extra) == b.match(q, extra=extra)


@pytest.mark.parametrize("seed", range(6))
def test_random_events_match_reference(seed):
    rng = random.Random(seed)
    a, b = PrefixIndex(), ReferencePrefixIndex()
    paths = chains(rng, 40)
    for step in range(400):
        w = rng.choice(WORKERS)
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
