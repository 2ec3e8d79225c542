"""Routing statistics, migration accounting, rebalancing, trace import."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.moe_traces import load_topk_dump, save_npz, structured_trace
from engine.moe.config import Topology
from engine.moe.placement import LayerPlacement, PlacementPlan, get_placement
from engine.moe.rebalance import Rebalancer, align_slots, migration_bytes, migration_transfers
from engine.moe.stats import ExpertStats, SlidingWindowStats

TOPO = Topology(nodes=2, ranks_per_node=2)


def test_stats_counts():
    ids = torch.tensor([[0, 1], [1, 2], [0, 1]])
    st = ExpertStats.from_topk(ids, torch.tensor([0, 1, 1]), num_experts=4, world_size=2)
    assert st.source.tolist() == [[1, 1, 0, 0], [1, 2, 1, 0]]
    assert st.load.tolist() == [2, 3, 1, 0]
    assert st.coact[0, 1] == 2 and st.coact[1, 2] == 1 and st.coact[0, 2] == 0
    assert torch.equal(st.coact, st.coact.T) and float(st.coact.diagonal().abs().sum()) == 0
    with pytest.raises(ValueError, match="expert ids"):
        ExpertStats.from_topk(torch.tensor([[4, 0]]), torch.tensor([0]), 4, 2)


def test_sliding_window_forgets_old_steps():
    w = SlidingWindowStats(num_layers=1, num_experts=4, world_size=2, window=2, sample_per_step=1)
    for e in (0, 1, 2):
        w.record(0, torch.tensor([[e, 3]]), 0)
        w.advance()
    snap = w.snapshot(0)
    assert snap.load.tolist() == [0, 0, 1, 1]  # window = the open step + 1 closed step
    w.record(0, torch.tensor([[0, 3]] * 5), 1)
    snap = w.snapshot(0)
    assert snap.tokens == 6 and snap.load.tolist() == [5, 0, 1, 6]
    assert snap.source[1].tolist() == [5, 0, 0, 5]
    assert len(snap.sample_ids) == 2  # one sampled token per record


def test_migration_bytes_count_slots_that_change_rank():
    old = LayerPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), 8, TOPO)
    same_rank_shuffle = LayerPlacement(torch.tensor([1, 0, 3, 2, 5, 4, 7, 6]), 8, TOPO)
    assert migration_bytes(old, same_rank_shuffle, expert_bytes=100) == 0
    swapped = LayerPlacement(torch.tensor([0, 4, 2, 3, 1, 5, 6, 7]), 8, TOPO)  # 1 <-> 4 across nodes
    assert migration_bytes(old, swapped, expert_bytes=100) == 200
    assert migration_transfers(old, swapped) == [(0, 2, 0, 1), (2, 0, 1, 4)]
    # expert 0 lives on ranks 0 and 3: rank 2 fetches it from rank 3, its own node
    old = LayerPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 0]), 7, TOPO)
    new = LayerPlacement(torch.tensor([6, 1, 2, 3, 0, 5, 4, 0]), 7, TOPO)
    assert migration_transfers(old, new) == [(2, 3, 0, 4), (3, 0, 0, 6), (3, 2, 0, 0)]
    assert migration_bytes(old, new, expert_bytes=10) == 30


def test_align_slots_keeps_resident_experts_in_place():
    old = LayerPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), 8, TOPO)
    new = LayerPlacement(torch.tensor([5, 0, 3, 2, 4, 1, 7, 6]), 8, TOPO)
    aligned = align_slots(old, new)
    assert aligned.phy2log.tolist() == [0, 5, 2, 3, 4, 1, 6, 7]


@pytest.mark.slow
def test_rebalancer_validates_candidates_before_adopting():
    trace = structured_trace("s", 1, 4096, 16, 4, 4, seed=9)
    first, second = (t.stats() for t in trace.halves())
    placement = get_placement("locality", num_redundant=4, max_evals=300)
    start = PlacementPlan([LayerPlacement(torch.arange(20) % 16, 16, TOPO, "locality")])
    reb = Rebalancer(placement, start, interval=2, expert_bytes=1000)
    assert not reb.rebalance(first)[0].adopted  # no candidate yet: fit one
    moved = []
    decision = reb.rebalance(second, migrate=lambda i, lp: moved.append((i, lp)))[0]
    assert decision.adopted and decision.new_score < 0.95 * decision.old_score
    assert moved and moved[0][1] is reb.plan[0]
    assert decision.migration_bytes == 1000 * len(migration_transfers(start[0], reb.plan[0])) > 0
    again = reb.rebalance(second)[0]  # nothing changed: the refit equals the plan, no churn
    assert not again.adopted and again.migration_bytes == 0
    assert reb.total_migration_bytes == decision.migration_bytes
    assert not reb.due(0) and reb.due(4) and not reb.due(5)


def test_trace_dump_round_trip(tmp_path):
    trace = structured_trace("s", 2, 64, 16, 2, 4, seed=1)
    save_npz(trace, tmp_path / "t.npz")
    back = load_topk_dump(tmp_path / "t.npz", world_size=4)
    assert torch.equal(back.topk_ids, trace.topk_ids) and torch.equal(back.src_rank, trace.src_rank)
    assert back.num_experts == 16
    lines = [json.dumps({"token": t, "layer": l, "src_rank": int(trace.src_rank[t]),
                         "topk_ids": trace.topk_ids[l, t].tolist()}) for t in range(64) for l in range(2)]
    (tmp_path / "t.jsonl").write_text("\n".join(reversed(lines)))
    back = load_topk_dump(tmp_path / "t.jsonl", world_size=4, num_experts=16)
    assert torch.equal(back.topk_ids, trace.topk_ids) and torch.equal(back.src_rank, trace.src_rank)
    (tmp_path / "bad.jsonl").write_text('{"token": 0, "layer": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_topk_dump(tmp_path / "bad.jsonl", world_size=4)
