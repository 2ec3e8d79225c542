"""Placements: invariants, replica choice, load cap, locality's traffic advantage."""

from __future__ import annotations

import pytest
import torch

from benchmarks.moe_traces import control_trace, structured_trace
from engine.moe.config import Topology
from engine.moe.placement import expected_load, simulate_dispatch
from engine.moe.placement import LayerPlacement, get_placement, placement_names

TOPO = Topology(nodes=2, ranks_per_node=2)


@pytest.fixture(scope="module")
def structured():
    return structured_trace("s", 1, 4096, 16, 4, 4, seed=3)


@pytest.fixture(scope="module")
def control():
    return control_trace("c", 1, 4096, 16, 4, 4, seed=4)


def _fit(name, trace, redundant=4, **kw):
    if name == "locality":
        kw.setdefault("max_evals", 800)
    fit, measured = trace.halves()
    return get_placement(name, num_redundant=redundant, **kw).fit_layer(fit.stats()[0], TOPO), measured


@pytest.mark.parametrize("name", ["contiguous", "balanced", pytest.param("locality", marks=pytest.mark.slow)])
def test_plan_invariants(name, structured):
    layer, _ = _fit(name, structured)
    assert layer.phy2log.numel() == 20 and layer.slots_per_rank == 5
    assert int(layer.replica_count.min()) >= 1 and int(layer.replica_count.sum()) == 20
    for e in range(16):  # log2phy and phy2log agree
        slots = layer.log2phy[e][layer.log2phy[e] >= 0]
        assert len(slots) == int(layer.replica_count[e])
        assert torch.all(layer.phy2log[slots] == e)


def test_registry_and_bad_settings():
    assert placement_names() == ["contiguous", "balanced", "locality"]
    with pytest.raises(ValueError, match="unknown placement"):
        get_placement("random")
    with pytest.raises(ValueError, match="multiple of the world size"):
        get_placement("balanced", num_redundant=3).slots_per_rank(16, TOPO)
    with pytest.raises(ValueError, match="at least one slot"):
        LayerPlacement(torch.tensor([0, 1, 1, 2]), 4, TOPO)


def test_contiguous_is_id_order(structured):
    layer, _ = _fit("contiguous", structured)
    assert layer.phy2log.tolist() == list(range(16)) + [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["balanced", pytest.param("locality", marks=pytest.mark.slow)])
def test_load_within_cap(name, structured):
    layer, measured = _fit(name, structured)
    fit_load = expected_load(layer, structured.halves()[0].stats()[0])
    assert fit_load.max() / fit_load.mean() <= 1.15 + 1e-6
    load = simulate_dispatch(layer, measured.topk_ids[0], measured.src_rank)["load"]
    assert load.max() / load.mean() <= 1.25


def test_balanced_replicates_hottest_expert(structured):
    layer, _ = _fit("balanced", structured)
    load = structured.halves()[0].stats()[0].load
    hottest = int(load.argmax())
    assert int(layer.replica_count[hottest]) >= 2
    assert int(layer.replica_count[int(load.argmin())]) == 1


def test_locality_replica_choice_prefers_rank_then_node():
    # expert 0 on ranks 0 (slot 0), 1 (slot 3) and 3 (slot 9); 3 slots per rank.
    phy = torch.tensor([0, 1, 2, 0, 3, 4, 5, 6, 7, 0, 1, 2])
    layer = LayerPlacement(phy, 8, TOPO, "locality")
    ids = torch.zeros(64, 1, dtype=torch.long)
    assert set(layer.choose_replica(ids, 0).flatten().tolist()) == {0}  # same rank
    assert set(layer.choose_replica(ids, 3).flatten().tolist()) == {9}
    assert set(layer.choose_replica(ids, 2).flatten().tolist()) == {9}  # same node
    # no replica of expert 5 in rank 1's node -> the only one, on rank 2
    assert set(layer.choose_replica(torch.full((8, 1), 5), 1).flatten().tolist()) == {6}
    hashed = LayerPlacement(phy, 8, TOPO, "hash").choose_replica(ids, 0, torch.arange(64)).flatten()
    counts = torch.bincount(hashed, minlength=12)[[0, 3, 9]]
    assert int(counts.min()) >= 10  # hash spreads over all three replicas


def test_locality_source_per_token():
    phy = torch.tensor([0, 1, 2, 0, 3, 4, 5, 6, 7, 0, 1, 2])
    layer = LayerPlacement(phy, 8, TOPO, "locality")
    src = torch.tensor([0, 1, 2, 3])
    assert layer.choose_replica(torch.zeros(4, 1, dtype=torch.long), src).flatten().tolist() == [0, 3, 9, 9]


def _bytes(layer, trace):
    sim = simulate_dispatch(layer, trace.topk_ids[0], trace.src_rank)
    return sim["rows_off_rank"] / sim["tokens"]


@pytest.mark.slow
def test_locality_sends_fewer_rows_on_structured_trace(structured, control):
    for trace, margin in ((structured, 0.85), (control, 1.03)):
        bal, measured = _fit("balanced", trace)
        loc, _ = _fit("locality", trace)
        assert _bytes(loc, measured) <= margin * _bytes(bal, measured), trace.name


@pytest.mark.slow
def test_locality_is_deterministic(structured):
    a, _ = _fit("locality", structured)
    b, _ = _fit("locality", structured)
    assert torch.equal(a.phy2log, b.phy2log)
