"""``AgentrtPolicy.select_fleet`` (candidates from a kept ``AgentrtFleet``) against ``select`` (every
worker's ``WorkerState``), the reference: random fleets and request streams, with ties everywhere
(equal loads, equal recent work, equal cached prefixes, equal costs), tier pricing, overloaded
workers (some, all), session last workers (live, overloaded, unknown), workers joining, leaving and
changing load between decisions, and the policy's recent-work renormalisation. Every decision must
be the same worker, cached blocks and reason."""

from __future__ import annotations

import math
import random

import pytest

import router.policies.agentrt as agentrt
from router.policies.agentrt import AgentrtFleet, AgentrtPolicy
from router.policy import Fleet, NoWorkerAvailable, RouteRequest, WorkerState, make_policy

BS = 16


def random_params(rng: random.Random) -> dict:
    host = rng.choice([0.0, 0.01, 0.05])
    return {
        "load_weight": rng.choice([0.1, 0.1, 0.0, 1e-12, 2.0]),
        "overload_rel": rng.choice([1.0, 1.5, 3.0]),
        "overload_abs_tokens": rng.choice([0.0, 5_000.0, 131072.0]),
        "affinity_min_fraction": rng.choice([0.0, 0.5, 0.9, 1.0]),
        "min_match_tokens": rng.choice([0, 64, 1024]),
        "min_match_fraction": rng.choice([0.0, 0.25, 1.0]),
        "tokens_per_queued_request": rng.choice([0.0, 4096.0, 1000.5]),
        "recent_work_half_life": rng.choice([0, 1, 3, 2000]),
        "decode_token_weight": rng.choice([0.0, 10.0]),
        "host_load_weight": host,
        "disk_load_weight": rng.choice([host, 0.05, 1.0]),
        "tentative_load_weight": rng.choice([0.5, 0.0, 1.0, 3.0]),
    }


def random_state(rng: random.Random, wid: str, flat: bool = False) -> WorkerState:
    """A worker's load state; ``flat``: every worker at the same load (idle or all equally busy), so
    loads sit exactly on the overload bound when ``overload_rel`` is 1 and ``overload_abs_tokens`` 0."""
    if flat:
        return WorkerState(wid, 0, 0, 0, rng.randrange(50), rng.randrange(50), 0, 0.0)
    tokens = rng.choice([0.0, 0.0, -0.0, 4096.0, 8192.0, 1e-300, 0.1, 0.2, 0.30000000000000004,
                         rng.uniform(0, 60_000), rng.uniform(0, 1e6), float(rng.randrange(0, 200_000))])
    return WorkerState(wid, 0, rng.choice([0, 0, 1, 2, 7]), rng.choice([0, 0, 1, 3]), rng.randrange(50),
                       rng.randrange(50), rng.randrange(4), tokens)


def random_match(rng: random.Random, ids: list[str],
                 n_blocks: int) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    matched, tiers = {}, {}
    if ids and rng.random() < 0.85:
        levels = [rng.randrange(1, n_blocks + 3) for _ in range(3)]  # few levels: equal prefixes
        for wid in rng.sample(ids, rng.randrange(0, len(ids) + 1)):
            k = rng.choice(levels)  # may exceed the prompt (a match counts at most the prompt)
            matched[wid] = k
            host = rng.randrange(0, k + 1) if rng.random() < 0.3 else 0
            disk = rng.choice([0, k - host, rng.randrange(0, k - host + 1)]) if rng.random() < 0.4 else 0
            tiers[wid] = (host, disk)
    if rng.random() < 0.2:
        matched["not-in-fleet"] = 5  # the index may know a worker the router does not route to
    return matched, tiers


def levels(matched: dict[str, int], rng: random.Random) -> list[tuple[int, list[str]]] | None:
    """``matched`` grouped by length as ``PrefixIndex.match_levels`` gives it, or None (the policy groups)."""
    if rng.random() < 0.3:
        return None
    by_k: dict[int, list[str]] = {}
    for wid, k in matched.items():
        by_k.setdefault(k, []).append(wid)
    return sorted(by_k.items())


def reference_states(fleet: Fleet, matched: dict[str, int], tiers: dict[str, tuple[int, int]],
                     rng: random.Random) -> list[WorkerState]:
    ids = list(fleet)
    rng.shuffle(ids)  # ``select`` must not depend on the workers' order either
    return [fleet.state(wid, matched.get(wid, 0), tiers.get(wid)) for wid in ids]


def check_stream(seed: int, decisions: int) -> dict[str, int]:
    rng = random.Random(seed)
    params = random_params(rng)
    flat = rng.random() < 0.3
    if flat and rng.random() < 0.7:
        params.update(overload_rel=1.0, overload_abs_tokens=0.0)  # the bound is the mean: every load on it
    policy = AgentrtPolicy(**params)
    fleet = policy.new_fleet()
    names = [f"w{i}" for i in range(rng.randrange(1, 40))] + ["a", "zz", "w"]
    for wid in rng.sample(names, rng.randrange(1, len(names) + 1)):
        fleet.update(random_state(rng, wid, flat))
    reasons: dict[str, int] = {}
    for k in range(decisions):
        for _ in range(rng.choice([0, 0, 1, 3])):  # the fleet changes between decisions
            op = rng.random()
            wid = rng.choice(names)
            if op < 0.6:
                fleet.update(random_state(rng, wid, flat))
            elif op < 0.8 and len(fleet) > 1:
                fleet.remove(wid)
                policy.on_worker_removed(wid)
            elif op < 0.9 and wid in fleet and not flat:  # its in-flight work grows: same worker, new load
                s = fleet.state(wid)
                fleet.update(s._replace(in_flight=s.in_flight + 1, in_flight_tokens=s.in_flight_tokens + 500.0))
            else:  # a state whose load does not change (only pages)
                if wid in fleet:
                    fleet.update(fleet.state(wid)._replace(pages_free=rng.randrange(99)))
        ids = list(fleet)
        n_blocks = rng.randrange(0, 40)
        num_tokens = max(0, n_blocks * BS - rng.randrange(0, BS))
        matched, tiers = random_match(rng, ids, n_blocks)
        last = rng.choice([None, None, rng.choice(ids), "gone"])
        req = RouteRequest(str(k), tuple(range(n_blocks)), num_tokens, BS, session_id=last and "s",
                           last_worker=last, est_output_tokens=rng.randrange(0, 300),
                           known_blocks=rng.choice([None, None, 0, rng.randrange(0, n_blocks + 1)]))
        want = policy.select(req, reference_states(fleet, matched, tiers, rng))
        got, weighed = policy.select_fleet(req, fleet, matched, tiers, levels(matched, rng))
        assert got == want, (seed, k, want, got)
        chosen = next(s for s in weighed if s.worker_id == got.worker_id)  # the chosen one as the policy saw it
        assert chosen.cached_blocks == got.cached_blocks and len({s.worker_id for s in weighed}) == len(weighed)
        reasons[got.reason] = reasons.get(got.reason, 0) + 1
        policy.on_dispatch(req, want)
        if rng.random() < 0.01:
            policy._scale = 1e199  # renormalisation soon: every recent-work key changes at once
    return reasons


@pytest.mark.parametrize("small", ["default", "walk", "enumerate"])
@pytest.mark.parametrize("seed", range(60))
def test_fleet_path_decides_as_the_full_path(seed, small, monkeypatch):
    """Large groups are walked in load order, small ones read member by member: both ways, every group."""
    if small != "default":
        monkeypatch.setattr(agentrt, "_small", lambda live, size: small == "enumerate")
    check_stream(seed, 150)


def test_every_rule_is_exercised():
    seen: dict[str, int] = {}
    for seed in range(100, 130):
        for reason, n in check_stream(seed, 100).items():
            seen[reason] = seen.get(reason, 0) + n
    assert {"affinity", "fallback", "prefix", "cost", "spill"} <= set(seen), seen


def test_idle_fleet_ties_rotate_by_recent_work_and_id():
    """Every worker idle (one big load tie): rule 3 walks (recent work, id) order like ``select``."""
    policy = AgentrtPolicy(min_match_tokens=64, recent_work_half_life=100)
    fleet = policy.new_fleet()
    ids = [f"w{i:03d}" for i in range(200)]
    random.Random(1).shuffle(ids)
    for wid in ids:
        fleet.update(WorkerState(wid))
    picks = []
    for i in range(450):
        req = RouteRequest(str(i), (), 2_000 + i, BS)
        want = policy.select(req, [fleet.state(w) for w in fleet])
        got, weighed = policy.select_fleet(req, fleet, {})
        assert got == want and got.reason == "fallback"
        assert got.worker_id in [s.worker_id for s in weighed] and len(weighed) <= 2  # a few, not 200
        policy.on_dispatch(req, got)
        picks.append(got.worker_id)
    assert len(set(picks[:200])) == 200  # the first round spreads over every idle worker


def test_load_sum_is_the_exactly_rounded_sum():
    rng = random.Random(7)
    policy = AgentrtPolicy(tokens_per_queued_request=0.0)
    fleet = policy.new_fleet()
    loads = {}
    for i in range(3000):
        wid = f"w{rng.randrange(300)}"
        if rng.random() < 0.2:
            fleet.remove(wid)
            loads.pop(wid, None)
        else:
            x = rng.choice([rng.uniform(0, 1e6), rng.uniform(0, 1e-3) * 10 ** rng.randrange(-300, 300),
                            0.1, 1e16, 1.0, 5e-324])
            fleet.update(WorkerState(wid, in_flight_tokens=x))
            loads[wid] = x
        assert fleet.load_sum() == math.fsum(loads.values())


def test_a_fleet_ignores_cached_blocks_and_others_use_the_default_path():
    fleet = Fleet()
    fleet.update(WorkerState("b", cached_blocks=9, running=1, host_blocks=3))
    fleet.update(WorkerState("a"))
    assert fleet.state("b") == WorkerState("b", running=1) and list(fleet) == ["b", "a"]
    assert fleet.state("b", 4, (1, 2)) == WorkerState("b", 4, running=1, host_blocks=1, disk_blocks=2)
    rr = make_policy("round_robin")
    assert rr.new_fleet() is None
    decision, weighed = rr.select_fleet(RouteRequest("r", (1,), 16, BS), fleet, {"a": 1})
    assert decision.worker_id == "a" and [s.cached_blocks for s in weighed] == [0, 1]  # id order, cached as matched
    agentrt = AgentrtPolicy()
    assert agentrt.select_fleet(RouteRequest("r", (1,), 16, BS), fleet, {"a": 1})[0].worker_id == "a"
    with pytest.raises(NoWorkerAvailable):
        agentrt.select_fleet(RouteRequest("r", (), 0, BS), agentrt.new_fleet(), {})
    assert isinstance(agentrt.new_fleet(), AgentrtFleet)
