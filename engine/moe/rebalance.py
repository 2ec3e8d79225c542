"""Periodic rebalancing: refit the placement on the sliding window and move weights.

Migration cost: a new slot needs a transfer only when its rank did not hold that
expert before (moving an expert between slots of one rank is a local copy). The
sender is a rank that held the expert, preferring the receiver's node, then the
lowest rank id, so every rank computes the same transfer list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.moe.placement import LayerPlacement, Placement, PlacementPlan
from engine.moe.stats import ExpertStats


def migration_transfers(old: LayerPlacement, new: LayerPlacement) -> list[tuple[int, int, int, int]]:
    """(src rank, dst rank, dst slot within the rank, expert) for every slot of ``new`` whose
    rank lacks the expert in ``old``; sorted by (src, dst, dst slot)."""
    if old.slots_per_rank != new.slots_per_rank or old.topology != new.topology:
        raise ValueError("old and new placements must share the topology and the slots per rank")
    topo = old.topology
    held = [set(old.local_experts(r)) for r in range(topo.world_size)]
    out = []
    for dst in range(topo.world_size):
        for slot, e in enumerate(new.local_experts(dst)):
            if e in held[dst]:
                continue
            holders = [r for r in range(topo.world_size) if e in held[r]]
            src = min(holders, key=lambda r: (topo.node_of(r) != topo.node_of(dst), r))
            out.append((src, dst, slot, e))
    return sorted(out)


def migration_bytes(old: LayerPlacement, new: LayerPlacement, expert_bytes: int) -> int:
    """Bytes of expert weights that cross ranks to go from ``old`` to ``new``."""
    return len(migration_transfers(old, new)) * expert_bytes


def align_slots(old: LayerPlacement, new: LayerPlacement) -> LayerPlacement:
    """``new`` with each rank's slots reordered so experts the rank already holds keep their
    old slot (same experts per rank, so the same plan; fewer local copies)."""
    s = new.slots_per_rank
    out = new.phy2log.clone()
    for r in range(new.world_size):
        before, after = old.local_experts(r), new.local_experts(r)
        slots: list[int | None] = [e if e in after else None for e in before]
        rest = list(after)
        for e in slots:
            if e is not None:
                rest.remove(e)
        slots = [e if e is not None else rest.pop(0) for e in slots]
        out[r * s:(r + 1) * s] = torch.tensor(slots)
    return LayerPlacement(out, new.num_experts, new.topology, new.replica_policy)


@dataclass(frozen=True)
class RebalanceDecision:
    layer: int
    adopted: bool
    old_score: float
    new_score: float
    migration_bytes: int


class Rebalancer:
    """Refit every ``interval`` steps, validating each candidate on fresh statistics.

    ``rebalance(stats)`` first judges the candidate fitted at the previous call: it is
    adopted for a layer only if, on *these* stats (which it was not fitted on), its score
    (the placement's own ``score``, lower is better) beats the layout in force by at least
    ``min_gain`` (relative). Then it fits a new candidate on these stats for next time.
    Scoring a plan on the data it was fitted to would always flatter it and churn weights
    on a stationary workload; the one-interval delay avoids that.
    """

    def __init__(self, placement: Placement, plan: PlacementPlan, interval: int, expert_bytes: int, min_gain: float = 0.05):
        if interval < 1:
            raise ValueError(f"interval must be >= 1 step, got {interval}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        self.placement, self.plan, self.interval = placement, plan, interval
        self.expert_bytes, self.min_gain = expert_bytes, min_gain
        self.total_migration_bytes = 0
        self._candidates: list[LayerPlacement] | None = None

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def rebalance(self, stats: Sequence[ExpertStats],
                  migrate: Callable[[int, LayerPlacement], None] | None = None) -> list[RebalanceDecision]:
        """Judge the pending candidates on ``stats`` (per layer), adopt the winners (calling
        ``migrate(layer, new)``, e.g. ``ExpertParallelMoE.migrate``), refit candidates."""
        if len(stats) != len(self.plan):
            raise ValueError(f"got stats for {len(stats)} layers, the plan has {len(self.plan)}")
        decisions, layers = [], list(self.plan.layers)
        for i, st in enumerate(stats):
            old = layers[i]
            new = self._candidates[i] if self._candidates is not None else old
            old_score, new_score = self.placement.score(old, st), self.placement.score(new, st)
            adopt = new is not old and new_score < old_score * (1.0 - self.min_gain)
            moved = migration_bytes(old, new, self.expert_bytes) if adopt else 0
            if adopt:
                if migrate is not None:
                    migrate(i, new)
                layers[i] = new
            self.total_migration_bytes += moved
            decisions.append(RebalanceDecision(i, adopt, old_score, new_score, moved))
        self.plan = PlacementPlan(layers)
        self._candidates = [align_slots(lp, self.placement.fit_layer(st, lp.topology)) for lp, st in zip(layers, stats)]
        return decisions
