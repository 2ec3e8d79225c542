"""Routing policies and the prefix index: affinity, hot-prefix spill, fallback, baselines."""

from __future__ import annotations

import pytest

from router.index import PrefixIndex
from router.policy import (NoWorkerAvailable, RouteRequest, WorkerState, make_policy,
                           policy_names)


def req(n_blocks, session=None, last=None, block=16, rid="r", prefix=0):
    hashes = tuple(range(prefix, prefix + n_blocks))
    return RouteRequest(rid, hashes, n_blocks * block, block, session_id=session, last_worker=last)


def workers(cached=None, load=None, ids=("w0", "w1", "w2", "w3")):
    cached, load = cached or {}, load or {}
    return [WorkerState(w, cached_blocks=cached.get(w, 0), in_flight=int(load.get(w, 0) > 0),
                        in_flight_tokens=load.get(w, 0.0)) for w in ids]


def test_index_match_is_contiguous_per_worker():
    index = PrefixIndex()
    index.stored("a", [1, 2, 3])
    index.stored("b", [1, 3])  # holds block 3 but not 2: only a 1-block prefix
    index.stored("c", [2, 3])  # no block 0: nothing
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    index.removed("a", [2, 99])
    assert index.match([1, 2, 3]) == {"a": 1, "b": 1}
    index.clear_worker("b")
    assert index.holders(1) == {"a"} and index.blocks_of("b") == 0
    index.replace_worker("a", [7])
    assert index.match([1]) == {} and index.match([7]) == {"a": 1} and len(index) == 3  # 7 (a), 2 and 3 (c)


def test_registry_knows_all_policies():
    assert policy_names() == ["round_robin", "least_load", "session_hash", "sglang_like", "agentrt"]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="overload_rel"):
        make_policy("agentrt", overload_rel=0.5)
    for name in policy_names():
        with pytest.raises(NoWorkerAvailable):
            make_policy(name).select(req(4), [])


def test_agentrt_prefers_the_prefix_holder():
    p = make_policy("agentrt")
    d = p.select(req(200), workers(cached={"w0": 1, "w1": 1, "w2": 150, "w3": 1}))
    assert (d.worker_id, d.reason) == ("w2", "prefix")


def test_agentrt_session_affinity_is_soft():
    p = make_policy("agentrt", overload_abs_tokens=10_000)
    r = req(100, session="s", last="w1")
    # The last worker holds the prefix: it wins even against a slightly longer match elsewhere.
    d = p.select(r, workers(cached={"w1": 95, "w3": 100}))
    assert (d.worker_id, d.reason) == ("w1", "affinity")
    # It lost most of the prefix (evicted): the holder wins instead.
    d = p.select(r, workers(cached={"w1": 10, "w3": 100}))
    assert d.worker_id == "w3"
    # Overloaded: affinity yields, the session moves to the next best.
    d = p.select(r, workers(cached={"w1": 95, "w3": 80}, load={"w1": 50_000}))
    assert d.worker_id == "w3"


def test_agentrt_hot_prefix_spills_when_holder_overloaded():
    p = make_policy("agentrt", overload_abs_tokens=8_000, overload_rel=1.5)
    r = req(400)  # a fleet's long tools prompt, 6400 tokens
    calm = p.select(r, workers(cached={"w0": 400}, load={"w0": 2_000, "w1": 500}))
    assert calm.worker_id == "w0"
    hot = p.select(r, workers(cached={"w0": 400}, load={"w0": 40_000, "w1": 500, "w2": 900, "w3": 700}))
    assert (hot.worker_id, hot.reason) == ("w1", "fallback")
    # Once a second worker holds it too, the load decides between the holders.
    two = p.select(r, workers(cached={"w0": 400, "w2": 400},
                              load={"w0": 40_000, "w1": 500, "w2": 900, "w3": 700}))
    assert (two.worker_id, two.reason) == ("w2", "spill")


def test_agentrt_short_match_falls_back_to_least_loaded_rotating():
    p = make_policy("agentrt", min_match_tokens=64)
    r = req(50)
    d = p.select(r, workers(cached={"w0": 2, "w1": 2, "w2": 2, "w3": 2}, load={"w0": 10, "w1": 5}))
    assert (d.reason, d.worker_id) == ("fallback", "w2")
    picks = []
    for i in range(4):  # equal loads: new prefixes rotate instead of piling on one id
        d = p.select(req(50, rid=str(i)), workers())
        p.on_dispatch(r, d)
        picks.append(d.worker_id)
    assert sorted(picks) == ["w0", "w1", "w2", "w3"]


def test_agentrt_idle_ties_go_to_the_worker_with_least_recent_work():
    p = make_policy("agentrt", min_match_tokens=64, recent_work_half_life=100)
    heavy = RouteRequest("h", (), 20_000, 16, est_output_tokens=500)   # 20,000 + 10 * 500 tokens of work
    light = RouteRequest("l", (), 1_000, 16)
    p.on_dispatch(heavy, p.select(heavy, workers()))                 # w0 (rotation starts there)
    assert p.recent_work("w0") == 25_000
    p.on_dispatch(light, p.select(light, workers()))
    p.on_dispatch(light, p.select(light, workers()))
    p.on_dispatch(light, p.select(light, workers()))                 # w1, w2, w3: 1,000 each
    picks = []
    for i in range(6):  # every worker idle: new sessions avoid w0 until its lead has decayed
        d = p.select(req(50, rid=str(i)), workers())
        assert d.reason == "fallback"
        p.on_dispatch(req(50, rid=str(i)), d)
        picks.append(d.worker_id)
    assert "w0" not in picks and sorted(set(picks)) == ["w1", "w2", "w3"]
    # Work decays with dispatches (half-life 100) and leaves with the worker.
    assert 25_000 * 0.5 ** (9 / 100) == pytest.approx(p.recent_work("w0"))
    p.on_worker_removed("w0")
    assert p.recent_work("w0") == 0.0
    # Load still comes first: a busy worker with no recent work is not chosen over idle ones.
    d = p.select(req(50), workers(load={"w0": 1.0}, ids=("w0", "w1")))
    assert d.worker_id == "w1"
    with pytest.raises(ValueError, match="recent_work_half_life"):
        make_policy("agentrt", recent_work_half_life=-1)


def test_round_robin_least_load_session_hash():
    rr = make_policy("round_robin")
    picks = []
    for _ in range(5):
        d = rr.select(req(4), workers())
        rr.on_dispatch(req(4), d)
        picks.append(d.worker_id)
    assert picks == ["w0", "w1", "w2", "w3", "w0"]
    ll = make_policy("least_load")
    assert ll.select(req(4), workers(load={"w0": 9, "w1": 9, "w3": 9})).worker_id == "w2"
    sh = make_policy("session_hash")
    first = sh.select(req(4, session="abc"), workers()).worker_id
    assert all(sh.select(req(9, session="abc"), workers()).worker_id == first for _ in range(3))
    others = [w for w in ("w0", "w1", "w2", "w3") if w != first]
    # Rendezvous hashing: removing another worker never moves the session.
    assert sh.select(req(4, session="abc"), workers(ids=[first, others[0]])).worker_id == first


def test_sglang_like_cache_threshold_and_balance():
    p = make_policy("sglang_like", balance_abs_threshold=2, balance_rel_threshold=1.5)
    ws = workers(ids=("w0", "w1"))
    first = p.select(req(10), ws)
    assert first.reason == "smallest_tree"
    p.on_dispatch(req(10), first)
    # Same prefix, matched 10/12 > 0.3: cache wins.
    again = p.select(req(12), ws)
    assert (again.worker_id, again.reason) == (first.worker_id, "cache")
    # A prompt matching < 30% goes to the smaller tree.
    other = p.select(req(10, prefix=100), ws)
    assert other.worker_id != first.worker_id and other.reason == "smallest_tree"
    # Pile 3 in-flight requests on the holder: imbalance (3 - 0 > 2, 3 > 1.5 * 0) wins over cache.
    for i in range(3):
        p.on_dispatch(req(10, rid=str(i)), again)
    assert p.select(req(12), ws).reason == "balance"
    for i in range(3):
        p.on_complete(req(10, rid=str(i)), again.worker_id)
    assert p.select(req(12), ws).reason == "cache"


def test_agentrt_prices_a_tentative_holders_queue_higher():
    """A burst of new sessions sharing an agent prompt: the holder only tentatively holds it (dispatched,
    not reported), so its queue is priced at ``tentative_load_weight`` and the request goes to a less
    loaded worker; the same match known from KV events (or a caller that says nothing) keeps it."""
    p = make_policy("agentrt")
    hashes = tuple(range(74))  # 1182 tokens: a 1008-token agent prompt (63 blocks), then the turn

    def decide(known):
        r = RouteRequest("r", hashes, 1182, 16, est_output_tokens=16, known_blocks=known)
        return p.select(r, [WorkerState("a", 63, in_flight_tokens=6000.0), WorkerState("b", 0, in_flight_tokens=3000.0)])

    # tentative: a = 174 + 0.5 * 6000 = 3174, b = 1182 + 0.5 * 3000 = 2682
    assert (decide(0).worker_id, decide(0).reason) == ("b", "cost")
    assert decide(62).worker_id == "b"  # the index knows less than the best match: still tentative
    # known: a = 174 + 0.1 * 6000 = 774, b = 1182 + 300 = 1482
    assert (decide(63).worker_id, decide(63).reason) == ("a", "prefix")
    assert decide(None).worker_id == "a"
    with pytest.raises(ValueError, match="known_blocks"):
        RouteRequest("r", hashes, 1182, 16, known_blocks=75)
    with pytest.raises(ValueError, match="tentative_load_weight"):
        make_policy("agentrt", tentative_load_weight=-1)
